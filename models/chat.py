"""Chat format of the built-in policy: how prompts, assistant turns and tool results become token ids, and back.

One sequence grows through an episode and is never re-rendered::

    <|bos|><|system|># Tools\\nname(arg: type) - description\\n<system text><|end|>
    <|user|>text<|end|>
    <|assistant|><think>reasoning</think>content<tool_call>{"name":..,"arguments":{..}}</tool_call><|end|>   <- policy
    <|tool|>name\\nresult<|end|>                                                                       <- observation
    <|assistant|>...

Text always goes through ``tokenizer.encode`` (bytes only), control tokens through ``encode_special``, so nothing a tool
prints can forge structure.
"""

from __future__ import annotations

import json
from typing import Any

from sandforge.types import Message, ToolCall

from .tokenizer import ByteTokenizer

_CALL_FORMAT = 'write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'


def _type_of(schema: Any) -> str:
    """Compact type of one JSON-schema property: ``string``, ``integer|null``, ``array[string]``, ``"r"|"w"``."""
    if not isinstance(schema, dict):
        return "any"
    if isinstance(schema.get("enum"), list):
        return "|".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    t = schema.get("type", "any")
    if isinstance(t, list):
        return "|".join(str(x) for x in t)
    if t == "array" and isinstance(schema.get("items"), dict):
        return f"array[{_type_of(schema['items'])}]"
    return str(t)


def tool_line(tool: dict) -> str:
    """``name(arg: type, opt?: type) - description`` for an OpenAI-style tool schema (bare or ``{"function": ...}``)."""
    fn = tool.get("function", tool) if tool.get("type") == "function" else tool
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    required = params.get("required")
    args = []
    for arg, schema in props.items():
        optional = "?" if isinstance(required, list) and arg not in required else ""
        args.append(f"{arg}{optional}: {_type_of(schema)}")
    line = f"{fn.get('name', '?')}({', '.join(args)})"
    description = " ".join(str(fn.get("description") or "").split())
    return f"{line} - {description}" if description else line


