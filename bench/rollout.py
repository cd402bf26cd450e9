"""Rollout engine benchmarks on CPU: how much of each multi-turn episode the engine prefills with sessions against
re-prefilling the whole history, and its decode throughput against HF-style static-batch generation.

    python bench/rollout.py [--preset k3-nano] [--episodes 32] [--turns 10] [--threads 1] [--seed 0]
                            [--prefill-episodes 8] [--sandbox-concurrency 1,8,32,64] [--sections prefill decode]

Sections (each returns a dict of JSON keys; ``main`` merges them):
- prefill: ``--prefill-episodes`` simulated 10-turn episodes (observations of 20-60 tokens, generations of 16-48)
  through the engine with a session per episode, and through the same engine with no sessions (every turn re-prefills
  the whole history).
  prefill_ratio_10_turns = prefilled tokens / sequence tokens with sessions (target <= 1.1); prefill_ratio_reprefill
  the same without; fed_ratio_10_turns = (prefilled + decoded tokens) / sequence tokens (1.0: each token fed once).
- decode: ``--episodes`` concurrent multi-turn episodes with varied generation lengths (mostly short tool calls, some
  long reasoning) through the engine (continuous batching, sessions), against HF ``generate`` semantics on the same
  model and requests: each turn's requests run as fixed batches until their longest member finishes (finished rows are
  still computed, as padding), every turn re-prefills the whole history (no cache across calls), nothing joins a
  running batch. decode_vs_hf_generate = engine tokens/s / baseline tokens/s (target >= 3), in CPU time of this
  process (one torch thread), since other jobs on a shared machine stretch wall time unevenly; the wall-time ratio is
  printed too. Both decode greedily, so their outputs should be identical; the table says whether they are.
- sandbox episodes (needs Docker; skipped with a row saying why): episodes/s at 1, 8, 32 and 64 concurrent TerminalEnv
  episodes (``--sandbox-concurrency``) against real containers, through ``RolloutWorker.run_episodes`` in this process
  (its SandboxPool holds ``concurrency`` warm sandboxes, ``max_live`` = concurrency, filled before the clock starts).
  Twice: with the scripted reference policy (sandbox + agent loop throughput: 2 x concurrency episodes, each
  resetting, running the reference tool calls, graded and removed), keys ``episodes_per_s_c1`` ... ``_c64`` and
  ``episodes_per_s_c64_vs_c1``; and with an in-process EngineCore serving this (untrained) model, 3 turns of up to 24
  tokens (adds model time; its replies make no tool calls), keys ``episodes_per_s_c1_engine`` ... Every container is
  removed by its run label at the end.

``--sections prefill decode`` runs only those. Prints a table, then as the last line a JSON object with the keys of every
section run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from dataclasses import asdict, dataclass, replace

import torch
from rich.console import Console
from rich.table import Table

from sandforge.engine import EngineCore
from sandforge.models.k3.model import PRESETS, K3Model, count_parameters
from sandforge.models.sampling import SamplingParams, sample_next
from sandforge.types import GenerateRequest


@dataclass
class Episode:
    """A scripted episode: its first prompt, and per turn the generation budget and the observation that follows."""

    prompt: list[int]
    max_tokens: list[int]
    observations: list[list[int]]


def make_episodes(n: int, turns: int, vocab: int, prompt_len: tuple[int, int], obs_len: tuple[int, int],
                  gen_len, seed: int) -> list[Episode]:
    """Random token episodes; ``gen_len(rng)`` draws a turn's generation length (no stop token: exactly that many)."""
    rng = random.Random(seed)

    def tokens(lo: int, hi: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))]

    return [Episode(tokens(*prompt_len), [gen_len(rng) for _ in range(turns)],
                    [tokens(*obs_len) for _ in range(turns - 1)]) for _ in range(n)]


def agentic_gen_len(rng: random.Random) -> int:
    """Mostly short tool calls, sometimes a long stretch of reasoning: 70% 8-48 tokens, 30% 64-160."""
    return rng.randint(8, 48) if rng.random() < 0.7 else rng.randint(64, 160)


