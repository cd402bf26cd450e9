"""The OpenAI chat-completions surface of the recording proxy: a request's JSON as sandforge messages, and a reply as
the JSON an OpenAI client reads back.

What is supported, and what is refused with a 400 that says so (never silently ignored): text content (a string, or a
list of ``{"type": "text"}`` parts), ``tools`` of type function, assistant ``tool_calls`` and ``tool`` results and one
choice (``n`` 1). A ``stream: true`` request is answered as server-sent events once the whole reply is generated
(``completion_events``: one chunk with the message, one with the finish reason, the usage if asked, ``[DONE]``), since
clients such as verifiers' chat program only speak streaming; tokens are not sent as they come. Sampling settings
the harness sent (temperature, top_p) are recorded but not used: an RL episode samples at the job's temperature,
which is what the trainer's ratio assumes.

The body is the policy's doing, so it is read by pydantic models (``ChatBody`` and its parts, ``JsonSchema`` for a
tool's parameters) and whatever they refuse, however odd or deeply nested, is a ``BadRequest`` that names the field
as the harness wrote it (``messages[2].tool_calls[0] needs function.name``); keys the proxy does not read are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator,
                      StrictBool, StrictInt, StrictStr, TypeAdapter, ValidationError, WrapValidator, model_validator)
from pydantic_core import PydanticCustomError

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
    namespaces: frozenset[str] = frozenset()  # Responses tool namespaces: the policy calls their tools "ns.name"


REFUSED = {  # keys whose non-default value would change the completion; value: what "off" looks like
    "n": (None, 1), "logit_bias": (None, {}), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "response_format": (None, {"type": "text"}), "stop": (None, [], ""),
    "echo": (None, False), "best_of": (None, 1), "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]),
}
ASKED = ("model", "temperature", "top_p", "seed")  # recorded as sent, not used
MAX_SCHEMA_DEPTH = 16  # nested objects in a tool's parameters


def shown(value: Any) -> str:
    """``value`` as the harness sent it (JSON), cut short; never fails, however deep or odd the value."""
    try:
        return json.dumps(value)[:40]
    except (TypeError, ValueError, RecursionError):
        return type(value).__name__


def safe_str(value: Any) -> str:
    """``str(value)``, or the type's name where a value is too deep or too long to write out."""
    try:
        return str(value)
    except (RecursionError, ValueError):
        return type(value).__name__


def refused(text: str) -> PydanticCustomError:
    return PydanticCustomError("bad_request", text)


def says(text: str, inside: bool = False) -> WrapValidator:
    """The field refused in the proxy's words: ``text`` (``{got}``: the value sent, ``{kind}``: its type) replaces
    pydantic's error about the value itself, or with ``inside`` any error within it; other errors within it (a message
    of the list, a property of a schema) keep their own words."""

    def check(value: Any, handler):
        try:
            return handler(value)
        except ValidationError as e:
            if inside or any(not err["loc"] for err in e.errors()):  # ``{got}`` last: what was sent is not re-read
                raise refused(text.replace("{kind}", type(value).__name__).replace("{got}", shown(value))) from None
            raise

    return WrapValidator(check)


KINDS = {"model_type": "an object", "model_attributes_type": "an object", "dict_type": "an object",
         "string_type": "a string", "list_type": "a list", "int_type": "an integer", "bool_type": "true or false",
         "float_type": "a number", "int_from_float": "an integer"}  # pydantic's errors of a value's kind, in words


def _in_words(err: dict) -> str:
    """One of pydantic's errors in the proxy's words (a field's own words, ``says``, pass as they are)."""
    kind = err["type"]
    if kind == "missing":
        return "is required"
    if kind in KINDS:
        return f"must be {KINDS[kind]}, got {shown(err.get('input'))}"
    if kind == "literal_error":
        return f"must be {err['ctx']['expected']}, got {shown(err.get('input'))}"
    if kind == "too_short":
        return "must not be empty"
    return err["msg"]


def read_sent(adapter: TypeAdapter, value: Any, where: tuple = ()) -> Any:
    """``value`` validated by ``adapter``; its first error as a BadRequest naming the field's path (``where`` first)
    as the harness wrote it: ``messages[2].tool_calls[0] needs function.name``, ``tools[0].function.description must
    be a string``, ``messages[1].content[0]: only text content parts are supported``."""
    try:
        return adapter.validate_python(value)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        path = ""
        for part in (*where, *err["loc"]):
            path += f"[{part}]" if isinstance(part, int) else f".{str(part)[:40]}" if path else str(part)[:40]
        says = _in_words(err)
        if not path:
            raise BadRequest(says) from None
        raise BadRequest(path + (" " if says.startswith(("must ", "needs ", "is ")) else ": ") + says) from None


class Sent(BaseModel):
    """Part of a request as the harness sent it: keys the proxy does not read are ignored."""

    model_config = ConfigDict(extra="ignore")


class JsonBody(Sent):
    """A request's body: a JSON object (any other value is refused in these words)."""

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            raise refused("the body must be a JSON object")
        return body


