"""One trainer rank: a Ray actor that owns a DeepSpeed engine over the policy.

N ranks form one torch.distributed group (gloo on CPU, NCCL on GPU: job/fleet/placement.py gives each CUDA rank a GPU of
its own, which it sees as cuda:0; its batches, reference model and value head live there too). Each rank receives its shard of the step's sequences, splits it
into exactly ``grad_accum_steps`` micro-batches (empty ones run a zero-weighted dummy so every rank does the same number
of backward passes), and DeepSpeed averages gradients across ranks and steps the optimizer at the boundary. The loss
itself (clipping, aggregation, KL, importance weights) lives in ``trainer/algorithms``; this file is plumbing. What
the rank gives the engine and writes as a policy is trainer/weight_export.py; its checkpoints, trainer/checkpoint.py.
"""

from __future__ import annotations

import copy
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from sandforge.config import ModelConfig, RolloutConfig, TrainerConfig
from sandforge.models.device import fast_bf16
from sandforge.models.lora import AdapterSnapshot
from sandforge.models.packing import PackedLayout
from sandforge.trainer.algorithms import MicroBatch, Stats, Totals, resolve, rl_objective, sft_objective
from sandforge.trainer.batches import DUMMY_ROW, forward_scores, pad_right, split_micro_batches, token_batch
from sandforge.trainer.checkpoint import RankCheckpoint, load_reference
from sandforge.trainer.routing_replay import RouterRecorder, mismatch_counts, mismatch_rate, routed_ids
from sandforge.trainer.shared_trunk import capture, find_trunk, resumed
from sandforge.trainer.weight_export import WeightExport
from sandforge.types import RowScores, TrainingRow


@dataclass(frozen=True)
class RolloutShape:
    """What the rollout fixes about the tokens the trainer scores."""

    temperature: float  # the engine sampled at it; the trainer scores under the same, or the ratio is off
    response_budget: int  # the most policy tokens an episode can have: Dr.GRPO's constant and DAPO's L_max

    @classmethod
    def of(cls, rollout: RolloutConfig) -> RolloutShape:
        budget = min(rollout.max_new_tokens * rollout.max_turns, rollout.max_context)
        return cls(rollout.temperature, budget)


def deepspeed_config(trainer: TrainerConfig, cuda: bool) -> dict:
    """DeepSpeed's config for the ``trainer`` section. bf16 (``trainer.bf16``; null: ``fast_bf16``) keeps fp32 master
    weights, gradients accumulated in fp32 and fp32 buffers (the LatentMoE biases); log-probs are taken from fp32
    logits."""
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,  # sequences are packed by us; DeepSpeed counts micro-steps only
        "gradient_accumulation_steps": trainer.grad_accum_steps,
        "gradient_clipping": trainer.grad_clip,
        "zero_optimization": {"stage": trainer.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if fast_bf16("cuda" if cuda else "cpu") if trainer.bf16 is None else trainer.bf16:
        ds_config["bf16"] = {"enabled": True}
    return ds_config


def reset_optimizer_state(optimizer) -> int:
    """Zero the state of ``optimizer`` and of the torch optimizer it wraps (DeepSpeed's ZeRO and bf16 optimizers hold
    it as ``.optimizer``, over their fp32 partitions). In place rather than cleared, so that whatever DeepSpeed holds
    of the state stays valid and its checkpoints keep their layout; a step count of 0 gives Adam's bias correction of
    a first step."""
    reset, seen = 0, set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if isinstance(optimizer, torch.optim.Optimizer):
            for state in optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value):
                        value.zero_()
                    elif isinstance(value, (int, float)):
                        state[key] = type(value)(0)
                reset += 1
        optimizer = getattr(optimizer, "optimizer", None)
    return reset


