"""Which architecture a job trains, by name: the small MoE decoder of #2 (``"moe"``), the K3 model (``"k3"``), or a
local Hugging Face causal LM (``"hf"``, from ``model.path``).

The trainer, the engine and the rollout workers build, load and save policies and their chat formats only through these
functions, so a checkpoint directory says what it holds (``config.json`` carries ``arch``, or HF's ``model_type``) and
all sides agree on it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from torch import nn

from .k3 import model as k3
from .k3.latent_moe import LatentMoE, update_all_biases
from .moe_lm import MoEConfig, MoETransformer
from .moe_lm import load_pretrained as load_moe
from .moe_lm import save_pretrained as save_moe

ARCHES = ("moe", "k3", "hf")


def _hf_policy(path: str | Path) -> nn.Module:
    from .hf import HFPolicy

    policy = HFPolicy.from_pretrained(str(path))
    policy.source_path = str(path)  # the engine rebuilds the same architecture from here, then takes our weights
    return policy


def build_policy(options: dict, vocab_size: int) -> nn.Module:
    """A fresh policy (for ``hf``: the local model at ``path``). ``options``: the config's ``model`` section."""
    arch = options.get("arch", "moe")
    if arch == "hf":
        return _hf_policy(options["path"])
    if arch == "k3":
        preset = options.get("preset", "k3-nano")
        if preset not in k3.PRESETS:
            raise ValueError(f"unknown K3 preset {preset!r}; known: {', '.join(k3.PRESETS)}")
        return k3.K3Model(replace(k3.PRESETS[preset], vocab_size=vocab_size))
    if arch == "moe":
        sizes = {k: v for k, v in options.items() if k in MoEConfig.__dataclass_fields__}
        return MoETransformer(MoEConfig(**{**sizes, "vocab_size": vocab_size}))
    raise ValueError(f"unknown model.arch {arch!r}; known: {', '.join(ARCHES)}")


def policy_config(model: nn.Module) -> dict:
    """The model's config as plain data, with its ``arch``: enough for ``policy_from_config`` to rebuild it."""
    if hasattr(model, "source_path"):
        return {"arch": "hf", "path": model.source_path}
    return {"arch": "k3" if isinstance(model, k3.K3Model) else "moe", **model.config.to_dict()}


def policy_from_config(config: dict) -> nn.Module:
    config = dict(config)
    arch = config.pop("arch", "moe")
    if arch == "hf":
        return _hf_policy(config["path"])
    if arch == "k3":
        return k3.K3Model(k3.K3Config.from_dict(config))
    return MoETransformer(MoEConfig.from_dict(config))


def load_policy(directory: str | Path) -> nn.Module:
    """A checkpoint written by ``save_policy`` (or either architecture's own ``save_pretrained``)."""
    config_file = Path(directory) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if "model_type" in config:  # written by Hugging Face
        return _hf_policy(directory)
    return k3.from_pretrained(directory) if config.get("arch") == "k3" else load_moe(directory)


def save_policy(model: nn.Module, directory: str | Path, tokenizer=None) -> Path:
    if hasattr(model, "source_path"):
        model.save_pretrained(str(directory))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
        return Path(directory)
    if isinstance(model, k3.K3Model):
        return k3.save_pretrained(model, directory, tokenizer=tokenizer)
    return save_moe(model, directory, tokenizer=tokenizer)


def after_optimizer_step(model: nn.Module, all_reduce=None) -> dict[str, float]:
    """Per-step model upkeep: LatentMoE selection biases from this step's routing (summed over ranks first)."""
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    if not moes:
        return {}
    if all_reduce is not None:
        for moe in moes:
            moe.reduce_stats(all_reduce)
    return {k: v for k, v in update_all_biases(model).items() if k.count("/") == 1}  # the summary, not every layer


def load_chat(options: dict):
    """The chat format (and through ``.tokenizer`` the tokenizer) of the policy ``options`` describe.

    ``options`` is the config's ``model`` section; a checkpoint in ``init_from`` brings its own tokenizer.
    """
    source = options.get("init_from") or None
    if options.get("arch") == "hf":
        from transformers import AutoTokenizer

        from .hf import HFChatFormat

        tokenizer = AutoTokenizer.from_pretrained(str(source or options["path"]), local_files_only=True)
        return HFChatFormat(tokenizer, parser=options.get("parser", "hermes"))
    from .bpe import load_tokenizer
    from .chat import ChatFormat

    return ChatFormat(load_tokenizer(str(source) if source else options.get("tokenizer", "bpe")))
