"""Checks on files the policy left in the sandbox."""

from __future__ import annotations

from sandforge.environments.sandbox.docker_sandbox import Sandbox
from sandforge.verifiers.base import VerifierError, register


def _show(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def file_equals(sandbox: Sandbox, path: str, content: str, strip: bool = True) -> tuple[float, str]:
    """1.0 if the file at ``path`` holds exactly ``content`` (both stripped of surrounding whitespace when ``strip``).

    The file is read by a fresh exec as root, so its permissions and whatever the policy left running do not matter.
    """
    try:
        actual = sandbox.read_file(path, user="root")
    except OSError as e:  # a directory, a FIFO the policy made, ...: the answer is not a readable file
        return 0.0, f"{path}: unreadable ({e})"
    if actual is None:
        return 0.0, f"{path}: missing"
    ok = actual.strip() == content.strip() if strip else actual == content
    return (1.0, f"{path}: matches") if ok else (0.0, f"{path}: expected {_show(content)}, got {_show(actual)}")


@register("file_equals")
def _file_equals_check(sandbox: Sandbox, args: dict) -> tuple[float, str]:
    unknown = set(args) - {"path", "content", "strip"}
    if unknown or "path" not in args or "content" not in args:
        raise VerifierError(f"file_equals takes path, content[, strip]; got {sorted(args)}")
    return file_equals(sandbox, **args)
