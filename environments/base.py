"""The gymnasium interface every sandforge environment shares: text observations, tool calls as actions."""

from __future__ import annotations

import asyncio
import string
from typing import Any

import gymnasium
from gymnasium import spaces

from sandforge.environments.tools import ToolError, call_tool, tool_schemas
from sandforge.types import ToolCall

MAX_OBSERVATION_CHARS = 1 << 20
SAMPLE_TEXT_CHARS = 32  # longest string argument ``ToolCallSpace.sample`` makes
SAMPLE_INT_HIGH = 100  # sampled integers are in [0, SAMPLE_INT_HIGH): element ids, counts, line numbers
_SAMPLE_CHARSET = string.ascii_letters + string.digits  # one shell word: a sampled command cannot chain or redirect


class ObservationText(spaces.Text):
    """``spaces.Text`` of any Unicode characters: observations are command output and file text, which may hold
    anything. ``sample`` draws printable ASCII; ``contains`` accepts every string of an allowed length."""

    def __init__(self, max_length: int, *, min_length: int = 0, seed: int | None = None) -> None:
        super().__init__(max_length, min_length=min_length, charset=string.printable, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"ObservationText({self.min_length}, {self.max_length})"


_JSON_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
}


class ToolCallSpace(gymnasium.Space):
    """Actions are ``sandforge.types.ToolCall``s of the env's tools (``tools``: their schemas, as the prompt shows).

    ``contains`` holds a call the env would run: a known tool, every required argument, no unknown one, each of its
    JSON type. ``sample`` draws a uniformly chosen tool with arguments of the right types (each optional one half the
    time): strings of 1 to ``SAMPLE_TEXT_CHARS`` letters and digits, integers in [0, ``SAMPLE_INT_HIGH``), numbers in
    [0, 1), booleans. A sampled call runs; what it does is usually an error the env reports, as for a weak policy.
    """

    def __init__(self, tools: list[dict], seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.tools = {t["name"]: t["parameters"] for t in tools}

    def contains(self, x: Any) -> bool:
        if not isinstance(x, ToolCall) or not isinstance(x.name, str) or not isinstance(x.arguments, dict):
            return False
        params = self.tools.get(x.name)
        if params is None:
            return False
        properties = params["properties"]
        if not set(params["required"]) <= set(x.arguments) or not set(x.arguments) <= set(properties):
            return False
        return all(_JSON_CHECKS[properties[k]["type"]](v) for k, v in x.arguments.items())

    def sample(self, mask: Any = None, probability: Any = None) -> ToolCall:
        if mask is not None or probability is not None:
            raise ValueError("ToolCallSpace.sample takes no mask or probability")
        rng = self.np_random
        name = list(self.tools)[int(rng.integers(len(self.tools)))]
        params = self.tools[name]
        arguments = {}
        for arg, schema in params["properties"].items():
            if arg in params["required"] or rng.integers(2):
                arguments[arg] = self._value(schema["type"])
        return ToolCall(name, arguments)

    def _value(self, kind: str) -> Any:
        rng = self.np_random
        if kind == "string":
            return "".join(rng.choice(list(_SAMPLE_CHARSET), size=int(rng.integers(1, SAMPLE_TEXT_CHARS + 1))))
        if kind == "integer":
            return int(rng.integers(SAMPLE_INT_HIGH))
        if kind == "number":
            return float(rng.random())
        return bool(rng.integers(2))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToolCallSpace) and self.tools == other.tools

    def __repr__(self) -> str:
        calls = ", ".join(f"{n}({', '.join(p['properties'])})" for n, p in self.tools.items())
        return f"ToolCallSpace({calls})"


def as_tool_call(action: Any) -> ToolCall:
    """The policy's action as a ToolCall: a ToolCall, or a mapping ``{"name": ..., "arguments": {...}}`` (the JSON a
    client sends). ToolError for anything else, so a malformed action is an observation, never an exception."""
    if isinstance(action, dict) and isinstance(action.get("name"), str):
        return ToolCall(action["name"], action.get("arguments", {}), str(action.get("id", "")))
    if not isinstance(action, ToolCall) or not isinstance(action.name, str):
        raise ToolError("an action is a tool call, ToolCall(name, arguments) or {'name': ..., 'arguments': {...}}; "
                        f"got {type(action).__name__}: {str(action)[:200]}")
    return action


