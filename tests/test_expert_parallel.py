"""Expert parallelism for the K3 LatentMoE: 2 ranks over gloo on CPU against one process holding every expert.

Each rank feeds different tokens. The dense reference (one process, all experts, both ranks' tokens in one batch) must
give the same outputs, input gradients and parameter gradients (≤ 1e-5, fp32); then three DeepSpeed ZeRO-2 steps with
world 2 / expert_parallel 2 must track a single-rank run's losses (≤ 1e-4) and end at the same weights.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from sandforge.config import ModelConfig
from sandforge.job.fleet.lifecycle import free_port
from sandforge.types import TrainingRow

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "terminal.yaml"
D = 32
MODEL = ModelConfig(arch="k3", preset="k3-nano", tokenizer="bytes",
                    k3=dict(d_model=32, n_heads=2, head_dim=16, d_ff=32, d_expert=16, n_experts=4))


def launch(fn, world: int, *args):
    """Start fn(rank, world, port, *args) in ``world`` fresh processes; ``collect`` waits for what each returns."""
    out = Path(tempfile.mkdtemp(prefix=f"ep-{fn.__name__}-"))
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_run, args=(fn, r, world, port, str(out), args)) for r in range(world)]
    for p in procs:
        p.start()
    return fn.__name__, procs, out


def collect(launched) -> list:
    name, procs, out = launched
    for p in procs:
        p.join(timeout=300)
    results = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
        path = out / f"rank{r}.pkl"
        assert path.exists(), f"rank {r} of {name} died (exit code {p.exitcode})"
        result = pickle.loads(path.read_bytes())
        if isinstance(result, BaseException):
            raise result
        results.append(result)
    shutil.rmtree(out, ignore_errors=True)
    return results


def _run(fn, rank: int, world: int, port: int, out: str, args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        result = fn(rank, world, port, *args)
    except BaseException:  # noqa: BLE001 - handed to the test process
        import traceback

        result = RuntimeError(f"rank {rank}: {traceback.format_exc()}")
    if dist.is_initialized():
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


# ---- one layer and one whole model, no DeepSpeed ---------------------------------------------------------------------


def make_moe():
    from sandforge.models.k3.latent_moe import LatentMoE

    torch.manual_seed(0)
    moe = LatentMoE(D, n_experts=8, top_k=3, n_shared=1, d_expert=24)
    with torch.no_grad():
        moe.bias.copy_(torch.randn(8) * 0.1)
        moe.norm.weight.copy_(torch.rand(moe.latent_dim) + 0.5)
    return moe


def layer_inputs():
    """Both ranks' tokens (different lengths of real tokens), a loss projection, and forced expert ids."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, D, generator=g)  # [rank, B, T, D]
    mask = torch.ones(2, 3, 5, dtype=torch.bool)
    mask[1, :, :2] = False  # rank 1 has left padding
    w = torch.randn(2, 3, 5, D, generator=g)
    forced = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(2 * 3 * 5)]).view(2, 3, 5, 3)
    return x, mask, w, forced


def make_model():
    from sandforge.models.build import build_policy

    torch.manual_seed(0)
    return build_policy(MODEL, 96)


def model_inputs():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 96, (2, 2, 9), generator=g)  # [rank, B, T]
    w = torch.randn(2, 2, 9, 96, generator=g) / 1000  # keeps the gradients O(1), so 1e-5 is a real bound
    return ids, w


def grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def ep_worker(rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist

    from sandforge.models.k3.expert_parallel import full_state_dict, shard_experts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}

    moe = make_moe()
    shard_experts(moe, dist.group.WORLD)
    out["expert_keys"] = sorted(k for k in moe.state_dict() if k.startswith("experts."))
    x, mask, w, forced = layer_inputs()
    xr = x[rank].clone().requires_grad_(True)
    moe.train()
    res = moe(xr, mask[rank])
    (res.y * w[rank]).sum().backward()
    out["y"], out["ids"], out["x_grad"], out["grads"] = res.y.detach(), res.expert_ids, xr.grad, grads(moe)
    moe.reduce_stats(dist.all_reduce)
    moe.update_bias()
    out["bias"] = moe.bias.clone()
    moe.eval()
    with torch.no_grad():
        out["forced_y"] = moe(x[rank], forced_ids=forced[rank]).y
        out["replay_y"] = moe(x[rank], forced_ids=res.expert_ids).y  # the recorded ids, under the updated bias
        out["own_y"] = moe(x[rank]).y  # routing by the updated (identical on both ranks) bias

    model = make_model()
    shard_experts(model, dist.group.WORLD)
    ids, w = model_inputs()
    model.train()
    result = model(ids[rank])
    (result.logits * w[rank]).sum().backward()
    out["logits"], out["router_ids"], out["model_grads"] = result.logits.detach(), result.router_ids, grads(model)
    model.eval()
    with torch.no_grad():
        out["replayed_logits"] = model(ids[rank], forced_ids=result.router_ids).logits
    out["full_state"] = full_state_dict(model)
    return out


@pytest.fixture(scope="module")
def ep_run():
    return collect(launch(ep_worker, 2))


def dense_layer():
    moe = make_moe()
    x, mask, w, forced = layer_inputs()
    xs = x.reshape(6, 5, D).clone().requires_grad_(True)  # both ranks' tokens in one batch
    moe.train()
    res = moe(xs, mask.reshape(6, 5))
    (res.y * w.reshape(6, 5, D)).sum().backward()
    return moe, xs, res, forced


