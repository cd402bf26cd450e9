"""A Hugging Face model's own chat template as a sandforge chat format, and the parsers that read its tool calls.

``HFChatFormat`` has ``ChatFormat``'s methods. It renders the first prompt with the model's chat template and
afterwards only token deltas, so the sequence is never re-rendered (ARCHITECTURE.md, token in, token out). A delta is
the suffix of [fixed prefix + tool messages] over [fixed prefix]; when the template would not extend the prefix tokens
exactly, ``TemplateDeltaError`` says so rather than silently training on tokens the model never saw. Tool calls are
read by a parser from ``PARSERS``: "hermes" (Qwen-style ``<tool_call>`` JSON) or "kimi_k2". A template that cannot
show tools gets them declared by sandforge (models/tool_declaration.py).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Callable

from sandforge.types import Message, ToolCall

from .tool_declaration import assistant_text, results_message, with_declaration


# ---------------------------------------------------------------- tool-call parsers
Parser = Callable[[str], tuple[Message, list[str]]]

_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>", re.DOTALL)


def _split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest). Templates may open ``<think>`` in the prompt, so a bare ``</think>`` also closes it."""
    m = _THINK.match(text)
    if m is None:
        if text.lstrip().startswith("<think>"):
            return text.lstrip()[len("<think>") :].strip(), ""  # never closed: all of it was reasoning
        return "", text
    return m.group(1).strip(), text[m.end() :]


def _call_from_json(body: str, where: str, name: str | None = None) -> tuple[ToolCall | None, str]:
    """A ToolCall from ``{"name":..,"arguments":{..}}`` (or from bare arguments when ``name`` is given)."""
    try:
        obj = json.loads(body)
    except Exception as e:  # noqa: BLE001 - JSONDecodeError, RecursionError, huge ints
        snippet = body if len(body) <= 80 else body[:77] + "..."
        return None, f"{where}: invalid JSON ({e}) in {snippet!r}"
    if name is None:
        if not isinstance(obj, dict):
            got = type(obj).__name__
            return None, f'{where}: expected a JSON object {{"name": ..., "arguments": {{...}}}}, got {got}'
        name, obj = obj.get("name"), obj.get("arguments", {})
        if isinstance(obj, str):  # some models double-encode the arguments
            try:
                obj = json.loads(obj)
            except Exception:  # noqa: BLE001
                pass
    if not isinstance(name, str) or not name:
        return None, f'{where}: the tool name must be a non-empty string, got {json.dumps(name)[:40]}'
    if not isinstance(obj, dict):
        return None, f"{where} ({name}): arguments must be a JSON object, got {type(obj).__name__}"
    return ToolCall(name=name, arguments=obj), ""


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[Message, list[str]]:
    """Qwen / Hermes: ``<think>..</think>``, then content and ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``
    blocks."""
    reasoning, rest = _split_reasoning(text)
    errors: list[str] = []
    calls: list[ToolCall] = []
    for n, m in enumerate(_HERMES_CALL.finditer(rest), start=1):
        if not m.group(2):
            errors.append(f"tool call {n}: <tool_call> was not closed with </tool_call>; it was not run")
            continue
        call, err = _call_from_json(m.group(1).strip(), f"tool call {n}")
        if err:
            errors.append(err + '; write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>')
        else:
            call.id = f"call_{len(calls)}"
            calls.append(call)
    content = _HERMES_CALL.sub("", rest).strip()
    return Message(role="assistant", content=content, reasoning=reasoning, tool_calls=calls), errors


_K2_SECTION = re.compile(r"<\|tool_calls_section_begin\|>(.*?)(<\|tool_calls_section_end\|>|$)", re.DOTALL)
_K2_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(.*?)\s*<\|tool_call_argument_begin\|>(.*?)(<\|tool_call_end\|>|$)", re.DOTALL
)
_K2_ID = re.compile(r"^(?:functions\.)?([^\s:]+)(?::(\d+))?$")
_K2_FORMAT = (
    "write <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}"
    "<|tool_call_end|><|tool_calls_section_end|>"
)


