"""The RL learning-rate schedule: a factor of ``trainer.lr`` for each RL optimizer step.

The schedule counts optimizer steps of the RL phase only (``trainer.steps`` x ``trainer.mini_batches`` x ``trainer.epochs`` in all); the
supervised warm start runs at ``warmup.lr`` and does not advance it. Past the end the last factor holds (a step with
fewer rows than mini-batches takes fewer optimizer steps, so a run may stop short of the end).
"""

from __future__ import annotations

import math


def lr_factor(update: int, total: int, kind: str = "constant", warmup: int = 0) -> float:
    """Multiplier of the base lr at optimizer step ``update`` (0-based) of ``total``: a linear ramp over the first
    ``warmup`` steps (1/warmup, 2/warmup, ..., 1), then constant, linear decay or cosine decay towards 0 at ``total``."""
    if update < warmup:
        return (update + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (update - warmup) / span)
    if kind == "linear":
        return max(1.0 - progress, 1.0 / span)  # the last step still moves
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"trainer.lr_schedule {kind!r}: expected constant, linear or cosine")
