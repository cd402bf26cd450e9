"""Trainer → engine weight sync, each push tagged with the policy version the engine then reports.

``trainer.weight_sync``:

- ``object_store``: rank 0's state dict goes through Ray's object store (a copy into shared memory, one out); works
  anywhere Ray does.
- ``collective``: rank 0 broadcasts flat buffers to the engine over a process group of their own
  (models/weight_channel.py: NCCL on GPU, Gloo on CPU), GPU memory to GPU memory without the object store.
- ``colocated``: the engine shares rank 0's GPU (``engine.colocate``); rank 0 hands over handles to its own tensors
  (models/shared_weights.py: CUDA IPC, shared memory on CPU) and the engine copies straight out of them, nothing
  serialised or sent but the handles.
- ``auto``: colocated when the engine shares rank 0's GPU, collective where a GPU takes part, object store otherwise
  (job/fleet/placement.py ``Placement.weight_sync``).

With expert parallelism or ZeRO-3 every rank takes part (the whole model is gathered first) on the first two paths;
the colocated one needs the whole model on rank 0.

With ``engine.remote`` (a separate inference server) ``DiskWeightSync`` takes their place: rank 0 writes the policy to
``engine.remote.weights_dir`` and the server loads it by its own mechanism (engine/remote.py
``update_weights``); the version it then reports must be the one pushed.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

from sandforge.config import RemoteEngineConfig
from sandforge.job.fleet.trainer_ranks import TrainerRanks


class WeightSync:
    def __init__(self, mode: str, ranks: list[Any], engine: Any, port: int, gather_all: bool,
                 host: str = "127.0.0.1"):
        """``mode``: object_store, collective or colocated (``Placement.weight_sync`` resolves auto); ``ranks``:
        TrainerRank handles (rank 0 first); ``engine``: an EngineActor handle; ``port``: a free port on ``host``
        (rank 0's address) for the collective channel; ``gather_all``: every rank takes part in building the whole
        state dict (expert parallelism, ZeRO-3)."""
        import ray

        if mode not in ("object_store", "collective", "colocated"):
            raise ValueError(f"weight sync mode {mode!r}: expected object_store, collective or colocated")
        if mode == "colocated" and gather_all:
            raise ValueError("weight_sync colocated needs the whole model on rank 0; with expert_parallel > 1 or "
                             "zero_stage 3 it is spread over the ranks: use weight_sync collective")
        self.mode = mode
        self.ranks = TrainerRanks(ranks if gather_all else ranks[:1])
        self.engine = engine
        if self.mode == "collective":
            ray.get([ranks[0].open_weight_channel.remote(host, port), engine.open_weight_channel.remote(host, port)])

    def push(self, version: int) -> int:
        """Send the ranks' current weights as ``version``; returns the version the engine now serves."""
        import ray

        if self.mode == "collective":
            sends = self.ranks.calls("send_weights", version)
            served = ray.get(self.engine.receive_weights.remote())
            ray.get(sends)
        elif self.mode == "colocated":  # the handles travel; the engine copies out of rank 0's memory before answering
            served = ray.get(self.engine.load_shared.remote(self.ranks[0].share_weights.remote(), version))
        else:
            weights = self.ranks.calls("get_weights")
            served = ray.get(self.engine.load_weights.remote(weights[0], version))
            if len(weights) > 1:
                ray.wait(weights[1:], num_returns=len(weights) - 1)  # the other ranks' copies are not fetched
        if served != version:
            raise RuntimeError(f"weight sync ({self.mode}): pushed version {version}, the engine serves {served}")
        return served


class DiskWeightSync:
    """Trainer -> remote inference server: the policy goes through disk. ``weights_dir/version_N`` is written by rank
    0 (every rank takes part when the model is spread over them), the server is told to load it, and the previous
    version's directory is removed once the server serves the new one."""

    def __init__(self, remote: RemoteEngineConfig, ranks: list[Any], gather_all: bool, weights_dir: Path):
        self.remote = remote
        self.ranks = TrainerRanks(ranks if gather_all else ranks[:1])
        self.weights_dir = Path(weights_dir).resolve()
        self.previous: Path | None = None

    def push(self, version: int) -> int:
        """Write the ranks' current weights as ``version`` and have the server load them; returns the version it
        serves. A server that cannot take them (down after the retries, refusing the files) raises JobError: one line
        naming the URL and what it answered."""
        from sandforge.job.console import JobError
        from sandforge.engine.remote import RemoteEngineError

        path = self.weights_dir / f"version_{version}"
        if path.exists():  # a resumed run writes this version again
            shutil.rmtree(path)
        self.ranks.each("save_policy", str(path))
        try:
            served = asyncio.run(load_remote_weights(self.remote, path, version))
        except RemoteEngineError as e:
            raise JobError(f"remote engine: {e}; the run stopped at policy version {version}") from None
        if served != version:
            raise JobError(f"remote engine {self.remote.url}: pushed weight version {version}, the server reports "
                           f"{served}")
        if self.previous is not None and self.previous != path:
            shutil.rmtree(self.previous, ignore_errors=True)
        self.previous = path
        return served


async def load_remote_weights(remote: RemoteEngineConfig, directory: Path, version: int) -> int:
    """Have the server of ``engine.remote`` serve the policy in ``directory`` as ``version``; the version it serves.
    `sandforge serve` loads weights only for the token it wrote into the weights directory (``directory``'s parent,
    the one it was started with: ``--weights-dir``), read here at each push."""
    from sandforge.engine.remote import RemoteEngine
    from sandforge.engine.server import read_admin_token

    token = read_admin_token(Path(directory).parent) if remote.api == "sandforge" else None
    async with RemoteEngine(remote.url, model=remote.model, api_key=remote.api_key, timeout=remote.timeout,
                            retries=remote.retries) as engine:
        return await engine.update_weights(str(directory), version, remote.api, admin_token=token)
