"""RL algorithms as small functions: advantages, per-token losses, loss aggregation, KL estimators, DAPO's sampling
and shaping, and a registry that ties them to ``trainer.algorithm``."""

from .advantages import TieBreak, group_advantages, signal_rewards, token_advantages, trained_successes  # noqa: F401
from .aggregate import MODES, Totals, aggregate  # noqa: F401
from .dapo import informative_groups, overlong_penalty  # noqa: F401
from .kl import kl_estimate  # noqa: F401
from .objective import MicroBatch, Stats, rl_objective, sft_objective  # noqa: F401
from .registry import ALGORITHMS, Settings, resolve  # noqa: F401
