"""A warm pool of started sandboxes, so an episode starts without waiting for a container to boot.

Background threads keep ``size`` sandboxes started and ready. ``acquire()`` hands out a ready one after a cheap state
check (an inspect, not an exec) and creates one on the spot only when none is ready. ``release()`` removes the
container: a sandbox never serves two episodes. Two limits protect the daemon: at most ``max_live`` containers exist at
once (ready, handed out and being created, together) and at most ``max_creates_per_second`` are created. A grader's
second container (``fresh()`` of a handed-out sandbox: the repo grader's) comes from the pool too and counts.

Daemon faults are retried with backoff (``lifecycle.retry_daemon``); when they persist, that ``acquire`` raises
SandboxError and only its episode fails. Each creation attempt carries its own label, so a container a failed attempt
left behind (created but never started) is found and removed even when Docker's own cleanup call failed too.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import docker

from sandforge.sandbox.daemon import docker_client
from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec
from sandforge.sandbox.labels import driver_labels
from sandforge.sandbox.lifecycle import remove_container, retry_daemon
from sandforge.sandbox.stats import SandboxStats
from sandforge.types import SandboxError

LABEL_ATTEMPT = "sandforge.attempt"  # one creation attempt: finds what a failed attempt left behind
MAX_REFILL_THREADS = 4  # creations in flight at once for the warm set: more only queue up in the daemon
REFILL_BACKOFF_MAX_S = 30.0

log = logging.getLogger(__name__)


class SandboxPool:
    """Ready sandboxes of one spec for one run. Thread-safe; ``close()`` it (or use ``with``) to remove what it holds.

    ``labels`` are added to every container; by default they are ``driver_labels(run_id)`` of this process, so the
    reaper knows who owns them. A driver passes its own ``driver_labels`` to the pools of its rollout workers.
    """

    def __init__(
        self,
        spec: SandboxSpec,
        run_id: str,
        size: int,
        client: docker.DockerClient | None = None,
        max_live: int = 64,
        max_creates_per_second: float = 8.0,
        labels: dict[str, str] | None = None,
        stats: SandboxStats | None = None,
        attempts: int = 4,
        backoff_s: float = 0.5,
    ) -> None:
        if size < 0 or max_live < 1 or max_creates_per_second <= 0:
            raise ValueError(
                f"SandboxPool needs size >= 0, max_live >= 1 and max_creates_per_second > 0 "
                f"(got size={size}, max_live={max_live}, max_creates_per_second={max_creates_per_second})"
            )
        if size > max_live:
            raise ValueError(f"SandboxPool size {size} exceeds max_live {max_live}: lower the size or raise max_live")
        self.spec = spec
        self.run_id = run_id
        self.size = size
        self.max_live = max_live
        self.stats = stats or SandboxStats()
        self._client = client or docker_client()
        self._labels = {**driver_labels(run_id), **(labels or {})}
        self._attempts, self._backoff_s = attempts, backoff_s
        self._interval = 1.0 / max_creates_per_second
        self._cond = threading.Condition()
        self._warm: deque[DockerSandbox] = deque()
        self._out: dict[str, DockerSandbox] = {}  # handed out, by container id
        self._graders_waiting = 0  # fresh() calls waiting for a slot: they go before new episodes and the warm set
        self._live = 0  # containers this pool answers for: warm + handed out + being created
        self._filling = 0  # creations in flight for the warm set
        self._orphans: list[str] = []  # containers whose removal failed; close() tries again
        self._next_slot = 0.0  # monotonic time before which no creation may start
        self._closed = False
        self._threads = [
            threading.Thread(target=self._refill, name=f"sandbox-pool-{i}", daemon=True)
            for i in range(min(size, MAX_REFILL_THREADS))
        ]
        for t in self._threads:
            t.start()

    # --- what episodes call ---------------------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None) -> DockerSandbox:
        """A started sandbox for one episode; give it back with ``release``.

        Waits at most ``timeout`` seconds (None: forever) when ``max_live`` sandboxes exist already. Raises SandboxError
        if none can be had in time, the daemon keeps failing, or the pool is closed.
        """
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        while True:
            sandbox = self._started(*self._take(deadline, timeout))
            if sandbox is None:
                continue
            with self._cond:
                if not self._closed:
                    self._out[sandbox.id] = sandbox
                    break
            self._discard(sandbox)
            raise SandboxError("the sandbox pool was closed while a sandbox was being acquired")
        self.stats.record_acquire(time.monotonic() - start)
        return sandbox

    def grader(self, parent: DockerSandbox) -> DockerSandbox:
        """A fresh sandbox of this pool's spec for grading ``parent``'s episode (what ``parent.fresh()`` returns): it
        takes a max_live slot like an episode's, and closing it gives the slot back.

        It waits for a slot, before new episodes and the warm set. When every live container is a handed-out one whose
        episode is itself waiting for its grader, no slot would ever come free: it goes one over (counted as the
        failure ``over_max_live``) rather than hang or fail the episode; max_live above the episodes a worker runs at
        once avoids that.
        """
        while True:
            with self._cond:
                self._graders_waiting += 1
                try:
                    sandbox, cold = self._grader_slot()
                finally:
                    self._graders_waiting -= 1
                    self._cond.notify_all()  # episodes and refills held back for it
            sandbox = self._started(sandbox, cold)
            if sandbox is not None:
                sandbox.grader = True
                return sandbox

    def _started(self, sandbox: DockerSandbox | None, cold: bool) -> DockerSandbox | None:
        """A taken warm ``sandbox`` if it is still alive (None: it died while it waited, and is gone), or, ``cold``,
        one created in the reserved slot (whose reservation is undone if that fails)."""
        if cold:
            try:
                return self._create()
            except SandboxError:
                self._forget(1)
                raise
        if not sandbox.alive():  # killed, OOM-ed or removed behind our back while it waited
            self.stats.failure("dead")
            self._discard(sandbox)
            return None
        return sandbox

    def _grader_slot(self) -> tuple[DockerSandbox | None, bool]:
        """Under the lock: a warm sandbox (False), or a slot reserved to create one in (True)."""
        while True:
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            if self._warm:
                self.stats.add_gauge("warm", -1)
                self._cond.notify_all()
                return self._warm.popleft(), False
            stuck = self._live == len(self._out) and self._graders_waiting >= len(self._out)
            if self._live < self.max_live or stuck:
                if self._live >= self.max_live:
                    self.stats.failure("over_max_live")
                    log.warning("sandbox pool: a grader's container goes over max_live=%d: every live sandbox's "
                                "episode waits for its grader (raise sandbox.max_live above the episodes a worker "
                                "runs at once)", self.max_live)
                self._live += 1
                self.stats.add_gauge("live", 1)
                return None, True
            self._cond.wait()

    def release(self, sandbox: DockerSandbox) -> None:
        """Remove the episode's container (never reused); the pool refills in the background. Never raises."""
        with self._cond:
            ours = self._out.pop(sandbox.id, None) is not None
        if ours:
            self._discard(sandbox)
        else:  # released twice, or not from this pool: still make sure it is gone, but it was not counted here
            self._remove(sandbox)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the warm set is full (e.g. before the first rollout step); False on timeout or when closed."""
        with self._cond:
            full = self._cond.wait_for(lambda: self._closed or len(self._warm) >= self.size, timeout)
            return full and not self._closed

    @property
    def warm(self) -> int:
        """Sandboxes started and ready to hand out."""
        with self._cond:
            return len(self._warm)

    @property
    def live(self) -> int:
        """Containers the pool answers for: ready, handed out and being created."""
        with self._cond:
            return self._live

    def close(self) -> None:
        """Stop refilling and remove every ready container. Handed-out sandboxes stay until released. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            warm = list(self._warm)
            self._warm.clear()
            self.stats.add_gauge("warm", -len(warm))
            self._cond.notify_all()
        for t in self._threads:
            t.join()  # a creation in flight finishes, sees the pool closed, and removes its sandbox
        if warm:
            with ThreadPoolExecutor(max_workers=min(8, len(warm))) as ex:
                list(ex.map(self._discard, warm))
        with self._cond:
            orphans, self._orphans = self._orphans, []
        for cid in orphans:
            try:
                remove_container(self._client, cid, self._attempts, self._backoff_s)
            except SandboxError as e:
                log.warning("sandbox pool: %s; the run's cleanup or `sandforge sandbox reap` will remove it", e)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SandboxPool({self.spec.image}, run={self.run_id}, size={self.size}, live={self.live})"

    # --- bookkeeping ----------------------------------------------------------------------------------------------

    def _take(self, deadline: float | None, timeout: float | None) -> tuple[DockerSandbox | None, bool]:
        """A warm sandbox (False), or a reserved slot to create one in (True); waits while max_live are live."""
        with self._cond:
            while True:
                if self._closed:
                    raise SandboxError("the sandbox pool is closed")
                if self._warm:
                    self.stats.add_gauge("warm", -1)
                    self._cond.notify_all()  # a refill thread: the warm set has room again
                    return self._warm.popleft(), False
                if self._live < self.max_live and not self._graders_waiting:
                    self._live += 1
                    self.stats.add_gauge("live", 1)
                    return None, True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self.stats.failure("acquire_timeout")
                    raise SandboxError(
                        f"no sandbox free within {timeout:g}s: {self.max_live} are live (the pool's max_live); "
                        "raise max_live or run fewer episodes at once"
                    )
                self._cond.wait(remaining)

    def _forget(self, n: int) -> None:
        with self._cond:
            self._live -= n
            self.stats.add_gauge("live", -n)
            self._cond.notify_all()

    def _remove(self, sandbox: DockerSandbox) -> bool:
        sandbox.close()  # one attempt, and frees what the DockerSandbox object holds
        try:
            remove_container(self._client, sandbox.id, self._attempts, self._backoff_s)  # gone already: one 404
            return True
        except SandboxError as e:
            self.stats.failure("remove")
            log.warning("sandbox pool: %s", e)
            with self._cond:
                self._orphans.append(sandbox.id)
            return False

    def _discard(self, sandbox: DockerSandbox) -> None:
        self._remove(sandbox)
        self._forget(1)

    # --- creating -------------------------------------------------------------------------------------------------

    def _throttle(self) -> None:
        with self._cond:
            slot = max(time.monotonic(), self._next_slot)
            self._next_slot = slot + self._interval
        delay = slot - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _create(self) -> DockerSandbox:
        """One started sandbox, with bounded retries on transient daemon errors; SandboxError when they run out."""

        def attempt() -> DockerSandbox:
            self._throttle()
            tag = uuid.uuid4().hex
            try:
                labels = {**self._labels, LABEL_ATTEMPT: tag}
                sandbox = PooledSandbox.create(self.spec, self.run_id, client=self._client, labels=labels)
                sandbox.pool = self
                return sandbox
            except SandboxError:
                left = self._sweep(tag)
                self.stats.failure("start" if left else "create")
                raise

        return retry_daemon(
            attempt,
            "create a sandbox",
            attempts=self._attempts,
            backoff_s=self._backoff_s,
            on_retry=lambda e: self.stats.failure("retry"),
        )

    def _sweep(self, tag: str) -> int:
        """Remove what a failed attempt left (a container created but not started); returns how many there were."""
        try:
            attempt = {"label": f"{LABEL_ATTEMPT}={tag}"}
            found = retry_daemon(
                lambda: self._client.containers.list(all=True, sparse=True, filters=attempt),
                "list a failed attempt's containers",
                attempts=self._attempts,
                backoff_s=self._backoff_s,
            )
        except SandboxError as e:
            log.warning("sandbox pool: %s", e)
            return 0
        for c in found:
            try:
                remove_container(self._client, c.id, self._attempts, self._backoff_s)
            except SandboxError as e:
                self.stats.failure("remove")
                log.warning("sandbox pool: %s", e)
                with self._cond:
                    self._orphans.append(c.id)
        return len(found)

    def _refill(self) -> None:
        failures = 0
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed
                    or (len(self._warm) + self._filling < self.size and self._live < self.max_live
                        and not self._graders_waiting)
                )
                if self._closed:
                    return
                self._live += 1
                self._filling += 1
                self.stats.add_gauge("live", 1)
            try:
                sandbox = self._create()
            except Exception as e:  # the daemon keeps failing: back off, so a sick daemon is not hammered
                with self._cond:
                    self._filling -= 1
                self._forget(1)
                failures += 1
                pause = min(2.0**failures, REFILL_BACKOFF_MAX_S)
                log.warning("sandbox pool: refill failed (%s); next try in %.0fs", e, pause)
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, timeout=pause)
                continue
            failures = 0
            with self._cond:
                self._filling -= 1
                if not self._closed:
                    self._warm.append(sandbox)
                    self.stats.add_gauge("warm", 1)
                    self._cond.notify_all()
                    continue
            self._discard(sandbox)


class PooledSandbox(DockerSandbox):
    """A sandbox of a pool: its ``fresh()`` container, for a grader, comes from the same pool (``SandboxPool.grader``)
    and counts against max_live; closing that one gives its slot back."""

    pool: SandboxPool | None = None
    grader: bool = False  # a grader's container: closing it frees its slot

    def fresh(self) -> DockerSandbox:
        return self.pool.grader(self) if self.pool is not None else super().fresh()

    def close(self) -> None:
        first = not self._closed
        super().close()
        if first and self.grader and self.pool is not None:
            self.pool._forget(1)
