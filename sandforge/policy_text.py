"""Text the policy made, held at the host's edge: bounded before it is stored, logged or shown, and made visible before
it reaches a terminal.

Everything a policy writes (tool outputs, answers a grader quotes, the names of keys in a JSON answer) can be as long as
it likes and can hold terminal control sequences: ESC ``[2J`` clears the screen, ESC ``]0;`` sets the window title,
ESC ``]52;`` writes the clipboard. ``bounded`` keeps a string's head and tail within a limit; ``visible`` replaces every
control character except newline and tab with its escape (``\\x1b``), so a terminal prints it instead of obeying it;
``visible_tree`` does that to every string of a recorded row, keys included.
"""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, and the C1 controls (U+0080-U+009F: a terminal may read U+009B as CSI)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def bounded(text: str, limit: int) -> str:
    """``text`` if it fits in ``limit`` characters, else its head and tail with how much was cut between them."""
    if len(text) <= limit:
        return text
    note = f" [... {len(text) - limit} characters cut ...] "
    keep = max(0, limit - len(note))
    head = keep * 2 // 3
    return text[:head] + note + text[len(text) - (keep - head):] if keep else text[:limit]


def visible(text: str) -> str:
    """``text`` with each control character (newline and tab kept) written as its escape, ``\\x1b`` for ESC."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group(0)):02x}", text)


def visible_tree(value):
    """``value`` (a recorded row: dicts, lists, strings, numbers) with ``visible`` applied to every string in it."""
    if isinstance(value, str):
        return visible(value)
    if isinstance(value, dict):
        return {visible_tree(k) if isinstance(k, str) else k: visible_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [visible_tree(v) for v in value]
    return value
