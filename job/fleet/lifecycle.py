"""The fleet of one job: everything a run starts and stops, in one place for ``train``, ``sft``, ``eval`` and ``serve``.

``open_fleet`` does, in order: Ctrl-C and SIGTERM become KeyboardInterrupt (so every exit path below runs); the
containers of dead drivers on this host are reaped; the job's images are built (each environment's, a plugin's from its
package, a Harbor task's from its folder); Ray starts, its workers at the driver's priority; where each part runs is
decided (job/fleet/placement.py: CPU, or GPUs Ray reserves) and stated in one line once the parts report it; the trainer
ranks (DeepSpeed, when the job trains); the inference engine, named ``engine-<run id>`` so rollout workers find it by name; the
weight sync from rank 0 to the engine; the rollout workers, one per node in turn. Leaving the block closes the workers'
warm sandboxes, stops Ray, removes every container labelled with the run and puts the signal handlers back, whether
the job ended, failed or was interrupted.

With ``engine.remote`` no engine starts: the workers generate through that server, and the weights reach it through
disk (job/fleet/weight_sync.py ``DiskWeightSync``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from sandforge.config import JobConfig
from sandforge.job.console import console, phase
from sandforge.models.device import engine_dtype
from sandforge.job.fleet.placement import Placement, cluster_gpus, describe, placement_group, resolve_placement
from sandforge.job.fleet.trainer_ranks import TrainerRanks

ALL_PARTS = frozenset({"trainer", "engine", "workers"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Fleet:
    """Handles to one job's actors. ``ranks`` is empty when the job does not train (eval, serve); ``workers`` is empty
    when it runs no episodes (serve); ``sync`` pushes the ranks' weights to the engine."""

    cfg: JobConfig
    run_id: str
    parts: frozenset[str] = ALL_PARTS
    images: dict[str, str] = field(default_factory=dict)  # image name -> tag, every image the job's tasks use
    ranks: TrainerRanks = field(default_factory=TrainerRanks)
    engine: Any = None  # the engine actor; None with engine.remote
    workers: list = field(default_factory=list)
    sync: Any = None
    placement: Placement | None = None
    bundles: Any = None  # the placement group colocated parts share (job/fleet/placement.py)

    def push_weights(self, version: int) -> None:
        self.sync.push(version)

    def before_update(self) -> None:
        """The trainer is about to step: an engine sharing its GPU frees its idle caches first."""
        if self.placement is not None and self.placement.colocate and self.engine is not None:
            import ray

            ray.get(self.engine.release_memory.remote())

    def close_workers(self) -> None:
        """The workers remove their warm sandboxes (best effort: the run's label sweep follows anyway)."""
        import ray

        try:
            ray.get([w.close.remote() for w in self.workers], timeout=30)
        except Exception as e:  # noqa: BLE001 - the label sweep removes what is left
            console.print(f"[yellow]workers did not close cleanly: {e}[/]")


def job_images(cfg: JobConfig, sampler: Any = None) -> dict[str, Any]:
    """Every image the job's tasks run in (image name -> folder with its Dockerfile): each environment's own (a
    plugin's may live in its package, or reuse a built-in's), plus the ones tasks bring (a Harbor task's; ``sampler``:
    the job's task sources, a ``TaskSampler``, opened here when not given)."""
    from sandforge.job.task_sampler import TaskSampler
    from sandforge.registry import environment

    contexts = {}
    for env in cfg.environments:
        entry = environment(env.name)
        if entry.image_name is not None:
            contexts[entry.image_name] = entry.image_context()
    contexts |= (sampler or TaskSampler(cfg.environments, cfg.run.seed)).images(cfg.sandbox.base_map)
    return contexts


def build_job_images(cfg: JobConfig, sampler: Any = None) -> dict[str, str]:
    """Reap dead drivers' containers, then build (or find up to date) every image the job needs: name -> tag."""
    from sandforge.sandbox.daemon import docker_client
    from sandforge.sandbox.images import build_images
    from sandforge.sandbox.lifecycle import reap_dead_runs

    client = docker_client()
    # containers of drivers that died on this host (crash, SIGKILL); each run named on a line of its own, unwrapped
    for run, n in sorted(reap_dead_runs(client).items()):
        console.print(f"reaped {n} container(s) of dead run {run}", soft_wrap=True, markup=False, highlight=False)
    images = build_images([], base_image=cfg.sandbox.base_image, client=client, mirror=cfg.sandbox.mirror,
                          contexts=job_images(cfg, sampler))
    if cfg.agent.harness is not None:  # the harness installed on top of every image its episodes run in
        from sandforge.sandbox.images import layered_images
        from sandforge.rollout.harnesses import find_harness

        harness = find_harness(cfg.agent.harness, cfg.agent.options)
        if harness.image_folder() is not None:
            images = layered_images(client, images, harness.image_folder(), harness.name)
    return images


