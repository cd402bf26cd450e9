"""Rollout workers seen from the driver: where they run, how episodes are spread over them, what a dead one costs.

Placement: worker i goes to alive node i mod n (node affinity), so on a cluster every node's Docker daemon runs
sandboxes. Before each batch the driver waits until every worker answers: one just restarted by Ray takes its
episodes instead of failing them because it was still coming up, and one that cannot come back (its node lost) is
started again on a node that is left. Episodes a worker had in flight when it died come back failed
(``lost_episodes``), counted in metrics, never silently missing and never run twice.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict

from rich.progress import Progress

from sandforge.types import Reward, Task, Trajectory

WORKER_RESTARTS = 4  # per rollout worker and run
READY_TIMEOUT_S = 120.0  # how long a batch waits for a restarting worker before handing it its episodes anyway


def episode_seed(run_seed: int, group: str, index: int) -> int:
    """Sampling seed of episode ``index`` of ``group`` (the group names the step): the same on a resumed run."""
    digest = hashlib.blake2b(f"{run_seed}/{group}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def worker_gone() -> tuple[type, ...]:
    """What ``ray.get`` on a rollout worker raises once the worker is gone: it died, or it is pinned to a lost node."""
    import ray

    return ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError


def worker_strategies(n: int) -> list:
    """A scheduling strategy per worker: round-robin over the alive nodes, the driver's first; one node: default.
    (Ray's soft node affinity and SPREAD are best effort: with zero-CPU actors both put every worker on one node.)"""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    if len(nodes) < 2:
        return ["DEFAULT"] * n
    head = ray.get_runtime_context().get_node_id()
    nodes = sorted(nodes, key=lambda node_id: (node_id != head, node_id))
    return [NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False) for i in range(n)]


class Workers(list):
    """The run's rollout worker handles (a list: ``workers[i]``), able to replace one that is gone for good: Ray
    restarts a worker that dies ``restarts`` times, on its node; one pinned to a lost node, or out of restarts, is
    started again on any node (``replace``), so a lost node costs its in-flight episodes, not half of every step."""

    def __init__(self, worker_class: type, n: int, *args, restarts: int = WORKER_RESTARTS):
        import ray

        self.make = lambda i, strategy="DEFAULT": ray.remote(
            num_cpus=0, scheduling_strategy=strategy, max_restarts=restarts)(worker_class).remote(i, *args)
        super().__init__(self.make(i, strategy) for i, strategy in enumerate(worker_strategies(n)))
        self.replaced = 0

    def replace(self, i: int) -> None:
        self[i] = self.make(i)
        self.replaced += 1


def start_workers(worker_class: type, n: int, *args, restarts: int = WORKER_RESTARTS) -> Workers:
    """``n`` rollout worker actors (``worker_class(i, *args)``), one per node in turn (``worker_strategies``)."""
    return Workers(worker_class, n, *args, restarts=restarts)


def wait_ready(workers: list, timeout: float = READY_TIMEOUT_S) -> None:
    """Wait until every worker answers ``ready()``: a worker Ray is restarting gets the time to come back; one gone
    for good (its node lost, restarts used up) is replaced when ``workers`` can (``Workers``). A worker still down
    after ``timeout`` gets its episodes anyway: they come back failed through ``collect_episodes``."""
    import ray

    deadline = time.monotonic() + timeout
    for i in range(len(workers)):
        replaced = False
        while time.monotonic() < deadline:
            try:
                ray.get(workers[i].ready.remote(), timeout=max(0.1, deadline - time.monotonic()))
                break
            except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnschedulableError):  # pinned to a lost node
                if replaced or not isinstance(workers, Workers):
                    break
                workers.replace(i)
                replaced = True
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.2)


