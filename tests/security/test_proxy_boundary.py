"""The recording proxy is a boundary (#56): a harness's request is the policy's doing, so whatever in it cannot be
rendered gets a 400 and the episode goes on; it never fails the episode (out of the gradient) as if sandforge had
broken. Attacks on a real proxy over its Unix socket, the harness's side."""

from __future__ import annotations

import copy
import random

import pytest
from test_proxy import TOKEN, ScriptedEngine, _post, served  # noqa: F401 - served: the fixture

from sandforge.rollout.chat_api import BadRequest, read_message, read_request, read_tools
from sandforge.rollout.messages_api import read_messages
from sandforge.rollout.responses_api import read_responses

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


def test_reading_and_rendering_run_off_the_loop_and_a_body_of_more_objects_than_tokens_is_refused(served,
                                                                                                    monkeypatch):
    """#56, measured by bench/proxy_flood.py: a body of a quarter of a million tiny messages (2 MiB, under
    ``max_body``) took 3 s to read into typed messages and 5 s to render, on the rollout worker's loop: another
    episode's request waited 4 s. The body is read and rendered off the loop, and a body with more JSON objects and
    arrays than the context has tokens (no conversation that fits has more) is refused before it is read."""
    from sandforge.rollout import proxy as proxy_module
    from sandforge.rollout.rows import RowRecorder

    import asyncio
    import threading

    s = served(ScriptedEngine([]), ctx=4096)

    async def ident():
        return threading.get_ident()

    loop_thread = asyncio.run_coroutine_threadsafe(ident(), s.loop).result(10)
    on_loop = []
    for owner, name in ((proxy_module, "read_request"), (RowRecorder, "prompt")):  # both looked up per request
        real = getattr(owner, name)

        def spy(*args, _real=real, **kwargs):
            on_loop.append(threading.get_ident() == loop_thread)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    many = {"model": "m", "messages": [{"role": "user", "content": "x"}] * 4096}
    r = _post(s, many)
    assert r.status_code == 400 and "JSON objects and arrays" in r.json()["error"]["message"], r.text
    assert on_loop == []  # refused before it was read
    assert _post(s, {"model": "m", "messages": [{"role": "user", "content": "x"}] * 300}).status_code == 200
    assert len(on_loop) == 2 and not any(on_loop), on_loop  # read and rendered, neither on the loop


def test_an_episodes_requests_are_answered_one_at_a_time(served):
    """#56: one connection at a time per episode. Requests a sandbox sends at once queue behind each other, from
    reading the body to the reply: the engine never holds two generations of one episode."""
    import threading

    class Counting(ScriptedEngine):
        def __init__(self):
            super().__init__([])
            self.running, self.most = 0, 0

        async def generate(self, request):
            import asyncio

            self.running += 1
            self.most = max(self.most, self.running)
            await asyncio.sleep(0.05)
            self.running -= 1
            return await super().generate(request)

    engine = Counting()
    s = served(engine, max_requests=20)
    codes = []
    threads = [threading.Thread(target=lambda: codes.append(_post(s, {"model": "m", "messages": HI}).status_code))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert codes == [200] * 6 and len(engine.requests) == 6
    assert engine.most == 1, engine.most


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


# --- the request models themselves (rollout/chat_api.py): what any body of any shape is answered ------------------

USER = {"role": "user", "content": "hi"}
ASSISTANT_CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}
PYDANTIC_WORDS = ("Input should", "Field required", "Value error", "validation error", "Assertion failed")


