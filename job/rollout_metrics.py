"""Per-step numbers about the episodes themselves: rewards, how episodes and turns ended, tool use and tool errors,
engine cache hits, time spent. Rewards and lengths count the episodes that reach the gradient (not failed); how
episodes ended, failures by kind and timings count every episode."""

from __future__ import annotations

from collections import Counter, defaultdict
from statistics import fmean

from sandforge.types import ZERO_CAUSES, Trajectory

EPISODE_ENDS = ("submit", "text", "max_turns", "context", "timeout", "error")
TURN_ENDS = ("stop", "length", "context", "timeout")
FAILURE_KINDS = ("sandbox", "verifier", "engine", "tool", "env", "worker", "error")


def _failure_kind(t: Trajectory) -> str:
    """"sandbox", "verifier", "engine", "tool", "env", "worker" or "error": the prefix the agent and worker give a
    failure ("worker": the rollout worker running it died)."""
    kind = t.failure.split(":", 1)[0].strip()
    return kind if kind in FAILURE_KINDS else "error"


def rollout_metrics(trajs: list[Trajectory], prefix: str = "") -> dict[str, float]:
    ok = [t for t in trajs if not t.failed]
    m: dict[str, float] = {
        "episodes/count": len(trajs),
        "episodes/failed": len(trajs) - len(ok),
    }
    ends = Counter(t.finish_reason or "error" for t in trajs)
    for end in EPISODE_ENDS:  # every key every step, so curves have no holes
        m[f"episodes/finish_{end}"] = ends[end] / len(trajs) if trajs else 0.0
    m["episodes/timeouts"] = ends["timeout"]
    kinds = Counter(_failure_kind(t) for t in trajs if t.failed)
    for kind in FAILURE_KINDS:
        m[f"episodes/failed_{kind}"] = kinds[kind]

    turns = [x for t in trajs for x in t.turns]
    if turns:
        turn_ends = Counter(x.finish_reason for x in turns)
        for end in TURN_ENDS:
            m[f"turns/finish_{end}"] = turn_ends[end] / len(turns)
        m["time/generate_per_turn"] = fmean(x.seconds_generate for x in turns)
        m["time/tools_per_turn"] = fmean(x.seconds_tools for x in turns)
        cached, prefilled = sum(x.cached_tokens for x in turns), sum(x.prefill_tokens for x in turns)
        m["tokens/cached"], m["tokens/prefilled"] = cached, prefilled
        m["tokens/cache_hit_rate"] = cached / (cached + prefilled) if cached + prefilled else 0.0
    if trajs:
        m["time/episode_mean"] = fmean(t.metadata.get("seconds", 0.0) for t in trajs)
        m["time/episode_max"] = max(t.metadata.get("seconds", 0.0) for t in trajs)
        m["time/sandbox_wait_mean"] = fmean(t.metadata.get("seconds_sandbox_wait", 0.0) for t in trajs)

    if not ok:
        m |= {"reward/mean": 0.0, "success/rate": 0.0}
        return {prefix + k: v for k, v in m.items()}
    m["reward/mean"] = fmean(t.reward.value for t in ok)
    zeroed = Counter(cause for t in ok for cause in t.reward.zero_causes)
    for cause in ZERO_CAUSES:  # graded 0 for what the policy left (a FIFO, a link out...): verdicts, not failures
        m[f"reward/zero_{cause}"] = zeroed[cause]
    m["success/rate"] = fmean(float(t.reward.success) for t in ok)
    m["response/length_mean"] = fmean(t.response_tokens for t in ok)
    # every training sequence: an episode whose harness rewrote its history trains on its earlier rows too
    m["sequence/length_mean"] = fmean(len(row.token_ids) for t in ok for row in t.rows())
    m["turns/mean"] = fmean(len(t.turns) for t in ok)
    m["turns/max"] = max(len(t.turns) for t in ok)
    m["tools/calls_per_episode"] = fmean(sum(len(x.tool_calls) for x in t.turns) for t in ok)
    m["tools/executed_per_episode"] = fmean(sum(x.executed for x in t.turns) for t in ok)
    m["tools/errors_per_episode"] = fmean(sum(len(x.tool_errors) for x in t.turns) for t in ok)
    m["tools/parse_errors_per_episode"] = fmean(sum(len(x.parse_errors) for x in t.turns) for t in ok)
    m["tools/truncated_outputs_per_episode"] = fmean(sum(x.truncated_outputs for x in t.turns) for t in ok)
    m["episodes/submitted"] = ends["submit"] / len(ok)  # among graded episodes
    by_env: dict[str, list[float]] = defaultdict(list)
    for t in ok:
        by_env[t.task.env].append(float(t.reward.success))
    for env, wins in by_env.items():
        m[f"success/{env}"] = fmean(wins)
    m |= named_reward_means(ok)
    return {prefix + k: v for k, v in m.items()}


def named_reward_means(trajs: list[Trajectory]) -> dict[str, float]:
    """``reward/<env>/<name>``: the mean of each named reward (Harbor's reward.json ``{"correctness": 1,
    "performance": 0.5}``) over the episodes whose checks reported it, so each becomes a curve of its own. Named
    rewards are the breakdown parts of checks that make one reward of several (``takes_reward_rule``)."""
    from sandforge.verifiers.checks import takes_reward_rule

    named: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        for i, check in enumerate(t.task.checks):
            if not takes_reward_rule(check.get("verifier")):
                continue
            head = f"{check.get('verifier')}:{check.get('path', i)}/"
            for key, value in t.reward.breakdown.items():
                if key.startswith(head):
                    named[f"reward/{t.task.env}/{key[len(head):]}"].append(value)
    return {key: fmean(values) for key, values in sorted(named.items())}
