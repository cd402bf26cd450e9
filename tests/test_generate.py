"""Batched cached generation against the naive reference, and engine/trainer log-probability agreement."""

from dataclasses import replace

import pytest
import torch

from sandforge.models.sampling import SamplingParams, sample_next, token_logprobs
from sandforge.engine.naive import Generation, generate_batch_naive
from sandforge.models.k3.model import PRESETS, K3Model
from sandforge.engine.naive import generate_naive

PROMPTS = [[257, 5, 9, 200, 7, 7, 3, 44, 45], [257, 17], [257, 8, 100, 101, 102], [257, 66, 67, 68, 69, 70, 71]]


def peaky_model(seed=0, scale=3.0, **overrides) -> K3Model:
    """A random K3 model with sharp, varied predictions (a freshly initialised one mostly repeats its input)."""
    torch.manual_seed(seed)
    model = K3Model(replace(PRESETS["k3-nano"], vocab_size=272, tie_embeddings=False, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(scale)
    return model


def right_padded(prompts, gens):
    seqs = [p + g.token_ids for p, g in zip(prompts, gens)]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask


def position_logits(model, prompt, gen, temperature=1.0):
    """Logits / temperature that chose each generated token, from one full forward pass. [n_generated, V]"""
    seq = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        return model(seq).logits[0, len(prompt) - 1 : -1] / temperature


def test_greedy_batched_matches_naive():
    model = peaky_model()
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    free = generate_batch_naive(model, PROMPTS, params)
    assert len({tuple(g.token_ids) for g in free}) == len(PROMPTS)  # the test is not trivially repetitive
    # stop on a token row 1 emits midway, so rows finish at different steps
    stop = free[1].token_ids[5]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_ids=(stop,))
    batched, naive = generate_batch_naive(model, PROMPTS, params), generate_naive(model, PROMPTS, params)
    assert [g.token_ids for g in batched] == [g.token_ids for g in naive]
    assert [g.finish_reason for g in batched] == [g.finish_reason for g in naive]
    assert batched[1].finish_reason == "stop" and batched[1].token_ids[-1] == stop and len(batched[1].token_ids) <= 6
    for b, n in zip(batched, naive):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(n.logprobs), atol=1e-4, rtol=0)
        assert len(b.logprobs) == len(b.token_ids)
        assert b.finish_reason == "stop" or len(b.token_ids) == 24


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=20, temperature=1.0),
        SamplingParams(max_new_tokens=20, temperature=0.7, top_k=5, top_p=0.9),  # logprobs are taken before truncation
    ],
)
def test_sampled_logprobs_match_trainer_recomputation(params):
    model = peaky_model(seed=1)
    gens = generate_batch_naive(model, PROMPTS, params, torch.Generator().manual_seed(0))
    ids, mask = right_padded(PROMPTS, gens)
    model.train()
    lp, aux = token_logprobs(model, ids, mask, temperature=params.temperature)
    assert lp.requires_grad and lp.shape == ids.shape and aux.ndim == 0  # K3 balances by bias: aux is 0
    assert (lp[:, 0] == 0).all() and (lp[mask == 0] == 0).all()
    for i, (p, g) in enumerate(zip(PROMPTS, gens)):
        recomputed = lp[i, len(p) : len(p) + len(g.token_ids)].detach()
        torch.testing.assert_close(recomputed, torch.tensor(g.logprobs), atol=1e-4, rtol=0)


def test_seeded_sampling_is_reproducible_and_restores_train_mode():
    model = peaky_model().train()
    params = SamplingParams(max_new_tokens=12)
    a = generate_batch_naive(model, PROMPTS, params, torch.Generator().manual_seed(7))
    assert model.training
    b = generate_batch_naive(model, PROMPTS, params, torch.Generator().manual_seed(7))
    c = generate_batch_naive(model, PROMPTS, params, torch.Generator().manual_seed(8))
    assert a == b and a != c
    assert all(isinstance(t, int) and isinstance(x, float) for g in a for t, x in zip(g.token_ids, g.logprobs))
    generate_naive(model, PROMPTS[:1], params)
    assert model.training
    model.eval()
    generate_batch_naive(model, PROMPTS[:1], params)
    assert not model.training


