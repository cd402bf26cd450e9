"""The `sql` state verifier on a real SQLite file in a real container: it compares rows, explains a mismatch, never
writes, and gives up (failing the episode, not scoring it) when the query cannot run."""

from __future__ import annotations

import time

import pytest

from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec
from sandforge.sandbox.images import build_images
from sandforge.types import ExecResult, Task
from sandforge.verifiers.checks import VerifierError, ZeroScore, known_verifiers, score_task
from sandforge.verifiers.state import query_rows, sql_check

pytestmark = pytest.mark.docker

DB = "/tmp/app/test.db"
MAKE_DB = f"""python3 - <<'EOF'
import os, sqlite3
os.makedirs("/tmp/app", mode=0o755, exist_ok=True)
con = sqlite3.connect("{DB}")
con.executescript("CREATE TABLE t (name TEXT, n INTEGER); INSERT INTO t VALUES ('a', 1), ('b', 2), ('c', 3);")
con.commit()
os.chmod("{DB}", 0o600)
EOF"""


@pytest.fixture(scope="module")
def app_sandbox(docker_client):
    image = build_images(["apps"], client=docker_client, show_progress=False)["apps"]
    run_id = f"test-state-{int(time.time() * 1000)}"
    with DockerSandbox.create(SandboxSpec(image=image), run_id, client=docker_client) as sb:
        result = sb.exec(MAKE_DB, user="root", session=False)
        assert result.exit_code == 0, result.output
        yield sb


def check(**args) -> Task:
    return Task(id="t", env="slack", family="f", seed=0, instruction="", checks=[{"verifier": "sql", "db": DB, **args}])


def test_rows_match_in_any_order_unless_ordered(app_sandbox):
    rows = [["c", 3], ["a", 1], ["b", 2]]
    assert sql_check(app_sandbox, DB, "SELECT name, n FROM t", rows) == (1.0, f"{DB}: state matches (3 rows)")
    score, reason = sql_check(app_sandbox, DB, "SELECT name, n FROM t ORDER BY n", rows, ordered=True)
    assert score == 0.0 and '[["c", 3], ["a", 1], ["b", 2]]' in reason and '[["a", 1], ["b", 2], ["c", 3]]' in reason
    assert sql_check(app_sandbox, DB, "SELECT name, n FROM t ORDER BY name = 'c' DESC, n", rows, ordered=True)[0] == 1.0


def test_a_missing_or_extra_row_scores_zero_and_says_what_differs(app_sandbox):
    score, reason = sql_check(app_sandbox, DB, "SELECT name FROM t", [["a"], ["b"]])
    assert score == 0.0 and reason == f'{DB}: expected [["a"], ["b"]], got [["a"], ["b"], ["c"]]'
    assert sql_check(app_sandbox, DB, "SELECT name FROM t WHERE n > 9", [])[0] == 1.0
    assert sql_check(app_sandbox, DB, "SELECT count(*) FROM t", [[3]])[0] == 1.0
    assert sql_check(app_sandbox, DB, "SELECT count(*) FROM t", [["3"]])[0] == 0.0  # types are compared too


def test_score_task_runs_registered_sql_checks(app_sandbox):
    assert "sql" in known_verifiers()
    reward = score_task(app_sandbox, check(query="SELECT n FROM t WHERE name = 'b'", expect=[[2]]))
    assert reward.value == 1.0 and reward.success
    reward = score_task(app_sandbox, check(query="SELECT n FROM t WHERE name = 'b'", expect=[[5]]))
    assert reward.value == 0.0 and not reward.success and "expected [[5]], got [[2]]" in reward.reason


def test_partial_credit_ranks_near_misses_and_keeps_success_exact(app_sandbox):
    query = "SELECT name, n FROM t"
    assert sql_check(app_sandbox, DB, query, [["c", 3], ["a", 1], ["b", 2]], partial=True)[0] == 1.0
    one_cell_off = sql_check(app_sandbox, DB, query, [["a", 1], ["b", 2], ["d", 3]], partial=True)[0]
    one_row_short = sql_check(app_sandbox, DB, query, [["a", 1], ["b", 2]], partial=True)[0]
    unrelated = sql_check(app_sandbox, DB, query, [["zz", 9]], partial=True)[0]
    assert 0.5 > one_cell_off > one_row_short > unrelated == 0.0
    reward = score_task(app_sandbox, check(query="SELECT name FROM t WHERE n = 2", expect=[["bb"]], partial=True))
    assert 0.0 < reward.value < 0.5 and not reward.success


