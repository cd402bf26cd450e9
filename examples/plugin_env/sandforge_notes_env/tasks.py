"""One seeded family: note these words, in order. Held-out tasks use words the train split never shows."""

from __future__ import annotations

import random

from sandforge.types import Task, ToolCall

SPLITS = ("train", "heldout")
_WORDS = {
    "train": "milk eggs bread rice tea jam".split(),
    "heldout": "soap salt corn figs".split(),
}


def add_notes_task(seed: int, split: str = "train") -> Task:
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}': use one of {', '.join(SPLITS)}")
    rng = random.Random(seed)
    notes = [rng.choice(_WORDS[split]) for _ in range(rng.randint(1, 3))]
    return Task(
        id=f"notes/add_notes/{split}/{seed}",
        env="notes",
        family="add_notes",
        seed=seed,
        split=split,
        instruction="Add these notes, one per add_note call, in this order: " + ", ".join(notes),
        checks=[{"verifier": "notes_equal", "notes": notes}],
        solution=[*(ToolCall("add_note", {"text": n}) for n in notes), ToolCall("submit")],
    )


# family -> (seed, split) -> Task: all sandforge needs of a task module (a job names families by these keys)
FAMILIES = {"add_notes": add_notes_task}
