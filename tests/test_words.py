"""Word pools (environments/words.py): train and held-out words never meet, and pools are stable."""

from __future__ import annotations

import random

import pytest

from sandforge.environments.words import SYLLABLES, WORDS, distinct, fresh, phrase, pool, pools, split_of, word


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


def test_fresh_words_are_of_their_split_new_to_the_task_and_seeded():
    rng = random.Random(3)
    taken = {"kolu"}
    words = distinct(rng, "heldout", 200, taken)
    assert len(set(words)) == 200 and "kolu" not in words and taken == {"kolu", *words}
    assert {split_of(w) for w in words} == {"heldout"}
    assert {len(w) // 2 for w in words} == {2, 3} and all(w[i:i + 2] in SYLLABLES for w in words for i in (0, 2))
    assert distinct(random.Random(3), "heldout", 200, {"kolu"}) == words  # same seed, same words
    assert {len(w) for w in distinct(rng, "train", 50, syllables=(2, 2))} == {4}
    assert split_of(fresh(rng, "heldout")) == "heldout"
    text = phrase(rng, "train", 2, 4)
    assert 2 <= len(text.split()) <= 4 and {split_of(w) for w in text.split()} == {"train"}
    draws = [fresh(random.Random(seed), "train") for seed in range(64)]
    assert len(draws) - len(set(draws)) <= 2  # 64 draws from ~150,000 train words rarely meet


# train-split syllable words that the instructions' own English spells: "Create the file", "the page", "Todo"
TEMPLATE_WORDS = {"file", "page", "database", "todo", "done", "bike"}


@pytest.mark.parametrize("env", ["terminal", "repo", "slack", "notion", "browser"])
def test_heldout_tasks_ask_for_heldout_words_only(env):
    import importlib
    import re

    tasks = importlib.import_module(f"sandforge.environments.{env}.tasks")
    for family in tasks.FAMILIES:
        for seed in range(10):
            text = tasks.FAMILIES[family](seed, "heldout").instruction.lower()
            train_words = [w for w in re.findall(r"\b(?:[bdfgklmnprstvz][aeiou])+\b", text) if len(w) >= 4
                           and split_of(w) == "train"]
            assert set(train_words) <= TEMPLATE_WORDS, (family, seed, text)
