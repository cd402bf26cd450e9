"""Checks on files the policy left in the sandbox: exact content, a substring or regex, a sha256, a JSON match.

Files are read by a fresh exec as root, so their permissions and whatever the policy left running do not matter;
everything else (matching, hashing, parsing) happens here, outside the sandbox, so a sandbox image needs no tools.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex

from sandforge.types import Sandbox
from sandforge.verifiers.checks import VerifierError, time_left, without_timeout
from sandforge.verifiers.partial import near_miss, text_similarity

MAX_BYTES = 64 << 20  # larger files are not the answer anyone asked for: score 0 instead of reading them


def _show(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def read_answer(sandbox: Sandbox, path: str) -> tuple[bytes | None, str]:
    """The file's bytes, or None and why it cannot be the answer (missing, a directory, a FIFO, too large).

    A FIFO or device would block the read until the file timeout, so the file's kind is checked first, within the
    check's budget: a policy that leaves a FIFO as its answer scores 0, it does not make grading hang.
    """
    kind = sandbox.exec(f"[ ! -e {shlex.quote(path)} ] || stat -L -c %F -- {shlex.quote(path)}", user="root",
                        session=False, timeout=time_left())
    if kind.timed_out or kind.exit_code != 0:
        return None, f"{path}: unreadable ({kind.output.strip() or 'stat timed out'})"
    if kind.output.strip() not in ("", "regular file", "regular empty file"):
        return None, f"{path}: not a regular file ({kind.output.strip()})"
    try:
        data = sandbox.get_file(path, user="root", max_bytes=MAX_BYTES)
    except OSError as e:  # a file swapped under us, one larger than MAX_BYTES
        return None, f"{path}: unreadable ({e})"
    return (None, f"{path}: missing") if data is None else (data, "")


def _takes(name: str, args: dict, required: set[str], optional: set[str]) -> None:
    unknown, missing = set(args) - required - optional, required - set(args)
    if unknown or missing:
        optional_text = f"[, {', '.join(sorted(optional))}]" if optional else ""
        raise VerifierError(f"{name} takes {', '.join(sorted(required))}{optional_text}[, timeout]; got {sorted(args)}")


# --- file_equals --------------------------------------------------------------------------------------------------


def file_equals(sandbox: Sandbox, path: str, content: str, strip: bool = True,
                partial: bool = False) -> tuple[float, str]:
    """1.0 if the file at ``path`` holds exactly ``content`` (both stripped of surrounding whitespace if ``strip``);
    with ``partial``, a file that differs scores its closeness to ``content`` as a near miss (below 1)."""
    try:
        actual = sandbox.read_file(path, user="root")
    except OSError as e:  # a directory, a FIFO the policy made, ...: the answer is not a readable file
        return 0.0, f"{path}: unreadable ({e})"
    if actual is None:
        return 0.0, f"{path}: missing"
    got, want = (actual.strip(), content.strip()) if strip else (actual, content)
    if got == want:
        return 1.0, f"{path}: matches"
    score = near_miss(text_similarity(got, want)) if partial else 0.0
    return score, f"{path}: expected {_show(content)}, got {_show(actual)}"


def file_equals_verifier(sandbox: Sandbox, args: dict) -> tuple[float, str]:
    args = without_timeout(args)
    unknown = set(args) - {"path", "content", "strip", "partial"}
    if unknown or "path" not in args or "content" not in args:
        raise VerifierError(f"file_equals takes path, content[, partial, strip, timeout]; got {sorted(args)}")
    return file_equals(sandbox, **args)


file_equals_verifier.partial_credit = True  # its checks take "partial": true


# --- file_contains ------------------------------------------------------------------------------------------------


def file_contains(sandbox: Sandbox, path: str, text: str | None = None, pattern: str | None = None,
                  absent: bool = False) -> tuple[float, str]:
    """1.0 if the file holds ``text`` (a substring) or matches ``pattern`` (a Python regex, multiline: ``^`` and ``$``
    match at line ends); with ``absent``, 1.0 if it does not. A missing file scores 0 either way: "no TODO left" in a
    file that was deleted is not an answer."""
    data, why = read_answer(sandbox, path)
    if data is None:
        return 0.0, why
    content = data.decode(errors="replace")
    if pattern is not None:
        found, what = re.search(pattern, content, re.MULTILINE) is not None, f"pattern {_show(pattern)}"
    else:
        found, what = text in content, _show(text)
    if found != absent:
        return 1.0, f"{path}: {'has no' if absent else 'has'} {what}"
    return 0.0, f"{path}: {'has' if absent else 'has no'} {what}" + ("" if absent else f" (got {_show(content)})")


def file_contains_verifier(sandbox: Sandbox, args: dict) -> tuple[float, str]:
    args = without_timeout(args)
    _takes("file_contains", args, {"path"}, {"text", "pattern", "absent"})
    if ("text" in args) == ("pattern" in args):
        raise VerifierError("file_contains takes exactly one of text (a substring) and pattern (a regex)")
    if not isinstance(args.get("text", args.get("pattern")), str):
        raise VerifierError("file_contains: text / pattern must be a string")
    if "pattern" in args:
        try:
            re.compile(args["pattern"])
        except re.error as e:
            raise VerifierError(f"file_contains: pattern {args['pattern']!r} is not a valid regex: {e}") from None
    return file_contains(sandbox, **args)


# --- file_hash ----------------------------------------------------------------------------------------------------


def file_hash(sandbox: Sandbox, path: str, sha256: str) -> tuple[float, str]:
    """1.0 if the sha256 of the file's exact bytes is ``sha256`` (hex): binary outputs, byte-exact copies."""
    data, why = read_answer(sandbox, path)
    if data is None:
        return 0.0, why
    digest = hashlib.sha256(data).hexdigest()
    if digest == sha256.lower():
        return 1.0, f"{path}: sha256 matches"
    return 0.0, f"{path}: sha256 {digest[:12]}..., expected {sha256[:12].lower()}... ({len(data)} bytes)"