# --- messages ----------------------------------------------------------------------------------------------------


class TextPart(Sent):
    type: Literal["text"]
    text: StrictStr


def _parts(content: Any) -> Any:
    """Text content as parts: a string is one, null none."""
    if content is None:
        return []
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


Content = Annotated[list[Annotated[TextPart, says("only text content parts are supported, got {got}", inside=True)]],
                    BeforeValidator(_parts), says("must be a string or a list of text parts, got {kind}")]


class CalledFunction(Sent):
    name: StrictStr
    arguments: Any = None  # a JSON object, or its JSON text as OpenAI clients send it back (call_arguments)


class ChatToolCall(Sent):
    function: CalledFunction
    id: Any = None


class ChatMessage(Sent):
    role: Annotated[Literal["system", "developer", "user", "assistant", "tool"],
                    says("must be system, user, assistant or tool (or developer), got {got}")]
    content: Content = []
    reasoning_content: Any = None  # an assistant's reasoning, under either name; kept only when it is text
    reasoning: Any = None
    tool_calls: Annotated[list[Annotated[ChatToolCall, says("needs function.name", inside=True)]],
                          says("must be a list")] | None = None
    tool_call_id: Any = None  # a tool result's: the call it answers
    name: Any = None  # a tool result's tool; unnamed, the tool of the call it answers

    @model_validator(mode="before")
    @classmethod
    def _calls_are_the_assistants(cls, m: Any) -> Any:
        """Only an assistant's ``tool_calls`` are read: what another role carries under that key is ignored."""
        if isinstance(m, dict) and m.get("role") != "assistant" and "tool_calls" in m:
            return {k: v for k, v in m.items() if k != "tool_calls"}
        return m


def call_arguments(raw: Any) -> dict:
    """A call's arguments: a JSON object, or its JSON text (as OpenAI clients send it back)."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):  # not JSON, or a number or nesting past what Python reads
            return {"__unparsed__": raw}  # compares unequal to anything the proxy returned: a new row
        return value if isinstance(value, dict) else {"__unparsed__": raw}
    return {"__unparsed__": safe_str(raw)}


def _message(m: ChatMessage, names: dict[str, str]) -> Message:
    """A read message as a Message; an assistant's calls are added to ``names`` (call id -> tool name)."""
    content = "".join(p.text for p in m.content)
    if m.role == "assistant":
        reasoning = m.reasoning_content or m.reasoning or ""
        calls = [ToolCall(name=c.function.name, arguments=call_arguments(c.function.arguments), id=safe_str(c.id or ""))
                 for c in m.tool_calls or []]
        names.update({c.id: c.name for c in calls if c.id})
        return Message(role="assistant", content=content, reasoning=reasoning if isinstance(reasoning, str) else "",
                       tool_calls=calls)
    if m.role == "tool":
        call_id = safe_str(m.tool_call_id or "")
        return Message(role="tool", content=content, name=safe_str(m.name or names.get(call_id, "tool")),
                       tool_call_id=call_id)
    return Message(role="system" if m.role == "developer" else m.role, content=content)


AnyMessage = Annotated[ChatMessage, says("expected an object with role system, user, assistant or tool")]
_MESSAGE = TypeAdapter(AnyMessage)


def read_message(m: Any, i: int, names: dict[str, str]) -> Message:
    """``messages[i]`` as a Message. ``names``: tool-call id -> tool name, from the assistant turns before it (OpenAI
    tool results name their call, not always their tool)."""
    return _message(read_sent(_MESSAGE, m, ("messages", i)), names)


# --- tools -------------------------------------------------------------------------------------------------------

Schema = Annotated["JsonSchema", says("must be a JSON schema object, got {kind}")]


class JsonSchema(Sent):
    """A tool's parameters as chat templates read them: ``properties`` a mapping of names to schemas, ``items`` a
    schema, ``required`` and ``enum`` lists, ``type`` a name or a list of names, ``description`` and ``title``
    strings (a template that reads one of another kind raises). Other keys pass as they are."""

    description: Annotated[StrictStr, says("must be a string")] = ""
    title: Annotated[StrictStr, says("must be a string")] = ""
    type: Annotated[StrictStr | list[StrictStr] | None,
                    says("must be a type name or a list of them", inside=True)] = None
    required: Annotated[list[Annotated[StrictStr, says("must be a property name, got {got}")]],
                        says("must be a list")] = []
    enum: Annotated[list[Any], says("must be a list")] = []
    properties: Annotated[dict[Any, Schema], says("must be an object of named schemas")] = {}
    items: Schema = None  # absent: no items; a null is refused, as any value that is not a schema


_SCHEMA = TypeAdapter(Schema)