def parse_kimi_k2(text: str) -> tuple[Message, list[str]]:
    """Kimi K2: tool calls in a ``<|tool_calls_section_begin|>`` section, ids ``functions.NAME:IDX``, JSON arguments."""
    reasoning, rest = _split_reasoning(text)
    errors: list[str] = []
    calls: list[ToolCall] = []
    n = 0
    for section in _K2_SECTION.finditer(rest):
        if not section.group(2):
            errors.append("the tool-call section was not closed with <|tool_calls_section_end|>")
        found = list(_K2_CALL.finditer(section.group(1)))
        if not found:
            errors.append(f"a tool-call section held no complete call; {_K2_FORMAT}")
        for m in found:
            n += 1
            where = f"tool call {n}"
            if not m.group(3):
                errors.append(f"{where}: not closed with <|tool_call_end|>; it was not run")
                continue
            ident = _K2_ID.match(m.group(1))
            if ident is None:
                errors.append(f"{where}: bad call id {m.group(1)[:40]!r}; {_K2_FORMAT}")
                continue
            call, err = _call_from_json(m.group(2).strip(), where, name=ident.group(1))
            if err:
                errors.append(f"{err}; {_K2_FORMAT}")
            else:
                call.id = m.group(1)
                calls.append(call)
    content = _K2_SECTION.sub("", rest).strip()
    return Message(role="assistant", content=content, reasoning=reasoning, tool_calls=calls), errors


PARSERS: dict[str, Parser] = {"hermes": parse_hermes, "qwen": parse_hermes, "kimi_k2": parse_kimi_k2}


# ---------------------------------------------------------------- chat format
class TemplateDeltaError(ValueError):
    """The chat template would not extend the token sequence exactly (it re-renders history, or tokens merge across
    the boundary), so appending a rendered delta would train on tokens that differ from a full render."""


# A fixed conversation the deltas are cut from: an assistant turn with reasoning and a call, as in an episode.
_BASE_USER = {"role": "user", "content": "Begin."}
_BASE_REPLY = Message("assistant", "", "Plan.", [ToolCall("noop", {}, "call_0")])
_PROBE_TOOL = {"name": "sandforge_probe_tool", "description": "Probe.", "parameters": {"type": "object",
                                                                                          "properties": {}}}
TOOL_FORMATS = ("auto", "template", "hermes")


def _tool_schema(tool: dict) -> dict:
    return tool if tool.get("type") == "function" else {"type": "function", "function": tool}


def _message_dict(m: Message) -> dict:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.role == "assistant":
        if m.reasoning:
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id or f"call_{i}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(m.tool_calls)
            ]
    if m.role == "tool":
        d["name"] = m.name
        d["tool_call_id"] = m.tool_call_id or m.name  # templates that print it (Kimi K2) need one even for errors
    return d


def plain_text(text: str) -> str:
    """``text`` as valid UTF-8 (a lone surrogate, which no tokenizer takes, becomes U+FFFD)."""
    return text.encode("utf-8", "replace").decode("utf-8") if isinstance(text, str) else str(text)


def neutralised(text: str, tokenizer: Any) -> str:
    """``text`` with every special token's spelling broken by a zero-width space, for templates that alter what they
    are given (the placeholder path cannot be used there)."""
    for token in sorted(tokenizer.all_special_tokens + [t.content for t in tokenizer.added_tokens_decoder.values()
                                                        if getattr(t, "special", False)], key=len, reverse=True):
        if len(token) > 1:
            text = text.replace(token, token[0] + "\u200b" + token[1:])
    return text


def substituted(messages: list[dict], values: dict[str, str]) -> list[dict]:
    """``messages`` with each placeholder in their string fields replaced by its value."""
    def sub(v):
        if isinstance(v, str):
            for key, text in values.items():
                v = v.replace(key, text)
            return v
        return v

    return [{k: sub(v) for k, v in m.items()} for m in messages]