def test_layer_forward_and_backward_match_the_dense_layer(ep_run):
    moe, xs, res, _ = dense_layer()
    dense = grads(moe)
    for rank, out in enumerate(ep_run):
        rows = slice(3 * rank, 3 * rank + 3)
        assert torch.equal(out["ids"], res.expert_ids[rows])
        torch.testing.assert_close(out["y"], res.y[rows].detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(out["x_grad"], xs.grad[rows], atol=1e-5, rtol=0)
        assert out["expert_keys"] == sorted(f"experts.{e}.{w}" for e in range(4 * rank, 4 * rank + 4)
                                            for w in ("w_gate.weight", "w_up.weight", "w_down.weight"))
    for name, grad in dense.items():
        if name.startswith("experts."):  # each expert's gradient lives on its owner, whole
            owner = int(name.split(".")[1]) // 4
            torch.testing.assert_close(ep_run[owner]["grads"][name], grad, atol=1e-5, rtol=0)
            assert name not in ep_run[1 - owner]["grads"]
        else:  # replicated: each rank holds its own tokens' share
            torch.testing.assert_close(ep_run[0]["grads"][name] + ep_run[1]["grads"][name], grad, atol=1e-5, rtol=0)


def test_quantile_balancing_counts_every_ranks_tokens(ep_run):
    moe, *_ = dense_layer()
    moe.update_bias()
    assert torch.equal(ep_run[0]["bias"], ep_run[1]["bias"])  # the replicated router routes alike everywhere
    torch.testing.assert_close(ep_run[0]["bias"], moe.bias, atol=1e-6, rtol=0)


def test_forced_expert_ids_replay_under_expert_parallelism(ep_run):
    moe, _, res, forced = dense_layer()
    x, *_ = layer_inputs()
    moe.update_bias()
    moe.eval()
    with torch.no_grad():
        dense_forced = moe(x.reshape(6, 5, D), forced_ids=forced.reshape(6, 5, 3)).y
    for rank, out in enumerate(ep_run):
        rows = slice(3 * rank, 3 * rank + 3)
        torch.testing.assert_close(out["forced_y"], dense_forced[rows], atol=1e-5, rtol=0)
        torch.testing.assert_close(out["replay_y"], out["y"], atol=1e-6, rtol=0)  # recorded ids: the recorded output
    assert not torch.allclose(ep_run[0]["own_y"], ep_run[0]["y"], atol=1e-6)  # the new bias does route differently


def test_whole_k3_model_matches_the_dense_model(ep_run):
    model = make_model()
    ids, w = model_inputs()
    model.train()
    result = model(ids.reshape(4, 9))
    (result.logits * w.reshape(4, 9, 96)).sum().backward()
    dense = grads(model)
    for rank, out in enumerate(ep_run):
        rows = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(out["router_ids"], result.router_ids[rows])
        torch.testing.assert_close(out["logits"], result.logits[rows].detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(out["replayed_logits"], out["logits"], atol=1e-6, rtol=0)
    experts = [n for n in dense if ".experts." in n]
    assert experts
    for name, grad in dense.items():
        holders = [out["model_grads"][name] for out in ep_run if name in out["model_grads"]]
        assert len(holders) == (1 if name in experts else 2), name
        torch.testing.assert_close(sum(holders), grad, atol=1e-5, rtol=0, msg=name)
    # the gathered state is the whole model, in the dense model's key order
    full = ep_run[0]["full_state"]
    assert list(full) == list(model.state_dict())
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(ep_run[1]["full_state"][k], v) for k, v in full.items())


# ---- DeepSpeed: TrainerRank with trainer.expert_parallel ------------------------------------------------------------


def training_rows() -> list[TrainingRow]:
    """Eight sequences of different lengths, prompts masked out, mixed advantages; off-policy enough to clip some."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(8):
        n = 10 + 3 * i
        ids = torch.randint(0, 250, (n,), generator=g).tolist()
        adv = [0.0] * 4 + [1.0 if i % 3 else -1.0] * (n - 4)
        old = (-5.6 + 0.3 * torch.randn(n, generator=g)).tolist()
        rows.append(TrainingRow(token_ids=ids, loss_mask=[0] * 4 + [1] * (n - 4), logprobs=old, advantages=adv,
                                returns=[0.0] * n))
    return rows


def ds_worker(rank: int, world: int, port: int, expert_parallel: int, zero_stage: int, checkpoint: str | None) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    from sandforge.config import TrainerConfig
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    # fp32 on every CPU: bf16 (the default where the CPU has AMX) rounds the two layouts' sums apart by more than the
    # 1e-4 this equivalence is held to
    cfg = TrainerConfig(lr=3e-3, kl_coef=0.05, grad_clip=1.0, zero_stage=zero_stage, grad_accum_steps=2,
                        world_size=world, expert_parallel=expert_parallel, bf16=False)
    trainer = TrainerRank(rank, world, "127.0.0.1", port, MODEL, cfg, RolloutShape(1.0, 64), seed=0, num_threads=1)
    rows = training_rows()
    total = sum(sum(r.loss_mask) for r in rows)
    metrics = [trainer.train_step(rows[rank::world], total, "rl") for _ in range(3)]  # grpo: token-mean
    out = {"metrics": metrics, "weights": trainer.get_weights(),
           "held": sum(p.numel() for p in trainer.engine.module.parameters())}
    if hasattr(trainer, "score"):  # 3 rows on rank 0, 1 on rank 1: different batch counts must still meet (all-to-all)
        out["scored"] = len(trainer.score(rows[: 3 - 2 * rank]))
    if checkpoint:
        out["policy_dir"] = trainer.save_checkpoint(checkpoint, "step_3", {"step": 3})
        with torch.no_grad():  # spoil this rank's weights, then resume: DeepSpeed's checkpoint must restore them
            for p in trainer.engine.module.parameters():
                p.add_(1.0)
        trainer.engine.load_checkpoint(checkpoint, "step_3")
        out["resumed"] = trainer.get_weights()
    return out


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    """ZeRO-2, gas 2: one rank with every row and every expert, and world 2 / expert_parallel 2 (started together)."""
    single = launch(ds_worker, 1, 1, 2, None)
    ep = launch(ds_worker, 2, 2, 2, str(tmp_path_factory.mktemp("ep-checkpoint")))
    return collect(single)[0], collect(ep)


def test_three_zero2_steps_track_the_single_rank_run(ds_runs):
    single, ep = ds_runs
    losses = [m["loss"] for m in single["metrics"]]
    assert abs(losses[-1] - losses[0]) > 1e-2  # the steps do move the policy: tracking it means something
    for rank in ep:
        assert [m["loss"] for m in rank["metrics"]] == pytest.approx(losses, abs=1e-4, rel=0)
        assert [m["grad_norm"] for m in rank["metrics"]] == pytest.approx([m["grad_norm"] for m in single["metrics"]],
                                                                         rel=1e-3)
        assert [m["moe/max_load_ratio"] for m in rank["metrics"]] == [m["moe/max_load_ratio"]
                                                                      for m in single["metrics"]]
    assert [rank.get("scored", 3 - 2 * i) for i, rank in enumerate(ep)] == [3, 1]
    experts = sum(v.numel() for k, v in single["weights"].items() if ".experts." in k)
    assert ep[0]["held"] == ep[1]["held"] == single["held"] - experts // 2  # each rank holds half the experts


def test_exported_weights_after_three_steps_match_the_single_rank_run(ds_runs):
    single, ep = ds_runs
    assert list(ep[0]["weights"]) == list(single["weights"])  # the whole model, in the dense key order
    for key, value in single["weights"].items():
        assert torch.equal(ep[0]["weights"][key], ep[1]["weights"][key]), key
        # selection biases come from 4096-bin histograms: rounding can move a quantile by part of one bin (8/4096)
        tolerance = 2e-3 if key.endswith("ffn.bias") else 1e-4
        torch.testing.assert_close(ep[0]["weights"][key], value, atol=tolerance, rtol=0, msg=key)


def test_checkpoint_of_an_expert_parallel_run_is_whole_and_resumes(ds_runs):
    from sandforge.models.build import load_policy

    _, ep = ds_runs
    policy = load_policy(ep[0]["policy_dir"]).state_dict()  # the standalone policy rank 0 writes: every expert
    assert policy.keys() == ep[0]["weights"].keys()
    assert all(torch.equal(policy[k], v) for k, v in ep[0]["weights"].items())
    for rank in ep:  # DeepSpeed's checkpoint put back each rank's own experts (and everything else)
        assert all(torch.equal(rank["resumed"][k], v) for k, v in rank["weights"].items())


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["trainer.world_size=2", "trainer.expert_parallel=4"], "4 must divide trainer.world_size (2)"),
        (["trainer.world_size=4", "trainer.expert_parallel=3"], "3 must divide trainer.world_size (4)"),
        (["trainer.world_size=2", "trainer.expert_parallel=2", "trainer.zero_stage=0"],
         "needs trainer.zero_stage 1 or 2"),
        (["trainer.world_size=2", "trainer.expert_parallel=2", "trainer.zero_stage=3"], "trainer.zero_stage"),
    ],
)
def test_config_rejects_expert_parallel_that_cannot_work(overrides, needle):
    from sandforge.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, overrides)
    message = str(err.value)
    assert needle in message and "configs/terminal.yaml" in message and "\n" not in message


def test_job_check_rejects_experts_that_do_not_split_evenly(tmp_path):
    from sandforge.job.cli import validate_job
    from sandforge.config import ConfigError, load_config

    ok = load_config(QUICKSTART, ["trainer.world_size=4", "trainer.expert_parallel=2", "trainer.zero_stage=1"])
    validate_job(ok, "job.yaml")  # k3-nano's 4 experts over 2 ranks
    uneven = load_config(QUICKSTART, ["trainer.world_size=4", "trainer.expert_parallel=4", "model.k3={n_experts: 6}"])
    with pytest.raises(ConfigError, match=r"job.yaml: 'trainer.expert_parallel' = 4 must divide .* n_experts \(6\)"):
        validate_job(uneven, "job.yaml")
    (tmp_path / "config.json").write_text("{}")
    hf = load_config(QUICKSTART, ["trainer.world_size=2", "trainer.expert_parallel=2", "model.arch=hf",
                                  f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match="shards the K3 LatentMoE"):
        validate_job(hf, "job.yaml")
