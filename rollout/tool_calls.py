"""One turn's tool calls: at most ``max_calls`` run, in call order or concurrently, and each answers.

Each call becomes one tool message, in call order; a parse error, an unknown tool, bad arguments or a call over
the per-turn cap becomes an "Error: ..." message that says what to fix. Which tools exist and which argument types they
take is checked by the environment's dispatch (``environments/tools.py``), the same for every chat format: parsers only
read syntax. Every observation is cut to ``max_output`` characters (head and tail, with a marker saying how much went).

Calls run concurrently only where the environment says its tools allow it (``concurrent_tools = True``); otherwise in
order, because a later call may depend on what an earlier one changed. A call that has started is never abandoned
mid-way (the sandbox's own exec timeout bounds it), so the verifier never grades a sandbox that a tool is still
changing; after the episode's deadline (or a call that ends the episode) no new call starts, and the calls that never
started get no message, since the model never sees another turn. A call still running ``grace`` seconds past the
deadline fails the episode.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from sandforge.types import Message, ToolCall


class ToolHang(RuntimeError):
    """A tool call outlived the episode's deadline by more than the grace period: the sandbox cannot be graded."""


@dataclass
class ToolOutcome:
    results: list[Message] = field(default_factory=list)  # parse errors first, then one message per call, in order
    errors: list[str] = field(default_factory=list)  # what the environment rejected, and calls that did not run
    executed: int = 0  # calls that ran in the environment
    terminated: bool = False  # a call ended the episode (submit)
    truncated: int = 0  # observations cut to max_output


def truncate_output(text: str, limit: int) -> tuple[str, bool]:
    """``text`` within ``limit`` characters (head and tail kept) plus a one-line marker, and whether it was cut."""
    if len(text) <= limit:
        return text, False
    head = limit // 2
    tail = limit - head
    marker = f"\n[... {len(text) - limit} of {len(text)} characters cut from the middle of this output ...]\n"
    return text[:head] + marker + text[len(text) - tail :], True


def error_message(text: str, call: ToolCall | None = None) -> Message:
    return Message(role="tool", name=call.name if call else "error", content=f"Error: {text}",
                   tool_call_id=call.id if call else "")


async def run_tool_calls(env, calls: list[ToolCall], parse_errors: list[str], *, max_calls: int, max_output: int,
                         deadline: float | None = None, grace: float = 60.0) -> ToolOutcome:
    """Run ``calls`` in ``env`` (a ToolEnv); ``deadline`` is a ``time.monotonic()`` after which no call starts."""
    out = ToolOutcome(results=[error_message(e) for e in parse_errors])
    run, over = calls[:max_calls], calls[max_calls:]
    answers: list[tuple[str, bool, dict] | None] = [None] * len(run)

    async def step(i: int) -> None:
        observation, _, terminated, _, info = await env.astep(run[i])
        answers[i] = (str(observation), bool(terminated), info if isinstance(info, dict) else {})

    async def in_order() -> None:
        for i in range(len(run)):
            if out.terminated or (deadline is not None and time.monotonic() >= deadline):
                return
            await step(i)
            out.terminated = answers[i][1]

    work = asyncio.gather(*(step(i) for i in range(len(run)))) if getattr(env, "concurrent_tools", False) \
        else asyncio.ensure_future(in_order())
    limit = None if deadline is None else max(0.0, deadline - time.monotonic()) + grace
    done, _ = await asyncio.wait({work}, timeout=limit)
    if not done:
        work.cancel()  # the threads themselves cannot be stopped; the env's close() removes what they work on
        raise ToolHang(f"a tool call was still running {grace:g}s after the episode's time limit")
    work.result()  # a SandboxError (or an env bug) fails the episode

    for call, answer in zip(run, answers):
        if answer is None:  # not started: an earlier call ended the episode, or the time ran out
            continue
        observation, terminated, info = answer
        out.terminated |= terminated
        out.executed += int(bool(info.get("executed")))
        if info.get("error"):
            out.errors.append(str(info["error"]))
        out.results.append(Message(role="tool", name=call.name, content=observation, tool_call_id=call.id))
    for k, call in enumerate(over, start=max_calls + 1):
        text = f"tool call {k} ({call.name}) was not run: at most {max_calls} tool calls run per turn"
        out.errors.append(text)
        out.results.append(error_message(text + "; make the remaining calls in the next turn", call))
    for m in out.results:
        m.content, cut = truncate_output(m.content, max_output)
        out.truncated += cut
    return out
