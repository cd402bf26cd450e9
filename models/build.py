"""Building, loading and saving policies by architecture: the K3-shaped model (``"k3"``, a preset size plus optional
field overrides) or a local Hugging Face causal LM (``"hf"``, from ``model.path``).

The trainer, the engine and the rollout workers build, load and save policies and their chat formats only through these
functions, so a checkpoint directory says what it holds (``config.json`` carries ``arch``, or HF's ``model_type``) and
all sides agree on it.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from sandforge.config import ModelConfig

from .k3 import model as k3
from .k3.config import preset_config
from .k3.latent_moe import LatentMoE, update_all_biases

ARCHES = ("k3", "hf")


def _hf_policy(path: str | Path) -> nn.Module:
    from .hf import HFPolicy

    policy = HFPolicy.from_pretrained(str(path))
    policy.source_path = str(path)  # the engine rebuilds the same architecture from here, then takes our weights
    return policy


def build_policy(model: ModelConfig, vocab_size: int) -> nn.Module:
    """A fresh policy as the config's ``model`` section describes it (for ``hf``: the local model at ``path``)."""
    if model.arch == "hf":
        return _hf_policy(model.path)
    return k3.K3Model(preset_config(model.preset, model.k3, vocab_size))


def trainable_policy(model: ModelConfig, vocab_size: int) -> nn.Module:
    """The policy a trainer rank trains: built from the ``model`` section, or loaded from ``model.init_from``, with LoRA
    adapters (models/lora.py) when ``model.lora`` is set."""
    policy = load_policy(model.init_from) if model.init_from else build_policy(model, vocab_size)
    if model.lora is not None:
        from .lora import add_lora

        add_lora(policy, model.lora)
    return policy


def policy_config(model: nn.Module) -> dict:
    """The model's config as plain data, with its ``arch``: enough for ``policy_from_config`` to rebuild it. An adapted
    policy adds its ``lora`` spec: the engine builds the plain model and merges the adapters each sync sends."""
    if hasattr(model, "source_path"):
        lora = getattr(model, "lora_spec", None)
        return {"arch": "hf", "path": model.source_path} | ({"lora": lora} if lora else {})
    return model.config.to_dict()  # K3Config.to_dict carries arch "k3"


def policy_from_config(config: dict) -> nn.Module:
    config = dict(config)
    arch = config.pop("arch", "k3")
    if arch == "hf":
        return _hf_policy(config["path"])
    if arch == "k3":
        return k3.K3Model(k3.K3Config.from_dict(config))
    raise ValueError(f"unknown model.arch {arch!r}; known: {', '.join(ARCHES)}")


def load_policy(directory: str | Path) -> nn.Module:
    """A checkpoint written by ``save_policy``: a K3 directory, or a Hugging Face one."""
    config_file = Path(directory) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if "model_type" in config:  # written by Hugging Face
        return _hf_policy(directory)
    return k3.from_pretrained(directory)


def save_policy(model: nn.Module, directory: str | Path, tokenizer=None, state_dict: dict | None = None) -> Path:
    """``state_dict`` replaces the model's own (K3 only): the whole model when the model holds one rank's experts. An
    adapted (LoRA) policy is saved merged, as the plain Hugging Face model it amounts to."""
    if hasattr(model, "source_path"):
        if getattr(model, "lora_spec", None):
            from .lora import save_merged

            save_merged(model, directory)
        else:
            model.save_pretrained(str(directory))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
        return Path(directory)
    return k3.save_pretrained(model, directory, tokenizer=tokenizer, state_dict=state_dict)


def after_optimizer_step(model: nn.Module, all_reduce=None) -> dict[str, float]:
    """Per-step model upkeep: LatentMoE selection biases from this step's routing (summed over ranks first)."""
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    if not moes:
        return {}
    if all_reduce is not None:
        for moe in moes:
            moe.reduce_stats(all_reduce)
    return {k: v for k, v in update_all_biases(model).items() if k.count("/") == 1}  # the summary, not every layer


def load_chat(model: ModelConfig):
    """The chat format (and through ``.tokenizer`` the tokenizer) of the policy the ``model`` section describes; a
    checkpoint in ``init_from`` brings its own tokenizer."""
    source = model.init_from
    if model.arch == "hf":
        from transformers import AutoTokenizer

        from .hf_chat import HFChatFormat

        tokenizer = AutoTokenizer.from_pretrained(str(source or model.path), local_files_only=True)
        template = Path(model.chat_template).read_text() if model.chat_template else None
        return HFChatFormat(tokenizer, parser=model.parser, tool_format=model.tool_format, chat_template=template)
    from .bpe import load_tokenizer
    from .chat import ChatFormat

    return ChatFormat(load_tokenizer(str(source) if source else model.tokenizer))
