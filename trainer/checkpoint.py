"""A trainer rank's share of a checkpoint, and the frozen KL reference restored on resume.

A checkpoint ``<directory>/<tag>/`` holds DeepSpeed's own state from every rank (weights, balancing biases, optimizer;
with LoRA no frozen base: the config rebuilds it), ``trainer_rank_<r>.pt`` per rank with what lives beside DeepSpeed
(its RNGs, step counts, where the lr schedule stands, the PPO value head and its optimizer), and from rank 0 the
standalone policy ``policy/`` (trainer/weight_export.py), merged with LoRA, whose adapters go beside it
(``adapters.safetensors``: a later resume's KL reference when this is step 0).
"""

from __future__ import annotations

from pathlib import Path

import torch

from sandforge.trainer.weight_export import WeightExport

ADAPTERS_FILE = "adapters.safetensors"  # a LoRA checkpoint's adapters, beside its merged policy/


class RankCheckpoint:
    """Saves and restores rank ``rank``'s checkpoint state: its DeepSpeed ``engine``, the policy ``export`` writes,
    and the state outside DeepSpeed (``value_head``, ``value_optimizer``: PPO's critic, None without one; the RNGs,
    ``cuda``'s too on a GPU rank)."""

    def __init__(self, engine, export: WeightExport, rank: int, lora: bool, cuda: bool,
                 value_head: torch.nn.Module | None = None, value_optimizer: torch.optim.Optimizer | None = None):
        self.engine, self.export, self.rank, self.lora, self.cuda = engine, export, rank, lora, cuda
        self.value_head, self.value_optimizer = value_head, value_optimizer

    def save(self, directory: str, tag: str, client_state: dict, steps: int, rl_updates: int) -> str:
        """Write this rank's share (every rank calls it: DeepSpeed's save, and with expert parallelism or ZeRO-3 the
        policy's, are collectives); returns the policy directory. ``steps``, ``rl_updates``: the rank's optimizer
        steps and RL ones, restored by ``load``."""
        self.engine.save_checkpoint(directory, tag=tag, client_state=client_state,
                                    exclude_frozen_parameters=self.lora)
        where = Path(directory) / tag
        if self.lora and self.rank == 0:
            from safetensors.torch import save_file

            save_file(self.export.weights(), str(where / ADAPTERS_FILE))
        policy_dir = self.export.save_policy(str(where / "policy"))
        torch.save(self._side_state(steps, rl_updates), where / f"trainer_rank_{self.rank}.pt")
        return policy_dir

    def load(self, directory: str, tag: str) -> tuple[dict, int, int]:
        """Restore what ``save`` wrote (weights, balancing biases, optimizer, RNGs, value head): (the client state,
        steps, rl_updates)."""
        if not (Path(directory) / tag).is_dir():
            raise FileNotFoundError(f"no checkpoint {tag!r} in {directory}")
        path, client_state = self.engine.load_checkpoint(directory, tag=tag, load_optimizer_states=True,
                                                         load_lr_scheduler_states=True,
                                                         load_module_strict=not self.lora)  # LoRA: no base saved
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint {tag!r} in {directory}")
        extra = torch.load(Path(directory) / tag / f"trainer_rank_{self.rank}.pt", weights_only=False)
        steps, rl_updates = self._restore_side_state(extra)
        return client_state or {}, steps, rl_updates

    def _side_state(self, steps: int, rl_updates: int) -> dict:
        return {"torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state() if self.cuda else None,
                "steps": steps,
                "rl_updates": rl_updates,
                "value_head": self.value_head.state_dict() if self.value_head is not None else None,
                "value_optimizer": self.value_optimizer.state_dict() if self.value_optimizer else None}

    def _restore_side_state(self, extra: dict) -> tuple[int, int]:
        torch.set_rng_state(extra["torch_rng"])
        if extra["cuda_rng"] is not None and self.cuda:
            torch.cuda.set_rng_state(extra["cuda_rng"])
        if self.value_head is not None and extra["value_head"] is not None:
            self.value_head.load_state_dict(extra["value_head"])
            self.value_optimizer.load_state_dict(extra["value_optimizer"])
        return extra["steps"], extra.get("rl_updates", 0)  # older checkpoints kept no rl_updates


def load_reference(reference, policy_dir: str, lora: bool, expert_parallel: int) -> None:
    """Load the KL reference ``reference`` from the policy directory ``policy_dir`` (LoRA: ``reference`` is an
    ``AdapterSnapshot``, loaded from the adapters saved beside it; expert parallelism: this rank's experts only, as the
    live reference holds them)."""
    from sandforge.models.build import load_policy

    if lora:
        adapters = Path(policy_dir).parent / ADAPTERS_FILE
        if not adapters.is_file():
            raise FileNotFoundError(f"no {adapters}: the KL reference of a model.lora run is the adapters saved "
                                    "beside its step-0 policy; that checkpoint was not written with model.lora")
        from safetensors.torch import load_file

        reference.load_state_dict(load_file(str(adapters)))
        return
    ref = load_policy(policy_dir)
    if expert_parallel > 1:
        from sandforge.trainer.expert_parallel import shard_model

        shard_model(ref, expert_parallel)
    device = next(reference.parameters()).device
    reference.load_state_dict({k: v.to(device) for k, v in ref.state_dict().items()})
