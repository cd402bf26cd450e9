"""DAPO's two data-side changes (Yu et al. 2025): dynamic sampling and overlong reward shaping."""

from __future__ import annotations

from collections import defaultdict


def informative_groups(rewards: list[float], groups: list[str]) -> set[str]:
    """Groups whose rewards are not all equal. A group that all passed or all failed has zero group-relative advantage
    everywhere, so it adds no gradient, only dilutes the batch; dynamic sampling drops it and samples more tasks."""
    seen: dict[str, set[float]] = defaultdict(set)
    for r, g in zip(rewards, groups):
        seen[g].add(r)
    return {g for g, values in seen.items() if len(values) > 1}


def overlong_penalty(length: int, budget: int, buffer: int, factor: float = 1.0) -> float:
    """Soft overlong punishment, added to the reward: 0 up to ``budget - buffer`` policy tokens, then falling linearly
    to -factor at ``budget`` (and -factor beyond it). ``buffer`` 0 turns it off."""
    if buffer <= 0 or length <= budget - buffer:
        return 0.0
    return -factor * min(1.0, (length - (budget - buffer)) / buffer)
