"""TrainerRank checkpoints: a rank reloaded from a checkpoint takes the next step exactly as the rank that wrote it
(weights, optimizer moments, balancing biases, RNG); routing replay and the router mismatch rate in a real step."""

import os
from dataclasses import replace

import pytest
import torch

from sandforge.config import ModelConfig, TrainerConfig
from sandforge.trainer.rank import RolloutShape
from sandforge.job.fleet.lifecycle import free_port
from sandforge.types import TrainingRow

MODEL = ModelConfig(arch="k3", preset="k3-nano", tokenizer="bytes",
                    k3=dict(d_model=32, n_heads=2, head_dim=16, d_ff=32, d_expert=16))
TRAINER = TrainerConfig(lr=1e-3, zero_stage=2, grad_accum_steps=2, routing_replay=True)
SHAPE = RolloutShape(temperature=1.0, response_budget=64)


def new_rank():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from sandforge.trainer.rank import TrainerRank

    return TrainerRank(0, 1, "127.0.0.1", free_port(), MODEL, TRAINER, SHAPE, seed=0, num_threads=2)


def make_rows(rank) -> list[TrainingRow]:
    """Three sequences scored by the rank's own model, with the routing it chose (as an engine would record it)."""
    from sandforge.trainer.batches import pad_right

    g = torch.Generator().manual_seed(1)
    rows = []
    for i, adv in enumerate([1.0, -1.0, 0.5]):
        n = 12 + 3 * i
        ids = torch.randint(80 * i, 80 * (i + 1), (n,), generator=g).tolist()
        rows.append(TrainingRow(token_ids=ids, loss_mask=[0] * 6 + [1] * (n - 6), advantages=[adv] * n))
    ids = pad_right([r.token_ids for r in rows], 0, torch.long)
    attn = pad_right([[1] * len(r.token_ids) for r in rows], 0, torch.long)
    model = rank.engine.module.eval()
    with torch.no_grad():
        out = model(ids, attention_mask=attn)
    logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    for i, r in enumerate(rows):
        n = len(r.token_ids)
        rows[i] = replace(r, logprobs=[0.0] + logp[i, : n - 1].tolist(),
                          routed_experts=out.router_ids[i, : n - 1].tolist() + [None])  # the last token is never fed
    return rows


def test_a_reloaded_rank_takes_the_same_next_step(tmp_path):
    a = new_rank()
    rows = make_rows(a)
    total = sum(sum(r.loss_mask) for r in rows)
    a.save_checkpoint(str(tmp_path), "step_0", {"step": 0})  # the policy RL starts from: the KL reference
    first = a.train_step(rows, total, mode="rl")
    assert first["router/mismatch_rate"] == 0.0  # the routing came from these very weights
    a.save_checkpoint(str(tmp_path), "step_1", {"step": 1})
    torch.manual_seed(123)  # whatever happens to the RNG after the save, the reload brings the saved one back
    want = a.train_step(rows, total, mode="rl")
    want_weights = a.get_weights()
    assert 0.0 <= want["router/mismatch_rate"] < 1.0  # the biases moved after step 1: some routing differs now

    b = new_rank()
    with torch.no_grad():  # a reference that is not the one the run started from must be replaced by the reload
        for p in b.reference.parameters():
            p.add_(0.01)
    client = b.load_checkpoint(str(tmp_path), "step_1", reference=str(tmp_path / "step_0" / "policy"))
    assert client["step"] == 1 and b.steps == 1
    got = b.train_step(rows, total, mode="rl")
    assert got == want  # every metric, bitwise
    for k, v in b.get_weights().items():
        assert torch.equal(v, want_weights[k]), k
    moe_bias = [k for k in want_weights if k.endswith("ffn.bias")]
    assert moe_bias, "the LatentMoE selection biases are part of the checkpointed state"


def test_a_missing_tag_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        new_rank().load_checkpoint(str(tmp_path), "step_9")


def test_rank_broadcasts_its_weights_over_the_channel():
    import threading

    from sandforge.models.weight_channel import WeightChannel

    rank, port, got = new_rank(), free_port(), []
    template = rank.get_weights()

    def engine():
        got.append(WeightChannel("127.0.0.1", port, rank=1, timeout_s=60).receive(template))

    t = threading.Thread(target=engine)
    t.start()
    rank.open_weight_channel("127.0.0.1", port)
    assert rank.send_weights(5) == 5
    t.join(60)
    [(weights, version)] = got
    assert version == 5 and all(torch.equal(weights[k], v) for k, v in template.items())


def test_resume_point_is_the_newest_complete_checkpoint(tmp_path):
    from sandforge.job.checkpoint import ResumeError, mark_complete, resume_point

    with pytest.raises(ResumeError, match="not a sandforge run directory"):
        resume_point(tmp_path)
    (tmp_path / "run_id").write_text("r\n")
    for step in (0, 2, 10, 3):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    for step in (0, 2, 3):  # step_10 is torn: the run died while writing it
        mark_complete(tmp_path / "checkpoints" / f"step_{step}")
    assert resume_point(tmp_path) == (3, tmp_path / "checkpoints" / "step_3")


def test_rows_past_the_checkpoint_and_a_torn_line_are_dropped(tmp_path):
    import json

    from sandforge.job.checkpoint import truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    rows = [{"phase": "warmup", "step": 5}] + [{"phase": "rl", "step": s} for s in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"phase": "rl", "st')
    dropped = truncate_jsonl(path, lambda r: r["phase"] != "rl" or r["step"] < 2)
    assert dropped == 3
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]


def test_config_hash_ignores_where_and_how_long():
    from sandforge.config import JobConfig
    from sandforge.job.checkpoint import config_hash

    job = JobConfig()
    other = JobConfig.model_validate({"run": {"output_dir": "elsewhere"}, "trainer": {"steps": 99},
                                      "logging": {"wandb": {"mode": "disabled"}}})
    changed = JobConfig.model_validate({"trainer": {"lr": 0.5}})
    assert config_hash(job) == config_hash(other) != config_hash(changed)
