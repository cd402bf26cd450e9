"""Kimi Delta Attention (KDA): a gated delta rule with a per-channel decay (Kimi Linear, arXiv 2510.26692; K3 report).

Per head, the state S (d_k x d_v) is updated token by token:

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,      alpha_t = exp(g_t), g_t <= 0 per channel
    o_t = S_t^T (scale * q_t)                                                    (reads the state after token t)

``kda_naive`` (models/k3/naive.py) is that loop, the plain reference; for one token (decode) it is also the right
algorithm, so the layer uses it there. ``kda_chunked`` is the chunkwise-parallel form (WY representation /
UT transform, as in the gated DeltaNet and Kimi Linear chunk algorithms); a test holds the two together. ``KDA`` is the
layer around them: short convolutions, L2-normalised q/k, low-rank decay gate, output RMSNorm and gate, decode cache.

Shapes: B batch, T tokens, H heads, K key dim, V value dim, N chunks, C chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..packing import packed_cu_seqlens, same_segment, segment_starts
from .naive import kda_naive


# Every decay factor formed in kda_chunked lies in [e^-40, e^40]. Within a sub-block the split factors are exact (the
# sub-block is chosen so that no channel decays by more than e^-40 across it); any other decay below e^-40 (~4e-18, far
# under fp32 resolution) is raised to e^-40. This keeps exp and the matmuls off the CPU's underflow / denormal slow
# paths, which are tens of times slower, and keeps the factors of a product from overflowing.
_MAX_LOG_SPAN = 40.0


def _sub_block(G: Tensor, C: int) -> int:
    """Largest sub-block (16, 8, 4, 2 or 1 tokens) over which no channel decays by more than exp(-_MAX_LOG_SPAN)."""
    for sub in (16, 8, 4, 2):
        if C % sub == 0:
            span = G[..., ::sub, :] - G[..., sub - 1 :: sub, :]  # log-decay across each sub-block, >= 0
            if span.numel() == 0 or span.max() <= _MAX_LOG_SPAN:
                return sub
    return 1


def _exp(x: Tensor) -> Tensor:
    """exp of a log-decay (<= 0), no smaller than e^-_MAX_LOG_SPAN."""
    return x.clamp(min=-_MAX_LOG_SPAN).exp()


# One function on purpose: it is the docstring's equations in order, each shape annotated; split, the chunk tensors
# would cross function boundaries and the algorithm could no longer be read against the derivation.
def kda_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    reset: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunkwise-parallel KDA, same contract as ``kda_naive``; works in fp32. ``reset`` [B, N] bool: chunk i starts
    from a zero state (packed sequences: a new sequence begins there; see ``models/packing.py``).

    Within a chunk starting from state S_0, with G_t = sum_{s<=t} g_s (cumulative log-decay from the chunk start) and
    Gamma_t = exp(G_t), write u_t = beta_t (v_t - k_t^T D_t S_{t-1}) so that S_t = D_t S_{t-1} + k_t u_t^T. Unrolled:

        S_t = Diag(Gamma_t) S_0 + sum_{j<=t} Diag(exp(G_t - G_j)) k_j u_j^T
        (I + A) U = beta V - beta (K * Gamma) S_0,    A_tj = beta_t sum_c k_tc k_jc exp(G_tc - G_jc)  (j < t)

    so with the UT transform T = (I + A)^{-1} (a unit lower-triangular solve): U = T beta V - T beta (K * Gamma) S_0
    (the WY form), o = (scale q * Gamma) S_0 + P U with P_tj = scale sum_c q_tc k_jc exp(G_tc - G_jc) (j <= t), and
    S_C = Diag(Gamma_C) S_0 + (K * exp(G_C - G))^T U. Everything but these last three runs for all chunks at once.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    pad = (-T) % C
    # padding with k = 0, beta = 0, g = 0 leaves the state untouched; its outputs are cut off below
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // C
    # [B,T,H,*] -> [B,H,N,C,*]
    q, k, v, g = (x.float().transpose(1, 2).unflatten(2, (N, C)) for x in (q, k, v, g))
    beta = beta.float().transpose(1, 2).unflatten(2, (N, C))[..., None]  # [B,H,N,C,1]
    q = q * scale

    G = g.cumsum(-2)  # [B,H,N,C,K], non-increasing along C
    # Scores sum_c x_ic k_jc exp(G_ic - G_jc) for x = k (A) and x = q (P), only needed for j <= i. The decay factors
    # through r, the first token of i's sub-block: exp(G_i - G_r) <= 1 times exp(G_r - G_j), which is <= 1 for j in
    # earlier sub-blocks and at most exp(_MAX_LOG_SPAN) inside i's own; so one matmul per sub-block of rows and no
    # [C, C, K] tensor. Entries with j > i inside i's sub-block are computed but discarded (torch.where).
    sub = _sub_block(G, C)
    n = C // sub
    G_r = G[..., ::sub, :]  # [B,H,N,n,K]
    to_r = _exp(G - G_r.repeat_interleave(sub, dim=-2)).unflatten(-2, (n, sub))  # exp(G_i - G_r): [B,H,N,n,s,K]
    x_r = torch.cat([k.unflatten(-2, (n, sub)) * to_r, q.unflatten(-2, (n, sub)) * to_r], dim=-2)  # [B,H,N,n,2s,K]
    scores = []
    for a in range(n):  # rows of sub-block a (k rows, then q rows) against keys up to its end
        end = (a + 1) * sub
        rel = (G_r[..., a, None, :] - G[..., :end, :]).clamp_(min=-_MAX_LOG_SPAN)  # G_r - G_j: [B,H,N,end,K]
        k_r = rel.exp_() * k[..., :end, :]  # k_j exp(G_r - G_j)
        scores.append(F.pad(x_r[..., a, :, :] @ k_r.transpose(-1, -2), (0, C - end)))  # [B,H,N,2s,C]
    scores = torch.stack(scores, dim=-3)  # [B,H,N,n,2s,C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A = torch.where(causal.tril(-1), beta * scores[..., :sub, :].flatten(-3, -2), 0.0)  # [B,H,N,C,C], strictly lower
    P = torch.where(causal, scores[..., sub:, :].flatten(-3, -2), 0.0)  # [B,H,N,C,C], lower incl. diagonal

    eye = torch.eye(C, device=q.device)
    gamma = _exp(G)  # Gamma_t = exp(G_t): [B,H,N,C,K]
    rhs = torch.cat([beta * v, beta * k * gamma], dim=-1)  # [B,H,N,C,V+K]
    UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U_v, W = UW[..., :V], UW[..., V:]  # T beta V: [B,H,N,C,V]; T beta (K * Gamma): [B,H,N,C,K]
    q_decay = q * gamma  # [B,H,N,C,K]
    k_decay = k * _exp(G[..., -1:, :] - G)  # exp(G_C - G_j) <= 1
    chunk_decay = _exp(G[..., -1, :])[..., None]  # [B,H,N,K,1]
    k_decay_t = k_decay.transpose(-1, -2)  # [B,H,N,K,C]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    starts, Us = [], []
    for i in range(N):  # the only sequential part: carry the state across chunks
        if reset is not None:
            S = S * (~reset[:, i]).to(S.dtype)[:, None, None, None]
        U = U_v[:, :, i] - W[:, :, i] @ S  # [B,H,C,V]
        starts.append(S)
        Us.append(U)
        S = chunk_decay[:, :, i] * S + k_decay_t[:, :, i] @ U
    # outputs of all chunks at once: o = (q Gamma) S_0 + P U
    o = q_decay @ torch.stack(starts, dim=2) + P @ torch.stack(Us, dim=2)  # [B,H,N,C,V]
    o = o.flatten(2, 3)[:, :, :T].transpose(1, 2)  # [B,T,H,V]
    return o.to(out_dtype), (S if output_final_state else None)


@dataclass
class KDACache:
    """Decode state of one KDA layer: the recurrent state [B,H,K,V] (fp32) and the last kernel-1 inputs of each short
    convolution, conv_q / conv_k [B, kernel-1, H*K] and conv_v [B, kernel-1, H*V]. Row b is sequence b."""

    state: Tensor
    conv_q: Tensor
    conv_k: Tensor
    conv_v: Tensor

    def _map(self, fn) -> KDACache:
        return KDACache(fn(self.state), fn(self.conv_q), fn(self.conv_k), fn(self.conv_v))

    def select(self, rows: Tensor | list[int]) -> KDACache:
        """Keep only these batch rows (e.g. drop finished sequences)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.state.device)
        return self._map(lambda t: t.index_select(0, rows))

    def repeat_interleave(self, n: int) -> KDACache:
        """Each row n times in a row: one prompt's cache -> n samples."""
        return self._map(lambda t: t.repeat_interleave(n, dim=0))

    def clone(self) -> KDACache:
        return self._map(torch.clone)

    @classmethod
    def cat(cls, caches: list[KDACache]) -> KDACache:
        """Rows of several caches in one batch (states are per row and fixed-size: nothing to pad)."""
        rows = [(c.state, c.conv_q, c.conv_k, c.conv_v) for c in caches]
        return KDACache(*(torch.cat(parts) for parts in zip(*rows)))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.state, self.conv_q, self.conv_k, self.conv_v))


