"""The start of every seeded task: its random source and its id, one rule for the built-in environments.

A seeded task is made from (family, seed, split) alone, so the same three give the same task on every machine. Its id
is ``env/family/seed`` for a training task and ``env/family/split/seed`` for a held-out one. Its random source is
seeded by a key, ``env/family/seed`` unless the environment's families were first written with another (the
terminal's by the seed alone, the repo's by ``env/family/split/seed``): kept, so that no task's values change.
"""

from __future__ import annotations

import random

SPLITS = ("train", "heldout")


def task_start(env: str, family: str, seed: int, split: str, key: str | int | None = None
               ) -> tuple[random.Random, str]:
    """The task's random source and its id; ValueError for a split that is neither train nor heldout."""
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}': use one of {', '.join(SPLITS)}")
    task_id = f"{env}/{family}/{seed}" if split == "train" else f"{env}/{family}/{split}/{seed}"
    return random.Random(f"{env}/{family}/{seed}" if key is None else key), task_id
