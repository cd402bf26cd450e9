"""Weights handed between two processes on one device without serialising them: the sender shares its tensors' memory
(CUDA IPC handles on a GPU, shared-memory files on CPU) and sends only the handles, a few hundred bytes per tensor; the
receiver maps that memory and copies straight out of it into its own parameters.

This is the weight sync of a colocated engine (``engine.colocate``: it shares trainer rank 0's GPU). The sender's
tensors must stay as they are until the receiver has copied them: the driver pushes between optimizer steps and waits
for the engine's answer, so they do.

    sender:   blob = share(state_dict)               receiver: state_dict = open_shared(blob)  # then copy out of it
"""

from __future__ import annotations

import io
import pickle

import torch.multiprocessing as mp
from torch import Tensor


def _file_system_sharing() -> None:
    """CPU tensors are shared as named files (the default strategy passes file descriptors, which only a child of the
    sender can receive); CUDA tensors always go by IPC handle."""
    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")


def share(state_dict: dict[str, Tensor]) -> bytes:
    """Handles to ``state_dict``'s tensors (detached; on CPU their storage moves into shared memory the first time, in
    place, so the sender goes on using it)."""
    from multiprocessing.reduction import ForkingPickler

    _file_system_sharing()
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump({k: v.detach() for k, v in state_dict.items()})
    return buf.getvalue()


def open_shared(blob: bytes) -> dict[str, Tensor]:
    """The sender's tensors, mapped into this process (no copy yet: copying out of them is the caller's)."""
    _file_system_sharing()
    return pickle.loads(blob)