class ShortConv(nn.Module):
    """Causal depthwise conv1d over time (kernel 4, no bias) that continues from the previous kernel-1 inputs.

    With a mask, pads are skipped: each real token sees the previous kernel-1 *real* inputs, so pads anywhere (left
    padding, or pads between turns) change nothing. Outputs at pad positions are zero. With ``segment_ids`` (packed
    sequences, no state) a token sees only earlier inputs of its own segment.
    """

    def __init__(self, channels: int, kernel: int = 4):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.randn(channels, 1, kernel) / kernel**0.5)

    def forward(self, x: Tensor, state: Tensor | None, mask: Tensor | None,
                segment_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        B, T, Ch = x.shape
        if segment_ids is not None:
            return self._segmented(x, segment_ids)
        if state is None:
            state = x.new_zeros(B, self.kernel - 1, Ch)
        if mask is not None:  # each row's real tokens first, in order, then its pads (zeroed): [B,T,Ch]
            order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
            x = (x * mask[..., None]).gather(1, order[..., None].expand(-1, -1, Ch))
        buf = torch.cat([state.to(x.dtype), x], dim=1)  # [B, kernel-1+T, Ch]
        y = F.conv1d(buf.transpose(1, 2), self.weight, groups=Ch).transpose(1, 2)  # [B,T,Ch]
        if mask is None:
            return y, buf[:, T:]
        # back to the original positions; the new state is the last kernel-1 real inputs
        pos = (mask.long().cumsum(1) - 1).clamp(min=0)  # [B,T]
        y = y.gather(1, pos[..., None].expand(-1, -1, Ch)) * mask[..., None]
        idx = mask.long().sum(1, keepdim=True) + torch.arange(self.kernel - 1, device=x.device)  # [B, kernel-1]
        return y, buf.gather(1, idx[..., None].expand(-1, -1, Ch))

    def _segmented(self, x: Tensor, segment_ids: Tensor) -> tuple[Tensor, Tensor]:
        """y_t = sum_j w_{kernel-1-j} x_{t-j} over the j with t-j in t's segment (conv1d's taps, one shift at a time).
        Returns no usable state (packed training forwards keep none): zeros, for the shape."""
        y = torch.zeros_like(x)
        for j in range(self.kernel):
            shifted = F.pad(x, (0, 0, j, 0))[:, : x.shape[1]]  # x_{t-j}
            keep = same_segment(segment_ids, j).to(x.dtype)[..., None]
            y = y + shifted * keep * self.weight[:, 0, self.kernel - 1 - j]
        return y, x.new_zeros(x.shape[0], self.kernel - 1, x.shape[2])


def fla_chunk_kda():
    """flash-linear-attention's ``chunk_kda`` where the optional ``fla-core`` package is installed, else None.

    It takes the same [B,T,H,K] layout, log-space g and post-sigmoid beta as ``kda_chunked`` (a GPU test ties them);
    the layer uses it on CUDA only, so CPU always runs ``kda_chunked``.
    """
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # not installed, or no Triton/GPU for it
        return None
    return chunk_kda


class KDA(nn.Module):
    """The Kimi Delta Attention layer: x [B,T,D] -> y [B,T,D].

        q, k = L2Norm(SiLU(ShortConv(W_q x))), L2Norm(SiLU(ShortConv(W_k x)));  v = SiLU(ShortConv(W_v x))
        g = g_min * sigmoid(exp(A_h) * z),  z = W_up W_down x + dt_bias   (log alpha per channel per head, in [g_min, 0])
        beta = sigmoid(W_beta x)   (per head)
        o = KDA(q, k, v, g, beta);   y = W_o[sigmoid(W_g x) * RMSNorm_head(o)]
    """

    use_fla = True  # on CUDA, prefill with fla-core's chunk_kda when it is installed (set False to force kda_chunked)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_k: int,
        head_v: int,
        low_rank: int = 16,
        conv_kernel: int = 4,
        g_min: float = -5.0,
        chunk_size: int = 64,
    ):
        super().__init__()
        self.n_heads, self.head_k, self.head_v = n_heads, head_k, head_v
        self.g_min, self.chunk_size = g_min, chunk_size
        HK, HV = n_heads * head_k, n_heads * head_v
        self.q_proj = nn.Linear(d_model, HK, bias=False)
        self.k_proj = nn.Linear(d_model, HK, bias=False)
        self.v_proj = nn.Linear(d_model, HV, bias=False)
        self.q_conv, self.k_conv, self.v_conv = ShortConv(HK, conv_kernel), ShortConv(HK, conv_kernel), ShortConv(HV, conv_kernel)
        self.g_down = nn.Linear(d_model, low_rank, bias=False)
        self.g_up = nn.Linear(low_rank, HK, bias=False)
        self.A_log = nn.Parameter(torch.zeros(n_heads))
        # sigmoid(dt_bias) in ~[0.0025, 0.12] at init: alpha = exp(g) starts between ~0.55 and ~0.99 per channel
        self.dt_bias = nn.Parameter(torch.empty(HK).uniform_(-6.0, -2.0))
        self.beta_proj = nn.Linear(d_model, n_heads, bias=False)
        self.gate_proj = nn.Linear(d_model, HV, bias=False)
        self.o_norm = nn.RMSNorm(head_v, eps=1e-6)
        self.o_proj = nn.Linear(HV, d_model, bias=False)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, cache: KDACache | None = None, use_cache: bool = False,
        segment_ids: Tensor | None = None,
    ) -> tuple[Tensor, KDACache | None]:
        """mask [B,T]: 1 = real token, 0 = pad; a pad changes neither the state nor the conv windows. Several tokens
        (prefill) run ``kda_chunked``, one token (decode) ``kda_naive``; both continue from ``cache`` (left as it
        is). Returns (y, the cache after these tokens if use_cache else None).

        segment_ids [B,T] (packed training sequences, ``models/packing.py``; no cache): every segment must start at a
        multiple of ``chunk_size``; the state and the conv windows restart there, so segments never see each other."""
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.head_k, self.head_v
        reset = None
        if segment_ids is not None:
            if cache is not None or use_cache:
                raise ValueError("KDA: segment_ids are for packed training forwards, which keep no cache")
            mask, reset = segment_ids > 0, self._chunk_resets(segment_ids)
        m = None if mask is None else mask.bool()
        conv = (None, None, None) if cache is None else (cache.conv_q, cache.conv_k, cache.conv_v)
        q, conv_q = self.q_conv(self.q_proj(x), conv[0], m, segment_ids)  # [B,T,H*K]
        k, conv_k = self.k_conv(self.k_proj(x), conv[1], m, segment_ids)
        v, conv_v = self.v_conv(self.v_proj(x), conv[2], m, segment_ids)  # [B,T,H*V]
        q = F.normalize(F.silu(q).view(B, T, H, K), dim=-1, eps=1e-6)
        k = F.normalize(F.silu(k).view(B, T, H, K), dim=-1, eps=1e-6)
        v = F.silu(v).view(B, T, H, V)

        z = (self.g_up(self.g_down(x)) + self.dt_bias).view(B, T, H, K).float()
        g = self.g_min * torch.sigmoid(self.A_log.exp()[:, None] * z)  # [B,T,H,K], fp32
        beta = torch.sigmoid(self.beta_proj(x).float())  # [B,T,H]
        if m is not None:  # a pad neither decays nor writes the state (its k, v are already 0 from the convs)
            g = g * m[..., None, None]
            beta = beta * m[..., None]

        state = None if cache is None else cache.state
        fla_chunk = fla_chunk_kda() if self.use_fla and q.is_cuda and T > 1 else None
        if T == 1:
            o, state = kda_naive(q, k, v, g, beta, initial_state=state, output_final_state=use_cache)
        elif fla_chunk is not None and reset is not None:  # packed rows: one varlen sequence, a span per segment
            flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta.to(q.dtype))]
            o, _ = fla_chunk(*flat, cu_seqlens=packed_cu_seqlens(segment_ids))
            o = o.view(B, T, H, V)
        elif fla_chunk is not None:  # the fused Triton kernel of flash-linear-attention, same contract and layout
            o, state = fla_chunk(q, k, v, g, beta.to(q.dtype), initial_state=state, output_final_state=use_cache)
        else:
            o, state = kda_chunked(q, k, v, g, beta, initial_state=state, output_final_state=use_cache,
                                   chunk_size=self.chunk_size, reset=reset)
        o = self.o_norm(o).reshape(B, T, H * V) * torch.sigmoid(self.gate_proj(x))  # [B,T,H*V]
        y = self.o_proj(o)  # [B,T,D]
        return y, (KDACache(state, conv_q, conv_k, conv_v) if use_cache else None)

    def _chunk_resets(self, segment_ids: Tensor) -> Tensor:
        """[B, N] bool: which chunks start a segment; ValueError if a segment starts inside a chunk."""
        starts = segment_starts(segment_ids)  # [B, T]
        T, C = segment_ids.shape[1], self.chunk_size
        inside = torch.arange(T, device=segment_ids.device) % C != 0
        if bool((starts & inside).any()):
            raise ValueError(f"KDA: a packed segment starts inside a {C}-token chunk; pack with align={C} "
                             "(models/packing.py)")
        return starts[:, ::C]
