"""Routing replay (R3): with the engine's recorded experts forced, the trainer's log-probs of the engine's tokens are
the engine's, even after the selection biases moved; the router mismatch rate sees the difference when not replaying."""

import asyncio
import copy
from dataclasses import replace

import pytest
import torch

from sandforge.types import GenerateRequest
from sandforge.models.sampling import token_logprobs
from sandforge.models.k3.latent_moe import LatentMoE
from sandforge.models.k3.model import PRESETS, K3Model
from sandforge.engine import EngineCore
from sandforge.trainer.routing_replay import RouterRecorder, mismatch_counts, replaying, routed_ids
from sandforge.types import TrainingRow

CFG = replace(PRESETS["k3-nano"], vocab_size=512, max_seq_len=96)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def episode(model: K3Model) -> TrainingRow:
    """Two engine turns of one session, assembled as the agent loop does: a row with routing at every fed position."""

    async def main():
        engine = EngineCore(model, seed=3)
        try:
            prompt = [1, 5, 9, 200, 17, 33, 4]
            req = GenerateRequest(prompt_ids=prompt, session_id="ep", max_tokens=12, temperature=1.0, seed=11)
            [a] = await engine.generate(req)
            seq = prompt + a.token_ids + [60, 61, 62]  # an observation appended
            [b] = await engine.generate(replace(req, prompt_ids=seq, seed=12))
            return prompt, a, seq, b
        finally:
            await engine.shutdown()

    prompt, a, seq, b = asyncio.run(main())
    tokens = seq + b.token_ids
    routed = [None] * len(tokens)
    routed[: len(prompt) + len(a.token_ids) - 1] = a.routed_experts
    start = b.cached_tokens
    routed[start : start + len(b.routed_experts)] = b.routed_experts
    mask = [0] * len(prompt) + [1] * len(a.token_ids) + [0] * 3 + [1] * len(b.token_ids)
    logprobs = [0.0] * len(prompt) + a.logprobs + [0.0] * 3 + b.logprobs
    assert b.cached_tokens > 0  # the second turn continued the session's cache
    return TrainingRow(token_ids=tokens, loss_mask=mask, logprobs=logprobs, routed_experts=routed)


def shifted_biases(model: K3Model, scale: float = 0.3) -> K3Model:
    """The same weights with other selection biases, as after a balancing update the engine has not seen yet."""
    moved = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    for m in moved.modules():
        if isinstance(m, LatentMoE):
            m.bias.copy_(torch.randn(m.bias.shape, generator=g) * scale)
    return moved


def score(model, row, replay: bool):
    ids = torch.tensor([row.token_ids])
    attn = torch.ones_like(ids)
    engine_ids = routed_ids([row], ids.shape[1])
    with torch.no_grad(), RouterRecorder(model) as router:
        lp, _ = token_logprobs(replaying(model, engine_ids if replay else None), ids, attn)
    counts = mismatch_counts(router.own_ids(), engine_ids, attn)
    rate = float(counts["router/mismatched"] / counts["router/known"])
    return lp[0], rate


def policy_error(lp, row) -> float:
    on = torch.tensor(row.loss_mask).bool()
    return float((lp[on] - torch.tensor(row.logprobs)[on]).abs().max())


def test_replay_reproduces_the_engine_logprobs_after_the_biases_moved():
    torch.manual_seed(0)
    engine_model = K3Model(CFG).eval()
    row = episode(engine_model)
    assert all(e is not None for e in row.routed_experts[:-1]) and row.routed_experts[-1] is None

    same_lp, same_rate = score(engine_model, row, replay=False)
    assert policy_error(same_lp, row) <= 1e-4 and same_rate == 0.0  # same weights: nothing to replay

    trainer_model = shifted_biases(engine_model)
    own_lp, own_rate = score(trainer_model, row, replay=False)
    replay_lp, replay_rate = score(trainer_model, row, replay=True)
    assert own_rate > 0.1 and replay_rate > 0.1  # the trainer's own router disagrees either way; replay overrides it
    assert policy_error(own_lp, row) > 1e-3  # without replay the ratio would see a policy the engine never ran
    assert policy_error(replay_lp, row) <= 1e-4


def test_unknown_routing_routes_by_itself():
    torch.manual_seed(0)
    model = K3Model(CFG).eval()
    row = episode(model)
    unknown = replace(row, routed_experts=[None] * len(row.token_ids))
    lp, _ = score(model, unknown, replay=True)
    plain, _ = score(model, replace(row, routed_experts=None), replay=False)
    assert routed_ids([unknown], 4) is None and torch.equal(lp, plain)
    half = replace(row, routed_experts=row.routed_experts[:5] + [None] * (len(row.token_ids) - 5))
    forced = routed_ids([half], len(row.token_ids) + 2)
    assert forced.shape[:2] == (1, len(row.token_ids) + 2) and (forced[0, 5:] == -1).all()
    lp_half, _ = score(model, half, replay=True)
    assert policy_error(lp_half, row) <= 1e-4
