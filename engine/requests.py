"""Engine requests: the ``GenerateRequest`` a caller sends, checked and turned into a ``Request``; a ``Row`` per sample."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from numbers import Integral

import torch
from torch import Tensor

from sandforge.types import GenerateRequest, Sample


@dataclass(eq=False)
class Request:
    prompt: list[int]
    session_id: str | None
    n: int
    params: tuple[float, float, int]  # temperature, top_p, top_k
    stop: frozenset[int]
    budget: int  # new tokens allowed: max_tokens, capped by the model's context
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    version: int = -1
    results: list[Sample | None] = field(default_factory=list)
    failed: bool = False
    seed: int | None = None  # sample i draws from its own generator seeded (seed, i): the same tokens in any batch


@dataclass(eq=False)
class Row:
    """One sample being generated. Its cache holds ``prompt + token_ids[:-1]``: the last sampled token is fed next."""

    request: Request
    sample: int
    session_id: str | None
    cached: int  # prompt tokens served from the session's cache
    routed: list[Tensor] = field(default_factory=list)  # [t, n_moe_layers, top_k] per feed, in order
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weight version that sampled each token
    finish_reason: str | None = None
    generator: torch.Generator | None = None  # the request's seeded generator; None: the engine's shared one


def parse_request(request: GenerateRequest, loop: asyncio.AbstractEventLoop, vocab_size: int, max_seq_len: int | None,
                  max_batch_size: int) -> Request:
    """Validate one request; a bad one raises ValueError (in its caller only, touching nothing else)."""
    try:
        return _parse(request, loop, vocab_size, max_seq_len, max_batch_size)
    except (TypeError, KeyError) as e:  # e.g. stop_ids not a list: still the request's fault
        raise ValueError(f"bad request ({type(e).__name__}: {e}); see EngineCore.generate") from e


def _parse(r: GenerateRequest, loop: asyncio.AbstractEventLoop, vocab_size: int, max_seq_len: int | None,
           max_batch_size: int) -> Request:
    if not isinstance(r, GenerateRequest):
        raise ValueError(f"the engine takes a GenerateRequest (sandforge.types), got {type(r).__name__}; over HTTP a "
                         "request is GenerateRequest.to_dict()")
    prompt = r.prompt_ids
    if not prompt:
        raise ValueError("prompt_ids is empty; render it with the chat format (it starts with the bos token)")
    bad = [t for t in prompt if not (isinstance(t, Integral) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt_ids holds {bad[0]!r}; token ids are ints in [0, {vocab_size})")
    if max_seq_len is not None and len(prompt) >= max_seq_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model's max_seq_len is {max_seq_len}")
    n, max_tokens, top_k = r.n, r.max_tokens, r.top_k
    temperature, top_p = float(r.temperature), float(r.top_p)
    if not (isinstance(n, int) and 1 <= n <= max_batch_size):
        raise ValueError(f"n={n!r}: samples per request must be between 1 and max_batch_size={max_batch_size}")
    if not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 1")
    if temperature < 0 or not 0 < top_p <= 1 or not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"bad sampling parameters: temperature={temperature} (>= 0), top_p={top_p} (0 < p <= 1), "
                         f"top_k={top_k!r} (int >= 0, 0 = off)")
    stop = r.stop_ids
    if not all(isinstance(t, Integral) for t in stop):
        raise ValueError(f"stop_ids must be token ids (ints), got {stop!r:.80}")
    seed = r.seed
    if seed is not None and not (isinstance(seed, Integral) and not isinstance(seed, bool) and 0 <= seed < 2**63):
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**63) or null")
    session_id = r.session_id
    budget = max_tokens if max_seq_len is None else min(max_tokens, max_seq_len - len(prompt))
    return Request([int(t) for t in prompt], None if session_id is None else str(session_id), n,
                   (temperature, top_p, top_k), frozenset(int(t) for t in stop), budget, loop.create_future(), loop,
                   results=[None] * n, seed=None if seed is None else int(seed))
