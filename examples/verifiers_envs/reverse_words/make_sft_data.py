"""Write an SFT dataset for reverse_words: chat conversations (JSONL with ``messages``, as TRL and prime-rl take them)
in which the assistant answers a word with its exact reversal in the environment's tags.

    python examples/verifiers_envs/reverse_words/make_sft_data.py --out examples/verifiers_envs/reverse_words/sft.jsonl

The words are every word the environment can make (``--syllables`` of its syllables) except those of the tasks a
sandforge job holds out (``--heldout`` of ``--num-tasks``, split as sandforge splits them: by a stable hash of each
task's key without its system prompt), so an evaluation on the held-out tasks measures the skill on words the data
never showed. The system prompt is the environment's own. Needs the installed environment and sandforge.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

from reverse_words.taskset import SYLLABLES, SYSTEM

from sandforge.environments.vf.tasks import load_tasks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--num-tasks", type=int, default=200, help="the environment's num_tasks (the job's args)")
    p.add_argument("--syllables", type=int, default=3, help="the environment's syllables (the job's args)")
    p.add_argument("--task-seed", type=int, default=0, help="the environment's seed (the job's args)")
    p.add_argument("--heldout", type=float, default=0.2, help="the job's environments[].heldout")
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    tasks = load_tasks("reverse_words", {"num_tasks": a.num_tasks, "syllables": a.syllables, "seed": a.task_seed},
                       heldout=a.heldout)
    heldout = {t.instruction for t in tasks if t.split == "heldout"}
    words = ["".join(parts) for parts in itertools.product(SYLLABLES, repeat=a.syllables)]
    allowed = sorted(set(words) - heldout)
    rng = random.Random(a.seed)
    with open(a.out, "w", encoding="utf-8") as f:
        for _ in range(a.rows):
            word = rng.choice(allowed)
            f.write(json.dumps({"messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": word},
                {"role": "assistant", "content": f"<reversed_text>{word[::-1]}</reversed_text>"}]}) + "\n")
    print(f"{a.rows} conversations over {len(allowed)} words ({len(heldout)} held-out words left out) -> {a.out}")


if __name__ == "__main__":
    main()