def test_checks_never_write_the_database(app_sandbox):
    for query in ("DELETE FROM t", "UPDATE t SET n = 0", "SELECT 1; DELETE FROM t", "DROP TABLE t"):
        with pytest.raises(VerifierError, match="failed"):
            sql_check(app_sandbox, DB, query, [])
    assert query_rows(app_sandbox, DB, "SELECT count(*) FROM t") == [[3]]


def test_a_query_that_cannot_run_fails_the_episode(app_sandbox):
    with pytest.raises(VerifierError, match="syntax error"):
        score_task(app_sandbox, check(query="SELEC * FROM t", expect=[]))
    with pytest.raises(VerifierError, match="absolute path"):
        sql_check(app_sandbox, "app.db", "SELECT 1", [[1]])
    with pytest.raises(VerifierError, match="sql takes db, query, expect"):
        score_task(app_sandbox, check(query="SELECT 1"))
    with pytest.raises(VerifierError, match="list of rows"):
        score_task(app_sandbox, check(query="SELECT 1", expect=[1]))


def test_state_the_policy_could_have_left_scores_zero(app_sandbox):
    """A missing or corrupt database, or a missing table, is a verdict: the policy may have made it so."""
    with pytest.raises(ZeroScore, match="no database .FileNotFoundError") as e:
        sql_check(app_sandbox, "/tmp/app/missing.db", "SELECT 1", [[1]])
    assert e.value.cause == "missing"
    reward = score_task(app_sandbox, check(query="SELECT * FROM nope", expect=[]))
    assert reward.value == 0.0 and "no such table" in reward.reason and reward.zero_causes == ["state"]
    assert app_sandbox.exec("head -c 4096 /dev/urandom > /tmp/junk.db", user="root", session=False).exit_code == 0
    with pytest.raises(ZeroScore, match="not a database"):
        sql_check(app_sandbox, "/tmp/junk.db", "SELECT * FROM t", [[1]])


def test_a_runaway_query_is_stopped_by_its_timeout(app_sandbox):
    forever = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    start = time.monotonic()
    reward = score_task(app_sandbox, check(query=forever, expect=[[0]], timeout=1))
    assert reward.value == 0.0 and "killed after 1.0 s, the check's timeout" in reward.reason
    assert reward.zero_causes == ["timeout"]
    assert time.monotonic() - start < 8
    assert query_rows(app_sandbox, DB, "SELECT 1") == [[1]]  # the sandbox still answers


class Garbled:
    """``real`` whose first exec prints a traceback and no JSON, as a query does on a sandbox the policy broke."""

    def __init__(self, real):
        self.real, self.execs = real, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def exec(self, *args, **kwargs):
        self.execs += 1
        return ExecResult(1, "Traceback (most recent call last):", False, 0.0) if self.execs == 1 else \
            self.real.exec(*args, **kwargs)


def test_a_query_whose_run_says_nothing_is_left_to_the_failure_rule(app_sandbox, sandbox):
    """No JSON from the query's exec is no verdict on the task: the same check runs on a pristine sandbox. Where it
    runs there (python3 in the image), the policy's leavings broke it: 0, broke_check. Where it cannot run on a
    pristine sandbox either (the terminal image has no python3), the check is broken by itself: the episode fails."""
    reward = score_task(Garbled(app_sandbox), check(query="SELECT count(*) FROM t", expect=[[3]]))
    assert reward.value == 0.0 and reward.zero_causes == ["broke_check"], reward
    assert "could not run the query" in reward.reason
    with pytest.raises(VerifierError, match="does the image have python3"):
        score_task(sandbox, check(query="SELECT count(*) FROM t", expect=[[3]]))
