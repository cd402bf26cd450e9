"""Sampling one token from logits, and the per-token log-probabilities the trainer recomputes.

The RL ratio compares the engine's sampled logprobs with ``token_logprobs`` on the same tokens, so both use the same
definition: log_softmax(logits / temperature) at the chosen token, before any top-k / top-p truncation (temperature 0,
greedy, counts as temperature 1). The engine (``sandforge.engine``) samples with ``sample_next``; its references are
``engine/naive.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k
    stop_ids: tuple[int, ...] = ()


def _scale(temperature: float) -> float:
    return temperature if temperature > 0 else 1.0


def _scale_logits(logits: Tensor, temperature: float | Tensor, cols: Tensor) -> Tensor:
    """``logits`` [B, K, V] at columns ``cols`` divided by the temperature: one float, or [B, T] per token (rows
    sampled at different temperatures; column t is scored at token t + 1's). 0 (greedy) scores at 1."""
    if not isinstance(temperature, Tensor):
        scale = _scale(temperature)
        return logits if scale == 1.0 else logits / scale
    per = temperature.to(logits.device, torch.float32)[:, cols + 1]
    return logits / torch.where(per > 0, per, torch.ones_like(per))[..., None]


def draw(probs: Tensor, generators: list[torch.Generator | None] | None = None,
         generator: torch.Generator | None = None) -> Tensor:
    """One token per row of ``probs`` [N, V] (non-negative weights, not necessarily normalised), by the inverse CDF:
    row i's token is where one uniform draw, scaled by the row's total weight, falls in its cumulative sum. Row i
    draws its uniform from ``generators[i]`` where given (so a seeded row samples the same token whatever else is in
    the batch), else from ``generator``. A token of zero weight is never drawn.

    ``torch.multinomial`` (the reference, ``draw_multinomial``) draws one exponential per vocabulary entry and row:
    for SmolLM2's 49,152 tokens that took 100x the time of this draw on a CPU, and a fifth of the engine's time in a
    quickstart step was sampling (py-spy, 2026-12-05)."""
    n, v = probs.shape
    cdf = probs.cumsum(-1)
    if generators is None:
        u = torch.rand(n, 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    else:
        u = torch.cat([torch.rand(1, generator=g if g is not None else generator, device=probs.device, dtype=cdf.dtype)
                       for g in generators])[:, None]
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp_(max=v - 1)
    # rounding can put u x total at the very top, past the last token with weight: take that token instead
    zero = probs.gather(-1, tokens[:, None]).squeeze(-1) <= 0
    if bool(zero.any()):
        last = v - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(-1)
        tokens = torch.where(zero, last, tokens)
    return tokens


def draw_multinomial(probs: Tensor, generators: list[torch.Generator | None] | None = None,
                     generator: torch.Generator | None = None) -> Tensor:
    """``draw``'s reference: ``torch.multinomial``, row by row where rows have generators of their own."""
    if generators is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.cat([torch.multinomial(probs[i : i + 1], 1, generator=g if g is not None else generator)
                      for i, g in enumerate(generators)]).squeeze(-1)


DRAWS = {"cdf": draw, "multinomial": draw_multinomial}  # engine.sampler


def sample_next(
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None,
    generators: list[torch.Generator | None] | None = None, sampler: str = "cdf",
) -> tuple[Tensor, Tensor]:
    """logits [N, V] float32 -> (token ids [N], their log-probabilities [N], taken before truncation). Row i draws
    from ``generators[i]`` where given, else from ``generator``, by ``DRAWS[sampler]``."""
    logprobs = F.log_softmax(logits / _scale(params.temperature), dim=-1)
    if params.temperature <= 0:
        tokens = logits.argmax(dim=-1)
    else:
        keep = torch.ones_like(logprobs, dtype=torch.bool)
        if 0 < params.top_k < logits.shape[-1]:
            keep = torch.zeros_like(keep).scatter_(-1, logprobs.topk(params.top_k, dim=-1).indices, True)
        if params.top_p < 1.0:
            # Smallest set of most likely tokens whose mass reaches top_p: keep a token if the mass before it < top_p.
            sorted_lp, order = logprobs.masked_fill(~keep, -torch.inf).sort(dim=-1, descending=True)
            probs = sorted_lp.exp()
            before = probs.cumsum(-1) - probs
            in_nucleus = before < params.top_p * probs.sum(-1, keepdim=True)
            in_nucleus[:, 0] = True
            keep = torch.zeros_like(keep).scatter_(-1, order, in_nucleus) & keep
        probs = logprobs.exp().masked_fill(~keep, 0.0)
        tokens = DRAWS[sampler](probs, generators, generator)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


@dataclass
class TokenScores:
    """Per token t of right-padded ``input_ids``, all read from the logits at t - 1 (column 0 and pads are 0)."""

    logprobs: Tensor  # [B, T] log p(input_ids[:, t] | input_ids[:, <t]) under logits / temperature, with grad
    aux_loss: Tensor  # the model's MoE balance loss
    entropy: Tensor | None = None  # [B, T] entropy of that next-token distribution, with grad
    hidden: Tensor | None = None  # [B, T, D] the final hidden state that predicted token t (a value head reads it)


def score_columns(score_mask: Tensor) -> Tensor:
    """The logit columns a forward must compute to score the tokens in ``score_mask`` [B, T]: column c predicts token
    c + 1, so c where any row needs token c + 1 (a micro-batch's rows share columns). Never empty: a batch with nothing
    to score (a rank's stand-in row) still gets one column, so its loss keeps a graph to backward through."""
    cols = score_mask[:, 1:].any(0).nonzero().squeeze(-1)
    return cols if cols.numel() else cols.new_zeros(1)


def token_scores(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, temperature: float | Tensor = 1.0,
    entropy: bool | str = False, hidden: bool = False, segment_ids: Tensor | None = None,
    score_mask: Tensor | None = None,
) -> TokenScores:
    """One forward pass over right-padded ``input_ids``: log-probs (and optionally entropies and hidden states).
    ``entropy``: True gives entropies with grad (an entropy bonus trains on them); "metric" without, so none of the
    [B, T, vocab] tensors they take are kept for the backward (with a 49k vocabulary they dominate a step's memory).

    With ``segment_ids`` (packed sequences, ``models/packing.py``) the rows hold several sequences: a token is scored
    only from the previous token of its own segment, so each sequence's first token gets 0 as in the padded layout.

    ``score_mask`` [B, T] (the loss mask): only these tokens are scored, the rest come back 0. The model then computes
    logits at ``score_columns`` only: the lm_head, the fp32 log_softmax over the vocabulary and their backward shrink
    from every token to the policy's own (an agentic episode is mostly prompt and tool output). Without it every token
    is scored, the reference the masked path is tested against (tests/test_token_scores.py).

    ``temperature``: the logits are divided by it before the softmax, as the engine sampled; a [B, T] tensor gives each
    token its own (rows sampled at different temperatures, ``trainer/batches.py row_temperatures``)."""
    kwargs = {"return_hidden": True} if hidden else {}
    if segment_ids is not None:
        kwargs["segment_ids"] = segment_ids
        attention_mask = segment_ids > 0
    B, T = input_ids.shape
    if score_mask is None:
        cols = torch.arange(T - 1, device=input_ids.device)
    else:
        cols = score_columns(score_mask).to(input_ids.device)  # a mask on the host costs the device no sync
        score_mask = score_mask.to(input_ids.device)
        kwargs["logits_at"] = cols
    res = model(input_ids, attention_mask=attention_mask, **kwargs)
    aux_loss, last_hidden, logits = res.aux_loss, res.hidden, res.logits
    del res  # from here on the [B, K, vocab] tensors are the only large ones, one saved for the backward at a time
    if score_mask is None:
        logits = logits[:, :-1]  # the last column predicts past the row
    logits = _scale_logits(logits.float(), temperature, cols)  # fp32 log-probs, whatever the weights are in
    logp = F.log_softmax(logits, dim=-1)  # [B, K, V], what the backward keeps; the logits themselves go
    del logits
    targets = input_ids[:, cols + 1]
    kept = _next_token_kept(input_ids, attention_mask, segment_ids)
    keep = kept[:, cols]
    if score_mask is not None:
        keep = keep * score_mask[:, cols + 1].to(logp.dtype)

    def spread(x: Tensor) -> Tensor:  # [B, K] at columns cols -> [B, T] by the token each column scores
        return x.new_zeros(B, T).index_copy(1, cols + 1, x * keep)

    out = TokenScores(spread(logp.gather(-1, targets[..., None]).squeeze(-1)), aux_loss)
    if entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy != "metric"):
            out.entropy = spread(-(logp.exp() * logp).sum(-1))
    if hidden:
        out.hidden = F.pad(last_hidden[:, :-1] * kept[..., None], (0, 0, 1, 0))
    return out


def _next_token_kept(input_ids: Tensor, attention_mask: Tensor | None, segment_ids: Tensor | None) -> Tensor:
    """[B, T - 1] float: 1 where token t + 1 is scored from column t (a real token, of the same sequence)."""
    if attention_mask is None:
        return torch.ones(input_ids.shape[0], input_ids.shape[1] - 1, device=input_ids.device)
    kept = attention_mask[:, 1:].float()
    if segment_ids is not None:
        kept = kept * (segment_ids[:, 1:] == segment_ids[:, :-1]).float()
    return kept


def token_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """log p(input_ids[:, t] | input_ids[:, <t]) under logits / temperature, with grad; [B, T], column 0 and pads are 0.

    ``input_ids`` are right-padded. Returns (logprobs, aux_loss) so the trainer can add the MoE balance loss.
    """
    s = token_scores(model, input_ids, attention_mask, temperature)
    return s.logprobs, s.aux_loss
