"""The driver's side of the trainer ranks (job/fleet/trainer_ranks.py): how one RL step's batch becomes optimizer
steps, with the ranks' own step stood in by a recorder."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from sandforge.job.fleet.trainer_ranks import TrainerRanks
from sandforge.types import RowScores, TrainingRow

ROWS = [TrainingRow(token_ids=[i, i + 1], loss_mask=[0, 1]) for i in range(6)]


@pytest.fixture
def steps(monkeypatch):
    taken = []

    def train(ranks, rows, mode):
        taken.append([r.token_ids[0] for r in rows])
        return {"loss": float(len(taken)), "ratio/min": 1.0 - len(taken), "ratio/max": 1.0 + len(taken)}

    monkeypatch.setattr(TrainerRanks, "train", train)
    return taken


@pytest.mark.parametrize("mini_batches, epochs", [(1, 1), (3, 1), (1, 2), (2, 3)])
def test_each_epoch_takes_every_row_once_split_in_mini_batches(steps, mini_batches, epochs):
    metrics = TrainerRanks([]).update(ROWS, mini_batches, random.Random(0), epochs)
    assert len(steps) == mini_batches * epochs
    for e in range(epochs):
        passed = steps[e * mini_batches:(e + 1) * mini_batches]
        assert sorted(i for part in passed for i in part) == [r.token_ids[0] for r in ROWS]
    n = len(steps)
    assert metrics["loss"] == pytest.approx((n + 1) / 2)  # averaged over the optimizer steps
    assert metrics["ratio/min"] == 1.0 - n and metrics["ratio/max"] == 1.0 + n  # the extremes


def test_epochs_reshuffle_the_batch(steps):
    TrainerRanks([]).update(ROWS, 2, random.Random(0), epochs=4)
    assert len({tuple(p) for p in steps[::2]}) > 1


def actor(rank: int, calls: list):
    """A stand-in for a rank's actor handle: each method's ``remote`` records the call and answers at once."""
    def method(name):
        def remote(*args):
            calls.append((rank, name, args))
            return {"rank": rank, "rows": args[0]} if name in ("train_step", "score") else rank
        return SimpleNamespace(remote=remote)
    return SimpleNamespace(**{n: method(n) for n in ("train_step", "score", "set_lr", "save_checkpoint")})


@pytest.fixture
def group(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)  # the stand-ins answer at once
    calls = []
    return TrainerRanks([actor(r, calls) for r in range(3)]), calls


def test_every_call_reaches_every_rank_in_rank_order(group):
    ranks, calls = group
    assert ranks.each("save_checkpoint", "/ckpt", "step_1", {}) == [0, 1, 2]
    ranks.set_lr(0.5)
    assert [(r, name) for r, name, _ in calls] == [(0, "save_checkpoint"), (1, "save_checkpoint"),
                                                   (2, "save_checkpoint"), (0, "set_lr"), (1, "set_lr"), (2, "set_lr")]
    assert len(ranks[:1]) == 1 and isinstance(ranks[:1], TrainerRanks) and ranks[0] is ranks.actors[0]


def test_rows_are_dealt_round_robin_and_scores_come_back_in_row_order(group, monkeypatch):
    ranks, calls = group
    metrics = ranks.train(ROWS, mode="rl")
    assert metrics == {"rank": 0, "rows": ROWS[0::3]}  # rank 0's (its metrics are reduced over the ranks)
    total, mode, n = calls[0][2][1:]
    assert (total, mode, n) == (6, "rl", 6) and [c[2][0] for c in calls] == [ROWS[0::3], ROWS[1::3], ROWS[2::3]]

    monkeypatch.setattr(TrainerRanks, "dealt", lambda self, method, rows: [
        [RowScores([], None, [float(rows.index(r))]) for r in rows[i::3]] for i in range(3)])
    assert [s.old_logprobs[0] for s in ranks.score(ROWS)] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
