"""Container ownership and the reaper: a SIGKILLed driver's containers are removed, a live driver's survive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from sandforge.sandbox import proxy_folders
from sandforge.sandbox.labels import (
    LABEL_EPISODE,
    LABEL_HOST,
    LABEL_PID,
    LABEL_RUN,
    LABEL_STARTED,
    _start_time,
    driver_alive,
    driver_labels,
)
from containers import list_run_containers
from sandforge.sandbox.lifecycle import reap_dead_runs, remove_run_containers
from sandforge.sandbox.spec import PROXY_ROOT

# --- ownership, no Docker -----------------------------------------------------------------------------------------


def test_driver_labels_name_this_live_process():
    labels = driver_labels("run-1")
    assert labels[LABEL_RUN] == "run-1" and labels[LABEL_PID] == str(os.getpid())
    assert driver_alive(labels) is True
    assert driver_alive({**labels, LABEL_STARTED: str(int(labels[LABEL_STARTED]) + 1)}) is False  # a reused pid
    assert driver_alive({**labels, LABEL_HOST: "some-other-host"}) is None  # cannot tell: leave it alone
    assert driver_alive({LABEL_RUN: "run-1"}) is False  # no owner at all
    assert driver_alive({**labels, LABEL_PID: "not-a-pid"}) is False


def test_a_dead_or_zombie_driver_is_not_alive():
    proc = subprocess.Popen(["sleep", "30"])
    labels = {**driver_labels("r"), LABEL_PID: str(proc.pid), LABEL_STARTED: str(_start_time(proc.pid))}
    assert driver_alive(labels) is True
    proc.kill()
    deadline = time.monotonic() + 10
    while _state(proc.pid) != "Z" and time.monotonic() < deadline:  # not waited for yet: a zombie
        time.sleep(0.01)
    assert _state(proc.pid) == "Z" and driver_alive(labels) is False
    proc.wait()
    assert driver_alive(labels) is False


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_proxy_folders_no_container_claims_are_stale_once_old(tmp_path, monkeypatch):
    monkeypatch.setattr(proxy_folders, "PROXY_ROOT", str(tmp_path / "proxy"))
    assert proxy_folders.stale([]) == []  # no root yet
    for episode in ("claimed", "orphan", "young"):
        proxy_folders.make(episode)
    old = time.time() - proxy_folders.ORPHAN_AGE_S - 1
    for episode in ("claimed", "orphan"):
        os.utime(tmp_path / "proxy" / episode, (old, old))
    assert proxy_folders.stale(["claimed"]) == ["orphan"]  # "young" may be a sandbox being created
    (tmp_path / "outside").mkdir()
    for name in ("../outside", "..", "", None):
        proxy_folders.remove(name)  # a label is not a path: nothing outside the root goes
    assert (tmp_path / "outside").is_dir() and (tmp_path / "proxy").is_dir()
    proxy_folders.remove("orphan")
    assert sorted(os.listdir(tmp_path / "proxy")) == ["claimed", "young"]


# --- the reaper against real containers ---------------------------------------------------------------------------

# A driver that fills a pool of its own (each sandbox with a proxy folder on the host, as an agent harness's has),
# hands one sandbox out, and waits to be killed.
DRIVER = """
import sys, time
from sandforge.sandbox.docker_sandbox import SandboxSpec
from sandforge.sandbox.pool import SandboxPool
pool = SandboxPool(SandboxSpec(image=sys.argv[1], proxy=True), sys.argv[2], size=2)
held = pool.acquire(timeout=120)
assert pool.wait_ready(120)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def run_ids(docker_client):
    """Fresh run ids; every container labelled with one of them is removed afterwards."""
    made: list[str] = []

    def make() -> str:
        made.append(f"test-{uuid.uuid4().hex[:12]}")
        return made[-1]

    yield make
    for rid in made:
        remove_run_containers(rid, docker_client)


def _container(client, image: str, labels: dict[str, str]) -> str:
    """A created (never started) container: the reaper judges it by its labels alone."""
    return client.api.create_container(image, command=["true"], labels=labels, network_disabled=True)["Id"]


def _episode(client, container_id: str) -> str:
    return client.api.inspect_container(container_id)["Config"]["Labels"][LABEL_EPISODE]


@pytest.mark.docker
@pytest.mark.alone  # any job another test starts would reap the dead driver's sandboxes first
def test_reaper_removes_a_sigkilled_drivers_containers_and_leaves_live_ones(terminal_image, docker_client, run_ids):
    dead, live, elsewhere, unowned, reused = (run_ids() for _ in range(5))
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, terminal_image, dead], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "ready", "the driver subprocess did not start its sandboxes"
    finally:
        driver.send_signal(signal.SIGKILL)  # no cleanup runs: its containers are orphans now
        driver.wait()
    assert len(list_run_containers(dead, docker_client)) == 3  # one handed out + two warm
    folders = [os.path.join(PROXY_ROOT, _episode(docker_client, cid))
               for cid in list_run_containers(dead, docker_client)]
    assert all(os.path.isdir(f) for f in folders)

    mine = driver_labels(live)
    live_box = _container(docker_client, terminal_image, mine)
    other_host = _container(docker_client, terminal_image, {**driver_labels(elsewhere), LABEL_HOST: "another-host"})
    _container(docker_client, terminal_image, {LABEL_RUN: unowned})
    stale = {**driver_labels(reused), LABEL_STARTED: str(int(mine[LABEL_STARTED]) - 1)}  # our pid, an older process
    _container(docker_client, terminal_image, stale)

    reaped = reap_dead_runs(docker_client, runs=[dead, live, elsewhere, unowned, reused])
    assert reaped == {dead: 3, unowned: 1, reused: 1}
    assert list_run_containers(dead, docker_client) == []
    assert not any(os.path.exists(f) for f in folders)  # their proxy folders went with them
    assert list_run_containers(live, docker_client) == [live_box]
    assert list_run_containers(elsewhere, docker_client) == [other_host]
    assert reap_dead_runs(docker_client, runs=[dead, live, elsewhere, unowned, reused]) == {}


@pytest.mark.docker
@pytest.mark.alone  # any job another test starts would reap the dead driver's sandboxes first
def test_sandbox_reap_command_removes_a_sigkilled_drivers_containers(terminal_image, docker_client, run_ids):
    dead = run_ids()
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, terminal_image, dead], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "ready"
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    assert list_run_containers(dead, docker_client)
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "sandbox", "reap"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"of dead run {dead}" in proc.stdout
    assert list_run_containers(dead, docker_client) == []
