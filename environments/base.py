"""The gymnasium interface every sandforge environment shares: text observations, tool calls as actions."""

from __future__ import annotations

import asyncio

import gymnasium
from gymnasium import spaces

from sandforge.environments.tools import ToolError, call_tool, tool_schemas
from sandforge.types import ToolCall

MAX_OBSERVATION_CHARS = 1 << 20


class ToolCallSpace(gymnasium.Space):
    """Actions are ``sandforge.types.ToolCall``s; which names and arguments are valid is the env's ``tools``."""

    def __init__(self) -> None:
        super().__init__(shape=None, dtype=None)

    def contains(self, x) -> bool:
        return isinstance(x, ToolCall)

    def sample(self, mask=None, probability=None) -> ToolCall:
        raise NotImplementedError("tool calls come from a policy; there is nothing meaningful to sample")


class ToolEnv(gymnasium.Env):
    """An episode is reset() -> instruction, then step(ToolCall) -> observation until a tool ends it.

    ``step`` never raises for a bad action: an invalid tool call becomes an "Error: ..." observation (with
    ``info["error"]``) so the policy sees what it did wrong. Only ``SandboxError`` escapes, because a broken sandbox
    fails the whole episode. Rewards come from verifiers after the episode, so ``step`` always returns 0.0.

    The async episode interface (``areset``, ``astep``, ``aclose``) is what an event loop running many episodes
    awaits: by default each runs its blocking counterpart in a worker thread; an env whose tools do async I/O
    overrides them and never ties up a thread.
    """

    metadata = {"render_modes": []}
    observation_space = spaces.Text(max_length=MAX_OBSERVATION_CHARS)
    action_space = ToolCallSpace()
    # Whether several calls of one turn may run at once (in threads). Only where no call can change what another sees:
    # otherwise the agent runs them in the order the policy wrote them.
    concurrent_tools = False

    def __init__(self) -> None:
        self._done = False

    @property
    def tools(self) -> list[dict]:
        return tool_schemas(self)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self._done = False
        return "", {}

    def end_episode(self) -> None:
        """Called by a tool (e.g. ``submit``) to terminate the episode after it returns."""
        self._done = True

    def step(self, action: ToolCall) -> tuple[str, float, bool, bool, dict]:
        if self._done:
            error = "the episode is over; no more tool calls run"
            return f"Error: {error}", 0.0, True, False, {"executed": False, "error": error}
        try:
            observation = call_tool(self, action)
            info = {"executed": True}
        except ToolError as e:
            observation, info = f"Error: {e}", {"executed": False, "error": str(e)}
        return observation, 0.0, self._done, False, info

    async def areset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        return await asyncio.to_thread(self.reset, seed=seed, options=options)

    async def astep(self, action: ToolCall) -> tuple[str, float, bool, bool, dict]:
        return await asyncio.to_thread(self.step, action)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)
