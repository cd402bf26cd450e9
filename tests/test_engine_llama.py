"""The fused decode path (engine/llama.py, engine.decoder: auto) and its kernels against their references: the
policy's own forward, torch's attention, linear and sampling ops. Greedy tokens equal, log-probs within a stated
tolerance; sessions survive across turns; a weight load changes what the next step samples."""

import asyncio
import random

import pytest
import torch
import transformers

from sandforge.engine import EngineCore
from sandforge.engine.attention import attention_reference, decode_attention, kernel_available
from sandforge.engine.batch import Prefill, sample_rows
from sandforge.engine.decoders import make_decoder
from sandforge.engine.blocks import RowCaches, RowKV
from sandforge.engine.linear import Linear, linear_reference
from sandforge.engine.linear import kernel_available as gemm_available
from sandforge.engine.llama import LlamaDecoder, unsupported
from sandforge.models.hf import HFPolicy
from sandforge.models.sampling import SamplingParams, sample_next
from sandforge.types import GenerateRequest

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
}
VOCAB = 97


def tiny(family: str = "llama", seed: int = 0, dtype=torch.float32) -> HFPolicy:
    """A random 3-layer model of ``family`` with grouped queries (4 heads, 2 kv heads), weights sharpened so that its
    greedy tokens depend on the whole prompt."""
    config_class, model_class, extra = FAMILIES[family]
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **extra)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    return HFPolicy(model).to(dtype)


def full_logits(policy, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return policy(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_decode_steps_equal_the_model_forward(family):
    """Fresh and continued prefills, then decode steps over a batch that rows join and leave (their caches copied out
    and back in), each position's logits within 1e-4 of one full forward of the policy (float32)."""
    policy = tiny(family)
    decoder = LlamaDecoder(policy)
    rng = random.Random(1)
    seqs = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (20, 24, 22)]
    refs = [full_logits(policy, s) for s in seqs]
    with torch.inference_mode():
        items = [Prefill(None, s[:6]) for s in seqs]
        decoder.prefill(items)
        for item, ref in zip(items, refs):
            assert torch.allclose(item.logits, ref[5], atol=1e-4)
        more = Prefill(items[1].out_cache, seqs[1][6:9])  # a session's next turn: only the new tokens
        decoder.prefill([more])
        assert torch.allclose(more.logits, refs[1][8], atol=1e-4)
        batch = decoder.new_batch()
        batch.add([0, 2], RowCaches.cat([items[0].out_cache, items[2].out_cache]))
        batch.add([1], more.out_cache)
        position = {0: 6, 1: 9, 2: 6}
        for step in range(8):
            logits, routed = decoder.step(batch, [seqs[r][position[r]] for r in batch.rows])
            assert routed is None
            for i, r in enumerate(batch.rows):
                assert torch.allclose(logits[i], refs[r][position[r]], atol=1e-4), (family, step, r)
                position[r] += 1
            if step == 2:  # row 0 leaves (another row takes its slot), then comes back
                (cache,) = batch.remove([batch.rows.index(0)])
                assert cache.rows[0].n == position[0]
                batch.add([0], cache)


def test_unsupported_policies_keep_the_model_path():
    from sandforge.models.k3.model import PRESETS, K3Model

    k3 = K3Model(PRESETS["k3-nano"])
    assert unsupported(k3) is not None
    assert type(make_decoder(k3, torch.device("cpu"), "auto")).__name__ == "ModelDecoder"
    with pytest.raises(ValueError, match="engine.decoder fused"):
        make_decoder(k3, torch.device("cpu"), "fused")
    assert isinstance(make_decoder(tiny(), torch.device("cpu"), "auto"), LlamaDecoder)


# ---------------------------------------------------------------- kernels against their references
needs_attention = pytest.mark.skipif(not kernel_available(torch.float32), reason="no C compiler: kernels not built")
needs_gemm = pytest.mark.skipif(not gemm_available(), reason="the small GEMM kernel needs a CPU with AVX-512 BF16")


@needs_attention
def test_loading_the_kernels_keeps_subnormal_floats():
    """The kernels are compiled with -ffast-math; linked with it, gcc's crtfastmath would set the CPU to flush
    subnormals to zero in the whole process (the trainer's arithmetic, hypothesis's float strategies)."""
    from sandforge.engine import native

    assert native.load() is not None
    assert 5e-324 * 1.0 > 0  # the smallest double, kept
    assert torch.tensor([1e-40]).mul(1.0).item() > 0  # a float32 subnormal, kept


@needs_attention
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("d,kv,g", [(64, 3, 3), (32, 2, 2), (16, 1, 5)])
def test_attention_kernel_equals_its_reference(dtype, tol, d, kv, g):
    """Rows of different lengths (one of a single token, some past a 64-position block) in a buffer with room."""
    torch.manual_seed(0)
    lengths = torch.tensor([1, 63, 64, 65, 200, 7])
    rows, cap = len(lengths) + 2, 256
    keys = torch.randn(rows, kv, cap, d).to(dtype)
    values = torch.randn(rows, kv, cap, d).to(dtype)
    q = torch.randn(len(lengths), kv * g, d).to(dtype)
    got = decode_attention(q, keys, values, lengths, d**-0.5)
    want = attention_reference(q, keys, values, lengths, d**-0.5)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


@needs_gemm
@pytest.mark.parametrize("rows", [1, 3, 12, 13, 24, 64])
def test_small_gemm_equals_torch_linear(rows):
    """Every option: bias, RMSNorm or gated input, residual, float32 logits; a column count that leaves the last
    32-column block part full. bf16 results are torch's bit for bit but for a rare last-bit rounding of a sum taken
    in another order."""
    torch.manual_seed(rows)
    n, k = 83, 96
    weight = (torch.randn(n, k) * 0.1).bfloat16()
    bias = torch.randn(n).bfloat16()
    x = torch.randn(rows, k).bfloat16()
    wide = torch.randn(rows, 2 * k).bfloat16()
    residual = torch.randn(rows, n).bfloat16()
    norm = (torch.rand(k).bfloat16() + 0.5, 1e-5)
    linear = Linear.of(weight, bias)
    assert linear.packed is not None
    cases = [
        (linear(x), linear_reference(x, weight, bias)),
        (linear(x, residual=residual), linear_reference(x, weight, bias, residual)),
        (linear(x, norm=norm), linear_reference(x, weight, bias, norm=norm)),
        (linear(x, out_f32=True), linear_reference(x, weight, bias, out_f32=True)),
    ]
    gated = Linear.of(weight[:, :k], None)
    cases.append((gated(wide[:, :2 * k], gated=True), linear_reference(wide, weight[:, :k], gated=True)))
    for got, want in cases:
        assert got.dtype == want.dtype and got.shape == want.shape
        close = torch.isclose(got.float(), want.float(), atol=0, rtol=0).float().mean()
        assert close > 0.97  # bit-equal
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=1e-2)  # the rest a bf16 ulp apart


