"""The model-facing half of the engine: prefill many sequences' new tokens in a few left-padded forwards, keep the
caches of all running sequences merged in one decode batch, and sample each row with its own parameters.

``ModelDecoder`` (engine/decoders.py) puts this path behind the interface ``EngineCore`` drives.

Works for any policy whose ``forward(ids, attention_mask, cache, use_cache)`` returns ``logits``, ``cache`` and
``router_ids`` and whose cache class has ``cat`` (merge rows, left-padding to the longest), ``select``, ``compact``
and ``keep_rows`` (select then compact): the K3 model (``K3Cache``) and Hugging Face models (``HFCache``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from sandforge.models.sampling import SamplingParams, sample_next

from . import native


@dataclass
class Prefill:
    """New tokens to feed after ``cache`` (None: a fresh sequence), and what feeding them gave."""

    cache: Any | None
    tokens: list[int]
    logits: Tensor | None = None  # [V] at the last new token
    routed: Tensor | None = None  # [len(tokens), n_moe_layers, top_k], MoE models only
    out_cache: Any = None  # the cache of this item's forward; the item is row ``out_row``
    out_row: int = 0
    error: Exception | None = None


def cat_caches(caches: list) -> Any:
    return type(caches[0]).cat(caches)


def length_groups(items: list[Prefill], slack: float = 1.25) -> list[list[Prefill]]:
    """Items of similar length together, so that left padding wastes at most ~``slack`` of the real tokens; fresh
    sequences and continuations apart (one forward either has a cache for every row or for none)."""
    groups = []
    for fresh in (True, False):
        batch: list[Prefill] = []
        real = 0
        for item in sorted((i for i in items if (i.cache is None) == fresh), key=lambda i: len(i.tokens)):
            n = len(item.tokens)  # the longest so far: items are sorted
            if batch and n * (len(batch) + 1) > slack * (real + n) + 16:
                groups.append(batch)
                batch, real = [], 0
            batch.append(item)
            real += n
        if batch:
            groups.append(batch)
    return groups


def run_prefill(model: nn.Module, items: list[Prefill], device: torch.device) -> None:
    """One forward over the items' new tokens, left-padded, each continuing its own cache."""
    width = max(len(item.tokens) for item in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, item in enumerate(items):
        ids[i, width - len(item.tokens) :] = torch.tensor(item.tokens, dtype=torch.long)
        mask[i, width - len(item.tokens) :] = 1
    cache = None if items[0].cache is None else cat_caches([item.cache for item in items])
    last = torch.tensor([width - 1], device=device)  # left padding: the last column is every row's last new token,
    out = model(ids.to(device), attention_mask=mask.to(device), cache=cache, use_cache=True,
                logits_at=last)  # and the only one sampled from: a prompt's other logits are never computed
    new_cache = out.cache.compact()
    for i, item in enumerate(items):
        item.logits = out.logits[i, -1]
        if out.router_ids is not None:
            item.routed = out.router_ids[i, width - len(item.tokens) :]
        item.out_cache, item.out_row = new_cache, i


def prefill(model: nn.Module, items: list[Prefill], device: torch.device) -> int:
    """Feed every item (grouped by length); an item whose forward fails gets ``error`` and the others still run.
    Returns the number of forwards."""
    forwards = 0
    for group in length_groups(items):
        try:
            forwards += 1
            run_prefill(model, group, device)
        except Exception as e:  # noqa: BLE001 - find the item at fault: run each alone
            if len(group) == 1:
                group[0].error = e
                continue
            for item in group:
                try:
                    forwards += 1
                    run_prefill(model, [item], device)
                except Exception as e1:  # noqa: BLE001
                    item.error = e1
    return forwards


def sample_kernel():
    """engine/kernels/sample.c's ``sample_rows_f32`` (None where it is not built)."""
    return native.function("sample_rows_f32", (ctypes.c_void_p,) * 5 + (ctypes.c_int64, ctypes.c_int64, ctypes.c_int))


def sample_rows(
    logits: Tensor, params: list[tuple[float, float, int]], generator: torch.Generator,
    generators: list[torch.Generator | None] | None = None, sampler: str = "cdf", use_kernel: bool = True,
) -> tuple[list[int], list[float]]:
    """logits [N, V]; params[i] = (temperature, top_p, top_k) of row i; generators[i]: row i's own generator (None:
    the shared ``generator``). Rows with equal parameters are sampled together by ``sample_next``, so each row follows
    exactly the definition of ``generate``, and a row with a generator of its own draws the same token whatever else
    is batched with it. ``sampler``: how tokens are drawn (models/sampling.py ``DRAWS``).

    Rows without truncation (top_p 1, top_k 0) drawn by ``cdf`` take the C kernel (engine/kernels/sample.c) where it is
    built: the same uniforms from the same generators in the same order, the same definition, so the same tokens
    (bar a uniform within rounding of a token's boundary) and log-probs within float rounding."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p, []).append(i)
    plain = sampler == "cdf" and all(top_p >= 1.0 and top_k <= 0 for _, top_p, top_k in groups)
    if (use_kernel and plain and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and sample_kernel() is not None):
        return _sample_rows_kernel(logits, params, groups, generator, generators)
    tokens, logprobs = [0] * len(params), [0.0] * len(params)
    for (temperature, top_p, top_k), rows in groups.items():
        idx = torch.tensor(rows, device=logits.device)
        own = None if generators is None else [generators[r] for r in rows]
        t, lp = sample_next(logits[idx], SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k), generator,
                            own, sampler)
        for r, ti, li in zip(rows, t.tolist(), lp.tolist()):
            tokens[r], logprobs[r] = ti, li
    return tokens, logprobs


def _sample_rows_kernel(logits: Tensor, params: list[tuple[float, float, int]], groups: dict[tuple, list[int]],
                        generator: torch.Generator, generators: list[torch.Generator | None] | None,
                        ) -> tuple[list[int], list[float]]:
    """``sample_rows`` by the kernel: each group's uniforms drawn as models/sampling.py ``draw`` draws them."""
    n = len(params)
    u = torch.zeros(n, dtype=torch.float32)
    for (temperature, _, _), rows in groups.items():
        if temperature <= 0:  # greedy draws nothing
            continue
        if generators is None:
            drawn = torch.rand(len(rows), 1, generator=generator, dtype=torch.float32)[:, 0]
        else:
            drawn = torch.cat([torch.rand(1, generator=generators[r] if generators[r] is not None else generator,
                                          dtype=torch.float32) for r in rows])
        u[rows] = drawn
    temperature = torch.tensor([p[0] for p in params], dtype=torch.float32)
    tokens = torch.empty(n, dtype=torch.int64)
    logprobs = torch.empty(n, dtype=torch.float32)
    logits = logits.contiguous()
    sample_kernel()(logits.data_ptr(), temperature.data_ptr(), u.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(),
                    n, logits.shape[1], torch.get_num_threads())
    return tokens.tolist(), logprobs.tolist()


class DecodeBatch:
    """The merged cache of all running sequences; row i of ``cache`` belongs to ``rows[i]``."""

    def __init__(self) -> None:
        self.rows: list = []
        self.cache: Any = None

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: list, cache: Any) -> None:
        self.cache = cache if self.cache is None else cat_caches([self.cache, cache])
        self.rows.extend(rows)

    def step(self, model: nn.Module, tokens: list[int], device: torch.device) -> tuple[Tensor, Tensor | None]:
        """Feed one token per row: logits [B, V] and, for MoE models, the routing of the fed tokens [B, L, k]."""
        ids = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
        out = model(ids, cache=self.cache, use_cache=True)  # no mask: every new token is real (and K3 skips pad logic)
        self.cache = out.cache
        return out.logits[:, -1], None if out.router_ids is None else out.router_ids[:, 0]

    def remove(self, indices: list[int]) -> list[Any]:
        """Take rows out; returns their batch-of-one caches, in the order of ``indices``."""
        gone = set(indices)
        caches = [self.cache.select([i]).compact() for i in indices]
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        self.cache = self.cache.keep_rows(keep) if keep else None
        return caches

    def clear(self) -> list:
        rows, self.rows, self.cache = self.rows, [], None
        return rows
