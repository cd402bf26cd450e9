"""The driver's side of the trainer ranks: one group that owns every call to them.

Every call goes to every rank, since each is a collective over their process group (or, like a checkpoint, each
rank's own part of one). ``calls`` starts a method on every rank with the same arguments, ``each`` waits for their
answers, and ``dealt`` gives rank i the rows ``rows[i::world]`` (round-robin). A step over all of them, the scores a
step needs first and the learning rate are the group's methods.
"""

from __future__ import annotations

import random
from typing import Any, Iterator

from sandforge.types import RowScores, TrainingRow


class TrainerRanks:
    """The trainer ranks' actor handles, in rank order; a slice of them is a group too (weight sync's rank 0)."""

    def __init__(self, actors: list | None = None):
        self.actors = list(actors or [])

    def __len__(self) -> int:
        return len(self.actors)

    def __iter__(self) -> Iterator:
        return iter(self.actors)

    def __getitem__(self, index):
        return TrainerRanks(self.actors[index]) if isinstance(index, slice) else self.actors[index]

    def calls(self, method: str, *args: Any) -> list:
        """``method(*args)`` started on every rank; the object refs, in rank order."""
        return [getattr(rank, method).remote(*args) for rank in self.actors]

    def each(self, method: str, *args: Any) -> list:
        """``method(*args)`` on every rank; the answers, in rank order."""
        import ray

        return ray.get(self.calls(method, *args))

    def dealt(self, method: str, rows: list, *args: Any) -> list:
        """``method(rows[i::world], *args)`` on rank i; the answers, in rank order."""
        import ray

        world = len(self.actors)
        return ray.get([getattr(rank, method).remote(rows[i::world], *args) for i, rank in enumerate(self.actors)])

    def train(self, rows: list[TrainingRow], mode: str) -> dict[str, float]:
        """One optimizer step over ``rows`` ("rl" or "sft" rows); rank 0's metrics (they are reduced over ranks)."""
        total = sum(sum(r.loss_mask) for r in rows)
        return self.dealt("train_step", rows, total, mode, len(rows))[0]

    def update(self, rows: list[TrainingRow], mini_batches: int, rng: random.Random,
               epochs: int = 1) -> dict[str, float]:
        """One RL step's optimizer steps: ``epochs`` passes over ``rows``, each a fresh shuffle split in
        ``mini_batches``, every step against the log-probs the trainer had before the first. Metrics are averaged over
        them (``ratio/min|max``: the extremes), so ``ratio/*`` and ``clip_frac`` show how far the later steps moved."""
        n = min(mini_batches, len(rows))
        if n == 1 and epochs == 1:
            return self.train(rows, mode="rl")
        parts = []
        for _ in range(epochs):
            order = list(range(len(rows)))
            rng.shuffle(order)
            parts += [self.train([rows[i] for i in order[k::n]], mode="rl") for k in range(n)]
        out = {}
        for key in parts[0]:
            values = [p[key] for p in parts if key in p]
            pick = {"ratio/min": min, "ratio/max": max}.get(key, lambda v: sum(v) / len(v))
            out[key] = pick(values)
        return out

    def score(self, rows: list[TrainingRow]) -> list[RowScores]:
        """Each row's per-token KL penalty, value estimates and log-probs from the trainer (``TrainerRank.score``), in
        row order."""
        world = len(self.actors)
        out: list[RowScores | None] = [None] * len(rows)
        for i, shard in enumerate(self.dealt("score", rows)):
            out[i::world] = shard
        return out

    def set_lr(self, lr: float) -> None:
        self.each("set_lr", lr)
