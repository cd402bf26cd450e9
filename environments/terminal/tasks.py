"""Procedural terminal tasks: each family turns a seed into a Task with a reference solution and its checks.

Same (family, seed, split) -> same task. File names and words are fresh syllable words of the task's split
(environments/words.py): 64 training tasks rarely share one, so copying them from the instruction is the only way to
get them right, and held-out tasks ask for words no training task uses.
"""

from __future__ import annotations

import random
from typing import Callable

from sandforge.environments.seeding import SPLITS, task_start  # noqa: F401 - SPLITS: the task module's
from sandforge.environments.words import fresh, phrase
from sandforge.types import Task, ToolCall



def _start(family: str, seed: int, split: str) -> tuple[random.Random, str]:
    return task_start("terminal", family, seed, split, key=seed)  # seeded by the seed alone, as first written


def write_file_task(seed: int, split: str = "train") -> Task:
    rng, task_id = _start("write_file", seed, split)
    path = f"/workspace/{fresh(rng, split)}.txt"
    content = phrase(rng, split, 2, 4)
    return Task(
        id=task_id,
        env="terminal",
        family="write_file",
        seed=seed,
        split=split,
        # quoted, so the words tokenize as they will inside the tool call's JSON string ("map red" -> "map", " red"):
        # the policy copies token ids instead of having to map " map" to "map" for words it has never written
        instruction=f'Create the file {path} containing exactly: "{content}"',
        checks=[{"verifier": "file_equals", "path": path, "content": content}],
        solution=[ToolCall("write_file", {"path": path, "content": content}), ToolCall("submit")],
    )


def count_words_task(seed: int, split: str = "train") -> Task:
    rng, task_id = _start("count_words", seed, split)
    path = f"/workspace/{fresh(rng, split)}.txt"
    n = rng.randint(3, 12)
    words = phrase(rng, split, n, n).split()
    lines = [" ".join(words[i : i + 5]) for i in range(0, n, 5)]  # up to 5 words a line: counting lines is wrong
    return Task(
        id=task_id,
        env="terminal",
        family="count_words",
        seed=seed,
        split=split,
        instruction=f"Write the number of words in {path} to /workspace/answer.txt",
        setup={"files": {path: "\n".join(lines) + "\n"}},
        checks=[{"verifier": "file_equals", "path": "/workspace/answer.txt", "content": str(n), "strip": True}],
        solution=[ToolCall("bash", {"command": f"wc -w < {path} > /workspace/answer.txt"}), ToolCall("submit")],
    )


FAMILIES: dict[str, Callable[[int, str], Task]] = {
    "write_file": write_file_task,
    "count_words": count_words_task,
}
