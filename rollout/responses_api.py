"""The OpenAI Responses surface of the recording proxy (``POST /v1/responses``), as Codex and other Responses clients
speak it: a request's ``instructions`` and ``input`` items as sandforge messages, and a reply as a Response object or,
with ``stream: true``, as its server-sent events (sent once the whole reply is generated, as the chat surface does).

The proxy keeps no conversation: a request carries the whole of it (Codex's ``store: false`` way), so
``previous_response_id`` and ``background`` are refused. Input items read: messages (system, developer, user and
assistant; text parts), ``function_call``, ``function_call_output`` and ``reasoning`` (its summary or reasoning text:
the policy's reasoning, given back as the proxy gave it, so the recorded row stays one sequence). An assistant turn is
the run of reasoning, assistant message and function-call items between two other items. Tools: ``function`` tools,
and the function tools of a ``namespace`` (offered to the policy as ``namespace.name``, and its calls of them answered
with their ``namespace``); the API's hosted tools (web search, file search, code interpreter...), which a server runs
and no client does, are not offered to the policy, as on a server without them; any other tool (a freeform
``custom`` one, ``local_shell``) is refused with a 400 that names it. Sampling settings are recorded, not used (the
chat surface's docstring says why); ``max_output_tokens`` bounds the reply.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, StrictInt, StrictStr, TypeAdapter

from sandforge.rollout.chat_api import (ASKED, BadRequest, ChatRequest, JsonBody, Sent, call_arguments, checked_schema,
                                        read_sent, refused, says, shown)
from sandforge.types import Message, ToolCall


class TextPart(Sent):
    type: Annotated[Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"],
                    says("must be input_text or output_text (only text is served), got {got}")]
    text: StrictStr


def _parts(content: Any) -> Any:
    if content is None:
        return []
    return [{"type": "input_text", "text": content}] if isinstance(content, str) else content


Content = Annotated[list[TextPart], BeforeValidator(_parts), says("must be a string or a list of text parts")]


class MessageItem(Sent):
    role: Annotated[Literal["system", "developer", "user", "assistant"],
                    says("must be system, developer, user or assistant, got {got}")]
    content: Content = []


class FunctionCallItem(Sent):
    call_id: Annotated[StrictStr, says("must be a string, got {got}")]
    name: Annotated[StrictStr, says("must be a string, got {got}")]
    arguments: Any = None  # JSON text, as the proxy sent it (call_arguments)
    namespace: Annotated[StrictStr, says("must be a string, got {got}")] | None = None

    @property
    def qualified(self) -> str:
        """The name the policy called: ``namespace.name`` for a namespace's tool."""
        return f"{self.namespace}.{self.name}" if self.namespace else self.name


class FunctionCallOutputItem(Sent):
    call_id: Annotated[StrictStr, says("must be a string, got {got}")]
    output: Content = []


class ReasoningItem(Sent):
    summary: Annotated[list[TextPart], says("must be a list of text parts")] = []
    content: Annotated[list[TextPart], BeforeValidator(lambda v: v or []), says("must be a list of text parts")] = []


ITEMS = {"message": TypeAdapter(MessageItem), "function_call": TypeAdapter(FunctionCallItem),
         "function_call_output": TypeAdapter(FunctionCallOutputItem), "reasoning": TypeAdapter(ReasoningItem)}


class FunctionTool(Sent):
    type: Annotated[Literal["function"], says('must be "function" (a namespace holds functions only), got {got}')]
    name: Annotated[StrictStr, says("must be a string, got {got}")]
    description: Annotated[StrictStr, says("must be a string")] = ""
    parameters: Annotated[dict, BeforeValidator(checked_schema)] = None

    def listed(self, namespace: str | None = None) -> dict:
        """As environments list their tools; a namespace's under ``namespace.name``."""
        out = {k: getattr(self, k) for k in ("name", "description", "parameters") if k in self.model_fields_set}
        return out | ({"name": f"{namespace}.{self.name}"} if namespace else {})


class NamespaceTool(Sent):
    name: Annotated[StrictStr, says("must be a string, got {got}")]
    description: Annotated[StrictStr, says("must be a string")] = ""
    tools: Annotated[list[FunctionTool], says("must be a list of function tools")]


# what a server runs and no client does: not offered to the policy (the proxy runs none of them)
HOSTED = ("web_search", "file_search", "code_interpreter", "image_generation", "computer_use", "mcp", "tool_search")
TOOLS = {"function": TypeAdapter(FunctionTool), "namespace": TypeAdapter(NamespaceTool)}


