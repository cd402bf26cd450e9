"""What a trainer rank's checkpoint keeps beside DeepSpeed's own state (this rank's RNGs, its step counts, the lr
schedule's position, the PPO value head, which lives outside DeepSpeed), and the frozen KL reference restored from a
policy directory on resume."""

from __future__ import annotations

from pathlib import Path

import torch

ADAPTERS_FILE = "adapters.safetensors"  # a LoRA checkpoint's adapters, beside its merged policy/


def extra_state(rank) -> dict:
    return {"torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if rank.device.type == "cuda" else None,
            "steps": rank.steps,
            "rl_updates": rank.rl_updates,
            "value_head": rank.value_head.state_dict() if rank.value_head is not None else None,
            "value_optimizer": rank.value_optimizer.state_dict() if rank.value_optimizer else None}


def restore_extra_state(rank, extra: dict) -> None:
    torch.set_rng_state(extra["torch_rng"])
    if extra["cuda_rng"] is not None and rank.device.type == "cuda":
        torch.cuda.set_rng_state(extra["cuda_rng"])
    rank.steps = extra["steps"]
    rank.rl_updates = extra.get("rl_updates", 0)
    if rank.value_head is not None and extra["value_head"] is not None:
        rank.value_head.load_state_dict(extra["value_head"])
        rank.value_optimizer.load_state_dict(extra["value_optimizer"])


def load_reference(rank, reference: str) -> None:
    """The KL reference from the policy directory ``reference`` (LoRA: from the adapters saved beside it)."""
    from sandforge.models.build import load_policy

    if rank.lora:
        adapters = Path(reference).parent / ADAPTERS_FILE
        if not adapters.is_file():
            raise FileNotFoundError(f"no {adapters}: the KL reference of a model.lora run is the adapters saved "
                                    "beside its step-0 policy; that checkpoint was not written with model.lora")
        from safetensors.torch import load_file

        rank.reference.load_state_dict(load_file(str(adapters)))
        return
    ref = load_policy(reference)
    if rank.expert_parallel > 1:  # keep this rank's experts, as the live reference does
        from sandforge.trainer.expert_parallel import shard_model

        shard_model(ref, rank.expert_parallel)
    device = next(rank.reference.parameters()).device
    rank.reference.load_state_dict({k: v.to(device) for k, v in ref.state_dict().items()})
