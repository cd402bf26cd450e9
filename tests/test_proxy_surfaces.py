"""The recording proxy's Responses (``/v1/responses``, rollout/responses_api.py) and Anthropic Messages
(``/v1/messages``, rollout/messages_api.py) surfaces, driven by the real clients: OpenAI's SDK and Anthropic's, each
streaming and not, through a tool call and its result, as Codex and Claude Code send them. What is recorded is the
chat surface's: one row per episode when the client gives the policy's turns back as it got them."""

from __future__ import annotations

import json

import anthropic
import httpx2
import openai
import pytest
from agent_fakes import CHAT
from test_proxy import TOKEN, ScriptedEngine, Served, served  # noqa: F401 - served: the fixture

from sandforge.rollout.messages_api import read_messages
from sandforge.rollout.responses_api import read_responses
from sandforge.types import Message, Sample, ToolCall

SHELL = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
CALL = Message(role="assistant", reasoning="look first", tool_calls=[ToolCall("bash", {"command": "ls -la"})])


def responses_client(s: Served, token: str = TOKEN) -> openai.OpenAI:
    return s.client(token)


def anthropic_client(s: Served, token: str = TOKEN) -> anthropic.Anthropic:
    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=s.socket))  # the HTTP package of Anthropic's SDK 2
    return anthropic.Anthropic(base_url="http://proxy", api_key=token, http_client=http, max_retries=0)


# ------------------------------------------------------------------------------------------- Responses


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_client_calls_a_tool_and_gets_one_recorded_row(served, stream):
    engine = ScriptedEngine([CALL])
    s = served(engine)
    client = responses_client(s)
    tools = [{"type": "function", "name": "bash", "description": "run a command", "parameters": SHELL,
              "strict": False}]
    history = [{"role": "user", "content": [{"type": "input_text", "text": "list the files"}]}]
    ask = dict(model="gpt-5-codex", instructions="you are an agent", tools=tools, tool_choice="auto", store=False,
               parallel_tool_calls=False, reasoning={"effort": "low"}, include=[])
    if stream:
        with client.responses.stream(input=history, **ask) as events:
            kinds = [e.type for e in events]
            first = events.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "response.function_call_arguments.done" in kinds
    else:
        first = client.responses.create(input=history, **ask)
    assert first.status == "completed"
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.summary[0].text == "look first"
    assert call.type == "function_call" and call.name == "bash" and json.loads(call.arguments) == {"command": "ls -la"}
    assert first.usage.output_tokens == len(s.proxy.recorder.rows[0].token_ids) - first.usage.input_tokens

    # as Codex goes on: the output items given back, then the call's output
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "a.txt\nb.txt"})
    second = client.responses.create(input=history, **ask)
    assert second.output_text == "done" and second.output[0].type == "message"
    rows = s.proxy.recorder.rows
    assert len(rows) == 1  # the reasoning given back as it was sent: one sequence
    assert engine.requests[1].prompt_ids[: len(engine.requests[0].prompt_ids)] == engine.requests[0].prompt_ids
    assert sum(rows[0].loss_mask) == first.usage.output_tokens + second.usage.output_tokens


def test_responses_input_items_become_the_conversation_turn_by_turn():
    """A turn is the run of reasoning, assistant text and calls between other items; a call's output is named for its
    call's tool."""
    request = read_responses({"instructions": "be brief", "input": [
        {"role": "developer", "content": "house rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "on it"}]},
        {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{\"command\": \"ls\"}"},
        {"type": "function_call", "call_id": "c2", "name": "read", "arguments": "not json"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "again"}]},
        {"type": "function_call", "call_id": "c3", "name": "bash", "arguments": "{}"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "a third"}]},
        {"type": "function_call_output", "call_id": "c3", "output": "done"}]})
    roles = [m.role for m in request.messages]
    assert roles == ["system", "system", "user", "assistant", "tool", "tool", "assistant", "assistant", "tool"]
    turn = request.messages[3]
    assert (turn.reasoning, turn.content) == ("think", "on it")
    assert [(c.id, c.name, c.arguments) for c in turn.tool_calls] == [
        ("c1", "bash", {"command": "ls"}), ("c2", "read", {"__unparsed__": "not json"})]
    assert [(m.name, m.tool_call_id, m.content) for m in request.messages[4:6]] == [("bash", "c1", "a.txt"),
                                                                                   ("read", "c2", "b")]
    assert request.messages[6].reasoning == "again" and request.messages[6].tool_calls[0].id == "c3"
    assert request.messages[7].reasoning == "a third" and not request.messages[7].tool_calls


def test_anthropic_blocks_become_the_conversation_turn_by_turn():
    request = read_messages({"system": "be brief", "max_tokens": 9, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "xx"},
                                          {"type": "text", "text": "on it"},
                                          {"type": "tool_use", "id": "t1", "name": "bash",
                                           "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"},
                                     {"type": "tool_result", "tool_use_id": "t9", "is_error": True}]}]})
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool", "tool"]
    assert (request.messages[2].reasoning, request.messages[2].content) == ("hm", "on it")
    assert [(m.name, m.tool_call_id, m.content) for m in request.messages[3:]] == [("bash", "t1", "a.txt"),
                                                                                   ("tool", "t9", "")]
    assert request.max_tokens == 9


