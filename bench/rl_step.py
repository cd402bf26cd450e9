"""One quickstart-shaped RL step on the real fleet, and where its wall time goes.

    python bench/rl_step.py [--tasks-per-step 6] [--group-size 4] [--max-new-tokens 128] [--model smollm2-135m]
                            [--set key=value ...] [--baseline key=value ...] [--warm-start] [--warmup-steps 0]
                            [--gemm-size 3072]

The step is ``RLJob.rl_step`` of configs/quickstart.yaml (SmolLM2-135M, LoRA on the top 10 layers, bf16 engine and
trainer, the five environments, ``tasks_per_step`` x ``group_size`` episodes) on the fleet ``open_fleet`` starts:
Ray, the DeepSpeed rank, the engine actor, the rollout workers and their Docker sandboxes. The flags shrink it;
``--set`` applies any further config override to both runs.

Where the time goes: every actor process records when it did what (``instrument``, installed as Ray's
``worker_process_setup_hook``; nothing in the package changes), on the host's monotonic clock, which all processes
of a local fleet share. Each instant of the step goes to the first of these that was active (the engine is one
thread and the machine's CPU-heavy part, so its work ranks above the waits that overlap it):

- ``weight_sync``: the driver's push of the new adapters to the engine (``time/weight_sync``), the engine's load
  included;
- ``engine_prefill``, ``engine_decode``: the engine decoder's prefills and decode steps (engine/decoders.py: the
  model's own forwards, or the fused path's);
- ``engine_other``: the rest of the engine thread's iterations (sampling, cache bookkeeping, session closes);
- ``trainer_backward``: DeepSpeed's ``backward`` and ``step`` calls in the rank (the backward pass and the optimizer
  step); ``trainer_forward``: the rest of ``TrainerRank.train_step`` (and ``score``): forwards, the loss, batching;
- ``sandbox_exec``: tool calls (``astep`` of the episode's environment: commands, file transfers, app calls);
- ``grading``: the verifiers (``score_task`` after each episode);
- ``sandbox_setup``: acquiring a sandbox and the task's setup (``areset``), releasing it (``aclose``);
- ``idle``: nothing of the above: Ray round trips, the driver's own work, waiting for a sandbox slot.

The parts add up to ``rl_step_s``. ``covered_s`` gives each part's own wall time, overlaps included (tool calls of
one episode overlap the engine decoding for another), with ``engine_busy`` (every engine iteration) and
``trainer_step`` (the rank's whole calls) in place of the two remainders.

The pretrained model rarely calls a tool before the quickstart's warm start; ``--warm-start`` runs the config's warm
start (untimed, on each fleet; shrink it with ``--set warmup.steps=.. warmup.episodes=..``) so the timed step is
RL's first as in ``sandforge train``.

``engine_flops_vs_gemm``: the engine's FLOP/s (see ``engine_flops``) over a square ``torch.matmul`` in bf16 and fp32
on the same cores in the same run (median of 5), the CPU's practical ceiling.

``speedup`` = the baseline's step seconds / the step's. The baseline is the same step under ``--baseline key=value
...`` overrides (e.g. the speed-ups switched off), each run on a fleet of its own; with no overrides both runs are
identical and the ratio is run-to-run noise around 1.0 (the JSON says so).

Prints a table, then as the last line a JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]

# Exclusive attribution order (see the docstring); ``engine`` and ``trainer`` are the remainders of the engine's
# iterations and the trainer's calls once the parts above them are taken out.
PRIORITY = ("weight_sync", "engine_prefill", "engine_decode", "engine", "trainer_backward", "trainer",
            "sandbox_exec", "grading", "sandbox_setup")
PART = {"engine": "engine_other", "trainer": "trainer_forward"}  # their names in split_s
OWN = {"engine": "engine_busy", "trainer": "trainer_step"}  # in covered_s: the whole of each


# ---- what each actor process records ------------------------------------------------------------------------------

def _timed(fn, kind: str, spans: list):
    """``fn`` (sync or async), appending ``(kind, start, end)`` to ``spans`` around each call."""
    import inspect

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def timed_async(*args, **kwargs):
            t0 = time.monotonic()
            try:
                return await fn(*args, **kwargs)
            finally:
                spans.append((kind, t0, time.monotonic()))
        return timed_async

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            spans.append((kind, t0, time.monotonic()))
    return timed


def _after_init(cls, setup) -> None:
    """``setup(self)`` after ``cls.__init__``; ``bench_spans()`` returns (and clears) what the instance recorded."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._bench_spans = []
        setup(self)

    def bench_spans(self) -> list:
        spans, self._bench_spans[:] = list(self._bench_spans), []
        return spans

    cls.__init__, cls.bench_spans = __init__, bench_spans


