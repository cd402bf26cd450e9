"""``sandforge eval``: held-out success of a checkpoint, per environment, with pass@k; no trainer is started.

The same parts as a training run serve the episodes (images, the embedded engine with the checkpoint's weights, rollout
workers and their sandboxes), and the same fixed held-out tasks as a run's ``eval`` section (rollout/evaluate.py), so
its numbers compare with a run's eval.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.table import Table

from sandforge.config import JobConfig
from sandforge.trainer.loop import console, make_run_id, progress
from sandforge.trainer.workers import collect_episodes, start_workers


def evaluate_checkpoint(cfg: JobConfig, checkpoint: Path, out_file: Path) -> dict:
    """Run ``cfg.eval.samples`` episodes of each held-out task with the policy in ``checkpoint``; write the summary
    (success and pass@k, overall and per environment) to ``out_file`` and return it."""
    import ray

    from sandforge.environments.sandbox.daemon import docker_client
    from sandforge.environments.sandbox.images import build_images
    from sandforge.environments.sandbox.labels import driver_labels
    from sandforge.environments.sandbox.lifecycle import reap_dead_runs, remove_run_containers
    from sandforge.models.policy import load_policy, policy_config
    from sandforge.rollout.engine import InferenceEngine
    from sandforge.rollout.evaluate import heldout_tasks, summarize
    from sandforge.rollout.worker import RolloutWorker

    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": checkpoint})})
    run_id = make_run_id(f"{cfg.run.name}-eval")
    e = cfg.eval
    tasks = heldout_tasks(cfg.environments, e.tasks_per_family)
    client = docker_client()
    reap_dead_runs(client)
    images = build_images(sorted({env.name for env in cfg.environments}), base_image=cfg.sandbox.base_image,
                          client=client, mirror=cfg.sandbox.mirror)
    ray.init(address=cfg.ray.address or "local",  # "local": a new instance, never a cluster found lying around
             num_cpus=cfg.ray.num_cpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=None if cfg.ray.address else 256 * 1024**2)
    workers = []
    try:
        policy = load_policy(checkpoint)
        engine = ray.remote(num_cpus=0)(InferenceEngine).options(name=f"engine-{run_id}").remote(
            policy_config(policy), cfg.engine.max_batch_size, cfg.engine.session_memory_mb, cfg.run.seed,
            os.cpu_count() or 1)
        ray.get(engine.load_weights.remote({k: v.detach() for k, v in policy.state_dict().items()}, 0))
        del policy
        job = cfg.model_dump(mode="json")
        workers = start_workers(RolloutWorker, cfg.rollout.workers, job, run_id, f"engine-{run_id}", images,
                                driver_labels(run_id))
        episodes = [(task, f"eval/{task.id}") for task in tasks for _ in range(e.samples)]
        with progress() as bar:
            trajs = collect_episodes(workers, [x[0] for x in episodes], [x[1] for x in episodes], cfg.run.seed, 0,
                                     False, bar, f"held-out eval: {len(tasks)} tasks x {e.samples}")
        summary = {"checkpoint": str(checkpoint), **summarize(trajs, e.samples)}
    finally:
        if workers:
            try:
                ray.get([w.close.remote() for w in workers], timeout=30)
            except Exception as err:  # noqa: BLE001 - the label sweep below removes what is left
                console.print(f"[yellow]workers did not close cleanly: {err}[/]")
        ray.shutdown()
        remove_run_containers(run_id)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(summary, indent=1) + "\n")
    console.print(summary_table(summary))
    console.print(f"[green]done[/]: {out_file}")
    return summary


def summary_table(summary: dict) -> Table:
    k = summary["k"]
    table = Table(title=f"held-out success: {summary['tasks']} tasks x {summary['episodes'] // max(summary['tasks'], 1)}"
                        f" episodes")
    for column in ("environment", "tasks", "success (pass@1)", f"pass@{k}", "failed episodes"):
        table.add_column(column)
    rows = [*summary["per_env"].items(), ("all", summary)]
    for env, s in rows:
        table.add_row(env, str(s["tasks"]), f"{100 * s['success']:.1f}%", f"{100 * s['pass@k']:.1f}%",
                      str(s["failed"]))
    return table
