"""Expert parallelism for LatentMoE: routed experts sharded over a process group, tokens moved by all-to-all.

With an expert-parallel group of E_p ranks and n experts, group rank r owns experts [r·n/E_p, (r+1)·n/E_p). The router,
W_down, W_up, the norm and the shared experts stay replicated; every rank routes its own tokens, then

    dispatch   sort the (token, slot) pairs by expert, so by owner rank; all-to-all the per-expert counts, then the
               latent rows z = W_down x they need                                        [M_send, L] -> [M_recv, L]
    compute    each local expert on the rows sent to it by every rank, one batch per expert
    return     the inverse all-to-all brings each result back to its token's rank        [M_recv, L] -> [M_send, L]
    combine    Σ_i p_i E_i(z), summed in slot order exactly as the dense loop sums it

``all_to_all`` is differentiable (its backward is the inverse exchange), so gradients reach z, the routing weights and
the local experts. Every rank runs every local expert even on zero rows, so each rank's autograd graph holds the same
collectives and every expert parameter gets a gradient (zero when no token chose it): ranks never wait on a reduction
another rank skipped. The dense loop in ``LatentMoE.forward`` stays the reference; tests/test_expert_parallel.py ties
them.

A sharded layer keeps its experts in a ``ModuleDict`` keyed by the global expert id, so its parameter names are the
dense model's (``experts.5.w_gate.weight``), a subset per rank; ``full_state_dict`` gathers the whole model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .latent_moe import LatentMoE

EXPERT_WEIGHTS = ("w_gate.weight", "w_up.weight", "w_down.weight")  # a SituGLU's parameters


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send), ...] -> [sum(recv), ...]: send[j] rows go to group rank j, recv[j] rows come from it."""

    @staticmethod
    def forward(ctx, x: Tensor, recv: list[int], send: list[int], group) -> Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, recv: list[int], send: list[int], group) -> Tensor:
    return _AllToAll.apply(x, recv, send, group)


class ExpertGroup:
    """The expert-parallel process group a LatentMoE is sharded over; copies of the model share it."""

    def __init__(self, group, n_experts: int):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        if n_experts % self.size:
            raise ValueError(f"{n_experts} experts cannot be split evenly over {self.size} expert-parallel ranks")
        self.n_experts, self.n_local = n_experts, n_experts // self.size

    @property
    def local_ids(self) -> range:
        return range(self.rank * self.n_local, (self.rank + 1) * self.n_local)

    def __deepcopy__(self, memo) -> ExpertGroup:
        return self  # a process group cannot be copied; a copied model uses the same one

    def mix(self, z: Tensor, ids: Tensor, p: Tensor, experts: nn.ModuleDict) -> Tensor:
        """Σ_i p_i E_i(z) for this rank's tokens, the experts spread over the group.

        z [N, L], ids and p [N, k] -> [N, L] float32."""
        N, k = ids.shape
        flat = ids.reshape(-1)  # [N·k] expert of each (token, slot) pair
        order = flat.argsort(stable=True)  # pairs grouped by expert, hence by owner rank
        send_per_expert = torch.bincount(flat, minlength=self.n_experts)  # [n]
        recv_per_expert = torch.empty_like(send_per_expert)  # [E_p · n_local]: source rank-major, then local expert
        dist.all_to_all_single(recv_per_expert, send_per_expert, group=self.group)
        recv_counts = recv_per_expert.view(self.size, self.n_local)
        send = send_per_expert.view(self.size, self.n_local).sum(1).tolist()  # rows to each rank
        recv = recv_counts.sum(1).tolist()  # rows from each rank
        rows = all_to_all(z[order // k], recv, send, self.group)  # [M_recv, L]

        # rows arrive grouped by source rank, then by expert: regroup by local expert for one batch per expert
        local = torch.arange(self.n_local, device=z.device).repeat(self.size)  # [E_p · n_local]
        by_expert = local.repeat_interleave(recv_counts.reshape(-1)).argsort(stable=True)  # [M_recv]
        chunks = rows[by_expert].split(recv_counts.sum(0).tolist())
        outs = [experts[str(e)](chunk) for e, chunk in zip(self.local_ids, chunks)]  # every expert, even on 0 rows
        out = torch.cat(outs)[inverse(by_expert)]  # [M_recv, L], back in arrival order

        back = all_to_all(out, send, recv, self.group)  # [M_send, L], pairs in `order`
        weighted = back.float() * p.reshape(-1)[order, None]
        return weighted[inverse(order)].view(N, k, -1).sum(1)  # summed in slot order, as the dense loop does


def inverse(perm: Tensor) -> Tensor:
    """The permutation that undoes ``perm``: x[perm][inverse(perm)] == x."""
    out = torch.empty_like(perm)
    out[perm] = torch.arange(perm.numel(), device=perm.device)
    return out


def shard_experts(model: nn.Module, group) -> list[nn.Parameter]:
    """Keep only this rank's routed experts in every LatentMoE of ``model``; returns their parameters."""
    params = []
    for moe in (m for m in model.modules() if isinstance(m, LatentMoE)):
        if moe.ep is not None:
            raise ValueError("this model's experts are already sharded")
        ep = ExpertGroup(group, moe.n_experts)
        moe.experts = nn.ModuleDict({str(e): moe.experts[e] for e in ep.local_ids})
        moe.ep = ep
        params += list(moe.experts.parameters())
    return params


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The dense model's state dict, every expert gathered from its owner (a collective over each expert group).

    Every rank of the group must call it; every rank gets the whole state, on CPU, keys in the dense model's order."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    gathered: dict[str, dict[str, Tensor]] = {}  # layer prefix -> key -> tensor, for all experts
    for name, moe in model.named_modules():
        if not isinstance(moe, LatentMoE) or moe.ep is None:
            continue
        prefix = f"{name}.experts." if name else "experts."
        ep, keys = moe.ep, {}
        for weight in EXPERT_WEIGHTS:
            local = torch.stack([state[f"{prefix}{e}.{weight}"] for e in ep.local_ids]).contiguous()  # [n_local, ...]
            parts = [torch.empty_like(local) for _ in range(ep.size)]
            dist.all_gather(parts, local, group=ep.group)
            for e, tensor in enumerate(torch.cat(parts)):  # rank-major order is global expert order
                keys[f"{prefix}{e}.{weight}"] = tensor
        gathered[prefix] = dict(sorted(keys.items(), key=lambda kv: int(kv[0][len(prefix):].split(".")[0])))
    prefixes, out = list(gathered), {}
    for key, value in state.items():
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None:
            out[key] = value.to("cpu", copy=True)
        elif prefix in gathered:  # the layer's first expert key: all its experts go here, in order
            out.update({k: v.to("cpu", copy=True) for k, v in gathered.pop(prefix).items()})
    return out
