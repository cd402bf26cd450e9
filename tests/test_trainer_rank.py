"""A real DeepSpeed engine (ZeRO-2, CPU, gloo) in this process: the GRPO and SFT steps move the policy the right way."""

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
TRAINER = TrainerConfig(lr=1e-3, zero_stage=2, grad_accum_steps=2)
SHAPE = RolloutShape(temperature=1.0, response_budget=64)


def trainer(**fields) -> TrainerConfig:
    return TRAINER.model_copy(update=fields)


@pytest.fixture(scope="module")
def rank():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from sandforge.trainer.rank import TrainerRank

    return TrainerRank(0, 1, "127.0.0.1", free_port(), MODEL, TRAINER, SHAPE, seed=0, num_threads=2)


def masked_logprobs(rank, rows):
    from sandforge.models.sampling import token_logprobs
    from sandforge.trainer.batches import pad_right

    ids = pad_right([r.token_ids for r in rows], 0, torch.long)
    attn = pad_right([[1] * len(r.token_ids) for r in rows], 0, torch.long)
    mask = pad_right([r.loss_mask for r in rows], 0, torch.float32)
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
        rows.append(TrainingRow(token_ids=ids, loss_mask=[0] * 6 + [1] * (n - 6), logprobs=[0.0] * n,
                                advantages=[adv] * n))
    lp, _ = masked_logprobs(rank, rows)
    # on-policy: old log-probs are the current policy's
    return [replace(r, logprobs=lp[i, : len(r.token_ids)].tolist()) for i, r in enumerate(rows)]


