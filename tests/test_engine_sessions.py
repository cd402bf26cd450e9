"""Engine sessions: a continued episode equals a full re-prefill while prefilling only its new tokens; group
sampling prefills once; eviction and new weights drop caches that later turns rebuild."""

import asyncio
import random

import pytest
import torch
from test_engine import CFG, peaky_k3, request, serve

from sandforge.models.sampling import SamplingParams
from sandforge.engine.naive import generate_batch_naive
from sandforge.models.k3.model import K3Cache


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def observation(rng: random.Random) -> list[int]:
    return [rng.randrange(1, CFG.vocab_size) for _ in range(rng.randint(2, 7))]


async def episode(engine, prompt, turns, rng, session_id, **kw):
    """A multi-turn episode: each turn's prompt is the last one + its generation + an observation (token-in)."""
    seq, outs = list(prompt), []
    for t in range(turns):
        [out] = await engine.generate(request(seq, session_id=session_id, max_tokens=6, **kw))
        outs.append((list(seq), out))
        seq = seq + out.token_ids + observation(rng)
    return outs


def test_continued_sessions_equal_reprefilling_the_whole_history():
    """Three episodes run concurrently (their new tokens prefill in one padded batch with caches of different
    lengths); each turn equals a session-less engine's re-prefill of the same sequence and prefills only the new
    tokens: the last generated token (never fed) and the observation."""
    model = peaky_k3(seed=3)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3], [100, 200]]

    async def with_sessions(engine):
        return await asyncio.gather(*(episode(engine, p, 4, random.Random(i), f"ep{i}") for i, p in enumerate(prompts)))

    episodes, stats = serve(model, with_sessions)

    async def reprefill(engine):
        return [[(await engine.generate(request(seq, max_tokens=6)))[0] for seq, _ in ep] for ep in episodes]

    fresh, fresh_stats = serve(model, reprefill)
    for ep, ref in zip(episodes, fresh):
        for t, ((seq, out), again) in enumerate(zip(ep, ref)):
            assert out.token_ids == again.token_ids
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(again.logprobs), atol=1e-4,
                                       rtol=0)
            if t == 0:
                assert out.cached_tokens == 0 and out.prefill_tokens == len(seq)
            else:
                prev_seq, prev = ep[t - 1]
                assert out.cached_tokens == len(prev_seq) + len(prev.token_ids) - 1
                assert out.prefill_tokens == len(seq) - out.cached_tokens
    assert len({tuple(o.token_ids) for ep in episodes for _, o in ep}) > 6  # not one repeated answer
    new_tokens = sum(out.prefill_tokens for ep in episodes for _, out in ep)
    assert stats["prefill_tokens"] == new_tokens < fresh_stats["prefill_tokens"]
    assert stats["cached_tokens"] == sum(out.cached_tokens for ep in episodes for _, out in ep)
    assert stats["rebuilds"] == 0 and stats["sessions"] == len(prompts)


def test_a_continued_cache_gives_the_logits_of_the_full_forward():
    """Two sequences of different lengths: caches from their prefixes, merged into one batch (left-padded), their
    suffixes fed left-padded too, then a few decode steps, against one full forward per sequence."""
    model = peaky_k3(seed=4)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, CFG.vocab_size, (n,), generator=g).tolist() for n in (20, 18)]
    cut, tail = (15, 2), 3  # prefix cached, then a prefill of the suffix, then `tail` tokens one at a time
    with torch.no_grad():
        caches = [model(torch.tensor([s[:c]]), use_cache=True).cache for s, c in zip(seqs, cut)]
        merged = K3Cache.cat(caches)
        suffixes = [s[c : len(s) - tail] for s, c in zip(seqs, cut)]
        width = max(map(len, suffixes))
        ids = torch.tensor([[0] * (width - len(x)) + x for x in suffixes])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in suffixes])
        out = model(ids, attention_mask=mask, cache=merged, use_cache=True)
        got = [[out.logits[i, -1]] for i in range(2)]
        cache = out.cache.compact()
        assert len(cache.layers[3]) < len(out.cache.layers[3])  # compaction removed padding columns
        for t in range(tail):
            step = torch.tensor([[s[len(s) - tail + t]] for s in seqs])
            out = model(step, cache=cache, use_cache=True)
            cache = out.cache
            for i in range(2):
                got[i].append(out.logits[i, -1])
        for s, logits in zip(seqs, got):
            full = model(torch.tensor([s])).logits[0, len(s) - tail - 1 :]
            torch.testing.assert_close(torch.stack(logits), full, atol=1e-4, rtol=0)


