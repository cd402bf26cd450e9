"""Stable LatentMoE with Quantile Balancing (Kimi K3 report, arXiv 2607.24653).

For one token x ∈ R^D (n experts, k chosen per token, latent size L = D/2 by default):

    s   = sigmoid(W_r x)                       router scores, always float32          [n]
    S   = top-k(s + b)                         the bias b only *selects* experts
    p_i = s_i / Σ_{j∈S} s_j                    weights come from the raw scores, i ∈ S
    z   = W_down x                             routed experts run on the latent        [L]
    y   = Σ_shared E_sh(x) + W_up RMSNorm(Σ_{i∈S} p_i E_i(z))    (normalise before reconstructing)

Every expert is a SiTU-GLU (``SituGLU``): h = [β1 tanh(W_g x/β1) ⊙ sigmoid(W_g x)] ⊙ [β2 tanh(W_u x/β2)], out = W_o h,
with β1 = 4, β2 = 25, so |h| ≤ β1·β2 however large the input grows.

Quantile Balancing sets the bias directly, with no learning rate. Expert j is chosen for token i exactly when its biased
score beats the token's cutoff, the best biased score it must displace. Routing with top-(k+1) gives that cutoff as
α_i = (k+1)-th largest of s_i + b: for every token where j is among the top k, α_i is the k-th best *other* expert, so
j stays chosen iff s_ij + b_j > α_i. Expert j therefore receives a fraction k/n of the tokens when

    b_j = −quantile_{1−k/n}( s_{:,j} − α )     over the step's real tokens, per expert,

because then exactly k/n of the tokens have s_ij − α_i > −b_j. The new b_j is absolute (α carries the other experts'
biases, not j's own where j is chosen), so no step size is needed. Subtracting the mean over experts changes no top-k
choice and keeps b bounded. For tokens where j is *not* chosen the true cutoff is the k-th value, a little above α_i,
so an underloaded expert's bias rises a little less than it would need alone; all experts move at once, so either way
the rule is a fixed-point iteration rather than an exact solve. Measured on a skewed router (max/mean load 5.7, 16
experts, top-2, 4k tokens a step) it reaches ≈1.3 in two steps and then stays at ≈1.1, the sampling-noise floor; the
exact per-expert cutoff converges about as fast, so the report's α is kept. Tied experts whose scores saturate at 1
move together and settle higher (≈1.6), which no per-expert bias can fully separate.

The quantile is taken from a fixed-range histogram of s − α per expert (``quantile_bins`` bins over ±``QUANTILE_RANGE``,
interpolated inside a bin), so the statistics of many micro-batches and ranks add up: ``reduce_stats(dist.all_reduce)``.
Statistics accumulate only in training forwards and only over real tokens; ``update_bias()`` (once per optimizer step)
applies them and resets. In eval mode nothing accumulates and the bias stays frozen. ``balancing="sign"`` is
DeepSeek-V3's rule instead, b_j += γ·sign(mean load − load_j); ``"none"`` keeps b = 0.

Routing replay: ``forward(..., forced_ids=...)`` uses the given experts (recorded by the inference engine as
``MoEResult.expert_ids``) instead of choosing; weights are still p_i = s_i / Σ s over those experts, so the output is
bitwise the output of the run that recorded them (same parameters; the bias is not consulted). A token whose forced ids
hold a -1 (routing unknown) routes by itself. Balancing statistics
always describe the router's own choice.

Expert parallelism (``expert_parallel.shard_experts``) keeps only one rank's routed experts and moves tokens to them
with all-to-all; everything else in the layer, the bias included, stays replicated.

The routed experts run as three grouped GEMMs over the tokens sorted by expert (``grouped_experts``,
``torch._grouped_mm``) on CUDA, and as a loop over experts elsewhere (``LatentMoE.grouped_mm`` chooses; the loop is the
reference the grouped path is tested against, on CPU too).

Shapes: B batch, T tokens, D model, L latent, N = B·T flattened tokens, n experts, k experts per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .naive import experts_naive

BALANCING = ("quantile", "sign", "none")
QUANTILE_RANGE = 4.0  # s − α lies in (−1 − Δb, 1 + Δb); mean-centred biases keep it well inside ±4


class MoEResult(NamedTuple):  # a tuple, so ZeRO-3's hooks find its tensors and re-gather the experts in backward
    y: Tensor  # [B, T, D] in the input's dtype
    expert_ids: Tensor  # [B, T, k] int64, the experts used (record these for routing replay)
    weights: Tensor  # [B, T, k] float32, p_i = s_i / Σ chosen s
    load: Tensor  # [n] float32, fraction of this call's real tokens sent to each expert (sums to k)


class SituGLU(nn.Module):
    """One expert: out = W_o [β1 tanh(W_g x/β1) ⊙ sigmoid(W_g x) ⊙ β2 tanh(W_u x/β2)], bounded by β1·β2 before W_o."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int | None = None, beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        self.w_gate = nn.Linear(d_in, d_hidden, bias=False)
        self.w_up = nn.Linear(d_in, d_hidden, bias=False)
        self.w_down = nn.Linear(d_hidden, d_out or d_in, bias=False)
        self.beta1, self.beta2 = beta1, beta2

    def hidden(self, x: Tensor) -> Tensor:
        g, u = self.w_gate(x), self.w_up(x)
        # tanh soft-caps both branches: the SiLU-like gate at β1, the linear branch at β2
        return self.beta1 * torch.tanh(g / self.beta1) * torch.sigmoid(g) * (self.beta2 * torch.tanh(u / self.beta2))

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(self.hidden(x))


