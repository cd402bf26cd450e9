"""Supervised data as users keep it: chat conversations, for the warm start (``warmup.data``) beside or instead of
the replayed reference solutions.

A file of conversations is JSONL, one object per line with ``messages`` as TRL's and prime-rl's SFT take them (the
OpenAI chat shape: ``system``, ``user``, ``assistant`` and ``tool`` messages; an assistant's ``tool_calls`` and its
``reasoning_content`` or ``reasoning``; text content parts) and optionally ``tools`` (OpenAI function schemas the
conversation was held with). A folder is a Hugging Face dataset saved with ``save_to_disk`` (the ``datasets``
package), whose rows have the same columns. Each conversation is rendered with the policy's own chat template, as
the agent loop renders an episode (rollout/rows.py ``conversation_tokens``), and trained on its assistant tokens only
(the loss mask). A line that cannot be read is a ``DataError`` naming the file and line; nothing is dropped silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from sandforge.rollout.chat_api import BadRequest, read_message, read_tools
from sandforge.rollout.rows import conversation_tokens
from sandforge.types import Message, TrainingRow


class DataError(ValueError):
    """A conversation that cannot be read: the message names the file and line (or row)."""


@dataclass(frozen=True)
class Conversation:
    messages: list[Message]
    tools: list[dict]
    where: str  # "data.jsonl:12", for errors


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) for each conversation of ``path``: the lines of a JSONL file, or a saved dataset's rows."""
    if path.is_dir():
        try:
            import datasets
        except ImportError:
            raise DataError(f"{path}: a folder is read as a Hugging Face dataset saved with save_to_disk, which needs "
                            "the `datasets` package (pip install datasets); or give a JSONL file") from None
        try:
            data = datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001 - the library names what is wrong
            raise DataError(f"{path}: not a dataset saved with save_to_disk ({type(e).__name__}: {e})") from None
        if isinstance(data, datasets.DatasetDict):
            if "train" not in data:
                raise DataError(f"{path}: a dataset with splits {sorted(data)} and no 'train' split")
            data = data["train"]
        for i, row in enumerate(data):
            yield f"{path}[{i}]", row
        return
    if not path.is_file():
        raise DataError(f"{path}: no such file or folder")
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON ({e})") from None


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of ``path`` (JSONL or a saved dataset), read; DataError at the first that cannot be."""
    out = []
    for where, record in _records(Path(path)):
        if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
            raise DataError(f"{where}: expected an object with a non-empty list `messages`")
        try:
            names: dict[str, str] = {}
            messages = [read_message(m, i, names) for i, m in enumerate(record["messages"])]
            tools = read_tools(record.get("tools") or [])
        except BadRequest as e:
            raise DataError(f"{where}: {e}") from None
        if not any(m.role == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant message: nothing to learn from")
        if messages[0].role not in ("system", "user"):
            raise DataError(f"{where}: the conversation starts with a {messages[0].role} message, not system or user")
        out.append(Conversation(messages, tools, where))
    if not out:
        raise DataError(f"{path}: no conversation in it")
    return out


def conversation_row(chat, conv: Conversation) -> TrainingRow:
    """``conv`` rendered with the policy's chat format, as an episode is (rollout/rows.py ``conversation_tokens``: the
    leading system and user messages as the prompt, each assistant message as the policy's reply, the user and tool
    messages after one as its observations), the loss on the assistant replies' tokens only. Trailing user or tool
    messages answer nothing the policy learns and are left out."""
    messages = list(conv.messages)
    while messages and messages[-1].role != "assistant":
        messages.pop()
    try:
        ids, mask = conversation_tokens(chat, conv.tools, messages)
    except BadRequest as e:
        raise DataError(f"{conv.where}: {e}") from None
    return TrainingRow(token_ids=ids, loss_mask=mask)


def data_rows(chat, path: str | Path, max_context: int) -> tuple[list[TrainingRow], int]:
    """The training rows of ``path``'s conversations, and how many were left out for being longer than
    ``max_context`` tokens (said by the caller, never silently)."""
    rows = [conversation_row(chat, c) for c in read_conversations(path)]
    kept = [r for r in rows if len(r.token_ids) <= max_context]
    return kept, len(rows) - len(kept)
