"""The assembled K3 policy: layout, cached decoding equals the full forward, routing replay, save/load, generation."""

import pytest
import torch

from sandforge.models.sampling import SamplingParams, token_logprobs
from sandforge.engine.naive import generate_batch_naive
from sandforge.models.k3.model import PRESETS, K3Model, count_parameters, from_pretrained, save_pretrained
from sandforge.engine.naive import generate_naive


@pytest.fixture(scope="module")
def nano():
    torch.manual_seed(0)
    return K3Model(PRESETS["k3-nano"]).eval()


def test_layout_is_three_kda_then_one_mla_with_a_final_global_layer(nano):
    cfg = PRESETS["k3-mini"]
    assert cfg.layer_kinds == ["kda", "kda", "kda", "mla"] * 2 + ["mla"]
    assert type(nano.layers[0].ffn).__name__ == "SituGLU"  # dense first feed-forward
    assert all(type(layer.ffn).__name__ == "LatentMoE" for layer in nano.layers[1:])
    assert count_parameters(nano) < 1_000_000
    assert 5_000_000 < count_parameters(K3Model(PRESETS["k3-mini"])) < 20_000_000
    with torch.device("meta"):  # shapes only: a billion parameters are not allocated
        assert 0.8e9 < count_parameters(K3Model(PRESETS["k3-1b"])) < 1.5e9


def decode_incrementally(model, ids, prefix, cache=None):
    out = model(ids[:, :prefix], use_cache=True, cache=cache)
    logits, cache = [out.logits], out.cache
    for t in range(prefix, ids.shape[1]):
        out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
        logits.append(out.logits)
        cache = out.cache
    return torch.cat(logits, dim=1), cache


def test_cached_decoding_equals_the_full_forward(nano):
    ids = torch.randint(0, 1000, (2, 19))
    with torch.no_grad():
        full = nano(ids).logits
        inc, _ = decode_incrementally(nano, ids, prefix=7)
    assert (full - inc).abs().max() <= 1e-4


def test_a_copied_cache_continues_like_the_full_forward(nano):
    prompt = torch.randint(0, 1000, (1, 9))
    tails = torch.randint(0, 1000, (3, 4))
    with torch.no_grad():
        cache = nano(prompt, use_cache=True).cache.repeat_interleave(3)  # one prompt, three samples
        branch = cache.clone()
        logits = []
        for t in range(tails.shape[1]):
            out = nano(tails[:, t : t + 1], cache=branch, use_cache=True)
            branch = out.cache
            logits.append(out.logits)
        inc = torch.cat(logits, dim=1)
        full = nano(torch.cat([prompt.expand(3, -1), tails], dim=1)).logits[:, 9:]
    assert (full - inc).abs().max() <= 1e-4


def test_forced_expert_ids_reproduce_the_recorded_logits_exactly(nano):
    ids = torch.randint(0, 1000, (2, 12))
    with torch.no_grad():
        recorded = nano(ids)
        replay = nano(ids, forced_ids=recorded.router_ids)
        n_moe = len(nano.moe_layers)
        assert recorded.router_ids.shape == (2, 12, n_moe, PRESETS["k3-nano"].top_k)
        elsewhere = nano(ids, forced_ids=(recorded.router_ids + 1) % PRESETS["k3-nano"].n_experts)
    assert torch.equal(replay.logits, recorded.logits)
    assert not torch.equal(elsewhere.logits, recorded.logits)  # the forcing really routes


def test_save_and_load_round_trip(nano, tmp_path):
    nano.layers[1].ffn.bias.copy_(torch.linspace(-1, 1, PRESETS["k3-nano"].n_experts))  # balancing state survives
    save_pretrained(nano, tmp_path)
    loaded = from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 1000, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, nano(ids).logits)
    assert torch.equal(loaded.layers[1].ffn.bias, nano.layers[1].ffn.bias)
    nano.layers[1].ffn.bias.zero_()


def test_batched_generation_and_trainer_logprobs_agree_with_the_reference(nano):
    prompts = [[5, 9, 100, 7], [300, 2], [8, 8, 8, 8, 8, 1]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    fast = generate_batch_naive(nano, prompts, params)
    slow = generate_naive(nano, prompts, params)
    assert [g.token_ids for g in fast] == [g.token_ids for g in slow]
    for prompt, g in zip(prompts, fast):
        ids = torch.tensor([prompt + g.token_ids])
        lp, _ = token_logprobs(nano, ids, torch.ones_like(ids))
        assert lp[0, len(prompt):].tolist() == pytest.approx(g.logprobs, abs=1e-4)