def test_grpo_step_raises_good_and_lowers_bad_sequences(rank):
    rows = make_rows(rank, [1.0, -1.0, 1.0])
    before, mask = masked_logprobs(rank, rows)
    weights_before = {k: v.clone() for k, v in rank.get_weights().items()}
    total = sum(sum(r.loss_mask) for r in rows)
    metrics = rank.train_step(rows, total, mode="rl")
    after, _ = masked_logprobs(rank, rows)
    delta = ((after - before) * mask).sum(dim=1)
    assert delta[0] > 0 and delta[2] > 0 and delta[1] < 0, delta
    assert metrics["grad_norm"] > 0
    # weights change only at the accumulation boundary, so every micro-batch is exactly on-policy: ratio 1, loss -mean(A)
    assert metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    want = -sum(sum(r.loss_mask) * r.advantages[0] for r in rows) / total
    assert metrics["loss"] == pytest.approx(want, abs=1e-4)
    assert metrics["tis/mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["mismatch/kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["ratio/min"] == pytest.approx(1.0) and metrics["ratio/max"] == pytest.approx(1.0)
    assert metrics["clip_frac"] == 0.0 and metrics["entropy"] > 0
    changed = [k for k, v in rank.get_weights().items() if not torch.equal(v, weights_before[k])]
    assert changed, "no parameter changed"


def test_sft_steps_lower_the_nll(rank):
    rows = make_rows(rank, [0.0, 0.0])
    total = sum(sum(r.loss_mask) for r in rows)
    first = rank.train_step(rows, total, mode="sft")["loss"]
    for _ in range(5):
        last = rank.train_step(rows, total, mode="sft")["loss"]
    assert last < first


def test_each_row_is_scored_at_the_temperature_it_was_sampled_at(rank):
    """Rows sampled at their environment's own temperature (0.5 here, the rank's shape says 1.0): the engine's
    log-probs are at 0.5, and the trainer's match them (no mismatch, ratio 1); SFT learns a demonstration at 1."""
    from sandforge.models.sampling import token_logprobs
    from sandforge.trainer.batches import pad_right

    rows = make_rows(rank, [1.0, -1.0])
    ids = pad_right([r.token_ids for r in rows], 0, torch.long)
    attn = pad_right([[1] * len(r.token_ids) for r in rows], 0, torch.long)
    with torch.no_grad():
        cold, _ = token_logprobs(rank.engine.module, ids, attn, temperature=0.5)
    rows = [replace(r, temperature=0.5, logprobs=cold[i, : len(r.token_ids)].tolist()) for i, r in enumerate(rows)]
    total = sum(sum(r.loss_mask) for r in rows)
    nll, mask = masked_logprobs(rank, rows)  # at temperature 1
    sft = rank.train_step(rows, total, mode="sft")
    assert sft["loss"] == pytest.approx(-(nll * mask).sum().item() / total, rel=1e-4)
    with torch.no_grad():
        cold, _ = token_logprobs(rank.engine.module, ids, attn, temperature=0.5)
    rows = [replace(r, logprobs=cold[i, : len(r.token_ids)].tolist()) for i, r in enumerate(rows)]
    metrics = rank.train_step(rows, total, mode="rl")
    assert metrics["mismatch/kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["tis/mean"] == pytest.approx(1.0, abs=1e-4)


def first_step_sizes(rank, rows) -> torch.Tensor:
    """|change| / lr of every weight element one RL step moved."""
    before = {k: v.clone() for k, v in rank.get_weights().items()}
    rank.train_step(rows, sum(sum(r.loss_mask) for r in rows), mode="rl")
    moved = torch.cat([(v - before[k]).abs().flatten() for k, v in rank.get_weights().items()])
    return moved[moved > 0] / rank.cfg.lr


def test_rl_starts_from_a_fresh_optimizer_after_supervised_steps():
    """A fresh AdamW's first step moves each weight by lr (m/sqrt(v) = g/|g| after bias correction). After warm-start
    steps, reset_optimizer gives RL exactly that step; without it, SFT's moments set the step instead."""
    from sandforge.trainer.rank import TrainerRank

    def warm_started() -> TrainerRank:
        r = TrainerRank(0, 1, "127.0.0.1", free_port(), MODEL, trainer(lr=1e-3, grad_accum_steps=1), SHAPE, seed=0,
                        num_threads=2)
        sft = make_rows(r, [0.0, 0.0])
        for _ in range(4):
            r.train_step(sft, sum(sum(x.loss_mask) for x in sft), mode="sft")
        return r

    fresh, carried = warm_started(), warm_started()
    assert fresh.reset_optimizer() > 0
    base = fresh.optimizer.optimizer  # DeepSpeed's ZeRO optimizer around the torch AdamW
    assert base.state and all(float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
                              for s in base.state.values())
    rl = make_rows(fresh, [1.0, -1.0, 1.0])
    steps = first_step_sizes(fresh, rl)
    assert (steps - 1).abs().lt(0.01).float().mean() > 0.95, steps  # a fresh Adam step: lr per weight
    assert all(float(s["step"]) == 1 for s in base.state.values())
    kept = first_step_sizes(carried, rl)
    assert (kept - 1).abs().lt(0.01).float().mean() < 0.5, kept  # SFT's moments decided the step


def test_ppo_value_head_learns_the_returns_and_scores_rows():
    from sandforge.trainer.rank import TrainerRank

    ppo = TrainerRank(0, 1, "127.0.0.1", free_port(), MODEL, trainer(algorithm="ppo", lr=1e-2), SHAPE,
                      seed=0, num_threads=2)
    rows = [replace(r, returns=[1.0] * len(r.token_ids)) for r in make_rows(ppo, [1.0, -1.0])]
    assert all(v == 0.0 for s in ppo.score(rows) for v in s.values)  # the head starts at zero
    total = sum(sum(r.loss_mask) for r in rows)
    losses = [ppo.train_step(rows, total, mode="rl", total_sequences=2)["value/loss"] for _ in range(3)]
    assert losses[0] == pytest.approx(0.5) and losses[-1] < losses[0]  # 0.5 (0 - 1)^2 at first, then lower
    scored = ppo.score(rows)
    assert [len(s.values) for s in scored] == [len(r.token_ids) for r in rows]
    assert scored[0].values[-1] > 0.1


def test_checkpoint_holds_a_loadable_policy(rank, tmp_path):
    from sandforge.models.build import load_policy

    policy_dir = rank.save_checkpoint(str(tmp_path), "step_1", {"step": 1})
    loaded = load_policy(policy_dir)
    for k, v in rank.get_weights().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert (tmp_path / "step_1").is_dir()


def test_later_mini_batches_take_their_ratio_against_the_steps_start(rank):
    """trainer.mini_batches: score() gives the step's old log-probs; after the first optimizer step the second
    mini-batch's ratio moves away from 1 (and can be clipped), while without old log-probs it would read exactly 1."""
    rows = make_rows(rank, [1.0, -1.0, 1.0])
    for i, (r, s) in enumerate(zip(rows, rank.score(rows))):
        # score sees the policy the engine had, on the tokens the loss reads (the rest are not scored: 0)
        assert s.old_logprobs == pytest.approx([lp * m for lp, m in zip(r.logprobs, r.loss_mask)], abs=1e-5)
        rows[i] = replace(r, old_logprobs=s.old_logprobs)
    first, second = rows[:1], rows[1:]
    m1 = rank.train_step(first, sum(sum(r.loss_mask) for r in first), mode="rl")
    assert m1["ratio/min"] == pytest.approx(1.0, abs=1e-5) and m1["ratio/max"] == pytest.approx(1.0, abs=1e-5)
    total = sum(sum(r.loss_mask) for r in second)
    plain = [replace(r, old_logprobs=None) for r in second]
    lp_now, mask = masked_logprobs(rank, second)
    moved = max(abs(a - b) for r, row in zip(second, lp_now) for a, b in zip(r.old_logprobs[6:], row[6:].tolist()))
    assert moved > 1e-4  # the first mini-batch's step changed the policy on these rows too
    m2 = rank.train_step(second, total, mode="rl")
    assert m2["ratio/max"] - m2["ratio/min"] > 1e-4
    # the same rows without old log-probs are on-policy again (current == old within the step)
    m3 = rank.train_step(plain, total, mode="rl")
    assert m3["ratio/min"] == pytest.approx(1.0, abs=1e-5) and m3["ratio/max"] == pytest.approx(1.0, abs=1e-5)


def test_a_second_epoch_over_the_batch_is_clipped_on_the_side_its_advantage_pushes():
    """trainer.epochs: the same rows again, against the step's old log-probs. After the first pass the ratio has moved,
    so the second pass's ratio metrics leave 1 and the clip acts: with clip-higher (a wide high side, a narrow low
    side) the tokens clipped are the ones pushed down, on the low side."""
    from sandforge.trainer.rank import TrainerRank

    r = TrainerRank(0, 1, "127.0.0.1", free_port(), MODEL,
                    trainer(lr=1e-2, grad_accum_steps=1, clip_eps_low=1e-3, clip_eps_high=10.0), SHAPE, seed=0,
                    num_threads=2)
    rows = make_rows(r, [1.0, -1.0, 1.0])
    rows = [replace(row, old_logprobs=s.old_logprobs) for row, s in zip(rows, r.score(rows))]
    total = sum(sum(x.loss_mask) for x in rows)
    first = r.train_step(rows, total, mode="rl")
    assert first["clip_frac"] == 0.0 and first["ratio/max"] == pytest.approx(1.0, abs=1e-5)
    second = r.train_step(rows, total, mode="rl")
    assert second["ratio/max"] > 1.001 and second["ratio/min"] < 0.999
    assert second["clip_frac/low"] > 0 and second["clip_frac/high"] == 0.0


def test_lr_factor_shapes():
    from sandforge.trainer.lr_schedule import lr_factor

    assert [lr_factor(u, 4) for u in range(4)] == [1.0] * 4
    assert [lr_factor(u, 6, "linear", warmup=2) for u in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    cosine = [lr_factor(u, 5, "cosine", warmup=1) for u in range(5)]
    assert cosine[:2] == [1.0, 1.0] and cosine[2] == pytest.approx(0.5 * (1 + 2 ** -0.5))
    assert cosine == sorted(cosine, reverse=True) and 0 < cosine[-1] < 0.2


def test_lr_follows_the_schedule_over_rl_steps_only_and_survives_a_checkpoint(tmp_path):
    """linear, 2 warmup steps over 3 RL steps x 2 mini-batches: 0.5, 1, 1, 0.75, 0.5, 0.25 of trainer.lr. A warm-start
    (SFT) step in between runs at the lr set_lr gave it and does not advance the schedule; a reloaded rank goes on."""
    from sandforge.trainer.rank import TrainerRank

    cfg = trainer(lr=1e-3, lr_schedule="linear", lr_warmup_steps=2, steps=3, mini_batches=2)
    a = TrainerRank(0, 1, "127.0.0.1", free_port(), MODEL, cfg, SHAPE, seed=0, num_threads=2)
    rows = make_rows(a, [1.0, -1.0])
    total = sum(sum(r.loss_mask) for r in rows)
    a.set_lr(5e-3)
    assert a.train_step(rows, total, mode="sft")["lr"] == 5e-3
    got = [a.train_step(rows, total, mode="rl")["lr"] for _ in range(3)]
    assert got == pytest.approx([5e-4, 1e-3, 1e-3])
    a.save_checkpoint(str(tmp_path), "step_3", {"step": 3})
    want = [a.train_step(rows, total, mode="rl")["lr"] for _ in range(3)]
    assert want == pytest.approx([7.5e-4, 5e-4, 2.5e-4])
    b = TrainerRank(0, 1, "127.0.0.1", free_port(), MODEL, cfg, SHAPE, seed=0, num_threads=2)
    b.load_checkpoint(str(tmp_path), "step_3")
    assert b.train_step(rows, total, mode="rl")["lr"] == want[0]


def test_deepspeed_config_for_each_precision_setting():
    from sandforge.trainer.rank import deepspeed_config

    base = TrainerConfig(zero_stage=1, grad_accum_steps=3, grad_clip=0.5)
    cpu, gpu = deepspeed_config(base, cuda=False), deepspeed_config(base, cuda=True)
    assert "bf16" not in cpu and gpu["bf16"] == {"enabled": True}  # null: bf16 exactly when CUDA is there
    assert cpu["zero_optimization"] == {"stage": 1} and cpu["gradient_accumulation_steps"] == 3
    assert cpu["gradient_clipping"] == 0.5
    assert "bf16" not in deepspeed_config(base.model_copy(update=dict(bf16=False)), cuda=True)
    assert deepspeed_config(base.model_copy(update=dict(bf16=True)), cuda=False)["bf16"] == {"enabled": True}


def test_a_bf16_step_on_cpu_keeps_log_probs_values_and_moe_biases_in_fp32():
    from sandforge.models.sampling import token_scores
    from sandforge.trainer.batches import pad_right
    from sandforge.trainer.rank import TrainerRank

    r = TrainerRank(0, 1, "127.0.0.1", free_port(), MODEL, trainer(bf16=True, algorithm="ppo", lr=1e-2), SHAPE,
                    seed=0, num_threads=2)
    assert next(r.engine.module.parameters()).dtype == torch.bfloat16
    biases = [b for n, b in r.engine.module.named_buffers() if n.endswith("ffn.bias")]
    assert biases and all(b.dtype == torch.float32 for b in biases)
    rows = [replace(row, returns=[1.0] * len(row.token_ids)) for row in make_rows(r, [1.0, -1.0])]
    ids = pad_right([row.token_ids for row in rows], 0, torch.long)
    attn = pad_right([[1] * len(row.token_ids) for row in rows], 0, torch.long)
    with torch.no_grad():
        assert token_scores(r.engine, ids, attn).logprobs.dtype == torch.float32
    total = sum(sum(row.loss_mask) for row in rows)
    m1 = r.train_step(rows, total, mode="rl", total_sequences=2)
    m2 = r.train_step(rows, total, mode="rl", total_sequences=2)
    assert m1["grad_norm"] > 0 and m2["value/loss"] < m1["value/loss"] == pytest.approx(0.5)


def test_without_kl_weight_or_logging_the_reference_forward_is_skipped():
    from sandforge.trainer.rank import TrainerRank

    r = TrainerRank(0, 1, "127.0.0.1", free_port(), MODEL, trainer(kl_coef=0.0, log_kl=False), SHAPE, seed=0,
                    num_threads=2)

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")

    r.reference.forward = refuse
    rows = make_rows(r, [1.0, -1.0])
    m = r.train_step(rows, sum(sum(row.loss_mask) for row in rows), mode="rl", total_sequences=2)
    assert m["grad_norm"] > 0 and "kl" not in m
