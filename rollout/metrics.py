"""Per-step numbers about the episodes themselves (rewards, lengths, tool use, failures)."""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean

from sandforge.types import Trajectory


def rollout_metrics(trajs: list[Trajectory], prefix: str = "") -> dict[str, float]:
    ok = [t for t in trajs if not t.failed]
    m: dict[str, float] = {
        "episodes/count": len(trajs),
        "episodes/failed": len(trajs) - len(ok),
    }
    if not ok:  # still a row per step, so curves have no holes
        m |= {"reward/mean": 0.0, "success/rate": 0.0}
        return {prefix + k: v for k, v in m.items()}
    m["reward/mean"] = fmean(t.reward.value for t in ok)
    m["success/rate"] = fmean(float(t.reward.success) for t in ok)
    m["response/length_mean"] = fmean(t.response_tokens for t in ok)
    m["sequence/length_mean"] = fmean(len(t.token_ids) for t in ok)
    m["turns/mean"] = fmean(len(t.turns) for t in ok)
    m["tools/executed_per_episode"] = fmean(sum(x.executed for x in t.turns) for t in ok)
    m["tools/parse_errors_per_episode"] = fmean(sum(len(x.parse_errors) for x in t.turns) for t in ok)
    m["episodes/submitted"] = fmean(float(t.metadata.get("stop") == "submit") for t in ok)
    by_env: dict[str, list[float]] = defaultdict(list)
    for t in ok:
        by_env[t.task.env].append(float(t.reward.success))
    for env, wins in by_env.items():
        m[f"success/{env}"] = fmean(wins)
    return {prefix + k: v for k, v in m.items()}
