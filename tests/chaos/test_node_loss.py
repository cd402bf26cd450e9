"""Case 11: a Ray worker node is lost from a two-node cluster (``ray.cluster_utils.Cluster`` on this machine) while a
``sandforge train`` driven on it has rollout workers, and so sandboxes, on both nodes. The run either goes on on the
node that is left (the lost worker restarted there, its in-flight episodes failed) or stops with one line and resumes;
either way every step ends with each of its episodes logged exactly once."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest

from harness import finish, metric_rows, run_containers, run_log, start_train, trajectories, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.docker, pytest.mark.slow]

RUN = ["trainer.steps=3", "trainer.checkpoint_every=1", "rollout.workers=2", "rollout.tasks_per_step=2",
       "rollout.group_size=2"]


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    # workers at the driver's priority, as sandforge's local Ray has them (job/fleet/lifecycle.py start_ray): at Ray's default
    # nice 15 a busy machine starves the trainer rank for minutes
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                      "_system_config": {"worker_niceness": 0}})
    yield c
    c.shutdown()


def raylet_pid(node) -> int:
    return node.all_processes["raylet"][0].process.pid


def rollout_worker_raylets() -> list[int]:
    """The raylet (so the node) each live RolloutWorker actor process belongs to: its parent process."""
    parents = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RolloutWorker"):
                stat = Path(f"/proc/{pid}/stat").read_text()
                parents.append(int(stat[stat.rfind(")") + 2 :].split()[1]))
        except (OSError, ValueError):
            continue
    return parents


def test_a_lost_node_costs_its_episodes_not_the_run(tmp_path, cluster, terminal_image, docker_client):
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    address = cluster.address
    out = tmp_path / "run"
    proc = start_train(out, f"ray.address={address}", *RUN)
    wait_for(lambda: (out / "checkpoints" / "step_1" / "complete").is_file(), "step-1 checkpoint", proc=proc, out=out)
    nodes = [raylet_pid(cluster.head_node), raylet_pid(second)]
    raylets = [pid for pid in rollout_worker_raylets() if pid in nodes]  # this cluster's (another run may be going)
    assert sorted(raylets) == sorted(nodes), (
        "workers are placed one per node in turn (job/fleet/rollout_workers.py)")
    run_id = (out / "run_id").read_text().strip()
    wait_for(lambda: run_containers(docker_client, run_id), "sandbox of step 2", proc=proc, out=out)
    cluster.remove_node(second, allow_graceful=False)

    code = finish(proc, out)
    log = run_log(out)
    if code != 0:  # stopped cleanly: one line, then --resume on the node that is left finishes the run
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert code == 1 and len(errors) == 1 and "--resume" in errors[0], log[-4000:]
        cluster.wait_for_nodes(timeout=120)  # the cluster knows the node is gone (else the resumed run may be placed on it)
        resumed = start_train(out, f"ray.address={address}", *RUN, resume=True)
        assert finish(resumed, out) == 0, run_log(out)[-4000:]

    rows = metric_rows(out)
    assert sorted(r["step"] for r in rows) == [0, 1, 2], rows
    episodes = [t for t in trajectories(out) if t["phase"] == "rl"]
    per_step = collections.Counter(t["step"] for t in episodes)
    assert per_step == {0: 4, 1: 4, 2: 4}, per_step  # none lost, none counted twice
    for step in (0, 1, 2):
        groups = collections.Counter(t["group"] for t in episodes if t["step"] == step)
        assert sorted(groups.values()) == [2, 2], groups
    sandboxes = [t["metadata"]["sandbox"] for t in episodes if t["metadata"].get("sandbox")]
    assert len(sandboxes) == len(set(sandboxes))
    lost = sum(r["episodes/failed_worker"] for r in rows)
    assert lost == sum(t["failure"].startswith("worker:") for t in episodes)  # counted where they happened
    assert run_containers(docker_client, run_id) == []
