"""DAPO's two data-side changes (Yu et al. 2025): dynamic sampling and overlong reward shaping."""

from __future__ import annotations

from collections import defaultdict


def informative_groups(rewards: list[float], successes: list[bool], groups: list[str], on: str = "success") -> set[str]:
    """Groups worth a gradient (``trainer.dynamic_sampling_on``): ``success``, those where some episodes succeeded and
    some did not; ``reward``, those whose reward values are not all equal. Dynamic sampling drops the rest and samples
    more tasks: a group that all passed or all failed has nothing to learn from, and keyed on reward, partial credit
    keeps groups where nobody succeeded, whose near-equal credit a std-normalised baseline blows up."""
    seen: dict[str, set] = defaultdict(set)
    for value, g in zip(successes if on == "success" else rewards, groups):
        seen[g].add(value)
    return {g for g, values in seen.items() if len(values) > 1}


def overlong_penalty(length: int, budget: int, buffer: int, factor: float = 1.0) -> float:
    """Soft overlong punishment, added to the reward: 0 up to ``budget - buffer`` policy tokens, then falling linearly
    to -factor at ``budget`` (and -factor beyond it). ``buffer`` 0 turns it off."""
    if buffer <= 0 or length <= budget - buffer:
        return 0.0
    return -factor * min(1.0, (length - (budget - buffer)) / buffer)
