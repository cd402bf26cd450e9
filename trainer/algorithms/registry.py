"""Algorithms by name (``trainer.algorithm``): an advantage function, a policy loss and the defaults they imply.

A config key left null (``trainer.loss_agg``, ``clip_eps_low``, ``clip_eps_high``, ``dynamic_sampling``,
``overlong_buffer``) takes the algorithm's default; a value set in the config always wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from sandforge.config import TrainerConfig

from . import advantages as adv
from .losses import PolicyLoss, cispo_loss, gspo_loss, ppo_clip_loss


@dataclass(frozen=True)
class Algorithm:
    advantages: adv.AdvantageFn
    loss: Callable[..., PolicyLoss]
    loss_agg: str = "token-mean"
    clip_eps_low: float | None = None  # None: trainer.clip_eps
    clip_eps_high: float | None = None
    value_head: bool = False  # PPO: a value head on the policy's last hidden state, trained alongside it
    dynamic_sampling: bool = False
    overlong_buffer: float = 0.0  # share of the response budget under the soft overlong penalty (0: off)


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(adv.grpo, ppo_clip_loss),
    "dr_grpo": Algorithm(adv.dr_grpo, ppo_clip_loss, loss_agg="seq-mean-token-sum"),
    "rloo": Algorithm(adv.rloo, ppo_clip_loss),
    "reinforce_pp": Algorithm(adv.reinforce_pp, ppo_clip_loss),
    "reinforce_pp_baseline": Algorithm(adv.reinforce_pp_baseline, ppo_clip_loss),
    "ppo": Algorithm(adv.ppo, ppo_clip_loss, value_head=True),
    # GSPO's sequence ratio stays near 1, so its clip range is tiny (the paper's 3e-4 / 4e-4)
    "gspo": Algorithm(adv.grpo, gspo_loss, loss_agg="seq-mean-token-mean", clip_eps_low=3e-4, clip_eps_high=4e-4),
    # CISPO: no lower bound on the weight; the upper bound only tames far off-policy tokens, it never drops them
    "cispo": Algorithm(adv.grpo, cispo_loss, clip_eps_low=1.0, clip_eps_high=4.0),
    "dapo": Algorithm(adv.grpo, ppo_clip_loss, clip_eps_high=0.28, dynamic_sampling=True, overlong_buffer=0.2),
}


@dataclass(frozen=True)
class Settings:
    """Everything the loss and the advantages need, resolved from ``trainer.*`` and the algorithm's defaults."""

    name: str
    algorithm: Algorithm
    loss_agg: str
    eps_low: float
    eps_high: float
    kl_coef: float
    kl_estimator: str
    kl_in: str  # "loss" or "reward"
    tis_cap: float | None
    entropy_coef: float
    value_coef: float
    gamma: float
    gae_lambda: float
    reward_signal: str  # "reward", "success" or "tiebreak" (advantages.signal_rewards)
    tiebreak_weight: float
    unended_fails: bool  # an episode the policy did not end itself trains as a failure (advantages.trained_successes)
    dynamic_sampling: bool
    dynamic_sampling_on: str  # "success" or "reward" (dapo.informative_groups)
    dynamic_sampling_max_rounds: int
    overlong_buffer: int  # tokens; 0: off
    overlong_penalty: float
    response_budget: int  # the most policy tokens an episode can have (L of seq-mean-token-sum, DAPO's L_max)

    @property
    def needs_scores(self) -> bool:
        """Does computing advantages need a forward pass of the trainer first (values, or KL in the reward)?"""
        return self.algorithm.value_head or (self.kl_in == "reward" and self.kl_coef > 0)


def resolve(trainer: TrainerConfig, response_budget: int) -> Settings:
    """Settings from the ``trainer`` section and the rollout's ``response_budget`` (the most policy tokens an episode
    can have)."""
    algo = ALGORITHMS[trainer.algorithm]

    def pick(value, default):
        return value if value is not None else default

    t = trainer
    return Settings(
        name=t.algorithm,
        algorithm=algo,
        loss_agg=pick(t.loss_agg, algo.loss_agg),
        eps_low=pick(t.clip_eps_low, t.clip_eps if algo.clip_eps_low is None else algo.clip_eps_low),
        eps_high=pick(t.clip_eps_high, t.clip_eps if algo.clip_eps_high is None else algo.clip_eps_high),
        kl_coef=t.kl_coef,
        kl_estimator=t.kl_estimator,
        kl_in=t.kl_in,
        tis_cap=t.tis_cap,
        entropy_coef=t.entropy_coef,
        value_coef=t.value_coef,
        gamma=t.gamma,
        gae_lambda=t.gae_lambda,
        reward_signal=t.reward_signal,
        tiebreak_weight=t.tiebreak_weight,
        unended_fails=t.unended_fails,
        dynamic_sampling=pick(t.dynamic_sampling, algo.dynamic_sampling),
        dynamic_sampling_on=t.dynamic_sampling_on,
        dynamic_sampling_max_rounds=t.dynamic_sampling_max_rounds,
        overlong_buffer=pick(t.overlong_buffer, int(algo.overlong_buffer * response_budget)),
        overlong_penalty=t.overlong_penalty,
        response_budget=int(response_budget),
    )
