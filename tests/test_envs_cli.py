"""`sandforge envs list`: every environment with its source, families, task counts per split and image."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from seeded import terminal_task as make_task

from seeded import dump_jsonl

ROOT = Path(__file__).resolve().parents[1]
HARBOR = ROOT / "tests" / "data" / "harbor"


def envs_list(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandforge.job.cli", "envs", "list", *args], capture_output=True,
                          text=True, timeout=120)


def table(stdout: str) -> list[list[str]]:
    """Rows split on the runs of two or more spaces that separate the columns."""
    import re

    return [re.split(r" {2,}(?=\S)", line.strip()) for line in stdout.splitlines()]


def test_built_in_environments_are_listed():
    proc = envs_list()
    assert proc.returncode == 0, proc.stderr
    rows = table(proc.stdout)
    assert rows[0] == ["name", "source", "families", "tasks", "image"]
    by_name = {r[0]: r for r in rows[1:]}
    assert by_name["terminal"] == ["terminal", "built-in", "write_file, count_words", "train seeded, heldout seeded",
                                   "sandforge/terminal"]
    assert by_name["harbor"][:3] == ["harbor", "built-in", "-"] and by_name["harbor"][-1] == "per task"
    assert by_name["slack"][-1] == by_name["notion"][-1] == "sandforge/apps"  # the mock apps share one image


def test_a_config_adds_its_task_files_with_their_counts(tmp_path):
    jsonl = tmp_path / "tasks.jsonl"
    dump_jsonl([make_task("write_file", s) for s in range(3)] + [make_task("count_words", 0, "heldout")], jsonl)
    config = tmp_path / "job.yaml"
    config.write_text(f"environments:\n  - name: terminal\n    tasks: {jsonl}\n  - name: harbor\n    tasks: {HARBOR}\n")
    proc = envs_list(str(config))
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in table(proc.stdout) if "environments[" in r[1]]
    assert rows == [
        ["terminal", f"{config}: environments[0].tasks = {jsonl}", "count_words, write_file",
         "train 3, heldout 1", "sandforge/terminal"],
        ["harbor", f"{config}: environments[1].tasks = {HARBOR}", "counting, files", "train 2, heldout 0",
         "per task: 2 images"],
    ]


def test_a_broken_task_file_is_reported_not_listed(tmp_path):
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text(str(asdict(make_task("write_file", 0))) + "\n")  # Python repr, not JSON
    config = tmp_path / "job.yaml"
    config.write_text(f"environments:\n  - name: terminal\n    tasks: {jsonl}\n")
    proc = envs_list(str(config))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: {jsonl} line 1: not valid JSON"), proc.stderr
