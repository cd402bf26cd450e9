"""The embedded engine answers concurrent requests exactly as an unbatched generation would, records the routing
that reproduces its log-probabilities, fails bad requests alone, serves Hugging Face models, and runs as a Ray actor."""

import asyncio
import time
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from sandforge.types import GenerateRequest
from sandforge.models.sampling import SamplingParams
from sandforge.engine.naive import generate_batch_naive
from sandforge.models.k3.model import PRESETS, K3Model
from sandforge.engine import EngineCore

CFG = replace(PRESETS["k3-nano"], vocab_size=512, max_seq_len=96)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def peaky_k3(seed: int = 0, scale: float = 4.0) -> K3Model:
    """A k3-nano with larger weights than the init, so greedy outputs depend on the whole prompt."""
    torch.manual_seed(seed)
    model = K3Model(CFG).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(scale)
    return model


def serve(model, fn, **engine_kwargs):
    """Run ``await fn(engine)`` against a fresh EngineCore and return (its result, the engine's stats)."""

    async def main():
        engine = EngineCore(model, **engine_kwargs)
        try:
            return await fn(engine), engine.stats()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def request(prompt, **kw) -> GenerateRequest:
    return GenerateRequest(**{"prompt_ids": prompt, "max_tokens": 10, "temperature": 0.0, **kw})


PROMPTS = [[1 + i, 7, 9 + 2 * i, 3, 40 + i, 41, 300 - i, 8, 9][: 2 + (3 * i) % 8] for i in range(7)]


def test_concurrent_greedy_requests_share_decode_steps_and_match_unbatched_generate():
    model = peaky_k3()
    free = [generate_batch_naive(model, [p], SamplingParams(max_new_tokens=10, temperature=0.0))[0] for p in PROMPTS]
    assert len({tuple(g.token_ids) for g in free}) == len(PROMPTS)  # outputs depend on the prompt
    stop = free[2].token_ids[3]  # row 2 stops midway, so rows leave the batch at different steps
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_ids=(stop,))

    async def fn(engine):
        return await asyncio.gather(*(engine.generate(request(p, stop_ids=[stop])) for p in PROMPTS))

    outs, stats = serve(model, fn, max_batch_size=4)
    for prompt, [out] in zip(PROMPTS, outs):
        [expected] = generate_batch_naive(model, [prompt], params)
        assert out.token_ids == expected.token_ids
        assert out.finish_reason == expected.finish_reason
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(expected.logprobs), atol=1e-4, rtol=0)
        assert out.cached_tokens == 0 and out.prefill_tokens == len(prompt) and out.version == -1
    assert outs[2][0].finish_reason == "stop" and outs[2][0].token_ids[-1] == stop
    generated = sum(len(o[0].token_ids) for o in outs)
    assert stats["generated_tokens"] == generated
    assert stats["decode_steps"] < generated - len(PROMPTS)  # decode steps were shared
    assert 1 < stats["mean_batch_size"] <= 4  # and max_batch_size held


def full_logits(model, seq, forced=None):
    with torch.no_grad():
        return model(torch.tensor([seq]), forced_ids=forced).logits[0]


def test_rows_with_different_sampling_parameters_get_their_own_logprobs():
    """One batch, three sampling settings: each logprob is log_softmax(logits / T) at the chosen token, before top-k
    and top-p truncation, as generate_batch_naive() defines it; top-k 1 sampling equals greedy."""
    model = peaky_k3(seed=1)
    settings = [dict(temperature=0.7, top_k=5, top_p=0.9), dict(temperature=1.3), dict(temperature=1.0, top_k=1)]

    async def fn(engine):
        return await asyncio.gather(*(engine.generate(request(p, **settings[i % 3])) for i, p in enumerate(PROMPTS)))

    outs, _ = serve(model, fn, seed=3)
    for i, (prompt, [out]) in enumerate(zip(PROMPTS, outs)):
        s = settings[i % 3]
        logits = full_logits(model, prompt + out.token_ids)[len(prompt) - 1 : -1] / s["temperature"]
        expected = F.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
        if s.get("top_k") == 1:
            assert out.token_ids == generate_batch_naive(model, [prompt], SamplingParams(10, temperature=0.0))[0].token_ids


