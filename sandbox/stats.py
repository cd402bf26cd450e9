"""Sandbox health in numbers: acquire and exec latency, live sandboxes, failures by kind.

A pool (and each env) records into one ``SandboxStats``; once per step the owner takes ``snapshot()`` and merges it into
the step's metrics. Rollout workers live in other processes: each sends ``export()`` (plain, picklable data) and the
driver ``absorb``s them into one SandboxStats, so percentiles are computed over every worker's samples, not averaged.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque

MAX_SAMPLES = 100_000  # per series between snapshots; older samples drop out first


class SandboxStats:
    """Thread-safe. Samples and failure counts reset at each ``snapshot(reset=True)``; gauges (live, warm) never do."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._acquire: deque[float] = deque(maxlen=MAX_SAMPLES)
        self._exec: deque[float] = deque(maxlen=MAX_SAMPLES)
        self._failures: Counter[str] = Counter()
        self._gauges: Counter[str] = Counter()  # live, warm: kept as sums so several pools can share one stats

    def record_acquire(self, seconds: float) -> None:
        with self._lock:
            self._acquire.append(seconds)

    def record_exec(self, seconds: float) -> None:
        with self._lock:
            self._exec.append(seconds)

    def failure(self, kind: str, n: int = 1) -> None:
        """Count a failure: create, start, exec, timeout, dead, remove, acquire_timeout, retry, ..."""
        with self._lock:
            self._failures[kind] += n

    def add_gauge(self, name: str, delta: int) -> None:
        """Move a gauge (``live``: containers a pool holds, handed-out included; ``warm``: ready to hand out)."""
        with self._lock:
            self._gauges[name] += delta

    def export(self, reset: bool = True) -> dict:
        """Everything recorded, as plain lists and dicts (send it across processes, then ``absorb`` it)."""
        with self._lock:
            data = {
                "acquire": list(self._acquire),
                "exec": list(self._exec),
                "failures": dict(self._failures),
                "gauges": dict(self._gauges),
            }
            if reset:
                self._acquire.clear()
                self._exec.clear()
                self._failures.clear()
        return data

    def absorb(self, data: dict) -> None:
        """Add another process's ``export()``: its samples and failures join these, its gauges add to these."""
        with self._lock:
            self._acquire.extend(data["acquire"])
            self._exec.extend(data["exec"])
            self._failures.update(data["failures"])
            self._gauges.update(data["gauges"])

    def snapshot(self, reset: bool = True) -> dict[str, float]:
        """Metrics keyed ``sandbox/...``: acquire/exec p50, p99, mean and count, gauges, ``sandbox/failures/<kind>``.

        Percentiles of an empty series are left out rather than reported as 0 (which would read as "instant").
        """
        data = self.export(reset=reset)
        out: dict[str, float] = {}
        for series in ("acquire", "exec"):
            samples = sorted(data[series])
            out[f"sandbox/{series}_count"] = float(len(samples))
            if samples:
                out[f"sandbox/{series}_p50_s"] = _percentile(samples, 0.50)
                out[f"sandbox/{series}_p99_s"] = _percentile(samples, 0.99)
                out[f"sandbox/{series}_mean_s"] = sum(samples) / len(samples)
        for name, value in sorted(data["gauges"].items()):
            out[f"sandbox/{name}"] = float(value)
        for kind, n in sorted(data["failures"].items()):
            out[f"sandbox/failures/{kind}"] = float(n)
        return out


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty list."""
    rank = math.ceil(q * len(ordered) - 1e-9)  # the epsilon keeps 0.99 * 100 from rounding up to rank 100
    return ordered[min(max(rank, 1), len(ordered)) - 1]
