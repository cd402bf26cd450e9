"""The built-in environments' seeded tasks, ``(family, seed, split="train") -> Task``, made as a job's task source
makes them: by the registry entry, the one lookup of a family in the task module's ``FAMILIES``."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from sandforge.registry import environment

terminal_task = environment("terminal").make_task()
repo_task = environment("repo").make_task()
slack_task = environment("slack").make_task()
notion_task = environment("notion").make_task()
browser_task = environment("browser").make_task()


def dump_jsonl(tasks, path: Path) -> None:
    """Write tasks in the shape a JSONL task file holds (environments/task_sources.py ``load_jsonl`` reads it)."""
    Path(path).write_text("".join(json.dumps(asdict(t)) + "\n" for t in tasks))


def straight(task):
    """``task`` with its reference solution's stumble left out (environments/recovery.py: about half the repo and
    booking references first make one call the environment rejects): the calls a solution needs, for tests that read
    what a solution writes. A stumble is known by the rule that rejects it: a read of a file the task does not have,
    a ``str_replace`` without ``new``, a value selected into a field whose options do not hold it."""
    import dataclasses

    files = task.setup.get("files", {})
    booking = task.setup.get("site", {}).get("booking", {})
    options = {2: booking.get("dates", []), 3: booking.get("times", [])}

    def rejected(call) -> bool:
        args = call.arguments
        return (call.name == "read_file" and task.env == "repo" and args["path"] not in files
                or call.name == "str_replace" and "new" not in args
                or call.name == "select" and booking and args["option"] not in options.get(args["id"], []))

    return dataclasses.replace(task, solution=[c for c in task.solution if not rejected(c)])
