"""Reading a run directory back (metrics rows, recorded episodes) for ``sandforge report`` and ``sandforge show``.

Only plain JSON is read (metrics.jsonl, trajectories.jsonl, eval.json, run_id), so a run can be inspected on a laptop
without torch, Ray or Docker, and while the run is still writing: a torn last line is skipped, not an error.
"""

from __future__ import annotations

import json
from pathlib import Path


class RunDirError(Exception):
    """The directory is not a run directory (or lacks what was asked of it); the message says what to pass instead."""


def check_run_dir(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is not a directory; pass a run directory (run.output_dir of a job, "
                          "e.g. runs/quickstart)")
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "trajectories.jsonl").is_file():
        raise RunDirError(f"{run_dir} holds neither metrics.jsonl nor trajectories.jsonl; pass the run.output_dir "
                          "of a job that has started (sandforge train writes them there)")
    return run_dir


def read_jsonl(path: Path) -> list[dict]:
    """Every row that parses as a JSON object; a line being written (a live or killed run) is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_metrics(run_dir: Path) -> dict[str, list[dict]]:
    """metrics.jsonl rows by phase ("warmup", "rl", "eval"). A step logged twice (a resumed run) keeps its last row."""
    by_phase: dict[str, dict] = {}
    for row in read_jsonl(Path(run_dir) / "metrics.jsonl"):
        phase = row.get("phase", "rl")
        step = row.get("warmup/step") if phase == "warmup" else row.get("step")
        rows = by_phase.setdefault(phase, {})
        rows[step if step is not None else f"row{len(rows)}"] = row
    return {phase: list(rows.values()) for phase, rows in by_phase.items()}


def read_episodes(run_dir: Path) -> list[dict]:
    """trajectories.jsonl rows: ``{"step", "phase", **Trajectory.to_dict()}``, in the order they were recorded."""
    return read_jsonl(Path(run_dir) / "trajectories.jsonl")


def read_eval(run_dir: Path) -> dict:
    """eval.json (held-out success before and after RL), or {} when the run has none (or it is unreadable)."""
    path = Path(run_dir) / "eval.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def run_id(run_dir: Path) -> str:
    path = Path(run_dir) / "run_id"
    return path.read_text().strip() if path.is_file() else Path(run_dir).resolve().name


def find_episodes(episodes: list[dict], key: str) -> list[int]:
    """Indices of the episodes ``key`` names: an index into trajectories.jsonl (negative counts from the end), else an
    exact task id or session id, else a substring of the task id, session id or group."""
    try:
        i = int(key)
    except ValueError:
        pass
    else:
        return [i % len(episodes)] if -len(episodes) <= i < len(episodes) else []

    def names(ep: dict) -> list[str]:
        task, meta = ep.get("task") or {}, ep.get("metadata") or {}
        return [str(x) for x in (task.get("id"), meta.get("session"), ep.get("group")) if x]

    exact = [i for i, ep in enumerate(episodes) if key in names(ep)[:2]]
    return exact or [i for i, ep in enumerate(episodes) if any(key in n for n in names(ep))]
