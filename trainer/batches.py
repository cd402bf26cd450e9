"""A micro-batch as tensors: right-padded token rows, and the policy's scores of them in a packed or padded layout.

Everything after the forward is written for the padded layout [B, T]; ``forward_scores`` packs sequences into shared
rows for the forward when the layout says so and unpacks its outputs, so packing never leaks into the loss code.
"""

from __future__ import annotations

import torch

from sandforge.models.sampling import TokenScores, token_scores
from sandforge.models.packing import PackedLayout
from sandforge.trainer.routing_replay import UNKNOWN, replaying
from sandforge.types import TrainingRow

# an empty micro-batch's stand-in: no loss tokens, so it adds nothing but keeps the ranks' backward counts equal
DUMMY_ROW = TrainingRow(token_ids=[0, 0], loss_mask=[0, 0], logprobs=[0.0, 0.0], advantages=[0.0, 0.0],
                        returns=[0.0, 0.0])


def pad_right(rows: list[list], value, dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """Rows padded to the longest with ``value``, as one [B, T] tensor on ``device`` (built on CPU, moved once)."""
    width = max(len(r) for r in rows)
    out = torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)
    return out if device is None else out.to(device, non_blocking=True)


def token_batch(rows: list[TrainingRow], device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and their attention mask [B, T] for a micro-batch of rows, on ``device``."""
    ids = pad_right([r.token_ids for r in rows], 0, torch.long, device)
    attn = pad_right([[1] * len(r.token_ids) for r in rows], 0, torch.long, device)
    return ids, attn


def forward_scores(model, rows: list[TrainingRow], layout: PackedLayout, temperature: float = 1.0,
                   forced: torch.Tensor | None = None, device: torch.device | str | None = None,
                   all_tokens: bool = False, **kwargs) -> TokenScores:
    """``token_scores`` of right-padded ``rows``, computed in ``layout`` (packed rows, or one row each) and returned
    in the padded layout, so everything after the forward is the same whether sequences were packed or not.
    Only the rows' loss-mask tokens are scored (the rest are 0; ``all_tokens``: every token, the reference).
    ``temperature``: what a row is scored at unless it carries its own (``TrainingRow.temperature``).
    ``forced``: the engine's routing [B, T, layers, k] to replay (padded layout, -1 unknown); ``device``: the
    model's, where the batch is built."""
    ids, attn = token_batch(rows, device)
    score_mask = None if all_tokens else pad_right([r.loss_mask for r in rows], 0, torch.bool)  # host: no sync
    temperature = row_temperatures(rows, temperature, device)
    if layout.is_padded:
        return token_scores(replaying(model, forced), ids, attn, temperature, score_mask=score_mask, **kwargs)
    if forced is not None:
        forced = layout.pack_tensor(forced, fill=UNKNOWN)
    if score_mask is not None:
        score_mask = layout.pack_tensor(score_mask, fill=False)
    if isinstance(temperature, torch.Tensor):
        temperature = layout.pack_tensor(temperature, fill=1.0)
    s = token_scores(replaying(model, forced), layout.pack_tensor(ids), None, temperature,
                     segment_ids=layout.segment_ids(ids.device), score_mask=score_mask, **kwargs)
    unpack = layout.unpack
    return TokenScores(unpack(s.logprobs), s.aux_loss, None if s.entropy is None else unpack(s.entropy),
                       None if s.hidden is None else unpack(s.hidden))


def row_temperatures(rows: list[TrainingRow], default: float,
                     device: torch.device | str | None = None) -> float | torch.Tensor:
    """The temperature each row is scored at: its own, else ``default``. One float when the rows agree (the common
    case, and the only one without per-environment temperatures), else a [B, T] tensor, each row's on every token."""
    each = [default if r.temperature is None else r.temperature for r in rows]
    if len(set(each)) == 1:
        return each[0]
    return pad_right([[t] * len(r.token_ids) for t, r in zip(each, rows)], 1.0, torch.float32, device)


def split_micro_batches(rows: list[TrainingRow], n: int, padded: bool = False) -> list[list[TrainingRow]]:
    """n micro-batches. Packed rows: sequences dealt longest-first, so the micro-batches' sizes stay close. Padded
    rows (``padded``: every row padded to the micro-batch's longest): runs of similar length, longest first, so short
    sequences are not padded to a long one's length (agentic episodes range from hundreds to thousands of tokens)."""
    order = sorted(rows, key=lambda r: len(r.token_ids), reverse=True)
    if padded:
        size, extra = divmod(len(order), n)
        bounds = [i * size + min(i, extra) for i in range(n + 1)]
        return [order[bounds[i] : bounds[i + 1]] for i in range(n)]
    return [order[i::n] for i in range(n)]