def collect_episodes(workers: list, tasks: list[Task], groups: list[str], run_seed: int, version: int,
                     scripted: bool, bar: Progress, label: str,
                     temperature: float | list[float] | None = None) -> list[Trajectory]:
    """Spread episodes over rollout workers (Ray handles) and gather them all, failed ones included, with a bar.
    ``temperature``: the policy samples at it, not at ``rollout.temperature`` (held-out evaluation; 0: greedy); a
    list gives each episode its own (a sampled and a greedy evaluation in one pass)."""
    import ray

    wait_ready(workers)
    # one call per episode, dealt to the workers in turn: each worker's own gate runs rollout.concurrency of them at
    # once across calls, and the bar moves as each episode ends (one call per worker moved it once per worker)
    seen: dict[str, int] = {}
    seeds = []
    for group in groups:
        seen[group] = seen.get(group, -1) + 1  # the episode's index within its group
        seeds.append(episode_seed(run_seed, group, seen[group]))
    temperatures = temperature if isinstance(temperature, list) else [temperature] * len(tasks)
    if len(temperatures) != len(tasks):
        raise ValueError(f"{len(temperatures)} temperatures for {len(tasks)} episodes")
    pending = {}
    for i, k in enumerate(longest_first(tasks)):
        task, group, seed = tasks[k], groups[k], seeds[k]
        index = i % len(workers)
        shard = [asdict(task)]
        pending[workers[index].run_episodes.remote(shard, [group], version, scripted, [seed], temperatures[k])] = (
            index, shard, [group])
    out: list[Trajectory] = []
    job = bar.add_task(label, total=len(tasks))
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        index, ts, gs = pending.pop(done[0])
        try:
            out += [Trajectory.from_dict(d) for d in ray.get(done[0])]
        except worker_gone() as e:  # the worker died (killed, OOM) or its node is gone
            out += lost_episodes(ts, gs, version, index, e)
        bar.advance(job, len(ts))
    bar.remove_task(job)
    return out


def longest_first(tasks: list[Task]) -> list[int]:
    """The order to start ``tasks`` in: the most reference calls first (a task's ``solution``, the proxy for how long
    its episode runs), ties in the given order. With more episodes than slots, the long ones then run beside the short
    ones instead of last, holding an otherwise empty batch: in the quickstart's held-out evaluation, in config order,
    the last minute went to a few browser (7 calls, 126 s an episode) and notion episodes while terminal's took 37 s."""
    return sorted(range(len(tasks)), key=lambda k: -len(tasks[k].solution or []))


def lost_episodes(tasks: list[dict], groups: list[str], version: int, worker: int,
                  error: Exception) -> list[Trajectory]:
    """The episodes a dead rollout worker had in flight, as failed episodes: counted in metrics (``failed_worker``),
    kept out of the gradient, never silently missing. Their sandboxes carry the run's label: the end-of-run sweep (or
    the reaper) removes them."""
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    reason = f"worker: rollout worker {worker} died mid-episode ({type(error).__name__}: {cause})"
    return [Trajectory(task=Task.from_dict(t), group=g, failed=True, failure=reason, finish_reason="error",
                       policy_version=version, reward=Reward(0.0, False, reason=reason), metadata={"worker": worker})
            for t, g in zip(tasks, groups)]


def common_failure(trajs: list[Trajectory]) -> str | None:
    """The one reason every episode failed for, when at least two ran and all failed alike (numbers aside: "worker 0"
    and "worker 1" are the same reason); None otherwise. Such a batch means the job cannot work (a tokenizer that does
    not load, a sandbox image that does not start), not that the policy lost: the run stops with it in one line."""
    import re

    if len(trajs) < 2 or not all(t.failed for t in trajs):
        return None
    first = [(t.failure or "unknown").strip().splitlines()[0] if (t.failure or "").strip() else "unknown"
             for t in trajs]
    if len({re.sub(r"\d+", "#", f) for f in first}) != 1:
        return None
    return first[0]


def stop_if_all_failed(trajs: list[Trajectory], label: str) -> None:
    """Every episode of a batch failed for one reason (``common_failure``): the job cannot work as set up; JobError
    says why in one line."""
    from sandforge.job.console import JobError

    reason = common_failure(trajs)
    if reason is not None:
        raise JobError(f"all {len(trajs)} episodes of '{label}' failed, each with: {reason}")