class HFChatFormat:
    """``ChatFormat``'s methods for a Hugging Face tokenizer and its chat template.

    ``stop_ids`` are the template's end-of-turn token (the last special token of a rendered assistant turn) and the
    tokenizer's eos. ``template_kwargs`` go to every ``apply_chat_template`` call (e.g. ``enable_thinking``).
    ``tool_format``: "template" renders tools and calls with the model's template, "hermes" declares them
    (models/tool_declaration.py; the hermes parser reads the calls), "auto" declares them only when the template
    shows no tool it is given. ``chat_template`` (Jinja text) replaces the tokenizer's own.
    """

    def __init__(self, tokenizer: Any, parser: str = "hermes", tool_format: str = "auto",
                 chat_template: str | None = None, **template_kwargs: Any) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; choose one of {sorted(PARSERS)}")
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"unknown tool format {tool_format!r}; choose one of {', '.join(TOOL_FORMATS)}")
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; add one to the checkpoint's tokenizer_config.json "
                             "or set model.chat_template")
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        self.declares_tools = tool_format == "hermes" or (tool_format == "auto" and not self._template_shows_tools())
        self.parser = PARSERS["hermes" if self.declares_tools else parser]  # declared tools are called hermes-style
        self._special = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
        }
        turn = self._assistant_turn(self._assistant(_BASE_REPLY))
        ends = [i for i in turn if i in self._special]
        if not ends:
            raise ValueError("the chat template ends assistant turns with no special token; cannot tell where to stop")
        self.end_of_turn = ends[-1]
        eos = tokenizer.eos_token_id
        self.stop_ids: list[int] = list(dict.fromkeys([self.end_of_turn] + ([eos] if eos is not None else [])))

    def _render(self, messages: list[dict], tools: list[dict] | None = None, gen: bool = False,
                untrusted: dict[str, str] | None = None) -> list[int]:
        """The template's tokens for ``messages``. ``untrusted``: placeholder -> text that stands in the messages for
        what a sandbox or the policy wrote (tool output, tool names); that text is tokenized as plain text, with
        special-token parsing off, so ``<|im_end|>`` in a tool's output is never the control token."""
        if not untrusted:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=gen, tokenize=True, **self.template_kwargs
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=gen, tokenize=False, **self.template_kwargs
        )
        if not all(text.count(p) == 1 for p in untrusted):  # a template that rewrote them: neutralise the text instead
            plain = {p: neutralised(t, self.tokenizer) for p, t in untrusted.items()}
            return self._render(substituted(messages, plain), tools, gen)
        ids: list[int] = []
        for part in re.split(f"({'|'.join(map(re.escape, untrusted))})", text):
            if part in untrusted:
                ids += self.tokenizer.encode(untrusted[part], add_special_tokens=False, split_special_tokens=True)
            elif part:
                ids += self.tokenizer.encode(part, add_special_tokens=False)
        return [int(i) for i in ids]

    def _template_shows_tools(self) -> bool:
        """Does the template render a tool it is given (a probe tool's name appears in the prompt)?"""
        try:
            prompt = self._render([_BASE_USER], [_tool_schema(_PROBE_TOOL)], gen=True)
        except Exception:  # noqa: BLE001 - a template that chokes on tools does not show them
            return False
        return _PROBE_TOOL["name"] in self.tokenizer.decode(prompt)

    def _assistant(self, msg: Message) -> dict:
        if self.declares_tools:
            return {"role": "assistant", "content": assistant_text(msg)}
        return _message_dict(msg)

    def _extension(self, prefix: list[int], full: list[int], what: str) -> list[int]:
        if full[: len(prefix)] != prefix:
            k = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
            got = self.tokenizer.decode(full[k : k + 8])
            want = self.tokenizer.decode(prefix[k : k + 8])
            raise TemplateDeltaError(
                f"the chat template does not extend the sequence exactly when {what}: token {k} renders as {got!r} "
                f"instead of {want!r}. Appended tokens would differ from what the model sees on a full render; use a "
                "template that never rewrites earlier turns (e.g. keeps reasoning) and ends turns with a special token"
            )
        return full[len(prefix) :]

    def _cut(self, ids: list[int]) -> int:
        """Length up to and including the last end-of-turn token: what the policy itself generated ends there."""
        ends = [k for k, i in enumerate(ids) if i == self.end_of_turn]
        return ends[-1] + 1 if ends else len(ids)

    def _assistant_turn(self, assistant: dict) -> list[int]:
        header = self._render([_BASE_USER], gen=True)
        turn = self._extension(header, self._render([_BASE_USER, assistant]), "an assistant message is added")
        ends = [k for k, i in enumerate(turn) if i in self._special]
        return turn[: ends[-1] + 1] if ends else turn

    # ---------------------------------------------------------------- rendering
    def render_prompt(self, tools: list[dict], messages: list[Message]) -> list[int]:
        """Prompt tokens from the model's template, ending with the assistant header."""
        for m in messages:
            if m.role not in ("system", "user"):
                raise ValueError(
                    f"render_prompt takes system and user messages, got role {m.role!r}; append assistant turns with "
                    "render_assistant and tool results with render_observations instead of re-rendering history"
                )
        rendered = [_message_dict(m) for m in messages]
        if self.declares_tools:
            return self._render(with_declaration(rendered, tools), gen=True)
        return self._render(rendered, [_tool_schema(t) for t in tools], gen=True)

    def render_assistant(self, msg: Message) -> list[int]:
        """The tokens the policy generates for ``msg`` (for SFT data), ending with the end-of-turn token."""
        return self._assistant_turn(self._assistant(msg))

    def render_observations(self, results: list[Message], closed: bool) -> list[int]:
        """Only the tokens appended after a generation: tool results (and user messages, which a harness behind the
        recording proxy may answer with), then the next assistant header.

        ``closed`` says whether the generation ended with the end-of-turn token; a truncated one is closed here.
        Raises ``TemplateDeltaError`` when the template would not extend the sequence exactly.
        """
        base = self._assistant(_BASE_REPLY)
        prefix = self._render([_BASE_USER, base])
        untrusted: dict[str, str] = {}  # placeholder -> tool output or name, tokenized as plain text

        def hold(text: str | None) -> str | None:
            if text is None:
                return None
            key = f"SANDFORGEUNTRUSTED{len(untrusted)}X{uuid.uuid4().hex[:8]}"
            untrusted[key] = plain_text(text)
            return key

        held = [Message(role="user", content=hold(r.content)) if r.role == "user" else
                Message(role="tool", content=hold(r.content), name=hold(r.name), tool_call_id=hold(r.tool_call_id))
                for r in results]
        if self.declares_tools:  # each run of tool results is one user turn of <tool_response> blocks
            tools, run = [], []
            for m in held + [None]:
                if (m is None or m.role == "user") and run:
                    tools.append(results_message(run))
                    run = []
                if m is not None:
                    (run.append(m) if m.role == "tool" else tools.append(_message_dict(m)))
        else:
            tools = [_message_dict(m) for m in held]
        full = self._render([_BASE_USER, base, *tools], gen=True, untrusted=untrusted)
        cut = self._cut(prefix)
        delta = self._extension(prefix[:cut], full, "tool results follow an assistant turn")
        return delta if closed else [self.end_of_turn, *delta]

    # ---------------------------------------------------------------- parsing
    def parse_assistant(self, token_ids: list[int]) -> tuple[Message, list[str]]:
        """The assistant message in ``token_ids`` and one readable error per problem. Never raises."""
        try:
            ids = [int(i) for i in token_ids]
            errors: list[str] = []
            stops = [k for k, i in enumerate(ids) if i in self.stop_ids]
            if stops:
                if stops[0] < len(ids) - 1:
                    errors.append(f"{len(ids) - stops[0] - 1} tokens after the end of the turn were ignored")
                ids = ids[: stops[0]]
            else:
                errors.append("the reply was cut off before the end of the turn (length limit); write shorter replies")
            msg, parse_errors = self.parser(self.tokenizer.decode(ids, skip_special_tokens=False))
            return msg, errors + parse_errors
        except Exception as e:  # noqa: BLE001 - the parser must never crash a run
            return Message(role="assistant"), [f"the reply could not be parsed ({type(e).__name__}: {e})"]