class TrainerRank:
    """``model``: the policy to build (or ``model.init_from`` to load); ``trainer``: the whole trainer section;
    ``shape``: what the rollout fixes about the scored tokens; ``device``: "cpu", or "cuda" when Ray placed the rank
    on a GPU (job/fleet/placement.py)."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model: ModelConfig,
                 trainer: TrainerConfig, shape: RolloutShape, seed: int = 0, num_threads: int = 1,
                 device: str = "cpu"):
        from sandforge.models.device import part_device, where

        self.device = part_device(device, f"trainer rank {rank}")
        self.where = where(device)
        cuda = self.device.type == "cuda"
        os.environ.update(
            DS_ACCELERATOR="cuda" if cuda else "cpu",
            RANK=str(rank),
            LOCAL_RANK="0" if cuda else str(rank),  # a CUDA rank sees only its own GPU
            WORLD_SIZE=str(world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        torch.set_num_threads(num_threads)
        import deepspeed

        from sandforge.models.build import load_chat, trainable_policy

        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        self.rank, self.world_size = rank, world_size
        self.cfg, self.temperature = trainer, shape.temperature
        torch.manual_seed(seed)  # identical initial weights on every rank
        self.tokenizer = load_chat(model).tokenizer
        # only the adapters train, and only they travel to the engine (never under ZeRO-3: sandforge/config_checks.py)
        self.lora = model.lora is not None
        policy = trainable_policy(model, len(self.tokenizer))
        if policy.config.vocab_size < len(self.tokenizer):
            raise ValueError(f"tokenizer {model.tokenizer_source()!r} has {len(self.tokenizer)} ids but the model only "
                             f"{policy.config.vocab_size}")

        self.expert_parallel = trainer.expert_parallel
        self.zero3 = trainer.zero_stage == 3  # parameters partitioned over ranks: forwards all-gather them
        if self.expert_parallel > 1:  # keep this rank's experts only; the reference copy shares the expert groups
            from sandforge.trainer.expert_parallel import optimizer_groups, shard_model

            shard_model(policy, self.expert_parallel)
        # frozen, for the KL metric/penalty. LoRA: the policy itself under a copy of its adapters, not a second model,
        # taken below once DeepSpeed has placed and cast the adapters
        self.reference = None if self.lora else copy.deepcopy(policy).eval().requires_grad_(False).to(self.device)
        if self.expert_parallel > 1:
            params = optimizer_groups(policy)
        else:
            params = [p for p in policy.parameters() if p.requires_grad] if self.lora else policy.parameters()
        optimizer = torch.optim.AdamW(params, lr=trainer.lr, weight_decay=trainer.weight_decay)
        ds_config = deepspeed_config(trainer, cuda)
        if self.expert_parallel > 1:
            from sandforge.trainer import expert_parallel

            self.engine, self.optimizer = expert_parallel.initialize(policy, optimizer, ds_config, self.expert_parallel)
        else:
            if self.zero3:  # an expert runs only on ranks whose tokens chose it: gather a MoE layer's experts together
                from deepspeed.utils import set_z3_leaf_modules

                from sandforge.models.k3.latent_moe import LatentMoE

                if any(isinstance(m, LatentMoE) for m in policy.modules()):
                    set_z3_leaf_modules(policy, [LatentMoE])
            self.engine, self.optimizer, _, _ = deepspeed.initialize(model=policy, optimizer=optimizer,
                                                                     config=ds_config)
        # the layers below the adapters: the reference's forward resumes from the policy's (trainer/shared_trunk.py)
        self.trunk = None
        if self.lora:
            self.reference = AdapterSnapshot(self.engine.module)
            if trainer.reference_forward == "shared_trunk":
                self.trunk = find_trunk(self.engine.module)
        elif "bf16" in ds_config:  # the reference scores in the policy's own precision, so KL measures training only
            self.reference.to(torch.bfloat16)
        self.settings = resolve(trainer, shape.response_budget)
        self.value_head = self.value_optimizer = None
        if self.settings.algorithm.value_head:  # PPO's critic: a linear head on the policy's last hidden state
            width = getattr(policy.config, "d_model", None) or policy.hf_config.hidden_size
            self.value_head = torch.nn.Linear(width, 1).to(self.device)
            torch.nn.init.zeros_(self.value_head.weight)  # V = 0 at first: GAE starts as discounted returns
            torch.nn.init.zeros_(self.value_head.bias)
            self.value_optimizer = torch.optim.AdamW(self.value_head.parameters(), lr=trainer.lr,
                                                     weight_decay=trainer.weight_decay)
        self.steps = 0
        self.rl_updates = 0  # RL optimizer steps taken: where the lr schedule stands (trainer/lr_schedule.py)
        self.export = WeightExport(self.engine.module, rank, self.tokenizer, self.lora, self.expert_parallel,
                                   self.zero3)
        self.gathers = self.export.gathers  # the model is spread over the ranks: exports and forwards are collectives
        self.checkpoint = RankCheckpoint(self.engine, self.export, rank, self.lora, cuda, self.value_head,
                                         self.value_optimizer)

    def reset_reference(self) -> None:
        """Make the current policy the KL reference (after a warm start, RL is measured from there). With ZeRO-3 or
        expert parallelism every rank must call it."""
        if self.lora:
            self.reference.take()
            return
        if self.expert_parallel > 1:  # the reference holds this rank's experts, as the policy does
            self.reference.load_state_dict(self.engine.module.state_dict())
            return
        self.reference.load_state_dict(self.export.weights())

    def reset_optimizer(self) -> int:
        """A fresh optimizer, in place: every moment and step count of the AdamW (and of PPO's value head) back to
        zero, as if no step had been taken; the weights, fp32 masters included, stay. RL calls it once, after the
        warm start. Returns how many parameter states were reset."""
        reset = reset_optimizer_state(self.optimizer)
        return reset + (reset_optimizer_state(self.value_optimizer) if self.value_optimizer else 0)

    def rl_lr(self, update: int) -> float:
        from sandforge.trainer.lr_schedule import lr_factor

        t = self.cfg
        return t.lr * lr_factor(update, t.steps * t.mini_batches * t.epochs, t.lr_schedule, t.lr_warmup_steps)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for group in self.value_optimizer.param_groups if self.value_optimizer else []:
            group["lr"] = lr

    def train_step(self, rows: list[TrainingRow], total_tokens: int, mode: str = "rl",
                   total_sequences: int | None = None) -> dict[str, float]:
        """One optimizer step over this rank's rows. ``total_tokens`` (loss tokens) and ``total_sequences`` count over
        all ranks, so each micro-batch's loss is its exact share of the step's aggregated loss.

        RL rows carry the engine's ``logprobs``, per-token ``advantages`` and, for PPO, per-token ``returns``; SFT rows
        only their tokens and loss mask (``TrainingRow``)."""
        gas = self.cfg.grad_accum_steps
        totals = Totals(tokens=total_tokens, sequences=total_sequences or len(rows))
        scale = gas * self.world_size  # undo DeepSpeed's 1/gas and 1/world averaging: each loss is already a share
        stats = Stats()
        if mode == "rl":  # the warm start keeps the lr set_lr gave it; RL follows the schedule
            self.set_lr(self.rl_lr(self.rl_updates))
        self.engine.train()
        for micro in split_micro_batches(rows, gas, padded=not self.packs()):
            weight = scale
            if not micro:  # keep every rank's backward count equal
                micro, weight = [DUMMY_ROW], 0.0
            loss, st, aux = self._micro_batch_loss(micro, totals, mode)
            aux = aux * (1.0 if weight else 0.0)
            st.sums["moe/aux_loss"] = aux.detach() / (gas * self.world_size)
            self.engine.backward(loss * weight + aux)
            self.engine.step()
            stats.add(st)
        if mode == "rl":
            self._step_value_head()
            self.rl_updates += 1
        self.steps += 1
        return mismatch_rate(self._reduce(stats)) | self._after_step()

    def packs(self) -> bool:
        """Whether micro-batches pack their sequences (``trainer.pack_sequences``, K3 policies) or pad each to the
        longest (Hugging Face policies, whose attention cannot keep packed sequences apart on every backend)."""
        return self.cfg.pack_sequences and getattr(self.engine.module, "pack_align", None) is not None

    def layout(self, rows: list[TrainingRow]) -> PackedLayout:
        """How a micro-batch's sequences share forward rows (``packs``)."""
        lengths = [len(r.token_ids) for r in rows]
        align = getattr(self.engine.module, "pack_align", None)
        if self.cfg.pack_sequences and align is not None:
            return PackedLayout.pack(lengths, align)
        return PackedLayout.padded(lengths)

    def _micro_batch_loss(self, micro: list[TrainingRow], totals: Totals,
                          mode: str) -> tuple[torch.Tensor, Stats, torch.Tensor]:
        dev = self.device
        every = self.cfg.scoring == "all_tokens"  # the reference: logits at every token (trainer/batches.py)
        ids, attn = token_batch(micro, dev)
        layout = self.layout(micro)
        mask = pad_right([r.loss_mask for r in micro], 0, torch.float32, dev)
        if mode == "sft":  # a demonstration is learnt at temperature 1, whatever a row was sampled at
            plain = [replace(r, temperature=None) for r in micro]
            scores = forward_scores(self.engine, plain, layout, device=dev, all_tokens=every)
            return *sft_objective(scores.logprobs, mask, totals), scores.aux_loss
        temperature = self.temperature  # RL scores tokens as the engine sampled them
        engine_ids = routed_ids(micro, ids.shape[1], dev)  # trainer/routing_replay.py
        forced = engine_ids if self.cfg.routing_replay else None
        want_ref = bool(self.settings.kl_coef and self.settings.kl_in == "loss") or self.cfg.log_kl
        trunk = self.trunk if want_ref and forced is None else None  # forced routing: the reference routes freely
        with RouterRecorder(self.engine.module) as router, capture(trunk):
            scores = forward_scores(self.engine, micro, layout, temperature, forced, device=dev, all_tokens=every,
                                    entropy=True if self.settings.entropy_coef else "metric",
                                    hidden=self.value_head is not None)
        ref = None  # no reference forward when KL neither weighs in the loss nor is logged (trainer.log_kl)
        if want_ref:
            with torch.no_grad(), resumed(trunk) if trunk else nullcontext():
                ref = forward_scores(self.reference, micro, layout, temperature, device=dev,
                                     all_tokens=every).logprobs
        batch = MicroBatch(
            logprobs=scores.logprobs,
            engine_logprobs=pad_right([r.logprobs for r in micro], 0.0, torch.float32, dev),
            advantages=pad_right([r.advantages for r in micro], 0.0, torch.float32, dev),
            mask=mask,
            ref_logprobs=ref,
            entropy=scores.entropy,
        )
        if all(r.old_logprobs is not None for r in micro):  # later mini-batches of a step: ratio against its start
            batch.old_logprobs = pad_right([r.old_logprobs for r in micro], 0.0, torch.float32, dev)
        if self.value_head is not None:
            batch.values = self.value_head(scores.hidden.float()).squeeze(-1)
            batch.returns = pad_right([r.returns for r in micro], 0.0, torch.float32, dev)
        loss, st = rl_objective(batch, self.settings, totals)
        own = router.own_ids()
        st.sums |= mismatch_counts(None if own is None else layout.unpack(own), engine_ids, attn)
        return loss, st, scores.aux_loss

    @torch.no_grad()
    def score(self, rows: list[TrainingRow]) -> list[RowScores]:
        """What the trainer knows before its step, per row and token: ``kl_penalty`` (kl_coef times KL to the
        reference, with ``trainer.kl_in: reward``), ``values`` (PPO's value head) and ``old_logprobs`` (the ratio's
        denominator when the step takes several mini-batches). Eval mode: no MoE statistics accumulate."""
        from sandforge.trainer.algorithms import kl_estimate

        s, temperature = self.settings, self.temperature
        every = self.cfg.scoring == "all_tokens"  # the reference: logits at every token (trainer/batches.py)
        size = max(1, -(-len(rows) // self.cfg.grad_accum_steps))  # as many rows at once as a training micro-batch
        self.engine.eval()
        out = []
        batches = [rows[start : start + size] for start in range(0, len(rows), size)]
        if self.gathers:  # every forward is an all-to-all (experts) or all-gathers (ZeRO-3): all ranks run gas of them
            batches += [[DUMMY_ROW]] * (self.cfg.grad_accum_steps - len(batches))
        for micro in batches:
            layout = self.layout(micro)
            width = max(len(r.token_ids) for r in micro)
            forced = routed_ids(micro, width, self.device) if self.cfg.routing_replay else None
            want_ref = s.kl_in == "reward" and bool(s.kl_coef)
            trunk = self.trunk if want_ref and forced is None else None
            with capture(trunk):
                scores = forward_scores(self.engine, micro, layout, temperature, forced, device=self.device,
                                        all_tokens=every, hidden=self.value_head is not None)
            penalty = torch.zeros_like(scores.logprobs)
            if want_ref:
                with resumed(trunk) if trunk else nullcontext():
                    ref = forward_scores(self.reference, micro, layout, temperature, device=self.device,
                                         all_tokens=every).logprobs
                penalty = s.kl_coef * kl_estimate(scores.logprobs, ref, s.kl_estimator)
            values = None if self.value_head is None else self.value_head(scores.hidden.float()).squeeze(-1)
            for i, r in enumerate(micro):
                n = len(r.token_ids)
                out.append(RowScores(kl_penalty=penalty[i, :n].tolist(),
                                     values=None if values is None else values[i, :n].tolist(),
                                     old_logprobs=scores.logprobs[i, :n].tolist()))
        return out[: len(rows)]  # the stand-ins' scores dropped

    def _step_value_head(self) -> None:
        """The value head lives outside DeepSpeed: average its gradients over ranks as DeepSpeed does, then step."""
        if self.value_head is None:
            return
        import torch.distributed as dist

        params = [p for p in self.value_head.parameters() if p.grad is not None]
        if self.world_size > 1:
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= self.world_size
        torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        self.value_optimizer.step()
        self.value_optimizer.zero_grad()

    def _after_step(self) -> dict[str, float]:
        import torch.distributed as dist

        from sandforge.models.build import after_optimizer_step

        return after_optimizer_step(self.engine.module, dist.all_reduce if self.world_size > 1 else None)

    def _reduce(self, stats: Stats) -> dict[str, float]:
        """Sums, minima and maxima over ranks (every rank holds the same keys: same mode, same settings)."""
        import torch.distributed as dist

        out = {}
        for values, op in ((stats.sums, dist.ReduceOp.SUM), (stats.mins, dist.ReduceOp.MIN),
                           (stats.maxs, dist.ReduceOp.MAX)):
            keys = sorted(values)
            if not keys:
                continue
            # on the rank's device: NCCL reduces GPU tensors only
            vec = torch.stack([torch.as_tensor(values[k], dtype=torch.float64).to(self.device) for k in keys])
            if self.world_size > 1:
                dist.all_reduce(vec, op=op)
            out |= {k: v for k, v in zip(keys, vec.tolist()) if math.isfinite(v)}  # min/max of no tokens: left out
        norm = self.engine.get_global_grad_norm()
        out["grad_norm"] = float(norm) if norm is not None else 0.0
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def device_name(self) -> str:
        """Where this rank runs, as the run's placement line states it (``cuda:<GPU id>`` or ``cpu``)."""
        return self.where

    def model_config_dict(self) -> dict:
        from sandforge.models.build import policy_config

        return policy_config(self.engine.module)

    # --- weight export (trainer/weight_export.py) and checkpoints (trainer/checkpoint.py), as the driver calls them

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights for the engine, on CPU in fp32 (LoRA: the adapters only). With expert parallelism or
        ZeRO-3 every rank must call it."""
        return self.export.weights()

    def share_weights(self) -> bytes:
        """Handles to the policy's own tensors for an engine sharing this rank's device (weight_sync colocated)."""
        return self.export.share()

    def open_weight_channel(self, host: str, port: int) -> None:
        """Rank 0's end of the collective weight sync; the engine opens the other end."""
        self.export.open_channel(host, port)

    def send_weights(self, version: int) -> int:
        """Broadcast the policy to the engine as ``version`` (every rank calls it; rank 0 sends)."""
        return self.export.send(version)

    def save_policy(self, directory: str) -> str:
        """The standalone policy, written by rank 0 (what a remote inference server loads after each step)."""
        return self.export.save_policy(directory)

    def save_checkpoint(self, directory: str, tag: str, client_state: dict | None = None) -> str:
        """This rank's share of checkpoint ``tag`` (every rank calls it); returns the policy directory."""
        return self.checkpoint.save(directory, tag, client_state or {}, self.steps, self.rl_updates)

    def load_checkpoint(self, directory: str, tag: str, reference: str | None = None) -> dict:
        """Restore what ``save_checkpoint`` wrote; returns the client state. ``reference``: a policy directory to
        restore the frozen KL reference from."""
        client_state, self.steps, self.rl_updates = self.checkpoint.load(directory, tag)
        if reference:
            load_reference(self.reference, reference, self.lora, self.expert_parallel)
        return client_state
