"""LoRA (model.lora) on a tiny Hugging Face llama built here: a real DeepSpeed step (ZeRO-2, gloo, this process)
trains only the adapters; the KL reference stays the frozen base; after a sync over either path the engine serves the
trainer's merged model; a checkpoint's policy is a plain Hugging Face model with the merged weights, and a rank
reloaded from it takes the same next step."""

import asyncio
import os
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from engine_sync import push_over_channel  # noqa: E402
from test_hf import build_tokenizer  # noqa: E402

from sandforge.config import (ConfigError, EngineConfig, LoraConfig, ModelConfig, TrainerConfig,  # noqa: E402
                              load_config)
from sandforge.job.fleet.lifecycle import free_port  # noqa: E402
from sandforge.trainer.checkpoint import ADAPTERS_FILE  # noqa: E402
from sandforge.trainer.rank import RolloutShape  # noqa: E402
from sandforge.types import TrainingRow  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRAINER = TrainerConfig(lr=1e-2, zero_stage=2, grad_accum_steps=2, kl_coef=0.1)
SHAPE = RolloutShape(temperature=1.0, response_budget=64)


def save_tiny_llama(path):
    """A tiny random llama with tied embeddings (as SmolLM2 has) and a BPE tokenizer, saved as a downloaded one is."""
    tokenizer = build_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def lora_model(path, **lora) -> ModelConfig:
    return ModelConfig(path=str(path), lora=LoraConfig(**{"r": 4, "alpha": 8.0, "target_modules": TARGETS, **lora}))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))


def new_rank(base_dir, trainer=TRAINER):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from sandforge.trainer.rank import TrainerRank

    return TrainerRank(0, 1, "127.0.0.1", free_port(), lora_model(base_dir), trainer, SHAPE, seed=0, num_threads=2)


def make_rows(rank, advantages):
    """On-policy rows: the engine's log-probs are the rank's own."""
    from sandforge.models.sampling import token_logprobs
    from sandforge.trainer.batches import token_batch

    g = torch.Generator().manual_seed(1)
    rows = []
    for i, adv in enumerate(advantages):
        n = 12 + 3 * i
        ids = torch.randint(3, len(rank.tokenizer), (n,), generator=g).tolist()
        rows.append(TrainingRow(token_ids=ids, loss_mask=[0] * 6 + [1] * (n - 6), advantages=[adv] * n))
    with torch.no_grad():
        lp, _ = token_logprobs(rank.engine.module.eval(), *token_batch(rows))
    return [replace(r, logprobs=lp[i, : len(r.token_ids)].tolist()) for i, r in enumerate(rows)]


def step(rank, rows):
    return rank.train_step(rows, sum(sum(r.loss_mask) for r in rows), mode="rl")


def logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits


IDS = torch.tensor([[5, 9, 30, 7, 11, 40, 41, 42, 17, 3], [8, 2, 6, 33, 12, 19, 21, 25, 27, 29]])


@pytest.fixture(scope="module")
def trained(base_dir):
    """A rank after two RL steps, so both A and B have moved (B starts at zero: the first step moves only B)."""
    rank = new_rank(base_dir)
    for _ in range(2):
        step(rank, make_rows(rank, [1.0, -1.0, 1.0]))
    return rank


def test_a_deepspeed_step_trains_only_the_adapters(base_dir):
    rank = new_rank(base_dir)
    adapters = rank.get_weights()
    assert adapters and all(k.endswith((".lora_A", ".lora_B")) for k in adapters)
    in_optimizer = sum(p.numel() for g in rank.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(v.numel() for v in adapters.values())  # the optimizer holds the adapters only
    base = {k: v.clone() for k, v in rank.engine.module.state_dict().items() if ".lora_" not in k}

    metrics = step(rank, make_rows(rank, [1.0, -1.0, 1.0]))
    assert metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-5) and metrics["grad_norm"] > 0
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the base, and so was the policy
    after = rank.engine.module.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # every base weight bit-identical
    moved = [k for k, v in rank.get_weights().items() if not torch.equal(v, adapters[k])]
    assert any(k.endswith(".lora_B") for k in moved)