async def run_on_engine(engine: EngineCore, episodes: list[Episode], sessions: bool) -> list[list[int]]:
    """All episodes at once; each turn's prompt is the whole sequence so far (token-in). Returns the final sequences."""

    async def one(i: int, ep: Episode) -> list[int]:
        seq = list(ep.prompt)
        for t, max_tokens in enumerate(ep.max_tokens):
            [out] = await engine.generate(GenerateRequest(prompt_ids=seq, session_id=f"ep{i}" if sessions else None,
                                                          max_tokens=max_tokens, temperature=0.0))
            seq += out.token_ids
            if t < len(ep.observations):
                seq += ep.observations[t]
        engine.close_session(f"ep{i}")
        return seq

    return await asyncio.gather(*(one(i, ep) for i, ep in enumerate(episodes)))


class Clock:
    """Wall time and this process's CPU time (all threads). On a shared machine other people's jobs stretch the wall
    time of one run and not the other's; CPU time is what the work itself cost."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def engine_run(model, episodes: list[Episode], sessions: bool, max_batch_size: int) -> tuple[list, dict, Clock]:
    async def main():
        engine = EngineCore(model, max_batch_size=max_batch_size)
        try:
            with Clock() as clock:
                seqs = await run_on_engine(engine, episodes, sessions)
            return seqs, engine.stats(), clock
        finally:
            await engine.shutdown()

    return asyncio.run(main())


@torch.inference_mode()
def static_generate(model, prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
    """HF ``generate`` semantics, greedy: one left-padded batch, decoded until its longest member is done; rows that
    are done keep being computed (their extra tokens are dropped), no row leaves and none joins."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model(ids, attention_mask=mask, use_cache=True)
    logits, cache = out.logits[:, -1], out.cache
    generated = []
    for step in range(max(budgets)):
        tokens, _ = sample_next(logits, SamplingParams(temperature=0.0))
        generated.append(tokens)
        if step + 1 < max(budgets):
            out = model(tokens[:, None], cache=cache, use_cache=True)  # no mask, as the engine's decode step
            logits, cache = out.logits[:, -1], out.cache
    columns = torch.stack(generated, dim=1).tolist()
    return [row[:n] for row, n in zip(columns, budgets)]


def static_run(model, episodes: list[Episode], batch_size: int) -> tuple[list, Clock, int]:
    """Turn by turn, the episodes in fixed batches; every turn re-prefills each history. Returns the final sequences,
    the time, and the tokens prefilled."""
    seqs = [list(ep.prompt) for ep in episodes]
    prefilled = 0
    with Clock() as clock:
        for t in range(len(episodes[0].max_tokens)):
            for start in range(0, len(episodes), batch_size):
                rows = range(start, min(start + batch_size, len(episodes)))
                prefilled += sum(len(seqs[i]) for i in rows)
                outs = static_generate(model, [seqs[i] for i in rows], [episodes[i].max_tokens[t] for i in rows])
                for i, out in zip(rows, outs):
                    seqs[i] += out
                    if t < len(episodes[i].observations):
                        seqs[i] += episodes[i].observations[t]
    return seqs, clock, prefilled


# ---------------------------------------------------------------- sections
def prefill_section(model, args, table: Table) -> dict:
    vocab = model.config.vocab_size
    episodes = make_episodes(args.prefill_episodes, 10, vocab, (64, 128), (20, 60), lambda r: r.randint(16, 48),
                             args.seed)
    seqs, with_sessions, _ = engine_run(model, episodes, sessions=True, max_batch_size=args.batch)
    again, without, _ = engine_run(model, episodes, sessions=False, max_batch_size=args.batch)
    total = sum(map(len, seqs))
    ratio = with_sessions["prefill_tokens"] / total
    baseline = without["prefill_tokens"] / total
    computed = (with_sessions["prefill_tokens"] + with_sessions["decode_tokens"]) / total
    table.add_row("prefill / sequence tokens, 10 turns, sessions", f"{ratio:.3f}", "target <= 1.1")
    table.add_row("prefill / sequence tokens, 10 turns, re-prefill", f"{baseline:.3f}", f"{baseline / ratio:.1f}x more")
    table.add_row("tokens fed / sequence tokens, sessions", f"{computed:.3f}", "prefill + decode; 1.0 = each once")
    table.add_row("greedy outputs identical with and without sessions", str(again == seqs), "")
    return {"prefill_ratio_10_turns": round(ratio, 4), "prefill_ratio_reprefill": round(baseline, 4),
            "fed_ratio_10_turns": round(computed, 4)}