def params(schema) -> dict:
    return {"messages": [USER], "tools": tool(parameters=schema)}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("body, says", [
    (5, "the body must be a JSON object"),
    ({}, "messages is required"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": "hi"}, "messages must be a non-empty list"),
    ({"messages": [USER, 5]}, "messages[1]: expected an object with role system, user, assistant or tool"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 'messages[0].role must be system, user, assistant or tool'),
    ({"messages": [{"content": "x"}]}, "messages[0].role is required"),
    ({"messages": [{"role": "user", "content": 5}]},
     "messages[0].content must be a string or a list of text parts, got int"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]},
     'messages[0].content[1]: only text content parts are supported, got {"type": "image_url"}'),
    ({"messages": [USER, {**ASSISTANT_CALLS, "tool_calls": "ls"}, USER]}, "messages[1].tool_calls must be a list"),
    ({"messages": [USER, {**ASSISTANT_CALLS, "tool_calls": [*ASSISTANT_CALLS["tool_calls"], {"function": {}}]}, USER]},
     "messages[1].tool_calls[1] needs function.name"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}, USER]},
     "messages[1].tool_calls[0] needs function.name"),
    ({"messages": [USER, {"role": "assistant", "content": "Sure"}]},
     "the last message is the assistant's: continuing a prefilled reply is not supported"),
    ({"messages": [USER], "tools": {"bash": {}}}, "tools must be a list"),
    ({"messages": [USER], "tools": ["bash"]}, 'tools[0]: expected {"type": "function", "function": {"name": ...}}'),
    ({"messages": [USER], "tools": [{"type": "retrieval", "function": {"name": "f"}}]},
     'tools[0].type must be "function" (the only kind of tool served), got "retrieval"'),
    ({"messages": [USER], "tools": [{"type": "function"}]}, "tools[0].function is required"),
    ({"messages": [USER], "tools": [{"function": {"name": 5}}]}, "tools[0].function.name must be a string, got 5"),
    ({"messages": [USER], "tools": tool(description=3)}, "tools[0].function.description must be a string"),
    (params("object"), "tools[0].function.parameters must be a JSON schema object, got str"),
    (params(None), "tools[0].function.parameters must be a JSON schema object, got NoneType"),
    (params({"properties": ["command"]}), "tools[0].function.parameters.properties must be an object of named schemas"),
    (params({"properties": {"command": "string"}}),
     "tools[0].function.parameters.properties.command must be a JSON schema object, got str"),
    (params({"required": "command"}), "tools[0].function.parameters.required must be a list"),
    (params({"required": ["a", 1]}), "tools[0].function.parameters.required[1] must be a property name, got 1"),
    (params({"type": ["string", 3]}), "tools[0].function.parameters.type must be a type name or a list of them"),
    (params({"enum": "ab"}), "tools[0].function.parameters.enum must be a list"),
    (params({"items": {"title": 1}}), "tools[0].function.parameters.items.title must be a string"),
    (params({"items": None}), "tools[0].function.parameters.items must be a JSON schema object, got NoneType"),
    (params(nested(17)), "tools[0].function.parameters: nested more than 16 deep"),
    ({"messages": [USER], "max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
    ({"messages": [USER], "max_tokens": True}, "max_tokens must be a positive integer, got true"),
    ({"messages": [USER], "max_completion_tokens": "5"}, 'max_completion_tokens must be a positive integer, got "5"'),
    ({"messages": [USER], "stream": "yes"}, 'stream must be true or false, got "yes"'),
    ({"messages": [USER], "stream": 1}, "stream must be true or false, got 1"),
    ({"messages": [USER], "logprobs": "yes"}, 'logprobs must be true or false, got "yes"'),
    ({"messages": [USER], "stream_options": ["include_usage"]}, "stream_options must be an object"),
    ({"messages": [USER], "top_logprobs": 5},
     "top_logprobs is not served: only the sampled token's log-prob (logprobs: true)"),
    ({"messages": [USER], "n": 2}, "n=2 is not supported by the recording proxy"),
    ({"messages": [USER], "stop": ["\n"]}, 'stop=["\\n"] is not supported by the recording proxy'),
    ({"messages": [USER], "response_format": {"type": "json_object"}},
     'response_format={"type": "json_object"} is not supported'),
])
def test_a_malformed_body_is_a_bad_request_that_names_the_field(body, says):
    with pytest.raises(BadRequest) as refused:
        read_request(body)
    assert str(refused.value).startswith(says), str(refused.value)


def test_tools_and_messages_read_alone_name_their_place():
    """How the warm start's data (job/sft_data.py) reads a conversation: one message, or the tools, at a time."""
    with pytest.raises(BadRequest, match=r"^tools must be a list$"):
        read_tools("bash")
    with pytest.raises(BadRequest, match=r"^messages\[3\]: expected an object with role"):
        read_message(["user", "hi"], 3, {})
    assert read_tools([{"function": {"name": "f", "parameters": nested(16)}}])[0]["parameters"] == nested(16)


