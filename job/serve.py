"""``sandforge serve CHECKPOINT``: the checkpoint's policy on the fleet's engine (job/fleet/lifecycle.py, the engine part only:
the same actor, placement and weight loading as a training run's), behind the OpenAI-compatible server of
engine/server.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

from sandforge.config import EngineConfig, JobConfig, RunConfig
from sandforge.types import GenerateRequest, Sample


class ActorEngine:
    """The engine contract (``async generate(GenerateRequest) -> list[Sample]``, ``stats()``, ``async load_weights``) over the
    engine actor; the engine's own errors (a request too long for the context, weights of another model) come back as
    themselves, not wrapped by Ray."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        import ray

        try:
            return await self.handle.generate.remote(request)
        except ray.exceptions.RayTaskError as e:
            raise e.cause from None

    async def load_weights(self, state_dict: dict, version: int) -> int:
        """``POST /update_weights_from_disk``: the engine serves ``state_dict`` as ``version`` once its running
        requests are done."""
        import ray

        try:
            return await self.handle.load_weights.remote(state_dict, version)
        except ray.exceptions.RayTaskError as e:
            raise e.cause from None

    async def stats(self) -> dict:
        return await self.handle.stats.remote()


def serve_checkpoint(checkpoint: Path, host: str, port: int, max_batch_size: int, session_memory_mb: float, seed: int,
                     announce: Callable[[str], Any], weights_dir: Path | None = None) -> None:
    """Load ``checkpoint`` (ValueError says why it cannot be), start the engine with its weights, serve until
    SIGINT/SIGTERM, then stop the engine. ``weights_dir``: new weights may be loaded from there, by the holder of the
    token the server writes into it (engine/server.py ``open_weight_updates``); None: no weight updates."""
    from sandforge.job.console import make_run_id
    from sandforge.job.fleet.lifecycle import open_fleet
    from sandforge.models.build import policy_config
    from sandforge.engine.server import load_checkpoint, open_weight_updates, serve, served_from

    model, tokenizer = load_checkpoint(checkpoint)
    policy = {"config": policy_config(model), "state_dict": {k: v.detach() for k, v in model.state_dict().items()}}
    cfg = JobConfig(run=RunConfig(name="serve", seed=seed),
                    engine=EngineConfig(max_batch_size=max_batch_size, session_memory_mb=session_memory_mb))
    with open_fleet(cfg, make_run_id("serve"), frozenset({"engine"}), policy=policy) as fleet:
        del policy
        served = served_from(ActorEngine(fleet.engine), model, tokenizer, str(checkpoint))
        updates = open_weight_updates(weights_dir) if weights_dir is not None else None
        asyncio.run(serve(served, host, port, announce, updates))
