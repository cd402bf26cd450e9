"""The trainer rank and the engine on a GPU, and the colocated weight hand-over between two processes by CUDA IPC."""

from __future__ import annotations

import asyncio

import torch
import torch.multiprocessing as mp

from sandforge.types import GenerateRequest
from sandforge.config import EngineConfig, ModelConfig, TrainerConfig
from sandforge.job.fleet.lifecycle import free_port
from sandforge.engine import EngineActor
from sandforge.trainer.rank import RolloutShape, TrainerRank
from sandforge.types import TrainingRow

MODEL = ModelConfig(arch="k3", preset="k3-nano", tokenizer="bytes")


def test_a_cuda_rank_trains_in_bf16_with_everything_on_its_gpu():
    rank = TrainerRank(0, 1, "127.0.0.1", free_port(), MODEL, TrainerConfig(lr=1e-3, device="cuda"),
                       RolloutShape(1.0, 64), device="cuda")
    assert rank.device.type == "cuda" and rank.where.startswith("cuda")
    assert next(rank.engine.module.parameters()).dtype == torch.bfloat16
    assert next(rank.reference.parameters()).device.type == "cuda"
    before = {k: v.clone() for k, v in rank.get_weights().items()}
    rows = [TrainingRow(token_ids=list(range(3, 40)), loss_mask=[0] * 5 + [1] * 32, logprobs=[-1.0] * 37,
                        advantages=[1.0] * 37)] * 4
    metrics = rank.train_step(rows, 4 * 32)
    assert metrics["grad_norm"] > 0
    after = rank.get_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_cuda_engine_generates_on_its_gpu():
    from sandforge.models.build import policy_config
    from sandforge.models.k3.model import PRESETS, K3Model

    config = policy_config(K3Model(PRESETS["k3-nano"]))
    engine = EngineActor(config, EngineConfig(dtype="bfloat16"), 0, 1, "cuda")
    assert next(engine.core.model.parameters()).is_cuda

    async def one():
        try:
            return await engine.generate(GenerateRequest(prompt_ids=[1, 2, 3], session_id=None, max_tokens=8,
                                          temperature=1.0, top_p=1.0, top_k=0, stop_ids=[], n=1))
        finally:
            await engine.core.shutdown()

    [sample] = asyncio.run(one())
    assert len(sample.token_ids) == 8


def _receiver(blob: bytes, out) -> None:
    from sandforge.models.shared_weights import open_shared

    state = open_shared(blob)
    out.put({k: v.clone().cpu() for k, v in state.items()})


def test_colocated_hand_over_copies_gpu_tensors_across_processes():
    from sandforge.models.shared_weights import share

    weights = {"a": torch.randn(64, 64, device="cuda", dtype=torch.bfloat16), "b": torch.arange(10, device="cuda")}
    blob = share(weights)
    assert len(blob) < 4096  # handles, not data
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_receiver, args=(blob, out))
    child.start()
    got = out.get(timeout=120)
    child.join(60)
    assert all(torch.equal(got[k], weights[k].cpu()) for k in weights)
