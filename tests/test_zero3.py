"""ZeRO-3 (parameters partitioned over ranks): 2 ranks over gloo on CPU track a single-rank run step for step, and the
whole model comes back from get_weights, score() and the checkpoint's standalone policy on every rank."""

from __future__ import annotations

import os

import pytest
import torch

from test_expert_parallel import MODEL, collect, launch, training_rows


def z3_worker(rank: int, world: int, port: int, zero_stage: int, checkpoint: str | None) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    from sandforge.config import TrainerConfig
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    cfg = TrainerConfig(lr=3e-3, kl_coef=0.05, grad_clip=1.0, zero_stage=zero_stage, grad_accum_steps=2,
                        world_size=world)
    trainer = TrainerRank(rank, world, "127.0.0.1", port, MODEL, cfg, RolloutShape(1.0, 64), seed=0, num_threads=1)
    rows = training_rows()
    total = sum(sum(r.loss_mask) for r in rows)
    metrics = [trainer.train_step(rows[rank::world], total, "rl") for _ in range(2)]
    out = {"metrics": metrics, "weights": trainer.get_weights(),
           "held": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
                       for p in trainer.engine.module.parameters()),
           # 3 rows on rank 0, 1 on rank 1: the ranks' forwards (each an all-gather under ZeRO-3) must still pair up
           "scored": [s.old_logprobs for s in trainer.score(rows[: 3 - 2 * rank])]}
    trainer.reset_reference()  # a collective under ZeRO-3: the reference is a whole local copy of the policy
    out["reference"] = {k: v.clone() for k, v in trainer.reference.state_dict().items()}
    if checkpoint:
        out["policy_dir"] = trainer.save_checkpoint(checkpoint, "step_2", {"step": 2})
        out["next"] = trainer.train_step(rows[rank::world], total, "rl")["loss"]
        trainer.train_step(rows[rank::world], total, "rl")  # moves on past the checkpoint, then goes back to it
        trainer.load_checkpoint(checkpoint, "step_2")
        out["resumed"] = trainer.get_weights()
        out["resumed_next"] = trainer.train_step(rows[rank::world], total, "rl")["loss"]
    return out


@pytest.fixture(scope="module")
def z3_runs(tmp_path_factory):
    single = launch(z3_worker, 1, 2, None)
    zero3 = launch(z3_worker, 2, 3, str(tmp_path_factory.mktemp("zero3-checkpoint")))
    return collect(single)[0], collect(zero3)


def test_two_zero3_ranks_track_the_single_rank_run(z3_runs):
    single, ranks = z3_runs
    losses = [m["loss"] for m in single["metrics"]]
    assert abs(losses[-1] - losses[0]) > 1e-3  # the first step moved the policy: tracking it means something
    for rank in ranks:
        assert [m["loss"] for m in rank["metrics"]] == pytest.approx(losses, abs=1e-4, rel=0)
        assert [m["grad_norm"] for m in rank["metrics"]] == pytest.approx([m["grad_norm"] for m in single["metrics"]],
                                                                         rel=1e-3)
    assert ranks[0]["held"] + ranks[1]["held"] <= single["held"] + 64  # each rank holds about half the parameters
    assert ranks[0]["held"] < 0.6 * single["held"]


def test_zero3_exports_the_whole_model_on_every_rank(z3_runs):
    from sandforge.models.build import load_policy

    single, ranks = z3_runs
    assert list(ranks[0]["weights"]) == list(single["weights"])
    for key, value in single["weights"].items():
        assert torch.equal(ranks[0]["weights"][key], ranks[1]["weights"][key]), key
        tolerance = 2e-3 if key.endswith("ffn.bias") else 1e-4  # biases: quantiles of 4096-bin histograms
        torch.testing.assert_close(ranks[0]["weights"][key], value, atol=tolerance, rtol=0, msg=key)
        for rank in ranks:
            assert torch.equal(rank["reference"][key], rank["weights"][key]), key
    policy = load_policy(ranks[0]["policy_dir"]).state_dict()
    assert all(torch.equal(policy[k], v) for k, v in ranks[0]["weights"].items())
    assert [len(r["scored"]) for r in ranks] == [3, 1]
    for got, want in zip(ranks[0]["scored"], single["scored"]):
        assert got == pytest.approx(want, abs=1e-4)


def test_zero3_checkpoint_resumes_on_every_rank(z3_runs):
    _, ranks = z3_runs
    for rank in ranks:
        assert all(torch.equal(rank["resumed"][k], v) for k, v in rank["weights"].items())
        assert rank["resumed_next"] == rank["next"]  # weights, optimizer moments and biases all came back