class ChatFormat:
    """Renders and parses the built-in policy's turns. See the module docstring for the layout."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.tokenizer = tokenizer
        sp = tokenizer.encode_special
        self.bos, self.eos, self.end = sp("<|bos|>"), sp("<|eos|>"), sp("<|end|>")
        self.system, self.user, self.assistant = sp("<|system|>"), sp("<|user|>"), sp("<|assistant|>")
        self.tool = sp("<|tool|>")
        self.think, self.think_end = sp("<think>"), sp("</think>")
        self.call, self.call_end = sp("<tool_call>"), sp("</tool_call>")
        self.stop_ids: list[int] = [self.end, self.eos]
        self.end_of_turn = self.end  # what closes an assistant turn (eos also stops generation)

    # ---------------------------------------------------------------- rendering
    def render_prompt(self, tools: list[dict], messages: list[Message]) -> list[int]:
        """Prompt tokens, ending with the assistant header. ``messages`` are system and user messages."""
        enc = self.tokenizer.encode
        system: list[str] = []
        if tools:
            system.append("\n".join(["# Tools", *(tool_line(t) for t in tools)]))
        ids = [self.bos, self.system]
        users: list[int] = []
        for m in messages:
            if m.role == "system":
                system.append(m.content)
            elif m.role == "user":
                users += [self.user, *enc(m.content), self.end]
            else:
                raise ValueError(
                    f"render_prompt takes system and user messages, got role {m.role!r}; append assistant turns with "
                    "render_assistant and tool results with render_observations instead of re-rendering history"
                )
        return ids + enc("\n".join(system)) + [self.end] + users + [self.assistant]

    def render_assistant(self, msg: Message) -> list[int]:
        """Exactly the tokens the policy generates for ``msg``, ending with ``<|end|>``."""
        enc = self.tokenizer.encode
        ids = [self.think, *enc(msg.reasoning), self.think_end, *enc(msg.content)]
        for call in msg.tool_calls:
            call_json = {"name": call.name, "arguments": call.arguments}
            body = json.dumps(call_json, ensure_ascii=False, separators=(",", ":"))
            ids += [self.call, *enc(body), self.call_end]
        return ids + [self.end]

    def render_observations(self, results: list[Message], closed: bool) -> list[int]:
        """Tokens appended after a generation: tool results (and user messages), then the next assistant header.

        ``closed`` says whether the generation ended with ``<|end|>``; a truncated one is closed here first.
        """
        ids = [] if closed else [self.end]
        for r in results:  # tool results; a harness behind the recording proxy may answer in a user turn
            if r.role == "user":
                ids += [self.user, *self.tokenizer.encode(r.content), self.end]
            else:
                ids += [self.tool, *self.tokenizer.encode(f"{r.name}\n{r.content}"), self.end]
        return ids + [self.assistant]

    # ---------------------------------------------------------------- parsing
    def _segments(self, ids: list[int]) -> list[int | str]:
        """Split ids into control-token ids and decoded text runs."""
        out: list[int | str] = []
        run: list[int] = []
        for i in ids:
            if self.tokenizer.is_special(i):
                if run:
                    out.append(self.tokenizer.decode(run))
                    run = []
                out.append(i)
            else:
                run.append(i)
        if run:
            out.append(self.tokenizer.decode(run))
        return out

    def parse_assistant(self, token_ids: list[int]) -> tuple[Message, list[str]]:
        """The assistant message in ``token_ids`` and one readable error per problem found. Never raises.

        Malformed tool calls are dropped from ``tool_calls`` and reported. Whether a tool exists is the environment's
        job, not the parser's.
        """
        errors: list[str] = []
        try:
            ids = [int(i) for i in token_ids]
        except (TypeError, ValueError, OverflowError):
            return Message(role="assistant"), ["the reply could not be read as token ids"]
        stops = [k for k, i in enumerate(ids) if i in self.stop_ids]
        if stops:
            if stops[0] < len(ids) - 1:
                extra = len(ids) - stops[0] - 1
                errors.append(f"{extra} tokens after <|end|> were ignored; end the reply with <|end|>")
            ids = ids[: stops[0]]
        else:
            errors.append("the reply was cut off before <|end|> (length limit); write shorter replies")

        segments = self._segments(ids)
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        unexpected: dict[int, int] = {}
        state = "start"  # start -> think -> content; "call" while inside <tool_call>
        call_text: list[str] = []
        n_calls = 0  # every <tool_call> the model opened, for numbering errors
        seen_call = had_think = False

        def close_call(terminated: bool) -> None:
            nonlocal n_calls
            n_calls += 1
            if not terminated:
                errors.append(f"tool call {n_calls}: <tool_call> was not closed with </tool_call>; it was not run")
                return
            call, error = self._parse_call("".join(call_text), n_calls)
            if error:
                errors.append(error)
            else:
                call.id = f"call_{len(calls)}"
                calls.append(call)

        for seg in segments:
            if isinstance(seg, str):
                if state == "call":
                    call_text.append(seg)
                elif state == "think":
                    reasoning.append(seg)
                elif not seen_call or seg.strip():  # whitespace between tool calls is not content
                    content.append(seg)
                    state = "content"
            elif seg == self.think and state == "start":
                state, had_think = "think", True
            elif seg == self.think_end and state == "think":
                state = "content"
            elif seg == self.think_end and state in ("start", "content") and not had_think and not seen_call:
                errors.append("</think> without an opening <think>; start the reply with <think>")
                reasoning, content, state, had_think = content, [], "content", True
            elif seg == self.call:
                if state == "think":
                    errors.append("missing </think>: close the reasoning with </think> before calling tools")
                elif state == "call":
                    close_call(terminated=False)
                state, call_text, seen_call = "call", [], True
            elif seg == self.call_end and state == "call":
                close_call(terminated=True)
                state = "content"
            else:
                unexpected[seg] = unexpected.get(seg, 0) + 1
        if state == "think":
            errors.append("missing </think>: close the reasoning with </think>")
        elif state == "call":
            close_call(terminated=False)
        for tid, n in unexpected.items():
            name = self.tokenizer.decode([tid])
            errors.append(f"unexpected {name} in the reply ({n}x); it was ignored")
        msg = Message(role="assistant", content="".join(content), reasoning="".join(reasoning), tool_calls=calls)
        return msg, errors

    def _parse_call(self, text: str, n: int) -> tuple[ToolCall | None, str]:
        """One tool call from the JSON between the tags, or an error that says how to fix it."""
        where = f"tool call {n}"
        try:
            obj = json.loads(text)
        except Exception as e:  # noqa: BLE001 - JSONDecodeError, RecursionError on deep nesting, huge ints
            snippet = text if len(text) <= 80 else text[:77] + "..."
            return None, f"{where}: invalid JSON ({e}) in {snippet!r}; {_CALL_FORMAT}"
        if not isinstance(obj, dict):
            return None, f"{where}: expected a JSON object, got {type(obj).__name__}; {_CALL_FORMAT}"
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            problem = "is missing" if name is None else f"must be a non-empty string, got {json.dumps(name)[:40]}"
            return None, f'{where}: "name" {problem}; {_CALL_FORMAT}'
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            got = type(args).__name__
            return None, f'{where} ({name}): "arguments" must be a JSON object, got {got}; {_CALL_FORMAT}'
        return ToolCall(name=name, arguments=args), ""