def test_top_k_only_emits_the_k_most_likely_tokens():
    model = peaky_model(seed=2, scale=1.0)  # flat predictions: without truncation many tokens would be drawn
    params = SamplingParams(max_new_tokens=30, temperature=1.5, top_k=3)
    for p, g in zip(PROMPTS, generate_batch_naive(model, PROMPTS, params, torch.Generator().manual_seed(0))):
        top3 = position_logits(model, p, g).topk(3).indices
        assert all(t in row for t, row in zip(g.token_ids, top3.tolist()))


def test_top_p_only_emits_tokens_of_the_nucleus():
    model = peaky_model(seed=2, scale=1.0)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.3)
    for p, g in zip(PROMPTS, generate_batch_naive(model, PROMPTS, params, torch.Generator().manual_seed(0))):
        probs = position_logits(model, p, g).softmax(-1)
        for t, row in zip(g.token_ids, probs):
            assert row[row > row[t]].sum() < 0.3  # the mass of more likely tokens had not reached top_p yet


def test_sample_next_truncation_on_known_logits():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]).repeat(2000, 1))
    gen = torch.Generator().manual_seed(0)
    tokens, lp = sample_next(logits, SamplingParams(top_p=0.8), gen)
    assert set(tokens.tolist()) == {0, 1}  # 0.5 < 0.8, 0.5 + 0.3 reaches it
    torch.testing.assert_close(lp, logits.gather(-1, tokens[:, None]).squeeze(-1))  # untruncated log-probs
    tokens, _ = sample_next(logits, SamplingParams(top_k=3), gen)
    assert set(tokens.tolist()) == {0, 1, 2}
    tokens, lp = sample_next(logits, SamplingParams(temperature=0), gen)
    assert (tokens == 0).all()


def test_stop_ids_and_length_limits():
    model = peaky_model()
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    first = [g.token_ids[0] for g in generate_batch_naive(model, PROMPTS, greedy)]
    gens = generate_batch_naive(model, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0, stop_ids=(first[0], 999)))
    assert gens[0] == Generation([first[0]], gens[0].logprobs, "stop")
    assert all(g.finish_reason == "stop" or len(g.token_ids) == 10 for g in gens)
    # the context length caps generation
    small = peaky_model(max_seq_len=12)
    gens = generate_batch_naive(small, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0))
    assert [len(p) + len(g.token_ids) for p, g in zip(PROMPTS, gens)] == [12, 12, 12, 12]
    assert generate_batch_naive(model, PROMPTS, SamplingParams(max_new_tokens=0)) == [Generation([], [], "length")] * 4
    assert generate_batch_naive(model, [], SamplingParams()) == []
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_batch_naive(model, [[1], []], SamplingParams())


def test_draw_samples_the_distribution_multinomial_samples():
    """models/sampling.py ``draw`` (inverse CDF, one uniform a row) against its reference ``torch.multinomial``: the
    same frequencies on a known distribution with zero-weight tokens (never drawn), within sampling noise."""
    from sandforge.models.sampling import draw, draw_multinomial

    probs = torch.tensor([[0.0, 0.1, 0.0, 0.25, 0.6, 0.05, 0.0]]).repeat(20000, 1) * 3  # unnormalised weights
    freq = []
    for fn in (draw, draw_multinomial):
        tokens = fn(probs, generator=torch.Generator().manual_seed(0))
        freq.append(torch.bincount(tokens, minlength=7).float() / len(tokens))
    assert freq[0][[0, 2, 6]].sum() == 0 and freq[1][[0, 2, 6]].sum() == 0
    want = probs[0] / probs[0].sum()
    for f in freq:
        assert (f - want).abs().max() < 0.015  # 3.5 sigma of 20,000 draws at p = 0.6
    # the top edge: a uniform that rounds to the total still lands on a token with weight
    edge = torch.tensor([[0.3, 0.7, 0.0, 0.0]])
    assert all(draw(edge, generator=torch.Generator().manual_seed(s)).item() in (0, 1) for s in range(200))


def test_a_row_with_its_own_generator_draws_the_same_token_in_any_batch():
    from sandforge.models.sampling import draw

    torch.manual_seed(0)
    probs = torch.rand(5, 1000)
    alone = [draw(probs[i : i + 1], [torch.Generator().manual_seed(10 + i)]).item() for i in range(5)]
    together = draw(probs, [torch.Generator().manual_seed(10 + i) for i in range(5)]).tolist()
    mixed = draw(probs, [None, torch.Generator().manual_seed(11), None, torch.Generator().manual_seed(13), None],
                 generator=torch.Generator().manual_seed(99)).tolist()
    assert alone == together and mixed[1] == alone[1] and mixed[3] == alone[3]
