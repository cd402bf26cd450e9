"""Procedural terminal tasks: each family turns a seed into a Task with a reference solution and its checks.

Same (family, seed, split) -> same task. Held-out tasks draw file names and words from pools the train split never
uses (environments/words.py), so a held-out score measures what the policy learned, not what it memorised.
"""

from __future__ import annotations

import random
from typing import Callable

from sandforge.environments.words import WORDS, pools
from sandforge.types import Task, ToolCall

# Short syllable words: a tiny byte-level policy has to type them. Train and held-out pools are disjoint.
_WORDS = WORDS
_NAMES = pools("terminal/files", 100, 20)
SPLITS = ("train", "heldout")


def _start(family: str, seed: int, split: str) -> tuple[random.Random, str]:
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}': use one of {', '.join(SPLITS)}")
    task_id = f"terminal/{family}/{seed}" if split == "train" else f"terminal/{family}/{split}/{seed}"
    return random.Random(seed), task_id


def write_file_task(seed: int, split: str = "train") -> Task:
    rng, task_id = _start("write_file", seed, split)
    path = f"/workspace/{rng.choice(_NAMES[split])}.txt"
    content = " ".join(rng.choice(_WORDS[split]) for _ in range(rng.randint(2, 4)))
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
    path = f"/workspace/{rng.choice(_NAMES[split])}.txt"
    n = rng.randint(3, 12)
    words = [rng.choice(_WORDS[split]) for _ in range(n)]
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
