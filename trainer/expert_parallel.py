"""Expert parallelism inside DeepSpeed (``trainer.expert_parallel`` = E_p > 1).

World W = E_p × D_e. DeepSpeed's groups (``deepspeed.utils.groups``, named ``ep_size_<E_p>``) split it two ways:
expert-parallel groups of E_p consecutive ranks, holding all n experts between them (n/E_p per rank, tokens moved by
all-to-all), and expert-data-parallel groups of the D_e ranks that hold the same experts. Dense parameters (router,
attention, W_down/W_up, shared experts) are replicated over all W ranks as before.

DeepSpeed's own MoE bookkeeping then does the rest, once it knows: expert parameters carry ``allreduce = False`` and
``group_name``, go into their own optimizer groups (``split_params_into_different_moe_groups_for_optimizer``), are
broadcast at start-up only within their expert-data-parallel group, and ZeRO-1/2 partitions and reduces them over that
group instead of the world. Gradients keep the world's scale: DeepSpeed divides expert gradients by W, not by D_e, and
each expert's gradient already sums the tokens of its whole expert-parallel group, so the token-mean loss scaling in
``TrainerRank.train_step`` stays exact. ZeRO-2's global gradient norm sums every expert's partition exactly once.

DeepSpeed recognises only its own MoE layer classes, so ``ExpertParallelEngine`` tells it that this model has MoE
layers (before the optimizer is built, which is when it matters) and keeps checkpoints whole: each expert-parallel
rank's experts go to their own file beside DeepSpeed's, and loading puts each rank's own experts back.

Only ZeRO stages 1 and 2 combine with it (``sandforge.config.EXPERT_PARALLEL_ZERO_STAGES``, docs/trainer.md "Expert
parallelism"). Without ZeRO, DeepSpeed clips gradients by the mean of each rank's own gradient norm
(``deepspeed.runtime.utils.clip_grad_norm_``), which is not the model's norm once ranks hold different experts. ZeRO-3
gathers and reduce-scatters each parameter from hooks that fire when the parameter is used, so ranks whose tokens chose
different experts issue different collectives and hang; DeepSpeed rejects its own MoE layers with stage 3 for that
reason.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from sandforge.models.k3.expert_parallel import shard_experts
from sandforge.models.k3.latent_moe import LatentMoE


def group_name(expert_parallel: int) -> str:
    return f"ep_size_{expert_parallel}"  # DeepSpeed's name for the groups of this size


def shard_model(model: nn.Module, expert_parallel: int) -> None:
    """Create DeepSpeed's expert groups (every rank must call this); keep this rank's experts, marked for DeepSpeed."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    if not moes:
        raise ValueError(f"trainer.expert_parallel={expert_parallel} needs LatentMoE layers (model.arch k3)")
    world = dist.get_world_size()
    if world % expert_parallel:
        raise ValueError(f"trainer.expert_parallel={expert_parallel} must divide trainer.world_size={world}")
    name = group_name(expert_parallel)
    groups._create_expert_and_data_parallel(expert_parallel)
    for p in shard_experts(model, groups._get_expert_parallel_group(name)):
        p.allreduce, p.group_name = False, name  # what deepspeed.moe.utils.is_moe_param looks for


def optimizer_groups(model: nn.Module) -> list[dict]:
    """Dense parameters in one group, each expert-data-parallel group's experts in their own (``moe: True``)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    params = [p for p in model.parameters() if p.requires_grad]
    return split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense"})


def expert_prefixes(model: nn.Module) -> tuple[str, ...]:
    """``layers.1.ffn.experts.`` for every sharded LatentMoE: the state-dict keys that differ between ranks start so."""
    return tuple(f"{n}.experts." for n, m in model.named_modules() if isinstance(m, LatentMoE) and m.ep is not None)


def _engine_class(expert_group: str):
    from deepspeed.runtime.engine import DeepSpeedEngine

    class ExpertParallelEngine(DeepSpeedEngine):
        """DeepSpeed's engine for a model whose LatentMoE layers are sharded by ``shard_model``."""

        expert_group: str

        def _configure_distributed_model(self, model):
            super()._configure_distributed_model(model)
            # DeepSpeed looks for its own MoE classes here; the optimizer, ZeRO and gradient reduction read this flag
            self.has_moe_layers = True
            self.num_experts = [m.n_experts for m in self.module.modules() if isinstance(m, LatentMoE)]

        def _expert_file(self, directory: str, tag: str) -> str:
            from deepspeed.utils import groups

            ep_rank = groups._get_expert_parallel_rank(self.expert_group)
            return os.path.join(directory, str(tag), f"expert_states_ep_rank_{ep_rank:02d}.pt")

        def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
            from deepspeed.utils import groups

            tag = f"global_step{self.global_steps}" if tag is None else tag
            saved = super().save_checkpoint(save_dir, tag, client_state=client_state or {}, save_latest=save_latest,
                                            **kwargs)
            if groups._get_expert_data_parallel_rank(self.expert_group) == 0:  # one writer per set of experts
                prefixes = expert_prefixes(self.module)
                experts = {k: v.detach().cpu() for k, v in self.module.state_dict().items() if k.startswith(prefixes)}
                torch.save(experts, self._expert_file(save_dir, tag))
            return saved

        def load_checkpoint(self, load_dir, tag=None, **kwargs):
            if tag is None:
                with open(os.path.join(load_dir, "latest")) as f:
                    tag = f.read().strip()
            self._expert_source = self._expert_file(load_dir, tag)
            try:
                return super().load_checkpoint(load_dir, tag, **kwargs)
            finally:
                del self._expert_source

        def load_module_state_dict(self, checkpoint, *args, **kwargs):
            if not hasattr(self, "_expert_source"):  # not from load_checkpoint: nothing to swap
                return super().load_module_state_dict(checkpoint, *args, **kwargs)
            # DeepSpeed's module file is the one of data-parallel rank 0: swap in this rank's experts
            prefixes = expert_prefixes(self.module)
            module = {k: v for k, v in checkpoint["module"].items() if not k.startswith(prefixes)}
            module.update(torch.load(self._expert_source, map_location="cpu", weights_only=True))
            return super().load_module_state_dict({**checkpoint, "module": module}, *args, **kwargs)

    ExpertParallelEngine.expert_group = expert_group
    return ExpertParallelEngine


def initialize(model: nn.Module, optimizer, ds_config: dict, expert_parallel: int):
    """``deepspeed.initialize`` for a model already passed through ``shard_model``: (engine, optimizer)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from sandforge.config import EXPERT_PARALLEL_ZERO_STAGES

    stage = ds_config["zero_optimization"]["stage"]
    if stage not in EXPERT_PARALLEL_ZERO_STAGES:
        raise ValueError(f"trainer.expert_parallel={expert_parallel} needs trainer.zero_stage 1 or 2, not {stage}")

    engine_class = _engine_class(group_name(expert_parallel))
    engine = engine_class(None, model, optimizer=optimizer, config=ds_config, config_class=DeepSpeedConfig(ds_config))
    return engine, engine.optimizer