@needs_attention
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_sample_kernel_draws_what_sample_next_draws(temperature):
    """The same uniforms from the same generators: the same tokens but where a uniform falls within float rounding
    of a token's boundary (the reference's cumulative sum is rounded to float32; about 0.3% of draws over 49k
    tokens), log-probs within 1e-4; greedy exactly."""
    torch.manual_seed(0)
    n, vocab = 32, 4096
    agree, total = 0, 0
    for trial in range(10):
        logits = torch.randn(n, vocab) * 3
        params = [(temperature, 1.0, 0)] * n
        gens = [[torch.Generator().manual_seed(100 * trial + i) for i in range(n)] for _ in range(2)]
        fast = sample_rows(logits, params, torch.Generator(), gens[0], use_kernel=True)
        slow = sample_rows(logits, params, torch.Generator(), gens[1], use_kernel=False)
        for a, b, la, lb in zip(fast[0], slow[0], fast[1], slow[1]):
            total += 1
            if a == b:
                agree += 1
                assert abs(la - lb) < 1e-4
        assert torch.allclose(torch.tensor(fast[1]),
                              torch.log_softmax(logits / (temperature or 1.0), -1)[range(n), fast[0]], atol=1e-4)
    assert agree / total >= (1.0 if temperature == 0 else 0.98)
    if temperature == 0:
        want, _ = sample_next(logits, SamplingParams(temperature=0.0))
        assert fast[0] == want.tolist()


# ---------------------------------------------------------------- the engine on the fused path
def run(policy, fn, decoder: str):
    async def main():
        engine = EngineCore(policy, max_batch_size=8, seed=0, decoder=decoder)
        try:
            return await fn(engine), engine.stats()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


