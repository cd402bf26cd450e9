"""A weight channel: one sender (trainer rank 0) broadcasts a policy's state dict to one receiver (an inference engine)
over a process group of their own, NCCL on GPU and Gloo on CPU (the same code, so CPU tests cover it).

Both ends know the parameter layout (the same model config), so only data crosses: a header [version, elements] and one
flat buffer per dtype, in the order of the state dict's sorted keys. A layout mismatch fails on the receiver with the
numbers, never with silently shifted weights.

    sender:   ch = WeightChannel("10.0.0.1", port, rank=0)      receiver: ch = WeightChannel("10.0.0.1", port, rank=1)
              ch.send(state_dict, version)                                state_dict, version = ch.receive(template)
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor


def _layout(state_dict: dict[str, Tensor]) -> dict[torch.dtype, list[str]]:
    """Keys grouped by dtype (sorted within each group and groups in order of their dtype's name)."""
    groups: dict[torch.dtype, list[str]] = {}
    for k in sorted(state_dict):
        groups.setdefault(state_dict[k].dtype, []).append(k)
    return dict(sorted(groups.items(), key=lambda kv: str(kv[0])))


def flatten(state_dict: dict[str, Tensor], device: torch.device) -> list[Tensor]:
    return [torch.cat([state_dict[k].detach().reshape(-1).to(device) for k in keys])
            for keys in _layout(state_dict).values()]


def unflatten(flats: list[Tensor], template: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for flat, keys in zip(flats, _layout(template).values()):
        offset = 0
        for k in keys:
            n = template[k].numel()
            out[k] = flat[offset : offset + n].view(template[k].shape)
            offset += n
    return out


class WeightChannel:
    def __init__(self, host: str, port: int, rank: int, timeout_s: float = 600.0, backend: str | None = None):
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.rank = rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        # the sender hosts the rendezvous; both ends block here until the other arrives
        self.store = dist.TCPStore(host, port, 2, is_master=rank == 0, timeout=timeout)
        if self.backend == "nccl":
            self.group = dist.ProcessGroupNCCL(self.store, rank, 2)
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, 2, timeout)

    def _broadcast(self, t: Tensor) -> None:
        self.group.broadcast(t, 0).wait()

    def send(self, state_dict: dict[str, Tensor], version: int) -> int:
        flats = flatten(state_dict, self.device)
        header = [version, sum(f.numel() for f in flats), len(flats)]
        self._broadcast(torch.tensor(header, dtype=torch.long, device=self.device))
        for flat in flats:
            self._broadcast(flat)
        return version

    def receive(self, template: dict[str, Tensor]) -> tuple[dict[str, Tensor], int]:
        """The sent state dict (laid out like ``template``, whose values only give shapes and dtypes) and its version."""
        header = torch.zeros(3, dtype=torch.long, device=self.device)
        self._broadcast(header)
        version, total, groups = header.tolist()
        layout = _layout(template)
        expected = sum(template[k].numel() for keys in layout.values() for k in keys)
        if (total, groups) != (expected, len(layout)):
            # the sender's buffers are left unread: this channel is out of step now and must be reopened
            raise ValueError(f"weight channel: the sender sent {total} elements in {groups} dtype group(s), this model "
                             f"has {expected} in {len(layout)}; the trainer and the engine must be built from the same "
                             "model config and dtype")
        flats = [torch.empty(sum(template[k].numel() for k in keys), dtype=dtype, device=self.device)
                 for dtype, keys in layout.items()]
        for flat in flats:
            self._broadcast(flat)
        return unflatten(flats, template), int(version)

    def close(self) -> None:
        self.group = None
        self.store = None
