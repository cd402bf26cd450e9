"""What the mock apps' task families share: seeding, task ids and splits."""

from __future__ import annotations

import random

SPLITS = ("train", "heldout")


def start(env: str, family: str, seed: int, split: str) -> tuple[random.Random, str]:
    """The family's random source (same seed, same task) and the task id (held-out ids name their split)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}': use one of {', '.join(SPLITS)}")
    task_id = f"{env}/{family}/{seed}" if split == "train" else f"{env}/{family}/{split}/{seed}"
    return random.Random(f"{env}/{family}/{seed}"), task_id

