"""`sandforge show RUN_DIR [--episode ID]` on a recorded run directory (tests/data/run_sample): an episode reads as
instruction, reasoning, tool calls, observations and verifier breakdown; failed or partial rows render too."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from sandforge.rundir import find_episodes, read_episodes
from sandforge.job.show import episode_table, render_episode

SAMPLE = Path(__file__).parent / "data" / "run_sample"
SANDFORGE = Path(sys.executable).parent / "sandforge"


def show(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "160"}  # rich wraps to the terminal; a wide one keeps commands on one line
    return subprocess.run([str(SANDFORGE), "show", *args], capture_output=True, text=True, timeout=60, env=env)


def rendered(ep: dict) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(render_episode(ep))
    return console.file.getvalue()


def in_order(text: str, *parts: str) -> bool:
    """Each part occurs after the one before it."""
    at = 0
    for part in parts:
        at = text.find(part, at)
        if at < 0:
            return False
        at += len(part)
    return True


def test_episode_shows_reasoning_tool_calls_observations_and_breakdown():
    out = show(str(SAMPLE), "--episode", "2")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "episode #2" in text and "terminal/count_words/11" in text
    assert in_order(text,
                    "Write the number of words in /workspace/plan.txt",  # the instruction
                    "The task wants words, not lines: wc -w counts words.",  # turn 0's reasoning
                    "Counting the words with wc.",  # its reply
                    "call bash", '"command": "wc -w < /workspace/plan.txt > /workspace/answer.txt"',
                    "[exit code 0]",  # the observation, literally (not eaten as rich markup)
                    "Check what was written before submitting.", "call read_file", '"path": "/workspace/answer.txt"',
                    "tool · read_file", "11",
                    "The count is there; done.", "call submit",
                    "reward", "value 1.00", "success", "file_equals:/workspace/answer.txt    1.00", "content matches")
    assert "failure" not in text


def test_without_episode_lists_all_and_shows_the_last():
    out = show(str(SAMPLE))
    assert out.returncode == 0, out.stderr
    episodes = read_episodes(SAMPLE)
    table, _, shown = out.stdout.partition("episode #")
    assert f"{len(episodes)} episodes" in table
    for i, ep in enumerate(episodes):
        line = next(line for line in table.splitlines() if line.strip().startswith(f"│ {i} "))
        assert ep["task"]["id"] in line and ep["phase"] in line and (ep["finish_reason"] or "?") in line
    assert "(failed)" in next(line for line in table.splitlines() if "│ 4 " in line)
    assert shown.startswith(f"{len(episodes) - 1}") and "Write the file as asked." in shown


def test_long_runs_list_their_latest_episodes():
    episodes = read_episodes(SAMPLE) * 20
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(episode_table(episodes))
    text = console.file.getvalue()
    assert f"{len(episodes)} episodes (trajectories.jsonl), the last 40 shown" in text
    numbers = [int(line.split("│")[1]) for line in text.splitlines() if line.startswith("│")]
    assert numbers == list(range(len(episodes) - 40, len(episodes)))  # indices stay those --episode takes


def test_episode_by_task_session_or_group_substring():
    episodes = read_episodes(SAMPLE)
    assert find_episodes(episodes, "3/terminal/count_words/11/9f8e7d6c5b4a") == [2]  # a session id
    assert find_episodes(episodes, "repo/fix_off_by_one/4") == [5]  # a task id
    assert find_episodes(episodes, "count_words/7") == [1, 3]  # a substring: every match
    assert find_episodes(episodes, "-1") == [len(episodes) - 1]
    out = show(str(SAMPLE), "-e", "count_words/7")
    assert out.returncode == 0, out.stderr
    assert "2 episodes match 'count_words/7' (#1, #3); showing the last" in out.stdout
    assert "episode #3" in out.stdout and "List the workspace" in out.stdout


def test_unknown_episode_and_bad_run_dir_are_one_clear_line(tmp_path):
    for args, expect in (([str(SAMPLE), "--episode", "99"], "pass an index 0..6"),
                         ([str(tmp_path)], "neither metrics.jsonl nor trajectories.jsonl")):
        out = show(*args)
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], out.stderr
        assert out.stdout == ""


def test_failed_episode_shows_why():
    text = rendered(read_episodes(SAMPLE)[4])
    assert "failed" in text and "failure (excluded from the gradient)" in text
    assert "sandbox: container sf-0c0b0a exited (OOM killed)" in text
    assert in_order(text, "Count the words.", "call bash", "tool · bash", "(no output)")


def test_long_observation_is_clipped_but_keeps_its_ends():
    text = rendered(read_episodes(SAMPLE)[3])
    assert "file_00.txt" in text and "file_14.txt" in text  # the head
    assert "file_30.txt" not in text and "lines cut" in text
    assert "<script>alert(\"x\")</script>" in text and "[exit code 0]" in text  # the tail, where errors are
    assert "List the workspace; <b>maybe</b> the file is elsewhere & hidden." in text  # reasoning in full, literal
    assert "parse error: unterminated JSON object" in text and "tool · error" in text


def test_partial_rows_render_without_crashing():
    assert "unknown task" in rendered({}) and "not graded" in rendered({})
    partial = {"task": {"id": "t/1", "instruction": "Do the thing."}, "failed": True, "reward": None,
               "messages": [{"role": "assistant", "tool_calls": [{"name": "bash"}]}, {"role": "tool"}]}
    text = rendered(partial)
    assert in_order(text, "Do the thing.", "call bash", "{}", "tool · ?", "not graded", "no reason recorded")
    older = json.loads((SAMPLE / "trajectories.jsonl").read_text().splitlines()[2])
    for key in ("turns", "metadata", "finish_reason", "policy_version"):
        older.pop(key)
    older["reward"].pop("breakdown")
    text = rendered(older)
    assert "wc -w < /workspace/plan.txt" in text and "value 1.00" in text
