"""Partial credit for near misses: how close an answer came, for checks that opt in with ``"partial": true``.

A check with partial credit still scores 1.0 only for the exact answer, so an episode's success is as strict as
before; a wrong answer scores ``NEAR_MISS`` times its similarity to the right one instead of 0. That is a denser
reward for RL: a policy that copies a value with one character off, or posts the right text in the wrong channel,
ranks above one that posted nothing, and GRPO has an advantage to follow in groups where no sample was exact.

Similarity is difflib's ratio (2 * matching characters / total characters) on values as text; rows compare cell by
cell, and a set of rows pairs each expected row with the closest unused row it got, dividing by the larger of the
two counts, so missing rows and extra rows both cost credit.
"""

from __future__ import annotations

from difflib import SequenceMatcher

NEAR_MISS = 0.5  # the most a wrong answer can score: exactness is worth at least as much as closeness


def text_similarity(got: str, want: str) -> float:
    """1.0 for equal strings, else difflib's ratio in [0, 1) (0 when either is empty)."""
    if got == want:
        return 1.0
    return min(SequenceMatcher(None, got, want, autojunk=False).ratio(), 0.999)


def value_similarity(got, want) -> float:
    """1.0 for equal values of one type; else the text similarity of their string forms (None counts as empty), below
    1 even when the forms agree ("3" is not 3)."""
    if got == want and type(got) is type(want):
        return 1.0
    return min(text_similarity("" if got is None else str(got), "" if want is None else str(want)), 0.999)


def row_similarity(got: list, want: list) -> float:
    """Mean cell similarity over the longer row (cells one row lacks count 0)."""
    width = max(len(got), len(want))
    if width == 0:
        return 1.0
    return sum(value_similarity(g, w) for g, w in zip(got, want)) / width


def rows_similarity(got: list[list], want: list[list], ordered: bool = False) -> float:
    """How close the rows ``got`` are to ``want``: 1.0 iff they are the same rows (in order, if ``ordered``).

    Unordered, each expected row (in order) takes the closest row not taken yet: greedy, so a near-duplicate cannot
    count twice; the sum is divided by the larger count.
    """
    size = max(len(got), len(want))
    if size == 0:
        return 1.0
    if ordered:
        return sum(row_similarity(g, w) for g, w in zip(got, want)) / size
    free = list(range(len(got)))
    total = 0.0
    for row in want:
        if not free:
            break
        best = max(free, key=lambda i: row_similarity(got[i], row))
        total += row_similarity(got[best], row)
        free.remove(best)
    return total / size


def near_miss(similarity: float) -> float:
    """The score of an answer that is not exact but ``similarity`` close: below NEAR_MISS, never 1.0."""
    return NEAR_MISS * min(max(similarity, 0.0), 1.0)
