"""Advantages: how each algorithm turns episode rewards into a weight for every policy token.

Every algorithm's function reads ``Episodes`` (tensors over each episode's *policy tokens only*: in a multi-turn
episode, tool output and prompt tokens are skipped, so the step after a policy token is the next policy token) and
returns one advantage per policy token, plus value targets for PPO. The verifier's reward arrives at the last policy
token; with ``trainer.kl_in: reward`` every policy token also carries -kl_coef * KL(policy || reference).

What the reward is (``trainer.reward_signal``, ``signal_rewards``): the verifier's value, partial credit included; or
success as 1/0, where ``tiebreak`` then lets partial credit order episodes of equal success within a group
(``tie_break``), scaled by ``trainer.tiebreak_weight`` and added after the algorithm's normalisation.

``token_advantages`` maps them back onto full sequences (0 off the loss mask) for the trainer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class TieBreak:
    """``trainer.reward_signal: tiebreak``: the partial credit that orders episodes of equal success in a group."""

    successes: list[bool]
    credit: list[float]  # per episode: the verifier's value in [0, 1]
    weight: float  # trainer.tiebreak_weight


@dataclass
class Episodes:
    rewards: list[float]  # per episode: the reward signal (after overlong shaping)
    groups: list[str]  # episodes of one task in one step share a group
    kl_penalty: list[Tensor]  # per episode [n_i]: kl_coef * KL per policy token (zeros unless trainer.kl_in is reward)
    values: list[Tensor] | None = None  # per episode [n_i]: the value head's estimates (PPO)
    tiebreak: TieBreak | None = None  # grpo, dr_grpo and rloo add it to their advantages


Advantages = tuple[list[Tensor], list[Tensor] | None]  # (per policy token advantages, value targets or None)


# ---------------------------------------------------------------- building blocks
def _members(groups: list[str]) -> list[list[int]]:
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    return list(members.values())


def group_advantages(rewards: list[float], groups: list[str], scale: bool = True, eps: float = 1e-6) -> list[float]:
    """GRPO: A_i = (r_i - mean(group)) / (std(group) + eps); Dr.GRPO drops the std (``scale=False``).

    A group of identical rewards gives zero advantage."""
    adv = [0.0] * len(rewards)
    for idx in _members(groups):
        r = torch.tensor([rewards[i] for i in idx], dtype=torch.float64)
        centred = r - r.mean()
        if scale and len(idx) > 1:
            centred = centred / (r.std(unbiased=False) + eps)
        for i, a in zip(idx, centred.tolist()):
            adv[i] = a
    return adv


def rloo_advantages(rewards: list[float], groups: list[str]) -> list[float]:
    """RLOO: A_i = r_i - mean of the *other* rewards of its group (0 for a group of one)."""
    adv = [0.0] * len(rewards)
    for idx in _members(groups):
        if len(idx) < 2:
            continue
        total = sum(rewards[i] for i in idx)
        for i in idx:
            adv[i] = rewards[i] - (total - rewards[i]) / (len(idx) - 1)
    return adv


def signal_rewards(signal: str, rewards: list[float], successes: list[bool]) -> list[float]:
    """``trainer.reward_signal``: ``reward`` trains on the verifier's value, partial credit included; ``success`` and
    ``tiebreak`` on 1.0 for a success and 0.0 for anything else (tiebreak's partial credit comes in ``tie_break``)."""
    return list(rewards) if signal == "reward" else [float(s) for s in successes]


ENDED_BY_POLICY = ("submit", "text")  # finish reasons of an episode that the policy ended itself (Trajectory)


def trained_successes(successes: list[bool], finish_reasons: list[str], unended_fails: bool) -> list[bool]:
    """The successes RL trains on: the verifier's, except that with ``trainer.unended_fails`` an episode the policy did
    not end itself (its turn limit, context or timeout cut it) is a failure. Without it such a success, graded on
    the sandbox as it stood, reinforces every turn it idled through before the cut as much as a submitted one."""
    if not unended_fails:
        return list(successes)
    return [s and f in ENDED_BY_POLICY for s, f in zip(successes, finish_reasons)]


def tie_break(adv: list[float], groups: list[str], tie: TieBreak | None) -> list[float]:
    """Partial credit as a tie-break on top of the success advantages ``adv``: each episode gains
    w * (credit - mean credit of the episodes of its group with the same success), added after the algorithm's
    normalisation, so never divided by a group's std: an all-fail group at 0.30/0.30/0.30/0.338 gets +-0.003, not
    +-1.73. Credit lies in [0, 1], so an episode's share stays under w.

    It never lifts a failure over a success of its group: w is capped at half the gap between the group's lowest
    success advantage and its highest failure advantage. On 1/0 success that gap is at least 1 (dr_grpo 1, grpo
    1/std >= 2, rloo n/(n-1)), so with tiebreak_weight <= 0.5 the cap bites only where shaping (the overlong penalty,
    KL in the reward) has narrowed it; where shaping has closed it, partial credit gets no weight."""
    if tie is None:
        return adv
    out = list(adv)
    for idx in _members(groups):
        wins = [adv[i] for i in idx if tie.successes[i]]
        fails = [adv[i] for i in idx if not tie.successes[i]]
        weight = tie.weight if not (wins and fails) else max(0.0, min(tie.weight, (min(wins) - max(fails)) / 2))
        for success in (True, False):
            same = [i for i in idx if tie.successes[i] == success]
            credit = [min(max(tie.credit[i], 0.0), 1.0) for i in same]  # a verifier's score is in [0, 1]
            for i, c in zip(same, credit):
                out[i] += weight * (c - sum(credit) / len(credit))
    return out


def token_rewards(reward: float, kl_penalty: Tensor) -> Tensor:
    """Per policy token: -KL penalty, plus the episode's reward on the last token."""
    r = -kl_penalty.double()
    if len(r):
        r[-1] += reward
    return r


def discounted_returns(rewards: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) r_s."""
    out, running = torch.zeros_like(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def gae(rewards: Tensor, values: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over one episode's policy tokens; the value after the last token is 0.

    delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},  returns (A, A + V)."""
    values = values.double()
    adv, running = torch.zeros_like(values), 0.0
    for t in range(len(values) - 1, -1, -1):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv, adv + values


def whiten(per_episode: list[Tensor], eps: float = 1e-6) -> list[Tensor]:
    """Normalise over every policy token of the batch: (x - mean) / (std + eps)."""
    flat = torch.cat(per_episode) if per_episode else torch.zeros(0)
    if flat.numel() == 0:
        return per_episode
    mean, std = flat.mean(), flat.std(unbiased=False)
    return [(x - mean) / (std + eps) for x in per_episode]


def _broadcast(per_episode: list[float], ep: Episodes) -> list[Tensor]:
    return [torch.full(p.shape, a, dtype=torch.float64) for a, p in zip(per_episode, ep.kl_penalty)]


def _penalised(ep: Episodes) -> list[float]:
    """Sequence-level rewards with the summed KL penalty subtracted (zero unless trainer.kl_in is reward)."""
    return [r - float(p.sum()) for r, p in zip(ep.rewards, ep.kl_penalty)]


# ---------------------------------------------------------------- one function per algorithm
def grpo(ep: Episodes, gamma: float = 1.0, lam: float = 1.0) -> Advantages:
    return _broadcast(tie_break(group_advantages(_penalised(ep), ep.groups), ep.groups, ep.tiebreak), ep), None


def dr_grpo(ep: Episodes, gamma: float = 1.0, lam: float = 1.0) -> Advantages:
    adv = group_advantages(_penalised(ep), ep.groups, scale=False)
    return _broadcast(tie_break(adv, ep.groups, ep.tiebreak), ep), None


def rloo(ep: Episodes, gamma: float = 1.0, lam: float = 1.0) -> Advantages:
    return _broadcast(tie_break(rloo_advantages(_penalised(ep), ep.groups), ep.groups, ep.tiebreak), ep), None


def reinforce_pp(ep: Episodes, gamma: float = 1.0, lam: float = 1.0, baseline: bool = False) -> Advantages:
    """REINFORCE++: per-token discounted returns (KL penalty included), normalised over the whole batch. The
    ``baseline`` variant first subtracts each group's mean reward (REINFORCE++-baseline)."""
    rewards = group_advantages(ep.rewards, ep.groups, scale=False) if baseline else ep.rewards
    returns = [discounted_returns(token_rewards(r, p), gamma) for r, p in zip(rewards, ep.kl_penalty)]
    return whiten(returns), None


def reinforce_pp_baseline(ep: Episodes, gamma: float = 1.0, lam: float = 1.0) -> Advantages:
    return reinforce_pp(ep, gamma, lam, baseline=True)


def ppo(ep: Episodes, gamma: float = 1.0, lam: float = 1.0) -> Advantages:
    """PPO: GAE from the value head's estimates; advantages whitened over the batch, value targets A + V kept raw."""
    if ep.values is None:
        raise ValueError("ppo needs the value head's estimates (Episodes.values)")
    out = [gae(token_rewards(r, p), v, gamma, lam) for r, p, v in zip(ep.rewards, ep.kl_penalty, ep.values)]
    return whiten([a for a, _ in out]), [ret for _, ret in out]


AdvantageFn = Callable[..., Advantages]


# ---------------------------------------------------------------- onto full sequences
def _positions(mask: list[int]) -> list[int]:
    return [t for t, m in enumerate(mask) if m]


def _spread(values: Tensor, positions: list[int], length: int) -> list[float]:
    full = [0.0] * length
    for t, v in zip(positions, values.tolist()):
        full[t] = v
    return full


def token_advantages(
    fn: AdvantageFn,
    rewards: list[float],
    groups: list[str],
    masks: list[list[int]],
    kl_penalty: list[list[float]] | None = None,  # per episode, per token of the full sequence
    values: list[list[float]] | None = None,  # likewise
    gamma: float = 1.0,
    lam: float = 1.0,
    tiebreak: TieBreak | None = None,  # trainer.reward_signal tiebreak (grpo, dr_grpo, rloo)
) -> tuple[list[list[float]], list[list[float]] | None]:
    """Advantages (and value targets) for every token of every sequence, 0 where the loss mask is 0."""
    positions = [_positions(m) for m in masks]

    def policy_only(per_token: list[list[float]] | None) -> list[Tensor] | None:
        if per_token is None:
            return None
        return [torch.tensor([seq[t] for t in pos], dtype=torch.float64) for seq, pos in zip(per_token, positions)]

    penalty = policy_only(kl_penalty) or [torch.zeros(len(pos), dtype=torch.float64) for pos in positions]
    adv, returns = fn(Episodes(list(rewards), list(groups), penalty, policy_only(values), tiebreak), gamma, lam)
    full_adv = [_spread(a, pos, len(m)) for a, pos, m in zip(adv, positions, masks)]
    if returns is None:
        return full_adv, None
    return full_adv, [_spread(r, pos, len(m)) for r, pos, m in zip(returns, positions, masks)]
