"""Fakes for agent-loop tests without Docker or a model: a ToolEnv with scripted tools, policies that replay replies."""

from __future__ import annotations

import asyncio
import threading
import time

from sandforge.environments.base import ToolEnv
from sandforge.environments.tools import tool
from sandforge.models.chat import ChatFormat
from sandforge.models.tokenizer import ByteTokenizer
from sandforge.rollout.episode import EpisodeLimits
from sandforge.types import GenerateRequest, Message, Reward, Sample, Task, ToolCall

CHAT = ChatFormat(ByteTokenizer())
TASK = Task(id="fake/1", env="fake", family="fake", seed=1, instruction="Do the thing.")


def grade(sandbox, task) -> Reward:
    return Reward(1.0, True, reason="graded")


def limits(**kw) -> EpisodeLimits:
    base = dict(max_turns=4, max_context=4096, max_new_tokens=512, stop_ids=CHAT.stop_ids)
    return EpisodeLimits(**{**base, **kw})


class FakeEnv(ToolEnv):
    """Tools that echo, sleep, print a lot or return queued results; records calls and whether it was closed."""

    def __init__(self, results: list[str] | None = None, concurrent: bool = False):
        super().__init__()
        self.results = list(results or [])
        self.concurrent_tools = concurrent
        self.log: list[tuple[str, float, float]] = []  # (tool, start, end)
        self.lock = threading.Lock()
        self.closed = 0
        self.sandbox = object()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return TASK.instruction, {"sandbox": "fake-box"}

    def close(self):
        self.closed += 1

    def _log(self, name, start):
        with self.lock:
            self.log.append((name, start, time.monotonic()))

    @tool
    def echo(self, text: str) -> str:
        """Say it back."""
        self._log("echo", time.monotonic())
        return text

    @tool
    def nap(self, seconds: float) -> str:
        """Sleep."""
        start = time.monotonic()
        time.sleep(seconds)
        self._log("nap", start)
        return f"slept {seconds}"

    @tool
    def shout(self, n: int) -> str:
        """Print a lot."""
        return "".join(chr(ord("a") + i % 26) for i in range(n))

    @tool
    def run(self, cmd: str) -> str:
        """Next queued result."""
        return self.results.pop(0) if self.results else ""

    @tool
    def submit(self) -> str:
        """Finish."""
        self.end_episode()
        return "submitted"


def reply(*calls: ToolCall, reasoning: str = "thinking", content: str = "", chat=CHAT) -> list[int]:
    return chat.render_assistant(Message("assistant", content, reasoning, list(calls)))


class ReplayPolicy:
    """Answers each request with the next scripted sample (token ids, or a dict with extra keys, or a callable of the
    request); records requests and closed sessions."""

    def __init__(self, samples, version: int = 7, delay: float = 0.0):
        self.samples = list(samples)
        self.version = version
        self.delay = delay
        self.requests: list[GenerateRequest] = []
        self.closed: list[str] = []

    async def generate(self, request: GenerateRequest) -> Sample:
        self.requests.append(request)
        item = self.samples.pop(0) if self.samples else reply(ToolCall("submit"))
        if callable(item):
            item = item(request)
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, (int, float)):  # a delay in seconds, then a submit
            await asyncio.sleep(item)
            item = reply(ToolCall("submit"))
        sample = item if isinstance(item, dict) else {"token_ids": item}
        ids = sample["token_ids"] = sample["token_ids"][: request.max_tokens]  # an engine never exceeds it
        base = {"logprobs": [-0.5] * len(ids), "version": self.version, "prefill_tokens": len(request.prompt_ids),
                "finish_reason": "stop" if ids and ids[-1] in CHAT.stop_ids else "length"}
        return Sample(**{**base, **sample})

    async def close_session(self, session_id: str) -> None:
        self.closed.append(session_id)
