"""The inference engine batches concurrent requests and answers each exactly as an unbatched generation would."""

import asyncio

import pytest
import torch

from sandforge.models.generate import SamplingParams, generate
from sandforge.models.moe_lm import MoEConfig, MoETransformer
from sandforge.rollout.engine import InferenceEngine

CFG = MoEConfig(vocab_size=272, d_model=32, n_layers=2, n_heads=2, d_ff=32, n_experts=4, top_k=2, tie_embeddings=False)


def trained_like_weights() -> dict:
    torch.manual_seed(0)
    model = MoETransformer(CFG)
    with torch.no_grad():  # larger weights than the init, so greedy outputs depend on the whole prompt
        for p in model.parameters():
            p.mul_(8.0)
    return model.state_dict()


def test_concurrent_requests_share_batches_and_match_unbatched_greedy():
    weights = trained_like_weights()
    prompts = [[1 + i, 7, 9 + 2 * i, 3][: 2 + i % 3] for i in range(6)]
    params = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop_ids": [5]}

    async def run():
        engine = InferenceEngine(CFG.to_dict(), max_batch_size=4, batch_wait_ms=20)
        assert await engine.load_weights(weights, version=3) == 3
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        return outs, engine.stats()

    outs, stats = asyncio.run(run())
    reference = MoETransformer(CFG)
    reference.load_state_dict(weights)
    for prompt, out in zip(prompts, outs):
        (expected,) = generate(reference, [prompt], SamplingParams(**{**params, "stop_ids": (5,)}))
        assert out["token_ids"] == expected.token_ids
        assert out["logprobs"] == pytest.approx(expected.logprobs, abs=1e-4)
        assert out["version"] == 3
    assert stats["batches"] < len(prompts)  # requests were batched, and max_batch_size was respected
    assert stats["mean_batch_size"] <= 4


def test_a_bad_request_fails_alone():
    async def run():
        engine = InferenceEngine(CFG.to_dict(), batch_wait_ms=0)
        good = {"max_new_tokens": 2, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "stop_ids": []}
        bad = {**good, "max_new_tokens": 3}
        results = await asyncio.gather(engine.generate([], bad), engine.generate([1, 2], good), return_exceptions=True)
        return results

    failed, ok = asyncio.run(run())
    assert isinstance(failed, ValueError)
    assert len(ok["token_ids"]) == 2
