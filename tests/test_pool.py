"""SandboxPool and SandboxStats: warm hand-out, never reused, caps on live sandboxes and creations, liveness before
hand-out, a flaky daemon retried then failing one episode cleanly, and nothing left behind."""

from __future__ import annotations

import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import docker.errors
import pytest
import requests
from seeded import terminal_task as make_task

from sandforge.sandbox.labels import LABEL_PID
from containers import list_run_containers
from sandforge.sandbox.lifecycle import is_transient, retry_daemon
from sandforge.sandbox.pool import SandboxPool
from sandforge.sandbox.stats import SandboxStats
from sandforge.environments.terminal.env import TerminalEnv
from sandforge.types import SandboxError, ToolCall
from sandforge.verifiers.checks import score_task

FAST_RETRY = {"attempts": 3, "backoff_s": 0.01}


def server_error(code: int = 500) -> docker.errors.APIError:
    response = requests.Response()
    response.status_code = code
    return docker.errors.APIError(f"simulated {code}", response=response)


# --- stats and retries, no Docker ---------------------------------------------------------------------------------


def test_stats_snapshot_has_percentiles_gauges_and_failures_and_resets_samples():
    stats = SandboxStats()
    for i in range(1, 101):
        stats.record_acquire(i / 100)
    stats.record_exec(0.25)
    stats.failure("dead")
    stats.failure("dead")
    stats.failure("create")
    stats.add_gauge("live", 3)
    stats.add_gauge("live", -1)
    snap = stats.snapshot()
    assert snap["sandbox/acquire_p50_s"] == 0.5 and snap["sandbox/acquire_p99_s"] == 0.99
    assert snap["sandbox/acquire_count"] == 100 and snap["sandbox/acquire_mean_s"] == pytest.approx(0.505)
    assert snap["sandbox/exec_p50_s"] == snap["sandbox/exec_p99_s"] == 0.25
    assert snap["sandbox/failures/dead"] == 2 and snap["sandbox/failures/create"] == 1 and snap["sandbox/live"] == 2
    assert all(isinstance(v, float) for v in snap.values())

    again = stats.snapshot()  # samples and failures were reset; the gauge was not
    assert again == {"sandbox/acquire_count": 0.0, "sandbox/exec_count": 0.0, "sandbox/live": 2.0}


def test_stats_of_several_workers_merge_their_samples_not_their_percentiles():
    a, b = SandboxStats(), SandboxStats()
    for x in (1, 2, 3):
        a.record_acquire(x)
    for x in (10, 20, 30, 40):
        b.record_acquire(x)
    a.add_gauge("live", 2)
    b.add_gauge("live", 5)
    b.failure("exec")
    driver = SandboxStats()
    for worker in (a, b):
        driver.absorb(pickle.loads(pickle.dumps(worker.export())))  # as it crosses from a Ray actor
    snap = driver.snapshot()
    assert snap["sandbox/acquire_p50_s"] == 10 and snap["sandbox/acquire_count"] == 7
    assert snap["sandbox/live"] == 7 and snap["sandbox/failures/exec"] == 1
    assert a.snapshot()["sandbox/acquire_count"] == 0  # export() reset the worker's samples


