"""The words generated tasks are made of: syllable words, every one either a train word or a held-out word.

A held-out task must ask for values the policy never saw in training, drawn from the same distribution as the ones it
did see. English word lists fail the second half for a policy built from scratch: the shipped BPE has learned most
short English words as single tokens, so a held-out word is a token the policy has never once written, and no amount
of training on other words teaches it to. Syllable words ("kolu", "dasimo") are spelled out of pieces every word
shares, so writing an unseen one is copying, the skill being measured.

Which split a word belongs to is a property of the word (a hash), not of the pool it came from: the pretraining
stage (job/pretraining_data.py) and every train-split task use train words only, held-out tasks use held-out words only.

Tasks draw their values fresh (``fresh``, ``distinct``, ``phrase``) rather than from a fixed pool: two or three syllables give
about 150,000 train words, so 64 warm-start tasks rarely share a file name, a channel or a page title, and a policy
cannot do better than copying them from the instruction. (Pools of 60-400 words repeated a value in 15-40 of 64
draws; a small policy learnt to write the pools' words instead of the task's.)
"""

from __future__ import annotations

import random
import zlib

from sandforge.environments.seeding import SPLITS

SYLLABLES = ("ba be bi bo bu da de di do du fa fe fi fo ga ge go gu ka ke ki ko ku la le li lo lu ma me mi mo mu na "
             "ne ni no nu pa pe pi po ra re ri ro ru sa se si so su ta te ti to tu va ve vi vo za ze zi zo").split()
HELDOUT_SHARE = 5  # one word in five is held out
VALUE_SYLLABLES = (2, 3)  # what tasks ask for: one-syllable words are too few (57) not to repeat


def split_of(word: str) -> str:
    """"heldout" for one syllable word in ``HELDOUT_SHARE``, "train" for the rest; fixed for every word."""
    return "heldout" if zlib.crc32(word.lower().encode()) % HELDOUT_SHARE == 0 else "train"


def any_word(rng: random.Random, syllables: tuple[int, int] = (1, 3)) -> str:
    """A word of ``syllables`` (lowest, highest) syllables, of either split."""
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(*syllables)))


def word(rng: random.Random, split: str = "train", syllables: tuple[int, int] = (1, 3)) -> str:
    """A word of ``split``: drawn until one of that split comes up."""
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}': use one of {', '.join(SPLITS)}")
    while True:
        w = any_word(rng, syllables)
        if split_of(w) == split:
            return w


def fresh(rng: random.Random, split: str = "train", syllables: tuple[int, int] = VALUE_SYLLABLES) -> str:
    """A two- or three-syllable word of ``split``: a value a task asks for (a file name, a channel, a guest)."""
    return word(rng, split, syllables)


def distinct(rng: random.Random, split: str, n: int, taken: set[str] | None = None,
             syllables: tuple[int, int] = VALUE_SYLLABLES) -> list[str]:
    """``n`` fresh words of ``split``, none of them in ``taken`` (which gains them): the values one task asks for,
    e.g. a workspace's channel names, that must differ from each other. Two syllables alone still give about 2,600
    train words, for names that should stay short."""
    taken = set() if taken is None else taken
    words: list[str] = []
    while len(words) < n:
        w = fresh(rng, split, syllables)
        if w not in taken:
            taken.add(w)
            words.append(w)
    return words


def phrase(rng: random.Random, split: str, lo: int, hi: int) -> str:
    """``lo`` to ``hi`` fresh words of ``split``, space-separated: a message, a file's content, a heading."""
    return " ".join(fresh(rng, split) for _ in range(rng.randint(lo, hi)))


def pool(split: str, n: int, salt: str) -> list[str]:
    """``n`` distinct two- or three-syllable words of ``split``, the same every time for the same ``salt``."""
    rng = random.Random(f"sandforge/{salt}/{split}")
    words: dict[str, None] = {}
    while len(words) < n:
        w = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(*VALUE_SYLLABLES)))
        if split_of(w) == split:
            words[w] = None
    return list(words)


def pools(salt: str, train: int, heldout: int) -> dict[str, list[str]]:
    """A train pool and a held-out pool (disjoint by construction) for one use. A fixed pool suits values a task
    shows but never asks for; what a solution must write should be drawn fresh (``fresh``, ``distinct``, ``phrase``)."""
    return {"train": pool("train", train, salt), "heldout": pool("heldout", heldout, salt)}


# a fixed sample of each split's words, for checks that a text holds words of one split only
WORDS = pools("words", 400, 80)
