"""Trainer → engine weight sync, each push tagged with the policy version the engine then reports.

``trainer.weight_sync``:

- ``object_store``: rank 0's state dict goes through Ray's object store (a copy into shared memory, one out); works
  anywhere Ray does.
- ``collective``: rank 0 broadcasts flat buffers to the engine over a process group of their own
  (models/weight_channel.py: NCCL on GPU, Gloo on CPU), GPU memory to GPU memory without the object store.
- ``auto``: collective where there is a GPU, object store otherwise.

With expert parallelism or ZeRO-3 every rank takes part (the whole model is gathered first) on either path.
"""

from __future__ import annotations

from typing import Any


def resolve_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    import torch

    return "collective" if torch.cuda.is_available() else "object_store"


class WeightSync:
    def __init__(self, mode: str, ranks: list[Any], engine: Any, port: int, gather_all: bool,
                 host: str = "127.0.0.1"):
        """``ranks``: TrainerRank handles (rank 0 first); ``engine``: an InferenceEngine handle; ``port``: a free port
        on ``host`` (rank 0's address) for the collective channel; ``gather_all``: every rank takes part in building
        the whole state dict (expert parallelism, ZeRO-3)."""
        import ray

        self.mode = resolve_mode(mode)
        self.ranks = ranks if gather_all else ranks[:1]
        self.engine = engine
        if self.mode == "collective":
            ray.get([ranks[0].open_weight_channel.remote(host, port), engine.open_weight_channel.remote(host, port)])

    def push(self, version: int) -> int:
        """Send the ranks' current weights as ``version``; returns the version the engine now serves."""
        import ray

        if self.mode == "collective":
            sends = [rank.send_weights.remote(version) for rank in self.ranks]
            served = ray.get(self.engine.receive_weights.remote())
            ray.get(sends)
        else:
            weights = [rank.get_weights.remote() for rank in self.ranks]
            served = ray.get(self.engine.load_weights.remote(weights[0], version))
            if len(weights) > 1:
                ray.wait(weights[1:], num_returns=len(weights) - 1)  # the other ranks' copies are not fetched
        if served != version:
            raise RuntimeError(f"weight sync ({self.mode}): pushed version {version}, the engine serves {served}")
        return served
