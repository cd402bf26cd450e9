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


def test_a_body_past_what_the_context_can_hold_is_refused_unparsed(served, monkeypatch):
    """#56: 8 MiB bodies were parsed with json.loads on the rollout worker's shared loop before any budget check: one
    sandbox's flood stalled every other episode's requests for seconds. A body is now sized to the episode's context
    (``max_body``), a bigger one is refused unread, and a body that is parsed is parsed off the loop."""
    from sandforge.rollout import proxy as proxy_module

    import asyncio
    import threading

    s = served(ScriptedEngine([]), ctx=4096)
    limit = proxy_module.max_body(4096)
    assert limit < 8 << 20

    async def ident():
        return threading.get_ident()

    loop_thread = asyncio.run_coroutine_threadsafe(ident(), s.loop).result(10)
    parsed_on = []
    real_loads = proxy_module.json.loads

    def loads(text, *args, **kwargs):
        parsed_on.append(threading.get_ident() == loop_thread)
        return real_loads(text, *args, **kwargs)

    monkeypatch.setattr(proxy_module.json, "loads", loads)
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * (limit + 10)}]}
    assert _post(s, big).status_code == 413
    assert parsed_on == []  # refused unread
    assert _post(s, {"model": "m", "messages": [{"role": "user", "content": "y" * 3000}]}).status_code == 200
    assert parsed_on and not any(parsed_on)  # parsed, and not on the proxy's event loop
    assert _post(s, {"model": "m", "messages": HI}).status_code == 200


def test_refused_requests_count_against_the_episodes_budget(served):
    """#56: refused requests cost the episode nothing, so a sandbox could send them without end. Each refusal counts
    as a request: past ``max_requests`` of them the episode ends."""
    s = served(ScriptedEngine([]), max_requests=3)
    for _ in range(3):
        assert _post(s, {"model": "m", "messages": HI, "n": 2}).status_code == 400
    assert s.proxy.ended == "max_turns"
    assert _post(s, {"model": "m", "messages": HI}).status_code == 400


def test_a_proxy_without_tools_ends_the_episode_on_a_request_that_offers_some(tmp_path):
    """#56: a verifiers environment has no sandbox, so a tool it offers the model would run the model's calls on the
    host. Its proxy (``tools=False``) answers such a request with nothing and ends the episode, whatever the task
    declared; a tool-less request is served."""
    from test_proxy import Served

    s = Served(tmp_path, ScriptedEngine([]))
    s.proxy.tools = False
    try:
        assert _post(s, {"model": "m", "messages": HI}).status_code == 200
        r = _post(s, {"model": "m", "messages": HI, "tools": tool(parameters={"type": "object"})})
        assert r.status_code == 400 and s.proxy.ended == "tools" and s.proxy.offered_tools == ["bash"]
        assert len(s.proxy.recorder.turns) == 1
    finally:
        s.close()
