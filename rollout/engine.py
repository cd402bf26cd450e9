"""The embedded inference engine: one Ray actor that batches generation requests from many concurrent episodes.

Episodes call ``generate`` one turn at a time. Requests that arrive within ``batch_wait_ms`` of each other (and share
sampling parameters) run as one batched, KV-cached generation. Weights arrive from the trainer between steps with a
version number; a weight load waits for the batch in flight, so a generation never mixes two policies.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

import torch


class InferenceEngine:
    def __init__(self, model_cfg: dict, max_batch_size: int = 16, batch_wait_ms: float = 5.0, seed: int = 0,
                 num_threads: int = 1):
        from sandforge.models.policy import policy_from_config

        torch.set_num_threads(num_threads)
        self.model = policy_from_config(model_cfg).eval()
        self.max_batch_size = max_batch_size
        self.batch_wait = batch_wait_ms / 1000
        self.generator = torch.Generator().manual_seed(seed)
        self.version = -1  # no trainer weights yet
        self.pending: list[tuple[list[int], tuple, asyncio.Future]] = []
        self.lock = asyncio.Lock()
        self.wake: asyncio.Event | None = None
        self.batches = 0
        self.batched_requests = 0

    async def generate(self, prompt_ids: list[int], params: dict) -> dict:
        """Sample one completion for ``prompt_ids``; returns a Generation as a dict plus the policy version."""
        if self.wake is None:
            self.wake = asyncio.Event()
            asyncio.get_running_loop().create_task(self._serve())
        key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
        future = asyncio.get_running_loop().create_future()
        self.pending.append((list(prompt_ids), key, future))
        self.wake.set()
        return await future

    async def _serve(self) -> None:
        from sandforge.models.generate import SamplingParams, generate

        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.batch_wait:
                await asyncio.sleep(self.batch_wait)  # let concurrent episodes join the batch
            while self.pending:
                key = self.pending[0][1]
                batch = [p for p in self.pending if p[1] == key][: self.max_batch_size]
                for p in batch:
                    self.pending.remove(p)
                params = SamplingParams(**dict(key))
                async with self.lock:
                    version = self.version
                    try:
                        outs = await asyncio.to_thread(generate, self.model, [p[0] for p in batch], params, self.generator)
                    except Exception as e:  # a bad request must not kill the engine: fail just these futures
                        for _, _, fut in batch:
                            fut.set_exception(e)
                        continue
                self.batches += 1
                self.batched_requests += len(batch)
                for (_, _, fut), out in zip(batch, outs):
                    if not fut.done():
                        fut.set_result({**asdict(out), "version": version})

    async def load_weights(self, state_dict: dict, version: int) -> int:
        async with self.lock:
            self.model.load_state_dict(state_dict)
            self.version = version
        return version

    def stats(self) -> dict:
        return {
            "version": self.version,
            "batches": self.batches,
            "mean_batch_size": self.batched_requests / max(self.batches, 1),
        }