def instrument() -> None:
    """Time the engine, the rollout workers and the trainer ranks from inside their classes. Runs in the driver (so
    Ray's handles know ``bench_spans``) and in every Ray worker process (``worker_process_setup_hook``), before an
    actor's class is loaded there."""
    import sandforge.rollout.worker as worker_module
    from sandforge.engine.ray_actor import EngineActor
    from sandforge.trainer.rank import TrainerRank
    from sandforge.verifiers.checks import score_task

    if hasattr(EngineActor, "bench_spans"):
        return

    def engine(self) -> None:
        spans, core = self._bench_spans, self.core
        core._iteration = _timed(core._iteration, "engine", spans)  # one engine iteration: admit, prefill, decode
        # the policy's prefills and decode steps, whichever decoder runs it (engine.decoder: the model's own forward
        # or the fused path)
        core.decoder.prefill = _timed(core.decoder.prefill, "engine_prefill", spans)
        core.decoder.step = _timed(core.decoder.step, "engine_decode", spans)

    _after_init(EngineActor, engine)
    EngineActor.bench_params = lambda self: sum(p.numel() for p in self.core.model.parameters())

    run_episode = worker_module.run_episode

    def worker(self) -> None:  # one rollout worker per process: its episodes grade through this process's global
        worker_module.run_episode = functools.partial(run_episode, score=_timed(score_task, "grading",
                                                                                self._bench_spans))

    _after_init(worker_module.RolloutWorker, worker)
    make_env = worker_module.RolloutWorker._make_env

    def _make_env(self, task):
        env = make_env(self, task)
        for name, kind in (("areset", "sandbox_setup"), ("astep", "sandbox_exec"), ("aclose", "sandbox_setup")):
            setattr(env, name, _timed(getattr(env, name), kind, self._bench_spans))
        return env

    worker_module.RolloutWorker._make_env = _make_env

    def rank(self) -> None:
        for name in ("backward", "step"):  # DeepSpeed's engine: the backward pass, the optimizer step
            setattr(self.engine, name, _timed(getattr(self.engine, name), "trainer_backward", self._bench_spans))

    _after_init(TrainerRank, rank)
    for name in ("train_step", "score"):
        method = getattr(TrainerRank, name)

        def timed_method(self, *args, _method=method, **kwargs):
            t0 = time.monotonic()
            try:
                return _method(self, *args, **kwargs)
            finally:
                self._bench_spans.append(("trainer", t0, time.monotonic()))

        setattr(TrainerRank, name, functools.wraps(method)(timed_method))


# ---- one step on one fleet ----------------------------------------------------------------------------------------