def decode_section(model, args, table: Table) -> dict:
    episodes = make_episodes(args.episodes, args.turns, model.config.vocab_size, (64, 128), (20, 60), agentic_gen_len,
                             args.seed + 1)
    n_tokens = sum(sum(ep.max_tokens) for ep in episodes)
    base_seqs, base, base_prefill = static_run(model, episodes, args.batch)
    seqs, stats, engine = engine_run(model, episodes, sessions=True, max_batch_size=args.batch)
    same = seqs == base_seqs
    ratio, wall_ratio = base.cpu / engine.cpu, base.wall / engine.wall
    table.add_row(f"HF-style static batches of {args.batch}, re-prefill", f"{n_tokens / base.cpu:,.0f} tok/s",
                  f"{base.cpu:.1f} s CPU ({base.wall:.1f} s wall), {base_prefill:,} prefilled")
    table.add_row("engine: continuous batching + sessions", f"{n_tokens / engine.cpu:,.0f} tok/s",
                  f"{engine.cpu:.1f} s CPU ({engine.wall:.1f} s wall), {stats['prefill_tokens']:,} prefilled, "
                  f"mean batch {stats['mean_batch_size']:.1f}")
    table.add_row("decode_vs_hf_generate (CPU time)", f"{ratio:.2f}x", f"target >= 3; wall time: {wall_ratio:.2f}x")
    table.add_row("identical greedy outputs", str(same), f"{n_tokens:,} tokens, {args.episodes} x {args.turns} turns")
    return {"decode_vs_hf_generate": round(ratio, 2), "decode_vs_hf_generate_wall": round(wall_ratio, 2),
            "engine_tokens_per_s": round(n_tokens / engine.cpu, 1),
            "hf_generate_tokens_per_s": round(n_tokens / base.cpu, 1),
            "decode_outputs_identical": same, "engine_mean_batch_size": round(stats["mean_batch_size"], 2)}


def _episodes_per_s(concurrency: int, n_episodes: int, model, images: dict, run_id: str, scripted: bool) -> tuple[float, int]:
    """``n_episodes`` TerminalEnv episodes through one in-process ``RolloutWorker`` running ``concurrency`` at once
    (its pool: ``concurrency`` warm sandboxes, ``max_live`` = concurrency, created before the clock starts).
    Returns (episodes/s, failed episodes)."""
    from sandforge.config import JobConfig
    from sandforge.sandbox.labels import driver_labels
    from sandforge.environments.terminal.tasks import FAMILIES
    from sandforge.rollout.worker import RolloutWorker, WorkerSetup

    job = JobConfig.model_validate({
        "rollout": {"workers": 1, "concurrency": concurrency, "max_turns": 3, "max_new_tokens": 24,
                    "temperature": 1.0, "episode_timeout": 300},
        "sandbox": {"warm_pool": concurrency, "max_live": concurrency, "creates_per_second": 32},
    })
    setup = WorkerSetup(run_id=run_id, engine="in-process", images=images, labels=driver_labels(run_id),
                        environments=tuple(job.environments), rollout=job.rollout, sandbox=job.sandbox, model=job.model)
    tasks = [asdict(FAMILIES[("write_file", "count_words")[i % 2]](i)) for i in range(n_episodes)]

    async def go() -> tuple[float, int]:
        engine = object() if scripted else EngineCore(model, max_batch_size=64)  # scripted: never asked
        worker = RolloutWorker(0, setup, engine)
        try:
            for pool in worker.pools.values():
                await asyncio.to_thread(pool.wait_ready, 300)
            start = time.perf_counter()
            out = await worker.run_episodes(tasks, [f"g{i}" for i in range(n_episodes)], 0, scripted=scripted)
            wall = time.perf_counter() - start
            return n_episodes / wall, sum(bool(t["failed"]) for t in out)
        finally:
            await asyncio.to_thread(worker.close)
            if not scripted:
                await engine.shutdown()

    return asyncio.run(go())