class LatentMoE(nn.Module):
    """Stable LatentMoE feed-forward (see the module docstring for the equations and the balancing rule).

    ``d_expert`` is the hidden size of every SiTU-GLU (routed and shared; default ``latent_dim``), ``latent_dim`` the
    size routed experts work in (default ``d_model // 2``), ``gamma`` the sign rule's step, ``quantile_bins`` the
    resolution of the balancing histogram (bin width 8 / bins). Activation checkpointing that re-runs the forward
    counts each token twice, which leaves the quantiles and load fractions unchanged.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int,
        n_shared: int = 1,
        d_expert: int | None = None,
        latent_dim: int | None = None,
        balancing: str = "quantile",
        gamma: float = 1e-3,
        quantile_bins: int = 4096,
    ) -> None:
        super().__init__()
        if balancing not in BALANCING:
            raise ValueError(f"balancing={balancing!r}; expected one of {BALANCING}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        if balancing == "quantile" and top_k == n_experts:
            raise ValueError(f"quantile balancing needs top_k < n_experts (got {top_k} of {n_experts}); use 'none'")
        self.d_model, self.n_experts, self.top_k = d_model, n_experts, top_k
        self.latent_dim = latent_dim or d_model // 2
        self.d_expert = d_expert or self.latent_dim
        self.balancing, self.gamma = balancing, gamma

        self.router = nn.Linear(d_model, n_experts, bias=False)  # applied in float32 whatever the module dtype
        self.w_down = nn.Linear(d_model, self.latent_dim, bias=False)
        self.experts = nn.ModuleList(SituGLU(self.latent_dim, self.d_expert) for _ in range(n_experts))
        self.ep = None  # an expert_parallel.ExpertGroup once shard_experts() keeps only this rank's experts
        self.grouped_mm: bool | None = None  # routed experts as grouped GEMMs; None: on CUDA, where it pays
        self.norm = nn.RMSNorm(self.latent_dim, eps=1e-6)
        self.w_up = nn.Linear(self.latent_dim, d_model, bias=False)
        self.shared = nn.ModuleList(SituGLU(d_model, self.d_expert) for _ in range(n_shared))

        # selection bias: a buffer (never a parameter, so no gradient), persistent so checkpoints keep it
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))
        # balancing statistics of the current optimizer step; sums, so ranks can all-reduce them
        self.register_buffer("_hist", torch.zeros(n_experts, quantile_bins, dtype=torch.int64), persistent=False)
        self.register_buffer("_counts", torch.zeros(n_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("_n_tokens", torch.zeros((), dtype=torch.int64), persistent=False)

    def _apply(self, fn, recurse=True):
        bias = self.bias
        super()._apply(fn, recurse)
        # .to(bfloat16) moves the bias but must not round it: it compares float32 scores
        self.bias = bias.to(device=self.bias.device, dtype=torch.float32)
        return self

    # ---- routing -------------------------------------------------------------------------------------------------

    def scores(self, x: Tensor) -> Tensor:
        """s = sigmoid(W_r x) in float32: [..., D] -> [..., n]."""
        return torch.sigmoid(F.linear(x.float(), self.router.weight.float()))

    def route(self, s: Tensor, forced_ids: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Chosen ids [N, k], weights p [N, k], and the top-(k+1) biased values [N, k+1] (for balancing)."""
        k_plus = min(self.top_k + 1, self.n_experts)
        top_vals, top_ids = (s + self.bias).topk(k_plus, dim=-1)
        ids = top_ids[:, : self.top_k]
        if forced_ids is not None:  # replay; a token with an unknown (-1) entry routes by itself
            ids = torch.where((forced_ids >= 0).all(-1, keepdim=True), forced_ids, ids)
        chosen = s.gather(-1, ids)
        return ids, chosen / chosen.sum(-1, keepdim=True), top_vals

    # ---- forward -------------------------------------------------------------------------------------------------

    def forward(self, x: Tensor, mask: Tensor | None = None, forced_ids: Tensor | None = None) -> MoEResult:
        B, T, D = x.shape
        xf = x.reshape(B * T, D)  # [N, D]
        real = torch.ones(B * T, dtype=torch.bool, device=x.device) if mask is None else mask.reshape(-1).bool()
        if forced_ids is not None:
            if forced_ids.shape != (B, T, self.top_k):
                raise ValueError(f"forced_ids has shape {tuple(forced_ids.shape)}; expected {(B, T, self.top_k)}")
            forced_ids = forced_ids.reshape(B * T, self.top_k).to(device=x.device, dtype=torch.long)

        s = self.scores(xf)  # [N, n] fp32
        ids, p, top_vals = self.route(s, forced_ids)  # [N, k], [N, k], [N, k+1]
        if self.training:  # load counts feed the metrics even without balancing
            self._accumulate(s[real], top_vals[real])

        z = self.w_down(xf)  # [N, L]
        if self.ep is None:
            grouped = x.is_cuda if self.grouped_mm is None else self.grouped_mm
            if grouped and grouped_mm_fits(z, self.d_expert):
                mixed = grouped_experts(z, ids, p, self.experts)
            else:
                mixed = experts_naive(z, ids, p, self.experts)
        else:  # experts spread over ranks: the same sum, tokens sent to their experts' ranks and back
            mixed = self.ep.mix(z, ids, p, self.experts)
        y = self.w_up(self.norm(mixed.to(x.dtype)))  # [N, D]
        for expert in self.shared:
            y = y + expert(xf)

        counts = torch.bincount(ids[real].reshape(-1), minlength=self.n_experts).float()
        load = counts / real.sum().clamp_min(1)
        return MoEResult(y.reshape(B, T, D), ids.reshape(B, T, -1), p.reshape(B, T, -1), load)

    # ---- balancing -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _accumulate(self, s: Tensor, top_vals: Tensor) -> None:
        """Add real tokens' statistics: the router's own load, and a histogram of s_ij − α_i per expert."""
        own_ids = (s + self.bias).topk(self.top_k, dim=-1).indices  # differs from the used ids only under replay
        self._counts += torch.bincount(own_ids.reshape(-1), minlength=self.n_experts)
        self._n_tokens += s.shape[0]
        if self.balancing == "quantile" and s.shape[0]:
            alpha = top_vals[:, self.top_k]  # each token's cutoff: the (k+1)-th biased score  [N]
            n_bins = self._hist.shape[1]
            width = 2 * QUANTILE_RANGE / n_bins
            bins = ((s - alpha[:, None] + QUANTILE_RANGE) / width).floor().clamp(0, n_bins - 1).long()  # [N, n]
            flat = bins + n_bins * torch.arange(self.n_experts, device=bins.device)  # histogram row j: expert j
            self._hist += torch.bincount(flat.reshape(-1), minlength=self._hist.numel()).view_as(self._hist)

    def reduce_stats(self, fn: Callable[[Tensor], object]) -> None:
        """Apply ``fn`` in place to every accumulator, e.g. ``moe.reduce_stats(torch.distributed.all_reduce)``
        before ``update_bias()`` so every rank sets the same bias from the statistics of all ranks (all are sums)."""
        for t in (self._hist, self._counts, self._n_tokens):
            fn(t)

    @torch.no_grad()
    def update_bias(self) -> dict[str, float]:
        """Set the bias from this step's statistics, reset them, and return balance metrics (empty if none)."""
        n = int(self._n_tokens)
        if n == 0:
            return {}
        load = self._counts.double() / n  # fraction of tokens per expert, mean k/n
        metrics = {
            "max_load_ratio": float(load.max() / load.mean()),
            "min_load_ratio": float(load.min() / load.mean()),
            "tokens": float(n),
        }
        if self.balancing == "quantile":
            b = -hist_quantile(self._hist, 1 - self.top_k / self.n_experts, QUANTILE_RANGE)
            self.bias.copy_(b - b.mean())
        elif self.balancing == "sign":
            self.bias += self.gamma * torch.sign(load.mean() - load).float()
        metrics["bias_range"] = float(self.bias.max() - self.bias.min())
        self._hist.zero_()
        self._counts.zero_()
        self._n_tokens.zero_()
        return metrics


