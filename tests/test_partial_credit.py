"""Partial credit (verifiers/partial.py): exact answers and only they score 1.0, a closer miss scores more than a
farther one, and missing or extra rows cost credit. The set matching is tied to a brute-force reference."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter

from sandforge.verifiers.partial import (NEAR_MISS, near_miss, row_similarity, rows_similarity, text_similarity,
                                         value_similarity)


def test_text_similarity_is_one_only_for_equal_text_and_grows_with_closeness():
    assert text_similarity("kolu dasi", "kolu dasi") == 1.0
    assert text_similarity("", "") == 1.0
    assert text_similarity("kolu dasi", "") == 0.0
    one_off, two_off, far = (text_similarity(g, "kolu dasi") for g in ("kolu dasu", "kola dasu", "zzzz"))
    assert 1.0 > one_off > two_off > far >= 0.0


def test_values_compare_by_type_then_by_text():
    assert value_similarity(3, 3) == 1.0
    assert value_similarity("3", 3) < 1.0  # the sql check tells "3" from 3, so a near miss never reaches 1
    assert value_similarity(None, None) == 1.0 and value_similarity(None, "x") == 0.0
    assert value_similarity(True, 1) < 1.0


def test_row_similarity_averages_cells_over_the_longer_row():
    assert row_similarity(["message", "C01", None, "hi"], ["message", "C01", None, "hi"]) == 1.0
    assert row_similarity(["message", "C02", None, "hi"], ["message", "C01", None, "hi"]) == (3 + text_similarity("C02", "C01")) / 4
    assert row_similarity(["a"], ["a", "b"]) == 0.5


def _exact(got, want, ordered):
    key = lambda r: json.dumps(r)  # noqa: E731
    return [key(r) for r in got] == [key(r) for r in want] if ordered else Counter(map(key, got)) == Counter(map(key, want))


def _best_pairing(got, want):
    """Brute force: the best one-to-one pairing's summed similarity, divided by the larger count."""
    size = max(len(got), len(want))
    if size == 0:
        return 1.0
    small, large, flip = (got, want, True) if len(got) <= len(want) else (want, got, False)
    best = 0.0
    for chosen in itertools.permutations(range(len(large)), len(small)):
        pairs = [(small[i], large[j]) if flip else (large[j], small[i]) for i, j in enumerate(chosen)]
        best = max(best, sum(row_similarity(g, w) for g, w in pairs))
    return best / size


def test_rows_similarity_is_one_exactly_when_the_rows_match_and_never_beats_the_best_pairing():
    rng = random.Random(0)
    values = ["a", "ab", "b", 1, 2, None]
    for _ in range(400):
        width = rng.randint(1, 3)
        want = [[rng.choice(values) for _ in range(width)] for _ in range(rng.randint(0, 3))]
        got = [list(r) for r in want]
        rng.shuffle(got)
        for _ in range(rng.randint(0, 2)):  # perturb: change a cell, drop a row or add one
            move = rng.choice(["cell", "drop", "add"])
            if move == "cell" and got:
                rng.choice(got)[rng.randrange(width)] = rng.choice(values)
            elif move == "drop" and got:
                got.pop(rng.randrange(len(got)))
            else:
                got.append([rng.choice(values) for _ in range(width)])
        for ordered in (False, True):
            score = rows_similarity(got, want, ordered)
            assert (score == 1.0) == _exact(got, want, ordered), (got, want, ordered)
            assert 0.0 <= score <= 1.0
        assert rows_similarity(got, want) <= _best_pairing(got, want) + 1e-9  # greedy never overcounts


def test_missing_and_extra_rows_cost_credit():
    want = [["message", "C01", None, "kolu dasi"]]
    right = rows_similarity(want, want)
    wrong_channel = rows_similarity([["message", "C02", None, "kolu dasi"]], want)
    with_extra = rows_similarity([*want, ["message", "C03", None, "spam"]], want)
    nothing = rows_similarity([], want)
    assert right == 1.0 and nothing == 0.0
    assert 1.0 > wrong_channel > 0.5 and with_extra == 0.5


def test_a_near_miss_scores_below_the_cap_and_never_one():
    assert near_miss(0.999) < NEAR_MISS < 1.0
    assert near_miss(0.0) == 0.0 and near_miss(-1.0) == 0.0
    assert near_miss(text_similarity("kolu dasu", "kolu dasi")) > near_miss(text_similarity("zz", "kolu dasi"))
