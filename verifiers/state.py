"""State checks: an SQL query against an app's database inside the sandbox, compared with the rows a task expects.

Mock apps (slack, notion, the browser's sites) keep their state in SQLite. Grading reads that state directly, the way
a person would check "is the reply in the right thread", instead of trusting anything the policy said. The query runs
in a fresh exec as root with python3's sqlite3, opening the database read-only (``mode=ro`` URI, ``query_only``), so a
check can never change what it grades, and the policy's processes and permissions play no part.

Check: ``{"verifier": "sql", "db": "/abs/app.db", "query": "SELECT ...", "expect": [[...], ...]}``; optional
``"ordered": true`` (rows must come in this order; default: any order, as a multiset), ``"partial": true`` (rows that
are not exactly right score their closeness, see verifiers/partial.py; success still needs the exact rows) and
``"timeout"`` (seconds; the query is killed inside the container when the check's time is up).

What the policy left decides the score, never whether the episode counts: a database that is missing, corrupt or
lacks the table, and a query still running at the check's timeout, score 0 with the reason. Only a query that cannot
run on a sound database (bad SQL, a write) fails the episode: that is the task's fault.
"""

from __future__ import annotations

import base64
import json
import shlex
from collections import Counter

from sandforge.types import Sandbox
from sandforge.verifiers.checks import Inconclusive, VerifierError, ZeroScore, time_left, without_timeout
from sandforge.verifiers.partial import near_miss, rows_similarity

_SHOW = 120  # characters of expected/got in a reason

# Runs inside the sandbox as ``python3 -I`` from / (no user site, no environment, no cwd on sys.path: no module the
# policy planted is imported). Its input is one base64 line of JSON on stdin, {"db": path, "query": sql}, never argv,
# which any process that can read /proc would see. Prints one JSON line: {"rows": [...]}, {"missing": why} (no
# database file: the policy may have deleted it) or {"error": "...", "fault": "task" | "state"}.
_QUERY_SCRIPT = r"""
import base64, json, os, sqlite3, stat, sys, urllib.parse
job = json.loads(base64.b64decode(sys.stdin.readline()))
db, query = job["db"], job["query"]
try:
    mode = os.stat(db).st_mode
except OSError as e:
    print(json.dumps({"missing": f"{type(e).__name__}: {e.strerror}"}))
    sys.exit(0)
if not stat.S_ISREG(mode):
    print(json.dumps({"missing": "not a regular file"}))
    sys.exit(0)
try:
    con = sqlite3.connect("file:" + urllib.parse.quote(db) + "?mode=ro", uri=True)
    con.execute("PRAGMA query_only = ON")
    rows = [list(r) for r in con.execute(query).fetchall()]
    print(json.dumps({"rows": rows}, default=str))
except sqlite3.Error as e:
    text = str(e)
    task = isinstance(e, sqlite3.ProgrammingError) or any(
        words in text for words in ("syntax error", "incomplete input", "readonly", "attempt to write"))
    print(json.dumps({"error": f"{type(e).__name__}: {text}", "fault": "task" if task else "state"}))
"""


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= _SHOW else text[:_SHOW] + "..."


def _key(row: list) -> str:
    return json.dumps(row, sort_keys=True, default=str)


def query_rows(sandbox: Sandbox, db: str, query: str, timeout: float | None = None) -> list[list]:
    """The rows ``query`` returns from the SQLite file ``db`` in the sandbox, read-only, as root in a fresh exec that
    is killed after ``timeout`` seconds (default: what the running check has left).

    Raises ZeroScore when the database is missing or unreadable as a database, or the query runs out of time (the
    policy left that state: score 0), VerifierError when the query cannot run on a sound database (bad SQL: the
    task's fault, so the episode is failed rather than scored), and ``Inconclusive`` when its run printed no answer
    (no python3 in the image, or a sandbox the policy broke: the failure rule tells which on a pristine sandbox).
    """
    if not db.startswith("/"):
        raise VerifierError(f"sql: 'db' must be an absolute path inside the sandbox, got {db!r}")
    payload = base64.b64encode(json.dumps({"db": db, "query": query}).encode()).decode()
    command = f"python3 -I -c {shlex.quote(_QUERY_SCRIPT)} <<'SFEOF'\n{payload}\nSFEOF"
    timeout = time_left() if timeout is None else timeout
    result = sandbox.exec(command, timeout=timeout, user="root", workdir="/", session=False)
    if result.timed_out:
        raise ZeroScore("timeout", f"sql: the query on {db} was killed after {timeout:.1f} s, the check's timeout")
    last = result.output.strip().splitlines()[-1:] or [""]
    try:
        answer = json.loads(last[0])
    except json.JSONDecodeError:
        raise Inconclusive(f"sql: could not run the query on {db} (exit {result.exit_code}): "
                            f"{result.output.strip()[-300:]} (does the image have python3?)") from None
    if "missing" in answer:
        raise ZeroScore("missing", f"{db}: no database ({answer['missing']})")
    if "error" in answer:
        if answer.get("fault") == "state":
            raise ZeroScore("state", f"{db}: {answer['error']}")
        raise VerifierError(f"sql: query on {db} failed: {answer['error']}; query: {query[:200]}")
    return answer["rows"]


def sql_check(sandbox: Sandbox, db: str, query: str, expect: list, ordered: bool = False,
              partial: bool = False) -> tuple[float, str]:
    """1.0 iff ``query`` returns exactly the rows ``expect`` (any order unless ``ordered``), else 0 or, with
    ``partial``, a near miss's credit (below 1); the reason shows both."""
    got = query_rows(sandbox, db, query)
    # JSON normalises both sides (tuples -> lists, 1 vs 1.0 stay distinct only if SQLite stored them so)
    want = json.loads(json.dumps(expect))
    if ordered:
        ok = [_key(r) for r in got] == [_key(r) for r in want]
    else:
        ok = Counter(map(_key, got)) == Counter(map(_key, want))
    if ok:
        return 1.0, f"{db}: state matches ({len(got)} row{'s' if len(got) != 1 else ''})"
    score = near_miss(rows_similarity(got, want, ordered)) if partial else 0.0
    return score, f"{db}: expected {_short(want)}, got {_short(got)}"


def sql_verifier(sandbox: Sandbox, args: dict) -> tuple[float, str]:
    args = without_timeout(args)  # run_check enforces it; time_left() passes it on to the exec
    unknown = set(args) - {"db", "query", "expect", "ordered", "partial"}
    if unknown or not {"db", "query", "expect"} <= set(args):
        raise VerifierError(f"sql takes db, query, expect[, ordered, partial, timeout]; got {sorted(args)}")
    if not isinstance(args["expect"], list) or not all(isinstance(r, list) for r in args["expect"]):
        raise VerifierError(f"sql: 'expect' must be a list of rows (lists), got {_short(args['expect'])}")
    return sql_check(sandbox, **args)


sql_verifier.partial_credit = True