def grouped_mm_fits(z: Tensor, d_expert: int) -> bool:
    """``torch._grouped_mm`` wants every row stride a multiple of 16 bytes (and exists: torch >= 2.8)."""
    size = z.element_size()
    return hasattr(torch, "_grouped_mm") and (z.shape[-1] * size) % 16 == 0 and (d_expert * size) % 16 == 0


def grouped_experts(z: Tensor, ids: Tensor, p: Tensor, experts: nn.ModuleList) -> Tensor:
    """``experts_naive`` as three grouped GEMMs: the (token, slot) pairs sorted by expert, each expert's rows one
    group (``offs``: where each group ends), the experts' weights stacked [n, in, out]. Same sum, same slot order."""
    N, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)  # pairs grouped by expert
    tok, slot = order // k, order % k
    offs = torch.bincount(flat, minlength=len(experts)).cumsum(0).to(torch.int32)
    rows = z[tok]  # [N*k, L]
    first = experts[0]
    w_gate = torch.stack([e.w_gate.weight for e in experts]).transpose(1, 2)  # [n, L, H]
    w_up = torch.stack([e.w_up.weight for e in experts]).transpose(1, 2)
    w_down = torch.stack([e.w_down.weight for e in experts]).transpose(1, 2)  # [n, H, L]
    g, u = torch._grouped_mm(rows, w_gate, offs=offs), torch._grouped_mm(rows, w_up, offs=offs)
    b1, b2 = first.beta1, first.beta2
    h = b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))  # SituGLU.hidden
    out = torch._grouped_mm(h.to(rows.dtype), w_down, offs=offs).float() * p[tok, slot, None]
    per_slot = torch.zeros(N, k, z.shape[-1], dtype=torch.float32, device=z.device)
    per_slot = per_slot.index_put((tok, slot), out)
    return per_slot.sum(1)


