"""One trainer rank: a Ray actor that owns a DeepSpeed engine over the policy.

N ranks form one torch.distributed group (gloo on CPU). Each rank receives its shard of the step's sequences, splits it
into exactly ``grad_accum_steps`` micro-batches (empty ones run a zero-weighted dummy so every rank does the same number
of backward passes), and DeepSpeed averages gradients across ranks and steps the optimizer at the boundary.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from sandforge.trainer.grpo import grpo_token_losses, sft_token_losses
from sandforge.trainer.routing_replay import RouterRecorder, mismatch_counts, mismatch_rate, replaying, routed_ids


def pad_right(rows: list[list], value, dtype) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)


def split_micro_batches(rows: list[dict], n: int) -> list[list[dict]]:
    """Deal sequences longest-first into n micro-batches so their padded sizes stay close."""
    order = sorted(rows, key=lambda r: len(r["token_ids"]), reverse=True)
    return [order[i::n] for i in range(n)]


class TrainerRank:
    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        model_cfg: dict,
        trainer_cfg: dict,
        init_from: str | None,
        tokenizer: str,
        seed: int,
        num_threads: int = 1,
    ):
        os.environ.update(
            DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        torch.set_num_threads(num_threads)
        import deepspeed

        from sandforge.models.policy import build_policy, load_chat, load_policy

        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
        self.rank, self.world_size = rank, world_size
        self.cfg = trainer_cfg
        torch.manual_seed(seed)  # identical initial weights on every rank
        self.tokenizer = load_chat({**model_cfg, "init_from": init_from, "tokenizer": tokenizer}).tokenizer
        model = load_policy(init_from) if init_from else build_policy(model_cfg, len(self.tokenizer))
        if model.config.vocab_size < len(self.tokenizer):
            raise ValueError(f"tokenizer {tokenizer!r} has {len(self.tokenizer)} ids but the model only "
                             f"{model.config.vocab_size}")

        self.expert_parallel = trainer_cfg.get("expert_parallel", 1)
        if self.expert_parallel > 1:  # keep this rank's experts only; the reference copy shares the expert groups
            from sandforge.trainer.expert_parallel import optimizer_groups, shard_model

            shard_model(model, self.expert_parallel)
        self.reference = copy.deepcopy(model).eval().requires_grad_(False)  # frozen, for the KL metric/penalty
        params = optimizer_groups(model) if self.expert_parallel > 1 else model.parameters()
        optimizer = torch.optim.AdamW(params, lr=trainer_cfg["lr"], weight_decay=trainer_cfg["weight_decay"])
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,  # sequences are packed by us; DeepSpeed counts micro-steps only
            "gradient_accumulation_steps": trainer_cfg["grad_accum_steps"],
            "gradient_clipping": trainer_cfg["grad_clip"],
            "zero_optimization": {"stage": trainer_cfg["zero_stage"]},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if self.expert_parallel > 1:
            from sandforge.trainer import expert_parallel

            self.engine, self.optimizer = expert_parallel.initialize(model, optimizer, ds_config, self.expert_parallel)
        else:
            self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.steps = 0

    def reset_reference(self) -> None:
        """Make the current policy the KL reference (after a warm start, RL is measured from there)."""
        self.reference.load_state_dict(self.engine.module.state_dict())

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, rows: list[dict], total_tokens: int, mode: str = "rl") -> dict[str, float]:
        """One optimizer step over this rank's rows; ``total_tokens`` counts loss tokens over all ranks."""
        from sandforge.models.generate import token_logprobs

        gas = self.cfg["grad_accum_steps"]
        scale = gas * self.world_size / max(total_tokens, 1)  # undo DeepSpeed's 1/gas and 1/world averaging
        sums: dict[str, torch.Tensor] = {}
        temperature = 1.0 if mode == "sft" else self.cfg["temperature"]  # RL scores tokens as the engine sampled them
        self.engine.train()
        router_totals: dict[str, float] = {}
        for micro in split_micro_batches(rows, gas):
            weight = scale
            if not micro:  # keep every rank's backward count equal
                micro, weight = [{"token_ids": [0, 0], "loss_mask": [0, 0], "logprobs": [0.0, 0.0], "advantage": 0.0}], 0.0
            ids = pad_right([r["token_ids"] for r in micro], 0, torch.long)
            attn = pad_right([[1] * len(r["token_ids"]) for r in micro], 0, torch.long)
            mask = pad_right([r["loss_mask"] for r in micro], 0, torch.float32)
            engine_ids = routed_ids(micro, ids.shape[1]) if mode == "rl" else None  # trainer/routing_replay.py
            forward = replaying(self.engine, engine_ids if self.cfg.get("routing_replay") else None)
            with RouterRecorder(self.engine.module) as router:
                logprobs, aux = token_logprobs(forward, ids, attn, temperature=temperature)
            if mode == "rl":
                router_sums = mismatch_counts(router.own_ids(), engine_ids, attn)
                for k, v in router_sums.items():
                    router_totals[k] = router_totals.get(k, 0.0) + float(v)
            if mode == "sft":
                loss, stats = sft_token_losses(logprobs, mask)
            else:
                old = pad_right([r["logprobs"] for r in micro], 0.0, torch.float32)
                adv = torch.tensor([r["advantage"] for r in micro], dtype=torch.float32)
                with torch.no_grad():
                    ref, _ = token_logprobs(self.reference, ids, attn, temperature=temperature)
                loss, stats = grpo_token_losses(
                    logprobs, old, adv, mask, self.cfg["clip_eps"], ref_logprobs=ref, kl_coef=self.cfg["kl_coef"]
                )
            stats["aux_loss"] = aux.detach() * (1.0 if weight else 0.0)
            self.engine.backward(loss * weight + aux * (1.0 if weight else 0.0))
            self.engine.step()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
        self.steps += 1
        return self._reduce(sums, total_tokens, gas) | self._router_rate(router_totals) | self._after_step()

    def _router_rate(self, totals: dict[str, float]) -> dict[str, float]:
        """``router/mismatch_rate`` over all ranks (trainer/routing_replay.py); every rank reduces the same keys."""
        import torch.distributed as dist

        if not totals:
            return {}
        vec = torch.tensor([totals["router/mismatched"], totals["router/known"]], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(vec)
        return mismatch_rate({"router/mismatched": vec[0].item(), "router/known": vec[1].item()})

    def _after_step(self) -> dict[str, float]:
        import torch.distributed as dist

        from sandforge.models.policy import after_optimizer_step

        return after_optimizer_step(self.engine.module, dist.all_reduce if self.world_size > 1 else None)

    def _reduce(self, sums: dict[str, torch.Tensor], total_tokens: int, gas: int) -> dict[str, float]:
        import torch.distributed as dist

        keys = sorted(sums)
        vec = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64) for k in keys])
        if self.world_size > 1:
            dist.all_reduce(vec)
        out = {}
        for k, v in zip(keys, vec.tolist()):
            if k == "aux_loss":
                out["moe/aux_loss"] = v / (gas * self.world_size)
            elif k == "clipped":
                out["clip_frac"] = v / max(total_tokens, 1)
            elif k == "ratio":
                out["ratio/mean"] = v / max(total_tokens, 1)
            elif k in ("pg_loss", "nll"):
                out["loss"] = v / max(total_tokens, 1)
            else:
                out[k] = v / max(total_tokens, 1)
        norm = self.engine.get_global_grad_norm()
        out["grad_norm"] = float(norm) if norm is not None else 0.0
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The whole policy's weights on CPU. With expert parallelism every rank must call it: experts are gathered."""
        if self.expert_parallel > 1:
            from sandforge.models.k3.expert_parallel import full_state_dict

            return full_state_dict(self.engine.module)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.engine.module.state_dict().items()}

    def open_weight_channel(self, host: str, port: int) -> None:
        """Rank 0's end of the collective weight sync (models/weight_sync.py); the engine opens the other end."""
        from sandforge.models.weight_sync import WeightChannel

        self.channel = WeightChannel(host, port, rank=0)

    def send_weights(self, version: int) -> int:
        """Broadcast the policy to the engine over the weight channel (every rank calls it: with expert parallelism
        the experts are gathered first; rank 0 sends)."""
        weights = self.get_weights()
        return self.channel.send(weights, version) if self.rank == 0 else version

    def model_config_dict(self) -> dict:
        from sandforge.models.policy import policy_config

        return policy_config(self.engine.module)

    def save_checkpoint(self, directory: str, tag: str, client_state: dict | None = None) -> str:
        """DeepSpeed checkpoint (all ranks) plus, on rank 0, a standalone policy (config.json + safetensors)."""
        from sandforge.models.policy import save_policy

        self.engine.save_checkpoint(directory, tag=tag, client_state=client_state or {})
        policy_dir = Path(directory) / tag / "policy"
        whole = self.get_weights() if self.expert_parallel > 1 else None  # a collective: every rank takes part
        if self.rank == 0:
            save_policy(self.engine.module, policy_dir, tokenizer=self.tokenizer, state_dict=whole)
        # what DeepSpeed does not keep: this rank's RNG and its step count
        torch.save({"torch_rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                    "steps": self.steps},
                   Path(directory) / tag / f"trainer_rank_{self.rank}.pt")
        return str(policy_dir)

    def load_checkpoint(self, directory: str, tag: str, reference: str | None = None) -> dict:
        """Restore what ``save_checkpoint`` wrote (weights, balancing biases, optimizer, RNG); returns the client
        state. ``reference``: a policy directory to restore the frozen KL reference from."""
        if not (Path(directory) / tag).is_dir():
            raise FileNotFoundError(f"no checkpoint {tag!r} in {directory}")
        path, client_state = self.engine.load_checkpoint(directory, tag=tag, load_optimizer_states=True,
                                                         load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint {tag!r} in {directory}")
        extra = torch.load(Path(directory) / tag / f"trainer_rank_{self.rank}.pt", weights_only=False)
        torch.set_rng_state(extra["torch_rng"])
        if extra["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["cuda_rng"])
        self.steps = extra["steps"]
        if reference:
            from sandforge.models.policy import load_policy

            ref = load_policy(reference)
            if self.expert_parallel > 1:  # keep this rank's experts, as the live reference does
                from sandforge.trainer.expert_parallel import shard_model

                shard_model(ref, self.expert_parallel)
            device = next(self.reference.parameters()).device
            self.reference.load_state_dict({k: v.to(device) for k, v in ref.state_dict().items()})
        return client_state or {}