async def episodes(engine, turns: int = 3, n: int = 5) -> list[list]:
    """``n`` concurrent multi-turn greedy episodes, each turn's prompt the whole sequence so far (token-in); each
    episode draws its tokens from its own generator, so they do not depend on the order the engine answers in."""

    async def one(i: int) -> list:
        rng = random.Random(i)
        seq = [rng.randrange(1, VOCAB) for _ in range(10 + 3 * i)]
        samples = []
        for turn in range(turns):
            [s] = await engine.generate(GenerateRequest(prompt_ids=seq, session_id=f"ep{i}", max_tokens=6 + i,
                                                        temperature=0.0))
            samples.append(s)
            seq = seq + s.token_ids + [rng.randrange(1, VOCAB) for _ in range(4)]
        return samples

    return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_fused_equals_engine_on_the_model_forward_across_turns(family):
    """Concurrent multi-turn episodes: the same greedy tokens and log-probs within 1e-4 as the engine on the policy's
    own forward, and every turn after the first prefills only what it appends (its session survived)."""
    policy = tiny(family)
    fused, stats = run(policy, episodes, "fused")
    model, _ = run(policy, episodes, "model")
    for a_turns, b_turns in zip(fused, model):
        for a, b in zip(a_turns, b_turns):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    for ep in fused:
        for turn in ep[1:]:
            assert turn.cached_tokens > 0 and turn.prefill_tokens == 4 + 1  # the observation and the last sample
    assert stats["rebuilds"] == 0


def test_a_weight_load_changes_the_next_sample_on_the_fused_path():
    """The fused q/k/v and gate/up matrices are copies: after a load they are made again, so the next request
    samples what the new weights (and the model path with them) sample."""
    old, new = tiny(seed=0), tiny(seed=1)
    prompt = [5, 17, 33, 2, 61, 40, 8]

    async def sample_before_and_after(engine):
        request = GenerateRequest(prompt_ids=prompt, max_tokens=8, temperature=0.0)
        [before] = await engine.generate(request)
        await engine.load_weights({k: v.clone() for k, v in new.state_dict().items()}, version=1)
        [after] = await engine.generate(request)
        return before, after

    (before, after), _ = run(tiny(seed=0), sample_before_and_after, "fused")
    (expect_before, expect_after), _ = run(old, lambda e: sample_before_and_after(e), "model")
    assert before.token_ids == expect_before.token_ids
    assert after.token_ids == expect_after.token_ids != before.token_ids
    assert after.version == 1


@pytest.mark.skipif(not (kernel_available(torch.bfloat16) and gemm_available()), reason="bf16 kernels not built")
def test_bf16_fused_path_tracks_the_bf16_model_forward():
    """In bf16 with every kernel: the first sampled token of each episode is the model path's, and the log-probs of
    the tokens both chose are within 0.05 (bf16 rounding, different summation order)."""
    policy = tiny(dtype=torch.bfloat16)
    fused, _ = run(policy, lambda e: episodes(e, turns=1), "fused")
    model, _ = run(policy, lambda e: episodes(e, turns=1), "model")
    for [a], [b] in zip(fused, model):
        assert a.token_ids[0] == b.token_ids[0]
        same = [i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x == y]
        assert max(abs(a.logprobs[i] - b.logprobs[i]) for i in same) < 0.05


def test_row_caches_answer_the_engine_cache_protocol():
    row = RowKV([torch.arange(12.0).view(1, 6, 2)], [torch.zeros(1, 6, 2)])
    caches = RowCaches.cat([RowCaches([row]), RowCaches([row.prefix(3)])])
    assert [r.n for r in caches.rows] == [6, 3] and caches.seq_len == 6
    assert caches.select([1]).rows[0].n == 3 and caches.compact() is caches
    assert caches.nbytes == row.nbytes + row.prefix(3).nbytes
    assert RowCaches([row]).prefix(2).rows[0].keys[0].tolist() == [[[0.0, 1.0], [2.0, 3.0]]]


def test_prompts_sharing_a_prefix_prefill_it_once_and_answer_as_without():
    """An RL step's first turns share the system prompt and tool declarations: admitted together they prefill it
    once, and a prompt admitted later under the same weights finds it stored. Their answers are those of the engine
    on the model path, which shares nothing."""
    rng = random.Random(5)
    system = [rng.randrange(1, VOCAB) for _ in range(48)]
    prompts = [system + [rng.randrange(1, VOCAB) for _ in range(5 + i)] for i in range(5)]

    async def ask(engine):
        first = await asyncio.gather(*(engine.generate(GenerateRequest(prompt_ids=p, max_tokens=6, temperature=0.0))
                                       for p in prompts[:4]))
        later = await engine.generate(GenerateRequest(prompt_ids=prompts[4], max_tokens=6, temperature=0.0))
        return [s[0] for s in first] + later

    policy = tiny()
    fused, stats = run(policy, ask, "fused")
    model, model_stats = run(policy, ask, "model")
    for a, b in zip(fused, model):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert stats["prefix_tokens"] == 4 * 48  # three of the first four, and the later one, skip the shared 48
    assert stats["prefill_tokens"] == sum(map(len, prompts)) - 4 * 48
    assert model_stats["prefix_tokens"] == 0
