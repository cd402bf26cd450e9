"""The OpenAI chat-completions surface of the recording proxy: a request's JSON as sandforge messages, and a reply as
the JSON an OpenAI client reads back.

What is supported, and what is refused with a 400 that says so (never silently ignored): text content (a string, or a
list of ``{"type": "text"}`` parts), ``tools`` of type function, assistant ``tool_calls`` and ``tool`` results and one
choice (``n`` 1). A ``stream: true`` request is answered as server-sent events once the whole reply is generated
(``completion_events``: one chunk with the message, one with the finish reason, the usage if asked, ``[DONE]``), since
clients such as verifiers' chat program only speak streaming; tokens are not sent as they come. Sampling settings
the harness sends (temperature, top_p) are recorded but not used: an RL episode samples at the job's temperature,
which is what the trainer's ratio assumes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sandforge.types import Message, ToolCall


class BadRequest(ValueError):
    """The harness sent something the proxy does not serve; the message says what (answered as a 400)."""


@dataclass(frozen=True)
class TokensAsked:
    """The exact tokens a client asks to be given back: ``logprobs`` (the sampled token's, OpenAI's
    ``choices[0].logprobs.content``; with vLLM's ``return_tokens_as_token_ids`` each token reads ``token_id:N``), and
    vLLM's ``return_token_ids`` (``prompt_token_ids`` and ``choices[0].token_ids``): the ids the proxy records."""

    logprobs: bool = False
    as_ids: bool = False
    token_ids: bool = False


@dataclass(frozen=True)
class ChatRequest:
    """One ``/v1/chat/completions`` request, read: the conversation, its tools and the completion budget asked."""

    messages: list[Message]
    tools: list[dict]  # function schemas as environments list them: name, description, parameters
    max_tokens: int | None
    asked: dict[str, Any]  # the sampling settings the harness sent, for the record
    stream: bool = False  # answer as server-sent events (completion_events)
    stream_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    tokens: TokensAsked = field(default_factory=TokensAsked)  # the exact tokens to give back


REFUSED = {  # keys whose non-default value would change the completion; value: what "off" looks like
    "n": (None, 1), "logit_bias": (None, {}), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "response_format": (None, {"type": "text"}), "stop": (None, [], ""),
    "echo": (None, False), "best_of": (None, 1), "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]),
}


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise BadRequest(f"{where}: only text content parts are supported, got {str(p)[:80]}")
            parts.append(p["text"])
        return "".join(parts)
    raise BadRequest(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _arguments(raw: Any) -> dict:
    """A call's arguments: a JSON object, or its JSON text (as OpenAI clients send it back)."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return {"__unparsed__": raw}  # compares unequal to anything the proxy returned: a new row
        return value if isinstance(value, dict) else {"__unparsed__": raw}
    return {"__unparsed__": str(raw)}


def _tool_calls(raw: Any, where: str) -> list[ToolCall]:
    if raw in (None, []):
        return []
    if not isinstance(raw, list):
        raise BadRequest(f"{where}.tool_calls must be a list")
    calls = []
    for j, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}.tool_calls[{j}] needs function.name")
        calls.append(ToolCall(name=fn["name"], arguments=_arguments(fn.get("arguments")), id=str(c.get("id") or "")))
    return calls


def read_message(m: Any, i: int, names: dict[str, str]) -> Message:
    """``messages[i]`` as a Message. ``names``: tool-call id -> tool name, from the assistant turns before it (OpenAI
    tool results name their call, not always their tool)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
        raise BadRequest(f"{where}: expected an object with role system, user, assistant or tool")
    role = "system" if m["role"] == "developer" else m["role"]
    content = _text(m.get("content"), where)
    if role == "assistant":
        reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
        msg = Message(role="assistant", content=content, reasoning=reasoning if isinstance(reasoning, str) else "",
                      tool_calls=_tool_calls(m.get("tool_calls"), where))
        names.update({c.id: c.name for c in msg.tool_calls if c.id})
        return msg
    if role == "tool":
        call_id = str(m.get("tool_call_id") or "")
        return Message(role="tool", content=content, name=str(m.get("name") or names.get(call_id, "tool")),
                       tool_call_id=call_id)
    return Message(role=role, content=content)


def _tool_schema(t: Any, i: int) -> dict:
    """A tool of the request as the chat templates render it, its shape checked (``_json_schema``): a template reads
    a schema's ``properties`` as a mapping of objects and ``required`` as a list of names, and one that is not would
    raise inside the template."""
    fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    if "description" in fn and not isinstance(fn["description"], str):
        raise BadRequest(f"tools[{i}].function.description must be a string")
    if "parameters" in fn:
        _json_schema(fn["parameters"], f"tools[{i}].function.parameters", 0)
    return {k: fn[k] for k in ("name", "description", "parameters") if k in fn}


def read_tools(tools: Any) -> list[dict]:
    """A request's (or a conversation's) ``tools``, each checked as the chat templates read it; BadRequest if not."""
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    return [_tool_schema(t, i) for i, t in enumerate(tools)]


MAX_SCHEMA_DEPTH = 16  # nested objects in a tool's parameters


def _json_schema(schema: Any, where: str, depth: int) -> None:
    """BadRequest unless ``schema`` is a JSON schema object as templates read one: ``properties`` a mapping of names
    to schemas, ``items`` a schema, ``required`` and ``enum`` lists, ``type`` a name or a list of names,
    ``description`` and ``title`` strings; nested at most ``MAX_SCHEMA_DEPTH`` deep. Other keys pass as they are."""
    if depth > MAX_SCHEMA_DEPTH:
        raise BadRequest(f"{where}: nested more than {MAX_SCHEMA_DEPTH} deep")
    if not isinstance(schema, dict):
        raise BadRequest(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    for key in ("description", "title"):
        if key in schema and not isinstance(schema[key], str):
            raise BadRequest(f"{where}.{key} must be a string")
    kind = schema.get("type")
    if kind is not None and not (isinstance(kind, str) or isinstance(kind, list)
                                 and all(isinstance(k, str) for k in kind)):
        raise BadRequest(f"{where}.type must be a type name or a list of them")
    for key in ("required", "enum"):
        if key in schema and not isinstance(schema[key], list):
            raise BadRequest(f"{where}.{key} must be a list")
    if "required" in schema and not all(isinstance(r, str) for r in schema["required"]):
        raise BadRequest(f"{where}.required must list property names")
    if "properties" in schema:
        props = schema["properties"]
        if not isinstance(props, dict):
            raise BadRequest(f"{where}.properties must be an object of named schemas")
        for name, sub in props.items():
            _json_schema(sub, f"{where}.properties.{str(name)[:40]}", depth + 1)
    if "items" in schema:
        _json_schema(schema["items"], f"{where}.items", depth + 1)


def read_request(body: Any) -> ChatRequest:
    """A chat-completions body as a ChatRequest; BadRequest names what is not served."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    for key, off in REFUSED.items():
        if key in body and body[key] not in off:
            raise BadRequest(f"{key}={json.dumps(body[key])[:40]} is not supported by the recording proxy "
                             "(one choice, no stop strings or penalties)")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list")
    names: dict[str, str] = {}
    messages = [read_message(m, i, names) for i, m in enumerate(raw)]
    if messages[-1].role == "assistant":
        raise BadRequest("the last message is the assistant's: continuing a prefilled reply is not supported")
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if body.get("stream") not in (None, False, True):
        raise BadRequest(f"stream must be true or false, got {json.dumps(body['stream'])[:40]}")
    stream = body.get("stream") is True
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object")
    if body.get("top_logprobs") not in (None, 0):
        raise BadRequest("top_logprobs is not served: only the sampled token's log-prob (logprobs: true)")
    flags = {k: body.get(k) for k in ("logprobs", "return_tokens_as_token_ids", "return_token_ids")}
    for key, value in flags.items():
        if value not in (None, False, True):
            raise BadRequest(f"{key} must be true or false, got {json.dumps(value)[:40]}")
    tokens = TokensAsked(bool(flags["logprobs"]), bool(flags["return_tokens_as_token_ids"]),
                         bool(flags["return_token_ids"]))
    asked = {k: body[k] for k in ("model", "temperature", "top_p", "seed") if k in body}
    return ChatRequest(messages, [_tool_schema(t, i) for i, t in enumerate(tools)], max_tokens, asked, stream,
                       stream and bool(options.get("include_usage")), tokens)


def message_json(msg: Message) -> dict:
    """An assistant reply as the ``choices[0].message`` object clients read."""
    out: dict[str, Any] = {"role": "assistant", "content": msg.content if (msg.content or not msg.tool_calls) else None}
    if msg.reasoning:
        out["reasoning_content"] = msg.reasoning
    if msg.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                             for c in msg.tool_calls]
    return out


def completion_json(msg: Message, finish_reason: str, prompt_tokens: int, completion_tokens: int, model: str,
                    request_id: str, created: int) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message_json(msg), "finish_reason": finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def with_tokens(completion: dict, asked: TokensAsked, prompt_ids: list[int], token_ids: list[int],
                logprobs: list[float], decode) -> dict:
    """``completion`` with the exact tokens ``asked`` for: the engine's ``token_ids`` and their ``logprobs`` (each
    token's text from ``decode([id])``, or ``token_id:N``), and the ``prompt_ids`` they followed."""
    choice = completion["choices"][0]
    if asked.logprobs:
        choice["logprobs"] = {"content": [
            {"token": f"token_id:{i}" if asked.as_ids else decode([i]), "logprob": float(lp), "bytes": None,
             "top_logprobs": []} for i, lp in zip(token_ids, logprobs)]}
    if asked.token_ids:
        completion["prompt_token_ids"] = list(prompt_ids)
        choice["token_ids"] = list(token_ids)
    return completion


def completion_events(completion: dict, usage: bool) -> bytes:
    """``completion`` (``completion_json``'s) as the server-sent events of a streamed reply: the whole message (and the
    tokens asked for) in the first chunk, the finish reason in the second, then the usage when ``usage`` (``include_usage``), then
    ``[DONE]``."""
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    choice = completion["choices"][0]
    message = dict(choice["message"])
    if "tool_calls" in message:
        message["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
    first = {"index": 0, "delta": message, "finish_reason": None, "logprobs": choice["logprobs"]}
    if "token_ids" in choice:
        first["token_ids"] = choice["token_ids"]
        head_first = head | {"prompt_token_ids": completion["prompt_token_ids"]}
    else:
        head_first = head
    chunks = [head_first | {"choices": [first]},
              head | {"choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"],
                                   "logprobs": None}]}]
    if usage:
        chunks.append(head | {"choices": [], "usage": completion["usage"]})
    return b"".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
