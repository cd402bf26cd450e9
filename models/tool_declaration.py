"""Tools for a chat template that cannot show them: sandforge declares them itself, in the hermes style.

Many instruct models' templates (SmolLM2's, plain ChatML) ignore the ``tools`` they are given, render no ``tool_calls``
and know no ``tool`` role. For those, ``HFChatFormat`` (``model.tool_format: auto`` finds out by rendering a probe
tool; ``hermes`` forces it) puts a system block in front of the conversation that lists the tools' JSON schemas and
asks for calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, writes the assistant's own turns that
way (reasoning in ``<think>...</think>``, which the hermes parser reads back), and returns tool results inside a user
turn as ``<tool_response>...</tool_response>`` blocks. Everything is still rendered by the model's own template, so its
special tokens and turn markers are the ones it was trained with.
"""

from __future__ import annotations

import json

from sandforge.types import Message

HOW_TO_CALL = (
    "You can use tools. Their signatures (JSON schema) are listed between <tools> and </tools>:\n<tools>\n{tools}\n"
    "</tools>\n\nTo use a tool, write one block per call, each a JSON object with the tool's name and its arguments:\n"
    '<tool_call>\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>\n'
    "Each call's result comes back to you between <tool_response> and </tool_response>."
)


def declaration(tools: list[dict]) -> str:
    """The system text that declares ``tools`` (schemas as environments list them: name, description, parameters)."""
    lines = [json.dumps({"type": "function", "function": t} if t.get("type") != "function" else t,
                        ensure_ascii=False) for t in tools]
    return HOW_TO_CALL.format(tools="\n".join(lines))


def with_declaration(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` with the tool declaration in front: appended to a leading system message, or as one."""
    if not tools:
        return messages
    text = declaration(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def assistant_text(msg: Message) -> str:
    """An assistant turn as the declared format writes it: ``<think>`` reasoning, content, ``<tool_call>`` blocks."""
    parts = [f"<think>\n{msg.reasoning}\n</think>"] if msg.reasoning else []
    if msg.content:
        parts.append(msg.content)
    parts += [f'<tool_call>\n{json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)}\n</tool_call>'
              for c in msg.tool_calls]
    return "\n".join(parts)


def results_message(results: list[Message]) -> dict:
    """Tool results as the one user turn that answers a reply's calls."""
    blocks = [f"<tool_response>\n{r.content}\n</tool_response>" for r in results]
    return {"role": "user", "content": "\n".join(blocks)}
