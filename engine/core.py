"""The embedded inference engine without Ray: continuous batching over many concurrent episodes, with a cache per
episode kept between turns.

Each request carries the whole sequence so far (token-in, token-out). One engine task loops; each iteration (run in a
worker thread, one model call at a time):

1. handles session closes and weight loads. By default a load waits until no sequence is running, and new requests
   wait for it, so a result never mixes two policies. An interrupting load (``load_weights(..., interrupt=True)``, or
   ``interrupt_loads`` set: the async RL loop) swaps the weights between two decode steps instead: K3-style partial
   rollouts, where sequences still generating continue on the new weights. Their caches were computed by the old
   weights, so each is rebuilt by a fresh prefill of everything it has fed under the new ones (the faithful choice:
   the continuation is exactly what the new policy generates from that prefix, at the price of one prefill per
   running sequence per update); each result's ``token_versions`` says which weights sampled each token;
2. admits pending requests while the decode batch has room: a request whose session cache covers a prefix of its
   prompt prefills only the rest; identical fresh prompts (and the n samples of one request) are prefilled once and the
   cache copied; a prompt seen recently is served from a snapshot; with the fused decoder, fresh prompts that share
   a prefix with each other or with a stored prompt (an RL step's system prompt and tool declarations) feed only
   what follows it (``prefix_tokens`` counts the tokens so served); prefills run in a few left-padded forwards;
3. runs one decode step over all running sequences, samples each with its own parameters, and retires the finished
   ones: their caches go back to their sessions, their requests' futures resolve.

A request may carry ``seed`` (an int): its samples then draw from generators of their own, seeded from it, so the same
request against the same weights samples the same tokens whatever else is batched with it (the logits themselves can
still differ in the last bits with batch composition: padding changes reductions). Without a seed, rows share the
engine's generator (``EngineCore.generator``, seeded at start); greedy decoding (temperature 0) draws nothing.

A result's ``cached_tokens`` counts the prompt tokens served from the episode's own session, so that ``routed_experts``
(one entry per token fed for ``prompt_ids[cached_tokens:] + token_ids[:-1]``) and the earlier turns' entries together
cover the sequence without gaps. Prompt tokens a request shares with another's prefill (same prompt, n > 1, snapshot)
count in its ``prefill_tokens`` and carry their routing; the engine's ``stats()`` count the work actually done.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from sandforge.types import GenerateRequest, Sample

from .batch import Prefill, cat_caches, sample_rows
from .decoders import make_decoder
from .requests import Request, Row, parse_request
from .sessions import CacheEntry, SessionStore

PREFIX_MIN = 32  # the shortest prompt prefix shared between fresh prompts that is prefilled once for all of them


def _extends(prompt: list[int], held: list[int]) -> bool:
    return len(prompt) > len(held) and prompt[: len(held)] == held


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class EngineCore:
    def __init__(
        self,
        model: nn.Module,
        max_batch_size: int = 32,
        session_memory_mb: float = 1024,
        seed: int = 0,
        max_prefill_tokens: int = 4096,
        max_snapshots: int = 16,
        sampler: str = "cdf",
        decoder: str = "auto",
    ):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.decoder = make_decoder(self.model, self.device, decoder)  # engine.decoder (engine/decoders.py)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens  # per iteration, so long prompts stall running sequences less
        self.max_seq_len = getattr(model.config, "max_seq_len", None)
        self.vocab_size = model.config.vocab_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampler = sampler  # engine.sampler: how tokens are drawn (models/sampling.py DRAWS)
        self.store = SessionStore(int(session_memory_mb * 2**20), max_snapshots)
        self.batch = self.decoder.new_batch()
        self.version = -1  # no trainer weights yet
        self.interrupt_loads = False  # True: loads swap weights under running sequences (see the module docstring)
        self.busy_seconds = 0.0  # time the engine thread spent working (the rest of the wall time it was idle)
        self.pending: deque[Request] = deque()
        # ("close", id) | ("load", state_dict, version, future, loop, interrupt, partial)
        self.commands: deque[tuple] = deque()
        self.counts: Counter = Counter()
        self._admitting: list = []  # the plan of the admission in progress
        self._closed: set[str] = set()  # sessions closed while a sample of theirs was running
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="engine")

    # ---------------------------------------------------------------- API
    async def generate(self, request: GenerateRequest) -> list[Sample]:
        """Sample ``request.n`` completions of ``request.prompt_ids``; see the module docstring."""
        loop = self._start()
        try:
            req = parse_request(request, loop, self.vocab_size, self.max_seq_len, self.max_batch_size)
        except ValueError:
            self.counts["failed_requests"] += 1
            raise
        self.pending.append(req)
        self._wake.set()
        return await req.future

    def close_session(self, session_id: str) -> None:
        """Forget an episode's cache (the episode is over); unknown ids are ignored."""
        self.commands.append(("close", session_id))
        if self._wake is not None:
            self._wake.set()

    def release_memory(self) -> None:
        """Drop every idle cache and hand the freed GPU memory back to the device (a colocated trainer is about to
        step); the sessions' next requests rebuild their caches by re-prefill."""
        self.commands.append(("release",))
        if self._wake is not None:
            self._wake.set()

    async def load_weights(self, state_dict: dict, version: int, interrupt: bool | None = None,
                           partial: bool = False) -> int:
        """New weights and their version. Waits for running sequences to finish, or with ``interrupt`` (default:
        ``interrupt_loads``) re-prefills them under the new weights and lets them go on; drops all cached sessions
        (their next requests rebuild them by re-prefill). ``partial``: ``state_dict`` holds only the weights that
        change (LoRA's merged layers); the rest stay as they are."""
        if partial:
            unknown = state_dict.keys() - self.model.state_dict().keys()
            if unknown:
                raise ValueError(f"weights for {len(unknown)} name(s) this model does not have (first: "
                                 f"{sorted(unknown)[0]})")
        loop = self._start()
        future = loop.create_future()
        interrupt = self.interrupt_loads if interrupt is None else interrupt
        self.commands.append(("load", state_dict, int(version), future, loop, bool(interrupt), partial))
        self._wake.set()
        return await future

    def rng_state(self) -> Tensor:
        """The shared sampling generator's state (for checkpoints: requests without a seed draw from it)."""
        return self.generator.get_state()

    def set_rng_state(self, state: Tensor) -> None:
        self.generator.set_state(state)

    def stats(self) -> dict:
        c = self.counts
        return {
            "version": self.version,
            "sessions": self.store.n_sessions,
            "snapshots": self.store.n_snapshots,
            "session_mb": self.store.nbytes / 2**20,
            "evictions": self.store.evictions,
            "rebuilds": c["rebuilds"],
            "interrupted_rows": c["interrupted_rows"],
            "reprefill_tokens": c["reprefill_tokens"],
            "busy_seconds": self.busy_seconds,
            "session_mismatches": c["session_mismatches"],
            "requests": c["requests"],
            "failed_requests": c["failed_requests"],
            "prefill_tokens": c["prefill_tokens"],
            "cached_tokens": c["cached_tokens"],
            "shared_prefills": c["shared_prefills"],
            "shared_prefill_tokens": c["shared_prefill_tokens"],
            "prefix_tokens": c["prefix_tokens"],
            "prefill_forwards": c["prefill_forwards"],
            "generated_tokens": c["generated_tokens"],
            "decode_steps": c["decode_steps"],
            "decode_tokens": c["decode_rows"],
            "mean_batch_size": c["decode_rows"] / max(c["decode_steps"], 1),
            "running": len(self.batch),
            "pending": len(self.pending),
        }

    async def shutdown(self) -> None:
        """Stop the engine task (tests; an actor's task lives as long as the actor)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def _start(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._serve())
        return loop

    def _busy(self) -> bool:
        return bool(self.pending or self.commands or len(self.batch))

    async def _serve(self) -> None:
        while True:
            self._wake.clear()
            if self._busy():  # one thread of our own: model calls never wait behind, or hold up, the loop's executor
                await asyncio.get_running_loop().run_in_executor(self._thread, self._run)
            else:
                await self._wake.wait()

    def _run(self) -> None:
        """Iterate while there is work (worker thread). Requests keep arriving meanwhile: the event loop appends to
        ``pending`` and ``commands``, which only this thread takes from."""
        while self._busy():
            try:
                self._iteration()
            except Exception as e:  # noqa: BLE001 - a failed step fails the requests in it, not the engine
                error = RuntimeError(f"the engine step failed: {type(e).__name__}: {e}")
                for req in [row.request for row in self.batch.clear()] + [p[0] for p in self._admitting]:
                    self._fail(req, error)
                self._admitting = []

    # ---------------------------------------------------------------- one iteration (worker thread)
    def _iteration(self) -> None:
        start = time.perf_counter()
        try:
            loading = self._commands()
            with torch.inference_mode():
                if not loading:
                    self._admit()
                if len(self.batch):
                    self._decode()
        finally:
            self.busy_seconds += time.perf_counter() - start

    def _commands(self) -> bool:
        """Run closes and (with nothing running) weight loads; True while a load still waits."""
        waiting = deque()
        while self.commands:
            cmd = self.commands.popleft()
            if cmd[0] == "close":
                self._close(cmd[1])
            elif cmd[0] == "release":
                self.store.clear()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            elif len(self.batch) and not cmd[5]:
                waiting.append(cmd)
            else:
                _, state_dict, version, future, loop, _, partial = cmd
                try:
                    self.model.load_state_dict(state_dict, strict=not partial)
                    self.decoder.refresh()
                    self.version = version
                    self.store.clear()
                    if len(self.batch):
                        with torch.inference_mode():
                            self._continue_on_new_weights()
                    self._resolve(loop, future, version)
                except Exception as e:  # noqa: BLE001 - e.g. mismatched keys: the caller hears it
                    self._resolve(loop, future, exc=e)
        self.commands.extendleft(reversed(waiting))
        return bool(waiting)

    def _continue_on_new_weights(self) -> None:
        """Partial rollouts: rebuild every running sequence's cache under the weights just loaded, by a fresh prefill
        of what it has fed (prompt + generated tokens but the last, which the next decode step feeds). Routing already
        recorded stays as it was when those tokens were fed (the routing that sampled them)."""
        rows = self.batch.clear()
        items = [Prefill(None, row.request.prompt + row.token_ids[:-1]) for row in rows]
        self.counts["prefill_forwards"] += self.decoder.prefill(items)
        self.counts["interrupted_rows"] += len(rows)
        self.counts["reprefill_tokens"] += sum(len(item.tokens) for item in items)
        keep, caches = [], []
        for row, item in zip(rows, items):
            if item.error is not None:
                self._fail(row.request, RuntimeError(f"re-prefill under new weights failed: {item.error}"))
            else:
                keep.append(row)
                caches.append((item.out_cache, item.out_row))
        if keep:
            self.batch.add(keep, self._gather(caches))

    def _close(self, session_id: str) -> None:
        """Forget a session and the sessions of its n > 1 samples (``id#i``), stored or still running."""
        children = session_id + "#"
        for kind, key in list(self.store.entries):
            if kind == "session" and (key == session_id or key.startswith(children)):
                self.store.close(key)
        for row in self.batch.rows:
            if row.session_id is not None and (row.session_id == session_id or row.session_id.startswith(children)):
                self._closed.add(row.session_id)

    def _admit(self) -> None:
        """Pending requests into the decode batch: look up their caches, prefill what is new, sample a first token."""
        room, budget = self.max_batch_size - len(self.batch), self.max_prefill_tokens
        items: dict[Any, Prefill] = {}  # one prefill per distinct (cache, new tokens)
        plan: list[tuple[Request, Prefill | CacheEntry, int]] = []  # request, where its cache comes from, cached
        self._admitting = plan  # failed iterations fail these too
        while self.pending and self.pending[0].n <= room:
            req = self.pending[0]
            entry = self._session_cache(req)
            cached = len(entry.tokens) if entry is not None else 0
            snapshot = self.store.snapshot(tuple(req.prompt)) if entry is None else None
            prefix = self._stored_prefix(req.prompt) if entry is None and snapshot is None else None
            cost = 0 if snapshot is not None else len(req.prompt) - cached - (prefix[1] if prefix else 0)
            if plan and cost > budget:
                break
            self.pending.popleft()
            self._claim_session(req, entry)
            room, budget = room - req.n, budget - cost
            req.version = self.version
            self.counts["requests"] += 1
            self.counts["cached_tokens"] += cached
            if snapshot is not None:
                plan.append((req, snapshot, 0))
                self.counts["shared_prefills"] += req.n
                self.counts["shared_prefill_tokens"] += req.n * len(req.prompt)
                continue
            key = ("fresh", tuple(req.prompt)) if entry is None else ("session", id(req))
            item = items.get(key)
            if item is None:
                if prefix is not None:  # a stored prompt's cache holds this one's first tokens
                    source, n = prefix
                    item = items[key] = Prefill(source.cache.prefix(n), req.prompt[n:])
                    self.counts["prefix_tokens"] += n
                else:
                    item = items[key] = Prefill(None if entry is None else entry.cache, req.prompt[cached:])
                self.counts["prefill_tokens"] += len(item.tokens)
                shared = req.n - 1
            else:
                shared = req.n
            self.counts["shared_prefills"] += shared
            self.counts["shared_prefill_tokens"] += shared * len(item.tokens)
            plan.append((req, item, cached))
        if not plan:
            self._admitting = []
            return
        self._share_prefixes([item for key, item in items.items() if key[0] == "fresh" and item.cache is None])
        self.counts["prefill_forwards"] += self.decoder.prefill(list(items.values()))
        for key, item in items.items():
            if key[0] == "fresh" and item.error is None:  # later requests for this prompt skip its prefill
                routed = None if item.routed is None else item.routed.clone()
                cache = item.out_cache.select([item.out_row]).compact()
                self.store.put_snapshot(key[1], CacheEntry(cache, list(key[1]), item.logits.clone(), routed))

        rows, caches, logits = [], [], []
        for req, source, cached in plan:
            if isinstance(source, Prefill) and source.error is not None:
                self._fail(req, ValueError(f"prefill failed: {type(source.error).__name__}: {source.error}"))
                continue
            for i in range(req.n):
                sid = req.session_id if req.n == 1 or req.session_id is None else f"{req.session_id}#{i}"
                row = Row(req, i, sid, cached)
                if req.seed is not None:  # per-request sampling: tokens independent of what else is batched
                    row.generator = torch.Generator(device=self.device).manual_seed((req.seed + i * 0x9E3779B1) % 2**63)
                if source.routed is not None:
                    row.routed.append(source.routed)
                rows.append(row)
                if isinstance(source, Prefill):
                    caches.append((source.out_cache, source.out_row))
                else:
                    caches.append((source.cache, 0))
                logits.append(source.logits)
        if rows:
            self.batch.add(rows, self._gather(caches))
            first = len(self.batch) - len(rows)
            self._sample(torch.stack(logits), list(range(first, len(self.batch))))
        self._admitting = []

    def _stored_prefix(self, prompt: list[int]) -> tuple[CacheEntry, int] | None:
        """The stored prompt sharing the longest prefix with ``prompt`` (at least ``PREFIX_MIN`` tokens, and one
        token short of the whole prompt: its last position must be fed for logits), and that length; None where the
        decoder's caches cannot be cut to a prefix (``prefix_caching``)."""
        if not self.decoder.prefix_caching or len(prompt) <= PREFIX_MIN:
            return None
        tokens = tuple(prompt)
        head = tokens[:PREFIX_MIN]
        best, length = None, PREFIX_MIN - 1
        for kind, key in self.store.entries:
            if kind == "prompt" and key[:PREFIX_MIN] == head:
                n = min(_common_prefix(key, tokens), len(prompt) - 1)
                if n > length:
                    best, length = self.store.entries[(kind, key)], n
        return None if best is None else (best, length)

    def _share_prefixes(self, fresh: list[Prefill]) -> None:
        """Fresh prompts admitted together that share a prefix (an RL step's episodes: the system prompt and the tool
        declarations) prefill it once: it is fed first, kept as a stored prompt (so later admissions under these
        weights find it too), and each prompt feeds only the rest."""
        if not self.decoder.prefix_caching:
            return
        groups: dict[tuple, list[Prefill]] = {}
        for item in fresh:
            if len(item.tokens) > PREFIX_MIN:
                groups.setdefault(tuple(item.tokens[:PREFIX_MIN]), []).append(item)
        for group in groups.values():
            if len(group) < 2:
                continue
            n = min(len(item.tokens) for item in group) - 1
            for item in group[1:]:
                n = min(n, _common_prefix(group[0].tokens, item.tokens))
            if n < PREFIX_MIN:
                continue
            shared = Prefill(None, group[0].tokens[:n])
            self.counts["prefill_forwards"] += self.decoder.prefill([shared])
            if shared.error is not None:  # each prompt is prefilled whole instead
                continue
            cache = shared.out_cache.select([shared.out_row]).compact()
            self.store.put_snapshot(tuple(shared.tokens), CacheEntry(cache, list(shared.tokens), shared.logits.clone()))
            for item in group:
                item.cache, item.tokens = cache, item.tokens[n:]
            self.counts["prefill_tokens"] -= (len(group) - 1) * n
            self.counts["prefix_tokens"] += (len(group) - 1) * n

    def _session_cache(self, req: Request) -> CacheEntry | None:
        """The request's session cache if its prompt extends what that cache holds (looked at, not taken)."""
        if req.session_id is None:
            return None
        entry = self.store.peek(req.session_id)
        return entry if entry is not None and _extends(req.prompt, entry.tokens) else None

    def _claim_session(self, req: Request, entry: CacheEntry | None) -> None:
        """An admitted request of one sample takes its session's cache (it returns when the sample finishes); a
        request without a usable cache counts as a rebuild when its session had one."""
        if req.session_id is None:
            return
        if entry is None:
            stale = self.store.take(req.session_id) if req.n == 1 else self.store.peek(req.session_id)
            if stale is not None:  # a different history: start over
                self.counts["session_mismatches"] += 1
            if stale is not None or self.store.was_forgotten(req.session_id):
                self.counts["rebuilds"] += 1
        elif req.n == 1:
            self.store.take(req.session_id)

    @staticmethod
    def _gather(caches: list[tuple[Any, int]]) -> Any:
        """One cache from (cache, row) pairs: consecutive rows of the same cache are taken with one select."""
        parts, run_cache, run_rows = [], None, []
        for cache, row in caches + [(None, 0)]:
            if cache is not run_cache and run_rows:
                parts.append(run_cache.select(run_rows))
                run_rows = []
            run_cache = cache
            run_rows.append(row)
        return parts[0] if len(parts) == 1 else cat_caches(parts)

    def _decode(self) -> None:
        rows = self.batch.rows
        logits, routed = self.decoder.step(self.batch, [r.token_ids[-1] for r in rows])
        self.counts["decode_steps"] += 1
        self.counts["decode_rows"] += len(rows)
        if routed is not None:
            for i, row in enumerate(rows):
                row.routed.append(routed[i : i + 1])
        self._sample(logits, list(range(len(rows))))

    def _sample(self, logits: Tensor, indices: list[int]) -> None:
        """Sample the next token of batch rows ``indices`` from ``logits`` (one row each); retire finished rows."""
        rows = [self.batch.rows[i] for i in indices]
        # a seeded row draws from its own generator, the others from the engine's, all in one pass
        tokens, logprobs = sample_rows(logits, [r.request.params for r in rows], self.generator,
                                       [r.generator for r in rows], self.sampler)
        done = []
        for i, row, token, logprob in zip(indices, rows, tokens, logprobs):
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            row.versions.append(self.version)
            if token in row.request.stop:
                row.finish_reason = "stop"
            elif len(row.token_ids) >= row.request.budget:
                row.finish_reason = "length"
            if row.finish_reason is not None:
                done.append(i)
        self.counts["generated_tokens"] += len(rows)
        if done:
            finished = [self.batch.rows[i] for i in done]
            for row, cache in zip(finished, self.batch.remove(done)):
                self._retire(row, cache)

    def _retire(self, row: Row, cache: Any) -> None:
        req = row.request
        if row.session_id in self._closed:
            self._closed.discard(row.session_id)
        elif row.session_id is not None and not req.failed:
            self.store.put(row.session_id, CacheEntry(cache, req.prompt + row.token_ids[:-1]))
        routed = torch.cat(row.routed).tolist() if row.routed else None
        req.results[row.sample] = Sample(
            token_ids=row.token_ids,
            logprobs=row.logprobs,
            finish_reason=row.finish_reason,
            version=req.version,
            token_versions=row.versions,  # per token: the weights that sampled it (differs after an interrupt)
            cached_tokens=row.cached,
            prefill_tokens=len(req.prompt) - row.cached,
            routed_experts=routed,
        )
        if all(r is not None for r in req.results) and not req.failed:
            self._resolve(req.loop, req.future, req.results)

    def _fail(self, req: Request, exc: Exception) -> None:
        if not req.failed:
            req.failed = True
            self.counts["failed_requests"] += 1
            self._resolve(req.loop, req.future, exc=exc)

    @staticmethod
    def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value=None, exc: Exception | None = None):
        def set_() -> None:
            if future.done():  # the caller gave up (cancelled)
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(value)

        loop.call_soon_threadsafe(set_)