def job_config(args, out: Path, overrides: list[str]):
    """configs/quickstart.yaml shrunk by the flags, checked and its model found locally as ``sandforge train`` does
    (job/preflight.py)."""
    from sandforge.config import load_config
    from sandforge.job.preflight import check_host, local_model, validate_job

    source = "configs/quickstart.yaml"
    cfg = load_config(ROOT / source, [
        f"run.output_dir={out}", "logging.wandb.mode=disabled", f"model.path={args.model}",
        f"rollout.tasks_per_step={args.tasks_per_step}", f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}", *args.set, *overrides])
    if cfg.ray.address is not None:
        raise SystemExit("bench/rl_step.py times a local fleet (one host, one clock): leave ray.address unset")
    validate_job(cfg, source)
    check_host(cfg, source)
    return local_model(cfg, source)


def _union(intervals) -> list[list[float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def split(spans: list[tuple[str, float, float]], start: float, end: float) -> tuple[dict, dict]:
    """(exclusive seconds per part, adding up to ``end - start``; each part's own seconds, overlaps included)."""
    by_kind: dict[str, list] = {kind: [] for kind in PRIORITY}
    for kind, a, b in spans:
        a, b = max(a, start), min(b, end)
        if b > a:
            by_kind[kind].append((a, b))
    covered: list[list[float]] = []
    exclusive, own = {}, {}
    for kind in PRIORITY:
        mine = _union(by_kind[kind])
        merged = _union(covered + mine)
        exclusive[PART.get(kind, kind)] = _length(merged) - _length(covered)
        own[OWN.get(kind, kind)] = _length(mine)
        covered = merged
    exclusive["idle"] = (end - start) - _length(covered)
    return exclusive, own


def run_step(args, overrides: list[str], label: str) -> dict:
    """Open a fleet for the quickstart with ``overrides``, run ``--warmup-steps`` steps, then time one."""
    import ray

    from sandforge.job import cold_start
    from sandforge.job.console import make_run_id, progress
    from sandforge.job.eta import RunClock, RunPlan
    from sandforge.job.fleet import lifecycle
    from sandforge.job.rl_job import RLJob
    from sandforge.job.runlog import RunLogger

    with tempfile.TemporaryDirectory(prefix="bench-rl-step-") as tmp:
        cfg = job_config(args, Path(tmp) / "run", overrides)
        run_id = make_run_id(f"bench-{label}")
        lifecycle.start_ray(cfg, runtime_env={"worker_process_setup_hook": instrument})  # open_fleet then uses it
        with lifecycle.open_fleet(cfg, run_id) as fleet, progress() as bar:
            logger = RunLogger(Path(tmp) / "run", cfg, run_id)
            try:
                job = RLJob(cfg, fleet, logger, bar, RunClock(RunPlan.of(cfg, 0, warm=True, sft_only=False)))
                if args.warm_start:
                    cold_start.before_rl(job)
                for step in range(args.warmup_steps):
                    job.rl_step(step)
                actors = [fleet.engine, *fleet.workers, *fleet.ranks]
                ray.get([a.bench_spans.remote() for a in actors])  # forget the start-up's and warm-up's
                before = ray.get(fleet.engine.stats.remote())
                t0 = time.monotonic()
                m = job.rl_step(args.warmup_steps)
                after = ray.get(fleet.engine.stats.remote())
                spans = [s for got in ray.get([a.bench_spans.remote() for a in actors]) for s in got]
                params = ray.get(fleet.engine.bench_params.remote())
            finally:
                logger.close()
    end = t0 + m["time/step"]
    spans.append(("weight_sync", end - m["time/weight_sync"], end))
    exclusive, own = split(spans, t0, end)
    grew = {k: after[k] - before[k] for k in ("prefill_tokens", "reprefill_tokens", "decode_tokens", "busy_seconds")}
    return {"label": label, "overrides": overrides, "rl_step_s": m["time/step"], "split_s": exclusive,
            "covered_s": own, "metrics": m, "params": params, "prefill_tokens": grew["prefill_tokens"] +
            grew["reprefill_tokens"], "decode_tokens": grew["decode_tokens"],
            "engine_busy_s": grew["busy_seconds"]}


# ---- the CPU's ceiling ---------------------------------------------------------------------------------------------

def gemm_flops(n: int, repeats: int = 5) -> dict[str, float]:
    """FLOP/s of an n x n x n ``torch.matmul`` in bf16 and fp32 on every core (the engine's thread count), median of
    ``repeats`` after one warm-up."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.matmul(a, b)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
        out[name] = 2 * n**3 / statistics.median(times)
    return out


def engine_flops(run: dict) -> float:
    """The engine's FLOP/s over its forwards: 2 x parameters per token fed (each weight one multiply-add; the tied
    embedding counted once, as the LM head's matmul, the input lookup being free), prefill and decode tokens alike.
    Not counted: attention's QK^T and AV (about 4 x layers x context x hidden per token; for SmolLM2 at the
    quickstart's ~2k-token contexts, 4 * 30 * 2000 * 576 = 0.14 GFLOP against 2N = 0.27), the padding of left-padded
    prefills, sampling."""
    seconds = run["covered_s"]["engine_prefill"] + run["covered_s"]["engine_decode"]
    return 2 * run["params"] * (run["prefill_tokens"] + run["decode_tokens"]) / max(seconds, 1e-9)


def cpu_info() -> dict:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return {"model": model, "cores": os.cpu_count(), "amx_bf16": "amx_bf16" in flags,
            "avx512_bf16": "avx512_bf16" in flags}


# ---- report ---------------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks-per-step", type=int, default=6, help="rollout.tasks_per_step (quickstart: 6)")
    ap.add_argument("--group-size", type=int, default=4, help="rollout.group_size (quickstart: 4)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="rollout.max_new_tokens (quickstart: 128)")
    ap.add_argument("--model", default="smollm2-135m", help="model.path: a catalogue name or a local HF directory")
    ap.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="further config overrides, for both runs")
    ap.add_argument("--baseline", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="overrides of the baseline run only (none: the same step twice)")
    ap.add_argument("--warm-start", action="store_true",
                    help="run the config's warm start (SFT on reference solutions) first, untimed")
    ap.add_argument("--warmup-steps", type=int, default=0, help="untimed RL steps on each fleet before the timed one")
    ap.add_argument("--gemm-size", type=int, default=3072, help="n of the n x n x n reference matmul")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    instrument()
    gemm = gemm_flops(args.gemm_size)  # before any fleet: the cores are the bench's alone (but for neighbours)
    baseline = run_step(args, args.baseline, "baseline")
    run = run_step(args, [], "step")
    flops = engine_flops(run)
    m = run["metrics"]
    cov = run["covered_s"]
    tps = {"prefill": run["prefill_tokens"] / max(cov["engine_prefill"], 1e-9),
           "decode": run["decode_tokens"] / max(cov["engine_decode"], 1e-9)}
    speedup = baseline["rl_step_s"] / run["rl_step_s"]
    note = (f"baseline: the same step with {' '.join(args.baseline)}" if args.baseline else
            "no --baseline overrides: the same step run twice, so speedup is run-to-run noise around 1.0, not a "
            "speed-up")

    table = Table(title=f"one RL step: {args.tasks_per_step} tasks x {args.group_size} episodes, {args.model}, "
                        f"{cpu_info()['model']} ({os.cpu_count()} cores)")
    for column in ("part", "seconds", "share", "own (overlaps)", "notes"):
        table.add_column(column)
    notes = {"engine_prefill": f"{run['prefill_tokens']} tokens, {tps['prefill']:.0f} tok/s",
             "engine_decode": f"{run['decode_tokens']} tokens, {tps['decode']:.1f} tok/s",
             "engine_other": "own: every engine iteration (engine_busy)",
             "trainer_forward": "own: the rank's whole train_step (trainer_step)",
             "sandbox_exec": f"{m.get('tools/calls_per_episode', 0):.1f} tool calls/episode",
             "weight_sync": "adapters to the engine, its load included"}
    own = {PART.get(kind, kind): OWN.get(kind, kind) for kind in PRIORITY}
    for part, seconds in run["split_s"].items():
        table.add_row(part, f"{seconds:.2f}", f"{seconds / run['rl_step_s']:.0%}",
                      f"{cov[own[part]]:.2f}" if part in own else "", notes.get(part, ""))
    table.add_row("rl_step_s", f"{run['rl_step_s']:.2f}", "100%", "",
                  f"{int(m['episodes/count'])} episodes ({int(m['episodes/failed'])} failed), reward "
                  f"{m['reward/mean']:.2f}")
    table.add_row("engine FLOP/s", f"{flops / 1e9:.1f} G", "", "",
                  f"{flops / gemm['bf16']:.1%} of a bf16 GEMM ({gemm['bf16'] / 1e9:.0f} G), "
                  f"{flops / gemm['fp32']:.1%} of fp32 ({gemm['fp32'] / 1e9:.0f} G)")
    table.add_row("speedup", f"{speedup:.2f}x", "", "", f"baseline {baseline['rl_step_s']:.2f} s; {note}")
    Console().print(table)

    r = lambda d: {k: round(v, 3) for k, v in d.items()}  # noqa: E731
    print(json.dumps({
        "rl_step_s": round(run["rl_step_s"], 3), "split_s": r(run["split_s"]), "covered_s": r(cov),
        "tokens": {"prefill": run["prefill_tokens"], "decode": run["decode_tokens"]},
        "tokens_per_s": r(tps), "engine_flops_per_s": round(flops), "gemm_flops_per_s": r(gemm),
        "engine_flops_vs_gemm": {k: round(flops / v, 4) for k, v in gemm.items()},
        "speedup": round(speedup, 3), "speedup_note": note,
        "baseline": {"overrides": args.baseline, "rl_step_s": round(baseline["rl_step_s"], 3),
                     "split_s": r(baseline["split_s"])},
        "engine_stats_busy_s": round(run["engine_busy_s"], 3),  # the engine's own counter: covered_s.engine_busy
        "tool_calls_per_episode": round(m.get("tools/calls_per_episode", 0.0), 2),
        "episodes": int(m["episodes/count"]), "failed": int(m["episodes/failed"]),
        "shape": {"tasks_per_step": args.tasks_per_step, "group_size": args.group_size,
                  "max_new_tokens": args.max_new_tokens, "model": args.model, "set": args.set,
                  "warm_start": args.warm_start, "warmup_steps": args.warmup_steps,
                  "engine_params": run["params"]},
        "cpu": cpu_info(),
    }))


if __name__ == "__main__":
    main()