def json_value(rng: random.Random, keys: tuple[str, ...], depth: int = 0):
    """A random JSON value: scalars of every kind, and lists and objects (keyed from ``keys``) nested a few deep."""
    pick = rng.random()
    if depth > 3 or pick < 0.45:
        return rng.choice([None, True, False, 0, 1, -1, 7, 2**70, 0.5, float("nan"), float("inf"), "", "x", "[]",
                           '{"a": 1}', "text", "function", *keys])
    if pick < 0.7:
        return [json_value(rng, keys, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(keys): json_value(rng, keys, depth + 1) for _ in range(rng.randrange(4))}


def one_field_corrupted(rng: random.Random, body, keys: tuple[str, ...]):
    """``body`` (a copy) with one value, anywhere in it, replaced by a random one, or with its key dropped."""
    body = copy.deepcopy(body)
    places, stack = [], [body]
    while stack:
        value = stack.pop()
        slots = list(value.items()) if isinstance(value, dict) else list(enumerate(value)) \
            if isinstance(value, list) else []
        places += [(value, k) for k, _ in slots]
        stack += [v for _, v in slots]
    if places:
        parent, key = rng.choice(places)
        if isinstance(parent, dict) and rng.random() < 0.2:
            del parent[key]
        else:
            parent[key] = json_value(rng, keys)
    return body


CHAT_KEYS = ("messages", "role", "content", "type", "text", "tool_calls", "function", "name", "arguments", "id",
             "tools", "parameters", "properties", "items", "required", "enum", "description", "max_tokens", "stream",
             "stream_options", "include_usage", "n", "stop", "logprobs", "model", "user", "assistant", "tool")


# an honest request of each surface: every kind of message, a tool call and its result, tools with nested schemas
HONEST_CHAT = {"model": "m", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
               "messages": [{"role": "system", "content": "Be brief."}, USER, ASSISTANT_CALLS,
                            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a.txt"}]},
                            {"role": "user", "content": "and?"}],
               "tools": tool(description="run", parameters={"type": "object", "required": ["command"], "properties": {
                   "command": {"type": "string"}, "env": {"type": "array", "items": {"type": "string"}}}})}


def test_no_body_of_any_shape_raises_anything_but_a_bad_request():
    """A few thousand bodies: random JSON values, and honest requests (messages of every role, tool calls, tools with
    nested schemas, settings) with one field corrupted. Each is read or refused with a BadRequest in the proxy's own
    words; pydantic's errors, a TypeError or a RecursionError never reach the proxy."""
    rng = random.Random(57)
    read, refused = fuzzed(read_request, CHAT_KEYS, HONEST_CHAT, rng)
    assert read > 300 and refused > 1000, (read, refused)  # both sides of the boundary were exercised


def fuzzed(read, keys: tuple[str, ...], honest: dict, rng: random.Random, n: int = 3000) -> tuple[int, int]:
    """``n`` bodies through ``read``: every tenth a random JSON value, the rest ``honest`` with one field corrupted;
    each must be read or refused with a BadRequest in the proxy's own words. (How many were read, refused.)"""
    taken, refused = 0, 0
    for i in range(n):
        body = json_value(rng, keys) if i % 10 == 0 else one_field_corrupted(rng, honest, keys)
        try:
            read(body)
            taken += 1
        except BadRequest as e:
            refused += 1
            assert not any(words in str(e) for words in PYDANTIC_WORDS), (body, str(e))
    return taken, refused


RESPONSES_KEYS = ("input", "instructions", "type", "role", "content", "text", "call_id", "name", "arguments",
                  "output", "summary", "tools", "parameters", "properties", "items", "required", "function",
                  "message", "function_call", "function_call_output", "reasoning", "input_text", "output_text",
                  "max_output_tokens", "stream", "tool_choice", "previous_response_id", "model", "user", "assistant")
MESSAGES_KEYS = ("messages", "system", "role", "content", "type", "text", "thinking", "tool_use", "tool_result",
                 "tool_use_id", "id", "name", "input", "input_schema", "properties", "items", "tools", "max_tokens",
                 "stream", "stop_sequences", "tool_choice", "auto", "model", "user", "assistant")


HONEST_RESPONSES = {
    "model": "m", "instructions": "Be brief.", "max_output_tokens": 50, "stream": True, "tool_choice": "auto",
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
              {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
              {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{\"command\": \"ls\"}"},
              {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}],
    "tools": [{"type": "function", "name": "bash", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}, "env": {"type": "array", "items": {"type": "string"}}}}}]}
