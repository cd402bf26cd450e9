"""Word pools (environments/words.py): train and held-out words never meet, and pools are stable."""

from __future__ import annotations

import random

import pytest

from sandforge.environments.words import WORDS, pool, pools, split_of, word


def test_pools_are_disjoint_stable_and_of_their_split():
    p = pools("test", 50, 10)
    assert p == pools("test", 50, 10) and p != pools("other", 50, 10)
    assert len(set(p["train"])) == 50 and len(set(p["heldout"])) == 10
    assert not set(p["train"]) & set(p["heldout"])
    assert {split_of(w) for w in p["train"]} == {"train"} and {split_of(w) for w in p["heldout"]} == {"heldout"}
    assert not set(WORDS["train"]) & set(WORDS["heldout"])


def test_about_one_word_in_five_is_held_out_and_word_keeps_to_its_split():
    rng = random.Random(0)
    drawn = [word(rng, "train") for _ in range(500)]
    assert {split_of(w) for w in drawn} == {"train"}
    everything = set(pool("train", 400, "x")) | set(pool("heldout", 100, "x"))
    share = sum(split_of(w) == "heldout" for w in everything) / len(everything)
    assert share == pytest.approx(0.2)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        word(rng, "test")


@pytest.mark.parametrize("env", ["terminal", "slack", "notion", "browser"])
def test_heldout_tasks_ask_for_heldout_words_only(env):
    import importlib
    import re

    tasks = importlib.import_module(f"sandforge.environments.{env}.tasks")
    for family in tasks.FAMILIES:
        for seed in range(10):
            text = tasks.FAMILIES[family](seed, "heldout").instruction.lower()
            train_words = [w for w in re.findall(r"\b(?:[bdfgklmnprstvz][aeiou])+\b", text) if len(w) >= 4
                           and split_of(w) == "train"]
            assert not set(train_words) & set(WORDS["train"]), (family, seed, text)