def file_hash_verifier(sandbox: Sandbox, args: dict) -> tuple[float, str]:
    args = without_timeout(args)
    _takes("file_hash", args, {"path", "sha256"}, set())
    if not isinstance(args["sha256"], str) or not re.fullmatch(r"[0-9a-fA-F]{64}", args["sha256"]):
        raise VerifierError(f"file_hash: sha256 must be 64 hex digits, got {args['sha256']!r}")
    return file_hash(sandbox, **args)


# --- json_match ---------------------------------------------------------------------------------------------------


def json_match(sandbox: Sandbox, path: str, expected, at: str | list = "", exact: bool = False,
               partial: bool = False) -> tuple[float, str]:
    """Does the file parse as JSON and hold ``expected`` at ``at``?

    ``at`` points into the document: "results.0.name" (dots; integers index lists) or a list of keys for keys with
    dots in them. By default ``expected`` is a subset: objects may have more keys than it names, lists must have the
    same length with each element matched. ``exact`` demands equality. Numbers compare by value (1 == 1.0) but booleans
    are not numbers. With ``partial`` the score is the fraction of expected values found (dense reward); otherwise
    1.0 only if all are.
    """
    data, why = read_answer(sandbox, path)
    if data is None:
        return 0.0, why
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return 0.0, f"{path}: not JSON ({e})"
    keys = at if isinstance(at, list) else [k for k in at.split(".") if k != ""]
    for depth, key in enumerate(keys):
        here = ".".join(str(k) for k in keys[:depth]) or "the top level"
        if isinstance(doc, dict) and str(key) in doc:
            doc = doc[str(key)]
        elif isinstance(doc, list) and re.fullmatch(r"-?\d+", str(key)) and -len(doc) <= int(key) < len(doc):
            doc = doc[int(key)]
        else:
            return 0.0, f"{path}: nothing at {'.'.join(map(str, keys))} ({here} has no {str(key)!r})"
    compared, matched, mismatches = json_mismatches(expected, doc, exact, ".".join(map(str, keys)))
    where = f"{path}" + (f" at {'.'.join(map(str, keys))}" if keys else "")
    if not mismatches:
        return 1.0, f"{where}: matches"
    shown = "; ".join(mismatches[:3]) + (f"; and {len(mismatches) - 3} more" if len(mismatches) > 3 else "")
    return (matched / compared if partial else 0.0), f"{where}: {matched}/{compared} values match ({shown})"


def json_mismatches(expected, actual, exact: bool, at: str = "") -> tuple[int, int, list[str]]:
    """(expected values compared, how many matched, a description of each mismatch). A value is a leaf of
    ``expected`` (or, with ``exact``, a key ``expected`` lacks); a missing or wrongly typed object or list fails all
    the leaves beneath it."""
    name, prefix = at or "the document", f"{at}." if at else ""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return _leaves(expected), 0, [f"{name}: expected an object, got {_js(actual)}"]
        compared, matched, mismatches = 0, 0, []
        for key, value in expected.items():
            if key not in actual:
                compared += _leaves(value)
                mismatches.append(f"{prefix}{key}: missing")
                continue
            n, ok, bad = json_mismatches(value, actual[key], exact, f"{prefix}{key}")
            compared, matched, mismatches = compared + n, matched + ok, mismatches + bad
        extra = sorted(set(actual) - set(expected)) if exact else []
        mismatches += [f"{prefix}{k}: unexpected" for k in extra]
        if compared + len(extra) == 0:  # {} matches any object (exact: only {})
            return 1, 1, mismatches
        return compared + len(extra), matched, mismatches
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            got = f"{len(actual)} items" if isinstance(actual, list) else _js(actual)
            return _leaves(expected), 0, [f"{name}: expected {len(expected)} items, got {got}"]
        if not expected:
            return 1, 1, []
        compared, matched, mismatches = 0, 0, []
        for i, (want, got) in enumerate(zip(expected, actual)):
            n, ok, bad = json_mismatches(want, got, exact, f"{prefix}{i}")
            compared, matched, mismatches = compared + n, matched + ok, mismatches + bad
        return compared, matched, mismatches
    if expected == actual and isinstance(expected, bool) == isinstance(actual, bool):
        return 1, 1, []
    return 1, 0, [f"{name}: expected {_js(expected)}, got {_js(actual)}"]


def _js(value, limit: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _leaves(value) -> int:
    if isinstance(value, dict):
        return sum(_leaves(v) for v in value.values()) or 1
    if isinstance(value, list):
        return sum(_leaves(v) for v in value) or 1
    return 1


def json_match_verifier(sandbox: Sandbox, args: dict) -> tuple[float, str]:
    args = without_timeout(args)
    _takes("json_match", args, {"path", "expected"}, {"at", "exact", "partial"})
    if not isinstance(args.get("at", ""), (str, list)):
        raise VerifierError(f"json_match: at must be a dotted path or a list of keys, got {args['at']!r}")
    return json_match(sandbox, **args)


json_match_verifier.partial_credit = True