HONEST_MESSAGES = {
    "model": "m", "system": [{"type": "text", "text": "Be brief."}], "max_tokens": 50, "stream": True,
    "messages": [{"role": "user", "content": "hi"},
                 {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""},
                                                   {"type": "tool_use", "id": "c1", "name": "bash",
                                                    "input": {"command": "ls"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "a.txt"}]}],
    "tools": [{"name": "bash", "input_schema": {"type": "object", "required": ["command"], "properties": {
        "command": {"type": "string"}}}}]}


@pytest.mark.parametrize("read, keys, honest", [
    (read_responses, RESPONSES_KEYS, HONEST_RESPONSES),
    (read_messages, MESSAGES_KEYS, HONEST_MESSAGES),
])
def test_no_body_of_any_shape_raises_anything_but_a_bad_request_on_the_other_surfaces(read, keys, honest):
    """The Responses and Anthropic Messages surfaces hold the chat surface's boundary: random JSON values and honest
    bodies with one field corrupted are read or refused with a BadRequest in the proxy's own words."""
    read(honest)
    taken, refused = fuzzed(read, keys, honest, random.Random(58))
    assert taken > 300 and refused > 1000, (taken, refused)


@pytest.mark.parametrize("place", ["body", "messages", "content", "role", "arguments", "arguments-text", "id", "n",
                                   "stream", "max_tokens", "tools", "properties", "items", "enum"])
def test_a_value_nested_past_pythons_recursion_limit_is_refused_or_read_never_a_recursion_error(place):
    deep: list = []
    for _ in range(20_000):
        deep = [deep]
    call = {"id": "c1", "function": {"name": "bash", "arguments": "{}"}}
    deep_schema: dict = {}
    for _ in range(20_000):
        deep_schema = {"items": deep_schema} if place == "items" else {"properties": {"a": deep_schema}}
    body = {
        "body": deep, "messages": {"messages": deep}, "content": {"messages": [{"role": "user", "content": [deep]}]},
        "role": {"messages": [{"role": deep}]}, "n": {"messages": [USER], "n": deep},
        "arguments": {"messages": [{"role": "assistant", "tool_calls": [{**call, "function": {
            "name": "bash", "arguments": deep}}]}, USER]},
        "arguments-text": {"messages": [{"role": "assistant", "tool_calls": [{**call, "function": {
            "name": "bash", "arguments": "[" * 20_000 + "]" * 20_000}}]}, USER]},
        "id": {"messages": [{"role": "assistant", "tool_calls": [{**call, "id": deep}]}, USER]},
        "stream": {"messages": [USER], "stream": deep}, "max_tokens": {"messages": [USER], "max_tokens": deep},
        "tools": {"messages": [USER], "tools": [deep]}, "properties": params(deep_schema), "items": params(deep_schema),
        "enum": params({"enum": deep, "description": deep}),
    }[place]
    try:
        asked = read_request(body)
    except BadRequest:
        return
    assert place in ("arguments", "arguments-text", "id")  # lenient fields: kept unparsed, never refused
    assert "__unparsed__" in asked.messages[0].tool_calls[0].arguments or asked.messages[0].tool_calls[0].id == "list"


@pytest.mark.parametrize("read, body", [
    (read_responses, lambda deep: {"input": deep}),
    (read_responses, lambda deep: {"input": [{"role": "user", "content": deep}]}),
    (read_responses, lambda deep: {"input": [{"type": "function_call", "call_id": "c", "name": "b", "arguments": deep},
                                             {"role": "user", "content": "hi"}]}),
    (read_responses, lambda deep: {"input": "hi", "tools": [{"type": "function", "name": "b", "parameters": {
        "type": "object", "properties": {"a": {"items": deep}}}}]}),
    (read_messages, lambda deep: {"messages": deep}),
    (read_messages, lambda deep: {"messages": [{"role": "user", "content": deep}]}),
    (read_messages, lambda deep: {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "b", "input": {"a": deep}}]}, {"role": "user", "content": "hi"}]}),
    (read_messages, lambda deep: {"system": deep, "messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_value_nested_past_the_recursion_limit_on_the_other_surfaces_is_refused_or_read(read, body):
    deep: list = []
    for _ in range(20_000):
        deep = [deep]
    try:
        read(body(deep))
    except BadRequest as e:
        assert not any(words in str(e) for words in PYDANTIC_WORDS), str(e)
