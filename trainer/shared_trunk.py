"""The KL reference's forward, resumed from the policy's own frozen trunk.

A LoRA policy with adapters on its top layers only (``model.lora.top_layers``) and its reference (the same policy under
a frozen copy of the adapters, models/lora.py ``AdapterSnapshot``) share every layer below the first adapted one: the
same frozen weights, fed the same tokens. The hidden states entering that layer are therefore the same in both
forwards of a micro-batch, and the reference takes them from the policy's forward (``capture``) instead of computing
the trunk again (``resumed``): with SmolLM2's adapters on 10 of 30 layers, two thirds of the reference's layers. Its
log-probs are the full forward's (tests/test_shared_trunk.py ties the two); ``trainer.reference_forward: full`` runs
the reference whole, the naive path.

It is used only where the two forwards provably compute the same trunk (``find_trunk``): a Hugging Face policy whose
decoder layers are found, adapters above layer 0, no dropout in the trunk (the policy's forward runs in train mode,
the reference's in eval), and no routing forced on the policy's forward (``trainer.routing_replay``: the reference
routes freely). Elsewhere the reference runs whole.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from torch import Tensor, nn


@dataclass
class Trunk:
    """The decoder layers of a policy, and the first one its adapters change; ``hidden``: what entered that layer in
    the last captured forward (detached)."""

    layers: nn.ModuleList
    first: int
    hidden: Tensor | None = field(default=None, repr=False)


def _dropout(policy: nn.Module, trunk: list[nn.Module]) -> bool:
    """Whether anything in the trunk drops out in train mode: an ``nn.Dropout`` with p > 0, or a config dropout rate
    (transformers' attention applies ``attention_dropout`` functionally)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for layer in trunk for m in layer.modules()):
        return True
    config = getattr(policy, "hf_config", None)
    if config is None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(isinstance(v, float) and v > 0 for k, v in vars(text).items() if "dropout" in k)


def find_trunk(policy: nn.Module) -> Trunk | None:
    """The policy's shared trunk, or None where the reference must run whole (see the module docstring)."""
    config = getattr(policy, "hf_config", None)
    if config is None or getattr(policy, "lora_spec", None) is None:
        return None
    depth = config.get_text_config().num_hidden_layers
    lists = [(name, m) for name, m in policy.named_modules()
             if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(m) == depth]
    if len(lists) != 1:
        return None
    name, layers = lists[0]
    prefix, targets = name + ".", policy.lora_spec["targets"]
    if not targets or not all(t.startswith(prefix) for t in targets):  # an adapter outside the decoder layers
        return None
    first = min(int(t[len(prefix):].split(".", 1)[0]) for t in targets)
    if first == 0 or _dropout(policy, list(layers[:first])):
        return None
    return Trunk(layers, first)


def _hidden_argument(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


@contextmanager
def capture(trunk: Trunk | None) -> Iterator[None]:
    """Within it, a forward of the policy records what enters its first adapted layer as ``trunk.hidden``."""
    if trunk is None:
        yield
        return
    trunk.hidden = None

    def record(module, args, kwargs):
        trunk.hidden = _hidden_argument(args, kwargs).detach()

    handle = trunk.layers[trunk.first].register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def resumed(trunk: Trunk) -> Iterator[None]:
    """Within it, a forward of the policy (or of its reference) skips the trunk: its layers pass their input through,
    and the last of them hands the first adapted layer the hidden states ``capture`` recorded. The forward must be of
    the same tokens as the captured one (the shapes are checked)."""
    captured = trunk.hidden
    if captured is None:
        raise RuntimeError("resumed: no policy forward was captured for this micro-batch")
    last = trunk.first - 1

    def passthrough(index: int):
        def forward(*args, **kwargs):
            hidden = _hidden_argument(args, kwargs)
            if index < last:
                return hidden
            if hidden.shape != captured.shape:
                raise RuntimeError(f"resumed: the captured trunk's hidden states are {tuple(captured.shape)}, this "
                                   f"forward's {tuple(hidden.shape)}: not the same micro-batch")
            return captured.to(hidden.dtype)
        return forward

    patched = list(trunk.layers[: trunk.first])
    for i, layer in enumerate(patched):
        layer.forward = passthrough(i)
    try:
        yield
    finally:
        for layer in patched:
            del layer.forward  # the class's forward again