def read_tools(tools: list[Any]) -> tuple[list[dict], frozenset[str]]:
    """A request's tools as the policy is offered them, and the namespaces among them."""
    out, namespaces = [], set()
    for i, raw in enumerate(tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if isinstance(kind, str) and kind.startswith(HOSTED):
            continue
        if not isinstance(kind, str) or kind not in TOOLS:
            raise BadRequest(f"tools[{i}].type must be function or namespace (tools the client runs; hosted ones are "
                             f"left out), got {shown(kind)}")
        tool = read_sent(TOOLS[kind], raw, ("tools", i))
        if kind == "function":
            out.append(tool.listed())
        else:
            namespaces.add(tool.name)
            out += [t.listed(tool.name) for t in tool.tools]
    return out, frozenset(namespaces)


def _no(value: Any, what: str) -> Any:
    if value not in (None, False):
        raise refused(what)
    return value


def _format(value: Any) -> Any:
    fmt = value.get("format") if isinstance(value, dict) else None
    if fmt not in (None, {"type": "text"}):
        raise refused(f"format {shown(fmt)} is not served: text only")
    return value


class ResponsesBody(JsonBody):
    """A ``/v1/responses`` body as the proxy serves it (the module's docstring says what that is)."""

    input: Annotated[StrictStr | Annotated[list[Any], Field(min_length=1)], says("must be a string or a non-empty "
                                                                                  "list of items")]
    instructions: Annotated[StrictStr, says("must be a string")] | None = None
    tools: Annotated[list[Any], BeforeValidator(lambda v: v or []), says("must be a list")] = []  # read_tools
    tool_choice: Annotated[Literal["auto"], says('is not served but "auto" (the policy decides), got {got}')] | None \
        = None
    max_output_tokens: Annotated[StrictInt, Field(gt=0), says("must be a positive integer, got {got}")] | None = None
    stream: Annotated[bool, says("must be true or false, got {got}")] | None = None
    previous_response_id: Annotated[Any, BeforeValidator(lambda v: _no(
        v, "is not served: the proxy keeps no conversation, send it whole (store: false)"))] = None
    background: Annotated[Any, BeforeValidator(lambda v: _no(v, "is not served"))] = None
    text: Annotated[Any, BeforeValidator(_format)] = None
    model: Any = None  # ASKED: recorded where sent
    temperature: Any = None
    top_p: Any = None
    seed: Any = None


_BODY = TypeAdapter(ResponsesBody)


def _text(parts: list[TextPart]) -> str:
    return "".join(p.text for p in parts)


def read_input(items: list[Any]) -> list[Message]:
    """``input`` items as Messages: each run of reasoning, assistant message and function-call items one assistant
    turn; a function call's output a tool message named for its call."""
    out: list[Message] = []
    turn: Message | None = None
    names: dict[str, str] = {}
    for i, raw in enumerate(items):
        kind = raw.get("type", "message" if "role" in raw else None) if isinstance(raw, dict) else None
        if not isinstance(kind, str) or kind not in ITEMS:
            raise BadRequest(f"input[{i}].type must be message, function_call, function_call_output or reasoning, "
                             f"got {shown(kind)}")
        item = read_sent(ITEMS[kind], raw, ("input", i))
        if kind == "reasoning" or (kind == "message" and item.role == "assistant") or kind == "function_call":
            # a turn is reasoning, then text, then calls: an item that goes back in that order begins the next one
            if turn is None or (kind == "reasoning" and (turn.reasoning or turn.content or turn.tool_calls)) or (
                    kind == "message" and (turn.content or turn.tool_calls)):
                turn = Message(role="assistant", content="")
                out.append(turn)
            if kind == "reasoning":
                turn.reasoning = _text(item.content) or "\n".join(p.text for p in item.summary)
            elif kind == "message":
                turn.content = _text(item.content)
            else:
                turn.tool_calls.append(ToolCall(name=item.qualified, arguments=call_arguments(item.arguments),
                                                id=item.call_id))
                names[item.call_id] = item.qualified
            continue
        turn = None
        if kind == "function_call_output":
            out.append(Message(role="tool", content=_text(item.output), name=names.get(item.call_id, "tool"),
                               tool_call_id=item.call_id))
        else:
            out.append(Message(role="system" if item.role == "developer" else item.role, content=_text(item.content)))
    return out


def read_responses(body: Any) -> ChatRequest:
    """A Responses body as a ChatRequest; BadRequest names what is not served."""
    sent: ResponsesBody = read_sent(_BODY, body)
    items = [{"role": "user", "content": sent.input}] if isinstance(sent.input, str) else sent.input
    messages = read_input(items)
    if sent.instructions:
        messages.insert(0, Message(role="system", content=sent.instructions))
    if messages[-1].role == "assistant":
        raise BadRequest("the last input item is the assistant's: continuing a prefilled reply is not supported")
    tools, namespaces = read_tools(sent.tools)
    return ChatRequest(messages, tools, sent.max_output_tokens,
                       {k: getattr(sent, k) for k in ASKED if k in sent.model_fields_set}, sent.stream is True,
                       namespaces=namespaces)


def _called(name: str, namespaces: frozenset[str]) -> dict:
    """A call's ``name``, and its ``namespace`` where the policy called a namespace's tool (``ns.name``)."""
    space, dot, rest = name.partition(".")
    return {"name": rest, "namespace": space} if dot and space in namespaces else {"name": name}


def response_json(msg: Message, finish_reason: str, prompt_tokens: int, completion_tokens: int, model: str,
                  response_id: str, created: int, namespaces: frozenset[str] = frozenset()) -> dict:
    """The Response object of an assistant reply: its reasoning (a summary), its text and its function calls as
    output items; ``incomplete`` when the reply was cut at its token budget."""
    n = response_id.removeprefix("resp_")
    output: list[dict] = []
    if msg.reasoning:
        output.append({"type": "reasoning", "id": f"rs_{n}", "summary": [{"type": "summary_text",
                                                                           "text": msg.reasoning}]})
    if msg.content or not msg.tool_calls:
        output.append({"type": "message", "id": f"msg_{n}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": msg.content, "annotations": []}]})
    output += [{"type": "function_call", "id": f"fc_{n}_{k}", "call_id": c.id, **_called(c.name, namespaces),
                "arguments": json.dumps(c.arguments, ensure_ascii=False), "status": "completed"}
               for k, c in enumerate(msg.tool_calls)]
    cut = finish_reason == "length"
    return {"id": response_id, "object": "response", "created_at": created, "model": model,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def _item_events(item: dict, index: int) -> list[dict]:
    """One output item's events, from ``output_item.added`` to ``output_item.done``."""
    events: list[dict] = []
    if item["type"] == "message":
        part = item["content"][0]
        events.append({"type": "response.output_item.added", "output_index": index,
                       "item": item | {"status": "in_progress", "content": []}})
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        events += [{"type": "response.content_part.added", **at, "part": part | {"text": ""}},
                   {"type": "response.output_text.delta", **at, "delta": part["text"], "logprobs": []},
                   {"type": "response.output_text.done", **at, "text": part["text"], "logprobs": []},
                   {"type": "response.content_part.done", **at, "part": part}]
    elif item["type"] == "function_call":
        events.append({"type": "response.output_item.added", "output_index": index,
                       "item": item | {"status": "in_progress", "arguments": ""}})
        at = {"item_id": item["id"], "output_index": index}
        events += [{"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                   {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]}]
    else:  # reasoning
        events.append({"type": "response.output_item.added", "output_index": index, "item": item | {"summary": []}})
        for k, part in enumerate(item["summary"]):
            at = {"item_id": item["id"], "output_index": index, "summary_index": k}
            events += [{"type": "response.reasoning_summary_part.added", **at, "part": part | {"text": ""}},
                       {"type": "response.reasoning_summary_text.delta", **at, "delta": part["text"]},
                       {"type": "response.reasoning_summary_text.done", **at, "text": part["text"]},
                       {"type": "response.reasoning_summary_part.done", **at, "part": part}]
    return events + [{"type": "response.output_item.done", "output_index": index, "item": item}]


def response_events(response: dict) -> bytes:
    """``response`` (``response_json``'s) as the server-sent events of a streamed reply: created, in progress, each
    output item whole, then completed (or incomplete)."""
    opening = response | {"status": "in_progress", "output": [], "incomplete_details": None}
    events = [{"type": "response.created", "response": opening},
              {"type": "response.in_progress", "response": opening}]
    for index, item in enumerate(response["output"]):
        events += _item_events(item, index)
    end = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    events.append({"type": end, "response": response})
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e | {'sequence_number': k}, ensure_ascii=False)}\n\n"
                    .encode() for k, e in enumerate(events))