def start_ray(cfg: JobConfig, runtime_env: dict | None = None) -> None:
    """A new local Ray instance (never a cluster found lying around), or the cluster ``ray.address`` names. Ray starts
    its worker processes at nice 15 by default, so a trainer rank would lose most of a core to any normal process:
    locally they run at the driver's own priority. (A cluster's raylets were started with their own setting.)
    ``runtime_env``: Ray's, for every worker (bench/rl_step.py's timing hook)."""
    import logging

    import ray

    if ray.is_initialized():  # this process joined Ray itself (a notebook, a test harness): the fleet uses it
        return
    local = cfg.ray.address is None
    # logging_level: Ray's own start-up notices (its local instance, token authentication) are not the user's concern
    ray.init(address=cfg.ray.address or "local", num_cpus=cfg.ray.num_cpus, include_dashboard=False,
             logging_level=logging.ERROR, log_to_driver=False, object_store_memory=256 * 1024**2 if local else None,
             _system_config={"worker_niceness": 0} if local else None,  # relative to the raylet: the driver's
             runtime_env=runtime_env)


def start_trainer_ranks(cfg: JobConfig, placement: Placement, bundles: Any = None) -> TrainerRanks:
    """``trainer.world_size`` DeepSpeed ranks, one torch.distributed group (gloo on CPU, NCCL on GPUs), each where
    ``placement`` puts it."""
    import ray

    from sandforge.trainer.rank import RolloutShape, TrainerRank

    world = cfg.trainer.world_size
    threads = max(1, (os.cpu_count() or 1) // world)
    port, shape = free_port(), RolloutShape.of(cfg.rollout)
    rank_actor = ray.remote(TrainerRank)
    return TrainerRanks([rank_actor.options(**placement.rank_options(r, bundles)).remote(
        r, world, "127.0.0.1", port, cfg.model, cfg.trainer, shape, cfg.run.seed, threads, placement.trainer)
        for r in range(world)])


def start_engine(cfg: JobConfig, run_id: str, policy_config: dict, placement: Placement, bundles: Any = None):
    """The inference engine actor for the policy ``policy_config`` describes (weights come later, by a push), where
    ``placement`` puts it."""
    import ray

    from sandforge.engine.ray_actor import EngineActor

    options = placement.engine_options(bundles) | {"name": engine_name(run_id)}
    return ray.remote(EngineActor).options(**options).remote(
        policy_config, cfg.engine, cfg.run.seed, cfg.engine.threads or os.cpu_count() or 1, placement.engine)


def state_placement(fleet: Fleet) -> str:
    """The run's line on where its parts run, from what the ranks and the engine report (printed as the fleet
    starts)."""
    import ray

    ranks = fleet.ranks.each("device_name")
    engine = ray.get(fleet.engine.device_name.remote()) if fleet.engine is not None else None
    line = describe(fleet.placement, ranks, engine, engine_dtype(fleet.cfg.engine.dtype, fleet.placement.engine))
    console.print(line, soft_wrap=True)
    return line


def model_spread(trainer) -> bool:
    """Whether the model is spread over the ranks, by expert parallelism (experts) or ZeRO-3 (every parameter): then
    all of them take part in gathering the whole model for the engine, and rank 0's copy is sent."""
    return trainer.expert_parallel > 1 or trainer.zero_stage == 3


def remote_engine(cfg: JobConfig, ranks: list):
    """``engine.remote``: the weight sync through disk to that server (with trainer ranks), or else the policy being
    evaluated (``model.init_from``) loaded by the server as version 0."""
    import asyncio

    from sandforge.job.console import JobError
    from sandforge.job.fleet.weight_sync import DiskWeightSync, load_remote_weights
    from sandforge.engine.remote import RemoteEngineError

    remote = cfg.engine.remote
    if ranks:
        weights_dir = remote.weights_dir or Path(cfg.run.output_dir) / "weights"
        return DiskWeightSync(remote, ranks, gather_all=model_spread(cfg.trainer), weights_dir=weights_dir)
    if cfg.model.init_from is not None:
        try:
            asyncio.run(load_remote_weights(remote, Path(cfg.model.init_from).resolve(), 0))
        except RemoteEngineError as e:
            raise JobError(f"remote engine: {e}") from None
    return None


def engine_name(run_id: str) -> str:
    return f"engine-{run_id}"


def start_rollout_workers(cfg: JobConfig, run_id: str, images: dict[str, str]) -> list:
    """``rollout.workers`` rollout workers, one per node in turn (job/fleet/rollout_workers.py). They find the engine by
    name: a handle among an actor's arguments is kept in the object store, which may break restarts (ray#53727)."""
    from sandforge.sandbox.labels import driver_labels
    from sandforge.job.fleet.rollout_workers import start_workers
    from sandforge.rollout.worker import RolloutWorker, WorkerSetup

    setup = WorkerSetup(run_id=run_id, engine=engine_name(run_id), images=images, labels=driver_labels(run_id),
                        environments=tuple(cfg.environments), rollout=cfg.rollout, sandbox=cfg.sandbox,
                        model=cfg.model, remote=cfg.engine.remote, agent=cfg.agent)
    return start_workers(RolloutWorker, cfg.rollout.workers, setup)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _interrupts_raise() -> None:
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _raise_interrupt)


