"""Policies are built, described, saved and loaded by architecture name, and keep their per-step upkeep."""

import pytest
import torch

from sandforge.config import ModelConfig
from sandforge.models.build import (
    after_optimizer_step,
    build_policy,
    load_policy,
    policy_config,
    policy_from_config,
    save_policy,
)
from sandforge.models.k3.config import preset_config
from sandforge.models.k3.model import K3Model


def test_build_describe_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = build_policy(ModelConfig(arch="k3", preset="k3-nano", k3={"d_model": 32, "d_ff": 48}), vocab_size=272)
    assert isinstance(model, K3Model) and model.config.vocab_size == 272
    assert (model.config.d_model, model.config.d_ff, model.config.n_experts) == (32, 48, 4)  # preset + overrides
    rebuilt = policy_from_config(policy_config(model))
    assert type(rebuilt) is K3Model and rebuilt.config == model.config
    save_policy(model, tmp_path)
    loaded = load_policy(tmp_path).eval()
    ids = torch.randint(0, 272, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


def test_unknown_arch_and_preset_are_explained():
    with pytest.raises(ValueError, match="unknown model.arch 'gpt'"):  # a checkpoint's config.json
        policy_from_config({"arch": "gpt"})
    with pytest.raises(ValueError, match="'k3' or 'hf'"):  # a job's model section
        ModelConfig(arch="gpt")
    with pytest.raises(ValueError, match="unknown K3 preset 'k3-huge'"):
        preset_config("k3-huge")
    with pytest.raises(ValueError, match="model.k3.d_modle: not a K3Config field"):
        build_policy(ModelConfig(k3={"d_modle": 64}), 272)


def test_after_optimizer_step_updates_the_latent_moe_biases():
    torch.manual_seed(0)
    model = build_policy(ModelConfig(), vocab_size=272).train()
    model(torch.randint(0, 272, (2, 32)))
    metrics = after_optimizer_step(model)
    assert metrics["moe/max_load_ratio"] >= 1.0
    assert any(m.ffn.bias.abs().sum() > 0 for m in model.layers[1:])
    assert after_optimizer_step(torch.nn.Linear(2, 2)) == {}  # nothing to do for a model without LatentMoE
