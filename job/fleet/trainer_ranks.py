"""The driver's side of the trainer ranks: one step over all of them, the scores a step needs first, the learning rate.

Rows are dealt to ranks round-robin (``rows[i::world]``); every rank takes part in every call, since each is a
collective over their process group.
"""

from __future__ import annotations

import random

from sandforge.types import RowScores, TrainingRow


def train(ranks: list, rows: list[TrainingRow], mode: str) -> dict[str, float]:
    """One optimizer step over ``rows`` ("rl" or "sft" rows); rank 0's metrics (they are reduced over ranks)."""
    import ray

    total = sum(sum(r.loss_mask) for r in rows)
    world = len(ranks)
    results = ray.get([rank.train_step.remote(rows[i::world], total, mode, len(rows)) for i, rank in enumerate(ranks)])
    return results[0]


def update(ranks: list, rows: list[TrainingRow], mini_batches: int, rng: random.Random,
           epochs: int = 1) -> dict[str, float]:
    """One RL step's optimizer steps: ``epochs`` passes over ``rows``, each a fresh shuffle split in ``mini_batches``,
    every step against the log-probs the trainer had before the first. Metrics are averaged over them
    (``ratio/min|max``: the extremes), so ``ratio/*`` and ``clip_frac`` show how far the later steps moved."""
    n = min(mini_batches, len(rows))
    if n == 1 and epochs == 1:
        return train(ranks, rows, mode="rl")
    parts = []
    for _ in range(epochs):
        order = list(range(len(rows)))
        rng.shuffle(order)
        parts += [train(ranks, [rows[i] for i in order[k::n]], mode="rl") for k in range(n)]
    out = {}
    for key in parts[0]:
        values = [p[key] for p in parts if key in p]
        pick = {"ratio/min": min, "ratio/max": max}.get(key, lambda v: sum(v) / len(v))
        out[key] = pick(values)
    return out


def score(ranks: list, rows: list[TrainingRow]) -> list[RowScores]:
    """Each row's per-token KL penalty, value estimates and log-probs from the trainer (``TrainerRank.score``), in row
    order."""
    import ray

    world = len(ranks)
    shards = ray.get([rank.score.remote(rows[i::world]) for i, rank in enumerate(ranks)])
    out: list[RowScores | None] = [None] * len(rows)
    for i, shard in enumerate(shards):
        out[i::world] = shard
    return out


def set_lr(ranks: list, lr: float) -> None:
    import ray

    ray.get([rank.set_lr.remote(lr) for rank in ranks])