def test_group_sampling_prefills_the_prompt_once():
    model = peaky_k3(seed=5)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    [expected] = generate_batch_naive(model, [prompt], SamplingParams(max_new_tokens=6, temperature=0.0))

    async def fn(engine):
        greedy = await engine.generate(request(prompt, session_id="g", n=4, max_tokens=6))
        after_group = engine.stats()
        sampled = await engine.generate(request(prompt, n=4, max_tokens=6, temperature=1.0))
        # G episodes of one task arriving together, then a late one: one prefill serves all
        other = [50, 51, 52, 53]
        together = await asyncio.gather(*(engine.generate(request(other, session_id=f"t{i}", max_tokens=6))
                                          for i in range(3)))
        late = await engine.generate(request(other, session_id="t3", max_tokens=6))
        turn2 = prompt + greedy[2].token_ids + [3, 4]
        [continued] = await engine.generate(request(turn2, session_id="g#2", max_tokens=6))
        return greedy, after_group, sampled, together, late, continued

    (greedy, after_group, sampled, together, late, continued), stats = serve(model, fn)
    assert [g.token_ids for g in greedy] == [expected.token_ids] * 4
    assert after_group["prefill_tokens"] == len(prompt) and after_group["shared_prefills"] == 3
    assert after_group["sessions"] == 4  # g#0 .. g#3
    assert len({tuple(s.token_ids) for s in sampled}) > 1
    answers = [o[0].token_ids for o in together] + [late[0].token_ids]
    assert answers == [answers[0]] * 4
    assert all(len(o[0].routed_experts) == 4 + 5 for o in together + [late])  # prompt + 5 fed generated tokens
    assert continued.cached_tokens == len(prompt) + 5
    # prefilled: the greedy group's prompt, the sampled group's (a snapshot of it), `other` once, 1 + 2 continued
    assert stats["prefill_tokens"] == len(prompt) + 4 + 3
    assert stats["shared_prefills"] == 3 + 4 + 2 + 1


def test_evicted_sessions_rebuild_with_the_same_answers():
    model = peaky_k3(seed=6)
    prompts = [[1, 2, 3, 4], [7, 7, 8]]

    def run(budget_mb):
        async def fn(engine):
            return await asyncio.gather(*(episode(engine, p, 3, random.Random(i), f"e{i}") for i, p in
                                          enumerate(prompts)))

        return serve(model, fn, session_memory_mb=budget_mb)

    roomy, roomy_stats = run(64)
    tight, tight_stats = run(0.001)  # 1 KB: no cache survives
    assert [[o.token_ids for _, o in ep] for ep in tight] == [[o.token_ids for _, o in ep] for ep in roomy]
    assert roomy_stats["evictions"] == roomy_stats["rebuilds"] == 0
    assert tight_stats["evictions"] >= 4 and tight_stats["rebuilds"] == 4  # every later turn re-prefilled
    assert all(o.cached_tokens == 0 for ep in tight for _, o in ep)
    assert tight_stats["sessions"] == 0 and tight_stats["session_mb"] <= 0.001


def test_new_weights_bump_the_version_and_drop_the_caches():
    old, new = peaky_k3(seed=7), peaky_k3(seed=8)
    prompt = [4, 5, 6, 7]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)

    async def fn(engine):
        assert await engine.load_weights(old.state_dict(), 1) == 1
        [a] = await engine.generate(request(prompt, session_id="s", max_tokens=6))
        seq = prompt + a.token_ids + [9, 9]
        # a long generation is in flight when the new weights arrive: it finishes under the old ones
        running = asyncio.ensure_future(engine.generate(request(seq, session_id="s", max_tokens=30)))
        while engine.stats()["running"] == 0 and not running.done():
            await asyncio.sleep(0.002)
        version = await engine.load_weights(new.state_dict(), 2)
        [b] = await running
        dropped = engine.stats()
        [c] = await engine.generate(request(seq, session_id="s", max_tokens=6))
        return a, seq, b, version, dropped, c

    model = peaky_k3(seed=0)  # the engine's own weights before any load
    (a, seq, b, version, dropped, c), stats = serve(model, fn)
    assert version == 2 and stats["version"] == 2
    assert a.version == 1 and a.token_ids == generate_batch_naive(old, [prompt], params)[0].token_ids
    assert b.version == 1 and b.cached_tokens > 0
    assert b.token_ids == generate_batch_naive(old, [seq], SamplingParams(30, temperature=0.0))[0].token_ids
    assert dropped["sessions"] == 0 and dropped["snapshots"] == 0
    assert c.version == 2 and c.cached_tokens == 0  # rebuilt under the new weights
    assert c.token_ids == generate_batch_naive(new, [seq], params)[0].token_ids != generate_batch_naive(old, [seq], params)[0].token_ids
    assert stats["rebuilds"] == 1


def test_close_session_forgets_the_cache():
    model = peaky_k3()

    async def fn(engine):
        await asyncio.gather(*(engine.generate(request([1, 2, 3 + i], session_id=f"c{i}", max_tokens=3))
                               for i in range(3)))
        before = engine.stats()["sessions"]
        engine.close_session("c1")
        engine.close_session("unknown")
        await engine.generate(request([1, 2], max_tokens=1))  # let the engine run its commands
        return before

    before, stats = serve(model, fn)
    assert before == 3 and stats["sessions"] == 2
