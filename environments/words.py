"""The words generated tasks are made of: syllable words, every one either a train word or a held-out word.

A held-out task must ask for values the policy never saw in training, drawn from the same distribution as the ones it
did see. English word lists fail the second half for a policy built from scratch: the shipped BPE has learned most
short English words as single tokens, so a held-out word is a token the policy has never once written, and no amount
of training on other words teaches it to. Syllable words ("kolu", "dasimo") are spelled out of pieces every word
shares, so writing an unseen one is copying, the skill being measured.

Which split a word belongs to is a property of the word (a hash), not of the pool it came from: the pretraining
stage (job/copy_data.py) and every train-split task use train words only, held-out tasks use held-out words only.
"""

from __future__ import annotations

import random
import zlib

SYLLABLES = ("ba be bi bo bu da de di do du fa fe fi fo ga ge go gu ka ke ki ko ku la le li lo lu ma me mi mo mu na "
             "ne ni no nu pa pe pi po ra re ri ro ru sa se si so su ta te ti to tu va ve vi vo za ze zi zo").split()
SPLITS = ("train", "heldout")
HELDOUT_SHARE = 5  # one word in five is held out


def split_of(word: str) -> str:
    """"heldout" for one syllable word in ``HELDOUT_SHARE``, "train" for the rest; fixed for every word."""
    return "heldout" if zlib.crc32(word.lower().encode()) % HELDOUT_SHARE == 0 else "train"


def any_word(rng: random.Random) -> str:
    """A word of one to three syllables, of either split."""
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))


def word(rng: random.Random, split: str = "train") -> str:
    """A word of ``split``: drawn until one of that split comes up."""
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}': use one of {', '.join(SPLITS)}")
    while True:
        w = any_word(rng)
        if split_of(w) == split:
            return w


def pool(split: str, n: int, salt: str) -> list[str]:
    """``n`` distinct two- or three-syllable words of ``split``, the same every time for the same ``salt``."""
    rng = random.Random(f"sandforge/{salt}/{split}")
    words: dict[str, None] = {}
    while len(words) < n:
        w = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
        if split_of(w) == split:
            words[w] = None
    return list(words)


def pools(salt: str, train: int, heldout: int) -> dict[str, list[str]]:
    """A train pool and a held-out pool (disjoint by construction) for one use, e.g. file names or channels."""
    return {"train": pool("train", train, salt), "heldout": pool("heldout", heldout, salt)}


# the content words tasks ask the policy to write: wide enough that a warm start cannot memorise them
WORDS = pools("words", 400, 80)