def test_routed_experts_replay_the_engines_logprobs_over_two_turns():
    model = peaky_k3(seed=2)
    n_moe, top_k = len(model.moe_layers), CFG.top_k
    prompt = PROMPTS[4]
    observation = [17, 18, 19, 20, 21]

    async def fn(engine):
        [first] = await engine.generate(request(prompt, session_id="ep", temperature=1.0))
        turn2 = prompt + first.token_ids + observation
        [second] = await engine.generate(request(turn2, session_id="ep", temperature=1.0))
        return first, turn2, second

    (first, turn2, second), _ = serve(model, fn, seed=5)
    assert first.cached_tokens == 0 and second.cached_tokens == len(prompt) + len(first.token_ids) - 1
    fed = [*prompt, *first.token_ids[:-1], first.token_ids[-1], *observation, *second.token_ids[:-1]]
    for out, p in ((first, prompt), (second, turn2)):
        assert len(out.routed_experts) == len(p) - out.cached_tokens + len(out.token_ids) - 1
        assert all(len(e) == n_moe and all(len(layer) == top_k for layer in e) for e in out.routed_experts)
    routed = first.routed_experts + second.routed_experts
    assert len(routed) == len(fed)
    forced = torch.tensor([routed])  # [1, T, n_moe_layers, top_k]
    logits = full_logits(model, fed, forced)
    lp = F.log_softmax(logits, -1)
    for out, start in ((first, len(prompt)), (second, len(turn2))):
        n = len(out.token_ids)
        # the last generated token was never fed; its logprob comes from the position before it
        expected = lp[start - 1 : start - 1 + n].gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


def test_a_bad_request_fails_alone_and_the_engine_goes_on():
    model = peaky_k3()
    bad = [
        request([]),  # empty
        request(list(range(1, 97))),  # max_seq_len tokens: no room to generate
        request([1, 2, 512]),  # outside the vocabulary
        request([1, 2], n=0),
        request([1, 2], top_p=0.0),
        request([1, 2], stop_ids=5),
        {"max_tokens": 3},
    ]

    async def fn(engine):
        requests = [request([1, 2, 3])] + bad
        results = await asyncio.gather(*(engine.generate(r) for r in requests), return_exceptions=True)
        after = await engine.generate(request([4, 5]))
        return results, after

    (results, after), stats = serve(model, fn)
    assert len(results[0][0].token_ids) == 10
    errors = results[1:]
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert "empty" in str(errors[0]) and "max_seq_len is 96" in str(errors[1]) and "[0, 512)" in str(errors[2])
    assert len(after[0].token_ids) == 10 and stats["requests"] == 2


def test_hf_tiny_qwen3_moe_greedy_and_sessions_match_generate(tmp_path):
    pytest.importorskip("transformers")
    from test_hf import save_tiny_qwen3_moe

    from sandforge.models.hf import HFPolicy

    model = HFPolicy.from_pretrained(save_tiny_qwen3_moe(tmp_path / "qwen3moe")).eval()
    prompts = [[5 + i, 9, 30 + 3 * i, 7, 11][: 2 + i % 4] for i in range(5)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    observation = [40, 41, 42]

    async def fn(engine):
        first = await asyncio.gather(*(engine.generate(request(p, session_id=f"e{i}", max_tokens=6))
                                       for i, p in enumerate(prompts)))
        turn2 = [p + out[0].token_ids + observation for p, out in zip(prompts, first)]
        second = await asyncio.gather(*(engine.generate(request(p, session_id=f"e{i}", max_tokens=6))
                                        for i, p in enumerate(turn2)))
        return first, turn2, second

    (first, turn2, second), stats = serve(model, fn)
    for batch_prompts, outs in ((prompts, first), (turn2, second)):
        for prompt, [out] in zip(batch_prompts, outs):
            [expected] = generate_batch_naive(model, [prompt], params)
            assert out.token_ids == expected.token_ids and out.routed_experts is None
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(expected.logprobs), atol=1e-4,
                                       rtol=0)
    assert [o[0].prefill_tokens for o in second] == [1 + len(observation)] * len(prompts)  # the sessions held
    assert stats["mean_batch_size"] > 1


def test_the_ray_actor_serves_requests_and_takes_weights():
    ray = pytest.importorskip("ray")
    from sandforge.config import EngineConfig
    from sandforge.engine import EngineActor

    weights = peaky_k3().state_dict()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=128 * 1024**2)
    try:
        engine = ray.remote(num_cpus=0)(EngineActor).remote({"arch": "k3", **CFG.to_dict()},
                                                              EngineConfig(max_batch_size=4, session_memory_mb=64), 0, 1)
        assert ray.get(engine.load_weights.remote(weights, 7)) == 7
        outs = ray.get([engine.generate.remote(request(p, session_id=f"s{i}")) for i, p in enumerate(PROMPTS[:3])])
        ray.get(engine.close_session.remote("s0"))
        for _ in range(100):  # the engine thread applies a close between two steps, not at once
            stats = ray.get(engine.stats.remote())
            if stats["sessions"] == 2:
                break
            time.sleep(0.05)
    finally:
        ray.shutdown()
    model = peaky_k3()
    for prompt, [out] in zip(PROMPTS, outs):
        assert out.version == 7
        assert out.token_ids == generate_batch_naive(model, [prompt], SamplingParams(10, temperature=0.0))[0].token_ids
    assert stats["version"] == 7 and stats["sessions"] == 2