def test_the_kl_reference_stays_the_frozen_base_until_reset(trained, base_dir):
    from sandforge.models.build import load_policy
    from sandforge.models.sampling import token_logprobs
    from sandforge.trainer.batches import token_batch

    rows = make_rows(trained, [1.0, 1.0])
    batch = token_batch(rows)
    with torch.no_grad():
        reference = token_logprobs(trained.reference, *batch)[0]
        base = token_logprobs(load_policy(base_dir).eval(), *batch)[0]
        policy = token_logprobs(trained.engine.module.eval(), *batch)[0]
    torch.testing.assert_close(reference, base, atol=1e-6, rtol=0)
    assert (policy - base).abs().max() > 1e-3  # the test could fail: the policy did move
    assert trained.reference.policy is trained.engine.module  # no second model
    trained.reset_reference()  # the warm start's end: RL is measured from here
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(trained.reference, *batch)[0], policy, atol=1e-6, rtol=0)
    assert trained.score(rows)[0].kl_penalty is not None


def sync(rank, engine, mode: str, version: int) -> int:
    """One push, the way job/fleet/weight_sync.py makes it: through the object store's path or the weight channel."""
    async def load(weights):
        try:
            return await engine.load_weights(weights, version)
        finally:
            await engine.core.shutdown()

    if mode == "object_store":
        return asyncio.run(load(rank.get_weights()))

    def send(port: int) -> None:
        rank.open_weight_channel("127.0.0.1", port)
        rank.send_weights(version)

    return push_over_channel(engine, send)


@pytest.mark.parametrize("mode", ["object_store", "collective"])
def test_the_engine_serves_the_trainers_merged_model_after_a_sync(trained, base_dir, mode):
    from sandforge.models.build import load_policy
    from sandforge.models.hf import HFPolicy
    from sandforge.models.lora import merged_state_dict
    from sandforge.engine import EngineActor

    config = trained.model_config_dict()
    assert config["lora"]["targets"] and config["lora"]["r"] == 4
    engine = EngineActor(config, EngineConfig(max_batch_size=4, session_memory_mb=16), 0, 1)
    base = logits(engine.core.model, IDS)
    assert sync(trained, engine, mode, 1) == 1 == engine.version()
    served = logits(engine.core.model, IDS)
    merged = load_policy(base_dir)
    merged.load_state_dict(merged_state_dict(trained.engine.module))
    assert isinstance(merged, HFPolicy)
    torch.testing.assert_close(served, logits(merged, IDS), atol=1e-4, rtol=0)
    torch.testing.assert_close(served, logits(trained.engine.module, IDS), atol=1e-4, rtol=0)  # as trained (unmerged)
    assert (served - base).abs().max() > 1e-2  # the sync changed what the engine serves
    assert sync(trained, engine, mode, 2) == 2  # the same adapters again: merged into the kept base, not on top
    assert torch.equal(logits(engine.core.model, IDS), served)


