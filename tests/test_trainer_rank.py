"""A real DeepSpeed engine (ZeRO-2, CPU, gloo) in this process: the GRPO and SFT steps move the policy the right way."""

import os

import pytest
import torch

from sandforge.trainer.loop import free_port

MODEL = dict(arch="k3", preset="k3-nano", k3=dict(d_model=32, n_heads=2, head_dim=16, d_ff=32, d_expert=16))
TRAINER = dict(lr=1e-3, weight_decay=0.0, grad_clip=1.0, clip_eps=0.2, kl_coef=0.0, zero_stage=2, grad_accum_steps=2, temperature=1.0)


@pytest.fixture(scope="module")
def rank():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from sandforge.trainer.actor import TrainerRank

    return TrainerRank(0, 1, "127.0.0.1", free_port(), MODEL, TRAINER, None, "bytes", seed=0, num_threads=2)


def masked_logprobs(rank, rows):
    from sandforge.models.generate import token_logprobs
    from sandforge.trainer.actor import pad_right

    ids = pad_right([r["token_ids"] for r in rows], 0, torch.long)
    attn = pad_right([[1] * len(r["token_ids"]) for r in rows], 0, torch.long)
    mask = pad_right([r["loss_mask"] for r in rows], 0, torch.float32)
    with torch.no_grad():
        lp, _ = token_logprobs(rank.engine.module, ids, attn)
    return lp, mask


def make_rows(rank, advantages):
    g = torch.Generator().manual_seed(1)
    rows = []
    for i, adv in enumerate(advantages):
        n = 12 + 3 * i
        # each row draws from its own token range, so one step's update on one row barely moves the others
        ids = torch.randint(80 * i, 80 * (i + 1), (n,), generator=g).tolist()
        rows.append({"token_ids": ids, "loss_mask": [0] * 6 + [1] * (n - 6), "logprobs": [0.0] * n, "advantage": adv})
    lp, _ = masked_logprobs(rank, rows)
    for i, r in enumerate(rows):  # on-policy: old log-probs are the current policy's
        r["logprobs"] = lp[i, : len(r["token_ids"])].tolist()
    return rows


def test_grpo_step_raises_good_and_lowers_bad_sequences(rank):
    rows = make_rows(rank, [1.0, -1.0, 1.0])
    before, mask = masked_logprobs(rank, rows)
    weights_before = {k: v.clone() for k, v in rank.get_weights().items()}
    total = sum(sum(r["loss_mask"]) for r in rows)
    metrics = rank.train_step(rows, total, mode="rl")
    after, _ = masked_logprobs(rank, rows)
    delta = ((after - before) * mask).sum(dim=1)
    assert delta[0] > 0 and delta[2] > 0 and delta[1] < 0, delta
    assert metrics["grad_norm"] > 0
    # weights change only at the accumulation boundary, so every micro-batch is exactly on-policy: ratio 1, loss -mean(A)
    assert metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["loss"] == pytest.approx(-sum(sum(r["loss_mask"]) * r["advantage"] for r in rows) / total, abs=1e-4)
    changed = [k for k, v in rank.get_weights().items() if not torch.equal(v, weights_before[k])]
    assert changed, "no parameter changed"


def test_sft_steps_lower_the_nll(rank):
    rows = make_rows(rank, [0.0, 0.0])
    total = sum(sum(r["loss_mask"]) for r in rows)
    first = rank.train_step(rows, total, mode="sft")["loss"]
    for _ in range(5):
        last = rank.train_step(rows, total, mode="sft")["loss"]
    assert last < first


def test_checkpoint_holds_a_loadable_policy(rank, tmp_path):
    from sandforge.models.policy import load_policy

    policy_dir = rank.save_checkpoint(str(tmp_path), "step_1", {"step": 1})
    loaded = load_policy(policy_dir)
    for k, v in rank.get_weights().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert (tmp_path / "step_1").is_dir()