def cut_observation(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters: head and tail kept around a marker that says the middle went."""
    if len(text) <= limit:
        return text
    marker = f"\n[... the middle of these {len(text)} characters was cut ...]\n"
    keep = limit - len(marker)
    if keep <= 0:
        return text[:limit]
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head):]


class ToolEnv(gymnasium.Env):
    """An episode is reset() -> instruction, then step(ToolCall) -> observation until a tool ends it.

    ``step`` never raises for a bad action: an invalid tool call (or an action that is no tool call at all) becomes an
    "Error: ..." observation (with ``info["error"]``) so the policy sees what it did wrong. Only ``SandboxError``
    escapes, because a broken sandbox fails the whole episode. The reward is 0.0 except on the step that ends the
    episode, which gets ``episode_reward()``: 0.0 here, the verifiers' grade in a ``SandboxEnv`` given ``score``.

    ``max_steps``: the episode is truncated (and still graded) after that many steps; None, no limit (the agent loop
    has its own turn limits). ``max_observation``: step observations are cut to that many characters (head and tail);
    None, only the tools' own caps apply (the agent loop cuts to ``rollout.max_tool_output`` itself).

    The async episode interface (``areset``, ``astep``, ``aclose``) is what an event loop running many episodes
    awaits: by default each runs its blocking counterpart in a worker thread; an env whose tools do async I/O
    overrides them and never ties up a thread.
    """

    metadata = {"render_modes": []}
    # Whether several calls of one turn may run at once (in threads). Only where no call can change what another sees:
    # otherwise the agent runs them in the order the policy wrote them.
    concurrent_tools = False

    def __init__(self, *, max_steps: int | None = None, max_observation: int | None = None) -> None:
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        if max_observation is not None and max_observation < 64:
            raise ValueError(f"max_observation must be at least 64 characters, got {max_observation}")
        self._done = False
        self._steps = 0
        self.max_steps = max_steps
        self.max_observation = max_observation
        self.observation_space = ObservationText(max_observation or MAX_OBSERVATION_CHARS)
        self.action_space = ToolCallSpace(self.tools)

    @property
    def tools(self) -> list[dict]:
        return tool_schemas(self)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self._done = False
        self._steps = 0
        return "", {}

    def begin_step(self) -> None:
        """A multi-step task's next step (rollout/steps.py): tools run again, in the sandbox as the steps before left
        it (no reset)."""
        self._done = False
        self._steps = 0

    def end_episode(self) -> None:
        """Called by a tool (e.g. ``submit``) to terminate the episode after it returns."""
        self._done = True

    def episode_reward(self, info: dict) -> float:
        """The reward of the step that ends the episode; may add what explains it to ``info``."""
        return 0.0

    def step(self, action: ToolCall) -> tuple[str, float, bool, bool, dict]:
        if self._done:
            error = "the episode is over; no more tool calls run"
            return f"Error: {error}", 0.0, True, False, {"executed": False, "error": error}
        self._steps += 1
        try:
            observation = call_tool(self, as_tool_call(action))
            info: dict = {"executed": True}
        except ToolError as e:
            observation, info = f"Error: {e}", {"executed": False, "error": str(e)}
        terminated = self._done
        truncated = not terminated and self.max_steps is not None and self._steps >= self.max_steps
        reward = 0.0
        if terminated or truncated:
            self._done = True
            reward = self.episode_reward(info)
        if self.max_observation is not None:
            observation = cut_observation(observation, self.max_observation)
        return observation, reward, terminated, truncated, info

    async def areset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        return await asyncio.to_thread(self.reset, seed=seed, options=options)

    async def astep(self, action: ToolCall) -> tuple[str, float, bool, bool, dict]:
        return await asyncio.to_thread(self.step, action)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def screenshots_png(self) -> list[bytes]:
        """PNG images of what the episode looked like, for the run's logs (a browser's pages); none by default. Called
        once the episode is graded, before ``close``."""
        return []
