"""One episode of a ``verifiers`` environment, its model calls served and recorded by sandforge.

verifiers runs the episode as it would anywhere (``Env.run_episode``): its chat program (in this worker:
environments/vf/chat_harness.py), its interception server in the rollout worker, the environment's own ``run`` (a
scripted user for a multi-turn env) and, at the end, the task's own ``@vf.reward`` functions. The one thing sandforge changes is the endpoint: verifiers'
eval client relays every completion to this episode's recording proxy (rollout/proxy.py) on the host's loopback, with
the episode's token in ``X-Sandforge-Episode``. So the rows are the proxy's (exactly the tokens the engine produced,
split where the conversation was rewritten), and the reward is what verifiers computed: the sum of the trace's
weighted rewards. Success: every named reward scored 1.

Like ``run_episode``, this never raises. A reply verifiers cannot use scores what its rubric gives it, and a rubric
that raises or records nothing once the policy has replied scores 0 with the cause ``malformed``: what broke it is the
policy's reply (#56). An engine that fails, or an environment that fails before the policy's first reply (no request
made), fails this episode only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from typing import Any

from sandforge.environments.task_sources import TaskSourceError
from sandforge.environments.vf.library import uv_on_path, vf
from sandforge.environments.vf.tasks import HARNESS, AgentLimits, load_env, task_list
from sandforge.rollout.episode import EpisodeLimits, ended, fail, fill_rows, release
from sandforge.rollout.policy_client import Policy, PolicyError
from sandforge.rollout.proxy import EPISODE_HEADER, MODEL_NAME, EpisodeProxy, ProxyBudget
from sandforge.types import Reward, Task, Trajectory

GRACE = 60.0  # seconds past rollout.episode_timeout for verifiers to stop its program and score


class EnvironmentFault(RuntimeError):
    """The verifiers environment itself failed (its program, its rubric): the episode fails."""


class VerifiersEnvs:
    """The verifiers environments a rollout worker runs: each loaded once, on first use, and held in its
    ``serving()`` context (interception server, shared tools) until ``close()``."""

    def __init__(self, limits: AgentLimits = AgentLimits(), harness: str = HARNESS) -> None:
        self.limits = limits  # where verifiers stops the agent, and scores
        self.harness = harness  # environments/vf/tasks.py's HARNESS (in the worker) or REFERENCE_HARNESS
        self._envs: dict[str, tuple[Any, list[Any]]] = {}
        self._stack = contextlib.AsyncExitStack()
        self._lock = asyncio.Lock()

    async def get(self, module: str, args: dict[str, Any]) -> tuple[Any, list[Any]]:
        """The environment and its tasks (in ``load()`` order)."""
        key = json.dumps([module, args], sort_keys=True)
        async with self._lock:
            if key not in self._envs:
                uv_on_path()
                env = await asyncio.to_thread(load_env, module, args, self.limits, self.harness)
                tasks = await asyncio.to_thread(task_list, env)
                await self._stack.enter_async_context(env.serving())
                self._envs[key] = (env, tasks)
        return self._envs[key]

    async def close(self) -> None:
        await self._stack.aclose()
        self._envs.clear()


def agent_limits(limits: EpisodeLimits, budget: ProxyBudget) -> AgentLimits:
    """verifiers' own stops for an episode under ``limits`` and ``budget``."""
    return AgentLimits(max_turns=budget.max_requests, max_output_tokens=budget.max_tokens,
                       timeout=limits.episode_timeout)


def reward_of(episode: Any) -> Reward:
    """The episode's reward as verifiers scored it; EnvironmentFault where its rubric never produced one."""
    traces = list(episode.traces)
    if not traces:
        raise EnvironmentFault(f"verifiers ran no agent: {_errors(episode.errors)}")
    scored = [t for t in traces if t.rewards]
    if not scored:
        raise EnvironmentFault(f"verifiers recorded no reward: {_errors([e for t in traces for e in t.errors])}")
    value = sum(t.reward for t in scored) / len(scored)
    breakdown = {name: float(r.score) for t in scored for name, r in t.rewards.items() if r is not None}
    success = all(score >= 1.0 - 1e-9 for score in breakdown.values())
    notes = [e.message for t in traces for e in t.errors]
    reason = f"verifiers rewards {breakdown}" + (f"; the run's errors: {_errors(notes)}" if notes else "")
    return Reward(value=float(value), success=success, breakdown=breakdown, reason=reason[:2000])