def hist_quantile(hist: Tensor, q: float, value_range: float) -> Tensor:
    """Per-row q-quantile of values binned uniformly over [−value_range, value_range), linear inside a bin.

    hist: [n, bins] counts -> [n] float32."""
    n_bins = hist.shape[1]
    width = 2 * value_range / n_bins
    cdf = hist.double().cumsum(-1)  # [n, bins]
    target = q * cdf[:, -1:]  # [n, 1]
    idx = torch.searchsorted(cdf, target).clamp(max=n_bins - 1)  # first bin reaching the target
    before = (cdf.gather(1, idx) - hist.double().gather(1, idx)).squeeze(1)
    in_bin = hist.double().gather(1, idx).squeeze(1).clamp_min(1)
    frac = ((target.squeeze(1) - before) / in_bin).clamp(0, 1)
    return (-value_range + (idx.squeeze(1) + frac) * width).float()


def update_all_biases(model: nn.Module) -> dict[str, float]:
    """Call ``update_bias()`` on every LatentMoE in ``model`` (once per optimizer step); metrics keyed
    ``moe/<layer>/...`` plus ``moe/max_load_ratio`` over layers."""
    metrics: dict[str, float] = {}
    worst = 0.0
    for name, module in model.named_modules():
        if isinstance(module, LatentMoE):
            for key, value in module.update_bias().items():
                metrics[f"moe/{name}/{key}"] = value
                if key == "max_load_ratio":
                    worst = max(worst, value)
    if worst:
        metrics["moe/max_load_ratio"] = worst
    return metrics