class CutEngine(ScriptedEngine):
    """Stops each reply at the request's max_tokens, as the engine does."""

    async def generate(self, request):
        whole = await super().generate(request)
        cut = len(whole.token_ids) > request.max_tokens
        return Sample(token_ids=whole.token_ids[: request.max_tokens], logprobs=whole.logprobs[: request.max_tokens],
                      finish_reason="length" if cut else "stop", version=whole.version)


def test_a_namespaces_tools_are_offered_by_qualified_name_and_hosted_tools_are_left_out(served):
    """Codex groups tools in a ``namespace`` and lists OpenAI's hosted web search: the policy is offered the
    namespace's functions as ``ns.name`` and its call comes back with its namespace; web search, which only a server
    runs, is not offered."""
    engine = ScriptedEngine([Message(role="assistant", tool_calls=[ToolCall("agents.spawn", {"task": "x"})]),
                             Message(role="assistant", content="ok")])
    s = served(engine)
    client = responses_client(s)
    tools = [{"type": "function", "name": "shell", "parameters": SHELL},
             {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [
                 {"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {
                     "task": {"type": "string"}}}}]},
             {"type": "web_search", "external_web_access": True}]
    history: list = [{"role": "user", "content": "go"}]
    first = client.responses.create(model="m", input=history, tools=tools)
    (call,) = first.output
    assert (call.name, call.namespace) == ("spawn", "agents")
    prompt = CHAT.tokenizer.decode(engine.requests[0].prompt_ids)  # the tools as the policy's template declared them
    assert "shell(" in prompt and "agents.spawn(" in prompt and "web_search" not in prompt
    history += [call.model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": call.call_id, "output": "spawned"}]
    client.responses.create(model="m", input=history, tools=tools)
    assert len(s.proxy.recorder.rows) == 1  # the namespaced call given back renders as the policy wrote it


def test_a_responses_reply_cut_at_its_budget_is_incomplete(served):
    s = served(CutEngine([Message(role="assistant", content="a long answer " * 50)]))
    r = responses_client(s).responses.create(model="m", input="hi", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens <= 5


@pytest.mark.parametrize("extra, says", [
    ({"previous_response_id": "resp_1"}, "previous_response_id is not served"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "x"}]}]},
     "tools[0].tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text"),
    ({"input": [{"role": "assistant", "content": "prefill"}]}, "prefilled"),
])
def test_what_the_responses_surface_does_not_serve_gets_a_400_that_says_so(served, extra, says):
    s = served(ScriptedEngine([]))
    body = {"model": "m", "input": "hi"} | extra
    with pytest.raises(openai.BadRequestError, match=r".*" + says.replace("[", r"\[").replace("]", r"\]")):
        responses_client(s).responses.create(**body)
    assert not s.proxy.recorder.turns and s.proxy.refused


# ------------------------------------------------------------------------------------------- Anthropic Messages


@pytest.mark.parametrize("stream", [False, True])
def test_an_anthropic_client_calls_a_tool_and_gets_one_recorded_row(served, stream):
    engine = ScriptedEngine([CALL])
    s = served(engine)
    client = anthropic_client(s)
    tools = [{"name": "bash", "description": "run a command", "input_schema": SHELL}]
    history = [{"role": "user", "content": "list the files"}]
    ask = dict(model="claude-sonnet-4-5", max_tokens=256, system=[{"type": "text", "text": "you are an agent"}],
               tools=tools, tool_choice={"type": "auto"})
    if stream:
        with client.messages.stream(messages=history, **ask) as events:
            kinds = [e.type for e in events]
            first = events.get_final_message()
        assert kinds[0] == "message_start" and "content_block_stop" in kinds and kinds[-1] == "message_stop"
    else:
        first = client.messages.create(messages=history, **ask)
    assert first.stop_reason == "tool_use"
    thinking, use = first.content
    assert thinking.type == "thinking" and thinking.thinking == "look first"
    assert use.type == "tool_use" and use.name == "bash" and use.input == {"command": "ls -la"}

    # as Claude Code goes on: the assistant's content given back, then the tool's result
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": [{"type": "text", "text": "a.txt"}]},
                                             {"type": "text", "text": "and now?"}]}]
    second = client.messages.create(messages=history, **ask)
    assert second.stop_reason == "end_turn" and second.content[0].text == "done"
    rows = s.proxy.recorder.rows
    assert len(rows) == 1
    assert engine.requests[1].prompt_ids[: len(engine.requests[0].prompt_ids)] == engine.requests[0].prompt_ids
    assert sum(rows[0].loss_mask) == first.usage.output_tokens + second.usage.output_tokens


def test_an_anthropic_client_needs_the_episodes_key(served):
    s = served(ScriptedEngine([]))
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(s, "not-it").messages.create(model="m", max_tokens=8,
                                                      messages=[{"role": "user", "content": "hi"}])
    assert not s.proxy.recorder.turns


@pytest.mark.parametrize("extra, says", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"stop_sequences": ["\n"]}, "stop_sequences"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "y", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "prefill"}]}, "prefilled"),
])
def test_what_the_messages_surface_does_not_serve_gets_a_400_that_says_so(served, extra, says):
    s = served(ScriptedEngine([]))
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]} | extra
    with pytest.raises(anthropic.BadRequestError, match=r".*" + says.replace("[", r"\[").replace("]", r"\]")):
        anthropic_client(s).messages.create(**body)
    assert not s.proxy.recorder.turns and s.proxy.refused
