"""The Anthropic Messages surface of the recording proxy (``POST /v1/messages``), as Claude Code and other Anthropic
clients speak it: a request's ``system`` and ``messages`` content blocks as sandforge messages, and a reply as a
Message object or, with ``stream: true``, as its server-sent events (sent once the whole reply is generated).

Content blocks read: ``text``; an assistant's ``thinking`` (the policy's reasoning, given back as the proxy gave it,
so the recorded row stays one sequence; ``redacted_thinking`` is dropped) and ``tool_use``; a user's ``tool_result``
(each a tool message, before the turn's text). Images and documents are refused with a 400 that names the block, as
are tools with a ``type`` of Anthropic's own (server tools such as web search), ``stop_sequences`` and a
``tool_choice`` other than ``auto``. Sampling settings are recorded, not used (the chat surface's docstring says why);
``max_tokens`` bounds the reply.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, StrictInt, StrictStr, TypeAdapter

from sandforge.rollout.chat_api import (ASKED, BadRequest, ChatRequest, JsonBody, Sent, checked_schema, read_sent, refused,
                                        safe_str, says, shown)
from sandforge.types import Message, ToolCall


class TextBlock(Sent):
    text: StrictStr


class ThinkingBlock(Sent):
    thinking: StrictStr


class ToolUseBlock(Sent):
    id: Annotated[StrictStr, says("must be a string, got {got}")]
    name: Annotated[StrictStr, says("must be a string, got {got}")]
    input: Annotated[dict, says("must be an object, got {kind}")] = {}


def _blocks(content: Any) -> Any:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


class ToolResultBlock(Sent):
    tool_use_id: Annotated[StrictStr, says("must be a string, got {got}")]
    content: Annotated[list[TextBlock], BeforeValidator(lambda v: _blocks(v if v is not None else [])),
                       says("must be a string or a list of text blocks")] = []
    is_error: Any = False


BLOCKS = {"text": TypeAdapter(TextBlock), "thinking": TypeAdapter(ThinkingBlock),
          "tool_use": TypeAdapter(ToolUseBlock), "tool_result": TypeAdapter(ToolResultBlock)}
BY_ROLE = {"user": ("text", "tool_result"), "assistant": ("text", "thinking", "redacted_thinking", "tool_use")}


class ChatTurn(Sent):
    role: Annotated[Literal["user", "assistant"], says("must be user or assistant, got {got}")]
    content: Annotated[list[Any], BeforeValidator(_blocks), says("must be a string or a list of content blocks")]


class Tool(Sent):
    type: Annotated[Literal["custom"], says('is a tool of Anthropic\'s own ({got}): only tools with an '
                                            'input_schema are served')] = "custom"
    name: Annotated[StrictStr, says("must be a string, got {got}")]
    description: Annotated[StrictStr, says("must be a string")] = ""
    input_schema: Annotated[dict, BeforeValidator(checked_schema)] = None


def _tool_choice(value: Any) -> Any:
    if value is not None and not (isinstance(value, dict) and value.get("type") == "auto"):
        raise refused(f'is not served but {{"type": "auto"}} (the policy decides), got {shown(value)}')
    return value


def _no_stop(value: Any) -> Any:
    if value not in (None, []):
        raise refused(f"is not supported by the recording proxy, got {shown(value)}")
    return value


class MessagesBody(JsonBody):
    """A ``/v1/messages`` body as the proxy serves it (the module's docstring says what that is)."""

    messages: Annotated[list[ChatTurn], Field(min_length=1), says("must be a non-empty list")]
    system: Annotated[list[TextBlock], BeforeValidator(lambda v: _blocks(v if v is not None else [])),
                      says("must be a string or a list of text blocks")] = []
    tools: Annotated[list[Tool], BeforeValidator(lambda v: v or []), says("must be a list")] = []
    tool_choice: Annotated[Any, BeforeValidator(_tool_choice)] = None
    max_tokens: Annotated[StrictInt, Field(gt=0), says("must be a positive integer, got {got}")] | None = None
    stop_sequences: Annotated[Any, BeforeValidator(_no_stop)] = None
    stream: Annotated[bool, says("must be true or false, got {got}")] | None = None
    model: Any = None  # ASKED: recorded where sent
    temperature: Any = None
    top_p: Any = None
    seed: Any = None


_BODY = TypeAdapter(MessagesBody)


def _turn(turn: ChatTurn, i: int) -> list[Message]:
    """One of the request's turns as Messages: a user turn's tool results first (tool messages), then its text; an
    assistant turn's thinking, text and tool uses as one assistant message."""
    text, reasoning, calls, results = [], [], [], []
    for j, raw in enumerate(turn.content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in BY_ROLE[turn.role]:
            raise BadRequest(f"messages[{i}].content[{j}].type must be one of {', '.join(BY_ROLE[turn.role])} in a "
                             f"{turn.role} turn, got {shown(kind)}")
        if kind == "redacted_thinking":
            continue  # encrypted reasoning the proxy never gives: nothing of the policy's in it
        block = read_sent(BLOCKS[kind], raw, ("messages", i, "content", j))
        if kind == "text":
            text.append(block.text)
        elif kind == "thinking":
            reasoning.append(block.thinking)
        elif kind == "tool_use":
            calls.append(ToolCall(name=block.name, arguments=block.input, id=block.id))
        else:
            results.append(block)
    if turn.role == "assistant":
        return [Message(role="assistant", content="".join(text), reasoning="".join(reasoning), tool_calls=calls)]
    out = [Message(role="tool", content="".join(b.text for b in r.content), tool_call_id=r.tool_use_id)
           for r in results]
    return out + ([Message(role="user", content="".join(text))] if text or not results else [])


def read_messages(body: Any) -> ChatRequest:
    """A Messages body as a ChatRequest; BadRequest names what is not served."""
    sent: MessagesBody = read_sent(_BODY, body)
    messages = [m for i, turn in enumerate(sent.messages) for m in _turn(turn, i)]
    names = {c.id: c.name for m in messages for c in m.tool_calls}
    for m in messages:
        if m.role == "tool":
            m.name = safe_str(names.get(m.tool_call_id, "tool"))
    if sent.system:
        messages.insert(0, Message(role="system", content="".join(b.text for b in sent.system)))
    if messages[-1].role == "assistant":
        raise BadRequest("the last message is the assistant's: continuing a prefilled reply is not supported")
    tools = [{"name": t.name, **({"description": t.description} if "description" in t.model_fields_set else {}),
              **({"parameters": t.input_schema} if "input_schema" in t.model_fields_set else {})} for t in sent.tools]
    return ChatRequest(messages, tools, sent.max_tokens,
                       {k: getattr(sent, k) for k in ASKED if k in sent.model_fields_set}, sent.stream is True)


def message_reply(msg: Message, finish_reason: str, prompt_tokens: int, completion_tokens: int, model: str,
                  message_id: str) -> dict:
    """The Message object of an assistant reply: thinking, text and tool uses as content blocks."""
    content: list[dict] = []
    if msg.reasoning:
        content.append({"type": "thinking", "thinking": msg.reasoning, "signature": ""})
    if msg.content or not msg.tool_calls:
        content.append({"type": "text", "text": msg.content})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in msg.tool_calls]
    stop = "max_tokens" if finish_reason == "length" else "tool_use" if msg.tool_calls else "end_turn"
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def _block_events(block: dict, index: int) -> list[dict]:
    if block["type"] == "text":
        start, delta = block | {"text": ""}, {"type": "text_delta", "text": block["text"]}
    elif block["type"] == "thinking":
        start, delta = block | {"thinking": ""}, {"type": "thinking_delta", "thinking": block["thinking"]}
    else:
        start, delta = block | {"input": {}}, {"type": "input_json_delta",
                                               "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    events = [{"type": "content_block_start", "index": index, "content_block": start},
              {"type": "content_block_delta", "index": index, "delta": delta}]
    if block["type"] == "thinking":
        events.append({"type": "content_block_delta", "index": index,
                       "delta": {"type": "signature_delta", "signature": block["signature"]}})
    return events + [{"type": "content_block_stop", "index": index}]


def message_events(reply: dict) -> bytes:
    """``reply`` (``message_reply``'s) as the server-sent events of a streamed reply: message_start, each content
    block whole, message_delta with the stop reason and usage, message_stop."""
    opening = reply | {"content": [], "stop_reason": None, "usage": reply["usage"] | {"output_tokens": 0}}
    events = [{"type": "message_start", "message": opening}]
    for index, block in enumerate(reply["content"]):
        events += _block_events(block, index)
    events += [{"type": "message_delta", "delta": {"stop_reason": reply["stop_reason"], "stop_sequence": None},
                "usage": {"output_tokens": reply["usage"]["output_tokens"]}},
               {"type": "message_stop"}]
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n".encode() for e in events)
