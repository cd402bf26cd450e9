"""Checks on files the policy left in the sandbox: exact content, a substring or regex, a sha256, a JSON match.

Files are read by a fresh exec as root, so their permissions and whatever the policy left running do not matter;
``answer_bytes`` first looks at what is there, within the check's time: no answer (nothing, a FIFO, a device, a link
to nothing or one the policy made pointing out of the workspace, a file over ``MAX_BYTES``) scores 0 with the reason
and its cause (``ZeroScore``), never a failed episode and never a read of what a link points to outside. Everything else (matching, hashing, parsing) happens here, outside the sandbox, so a sandbox image needs no tools.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex

from sandforge.types import ZERO_CAUSES, Sandbox
from sandforge.verifiers.checks import Inconclusive, VerifierError, ZeroScore, time_left, without_timeout
from sandforge.verifiers.partial import near_miss, text_similarity

MAX_BYTES = 64 << 20  # larger files are not the answer anyone asked for: score 0 instead of reading them


def _show(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


# Run as root from the workdir: $1 the path, $2 the workdir, $3 the size limit. Prints one verdict line: `ok <resolved>`,
# or a cause (ZERO_CAUSES) and why. Links resolve inside the sandbox; one the policy made (not root's) is never followed
# out of the workspace. Only a regular file is read: a FIFO or device would block the read.
_EXAMINE = r"""p=$1 ws=$2 max=$3
[[ -e $p || -L $p ]] || { echo "missing missing"; exit 0; }
r=$(realpath -e -- "$p" 2>/dev/null) || { echo "link a link to nothing"; exit 0; }
[[ $r == *$'\n'* ]] && { echo "malformed a name with a line break"; exit 0; }
n=$(realpath -s -m -- "$p")
if [[ $r != "$n" && $r != "$ws" && $r != "$ws"/* ]]; then
  q=; IFS=/ read -ra parts <<< "${n#/}"
  for c in "${parts[@]}"; do
    q=$q/$c
    [[ -L $q && $(stat -c %u -- "$q") != 0 ]] && { echo "link a link out of $ws"; exit 0; }
  done
fi
[[ -f $r ]] || { echo "not_a_file not a regular file ($(stat -c %F -- "$r"))"; exit 0; }
s=$(stat -c %s -- "$r")
(( s <= max )) || { echo "too_large larger than $max bytes ($s)"; exit 0; }
printf 'ok %s\n' "$r"
"""


def answer_bytes(sandbox: Sandbox, path: str, max_bytes: int = MAX_BYTES) -> bytes:
    """The bytes of the answer file at ``path``, read as root within the check's time. Raises ZeroScore when the
    policy left no answer there: nothing, a link to nothing or out of the workspace, a FIFO, a device, a directory, a
    file over ``max_bytes``, or a check out of time."""
    _check_path(path)
    seen = sandbox.exec(f"bash -c {shlex.quote(_EXAMINE)} examine {shlex.quote(path)} "
                        f"{shlex.quote(sandbox.workdir)} {max_bytes}", user="root", session=False,
                        timeout=time_left(), workdir=sandbox.workdir)
    line = seen.output.strip().splitlines()[-1:] or [""]
    verdict, _, detail = line[0].partition(" ")
    if seen.timed_out:
        raise ZeroScore("timeout", f"{path}: looking at it timed out")
    if verdict != "ok" or seen.exit_code != 0:
        if verdict not in ZERO_CAUSES:
            raise Inconclusive(f"cannot examine {path}: {seen.output.strip()[-200:]}")
        raise ZeroScore(verdict, f"{path}: {detail}")
    try:
        data = sandbox.get_file(detail, user="root", max_bytes=max_bytes)
    except OSError as e:  # e.g. timed out on a slow disk
        raise ZeroScore("timeout", f"{path}: unreadable ({e})") from None
    if data is None:
        raise ZeroScore("missing", f"{path}: missing")
    return data


def read_answer(sandbox: Sandbox, path: str) -> tuple[bytes | None, str]:
    """``answer_bytes``, or None and why the policy left no answer (for verifiers that phrase a verdict of their own)."""
    try:
        return answer_bytes(sandbox, path), ""
    except ZeroScore as e:
        return None, e.reason


def _check_path(path: object) -> None:
    if not isinstance(path, str) or not path or "\0" in path or "\n" in path:
        raise VerifierError(f"path must be a file path, got {path!r}")


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
    actual = answer_bytes(sandbox, path).decode(errors="replace")
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
    data = answer_bytes(sandbox, path)
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
    data = answer_bytes(sandbox, path)
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
    data = answer_bytes(sandbox, path)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ZeroScore("malformed", f"{path}: not JSON ({e})") from None
    except RecursionError:  # absurd nesting: no answer anyone asked for
        raise ZeroScore("malformed", f"{path}: JSON nested too deeply to read") from None
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