@contextlib.contextmanager
def open_fleet(cfg: JobConfig, run_id: str, parts: frozenset[str] = ALL_PARTS,
               policy: dict | None = None, sampler: Any = None) -> Iterator[Fleet]:
    """Start the ``parts`` of the job's fleet (see the module docstring) and stop all of it when the block ends.

    ``policy``: the engine's weights when the fleet has no trainer ranks (``checkpoint_policy``: they are served as
    version 0); with ranks, the engine is built like rank 0's policy and the caller pushes weights (``push_weights``).
    ``sampler``: the job's opened task sources (``TaskSampler``), whose tasks' own images are built.
    """
    import ray

    fleet = Fleet(cfg, run_id, parts)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    _interrupts_raise()
    try:
        if "workers" in parts:
            with phase("building the sandbox images"):
                fleet.images = build_job_images(cfg, sampler)
        with phase("starting Ray"):
            start_ray(cfg)
        _interrupts_raise()  # ray.init installs handlers of its own
        fleet.placement = placement = resolve_placement(cfg, cluster_gpus(), trains="trainer" in parts)
        fleet.bundles = placement_group(placement)
        if "trainer" in parts:
            with phase("starting the trainer ranks (DeepSpeed)"):
                fleet.ranks = start_trainer_ranks(cfg, placement, fleet.bundles)
                fleet.ranks.each("device_name")
        if cfg.engine.remote is not None:  # a separate server: no engine here, the weights go through disk
            fleet.sync = remote_engine(cfg, fleet.ranks)
        elif fleet.ranks:
            from sandforge.job.fleet.weight_sync import WeightSync

            fleet.engine = start_engine(cfg, run_id, fleet.ranks[:1].each("model_config_dict")[0], placement,
                                        fleet.bundles)
            spread = model_spread(cfg.trainer)
            fleet.sync = WeightSync(placement.weight_sync(cfg.trainer.weight_sync, spread), fleet.ranks, fleet.engine,
                                    free_port(), gather_all=spread)
        else:
            fleet.engine = start_engine(cfg, run_id, policy["config"], placement, fleet.bundles)
            ray.get(fleet.engine.load_weights.remote(policy["state_dict"], 0))
        state_placement(fleet)
        if "workers" in parts:
            with phase("starting the rollout workers"):
                fleet.workers = start_rollout_workers(cfg, run_id, fleet.images)
        yield fleet
    finally:
        close_fleet(fleet, clean=sys.exc_info()[0] is None)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def close_fleet(fleet: Fleet, clean: bool) -> None:
    """Workers remove their warm sandboxes (after a clean end only: otherwise the label sweep suffices), Ray stops,
    and every container labelled with the run goes. Never raises: the daemon itself may be gone."""
    import ray

    if clean and fleet.workers:
        fleet.close_workers()
    if fleet.bundles is not None and ray.is_initialized():  # on a cluster, the GPUs go back now
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(fleet.bundles)
    if ray.is_initialized():
        ray.shutdown()
    if "workers" not in fleet.parts:
        return
    from sandforge.sandbox.lifecycle import remove_run_containers

    try:
        removed = remove_run_containers(fleet.run_id)
    except Exception as e:  # noqa: BLE001 - the reaper of the next start takes over
        console.print(f"[red]could not remove containers of {fleet.run_id}: {e}[/]")
    else:
        if removed:
            console.print(f"removed {removed} leftover container(s) of {fleet.run_id}")


def checkpoint_policy(directory: Path) -> dict:
    """A policy checkpoint as the engine of a fleet without trainer ranks takes it (``open_fleet(policy=...)``)."""
    from sandforge.models.build import load_policy, policy_config

    model = load_policy(directory)
    return {"config": policy_config(model), "state_dict": {k: v.detach() for k, v in model.state_dict().items()}}
