"""Per-request seeds: a seeded request samples the same tokens alone or batched with others, and the agent loop sends
a distinct seed each turn."""

import asyncio
from dataclasses import replace

import pytest
import torch

from sandforge.types import GenerateRequest
from sandforge.models.k3.model import PRESETS, K3Model
from sandforge.rollout.episode import turn_seed
from sandforge.engine import EngineCore

CFG = replace(PRESETS["k3-nano"], vocab_size=512, max_seq_len=96)


def run(fn):
    async def main():
        torch.manual_seed(0)
        engine = EngineCore(K3Model(CFG).eval(), seed=1)
        try:
            return await fn(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def req(prompt, **kw):
    return GenerateRequest(prompt_ids=prompt, max_tokens=16, temperature=1.0, **kw)


def test_seeded_sampling_does_not_depend_on_the_batch():
    torch.set_num_threads(1)
    prompt = [1, 4, 9, 16, 25]

    async def alone(engine):
        return (await engine.generate(req(prompt, seed=42, n=2)))

    async def crowded(engine):
        others = [engine.generate(req([1, 2 + i, 3], seed=None if i % 2 else i)) for i in range(4)]
        got, *_ = await asyncio.gather(engine.generate(req(prompt, seed=42, n=2)), *others)
        return got

    a, b = run(alone), run(crowded)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert a[0].token_ids != a[1].token_ids  # the n samples draw from generators of their own
    for x, y in zip(a, b):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
    other = run(lambda e: e.generate(req(prompt, seed=43)))
    assert other[0].token_ids != a[0].token_ids


def test_bad_seed_is_the_request_s_fault():
    with pytest.raises(ValueError, match="seed"):
        run(lambda e: e.generate(req([1, 2], seed="x")))


def test_turn_seeds_differ_per_turn_and_repeat_per_episode():
    seeds = [turn_seed(7, t) for t in range(4)]
    assert len(set(seeds)) == 4 and seeds == [turn_seed(7, t) for t in range(4)]
    assert all(0 <= s < 2**63 for s in seeds)
