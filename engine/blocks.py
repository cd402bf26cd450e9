"""The KV layout of the fused decode path (engine/llama.py): an idle cache is one contiguous block per row
(``RowCaches``), and the running rows' caches sit in slots of one buffer per layer (``SlotBatch``).

``SlotBatch`` keeps, per layer, keys and values ``[rows, kv_heads, capacity, d]``: row i's tokens at positions
0 .. lengths[i] - 1 of slot i, nothing padded in front. A decode step writes each row's new key and value at its own
length (one indexed write a layer), and attention reads each row's own positions only (engine/kernels/
decode_attention.c). A row that joins is copied into the next free slot, a row that leaves is copied out and the last
row moved into its slot: each costs one row's cache, never the batch's. Capacity grows in steps of ``GROW`` positions
(one copy of the batch then) and the buffers go when the batch empties.

Attention over this layout: engine/attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

GROW = 256  # positions added to a batch's capacity when a row outgrows it


@dataclass
class RowKV:
    """One sequence's cache: per layer keys and values ``[kv_heads, n, d]`` (no batch dimension, no padding)."""

    keys: list[Tensor]
    values: list[Tensor]

    @property
    def n(self) -> int:
        return self.keys[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def prefix(self, n: int) -> RowKV:
        """The first ``n`` tokens' cache (views: caches are never written after they are made)."""
        return RowKV([k[:, :n] for k in self.keys], [v[:, :n] for v in self.values])


@dataclass
class RowCaches:
    """Idle caches of the fused path: a list of rows. Answers the engine's cache protocol (``select``, ``cat``,
    ``compact``, ``nbytes``) the way ``HFCache`` and ``K3Cache`` do, without padding: a row is its tokens."""

    rows: list[RowKV] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    @property
    def seq_len(self) -> int:
        return max(r.n for r in self.rows)

    def select(self, rows) -> RowCaches:
        return RowCaches([self.rows[int(i)] for i in rows])

    def compact(self) -> RowCaches:
        return self

    def prefix(self, n: int) -> RowCaches:
        """A one-row cache's first ``n`` tokens (the engine's shared-prefix reuse)."""
        (row,) = self.rows
        return RowCaches([row.prefix(n)])

    @classmethod
    def cat(cls, caches: list[RowCaches]) -> RowCaches:
        return RowCaches([r for c in caches for r in c.rows])


class SlotBatch:
    """The running sequences of the fused path: ``rows[i]`` is the engine's row in slot i (see the module docstring).
    The decoder (engine/llama.py) runs the step; this class owns the layout."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.rows: list = []
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)  # per row: tokens cached
        self.keys: list[Tensor] = []  # per layer [row capacity, kv_heads, capacity, d]
        self.values: list[Tensor] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def row_capacity(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    def add(self, rows: list, caches: RowCaches) -> None:
        """New rows with their caches, each copied into the next free slot."""
        new = caches.rows
        first = len(self.rows)
        self._reserve(first + len(new), max(r.n for r in new) + 1)
        for j, row in enumerate(new):
            for layer in range(self.n_layers):
                self.keys[layer][first + j, :, : row.n] = row.keys[layer]
                self.values[layer][first + j, :, : row.n] = row.values[layer]
        self.lengths = torch.cat([self.lengths, torch.tensor([r.n for r in new], dtype=torch.long,
                                                             device=self.device)])
        self.rows.extend(rows)

    def remove(self, indices: list[int]) -> list[RowCaches]:
        """Take rows out; returns their one-row caches, in the order of ``indices``. The rows left keep their order
        but for the last ones, moved into the freed slots."""
        out = [RowCaches([self.row_kv(i)]) for i in indices]
        gone = set(indices)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        if not keep:
            self.clear()
            return out
        holes = sorted(i for i in gone if i < len(keep))  # freed slots below the new end
        movers = [i for i in keep if i >= len(keep)]  # rows above it, each into a hole
        order = list(range(len(keep)))
        for hole, mover in zip(holes, movers):
            n = int(self.lengths[mover])
            for layer in range(self.n_layers):
                self.keys[layer][hole, :, :n] = self.keys[layer][mover, :, :n]
                self.values[layer][hole, :, :n] = self.values[layer][mover, :, :n]
            order[hole] = mover
        self.rows = [self.rows[i] for i in order]
        self.lengths = self.lengths[torch.tensor(order, dtype=torch.long, device=self.device)]
        return out

    def clear(self) -> list:
        rows = self.rows
        self.__init__(self.n_layers, self.kv_heads, self.head_dim, self.dtype, self.device)
        return rows

    def row_kv(self, i: int) -> RowKV:
        """Row i's cache as tensors of its own."""
        n = int(self.lengths[i])
        return RowKV([k[i, :, :n].clone() for k in self.keys], [v[i, :, :n].clone() for v in self.values])

    # ---------------------------------------------------------------- a decode step
    def reserve_step(self) -> None:
        """Room for one more token in every row (before a step's writes)."""
        self._reserve(len(self.rows), int(self.lengths.max()) + 1)
        self._row_index = torch.arange(len(self.rows), device=self.device)  # the step's writes, every layer

    def write(self, layer: int, keys: Tensor, values: Tensor) -> None:
        """The step's new keys and values ([rows, kv_heads, d]) at each row's own next position."""
        self.keys[layer][self._row_index, :, self.lengths] = keys
        self.values[layer][self._row_index, :, self.lengths] = values

    def advance(self) -> None:
        self.lengths += 1

    def _reserve(self, n_rows: int, n_positions: int) -> None:
        if n_rows <= self.row_capacity and n_positions <= self.capacity:
            return
        rows = max(n_rows, self.row_capacity)
        positions = max(self.capacity, -(-n_positions // GROW) * GROW)
        used_rows, used = len(self.rows), (int(self.lengths.max()) if len(self.rows) else 0)
        for buffers in (self.keys, self.values):
            old = list(buffers)
            buffers.clear()
            for layer in range(self.n_layers):
                grown = torch.zeros(rows, self.kv_heads, positions, self.head_dim, dtype=self.dtype,
                                    device=self.device)
                if old:
                    grown[:used_rows, :, :used] = old[layer][:used_rows, :, :used]
                buffers.append(grown)
