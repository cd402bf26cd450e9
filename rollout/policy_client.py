"""How an episode asks a policy for tokens: one ``GenerateRequest`` in, one ``Sample`` out (both in sandforge.types).

The engine contract: ``generate(GenerateRequest) -> list[Sample]``, one per ``n``; the in-process ``EngineCore``, the
``EngineActor`` around it and the OpenAI-compatible ``RemoteEngine`` all answer it (sandforge.engine).

``EnginePolicy`` is the only adapter: it takes a Ray actor handle or any object with ``async generate(request)``
(and optionally ``close_session(session_id)``). ``scripted_policy`` answers the same calls with a task's reference
solution, for the supervised warm start.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Protocol

from sandforge.types import GenerateRequest, Message, Sample, Task

log = logging.getLogger(__name__)


class PolicyError(RuntimeError):
    """The engine failed or answered something that is not a sample; the episode fails, the run goes on."""


class Policy(Protocol):
    async def generate(self, request: GenerateRequest) -> Sample:
        """One sample for ``request`` (the engine contract above)."""
        ...

    async def close_session(self, session_id: str) -> None:
        """The episode is over: the engine may drop what it cached for ``session_id``."""
        ...


async def _call(obj: Any, method: str, *args: Any) -> Any:
    """``obj.method(*args)`` for a Ray actor handle (``.remote``, an awaitable ObjectRef) or a plain object."""
    fn = getattr(obj, method)
    remote = getattr(fn, "remote", None)
    result = remote(*args) if remote is not None else fn(*args)
    return await result if inspect.isawaitable(result) else result


class EnginePolicy:
    """A policy backed by an engine (Ray handle or in-process object). Checks the answer's shape, so a broken engine
    fails the episode with a readable reason instead of corrupting the trajectory."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def generate(self, request: GenerateRequest) -> Sample:
        try:  # a remote answer that is not a sample fails while its Sample is built, in here
            samples = await _call(self.engine, "generate", request)
        except Exception as e:  # noqa: BLE001 - a dead actor, an HTTP error, a bad request: this episode only
            raise PolicyError(f"engine: {type(e).__name__}: {e}") from e
        if isinstance(samples, Sample):  # an engine that answers one sample bare
            samples = [samples]
        if not isinstance(samples, list) or not samples:
            raise PolicyError(f"engine: expected a list of samples, got {type(samples).__name__}")
        return check_sample(samples[0])

    async def close_session(self, session_id: str) -> None:
        if not hasattr(self.engine, "close_session"):
            return
        try:
            await _call(self.engine, "close_session", session_id)
        except Exception as e:  # noqa: BLE001 - the episode is over either way; the engine evicts by itself later
            log.warning("engine: close_session(%s) failed: %s", session_id, e)


def check_sample(sample: Any) -> Sample:
    """The policy's answer, which must be a ``Sample`` (whose construction checked its shape); else PolicyError."""
    if not isinstance(sample, Sample):
        raise PolicyError(f"engine: expected a Sample, got {type(sample).__name__} {str(sample)[:120]}")
    return sample


class ScriptedPolicy:
    """Replays a task's reference solution, one tool call per turn, as the tokens the policy would emit.

    Used to collect verified demonstrations for the supervised warm start (logprobs are 0; they are never used).
    It ignores ``max_tokens``: a reference call is replayed whole. Its tokens carry ``version``.
    """

    def __init__(self, task: Task, chat: Any, version: int = 0) -> None:
        self.calls = list(task.solution)
        self.chat = chat
        self.version = version

    async def generate(self, request: GenerateRequest) -> Sample:
        call = self.calls.pop(0) if self.calls else None
        if call is None:
            msg = Message(role="assistant", reasoning="done")
        else:
            msg = Message(role="assistant", reasoning=f"I will use {call.name}.", tool_calls=[call])
        ids = self.chat.render_assistant(msg)
        return Sample(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", version=self.version,
                      prefill_tokens=len(request.prompt_ids))

    async def close_session(self, session_id: str) -> None:
        return None


def scripted_policy(task: Task, chat: Any, version: int = 0) -> ScriptedPolicy:
    return ScriptedPolicy(task, chat, version)