def sandbox_episodes_section(model, args, table: Table) -> dict:
    """Episodes/s at 1, 8, 32 and 64 concurrent TerminalEnv episodes against real containers, through the rollout
    worker's code path in this process: the scripted reference policy (sandbox + agent loop only: each episode resets,
    runs the reference tool calls, is graded and removed) and the engine with this model (untrained, so its replies
    add model time and error observations, not tool calls)."""
    from sandforge.sandbox.daemon import docker_client
    from sandforge.sandbox.images import build_images
    from sandforge.sandbox.lifecycle import remove_run_containers
    from sandforge.types import SandboxError

    if not args.sandbox_concurrency:
        return {}
    try:
        client = docker_client()
        images = build_images(["terminal"], client=client, show_progress=False)
    except SandboxError as e:
        table.add_row("episodes/s against real sandboxes", "skipped", f"no Docker daemon: {e}")
        return {}
    from sandforge.config import ModelConfig
    from sandforge.models.build import load_chat

    vocab = load_chat(ModelConfig()).tokenizer.vocab_size  # the worker's chat format
    if model.config.vocab_size != vocab:
        model = K3Model(replace(model.config, vocab_size=vocab)).eval()
    run_id = f"bench-rollout-{uuid.uuid4().hex[:10]}"
    result: dict = {}
    try:
        for scripted, label in ((True, "scripted"), (False, "engine")):
            rates = {}
            for c in args.sandbox_concurrency:
                n = max(4, 2 * c) if scripted else max(4, c)
                rate, failed = _episodes_per_s(c, n, model, images, run_id, scripted)
                rates[c] = rate
                suffix = "" if scripted else "_engine"
                result[f"episodes_per_s_c{c}{suffix}"] = round(rate, 3)
                table.add_row(f"episodes/s, {c} concurrent, {label} policy", f"{rate:.2f}",
                              f"{n} episodes, {failed} failed; {rate / rates[args.sandbox_concurrency[0]]:.1f}x c1")
            base = rates[args.sandbox_concurrency[0]]
            for c, rate in rates.items():
                if c != args.sandbox_concurrency[0]:
                    result[f"episodes_per_s_c{c}{'' if scripted else '_engine'}_vs_c1"] = round(rate / base, 2)
    finally:
        left = remove_run_containers(run_id, client)
        if left:
            table.add_row("containers left and removed", str(left), run_id)
    return result


# Sections run in order; each adds rows to the table and returns its JSON keys.
SECTIONS = [prefill_section, decode_section, sandbox_episodes_section]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3-nano", choices=sorted(PRESETS))
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32, help="engine max_batch_size = the baseline's batch size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-episodes", type=int, default=8, help="10-turn episodes of the prefill section")
    ap.add_argument("--sandbox-concurrency", default="1,8,32,64",
                    help="concurrent episodes for the real-sandbox section, comma-separated (empty: skip it)")
    ap.add_argument("--sections", nargs="+", choices=[s.__name__.removesuffix("_section") for s in SECTIONS],
                    help="run only these sections (default: all)")
    args = ap.parse_args()
    args.sandbox_concurrency = [int(c) for c in args.sandbox_concurrency.split(",") if c]

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = K3Model(replace(PRESETS[args.preset], max_seq_len=1 << 16)).eval()
    table = Table(title=f"rollout engine, {args.preset} ({count_parameters(model) / 1e6:.2f}M params), fp32 CPU, "
                        f"{torch.get_num_threads()} thread(s)")
    for column in ("what", "value", "notes"):
        table.add_column(column)
    result: dict = {}
    for section in SECTIONS:
        if args.sections is None or section.__name__.removesuffix("_section") in args.sections:
            result.update(section(model, args, table))
    Console().print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
