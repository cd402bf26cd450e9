"""``sandforge train`` and ``sandforge sft``: a whole run from its config: the run directory, resume, the fleet
(job/fleet/lifecycle.py), the cold start, RL steps with their held-out evaluations, checkpoints, the final report, and the
one-line errors a user acts on.
"""

from __future__ import annotations

import re
from pathlib import Path

from rich.markup import escape

from sandforge.config import JobConfig, dump_config
from sandforge.job import cold_start
from sandforge.job.checkpoint import checkpoint_dir, restore_checkpoint, resume_point, save_checkpoint, truncate_jsonl
from sandforge.job.console import JobError, console, make_run_id, progress
from sandforge.job.eta import RunClock, RunPlan
from sandforge.job.evaluation import EvalRecord, eval_summary, run_record
from sandforge.job.fleet.lifecycle import open_fleet
from sandforge.job.no_signal import SilentStreak, silent_in
from sandforge.job.rl_job import RLJob, rl_steps, step_line
from sandforge.job.runlog import RunLogger
from sandforge.job.task_sampler import TaskSampler


def _write_report(out: Path) -> None:
    """The curves as report.png and report.html (``sandforge report``); a plotting failure never fails the run."""
    from sandforge.job.report import write_report

    try:
        png, html = write_report(out)
    except Exception as e:  # noqa: BLE001 - the run's data is safe in metrics.jsonl; report can be rerun
        console.print(f"[yellow]report: {type(e).__name__}: {e} (rerun `sandforge report {out}`)[/]")
    else:
        console.print(f"report: {png} and {html}", soft_wrap=True)


def actor_died(error: Exception, out: Path) -> str:
    """One line for a run stopped by a dead actor: which one, and how to continue from the last checkpoint."""
    latest = out / "checkpoints" / "latest"
    last = latest.read_text().strip() if latest.is_file() else None
    name = re.search(r"class_name: (\w+)", str(error))
    who = f"a {name.group(1)} actor" if name else "an actor of the run"
    if not last:
        return f"{who} died (killed, out of memory or its node lost) before the first checkpoint: start the run again"
    return (f"{who} died (killed, out of memory or its node lost), so the run stopped; continue it from its last "
            f"checkpoint ({last}) with `sandforge train CONFIG --resume {out}`")


def _kept_on_resume(row: dict, start: int) -> bool:
    """Rows a run resumed after ``start`` RL steps keeps: the warm start's, RL steps before ``start``, evaluations of
    the policy at ``start`` or earlier (an evaluation at step s measures the policy after s steps)."""
    phase, step = row.get("phase"), row.get("step", 0)
    if phase == "rl":
        return step < start
    if phase == "eval":
        return step <= start
    return True