def _errors(errors: list[Any]) -> str:
    texts = [e if isinstance(e, str) else f"{e.type}: {e.message}" for e in errors]
    return "; ".join(t[:300] for t in texts[-3:]) or "(none recorded)"


async def run_vf_episode(task: Task, envs: VerifiersEnvs, policy: Policy, chat, limits: EpisodeLimits,
                         budget: ProxyBudget, group: str, version: int = 0, session_id: str | None = None,
                         seed: int | None = None) -> Trajectory:
    """Run verifiers ``task`` (one of environments/vf/tasks.py's) with ``policy`` behind the proxy; always returns a
    Trajectory, never raises."""
    traj = Trajectory(task=task, group=group, policy_version=version)
    session = session_id or f"{group}/{uuid.uuid4().hex[:12]}"
    spec = task.setup["verifiers"]
    traj.metadata |= {"session": session, "verifiers": spec["id"]}
    start = time.monotonic()
    proxy: EpisodeProxy | None = None
    try:
        env, tasks = await envs.get(spec["id"], spec["args"])
        position = int(spec["position"])
        if position >= len(tasks) or tasks[position].key != spec["key"]:
            raise EnvironmentFault(f"task {task.id} is not at position {position} of verifiers environment "
                                   f"{spec['id']!r} on this worker: its tasks differ from the driver's")
        api = vf()
        token = secrets.token_urlsafe(24)
        proxy = EpisodeProxy(None, token, policy, chat, limits, budget, session, version, seed, tools=False)
        await proxy.start()
        client = api.EvalClientConfig(base_url=proxy.url, api_key_var="SANDFORGE_VERIFIERS_NO_KEY",
                                      headers={EPISODE_HEADER: token})
        ctx = api.ModelContext(model=MODEL_NAME, client=client, sampling=api.Sampling())
        timeout = None if limits.episode_timeout is None else limits.episode_timeout + GRACE
        episode = await asyncio.wait_for(env.run_episode(tasks[position], ctx), timeout)
        budget_spent = proxy.ended  # a budget of the proxy's ended it (before end() marks it done)
        proxy.end()
        await proxy.close()
        if proxy.failure:
            raise PolicyError(proxy.failure)
        if proxy.offered_tools:  # whatever the task declared: with no sandbox its tools would run on the host
            raise EnvironmentFault(f"the environment offered the policy tools ({', '.join(proxy.offered_tools)}), "
                                   "which would run its calls on the host: the episode was ended unanswered")
        if not proxy.recorder.turns:
            raise EnvironmentFault("the environment made no request to the policy: "
                                   f"{_errors([e for t in episode.traces for e in t.errors] + episode.errors)}")
        fill_rows(traj, proxy)
        try:
            traj.reward = reward_of(episode)
        except EnvironmentFault as e:
            # the policy has replied (above): a rubric that raised or recorded nothing was scoring what the policy
            # said, so it is the policy's 0 with a cause, never a failed episode (a losing policy could otherwise
            # make its losses vanish: a 5,000-digit guess broke guess_number's rubric)
            if budget_spent is not None:  # a budget of the proxy's refused a request before verifiers' own limit
                why, causes = f"the episode's budget ran out ({budget_spent}) before verifiers scored it", []
            else:
                why, causes = "verifiers' rubric gave the policy's replies no reward", ["malformed"]
            traj.reward = Reward(0.0, False, reason=f"{why}: {e}"[:2000], zero_causes=causes)
        traj.finish_reason = budget_spent or ("timeout" if episode.is_timeout else "submit")
        if proxy.refused:
            traj.metadata["proxy_refused"] = proxy.refused[-10:]
    except asyncio.TimeoutError:
        traj.failed, traj.failure = True, f"env: verifiers did not end the episode {GRACE:.0f} s after " \
                                          "rollout.episode_timeout"
    except (EnvironmentFault, TaskSourceError) as e:  # the environment's own fault: episodes/failed_env
        traj.failed, traj.failure = True, f"env: {e}"
    except Exception as e:  # one episode fails, never the run (a bug's traceback is kept)
        fail(traj, e)
    finally:
        await release(proxy, policy, session)
    return ended(traj, start)
