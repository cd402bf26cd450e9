"""What a run leaves behind: metrics.jsonl, trajectories.jsonl and a wandb run (offline unless configured otherwise)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from sandforge.config import JobConfig
from sandforge.registry import environment
from sandforge.types import Trajectory


def render_messages(traj: Trajectory) -> str:
    """A plain-text transcript of an episode: reasoning, tool calls and observations, for tables and quick reading."""
    lines = []
    for m in traj.messages:
        if m.role == "assistant":
            if m.reasoning:
                lines.append(f"[think] {m.reasoning}")
            if m.content:
                lines.append(f"[assistant] {m.content}")
            lines += [f"[call] {c.name}({json.dumps(c.arguments)})" for c in m.tool_calls]
        else:
            lines.append(f"[{m.role}{':' + m.name if m.name else ''}] {m.content}")
    return "\n".join(lines)


class RunLogger:
    def __init__(self, output_dir: Path, cfg: JobConfig, run_id: str, resume: bool = False):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.trajectories_path = self.output_dir / "trajectories.jsonl"
        self.samples = cfg.logging.sample_trajectories
        self.entries = {env.name: environment(env.name) for env in cfg.environments}  # their log_task hooks
        self.run = None
        wb = cfg.logging.wandb
        if wb.mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            # a wandb service inherited from a parent process (a notebook, a test) may still hold a killed run of
            # ours under the same id: this driver starts its own
            os.environ.pop("WANDB_SERVICE", None)
            import wandb

            self.run = wandb.init(
                project=wb.project,
                entity=wb.entity,
                name=run_id,
                id=run_id,
                dir=str(self.output_dir),
                mode=wb.mode,
                tags=wb.tags,
                config=cfg.model_dump(mode="json"),
                settings=wandb.Settings(console="off"),
                resume="allow" if resume else None,  # a resumed run continues the same wandb run (same id)
            )

    def log(self, phase: str, metrics: dict[str, float]) -> None:
        """One row: to metrics.jsonl (with its phase, "warmup" or "rl") and to wandb."""
        row = {"phase": phase, "time": time.time(), **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.run is not None:
            self.run.log(metrics)

    def log_trajectories(self, step: int, phase: str, trajectories: list[Trajectory]) -> None:
        """Each episode as a row of trajectories.jsonl; its screenshots (a browser episode's) as PNG files under
        ``screenshots/<phase>-<step>/``, the row naming them (``metadata.screenshots``, relative to the run directory)."""
        for i, t in enumerate(trajectories):
            self._write_screenshots(t, f"{phase}-{step}", i)
        with self.trajectories_path.open("a") as f:
            for t in trajectories:
                row = t.to_dict()
                entry = self.entries.get(row["task"]["env"])
                if entry is not None:  # a Harbor task's tests by hash, not in every row
                    row["task"] = entry.logged_task(row["task"])
                f.write(json.dumps({"step": step, "phase": phase, **row}) + "\n")
        if self.run is not None and self.samples and trajectories:
            import wandb

            # breakdown: each check's score as JSON, so a reward of 0.5 says which check failed
            table = wandb.Table(columns=["step", "task", "reward", "breakdown", "failed", "turns", "transcript"])
            for t in trajectories[: self.samples]:
                reward = t.reward.value if t.reward else None
                breakdown = json.dumps(t.reward.breakdown if t.reward else {})
                table.add_data(step, t.task.id, reward, breakdown, t.failure or "", len(t.turns), render_messages(t))
            self.run.log({f"samples/{phase}": table})

    def _write_screenshots(self, traj: Trajectory, batch: str, index: int) -> None:
        import base64

        shots = traj.metadata.pop("screenshots_png", None)
        if not shots:
            return
        folder = self.output_dir / "screenshots" / batch
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for j, data in enumerate(shots):
            path = folder / f"{index:04d}-{j}.png"  # names of our own: nothing from the sandbox reaches a host path
            path.write_bytes(base64.b64decode(data))
            paths.append(str(path.relative_to(self.output_dir)))
        traj.metadata["screenshots"] = paths

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
