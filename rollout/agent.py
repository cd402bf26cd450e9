"""The multi-turn agent loop: one episode, token in and token out.

The sequence only grows: each turn the policy generates onto the end of it, and the tool results are rendered as tokens
appended after that. Nothing is re-rendered, so the trainer sees exactly the tokens the engine consumed and produced,
reasoning included. Bad model output becomes an error observation; a broken sandbox or verifier fails this episode only.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass
from typing import Awaitable, Callable

from sandforge.environments.sandbox.docker_sandbox import SandboxError
from sandforge.models.chat import ChatFormat
from sandforge.models.generate import Generation, SamplingParams
from sandforge.types import Message, Reward, Task, Trajectory, Turn
from sandforge.verifiers.base import VerifierError, score_task

Policy = Callable[[list[int], SamplingParams], Awaitable[Generation]]

NO_TOOL_CALL = "No tool call found. Call one of the tools, or call submit() when the task is done."


@dataclass
class EpisodeLimits:
    max_turns: int
    max_context: int
    sampling: SamplingParams


async def run_episode(task: Task, env, policy: Policy, chat: ChatFormat, limits: EpisodeLimits, group: str,
                      version: int = 0) -> Trajectory:
    """Run ``task`` in ``env`` (a ToolEnv, not yet reset) with ``policy``; always returns a Trajectory, never raises."""
    traj = Trajectory(task=task, group=group, policy_version=version)
    try:
        observation, info = await asyncio.to_thread(env.reset)
        traj.metadata["sandbox"] = info.get("sandbox", "")
        user = Message(role="user", content=observation)
        traj.messages.append(user)
        _extend(traj, chat.render_prompt(env.tools, [user]), policy_tokens=False)
        await _turns(traj, env, policy, chat, limits)
        traj.reward = await asyncio.to_thread(score_task, env.sandbox, task)
    except SandboxError as e:
        traj.failed, traj.failure = True, f"sandbox: {e}"
    except VerifierError as e:
        traj.failed, traj.failure = True, f"verifier: {e}"
    except Exception as e:  # anything else is a bug, but still one episode, not the run
        traj.failed, traj.failure = True, f"error: {type(e).__name__}: {e}"
        traj.metadata["traceback"] = traceback.format_exc()
    finally:
        await asyncio.to_thread(env.close)
    if traj.failed and traj.reward is None:
        traj.reward = Reward(value=0.0, success=False, reason=traj.failure)
    return traj


def _extend(traj: Trajectory, ids: list[int], policy_tokens: bool, logprobs: list[float] | None = None) -> None:
    traj.token_ids += ids
    traj.loss_mask += [1 if policy_tokens else 0] * len(ids)
    traj.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


async def _turns(traj: Trajectory, env, policy: Policy, chat: ChatFormat, limits: EpisodeLimits) -> None:
    for index in range(limits.max_turns):
        budget = min(limits.sampling.max_new_tokens, limits.max_context - len(traj.token_ids))
        if budget <= 0:
            traj.metadata["stop"] = "context"
            return
        params = SamplingParams(**{**limits.sampling.__dict__, "max_new_tokens": budget})
        prompt_tokens = len(traj.token_ids)
        t0 = time.perf_counter()
        gen = await policy(list(traj.token_ids), params)
        t1 = time.perf_counter()
        _extend(traj, gen.token_ids, policy_tokens=True, logprobs=gen.logprobs)
        message, errors = chat.parse_assistant(gen.token_ids)
        traj.messages.append(message)
        turn = Turn(index=index, prompt_tokens=prompt_tokens, generated_tokens=len(gen.token_ids),
                    observation_tokens=0, finish_reason=gen.finish_reason, tool_calls=message.tool_calls,
                    parse_errors=errors, seconds_generate=t1 - t0)
        traj.turns.append(turn)

        results: list[Message] = [Message(role="tool", name="error", content=f"Error: {e}") for e in errors]
        done = False
        for call in message.tool_calls:
            observation, _, terminated, _, info = await asyncio.to_thread(env.step, call)
            turn.executed += int(bool(info.get("executed")))
            results.append(Message(role="tool", name=call.name, content=observation))
            if terminated:
                done = True
                break
        if not results:
            results.append(Message(role="tool", name="error", content=NO_TOOL_CALL))
        turn.observations = [r.content for r in results]
        turn.seconds_tools = time.perf_counter() - t1
        traj.messages += results
        if done:
            traj.metadata["stop"] = "submit"
            return
        if index + 1 < limits.max_turns:
            appended = chat.render_observations(results, closed=gen.finish_reason == "stop")
            _extend(traj, appended, policy_tokens=False)
            turn.observation_tokens = len(appended)
    traj.metadata["stop"] = "max_turns"


def scripted_policy(task: Task, chat: ChatFormat) -> Policy:
    """Replays the task's reference solution, one tool call per turn, as the tokens the policy would emit.

    Used to collect verified demonstrations for the supervised warm start; logprobs are 0 (they are never used).
    """
    calls = list(task.solution)

    async def act(token_ids: list[int], params: SamplingParams) -> Generation:
        call = calls.pop(0) if calls else None
        if call is None:
            msg = Message(role="assistant", reasoning="done", tool_calls=[])
        else:
            msg = Message(role="assistant", reasoning=f"I will use {call.name}.", tool_calls=[call])
        ids = chat.render_assistant(msg)
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")

    return act