def test_stats_count_every_sample_from_many_threads():
    stats = SandboxStats()

    def record():
        for _ in range(2000):
            stats.record_exec(0.001)
            stats.failure("exec")

    threads = [threading.Thread(target=record) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = stats.snapshot()
    assert snap["sandbox/exec_count"] == 16000 and snap["sandbox/failures/exec"] == 16000


def test_transient_daemon_errors_are_retried_with_backoff_and_others_are_not():
    assert is_transient(requests.ConnectionError("refused")) and is_transient(requests.ReadTimeout("slow"))
    assert is_transient(server_error(500)) and is_transient(server_error(503))
    assert not is_transient(server_error(400)) and not is_transient(docker.errors.ImageNotFound("no such image"))
    wrapped = SandboxError("could not start")
    wrapped.__cause__ = requests.ConnectionError("refused")
    assert is_transient(wrapped)

    calls, retried = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise requests.ConnectionError("daemon restarting")
        return "ok"

    assert retry_daemon(flaky, "ping", attempts=4, backoff_s=0.001, on_retry=retried.append) == "ok"
    assert len(calls) == 3 and len(retried) == 2

    calls.clear()
    with pytest.raises(SandboxError, match="could not ping after 3 tries: ConnectionError"):
        retry_daemon(lambda: calls.append(1) or flaky_always(), "ping", attempts=3, backoff_s=0.001)
    assert len(calls) == 3

    calls.clear()
    with pytest.raises(SandboxError, match="could not ping: ImageNotFound"):
        retry_daemon(lambda: calls.append(1) or missing_image(), "ping", attempts=3, backoff_s=0.001)
    assert len(calls) == 1  # not transient: no retry


def flaky_always():
    raise requests.ConnectionError("daemon down")


def missing_image():
    raise docker.errors.ImageNotFound("no such image")


def test_pool_arguments_are_checked():
    with pytest.raises(ValueError, match="size 5 exceeds max_live 2: lower the size"):
        SandboxPool(None, "r", size=5, client=object(), max_live=2)
    with pytest.raises(ValueError, match="max_creates_per_second > 0"):
        SandboxPool(None, "r", size=1, client=object(), max_creates_per_second=0)


# --- a thin wrapper over the real client that fails on cue ---------------------------------------------------------


class FlakyClient:
    """The real DockerClient, except that the next calls to ``containers.create``, ``Container.start`` and
    ``api.remove_container`` raise the errors queued for them (one per call), and every create is recorded."""

    def __init__(self, real):
        self._real = real
        self.create_errors: list[Exception] = []  # raised before the daemon creates anything
        self.lost_replies: list[Exception] = []  # raised after the daemon created the container
        self.start_errors: list[Exception] = []
        self.remove_errors: list[Exception] = []
        self.creates: list[tuple[float, int]] = []  # (monotonic time, calling thread) of every create
        self.lock = threading.Lock()
        self.containers = _Containers(self)
        self.api = _Api(self)

    def pop(self, queue: list[Exception]) -> Exception | None:
        with self.lock:
            return queue.pop(0) if queue else None

    def __getattr__(self, name):
        return getattr(self._real, name)


class _Containers:
    def __init__(self, flaky: FlakyClient):
        self._flaky = flaky

    def create(self, *args, **kwargs):
        f = self._flaky
        with f.lock:
            f.creates.append((time.monotonic(), threading.get_ident()))
        if error := f.pop(f.create_errors):
            raise error
        container = f._real.containers.create(*args, **kwargs)
        if error := f.pop(f.lost_replies):
            raise error
        return _Container(container, f)

    def __getattr__(self, name):
        return getattr(self._flaky._real.containers, name)


class _Container:
    def __init__(self, container, flaky: FlakyClient):
        self._container = container
        self._flaky = flaky

    def start(self, *args, **kwargs):
        if error := self._flaky.pop(self._flaky.start_errors):
            raise error
        return self._container.start(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._container, name)


class _Api:
    def __init__(self, flaky: FlakyClient):
        self._flaky = flaky

    def remove_container(self, *args, **kwargs):
        if error := self._flaky.pop(self._flaky.remove_errors):
            raise error
        return self._flaky._real.api.remove_container(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._flaky._real.api, name)


def states(run_id: str, client) -> list[str]:
    return [client.api.inspect_container(cid)["State"]["Status"] for cid in list_run_containers(run_id, client)]


def gone(client, container_id: str) -> bool:
    try:
        client.api.inspect_container(container_id)
    except docker.errors.NotFound:
        return True
    return False


# --- real containers ----------------------------------------------------------------------------------------------


@pytest.mark.docker
def test_warm_acquire_creates_nothing_and_released_sandboxes_are_removed_never_reused(
    terminal_spec, run_id, docker_client
):
    flaky = FlakyClient(docker_client)
    with SandboxPool(terminal_spec, run_id, size=2, client=flaky, max_creates_per_second=50) as pool:
        assert pool.wait_ready(120) and pool.warm == 2
        warm_ids = set(list_run_containers(run_id, docker_client))
        assert len(warm_ids) == 2 and states(run_id, docker_client) == ["running", "running"]

        sandbox = pool.acquire(timeout=60)
        assert sandbox.id in warm_ids  # one of the containers started before acquire was called
        assert not [tid for _, tid in flaky.creates if tid == threading.get_ident()]  # none created on this thread
        labels = docker_client.api.inspect_container(sandbox.id)["Config"]["Labels"]
        assert labels[LABEL_PID] == str(os.getpid())  # owned by this process for the reaper
        assert sandbox.exec("whoami").output.strip() == "sandbox"

        handed_out = [sandbox.id]
        pool.release(sandbox)
        assert gone(docker_client, sandbox.id)
        for _ in range(3):
            sandbox = pool.acquire(timeout=60)
            assert sandbox.id not in handed_out and sandbox.alive()
            handed_out.append(sandbox.id)
            pool.release(sandbox)
            assert gone(docker_client, sandbox.id)
        pool.release(sandbox)  # a second release of the same sandbox is harmless
        snap = pool.stats.snapshot()
        assert snap["sandbox/acquire_count"] == 4 and "sandbox/failures/remove" not in snap
    assert list_run_containers(run_id, docker_client) == []
    assert pool.stats.snapshot()["sandbox/live"] == 0


@pytest.mark.docker
def test_max_live_caps_every_container_and_a_release_frees_a_slot(terminal_spec, run_id, docker_client):
    seen, stop = [], threading.Event()

    def watch():  # counts containers on the daemon, independently of the pool's own bookkeeping
        while not stop.is_set():
            seen.append(len(list_run_containers(run_id, docker_client)))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with SandboxPool(terminal_spec, run_id, size=2, max_live=3, client=docker_client) as pool:
            held = [pool.acquire(timeout=60) for _ in range(3)]
            time.sleep(1.0)  # room for the refill threads to overshoot, if they would
            assert pool.live == 3 and pool.warm == 0
            with pytest.raises(SandboxError, match="max_live"):
                pool.acquire(timeout=0.3)

            waiter: list = []
            t = threading.Thread(target=lambda: waiter.append(pool.acquire(timeout=60)))
            t.start()
            pool.release(held.pop(0))
            t.join()
            assert waiter and waiter[0].id not in {s.id for s in held} and waiter[0].alive()
            for s in held + waiter:
                pool.release(s)
            assert pool.stats.snapshot()["sandbox/failures/acquire_timeout"] == 1
    finally:
        stop.set()
        watcher.join()
    assert max(seen) == 3 and list_run_containers(run_id, docker_client) == []


@pytest.mark.docker
def test_creations_are_throttled_to_the_configured_rate(terminal_spec, run_id, docker_client):
    flaky, rate = FlakyClient(docker_client), 3.0
    with SandboxPool(terminal_spec, run_id, size=0, client=flaky, max_creates_per_second=rate) as pool:
        with ThreadPoolExecutor(6) as ex:  # six cold acquires at once: unthrottled they would all create at once
            boxes = list(ex.map(lambda _: pool.acquire(timeout=120), range(6)))
        for box in boxes:
            pool.release(box)
    times = sorted(t for t, _ in flaky.creates)
    assert len(times) == 6 and len({b.id for b in boxes}) == 6
    for i in range(len(times)):
        for j in range(i + 1, len(times)):
            assert times[j] - times[i] >= (j - i - 1) / rate, f"creates {i} and {j} too close: {times}"
    assert list_run_containers(run_id, docker_client) == []


@pytest.mark.docker
def test_a_warm_sandbox_killed_behind_the_pools_back_is_not_handed_out(terminal_spec, run_id, docker_client):
    with SandboxPool(terminal_spec, run_id, size=2, client=docker_client) as pool:
        assert pool.wait_ready(120)
        killed = list_run_containers(run_id, docker_client)
        for cid in killed:
            docker_client.api.kill(cid)
        sandbox = pool.acquire(timeout=60)
        assert sandbox.id not in killed and sandbox.exec("echo ok").output == "ok\n"
        assert all(gone(docker_client, cid) for cid in killed)  # discarded, not left exited
        assert pool.stats.snapshot()["sandbox/failures/dead"] == 2
        pool.release(sandbox)
    assert list_run_containers(run_id, docker_client) == []


@pytest.mark.docker
def test_transient_daemon_errors_are_retried_then_fail_only_that_acquire(terminal_spec, run_id, docker_client):
    flaky = FlakyClient(docker_client)
    with SandboxPool(terminal_spec, run_id, size=0, client=flaky, **FAST_RETRY) as pool:
        flaky.create_errors += [requests.ConnectionError("daemon restarting"), server_error(503)]
        sandbox = pool.acquire(timeout=60)  # third try succeeds
        assert len(flaky.creates) == 3 and sandbox.alive()
        pool.release(sandbox)
        snap = pool.stats.snapshot()
        assert snap["sandbox/failures/retry"] == 2 and snap["sandbox/failures/create"] == 2

        flaky.create_errors += [server_error(500)] * 3
        with pytest.raises(SandboxError, match="after 3 tries"):
            pool.acquire(timeout=60)
        assert pool.live == 0  # the failed acquire gave its slot back

        flaky.create_errors.append(docker.errors.ImageNotFound("no such image"))
        with pytest.raises(SandboxError):  # not transient: fails at once
            pool.acquire(timeout=60)
        assert len(flaky.creates) == 3 + 3 + 1

        sandbox = pool.acquire(timeout=60)  # the daemon is well again: the run goes on
        assert sandbox.exec("true").exit_code == 0
        pool.release(sandbox)
    assert list_run_containers(run_id, docker_client) == []


@pytest.mark.docker
def test_containers_left_by_failed_starts_and_lost_replies_are_removed(terminal_spec, run_id, docker_client):
    flaky = FlakyClient(docker_client)
    with SandboxPool(terminal_spec, run_id, size=0, client=flaky, **FAST_RETRY) as pool:
        # The start fails, and so does the cleanup inside DockerSandbox.create: the pool's own sweep must remove it.
        flaky.start_errors.append(server_error(500))
        flaky.remove_errors.append(requests.ConnectionError("daemon restarting"))
        sandbox = pool.acquire(timeout=60)
        assert list_run_containers(run_id, docker_client) == [sandbox.id]
        assert pool.stats.snapshot()["sandbox/failures/start"] == 1
        pool.release(sandbox)

        # The daemon created the container but the reply timed out, three times over: the acquire fails, and
        # none of the three containers stays behind in "created".
        flaky.lost_replies += [requests.ReadTimeout("read timed out")] * 3
        with pytest.raises(SandboxError, match="after 3 tries"):
            pool.acquire(timeout=60)
        assert states(run_id, docker_client) == []
    assert list_run_containers(run_id, docker_client) == []


@pytest.mark.docker
def test_close_removes_warm_containers_and_later_acquires_fail(terminal_spec, run_id, docker_client):
    pool = SandboxPool(terminal_spec, run_id, size=3, client=docker_client)
    assert pool.wait_ready(120)
    held = pool.acquire(timeout=60)
    pool.close()
    assert list_run_containers(run_id, docker_client) == [held.id]  # handed out: its episode still runs
    assert held.exec("echo still here").output == "still here\n"
    pool.release(held)
    assert list_run_containers(run_id, docker_client) == []
    with pytest.raises(SandboxError, match="closed"):
        pool.acquire(timeout=1)
    pool.close()  # idempotent


@pytest.mark.docker
def test_terminal_env_takes_warm_sandboxes_from_a_pool_and_records_exec_latency(terminal_spec, run_id, docker_client):
    task = make_task("count_words", 7)
    with SandboxPool(terminal_spec, run_id, size=1, client=docker_client) as pool:
        assert pool.wait_ready(120)
        warm = set(list_run_containers(run_id, docker_client))
        env = TerminalEnv(task, terminal_spec, run_id, exec_timeout=1, pool=pool)
        try:
            env.reset()
            first = env.sandbox.id
            assert first in warm
            env.step(ToolCall("bash", {"command": "sleep 5"}))  # a timeout, counted as one
            for call in task.solution:
                env.step(call)
            assert score_task(env.sandbox, task).success
            env.reset()  # the solved episode's container is removed, the next comes from the pool
            assert env.sandbox.id != first and gone(docker_client, first)
        finally:
            env.close()
        snap = pool.stats.snapshot()
        bash_calls = sum(c.name == "bash" for c in task.solution) + 1
        assert snap["sandbox/exec_count"] == bash_calls and snap["sandbox/failures/timeout"] == 1
        assert snap["sandbox/acquire_count"] == 2
    assert list_run_containers(run_id, docker_client) == []
