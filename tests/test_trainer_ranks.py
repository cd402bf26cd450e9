"""The driver's side of the trainer ranks (job/fleet/trainer_ranks.py): how one RL step's batch becomes optimizer
steps, with the ranks' own step stood in by a recorder."""

from __future__ import annotations

import random

import pytest

from sandforge.job.fleet import trainer_ranks
from sandforge.types import TrainingRow

ROWS = [TrainingRow(token_ids=[i, i + 1], loss_mask=[0, 1]) for i in range(6)]


@pytest.fixture
def steps(monkeypatch):
    taken = []

    def train(ranks, rows, mode):
        taken.append([r.token_ids[0] for r in rows])
        return {"loss": float(len(taken)), "ratio/min": 1.0 - len(taken), "ratio/max": 1.0 + len(taken)}

    monkeypatch.setattr(trainer_ranks, "train", train)
    return taken


@pytest.mark.parametrize("mini_batches, epochs", [(1, 1), (3, 1), (1, 2), (2, 3)])
def test_each_epoch_takes_every_row_once_split_in_mini_batches(steps, mini_batches, epochs):
    metrics = trainer_ranks.update([], ROWS, mini_batches, random.Random(0), epochs)
    assert len(steps) == mini_batches * epochs
    for e in range(epochs):
        passed = steps[e * mini_batches:(e + 1) * mini_batches]
        assert sorted(i for part in passed for i in part) == [r.token_ids[0] for r in ROWS]
    n = len(steps)
    assert metrics["loss"] == pytest.approx((n + 1) / 2)  # averaged over the optimizer steps
    assert metrics["ratio/min"] == 1.0 - n and metrics["ratio/max"] == 1.0 + n  # the extremes


def test_epochs_reshuffle_the_batch(steps):
    trainer_ranks.update([], ROWS, 2, random.Random(0), epochs=4)
    assert len({tuple(p) for p in steps[::2]}) > 1
