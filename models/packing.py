"""Sequence packing: several sequences share one row of the training forward instead of each padding to the longest.

A micro-batch of N sequences is laid out as R <= N rows of width W = the longest sequence's length. Sequences are
placed first-fit-decreasing; each starts at a multiple of ``align`` (the K3 KDA chunk, so a chunk never holds the end
of one sequence and the start of the next and the recurrent state resets exactly between chunks), and alignment pads
sit between them. ``segment_ids`` [R, W] name the sequence of every slot (i + 1 for sequence i, 0 for a pad); the model
keeps sequences apart with it (MLA attends within a segment, KDA resets its state and short convolutions at a segment
start), so a packed forward computes what N separate forwards compute, with fewer pads.

The layout never makes a forward wider than padding (W is the longest length) and rarely taller (R <= N). Everything
outside the forward stays in the padded [N, L] layout: ``pack`` moves per-token inputs into rows, ``unpack`` brings
per-token outputs back (differentiably), so losses, aggregation modes and per-sequence ratios never see packing.
``PackedLayout.padded`` is the identity layout (one sequence per row, offset 0): the reference every test ties to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class PackedLayout:
    lengths: tuple[int, ...]  # tokens of sequence i
    rows: tuple[int, ...]  # the row sequence i lives in
    offsets: tuple[int, ...]  # where it starts in that row
    n_rows: int  # R
    width: int  # W

    @classmethod
    def padded(cls, lengths: list[int]) -> PackedLayout:
        """One sequence per row, right-padded to the longest: what the trainer does without packing."""
        return cls(tuple(lengths), tuple(range(len(lengths))), (0,) * len(lengths), len(lengths), max(lengths))

    @classmethod
    def pack(cls, lengths: list[int], align: int = 1) -> PackedLayout:
        """First-fit decreasing into rows as wide as the longest sequence, each sequence starting at a multiple of
        ``align`` (a row's last sequence needs no pad after it)."""
        width = max(lengths)
        ends: list[int] = []  # where each row's used slots end
        rows, offsets = [0] * len(lengths), [0] * len(lengths)
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            for r, end in enumerate(ends):
                start = _round_up(end, align)
                if start + lengths[i] <= width:
                    break
            else:
                r, start = len(ends), 0
                ends.append(0)
            rows[i], offsets[i], ends[r] = r, start, start + lengths[i]
        return cls(tuple(lengths), tuple(rows), tuple(offsets), len(ends), width)

    @property
    def is_padded(self) -> bool:
        return self.n_rows == len(self.lengths) and not any(self.offsets) and self.rows == tuple(range(self.n_rows))

    def _index(self, device) -> tuple[Tensor, Tensor]:
        """Flat indices of every real token: in the packed [R*W] layout and in the padded [N*L] one."""
        L = max(self.lengths)
        packed = [r * self.width + o + t for r, o, n in zip(self.rows, self.offsets, self.lengths) for t in range(n)]
        padded = [i * L + t for i, n in enumerate(self.lengths) for t in range(n)]
        return (torch.tensor(packed, dtype=torch.long, device=device),
                torch.tensor(padded, dtype=torch.long, device=device))

    def pack_tensor(self, x: Tensor, fill=0) -> Tensor:
        """[N, L, *] in the padded layout -> [R, W, *] (``fill`` where no sequence is)."""
        if self.is_padded:
            return x
        packed, padded = self._index(x.device)
        out = x.new_full((self.n_rows * self.width, *x.shape[2:]), fill)
        out[packed] = x.reshape(-1, *x.shape[2:])[padded]
        return out.view(self.n_rows, self.width, *x.shape[2:])

    def unpack(self, y: Tensor) -> Tensor:
        """[R, W, *] -> [N, L, *] padded layout, zeros past each sequence's end; gradients flow back to ``y``."""
        if self.is_padded:
            return y
        packed, padded = self._index(y.device)
        N, L = len(self.lengths), max(self.lengths)
        flat = y.reshape(-1, *y.shape[2:]).index_select(0, packed)
        out = y.new_zeros((N * L, *y.shape[2:])).index_copy(0, padded, flat)
        return out.view(N, L, *y.shape[2:])

    def segment_ids(self, device=None) -> Tensor:
        """[R, W] long: i + 1 where sequence i is, 0 on pads."""
        seg = torch.zeros(self.n_rows, self.width, dtype=torch.long, device=device)
        for i, (r, o, n) in enumerate(zip(self.rows, self.offsets, self.lengths)):
            seg[r, o : o + n] = i + 1
        return seg

    @property
    def slots(self) -> int:
        """R * W: tokens the forward computes, pads included."""
        return self.n_rows * self.width


def segment_starts(segment_ids: Tensor) -> Tensor:
    """[B, T] bool: the first token of each segment (a real token whose left neighbour is another segment or a pad)."""
    prev = torch.nn.functional.pad(segment_ids, (1, 0))[:, :-1]
    return (segment_ids > 0) & (segment_ids != prev)


def same_segment(segment_ids: Tensor, shift: int) -> Tensor:
    """[B, T] bool: token t and token t - ``shift`` are real and in the same segment (False for t < shift)."""
    prev = torch.nn.functional.pad(segment_ids, (shift, 0))[:, : segment_ids.shape[1]]
    return (segment_ids > 0) & (segment_ids == prev)


def packed_cu_seqlens(segment_ids: Tensor) -> Tensor:
    """The boundaries of packed rows [B, T] flattened into one sequence of B*T tokens, as varlen kernels take them
    (fla-core's ``cu_seqlens``): every row start and every segment start, then B*T. Pads after a row's last segment
    stay in that segment's span (a pad neither decays nor writes a recurrent state)."""
    starts = segment_starts(segment_ids)
    starts[:, 0] = True
    idx = starts.reshape(-1).nonzero().squeeze(1)
    return torch.cat([idx, idx.new_tensor([segment_ids.numel()])])

