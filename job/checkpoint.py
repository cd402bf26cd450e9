"""Checkpoints of a run and resuming from them.

``<output_dir>/checkpoints/step_N/`` holds, after N RL steps:

    DeepSpeed's files        model (MoE balancing biases included: they are persistent buffers) and optimizer state
    policy/                  the standalone policy (rank 0), for ``sandforge serve`` and evaluation
    trainer_rank_R.pt        each rank's torch RNG, step counts (the lr schedule's position), the PPO value head and
                             its optimizer
    driver.pt                step, policy version, task sampler RNG (the data cursor), the driver's RNGs, the engine's
                             sampling generator, the config hash
    complete                 written last: a directory without it is torn (the run died while writing) and is skipped

Nothing here imports torch at module level: the CLI checks ``--resume DIR`` before anything heavy starts.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Callable

from sandforge.config import JobConfig

COMPLETE = "complete"
STEP_DIR = re.compile(r"step_(\d+)$")


class ResumeError(ValueError):
    """Nothing to resume from at the given place; the message says what was looked for."""


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step}"


def complete_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint, oldest first."""
    root = Path(output_dir) / "checkpoints"
    found = []
    for d in root.iterdir() if root.is_dir() else []:
        m = STEP_DIR.match(d.name)
        if m and (d / COMPLETE).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def resume_point(output_dir: Path) -> tuple[int, Path]:
    """The newest complete checkpoint of the run in ``output_dir``; ResumeError when there is none."""
    out = Path(output_dir)
    if not out.is_dir():
        raise ResumeError(f"--resume {out}: no such directory; pass a run's output_dir (run.output_dir)")
    if not (out / "run_id").is_file():
        raise ResumeError(f"--resume {out}: not a sandforge run directory (no run_id file); pass a run's output_dir")
    found = complete_checkpoints(out)
    if not found:
        raise ResumeError(f"--resume {out}: no complete checkpoint under {out / 'checkpoints'} (a checkpoint counts "
                          f"once its '{COMPLETE}' marker is written); start the run again without --resume")
    return found[-1]


def config_hash(cfg: JobConfig) -> str:
    """What must match for a resumed run to continue the same experiment: everything but where it writes and how long
    it runs (trainer.steps may grow) or how it logs."""
    same = cfg.model_dump(mode="json", exclude={"logging": True, "run": {"output_dir"},
                                                "trainer": {"steps", "checkpoint_every"}})
    return hashlib.sha256(json.dumps(same, sort_keys=True, default=str).encode()).hexdigest()[:16]


def save_driver_state(directory: Path, state: dict[str, Any]) -> None:
    import torch

    torch.save(state, Path(directory) / "driver.pt")


def load_driver_state(directory: Path) -> dict[str, Any]:
    import torch

    return torch.load(Path(directory) / "driver.pt", weights_only=False)


def mark_complete(directory: Path) -> None:
    (Path(directory) / COMPLETE).write_text("ok\n")


def truncate_jsonl(path: Path, keep: Callable[[dict], bool]) -> int:
    """Drop the rows of a JSON-lines file that ``keep`` rejects (and a torn last line); returns how many went."""
    path = Path(path)
    if not path.is_file():
        return 0
    rows, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the killed run was writing it
            dropped += 1
            continue
        if keep(row):
            rows.append(line)
        else:
            dropped += 1
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    tmp.replace(path)
    return dropped


def save_checkpoint(job, step: int) -> str:
    """Everything a resumed run needs after ``step`` RL steps (``job``: an RLJob): the ranks' DeepSpeed state and
    policy, then ``driver.pt``; ``complete`` goes last. Returns the policy directory."""
    import ray
    import torch

    directory = str(job.output_dir / "checkpoints")
    state = {"step": step, "policy_version": job.version, "run_id": job.run_id}
    paths = job.ranks.each("save_checkpoint", directory, f"step_{step}", state)
    where = checkpoint_dir(job.output_dir, step)
    save_driver_state(where, {
        **state,
        "sampler_rng": job.sampler.rng.getstate(),  # the data cursor: which tasks come next
        "driver_rng": job.rng.getstate(),
        "torch_rng": torch.get_rng_state(),
        "engine_rng": ray.get(job.engine.rng_state.remote()) if job.engine is not None else None,  # remote: none
        "config_hash": config_hash(job.cfg),
    })
    mark_complete(where)
    (job.output_dir / "checkpoints" / "latest").write_text(f"step_{step}\n")
    return paths[0]


def restore_checkpoint(job, step: int) -> None:
    """Continue ``job`` from checkpoint ``step``: ranks reload (DeepSpeed), RNGs, data cursor and version come back,
    and the engine gets the restored weights."""
    import ray
    import torch

    from sandforge.job.console import console

    where = checkpoint_dir(job.output_dir, step)
    driver = load_driver_state(where)
    if driver["config_hash"] != config_hash(job.cfg):
        console.print(f"[yellow]resume: the config differs from the one {where} was written with (beyond "
                      "run.output_dir, trainer.steps, trainer.checkpoint_every, logging); continuing anyway[/]")
    reference = checkpoint_dir(job.output_dir, 0) / "policy"  # the policy RL started from: the KL reference
    job.ranks.each("load_checkpoint", str(job.output_dir / "checkpoints"), where.name,
                   str(reference) if reference.is_dir() else None)
    job.sampler.rng.setstate(driver["sampler_rng"])
    job.rng.setstate(driver["driver_rng"])
    torch.set_rng_state(driver["torch_rng"])
    job.version = driver["policy_version"]
    job.push_weights()
    if job.engine is not None and driver["engine_rng"] is not None:
        ray.get(job.engine.set_rng_state.remote(driver["engine_rng"]))
