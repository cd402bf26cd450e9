"""Tools an environment offers the policy: methods marked ``@tool``, described by their signature and docstring.

``tool_schemas`` turns them into OpenAI-style function schemas for the prompt; ``call_tool`` checks a parsed call
against the same signature before running it, so a malformed call becomes a message the model can learn from.
"""

from __future__ import annotations

import difflib
import inspect
import re
import typing
from typing import Any, Callable

from sandforge.types import ToolCall

_MARK = "__sandforge_tool__"
_JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


class ToolError(ValueError):
    """A tool call the environment cannot run as given; the message tells the model what to fix."""


def tool(fn: Callable) -> Callable:
    """Mark an environment method as a tool. Parameters must be typed str/int/float/bool; the docstring's first
    line is the description the model reads, so keep it short. An ``Args:`` section (Google style, ``name: text``
    or ``name (type): text``, continuation lines indented deeper) describes the parameters in the schema."""
    setattr(fn, _MARK, True)
    return fn


def _tools(obj: Any) -> dict[str, Callable]:
    """Tool name -> unbound function, in definition order (base classes first)."""
    found: dict[str, Callable] = {}
    for klass in reversed(type(obj).__mro__):
        for name, attr in vars(klass).items():
            if getattr(attr, _MARK, False):
                found[name] = attr
            elif name in found:  # a subclass overrode a tool with a plain method: no longer a tool
                del found[name]
    return found


def _params(fn: Callable) -> list[tuple[str, type, bool]]:
    """(name, type, required) for each parameter after self."""
    hints = typing.get_type_hints(fn)
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        kind = hints.get(p.name)
        if kind not in _JSON_TYPES:
            raise TypeError(f"tool {fn.__name__}: parameter '{p.name}' must be typed str, int, float or bool")
        out.append((p.name, kind, p.default is inspect.Parameter.empty))
    return out


_ARG_LINE = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def param_docs(fn: Callable) -> dict[str, str]:
    """Parameter name -> description, from the docstring's ``Args:`` section (empty without one)."""
    lines = (inspect.getdoc(fn) or "").splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:")), None)
    if start is None:
        return {}
    docs: dict[str, str] = {}
    indent, current = None, None
    for line in lines[start:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent or depth == 0:  # the next section ("Returns:") or the end of the indented block
            break
        match = _ARG_LINE.match(line.strip()) if depth == indent else None
        if match:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current is not None:  # a continuation line
            docs[current] = f"{docs[current]} {line.strip()}".strip()
    return docs


def _signature(name: str, fn: Callable) -> str:
    args = ", ".join(f"{p}: {_JSON_TYPES[t]}" + ("" if req else "?") for p, t, req in _params(fn))
    return f"{name}({args})"


def tool_schemas(obj: Any) -> list[dict]:
    """OpenAI-style function schemas for every ``@tool`` method of ``obj``."""
    schemas = []
    for name, fn in _tools(obj).items():
        params = _params(fn)
        docs = param_docs(fn)
        stray = sorted(set(docs) - {p for p, _, _ in params})
        if stray:
            raise TypeError(f"tool {name}: its docstring's Args names {', '.join(map(repr, stray))}, not a parameter")
        schemas.append(
            {
                "name": name,
                "description": (inspect.getdoc(fn) or "").split("\n")[0].strip(),
                "parameters": {
                    "type": "object",
                    "properties": {
                        p: {"type": _JSON_TYPES[t], **({"description": docs[p]} if docs.get(p) else {})}
                        for p, t, _ in params
                    },
                    "required": [p for p, _, req in params if req],
                },
            }
        )
    return schemas


def _matches(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return _JSON_TYPES.get(type(value), type(value).__name__)


def call_tool(obj: Any, call: ToolCall) -> str:
    """Validate ``call`` against ``obj``'s tools and run it; raises ToolError saying what was wrong."""
    tools = _tools(obj)
    fn = tools.get(call.name)
    if fn is None:
        valid = ", ".join(_signature(n, f) for n, f in tools.items())
        close = difflib.get_close_matches(str(call.name), list(tools), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ToolError(f"unknown tool '{call.name}'{hint}. Tools: {valid}")
    usage = f"usage: {_signature(call.name, fn)}"
    if not isinstance(call.arguments, dict):
        raise ToolError(f"{call.name}: arguments must be a JSON object; {usage}")
    params = _params(fn)
    names = {p for p, _, _ in params}
    extra = sorted(set(call.arguments) - names)
    if extra:
        raise ToolError(f"{call.name}: unknown argument {', '.join(map(repr, extra))}; {usage}")
    for p, kind, required in params:
        if p not in call.arguments:
            if required:
                raise ToolError(f"{call.name}: missing argument '{p}'; {usage}")
        elif not _matches(call.arguments[p], kind):
            got = _json_type(call.arguments[p])
            raise ToolError(f"{call.name}: '{p}' must be {_JSON_TYPES[kind]}, got {got}; {usage}")
    result = fn(obj, **call.arguments)
    return "" if result is None else str(result)
