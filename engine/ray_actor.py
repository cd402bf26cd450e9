"""The engine as a Ray actor: builds the policy from its config and serves ``EngineCore`` on the actor's event loop.

    engine = ray.remote(num_cpus=0)(EngineActor).remote(policy_config, cfg.engine, seed, threads, "cpu")
    [sample] = await engine.generate.remote(GenerateRequest(prompt_ids=[...], session_id="ep-3", max_tokens=256))
"""

from __future__ import annotations

import torch

from sandforge.config import EngineConfig
from sandforge.types import GenerateRequest, Sample

from .core import EngineCore


def sent_layout(state_dict: dict) -> dict:
    """What the trainer sends for these weights: fp32 wherever the engine serves floating point in another dtype."""
    return {k: torch.empty(v.shape, dtype=torch.float32) if v.is_floating_point() else v for k, v in state_dict.items()}


class EngineActor:
    """``policy_config``: the policy's own config (``models.build.policy_config``: its ``arch`` and sizes), from which
    the engine builds it; weights arrive by ``load_weights`` or ``receive_weights``. A config with ``lora`` (the
    trainer trains LoRA adapters): each load brings the adapters only, merged here into the base weights the engine
    was built with (models/lora.py ``LoraMerger``, which keeps that base unmerged, so syncs never accumulate)."""

    def __init__(self, policy_config: dict, engine: EngineConfig, seed: int = 0, num_threads: int = 1,
                 device: str = "cpu"):
        from sandforge.models.build import policy_from_config
        from sandforge.models.device import engine_dtype, part_device, where

        self.device, self.where = part_device(device, "engine"), where(device)
        torch.set_num_threads(num_threads)
        model = policy_from_config(policy_config).to(self.device)
        self.lora = None
        if policy_config.get("lora"):
            from sandforge.models.lora import LoraMerger

            self.lora = LoraMerger(model, policy_config["lora"])  # keeps the base in fp32: merges lose nothing
        dtype = engine_dtype(engine.dtype, self.device.type)
        model = model.to(getattr(torch, dtype))  # loads cast the trainer's fp32 weights (load_state_dict)
        if hasattr(model, "fast_cache"):  # a Hugging Face policy (models/hf.py)
            model.fast_cache = engine.kv_cache == "fast"
        self.core = EngineCore(model, engine.max_batch_size, engine.session_memory_mb, seed, sampler=engine.sampler,
                               decoder=engine.decoder)

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        return await self.core.generate(request)

    async def close_session(self, session_id: str) -> None:
        self.core.close_session(session_id)

    async def load_weights(self, state_dict: dict, version: int, interrupt: bool | None = None) -> int:
        """The trainer's ``get_weights`` (with LoRA: its adapters) as ``version``; returns the version now served."""
        if self.lora is not None:
            return await self.core.load_weights(self.lora.merged(state_dict), version, interrupt, partial=True)
        return await self.core.load_weights(state_dict, version, interrupt)

    def set_interrupt_loads(self, interrupt: bool) -> None:
        """Async RL: later loads swap weights under running sequences (partial rollouts, see EngineCore)."""
        self.core.interrupt_loads = bool(interrupt)

    def stats(self) -> dict:
        return self.core.stats()

    async def load_shared(self, blob: bytes, version: int) -> int:
        """Weights shared by trainer rank 0 on this engine's device (``TrainerRank.share_weights``: handles, no data),
        copied straight into the served model as ``version``."""
        from sandforge.models.shared_weights import open_shared

        return await self.load_weights(open_shared(blob), version)

    def release_memory(self) -> None:
        """Give back the episode caches' memory while the trainer steps on the GPU this engine shares with it; the
        sessions' next requests rebuild their caches by re-prefill."""
        self.core.release_memory()

    def served_weights(self) -> dict:
        """The weights being served, copied to CPU in the engine's dtype (checks of a weight sync)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.core.model.state_dict().items()}

    def device_name(self) -> str:
        """Where the engine runs, as the run's placement line states it."""
        return self.where

    def open_weight_channel(self, host: str, port: int) -> None:
        """The receiving end of the collective weight sync (models/weight_channel.py); trainer rank 0 sends."""
        from sandforge.models.weight_channel import WeightChannel

        self.channel = WeightChannel(host, port, rank=1)

    async def receive_weights(self) -> int:
        """Take one broadcast from the weight channel and serve it; returns its version. The broadcast runs in a
        thread, so requests keep being accepted meanwhile."""
        import asyncio

        template = self.lora.template() if self.lora is not None else sent_layout(self.core.model.state_dict())
        state_dict, version = await asyncio.to_thread(self.channel.receive, template)
        return await self.load_weights(state_dict, version)

    def version(self) -> int:
        """The version of the weights being served (-1 before the first load)."""
        return self.core.version

    def rng_state(self):
        return self.core.rng_state()

    def set_rng_state(self, state) -> None:
        self.core.set_rng_state(state)
