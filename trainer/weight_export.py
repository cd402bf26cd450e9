"""What a trainer rank gives out of its policy: the weights the engine needs (through Ray's object store, the weight
channel, or handles to the rank's own tensors for an engine sharing its GPU), and the standalone policy it writes to
disk (a checkpoint's policy/, what a remote inference server loads after each step).

With expert parallelism or ZeRO-3 no rank holds the whole model: building it is a collective, so every rank takes part
in ``weights``, ``send`` and ``save_policy`` together.
"""

from __future__ import annotations

import contextlib

import torch


class WeightExport:
    """Rank ``rank``'s view of the policy ``module`` (the DeepSpeed engine's) for export. ``lora``: only the adapters
    train, and only they travel to the engine; ``expert_parallel``: the rank holds 1/expert_parallel of the experts;
    ``zero3``: its parameters are partitioned over the ranks; ``tokenizer``: saved beside the policy."""

    def __init__(self, module: torch.nn.Module, rank: int, tokenizer, lora: bool, expert_parallel: int, zero3: bool):
        self.module, self.rank, self.tokenizer = module, rank, tokenizer
        self.lora, self.expert_parallel, self.zero3 = lora, expert_parallel, zero3
        # building the whole model is a collective: every rank must call weights / save_policy together
        self.gathers = expert_parallel > 1 or zero3
        self.channel = None  # rank 0's end of the collective weight sync, once opened

    def full_parameters(self):
        """A context in which the module's parameters are whole (ZeRO-3 gathers them: a collective, on every rank)."""
        if not self.zero3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)

    def weights(self) -> dict[str, torch.Tensor]:
        """What the engine needs of the policy, on CPU, in fp32 as the engine holds it (bf16 training keeps bf16
        copies): the whole policy's weights, or with LoRA only the adapters (models/lora.py ``adapter_weights``; the
        engine merges them into its base). With expert parallelism every rank must call it: experts are gathered."""
        if self.lora:
            from sandforge.models.lora import adapter_weights

            weights = {k: v.detach().to("cpu", copy=True) for k, v in adapter_weights(self.module).items()}
        elif self.expert_parallel > 1:
            from sandforge.models.k3.expert_parallel import full_state_dict

            weights = full_state_dict(self.module)
        else:
            with self.full_parameters():
                weights = {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        return {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}

    def share(self) -> bytes:
        """Handles to the policy's own tensors (LoRA: its adapters) for an engine on this rank's device to copy from
        (models/shared_weights.py, ``trainer.weight_sync: colocated``); the engine casts them to its dtype. Not with
        expert parallelism or ZeRO-3, where rank 0 does not hold the whole model."""
        from sandforge.models.shared_weights import share

        if self.gathers:
            raise ValueError("weight_sync colocated needs the whole model on rank 0; with expert_parallel > 1 or "
                             "zero_stage 3 it is spread over the ranks (use weight_sync collective)")
        if self.lora:
            from sandforge.models.lora import adapter_weights

            return share(adapter_weights(self.module))
        return share(self.module.state_dict())

    def open_channel(self, host: str, port: int) -> None:
        """Rank 0's end of the collective weight sync (models/weight_channel.py); the engine opens the other end."""
        from sandforge.models.weight_channel import WeightChannel

        self.channel = WeightChannel(host, port, rank=0)

    def send(self, version: int) -> int:
        """Broadcast the policy to the engine over the weight channel (every rank calls it: with expert parallelism or
        ZeRO-3 the whole model is gathered first; rank 0 sends)."""
        weights = self.weights()
        return self.channel.send(weights, version) if self.rank == 0 else version

    def save_policy(self, directory: str) -> str:
        """The standalone policy (config.json + safetensors, merged with LoRA), written by rank 0. With expert
        parallelism or ZeRO-3 a collective: every rank takes part."""
        from sandforge.models.build import save_policy

        whole = self.weights() if self.gathers or self.rank == 0 else None
        with self.full_parameters():  # a Hugging Face policy saves its own (gathered) parameters
            if self.rank == 0:
                save_policy(self.module, directory, tokenizer=self.tokenizer, state_dict=whole)
        return directory