def start_run(cfg: JobConfig, resume: bool) -> tuple[Path, str, int]:
    """The run directory, the run id and the RL step to start from. A resumed run keeps its id and drops the rows
    logged after its newest complete checkpoint (they are about to be made again); a new one writes its config."""
    out = Path(cfg.run.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        run_id = make_run_id(cfg.run.name)
        dump_config(cfg, out / "config.yaml")
        (out / "run_id").write_text(run_id + "\n")
        console.print(f"[bold]sandforge[/] run [cyan]{run_id}[/] → {out}", soft_wrap=True)
        return out, run_id, 0
    start, _ = resume_point(out)
    run_id = (out / "run_id").read_text().strip()
    truncate_jsonl(out / "metrics.jsonl", lambda r: _kept_on_resume(r, start))
    truncate_jsonl(out / "trajectories.jsonl", lambda r: _kept_on_resume(r, start))
    console.print(f"[bold]sandforge[/] resuming run [cyan]{run_id}[/] after step {start} → {out}", soft_wrap=True)
    return out, run_id, start


def run(cfg: JobConfig, resume: bool = False, sft_only: bool = False, sampler: TaskSampler | None = None) -> Path:
    """Run a whole job; returns the run directory. Ctrl-C (or SIGTERM) stops cleanly and removes the run's containers.

    ``resume``: continue the run in ``run.output_dir`` from its newest complete checkpoint (same run id and wandb run;
    rows logged after that checkpoint are dropped, the killed run's containers reaped). ``sft_only`` (``sandforge
    sft``): the supervised cold start alone, ending with the checkpoint ``sandforge train`` can start from.
    With ``eval.tasks_per_family``, held-out success is measured before RL, every ``eval.every`` steps and at the end
    (``eval`` rows, eval.json). ``sampler``: the job's task sources as the preflight opened them (opened here
    otherwise); every part of the run draws from these, none opens them again."""
    import ray

    sampler = sampler or TaskSampler(cfg.environments, cfg.run.seed)
    out, run_id, start = start_run(cfg, resume)
    logger = None
    try:
        with open_fleet(cfg, run_id, sampler=sampler) as fleet, progress() as bar:
            logger = RunLogger(out, cfg, run_id, resume=resume)
            plan = RunPlan.of(cfg, start, warm=not resume, sft_only=sft_only, sampler=sampler)
            job = RLJob(cfg, fleet, logger, bar, RunClock(plan), sampler=sampler)
            bar.console.print(job.clock.line(), soft_wrap=True)
            record = None if sft_only else run_record(cfg, out, resume, start)
            if resume:
                restore_checkpoint(job, start)
            else:
                if record is not None and cfg.eval.base:
                    record.set_base(job.evaluate(0, base=True))
                cold_start.before_rl(job, rl_follows=not sft_only)
            if sft_only:
                policy = checkpoint_dir(out, 0) / "policy"
                console.print(f"[green]done[/]: SFT checkpoint in {policy}; start RL from it with "
                              f"model.init_from={policy}", soft_wrap=True)
                return out
            policy = rl_phase(job, bar, record, start)
        if record is not None:
            console.print(eval_summary(record), soft_wrap=True)
        console.print(f"[green]done[/]: metrics in {out / 'metrics.jsonl'}, policy in {policy}", soft_wrap=True)
        _write_report(out)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping actors and removing this run's containers[/]")
        raise
    except ray.exceptions.RayActorError as e:  # a trainer rank or the engine died (killed, OOM, node lost)
        raise JobError(actor_died(e, out)) from None
    finally:
        if logger is not None:
            logger.close()
    return out


def rl_phase(job: RLJob, bar, record: EvalRecord | None, start: int) -> Path:
    """RL steps ``start`` .. ``trainer.steps`` with their checkpoints and held-out evaluations (into ``record``, the
    run's eval.json); returns the final policy's directory."""
    cfg = job.cfg
    total, e = cfg.trainer.steps, cfg.eval
    if record is not None and not record.has(start) and (start == 0 or (e.every and start % e.every == 0)):
        record.add(job.evaluate(start))  # before RL: the SFT checkpoint
        bar.console.print(job.clock.line(), soft_wrap=True)
    steps = bar.add_task("RL steps", total=total, completed=start)
    streak = SilentStreak()
    for step, metrics in rl_steps(job, start):
        job.logger.log("rl", metrics)
        bar.update(steps, advance=1, description=f"RL steps (reward {metrics['reward/mean']:.2f})")
        bar.console.print(f"{step_line(step, total, metrics)}  ({job.clock.line()})", soft_wrap=True)
        for warning in streak.update(*silent_in(metrics)):
            bar.console.print(f"[yellow]{escape(warning)}[/]", soft_wrap=True)
        every = cfg.trainer.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < total:
            save_checkpoint(job, step + 1)
        if record is not None and e.every and (step + 1) % e.every == 0 and step + 1 < total:
            record.add(job.evaluate(step + 1))
    policy = save_checkpoint(job, total)
    if record is not None and total and not record.has(total):
        record.add(job.evaluate(total))
    return policy
