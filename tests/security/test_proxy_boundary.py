"""The recording proxy is a boundary (#56): a harness's request is the policy's doing, so whatever in it cannot be
rendered gets a 400 and the episode goes on; it never fails the episode (out of the gradient) as if sandforge had
broken. Attacks on a real proxy over its Unix socket, the harness's side."""

from __future__ import annotations

import pytest
from test_proxy import TOKEN, ScriptedEngine, _post, served  # noqa: F401 - served: the fixture

HI = [{"role": "user", "content": "hi"}]


def tool(**function) -> list[dict]:
    return [{"type": "function", "function": {"name": "bash", **function}}]


@pytest.mark.parametrize("tools", [
    tool(parameters="a string"),
    tool(parameters={"type": "object", "properties": ["command"]}),
    tool(parameters={"type": "object", "properties": {"command": "string"}}),
    tool(parameters={"type": "object", "properties": {"command": {"type": "string"}}, "required": "command"}),
    tool(parameters=[1, 2]),
    tool(description={"nested": True}),
    [{"type": "function", "function": {"name": "bash"}}, "not a tool"],
], ids=["parameters-str", "properties-list", "property-str", "required-str", "parameters-list", "description-dict",
        "tool-str"])
def test_tool_schemas_that_cannot_be_rendered_get_a_400_and_the_episode_goes_on(served, tools):
    s = served(ScriptedEngine([]))
    r = _post(s, {"model": "m", "messages": HI, "tools": tools})
    assert r.status_code == 400, r.text
    assert s.proxy.failure == "" and s.proxy.ended is None
    ok = _post(s, {"model": "m", "messages": HI})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "done"
    assert len(s.proxy.refused) == 1


def test_an_honest_tool_schema_is_served(served):
    s = served(ScriptedEngine([]))
    tools = tool(description="run a command", parameters={"type": "object", "properties": {
        "command": {"type": "string", "description": "the command"}}, "required": ["command"]})
    assert _post(s, {"model": "m", "messages": HI, "tools": tools}).status_code == 200
    assert s.proxy.failure == "" and not s.proxy.refused
