"""A whole job from the command line: directories, resume, Ray start and stop, the cold start, RL steps with their
held-out evaluations, checkpoints, the final report, and the one-line errors a user acts on.

The RL machinery itself (actors, a step, the warm start) is trainer/loop.py's RLJob; this module drives it.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

from sandforge.config import JobConfig, dump_config
from sandforge.runlog import RunLogger
from sandforge.trainer.eta import RunClock, RunPlan
from sandforge.trainer.loop import JobError, RLJob, console, job_images, make_run_id, progress, rl_steps, step_line


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _write_report(out: Path) -> None:
    """The curves as report.png and report.html (``sandforge report``); a plotting failure never fails the run."""
    from sandforge.report import write_report

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


def _eval_record(cfg: JobConfig, out: Path, resume: bool, start: int):
    """The run's eval.json (None without held-out evaluation); a resumed run drops evaluations after ``start``."""
    if not cfg.eval.tasks_per_family:
        return None
    from sandforge.rollout.evaluate import EvalRecord

    path = out / "eval.json"
    if not resume:
        path.unlink(missing_ok=True)
    record = EvalRecord(path, cfg.eval.samples, cfg.eval.tasks_per_family)
    record.resume_from(start)
    return record


def eval_summary(result: dict) -> str:
    """Before -> after held-out success per environment, for the end of a run."""
    if "before" not in result:
        return "held-out eval: nothing measured"
    b, a = result["before"], result["after"]
    lines = [f"held-out success (eval.json): {100 * b['success']:.1f}% after step {b['step']} -> "
             f"{100 * a['success']:.1f}% after step {a['step']} ({result['delta_points']['success']:+.1f} points)"]
    for env, delta in result["delta_points"]["per_env"].items():
        before = b["per_env"].get(env, {}).get("success", 0.0)
        after = a["per_env"].get(env, {}).get("success", 0.0)
        lines.append(f"  {env}: {100 * before:.1f}% -> {100 * after:.1f}% ({delta:+.1f})")
    return "\n".join(lines)