def test_a_checkpoint_saves_the_merged_policy_and_reloads_the_same_next_step(base_dir, tmp_path):
    from sandforge.models.build import load_chat, load_policy

    a = new_rank(base_dir)
    step(a, make_rows(a, [1.0, -1.0, 1.0]))
    a.reset_reference()  # as after a warm start: the reference is not the base any more
    a.save_checkpoint(str(tmp_path), "step_0", {"step": 0})
    rows = make_rows(a, [1.0, -1.0, 0.5])
    step(a, rows)
    policy_dir = a.save_checkpoint(str(tmp_path), "step_1", {"step": 1})
    want = step(a, rows)

    plain = load_policy(policy_dir)  # a plain Hugging Face policy: no adapters, weights merged
    assert not any(".lora_" in k or ".base_layer." in k for k in plain.state_dict())
    assert (tmp_path / "step_1" / ADAPTERS_FILE).is_file()
    b = new_rank(base_dir)
    b.load_checkpoint(str(tmp_path), "step_1", reference=str(tmp_path / "step_0" / "policy"))
    torch.testing.assert_close(logits(plain, IDS), logits(b.engine.module, IDS), atol=1e-4, rtol=0)
    chat = load_chat(ModelConfig(path=str(base_dir), init_from=policy_dir))  # model.init_from: the tokenizer came too
    assert len(chat.tokenizer) == len(a.tokenizer)
    got = step(b, rows)
    assert got == want  # every metric bitwise: adapters, optimizer moments and the KL reference came back
    assert all(torch.equal(v, a.get_weights()[k]) for k, v in b.get_weights().items())


def test_top_layers_adapts_only_the_last_layers_and_the_backward_stops_below_them(base_dir):
    from sandforge.models.build import load_policy
    from sandforge.models.sampling import token_logprobs
    from sandforge.models.lora import add_lora, adapter_weights

    policy = add_lora(load_policy(base_dir), LoraConfig(top_layers=1))
    assert {k.split(".")[3] for k in adapter_weights(policy)} == {"1"}  # model.model.layers.<i>...
    assert len(policy.lora_spec["targets"]) == len(TARGETS)
    with torch.no_grad():
        for v in adapter_weights(policy).values():
            v.normal_(0, 0.1)  # B = 0 would give A no gradient
    graph = []  # per layer: is its output part of the autograd graph?
    for layer in policy.model.model.layers:
        layer.register_forward_hook(lambda m, args, out: graph.append((out[0] if isinstance(out, tuple) else out)
                                                                      .requires_grad))
    token_logprobs(policy, IDS, torch.ones_like(IDS))[0].sum().backward()
    assert graph == [False, True]  # no backward through layer 0, whose weights are all frozen
    assert all(v.grad is not None and v.grad.abs().sum() > 0 for v in adapter_weights(policy).values())