def _depth_within(schema: Any) -> None:
    """Refused if ``schema`` nests (through ``properties`` and ``items``) more than MAX_SCHEMA_DEPTH deep: measured
    level by level before the schema is validated, so no schema recurses far."""
    level, depth = [schema], 0
    while level:
        if depth > MAX_SCHEMA_DEPTH:
            raise refused(f"nested more than {MAX_SCHEMA_DEPTH} deep")
        below = []
        for node in level:
            if isinstance(node, dict):
                props = node.get("properties")
                below += list(props.values()) if isinstance(props, dict) else []
                below += [node["items"]] if "items" in node else []
        level, depth = below, depth + 1


def checked_schema(schema: Any) -> Any:
    """A tool's parameters checked as a ``JsonSchema`` and kept as sent: the template renders the harness's own
    object (its key order, keys the model does not name)."""
    _depth_within(schema)
    _SCHEMA.validate_python(schema)
    return schema


class FunctionSpec(Sent):
    name: Annotated[StrictStr, says("must be a string, got {got}")]
    description: Annotated[StrictStr, says("must be a string")] = ""
    parameters: Annotated[dict, PlainValidator(checked_schema)] = None  # absent: none; a null is refused


class ChatTool(Sent):
    type: Annotated[Literal["function"], says('must be "function" (the only kind of tool served), got {got}')] = \
        "function"
    function: Annotated[FunctionSpec, says("must be an object with the function's name, got {kind}")]


Tools = Annotated[list[Annotated[ChatTool, says('expected {"type": "function", "function": {"name": ...}}')]],
                  says("must be a list")]
_TOOLS = TypeAdapter(Tools)


def _listed(tool: ChatTool) -> dict:
    """A tool as environments list theirs: its function's name, and description and parameters where sent."""
    fn = tool.function
    return {k: getattr(fn, k) for k in ("name", "description", "parameters") if k in fn.model_fields_set}


def read_tools(tools: Any) -> list[dict]:
    """A request's (or a conversation's) ``tools``, each checked as the chat templates read it; BadRequest if not."""
    return [_listed(t) for t in read_sent(_TOOLS, tools, ("tools",))]


# --- the request -------------------------------------------------------------------------------------------------

def _zero_or_one(value: Any) -> Any:
    """A JSON 0 or 1 for a token flag reads as false or true."""
    return bool(value) if type(value) in (int, float) and value in (0, 1) else value


Flag = Annotated[StrictBool, says("must be true or false, got {got}")] | None  # stream: true or false, never guessed
TokenFlag = Annotated[StrictBool, BeforeValidator(_zero_or_one), says("must be true or false, got {got}")] | None


class StreamOptions(Sent):
    include_usage: Any = False  # truthy: a last chunk with the usage


def _no_top_logprobs(value: Any) -> Any:
    if value not in (None, 0):
        raise refused("is not served: only the sampled token's log-prob (logprobs: true)")
    return value


class ChatBody(Sent):
    """A ``/v1/chat/completions`` body as the proxy serves it (the module's docstring says what that is)."""

    messages: Annotated[list[AnyMessage], Field(min_length=1), says("must be a non-empty list")]
    tools: Annotated[Tools, BeforeValidator(lambda v: v or [])] = []  # null, {}, "": none
    max_tokens: Annotated[StrictInt, Field(gt=0), says("must be a positive integer, got {got}")] | None = Field(
        None, validation_alias=AliasChoices("max_completion_tokens", "max_tokens"))  # the first, where both are sent
    stream: Flag = None
    stream_options: Annotated[StreamOptions, BeforeValidator(lambda v: v or {}), says("must be an object")] = \
        StreamOptions()  # null: none
    top_logprobs: Annotated[Any, AfterValidator(_no_top_logprobs)] = None
    logprobs: TokenFlag = None
    return_tokens_as_token_ids: TokenFlag = None
    return_token_ids: TokenFlag = None
    model: Any = None  # ASKED: recorded where sent
    temperature: Any = None
    top_p: Any = None
    seed: Any = None

    @model_validator(mode="before")
    @classmethod
    def _served(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            raise refused("the body must be a JSON object")
        for key, off in REFUSED.items():
            if key in body and body[key] not in off:
                raise refused(f"{key}={shown(body[key])} is not supported by the recording proxy (one choice, no "
                               "stop strings or penalties)")
        return body

    @model_validator(mode="after")
    def _not_prefilled(self) -> ChatBody:
        if self.messages[-1].role == "assistant":
            raise refused("the last message is the assistant's: continuing a prefilled reply is not supported")
        return self


_BODY = TypeAdapter(ChatBody)


def read_request(body: Any) -> ChatRequest:
    """A chat-completions body as a ChatRequest; BadRequest names what is not served."""
    sent: ChatBody = read_sent(_BODY, body)
    names: dict[str, str] = {}
    stream = sent.stream is True
    return ChatRequest([_message(m, names) for m in sent.messages], [_listed(t) for t in sent.tools], sent.max_tokens,
                       {k: getattr(sent, k) for k in ASKED if k in sent.model_fields_set}, stream,
                       stream and bool(sent.stream_options.include_usage),
                       TokensAsked(bool(sent.logprobs), bool(sent.return_tokens_as_token_ids),
                                   bool(sent.return_token_ids)))


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
