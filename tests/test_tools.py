"""Tool schemas and call validation, and how ToolEnv turns bad calls into observations. No Docker needed."""

from __future__ import annotations

import pytest

from sandforge.environments.base import ToolEnv
from sandforge.environments.tools import ToolError, call_tool, tool, tool_schemas
from sandforge.types import ToolCall


class Calculator:
    @tool
    def add(self, a: int, b: int = 0) -> str:
        """Add two integers.

        Everything after the first line stays out of the schema.
        """
        return str(a + b)

    @tool
    def scale(self, x: float, label: str, loud: bool = False) -> str:
        """Scale a number."""
        out = f"{label}={x * 2}"
        return out.upper() if loud else out

    def helper(self) -> str:  # not a tool
        return "hidden"


class Counter(ToolEnv):
    def __init__(self):
        super().__init__()
        self.count = 0

    @tool
    def bump(self, by: int) -> str:
        """Add to the counter."""
        self.count += by
        return str(self.count)

    @tool
    def submit(self) -> str:
        """Finish."""
        self.end_episode()
        return "done"


def test_schemas_follow_signatures_and_first_docstring_line():
    schemas = tool_schemas(Calculator())
    assert [s["name"] for s in schemas] == ["add", "scale"]
    assert schemas[0] == {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a"],
        },
    }
    assert schemas[1]["parameters"]["properties"] == {
        "x": {"type": "number"},
        "label": {"type": "string"},
        "loud": {"type": "boolean"},
    }
    assert schemas[1]["parameters"]["required"] == ["x", "label"]


def test_call_tool_runs_valid_calls():
    calc = Calculator()
    assert call_tool(calc, ToolCall("add", {"a": 2, "b": 3})) == "5"
    assert call_tool(calc, ToolCall("add", {"a": 2})) == "2"
    assert call_tool(calc, ToolCall("scale", {"x": 2, "label": "v"})) == "v=4"  # an int is a valid number
    assert call_tool(calc, ToolCall("scale", {"x": 1.5, "label": "v", "loud": True})) == "V=3.0"


@pytest.mark.parametrize(
    "call, expected",
    [
        (ToolCall("mul", {"a": 1}), ["unknown tool 'mul'", "add(a: integer, b: integer?)", "scale("]),
        (ToolCall("helper"), ["unknown tool 'helper'"]),
        (ToolCall("add", {}), ["missing argument 'a'", "usage: add(a: integer, b: integer?)"]),
        (ToolCall("add", {"a": 1, "c": 2}), ["unknown argument 'c'", "usage: add("]),
        (ToolCall("add", {"a": "1"}), ["'a' must be integer, got string"]),
        (ToolCall("add", {"a": True}), ["'a' must be integer, got boolean"]),
        (ToolCall("add", {"a": 1.5}), ["'a' must be integer, got number"]),
        (ToolCall("scale", {"x": "big", "label": "v"}), ["'x' must be number, got string"]),
        (ToolCall("scale", {"x": 1, "label": "v", "loud": "yes"}), ["'loud' must be boolean, got string"]),
        (ToolCall("add", ["a", 1]), ["arguments must be a JSON object"]),
    ],
)
def test_call_tool_explains_bad_calls(call, expected):
    with pytest.raises(ToolError) as err:
        call_tool(Calculator(), call)
    for fragment in expected:
        assert fragment in str(err.value)


def test_untyped_tool_parameters_are_rejected():
    class Bad:
        @tool
        def f(self, x) -> str:
            """No type."""
            return x

    with pytest.raises(TypeError, match="parameter 'x' must be typed"):
        tool_schemas(Bad())


def test_tool_env_turns_bad_calls_into_error_observations():
    env = Counter()
    assert env.reset() == ("", {})
    assert [t["name"] for t in env.tools] == ["bump", "submit"]

    obs, reward, terminated, truncated, info = env.step(ToolCall("bump", {"by": "two"}))
    assert obs.startswith("Error: bump: 'by' must be integer, got string")
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["executed"] is False and "integer" in info["error"]
    assert env.count == 0

    obs, _, _, _, info = env.step(ToolCall("jump"))
    assert obs.startswith("Error: unknown tool 'jump'") and "bump(by: integer)" in obs

    obs, _, terminated, _, info = env.step(ToolCall("bump", {"by": 2}))
    assert (obs, terminated, info) == ("2", False, {"executed": True})

    obs, _, terminated, _, info = env.step(ToolCall("submit"))
    assert (obs, terminated, info["executed"]) == ("done", True, True)

    obs, _, terminated, _, info = env.step(ToolCall("bump", {"by": 1}))
    assert terminated and not info["executed"] and obs.startswith("Error: the episode is over")
    assert env.count == 2


# --- parameter descriptions from an Args: section, the async episode interface ------------------------------------


class Search:
    @tool
    def grep(self, pattern: str, path: str = ".", limit: int = 0) -> str:
        """Search files for a pattern.

        Args:
            pattern: a regular expression,
                extended syntax.
            path (str): where to search.
            limit: stop after this many matches (0: all).

        Returns:
            the matching lines
        """
        return f"{pattern} in {path}"


def test_args_section_describes_each_parameter_in_the_schema():
    (schema,) = tool_schemas(Search())
    assert schema["description"] == "Search files for a pattern."
    assert schema["parameters"]["properties"] == {
        "pattern": {"type": "string", "description": "a regular expression, extended syntax."},
        "path": {"type": "string", "description": "where to search."},
        "limit": {"type": "integer", "description": "stop after this many matches (0: all)."},
    }
    assert schema["parameters"]["required"] == ["pattern"]


def test_args_naming_a_missing_parameter_is_a_definition_error():
    class Typo:
        @tool
        def grep(self, pattern: str) -> str:
            """Search.

            Args:
                patern: misspelt.
            """
            return pattern

    with pytest.raises(TypeError, match="tool grep: its docstring's Args names 'patern', not a parameter"):
        tool_schemas(Typo())


def test_async_interface_runs_the_same_episode():
    import asyncio

    class Echo(ToolEnv):
        @tool
        def echo(self, text: str) -> str:
            """Say it back."""
            return text

        @tool
        def submit(self) -> str:
            """Finish."""
            self.end_episode()
            return "ok"

    async def episode(env):
        await env.areset()
        first = await env.astep(ToolCall("echo", {"text": "hi"}))
        second = await env.astep(ToolCall("submit"))
        third = await env.astep(ToolCall("echo", {"text": "late"}))
        await env.aclose()
        return first, second, third

    first, second, third = asyncio.run(episode(Echo()))
    assert first[:3] == ("hi", 0.0, False) and second[:3] == ("ok", 0.0, True)
    assert third[0].startswith("Error: the episode is over") and third[2] is True