def test_lora_is_refused_where_it_cannot_work(base_dir, tmp_path):
    from sandforge.models.build import load_policy
    from sandforge.models.lora import add_lora

    with pytest.raises(ValueError, match="names no linear layer of this model.*q_proj"):
        add_lora(load_policy(base_dir), LoraConfig(target_modules=["qproj"]))
    with pytest.raises(ValueError, match="lm_head shares its weight with model.model.embed_tokens.weight"):
        add_lora(load_policy(base_dir), LoraConfig(target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="top_layers' = 3, but this model has 2 layers"):
        add_lora(load_policy(base_dir), LoraConfig(top_layers=3))
    job = tmp_path / "job.yaml"
    for text, needle in [
        (f"model:\n  path: {base_dir}\n  lora: {{r: 4}}\ntrainer:\n  zero_stage: 3\n", "use zero_stage 2"),
        ("model:\n  arch: k3\n  lora: {r: 4}\n", "'model.lora' needs a pretrained policy"),
        (f"model:\n  path: {base_dir}\n  lora: {{alpah: 4}}\n",
         "unknown key 'model.lora.alpah' (did you mean 'alpha'?)"),
    ]:
        job.write_text(text)
        with pytest.raises(ConfigError) as err:
            load_config(job)
        assert needle in str(err.value) and "\n" not in str(err.value)
    job.write_text(f"model:\n  path: {base_dir}\n  lora: {{r: 4}}\n")
    assert load_config(job).model.lora.target_modules == TARGETS and load_config(job).model.lora.alpha == 32


def test_a_bfloat16_engine_merges_in_fp32_and_serves_the_merged_weights_cast(trained, base_dir):
    """engine.dtype bfloat16: the adapters are merged into the fp32 base it kept, then cast; nothing accumulates."""
    from sandforge.models.lora import merged_state_dict
    from sandforge.engine import EngineActor

    engine = EngineActor(trained.model_config_dict(), EngineConfig(max_batch_size=4, session_memory_mb=16,
                                                                       dtype="bfloat16"), 0, 1)
    assert {p.dtype for p in engine.core.model.parameters()} == {torch.bfloat16}
    assert sync(trained, engine, "object_store", 1) == 1
    merged = merged_state_dict(trained.engine.module)
    served = engine.core.model.state_dict()
    for key, value in merged.items():
        assert torch.equal(served[key], value.to(torch.bfloat16)), key
    assert sync(trained, engine, "object_store", 2) == 2
    assert all(torch.equal(engine.core.model.state_dict()[k], v) for k, v in served.items())
    torch.testing.assert_close(logits(engine.core.model, IDS), logits(trained.engine.module, IDS), atol=0.15, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lora_layers_compute_what_peft_computes(base_dir, dtype):
    """models/lora_fused.py's merged forward and its backward against peft's own forward (``lora.fused: false``):
    the same log-probs and the same adapter gradients, in fp32 and in bf16 (to bf16's rounding); adapters disabled,
    the layers run peft's path."""
    from sandforge.models.build import load_policy
    from sandforge.models.lora import add_lora, adapter_weights
    from sandforge.models.lora_fused import FusedLoraLinear
    from sandforge.models.sampling import token_logprobs

    policies = []
    for fused in (False, True):
        policy = add_lora(load_policy(base_dir), LoraConfig(r=4, alpha=8.0, fused=fused)).to(dtype)
        torch.manual_seed(1)
        with torch.no_grad():
            for v in adapter_weights(policy).values():
                v.normal_(0, 0.1)
        policies.append(policy)
    reference, fused = policies
    assert not any(isinstance(m, FusedLoraLinear) for m in reference.modules())
    assert sum(isinstance(m, FusedLoraLinear) for m in fused.modules()) == len(fused.lora_spec["targets"])
    mask = torch.ones_like(IDS)
    mask[0, :3] = 0  # left padding in one row
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 5e-2}
    outs = []
    for policy in policies:
        lp, _ = token_logprobs(policy, IDS, mask)
        lp.float().sum().backward()
        outs.append((lp.detach().float(), {k: v.grad.float() for k, v in adapter_weights(policy).items()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], **tol)
    for k, g in outs[0][1].items():
        assert g.abs().sum() > 0
        torch.testing.assert_close(outs[1][1][k], g, **tol)
    with torch.no_grad():  # the scoring forward, no graph
        torch.testing.assert_close(token_logprobs(fused, IDS, mask)[0].float(), outs[0][0], **tol)
    for policy in policies:
        for m in policy.modules():
            if hasattr(m, "disable_adapters") and hasattr(m, "_disable_adapters"):
                m._disable_adapters = True
    with torch.no_grad():  # adapters off: both are the base model
        torch.testing.assert_close(token_logprobs(fused, IDS, mask)[0], token_logprobs(reference, IDS, mask)[0])


def test_scoring_every_token_takes_the_same_step(base_dir):
    """``trainer.scoring: all_tokens`` (the reference, bench/rl_step.py's baseline) against the default's logits at
    policy tokens only: the same loss, gradient norm and adapters after a step."""
    ranks = [new_rank(base_dir, TRAINER.model_copy(update={"scoring": scoring})) for scoring in ("policy_tokens", "all_tokens")]
    rows = make_rows(ranks[0], [1.0, -1.0, 0.5])
    got = [step(rank, rows) for rank in ranks]
    for key in ("loss", "grad_norm", "kl"):
        assert got[0][key] == pytest.approx(got[1][key], rel=1e-4, abs=1e-6)
    for k, v in ranks[0].get_weights().items():
        torch.testing.assert_close(v, ranks[1].get_weights()[k], atol=1e-6, rtol=1e-4)
