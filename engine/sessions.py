"""Idle model caches the engine keeps between requests: one per episode (session) and a few per prompt (snapshots).

A session's cache holds the tokens the engine has fed for that episode (the last turn's prompt and generated tokens,
except the last sampled one, which was never fed), so the next turn prefills only what it appends. A snapshot is the
cache of one whole prompt plus its last-position logits and routing, keyed by the exact token tuple: G episodes of the
same task that arrive a little apart share one prefill.

Both live under one memory budget; when it is exceeded, the least recently used entries go first. Running sequences
are not here (their caches are in the decode batch), so they are never evicted. A session that was evicted, or dropped
because the weights changed, is remembered by id so that its next request counts as a rebuild.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from torch import Tensor

FORGOTTEN_IDS = 65536  # how many evicted session ids are remembered (for the rebuild count only)


@dataclass
class CacheEntry:
    cache: Any  # a batch-of-one model cache (K3Cache or HFCache): has nbytes, select, cat, compact
    tokens: list[int]  # the tokens the cache holds
    logits: Tensor | None = None  # snapshots: logits at the last prompt position [V]
    routed: Tensor | None = None  # snapshots of MoE models: routing of the prompt tokens [T, n_moe_layers, top_k]

    @property
    def nbytes(self) -> int:
        extra = sum(t.nbytes for t in (self.logits, self.routed) if t is not None)
        return self.cache.nbytes + extra


class SessionStore:
    def __init__(self, budget_bytes: int, max_snapshots: int = 16):
        self.budget_bytes = budget_bytes
        self.max_snapshots = max_snapshots
        self.entries: OrderedDict[tuple[str, Any], CacheEntry] = OrderedDict()  # ("session", id) | ("prompt", tokens)
        self.forgotten: OrderedDict[str, None] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0  # sessions evicted by the memory budget
        self.n_snapshots = 0

    @property
    def n_sessions(self) -> int:
        return len(self.entries) - self.n_snapshots

    # ---------------------------------------------------------------- sessions
    def take(self, session_id: str) -> CacheEntry | None:
        """Remove and return a session's cache: the sequence that continues it owns it until it finishes."""
        return self._pop(("session", session_id))

    def peek(self, session_id: str) -> CacheEntry | None:
        """A session's cache, left in place (marked as recently used)."""
        return self._get(("session", session_id))

    def put(self, session_id: str, entry: CacheEntry) -> None:
        self.forgotten.pop(session_id, None)
        self._put(("session", session_id), entry)

    def close(self, session_id: str) -> None:
        self._pop(("session", session_id))
        self.forgotten.pop(session_id, None)

    def was_forgotten(self, session_id: str) -> bool:
        """Whether this session had a cache that was evicted or dropped (and forget that it had)."""
        if session_id not in self.forgotten:
            return False
        del self.forgotten[session_id]
        return True

    # ---------------------------------------------------------------- snapshots
    def snapshot(self, tokens: tuple[int, ...]) -> CacheEntry | None:
        return self._get(("prompt", tokens))

    def put_snapshot(self, tokens: tuple[int, ...], entry: CacheEntry) -> None:
        self._put(("prompt", tokens), entry)
        while self.n_snapshots > self.max_snapshots:
            oldest = next(k for k in self.entries if k[0] == "prompt")
            self._pop(oldest)

    # ---------------------------------------------------------------- all
    def clear(self) -> None:
        """Drop every cache (the weights changed); the sessions' next requests rebuild them."""
        for kind, key in list(self.entries):
            if kind == "session":
                self._forget(key)
        self.entries.clear()
        self.nbytes = self.n_snapshots = 0

    def _get(self, key) -> CacheEntry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def _put(self, key, entry: CacheEntry) -> None:
        self._pop(key)
        self.entries[key] = entry
        self.nbytes += entry.nbytes
        self.n_snapshots += key[0] == "prompt"
        self._evict()

    def _pop(self, key) -> CacheEntry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            self.n_snapshots -= key[0] == "prompt"
        return entry

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes and self.entries:
            kind, key = next(iter(self.entries))
            self._pop((kind, key))
            if kind == "session":
                self.evictions += 1
                self._forget(key)

    def _forget(self, session_id: str) -> None:
        self.forgotten[session_id] = None
        if len(self.forgotten) > FORGOTTEN_IDS:
            self.forgotten.popitem(last=False)
