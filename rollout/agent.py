"""The multi-turn agent loop: one episode, token in and token out.

The sequence only grows: each turn the policy generates onto the end of it, and the tool results are rendered as tokens
appended after that. Nothing is re-rendered, so the trainer sees exactly the tokens the engine consumed and produced,
reasoning included. Bad model output becomes an error observation; a broken sandbox, engine or verifier fails this
episode only (``failed=True``, excluded from the gradient), and ``run_episode`` never raises.

Limits (``EpisodeLimits``, from the ``rollout`` config): ``max_turns``; ``max_new_tokens`` per turn; ``max_context``
for the whole sequence (a turn's budget shrinks to fit, and tool results that would leave no room end the episode
instead of being appended); ``episode_timeout`` seconds of wall clock from the first prompt (waiting for a sandbox is
not counted; generation is interrupted, a running tool call is not, see ``tool_calls``); ``max_tool_calls`` per turn;
``max_tool_output`` characters per observation. An episode that times out is still graded: the verifier judges the
sandbox as the policy left it, which is what a user expects of a time limit.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Callable

from sandforge.rollout import steps
from sandforge.rollout.episode import EpisodeLimits, ended, fail, turn_seed
from sandforge.rollout.policy_client import Policy, check_sample
from sandforge.rollout.tool_calls import ToolOutcome, run_tool_calls
from sandforge.types import (GenerateRequest, Message, Reward, Sample, SandboxError, Task, TokenRow, Trajectory,
                             Turn)
from sandforge.verifiers.checks import score_task

NO_TOOL_CALL = "no tool call found. Call one of the tools, or call submit() when the task is done."


async def run_episode(task: Task, env, policy: Policy, chat, limits: EpisodeLimits, group: str, version: int = 0,
                      session_id: str | None = None,
                      score: Callable[[Any, Task], Reward] = score_task, seed: int | None = None) -> Trajectory:
    """Run ``task`` in ``env`` (a ToolEnv, not yet reset) with ``policy``; always returns a Trajectory, never raises.

    ``session_id`` names the episode to the engine (its cache); the session is closed when the episode ends.
    ``score(env.sandbox, task)`` grades it afterwards. ``seed`` makes sampling reproducible: turn i's request carries
    ``turn_seed(seed, i)`` (the engine then samples it from a generator of its own, whatever else it batches).
    """
    traj = Trajectory(task=task, group=group, policy_version=version)
    session = session_id or f"{group}/{uuid.uuid4().hex[:12]}"
    traj.metadata["session"] = session
    start = time.monotonic()
    try:
        observation, info = await env.areset()
        traj.metadata["sandbox"] = info.get("sandbox", "") if isinstance(info, dict) else ""
        traj.metadata["seconds_reset"] = time.monotonic() - start
        if task.steps:  # a multi-step task: each step in a fresh context, graded as it ends (rollout/steps.py)
            traj.finish_reason, traj.reward, session = await _steps(traj, env, policy, chat, limits, session, seed,
                                                                    score)
        else:
            user = Message(role="user", content=observation)
            traj.messages.append(user)
            _extend(traj, chat.render_prompt(env.tools, [user]))
            deadline = None if limits.episode_timeout is None else time.monotonic() + limits.episode_timeout
            traj.finish_reason = await _turns(traj, env, policy, chat, limits, session, deadline, seed)
            traj.reward = await asyncio.to_thread(score, env.sandbox, task)
    except Exception as e:  # one episode fails, never the run (a bug's traceback is kept)
        fail(traj, e)
    finally:
        try:
            await policy.close_session(session)
        except Exception:  # noqa: BLE001 - the engine evicts the session by itself eventually
            pass
        await _keep_screenshots(traj, env)
        await env.aclose()
    return ended(traj, start)


def _extend(traj: Trajectory, ids: list[int], version: int | None = None, logprobs: list[float] | None = None,
            versions: list[int] | None = None) -> None:
    """Append ``ids``: the policy's own tokens when ``version`` is given, otherwise prompt / observation tokens.
    ``versions`` (one per token) replaces ``version`` in ``token_versions`` where the weights changed mid-reply."""
    n = len(ids)
    traj.token_ids += ids
    traj.loss_mask += [0 if version is None else 1] * n
    traj.logprobs += [float(x) for x in logprobs] if logprobs is not None else [0.0] * n
    if versions is None:
        versions = [-1 if version is None else version] * n
    traj.token_versions += [int(v) for v in versions]
    if traj.routed_experts is not None:
        traj.routed_experts += [None] * n


def _place_routing(traj: Trajectory, prompt_len: int, sample: Sample) -> None:
    """Routing of the tokens this request fed, ``prompt[cached:] + generated[:-1]``, at their positions."""
    routing = sample.routed_experts
    if routing is None:
        return
    start = int(sample.cached_tokens or 0)
    fed = prompt_len - start + max(0, len(sample.token_ids) - 1)
    if not isinstance(routing, list) or len(routing) != fed or start < 0:
        # misaligned routing would silently replay the wrong experts: drop it and say so
        traj.metadata["routing_errors"] = traj.metadata.get("routing_errors", 0) + 1
        return
    if traj.routed_experts is None:
        traj.routed_experts = [None] * len(traj.token_ids)
    traj.routed_experts[start : start + fed] = routing


async def answer_reply(env, chat, ids: list[int], limits: EpisodeLimits,
                       deadline: float | None = None) -> tuple[Message, list[str], ToolOutcome]:
    """Parse one reply and run its tool calls. Never raises for what the model wrote: every reply gets at least one
    tool message, the result of a call or an "Error: ..." that says what to fix (a broken sandbox still raises)."""
    message, errors = chat.parse_assistant(ids)
    notes = errors if (errors or message.tool_calls) else [NO_TOOL_CALL]
    outcome = await run_tool_calls(env, message.tool_calls, notes, max_calls=limits.max_tool_calls,
                                   max_output=limits.max_tool_output, deadline=deadline, grace=limits.tool_grace)
    return message, errors, outcome


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


async def _keep_screenshots(traj: Trajectory, env) -> None:
    """The env's screenshots (a browser's), base64 in ``metadata["screenshots_png"]`` until the run log writes them
    into the run directory. Best effort: a sandbox already gone has none to give."""
    shots = getattr(env, "screenshots_png", None)
    if shots is None or getattr(env, "_sandbox", True) is None:
        return
    try:
        images = await asyncio.to_thread(shots)
    except Exception:  # noqa: BLE001 - logs only: never fails the episode
        return
    if images:
        traj.metadata["screenshots_png"] = [base64.b64encode(png).decode() for png in images]


async def _steps(traj: Trajectory, env, policy: Policy, chat, limits: EpisodeLimits, session: str, seed: int | None,
                 score: Callable[[Any, Task], Reward]) -> tuple[str, Reward, str]:
    """A multi-step task's steps, in order, in ``env``'s one sandbox: each step's set-up (``steps.prepare``), its
    instruction in a fresh context (the step before's tokens become an earlier row: each trains as its own sequence) with an engine
    session of its own, its turns, then its checks; a step below its ``min_reward`` ends the episode. The last step's
    finish reason, the episode's reward (``steps.combine``) and the session still open."""
    task = traj.task
    begin = getattr(env, "begin_step", None)
    if begin is None:
        raise SandboxError(f"task {task.id} has steps, and its environment {type(env).__name__} cannot run a next "
                           "step in the same sandbox (it has no begin_step)")
    await asyncio.to_thread(steps.first_prepare, env.sandbox, task)
    results: list[steps.StepResult] = []
    finish, note, first = "", "", session
    for i, step in enumerate(task.steps):
        if i > 0:
            if why := await asyncio.to_thread(steps.prepare, env.sandbox, step):  # on what the policy left: its 0
                results.append(steps.StepResult(step.name, steps.unprepared(why)))
                note = f"the steps after {step.name} did not run"
                break
            traj.earlier_rows.append(TokenRow(traj.token_ids, traj.loss_mask, traj.logprobs, traj.token_versions,
                                              traj.routed_experts))
            traj.token_ids, traj.loss_mask, traj.logprobs, traj.token_versions = [], [], [], []
            traj.routed_experts = None
            try:
                await policy.close_session(session)
            except Exception:  # noqa: BLE001 - the engine evicts the session by itself eventually
                pass
            session = f"{first}/{step.name}"
            await asyncio.to_thread(begin)
        user = Message(role="user", content=step.instruction)
        traj.messages.append(user)
        _extend(traj, chat.render_prompt(env.tools, [user]))
        timeouts = [t for t in (step.agent_timeout, limits.episode_timeout) if t]  # the step's own, within the job's
        deadline = time.monotonic() + min(timeouts) if timeouts else None
        finish = await _turns(traj, env, policy, chat, limits, session, deadline,
                              None if seed is None else turn_seed(seed, 1_000_000 + i))
        reward = await asyncio.to_thread(score, env.sandbox, steps.step_task(task, i))
        results.append(steps.StepResult(step.name, reward))
        if steps.stops_after(step, reward) and i + 1 < len(task.steps):
            note = f"step {step.name} scored {reward.value:g}, below its min_reward {step.min_reward:g}: the steps " \
                   "after it did not run"
            break
    traj.metadata["steps"] = [r.to_json() for r in results]
    return finish, steps.combine(task, results, note), session


async def _turns(traj: Trajectory, env, policy: Policy, chat, limits: EpisodeLimits, session: str,
                 deadline: float | None, seed: int | None = None) -> str:
    """Generate and act until the episode ends; returns the episode's finish reason."""
    for index in range(limits.max_turns):
        room = limits.max_context - len(traj.token_ids)
        if room <= 0:
            return "context"
        budget = min(limits.max_new_tokens, room)
        prompt_len = len(traj.token_ids)
        turn = Turn(index=index, prompt_tokens=prompt_len, generated_tokens=0, observation_tokens=0, finish_reason="")
        left = _left(deadline)
        if left is not None and left <= 0:
            return "timeout"
        traj.turns.append(turn)
        request = GenerateRequest(prompt_ids=traj.token_ids, session_id=session, max_tokens=budget,
                                  temperature=limits.temperature, top_p=limits.top_p, top_k=limits.top_k,
                                  stop_ids=limits.stop_ids, n=1,
                                  seed=None if seed is None else turn_seed(seed, index))
        t0 = time.monotonic()
        try:
            sample = check_sample(await asyncio.wait_for(policy.generate(request), left))
        except asyncio.TimeoutError:
            turn.finish_reason, turn.seconds_generate = "timeout", time.monotonic() - t0
            return "timeout"
        t1 = time.monotonic()
        ids = [int(i) for i in sample.token_ids]
        turn.version = int(sample.version)
        turn.cached_tokens, turn.prefill_tokens = int(sample.cached_tokens), int(sample.prefill_tokens)
        versions = sample.token_versions  # an engine that swapped weights mid-reply says which sampled what
        versions = versions if isinstance(versions, list) and len(versions) == len(ids) else None
        _extend(traj, ids, version=turn.version, logprobs=sample.logprobs, versions=versions)
        _place_routing(traj, prompt_len, sample)
        finish = sample.finish_reason
        if finish == "length" and len(ids) >= budget and budget < limits.max_new_tokens:
            finish = "context"
        turn.generated_tokens, turn.finish_reason, turn.seconds_generate = len(ids), finish, t1 - t0

        message, errors, outcome = await answer_reply(env, chat, ids, limits, deadline)
        traj.messages.append(message)
        turn.tool_calls, turn.parse_errors = message.tool_calls, errors
        malformed = errors[1:] if finish in ("length", "context") else errors  # beyond the cut-off note: a bad call
        if limits.end_on_text and not message.tool_calls and not malformed:  # prose: its final answer, graded as is
            turn.seconds_tools = time.monotonic() - t1
            return "text"
        turn.seconds_tools = time.monotonic() - t1
        turn.observations = [r.content for r in outcome.results]
        turn.tool_errors, turn.executed, turn.truncated_outputs = outcome.errors, outcome.executed, outcome.truncated
        traj.messages += outcome.results
        if outcome.terminated:
            return "submit"
        if index + 1 == limits.max_turns:
            return "max_turns"
        left = _left(deadline)
        if left is not None and left <= 0:
            return "timeout"
        # closed only by the end-of-turn token itself: a reply stopped at a different eos still needs its turn closed
        appended = chat.render_observations(outcome.results, closed=bool(ids) and ids[-1] == chat.end_of_turn)
        if len(traj.token_ids) + len(appended) >= limits.max_context:
            return "context"  # the policy could not answer them: appending would only add dead tokens
        _extend(traj, appended)
        turn.observation_tokens = len(appended)
    return "max_turns"