def run(cfg: JobConfig, resume: bool = False, sft_only: bool = False) -> Path:
    """Run a whole job; returns the run directory. Ctrl-C (or SIGTERM) stops cleanly and removes the run's containers.

    ``resume``: continue the run in ``run.output_dir`` from its newest complete checkpoint (same run id and wandb run;
    rows logged after that checkpoint are dropped, the killed run's containers reaped). ``sft_only`` (``sandforge
    sft``): the supervised cold start alone, ending with the checkpoint ``sandforge train`` can start from.
    With ``eval.tasks_per_family``, held-out success is measured before RL, every ``eval.every`` steps and at the end
    (``eval`` rows, eval.json)."""
    import ray

    from sandforge.environments.sandbox.daemon import docker_client
    from sandforge.environments.sandbox.images import build_images
    from sandforge.environments.sandbox.labels import driver_labels
    from sandforge.environments.sandbox.lifecycle import reap_dead_runs, remove_run_containers

    from sandforge.trainer.checkpoint import checkpoint_dir, resume_point, truncate_jsonl

    out = Path(cfg.run.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = 0
    if resume:
        start, _ = resume_point(out)
        run_id = (out / "run_id").read_text().strip()
        # rows past the checkpoint are about to be made again
        truncate_jsonl(out / "metrics.jsonl", lambda r: _kept_on_resume(r, start))
        truncate_jsonl(out / "trajectories.jsonl", lambda r: _kept_on_resume(r, start))
        console.print(f"[bold]sandforge[/] resuming run [cyan]{run_id}[/] after step {start} → {out}")
    else:
        run_id = make_run_id(cfg.run.name)
        dump_config(cfg, out / "config.yaml")
        (out / "run_id").write_text(run_id + "\n")
        console.print(f"[bold]sandforge[/] run [cyan]{run_id}[/] → {out}")
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    logger = job = None
    try:
        client = docker_client()
        reaped = reap_dead_runs(client)  # containers of drivers that died on this host (crash, SIGKILL)
        if reaped:
            console.print(f"reaped {sum(reaped.values())} container(s) of dead run(s): {', '.join(sorted(reaped))}")
        images = build_images([], base_image=cfg.sandbox.base_image, client=client, mirror=cfg.sandbox.mirror,
                              contexts=job_images(cfg))
        ray.init(address=cfg.ray.address or "local",  # "local": a new instance, never a cluster found lying around
                 num_cpus=cfg.ray.num_cpus, include_dashboard=False, log_to_driver=False,
                 object_store_memory=None if cfg.ray.address else 256 * 1024**2)
        for sig in previous:  # after ray.init, which installs handlers of its own
            signal.signal(sig, _raise_interrupt)
        logger = RunLogger(out, cfg, run_id, resume=resume)
        with progress() as bar:
            job = RLJob(cfg, run_id, images, logger, bar, driver_labels(run_id))
            job.clock = RunClock(RunPlan.of(cfg, start, warm=not resume, sft_only=sft_only))
            bar.console.print(job.clock.line(), soft_wrap=True)
            if resume:
                job.restore(start)
            else:
                if cfg.pretrain.steps:
                    job.pretrain()
                if cfg.warmup.steps:
                    job.warmup()
                    bar.console.print(job.clock.line(), soft_wrap=True)
                job.checkpoint(0)  # the policy RL starts from (after the warm start), for comparison and evaluation
            if sft_only:
                policy = checkpoint_dir(out, 0) / "policy"
                console.print(f"[green]done[/]: SFT checkpoint in {policy}; start RL from it with "
                              f"model.init_from={policy}", soft_wrap=True)
                return out
            record = _eval_record(cfg, out, resume, start)
            total, e = cfg.trainer.steps, cfg.eval
            if record is not None and not record.has(start) and (start == 0 or (e.every and start % e.every == 0)):
                record.add(job.evaluate(start))  # before RL: the SFT checkpoint
                bar.console.print(job.clock.line(), soft_wrap=True)
            steps = bar.add_task("RL steps", total=total, completed=start)
            for step, metrics in rl_steps(job, start):
                logger.log("rl", metrics)
                bar.update(steps, advance=1, description=f"RL steps (reward {metrics['reward/mean']:.2f})")
                bar.console.print(f"{step_line(step, total, metrics)}  ({job.clock.line()})", soft_wrap=True)
                every = cfg.trainer.checkpoint_every
                if every and (step + 1) % every == 0 and step + 1 < total:
                    job.checkpoint(step + 1)
                if record is not None and e.every and (step + 1) % e.every == 0 and step + 1 < total:
                    record.add(job.evaluate(step + 1))
            policy = job.checkpoint(total)
            if record is not None and total and not record.has(total):
                record.add(job.evaluate(total))
        if record is not None:
            console.print(eval_summary(record.as_dict()), soft_wrap=True)
        console.print(f"[green]done[/]: metrics in {out / 'metrics.jsonl'}, policy in {policy}", soft_wrap=True)
        _write_report(out)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping actors and removing this run's containers[/]")
        raise
    except ray.exceptions.RayActorError as e:  # a trainer rank or the engine died (killed, OOM, node lost)
        raise JobError(actor_died(e, out)) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if logger is not None:
            logger.close()
        if job is not None and sys.exc_info()[0] is None:  # interrupted or failed: the label sweep below suffices
            job.close()
        if ray.is_initialized():
            ray.shutdown()
        try:
            removed = remove_run_containers(run_id)
        except Exception as e:  # the daemon itself is gone: say so, the reaper of the next start takes over
            console.print(f"[red]could not remove containers of {run_id}: {e}[/]")
        else:
            if removed:
                console.print(f"removed {removed} leftover container(s) of {run_id}")
    return out
