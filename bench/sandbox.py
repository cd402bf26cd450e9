"""Sandboxes against raw Docker: exec round trip, warm acquire, and many sandboxes at once.

    python bench/sandbox.py [--calls 200] [--cli-calls 100] [--acquires 8] [--sandboxes 64] [--commands 20]

All in one run, on the same container where it matters, so the ratios hold on a noisy machine:
- exec round trip of ``echo hi``: sandforge ``DockerSandbox.exec`` (persistent session), its reference path (one docker
  exec per command), the docker SDK's ``container.exec_run`` and the ``docker exec`` CLI in a subprocess, interleaved;
- ``SandboxPool.acquire()`` from a warm pool vs a cold ``containers.run``;
- ``--sandboxes`` sandboxes at once, each running ``--commands`` session commands (throughput, failures).

Every container is labelled with a bench run id and removed by that label at the end, also on Ctrl-C or SIGTERM.
Prints a table, then one JSON line (the last line) with the ratios.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from sandforge.sandbox.daemon import docker_client
from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec
from sandforge.sandbox.images import build_images
from sandforge.sandbox.labels import LABEL_RUN
from sandforge.sandbox.lifecycle import remove_run_containers
from sandforge.sandbox.pool import SandboxPool
from sandforge.types import SandboxError

err = Console(stderr=True)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_exec(client, spec: SandboxSpec, run_id: str, args) -> dict[str, list[float]]:
    """Round trips of `echo hi` through each path, interleaved on one container."""
    with DockerSandbox.create(spec, run_id, client=client) as sandbox:
        # the same container, one docker exec per command
        reference = DockerSandbox(sandbox._container, spec, run_id, client)
        reference.reuse_shell = False
        container = sandbox._container
        cli = ["docker", "exec", "-u", spec.user, "-w", spec.workdir, sandbox.id, "echo", "hi"]

        def check(output: str | bytes) -> None:
            if output not in ("hi\n", b"hi\n"):
                raise RuntimeError(f"unexpected output {output!r}")

        paths = {
            "sandforge exec": lambda: check(sandbox.exec("echo hi").output),
            "sandforge exec, reference path": lambda: check(reference.exec("echo hi").output),
            "docker SDK exec_run": lambda: check(container.exec_run(["echo", "hi"], user=spec.user).output),
            "docker exec CLI": lambda: check(subprocess.run(cli, capture_output=True, check=True).stdout),
        }
        counts = {"sandforge exec": args.calls, "docker SDK exec_run": args.calls}
        counts |= {"sandforge exec, reference path": args.cli_calls, "docker exec CLI": args.cli_calls}
        for fn in paths.values():  # warm-up: the session's dispatcher starts, the CLI binary is in the page cache
            for _ in range(3):
                fn()
        samples: dict[str, list[float]] = {name: [] for name in paths}
        with Progress(console=err, transient=True) as progress:
            task = progress.add_task("exec round trips", total=sum(counts.values()))
            for i in range(max(counts.values())):
                for name, fn in paths.items():
                    if i < counts[name]:
                        samples[name].append(timed(fn))
                        progress.advance(task)
        return samples


def bench_acquire(client, spec: SandboxSpec, run_id: str, n: int) -> tuple[list[float], list[float]]:
    """(warm ``SandboxPool.acquire()`` seconds, cold ``containers.run`` seconds)."""
    cold = []
    for _ in range(n):  # cold first, while the daemon has nothing else to do
        start = time.perf_counter()
        container = client.containers.run(
            spec.image, ["sleep", "infinity"], detach=True, init=True, network_mode="none", labels={LABEL_RUN: run_id}
        )
        cold.append(time.perf_counter() - start)
        container.remove(force=True)
    warm = []
    pool = SandboxPool(spec, run_id, size=n, client=client, max_live=n)
    try:
        if not pool.wait_ready(timeout=300):
            raise RuntimeError(f"the pool did not fill {n} sandboxes in 300 s")
        held = []
        for _ in range(n):
            start = time.perf_counter()
            held.append(pool.acquire())
            warm.append(time.perf_counter() - start)
        for sandbox in held:
            pool.release(sandbox)
    finally:
        pool.close()
    return warm, cold


def bench_concurrent(client, spec: SandboxSpec, run_id: str, args) -> dict:
    """Many sandboxes at once, each a session running its own commands; every command's output is checked."""
    boxes: list[DockerSandbox] = []
    failures: list[str] = []
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task(f"starting {args.sandboxes} sandboxes", total=args.sandboxes)
        with ThreadPoolExecutor(args.create_workers) as pool:  # a few creations at a time: the daemon serialises them
            creating = [pool.submit(DockerSandbox.create, spec, run_id, client) for _ in range(args.sandboxes)]
            for future in as_completed(creating):
                try:
                    boxes.append(future.result())
                except SandboxError as e:
                    failures.append(f"create: {e}")
                progress.advance(task)

        latencies: list[float] = []

        def episode(i: int, box: DockerSandbox) -> bool:
            ok = True
            for j in range(args.commands):
                try:
                    result = box.exec(f"cd /tmp; export STEP={j}; echo {i}-$STEP-$(pwd)", timeout=30)
                    latencies.append(result.seconds)
                    if (result.exit_code, result.output) != (0, f"{i}-{j}-/tmp\n"):
                        raise RuntimeError(f"exit {result.exit_code}, output {result.output[:200]!r}")
                except Exception as e:  # counted, never fatal: this measures how many episodes survive
                    failures.append(f"sandbox {i} command {j}: {e}")
                    ok = False
            return ok

        task = progress.add_task(f"{len(boxes)} sandboxes x {args.commands} commands", total=len(boxes))
        start = time.perf_counter()
        with ThreadPoolExecutor(max(1, len(boxes))) as pool:  # one thread per sandbox: all run at once
            futures = [pool.submit(episode, i, box) for i, box in enumerate(boxes)]
            for future in as_completed(futures):
                progress.advance(task)
        wall = time.perf_counter() - start
        completed = sum(f.result() for f in futures)
        task = progress.add_task("removing", total=len(boxes))
        with ThreadPoolExecutor(args.create_workers) as pool:
            for _ in pool.map(DockerSandbox.close, boxes):
                progress.advance(task)
    return {"completed": completed, "failures": failures, "wall": wall, "latencies": latencies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200, help="round trips of sandforge exec and of the SDK")
    ap.add_argument("--cli-calls", type=int, default=100, help="round trips of the CLI and the reference path")
    ap.add_argument("--acquires", type=int, default=8)
    ap.add_argument("--sandboxes", type=int, default=64)
    ap.add_argument("--commands", type=int, default=20)
    ap.add_argument("--create-workers", type=int, default=4)
    args = ap.parse_args()

    run_id = f"bench-{uuid.uuid4().hex[:12]}"
    client = docker_client(max_pool_size=2 * args.sandboxes + 16)  # one connection per thread talking at once
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally below
    image = build_images(["terminal"], client=client, show_progress=False)["terminal"]
    spec = SandboxSpec(image=image)
    err.print(f"bench run {run_id} on {image}")
    try:
        samples = bench_exec(client, spec, run_id, args)
        warm, cold = bench_acquire(client, spec, run_id, args.acquires)
        concurrent = bench_concurrent(client, spec, run_id, args)
    finally:
        removed = remove_run_containers(run_id, client)
        if removed:
            err.print(f"removed {removed} leftover container(s) of {run_id}")

    table = Table(title=f"sandbox bench ({run_id})")
    for column in ("measure", "n", "p50 ms", "p99 ms"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    many = f"sandforge exec, {args.sandboxes} sandboxes at once"
    rows = {**samples, "warm acquire: SandboxPool.acquire()": warm, "cold containers.run": cold,
            many: concurrent["latencies"]}
    for name, values in rows.items():
        p50_ms, p99_ms = (f"{percentile(values, q) * 1e3:.1f}" if values else "-" for q in (0.5, 0.99))
        table.add_row(name, str(len(values)), p50_ms, p99_ms)
    p50 = {name: statistics.median(values) for name, values in rows.items() if values}
    throughput = len(concurrent["latencies"]) / concurrent["wall"]
    Console().print(table)
    Console().print(
        f"{concurrent['completed']}/{args.sandboxes} sandboxes ran all {args.commands} commands: "
        f"{throughput:.0f} commands/s, {len(concurrent['failures'])} failures"
    )
    for failure in concurrent["failures"][:10]:
        err.print(f"[red]failure[/red] {failure}")

    result = {
        "exec_vs_sdk_p50": round(p50["sandforge exec"] / p50["docker SDK exec_run"], 3),
        "exec_vs_cli_p50": round(p50["sandforge exec"] / p50["docker exec CLI"], 3),
        "reference_vs_sdk_p50": round(p50["sandforge exec, reference path"] / p50["docker SDK exec_run"], 3),
        "acquire_warm_vs_cold": round(p50["warm acquire: SandboxPool.acquire()"] / p50["cold containers.run"], 4),
        "concurrent": concurrent["completed"],
        "failures": len(concurrent["failures"]),
        "throughput_cmd_per_s": round(throughput, 1),
        "exec_p50_ms": round(p50["sandforge exec"] * 1e3, 2),
        "exec_p99_ms": round(percentile(samples["sandforge exec"], 0.99) * 1e3, 2),
        "sdk_p50_ms": round(p50["docker SDK exec_run"] * 1e3, 2),
        "cli_p50_ms": round(p50["docker exec CLI"] * 1e3, 2),
        "warm": "SandboxPool.acquire()",
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
