"""LoRA adapters (``model.lora``) on a Hugging Face policy: trained by the trainer, merged by the engine.

``add_lora`` injects peft's LoRA layers into an ``HFPolicy`` in place: the base weights freeze, and each targeted linear
layer W gains A [r, in] and B [out, r] (B starts at zero, so the policy starts as the base) and computes
W x + (alpha / r) B A x. What leaves the trainer is in the plain policy's names, so no other part needs peft:

- ``adapter_weights``: what a weight sync sends, ``<module>.lora_A`` and ``<module>.lora_B`` per adapted module;
- ``policy.lora_spec``: what the engine needs to merge them (rank, alpha, adapted modules), carried in the policy
  config (models/build.py ``policy_config``);
- ``merged_state_dict``: W + (alpha / r) B A for every adapted weight and the rest as is: the plain model a checkpoint
  saves.

The engine's side is ``LoraMerger``: it keeps the base of every adapted weight unmerged and serves base + delta, so
repeated syncs never accumulate. ``merge_weight`` is the one formula both sides use.

``AdapterSnapshot`` runs the policy under frozen copies of its adapters: a LoRA policy's KL reference without a second
model (before any copy is taken later, B = 0: exactly the base model).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from sandforge.config import LoraConfig

ADAPTER = "default"  # peft's name for an adapter; a policy has one


def add_lora(policy: nn.Module, lora: LoraConfig) -> nn.Module:
    """Inject trainable adapters into ``policy`` (an ``HFPolicy``) in place; every other weight is frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    layers = None
    if lora.top_layers is not None:
        depth = policy.hf_config.get_text_config().num_hidden_layers
        if lora.top_layers > depth:
            raise ValueError(f"'model.lora.top_layers' = {lora.top_layers}, but this model has {depth} layers")
        layers = list(range(depth - lora.top_layers, depth))
    config = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                            lora_dropout=lora.dropout, layers_to_transform=layers)
    try:
        inject_adapter_in_model(config, policy.model)
    except ValueError as e:  # peft: no module matched
        names = sorted({n.rsplit(".", 1)[-1] for n, m in policy.model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"'model.lora.target_modules' = {list(lora.target_modules)} names no linear layer of this "
                         f"model ({e}); its linear layers are named {', '.join(names)}") from None
    layers = lora_layers(policy)
    _refuse_tied(policy, layers)
    for name, p in policy.named_parameters():
        p.requires_grad_(".lora_" in name)
    policy.lora_spec = {"r": lora.r, "alpha": lora.alpha, "targets": sorted(layers)}
    if lora.fused:
        from .lora_fused import fuse_lora

        fuse_lora(policy)
    return policy


def lora_layers(policy: nn.Module) -> dict[str, nn.Module]:
    """The adapted modules by their name in ``policy``."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in policy.named_modules() if isinstance(m, LoraLayer)}


def _refuse_tied(policy: nn.Module, layers: dict[str, nn.Module]) -> None:
    """A weight shared with another module (tied embeddings) cannot take a merged adapter: merging changes both."""
    names: dict[int, list[str]] = {}
    for name, p in policy.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for name, layer in layers.items():
        shared = names[id(layer.base_layer.weight)]
        if len(shared) > 1:
            raise ValueError(f"'model.lora.target_modules': {name.rsplit('.', 1)[-1]} shares its weight with "
                             f"{', '.join(n for n in shared if not n.startswith(name + '.'))} (tied embeddings), so "
                             "its adapter cannot be merged for serving; leave it out of target_modules")


def adapter_weights(policy: nn.Module) -> dict[str, Tensor]:
    """The adapters, ``<module>.lora_A`` [r, in] and ``<module>.lora_B`` [out, r] (the live parameters, not copies)."""
    out = {}
    for name, layer in lora_layers(policy).items():
        out[f"{name}.lora_A"] = layer.lora_A[ADAPTER].weight
        out[f"{name}.lora_B"] = layer.lora_B[ADAPTER].weight
    return out


def _parameter_name(key: str) -> str:
    """``<module>.lora_A`` -> the parameter's name in the peft-injected policy."""
    return f"{key}.{ADAPTER}.weight"


def merge_weight(base: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """W + scaling B A, computed in the base weight's dtype and device."""
    return base + (b.to(base) @ a.to(base)) * scaling


@torch.no_grad()
def merged_state_dict(policy: nn.Module) -> dict[str, Tensor]:
    """The state dict of the plain policy (no peft layers) that computes what the adapted ``policy`` computes."""
    layers = lora_layers(policy)
    out = {}
    for key, value in policy.state_dict().items():
        if ".lora_" in key:
            continue
        module, dot, leaf = key.rpartition(".base_layer.")
        if dot and leaf == "weight":
            layer = layers[module]
            value = merge_weight(value, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight,
                                 layer.scaling[ADAPTER])
        out[key.replace(".base_layer.", ".")] = value
    return out


def save_merged(policy: nn.Module, directory: str | Path) -> None:
    """Save the adapted ``policy`` (an ``HFPolicy``) as the plain Hugging Face model it amounts to."""
    merged = {k.removeprefix("model."): v for k, v in merged_state_dict(policy).items()}  # the HF model's own names
    policy.model.save_pretrained(str(directory), state_dict=merged)


class LoraMerger:
    """The engine's side of a LoRA sync: the base of every adapted weight of ``model`` (a plain policy built like the
    trainer's), kept as it was loaded, and the merged weights for each set of adapters the trainer sends."""

    def __init__(self, model: nn.Module, spec: dict):
        self.rank, self.scaling = int(spec["r"]), spec["alpha"] / spec["r"]  # as peft scales: lora_alpha / r
        self.base: dict[str, Tensor] = {}
        self.shapes: dict[str, tuple[int, int]] = {}
        for name in spec["targets"]:
            try:
                weight = model.get_submodule(name).weight
            except AttributeError:
                raise ValueError(f"the trainer adapts {name}, which this engine's model does not have: the trainer and "
                                 "the engine must be built from the same model") from None
            self.base[f"{name}.weight"] = weight.detach().clone()
            out_features, in_features = weight.shape
            self.shapes[f"{name}.lora_A"] = (self.rank, in_features)
            self.shapes[f"{name}.lora_B"] = (out_features, self.rank)

    def template(self) -> dict[str, Tensor]:
        """What a sync carries, as the weight channel's receiving template (fp32, as the trainer sends it)."""
        return {k: torch.empty(shape, dtype=torch.float32) for k, shape in self.shapes.items()}

    @torch.no_grad()
    def merged(self, adapters: dict[str, Tensor]) -> dict[str, Tensor]:
        """base + scaling B A for every adapted weight, from the trainer's ``adapter_weights``."""
        if adapters.keys() != self.shapes.keys():
            odd = sorted(adapters.keys() ^ self.shapes.keys())
            raise ValueError(f"LoRA sync: {len(odd)} adapter name(s) differ from what the trainer announced (first: "
                             f"{odd[0]}); the trainer and the engine must be built from the same model config")
        return {key: merge_weight(base, adapters[key.removesuffix(".weight") + ".lora_A"],
                                  adapters[key.removesuffix(".weight") + ".lora_B"], self.scaling)
                for key, base in self.base.items()}


class AdapterSnapshot:
    """``policy`` (adapted) run with frozen copies of its adapters: the KL reference of a LoRA policy. A call runs the
    policy in eval mode (no adapter dropout) with the copies in place of the live adapters for that call only
    (``torch.func.functional_call``), so the live ones, and any autograd graph built on them, are untouched."""

    def __init__(self, policy: nn.Module):
        self.policy = policy
        self.take()

    def take(self) -> None:
        """The policy's current adapters become the reference."""
        self.adapters = {k: v.detach().clone() for k, v in adapter_weights(self.policy).items()}

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.adapters)

    def load_state_dict(self, adapters: dict[str, Tensor]) -> None:
        if adapters.keys() != self.adapters.keys():
            raise ValueError(f"reference adapters: {len(adapters)} tensors where this policy has {len(self.adapters)} "
                             "(a checkpoint of a different model.lora?)")
        self.adapters = {k: v.to(self.adapters[k]).clone() for k, v in adapters.items()}

    def __call__(self, *args, **kwargs):
        from torch.func import functional_call

        training = self.policy.training
        self.policy.eval()
        try:
            params = {_parameter_name(k): v for k, v in self.adapters.items()}
            return functional_call(self.policy, params, args, kwargs)
        finally:
            self.policy.train(training)
