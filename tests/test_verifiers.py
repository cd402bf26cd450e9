"""The general verifiers (command, file_contains, file_hash, json_match, rubric) against real terminal sandboxes, and
verifier safety: every check runs within a timeout, a hanging or crashing verifier fails its episode (and only it)
with a reason naming the check, and a command the policy made hang scores 0 instead."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time

import pytest
from agent_fakes import CHAT, limits
from seeded import terminal_task as make_task

from containers import list_run_containers
from sandforge.environments.terminal.env import TerminalEnv
from sandforge.rollout.agent import run_episode
from sandforge.rollout.policy_client import scripted_policy
from sandforge.types import Task
from sandforge.verifiers import checks
from sandforge.verifiers.checks import VERIFIERS, VerifierError, known_verifiers, register, score_task, time_left

pytestmark = pytest.mark.timeout(180)


def _task(*checks: dict) -> Task:
    return Task(id="t/1", env="terminal", family="f", seed=1, instruction="x", checks=list(checks))


def score(sandbox, check: dict) -> tuple[float, str]:
    reward = score_task(sandbox, _task(check))
    return reward.value, reward.reason


# --- verifiers registered by the tests: one that hangs, one that raises, one that reports its budget ----------------

RELEASE = threading.Event()  # set at the end of the module


@register("test_hang")
def _hang(sandbox, args):
    RELEASE.wait(300)
    return 1.0, "released"


@register("test_raise")
def _raise(sandbox, args):
    raise KeyError("the verifier's own bug")


@register("test_budget")
def _budget(sandbox, args):
    return 1.0, f"{time_left():.3f}"


@register("test_bad_score")
def _bad_score(sandbox, args):
    return args["value"], "out of range"


@register("test_returns")
def _returns(sandbox, args):
    return args["value"]


@register("test_parts")
def _parts(sandbox, args):
    return 0.5, json.dumps(args, sort_keys=True), {"fail_to_pass": 1.0, "pass_to_pass": 0.0}


@pytest.fixture(autouse=True, scope="module")
def _test_verifiers_go_away():
    yield
    RELEASE.set()  # the hung verifier threads exit
    for name in ("test_hang", "test_raise", "test_budget", "test_bad_score", "test_returns", "test_parts"):
        VERIFIERS.pop(name)


# --- command ------------------------------------------------------------------------------------------------------


@pytest.mark.docker
def test_command_scores_exit_code_and_output_as_root_outside_the_policy_session(sandbox):
    # the policy's session: a function shadowing `true`, a variable, a file only it can read
    sandbox.exec("true() { return 1; }; export ANSWER=42; echo secret > mine.txt; chmod 600 mine.txt")
    for startup in (".bashrc", ".profile", ".bash_profile", ".bash_login"):  # HOME is the workspace
        sandbox.write_file(startup, "true() { return 1; }; exit 7\n")
    assert sandbox.exec("true").exit_code == 1
    assert score(sandbox, {"verifier": "command", "command": "true"}) == (1.0, "`true` exited 0")
    assert score(sandbox, {"verifier": "command", "command": "id -u; cat /workspace/mine.txt; echo ${ANSWER:-unset}",
                           "pattern": r"^0\nsecret\nunset$"})[0] == 1.0
    value, reason = score(sandbox, {"verifier": "command", "command": "echo nope; exit 3"})
    assert value == 0.0 and reason == "`echo nope; exit 3` exited 3, expected 0; output 'nope'"
    assert score(sandbox, {"verifier": "command", "command": "exit 3", "exit_code": 3})[0] == 1.0
    assert score(sandbox, {"verifier": "command", "command": "exit 5", "exit_code": None, "pattern": "^$"})[0] == 1.0
    value, reason = score(sandbox, {"verifier": "command", "command": "echo 2 passed", "pattern": r"\b3 passed"})
    assert value == 0.0 and "does not match" in reason and "'2 passed'" in reason
    # absent: the text must not appear; the exit code still counts
    check = {"verifier": "command", "command": "echo all ok", "pattern": "FAIL", "absent": True}
    assert score(sandbox, check)[0] == 1.0
    assert score(sandbox, {**check, "command": "echo 1 FAILED"}) == (0.0, "`echo 1 FAILED`: output matches 'FAIL'; "
                                                                         "output '1 FAILED'")
    assert score(sandbox, {**check, "command": "echo all ok; false"})[0] == 0.0
    # a failure hidden in the middle of long output cannot pass an absence check
    flood = "seq 20000; echo FAIL; seq 20000"
    value, reason = score(sandbox, {**check, "command": flood})
    assert value == 0.0 and "truncated" in reason
    value, reason = score(sandbox, {**check, "command": flood, "pattern": "NEVER"})
    assert value == 0.0 and "truncated" in reason


@pytest.mark.docker
def test_a_command_that_hangs_is_killed_at_the_check_timeout_and_scores_zero(sandbox):
    # a timeout long enough for the exec to start on a loaded machine (the suite runs two workers): at 1 s the check's
    # own deadline could pass before the command ran, a 0 for another reason than the one tested here
    start = time.monotonic()
    value, reason = score(sandbox, {"verifier": "command", "command": "sleep 60; echo late > /tmp/late", "timeout": 5})
    assert time.monotonic() - start < 30  # killed at its timeout, long before the 60 s sleep would end
    assert value == 0.0 and "timed out" in reason
    # killed inside the container, not only abandoned by the client
    assert sandbox.exec("pgrep -fc 'slee[p] 60'", user="root", session=False).output == "0\n"


@pytest.mark.docker
def test_command_arguments_are_checked(sandbox):
    for check, fragment in [
        ({"verifier": "command"}, "command takes command"),
        ({"verifier": "command", "command": "true", "expect": 0}, "command takes command"),
        ({"verifier": "command", "command": "true", "exit_code": "0"}, "exit_code must be an integer"),
        ({"verifier": "command", "command": "true", "pattern": "("}, "not a valid regex"),
        ({"verifier": "command", "command": "true", "absent": True}, "absent needs a pattern"),
        ({"verifier": "command", "command": "true", "timeout": 0}, "timeout must be a positive number"),
    ]:
        with pytest.raises(VerifierError, match=fragment) as info:
            score(sandbox, check)
        assert "task t/1, check 0 (command)" in str(info.value)


# --- files --------------------------------------------------------------------------------------------------------


@pytest.mark.docker
def test_file_contains_text_pattern_and_absence(sandbox):
    sandbox.write_file("notes.md", "# Usage\nrun ./go --fast\nTODO: tests\n")
    sandbox.exec("chmod 000 notes.md")  # root reads it anyway
    check = {"verifier": "file_contains", "path": "/workspace/notes.md"}
    assert score(sandbox, {**check, "text": "./go --fast"})[0] == 1.0
    assert score(sandbox, {**check, "text": "--slow"}) == (0.0, "/workspace/notes.md: has no '--slow' (got '# Usage"
                                                                "\\nrun ./go --fast\\nTODO: tests\\n')")
    assert score(sandbox, {**check, "pattern": r"^run \./go( --\w+)+$"})[0] == 1.0
    assert score(sandbox, {**check, "pattern": "^--fast"})[0] == 0.0  # ^ is a line start, not any position
    assert score(sandbox, {**check, "pattern": "TODO", "absent": True}) == (0.0, "/workspace/notes.md: has pattern "
                                                                                "'TODO'")
    assert score(sandbox, {**check, "pattern": "FIXME", "absent": True})[0] == 1.0
    assert score(sandbox, {**check, "path": "gone.md", "text": "x", "absent": True}) == (0.0, "gone.md: missing")
    with pytest.raises(VerifierError, match="exactly one of text"):
        score(sandbox, {**check, "text": "a", "pattern": "b"})


@pytest.mark.docker
def test_what_is_not_a_regular_file_scores_zero_without_hanging(sandbox):
    """A FIFO would block a plain read until the file timeout; a directory or device is no answer either."""
    sandbox.exec("mkfifo pipe.json; mkdir dir.json; ln -s pipe.json link.json; echo '{}' > real.json; "
                 "ln -s real.json good.json")
    start = time.monotonic()
    for path, kind in [("pipe.json", "fifo"), ("dir.json", "directory"), ("link.json", "fifo"),
                       ("/dev/null", "character special file")]:
        for check in ({"verifier": "json_match", "path": path, "expected": {}},
                      {"verifier": "file_hash", "path": path, "sha256": "0" * 64},
                      {"verifier": "file_contains", "path": path, "text": "x", "absent": True}):
            assert score(sandbox, {**check, "timeout": 5}) == (0.0, f"{path}: not a regular file ({kind})")
    assert time.monotonic() - start < 30
    assert score(sandbox, {"verifier": "json_match", "path": "good.json", "expected": {}})[0] == 1.0


@pytest.mark.docker
def test_file_hash_compares_the_exact_bytes(sandbox):
    blob = bytes(range(256)) * 3 + b"\x00\r\n"
    sandbox.put_file("out.bin", blob)
    digest = hashlib.sha256(blob).hexdigest()
    check = {"verifier": "file_hash", "path": "out.bin", "sha256": digest.upper()}
    assert score(sandbox, check) == (1.0, "out.bin: sha256 matches")
    sandbox.put_file("out.bin", blob[:-1] + b"X")  # one byte differs
    value, reason = score(sandbox, check)
    assert value == 0.0 and reason.startswith("out.bin: sha256 ") and f"expected {digest[:12]}..." in reason
    assert score(sandbox, {**check, "path": "none.bin"}) == (0.0, "none.bin: missing")
    with pytest.raises(VerifierError, match="sha256 must be 64 hex digits"):
        score(sandbox, {**check, "sha256": "abc"})


@pytest.mark.docker
def test_json_match_subset_exact_path_and_partial_credit(sandbox):
    doc = {"status": "ok", "count": 3, "done": True, "items": [{"name": "a", "size": 1}, {"name": "b.c", "size": 2}],
           "extra": None}
    sandbox.write_file("out.json", json.dumps(doc))
    check = {"verifier": "json_match", "path": "out.json"}
    assert score(sandbox, {**check, "expected": {"status": "ok", "count": 3.0}}) == (1.0, "out.json: matches")
    assert score(sandbox, {**check, "expected": {"name": "b.c"}, "at": "items.1"}) == (1.0, "out.json at items.1: "
                                                                                          "matches")
    assert score(sandbox, {**check, "expected": "b.c", "at": ["items", 1, "name"]})[0] == 1.0
    assert score(sandbox, {**check, "expected": 1, "at": "items.-1.size"})[0] == 0.0
    value, reason = score(sandbox, {**check, "expected": 1, "at": "items.5.size"})
    assert value == 0.0 and "nothing at items.5.size (items has no '5')" in reason
    assert score(sandbox, {**check, "expected": {"done": 1}})[0] == 0.0  # true is not 1
    # exact: keys the expected value does not name count against it
    exact = {**check, "expected": {"name": "a", "size": 1}, "at": "items.0", "exact": True}
    assert score(sandbox, exact)[0] == 1.0
    assert score(sandbox, {**exact, "expected": {"name": "a"}}) == (0.0, "out.json at items.0: 1/2 values match "
                                                                         "(items.0.size: unexpected)")
    # partial credit: the fraction of expected values found
    wrong_two = {"status": "ok", "count": 4, "done": True, "items": [{"name": "a"}, {"name": "x"}]}
    value, reason = score(sandbox, {**check, "expected": wrong_two, "partial": True})
    assert value == pytest.approx(3 / 5) and "3/5 values match" in reason
    assert "count: expected 4, got 3" in reason and "items.1.name: expected \"x\", got \"b.c\"" in reason
    assert score(sandbox, {**check, "expected": wrong_two})[0] == 0.0  # all or nothing by default
    assert score(sandbox, {**check, "expected": {"items": [{"name": "a"}]}, "partial": True})[0] == 0.0  # length
    # a missing object fails every value beneath it
    value, reason = score(sandbox, {**check, "expected": {"status": "ok", "meta": {"a": 1, "b": [2, 3]}},
                                    "partial": True})
    assert value == pytest.approx(1 / 4) and reason == "out.json: 1/4 values match (meta: missing)"
    value, reason = score(sandbox, {**check, "expected": {"count": 3, "items": {"name": "a"}}, "partial": True})
    assert value == 0.5 and reason.startswith('out.json: 1/2 values match (items: expected an object, got [{"name"')
    assert score(sandbox, {**check, "expected": {}, "at": "items.0"})[0] == 1.0
    assert score(sandbox, {**check, "expected": {}, "at": "items.0", "exact": True})[0] == 0.0
    sandbox.write_file("bad.json", "{'status': 'ok'}")
    value, reason = score(sandbox, {**check, "path": "bad.json", "expected": {}})
    assert value == 0.0 and reason.startswith("bad.json: not JSON")


# --- rubric -------------------------------------------------------------------------------------------------------


@pytest.mark.docker
def test_rubric_weights_items_and_reports_each(sandbox):
    sandbox.write_file("README.md", "Usage: run it\n")
    rubric = {"verifier": "rubric", "items": [
        {"weight": 2, "label": "readme", "check": {"verifier": "file_contains", "path": "README.md", "text": "Usage"}},
        {"weight": 1, "label": "tests", "check": {"verifier": "command", "command": "test -e tests.py"}},
        {"weight": 1, "check": {"verifier": "rubric", "items": [  # nested: half of it passes
            {"check": {"verifier": "command", "command": "true"}},
            {"check": {"verifier": "command", "command": "false"}}]}},
    ]}
    reward = score_task(sandbox, _task(rubric, {"verifier": "command", "command": "true"}))
    assert reward.breakdown == {"rubric:0": pytest.approx(2.5 / 4), "command:1": 1.0, "rubric:0/readme": 1.0,
                                "rubric:0/tests": 0.0, "rubric:0/2:rubric": 0.5, "rubric:0/2:rubric/0:command": 1.0,
                                "rubric:0/2:rubric/1:command": 0.0}
    assert reward.value == pytest.approx((2.5 / 4 + 1) / 2) and not reward.success
    assert "tests (1): 0.00 `test -e tests.py` exited 1" in reward.reason
    sandbox.write_file("tests.py", "")
    assert score(sandbox, rubric)[0] == pytest.approx(3.5 / 4)
    zero_weight = {"verifier": "rubric", "items": [{"weight": 0, "check": {"verifier": "command", "command": "false"}},
                                                   {"weight": 1, "check": {"verifier": "command", "command": "true"}}]}
    assert score(sandbox, zero_weight)[0] == 1.0

    for bad, fragment in [
        ({"verifier": "rubric", "items": []}, "non-empty list"),
        ({"verifier": "rubric", "items": [{"weight": -1, "check": {"verifier": "command", "command": "true"}}]},
         "weight must be a number >= 0"),
        ({"verifier": "rubric", "items": [{"weight": 0, "check": {"verifier": "command", "command": "true"}}]},
         "weights sum to 0"),
        ({"verifier": "rubric", "items": [{"check": {"verifier": "nope"}}]}, r"check 0 \(rubric\), item 0: unknown "
                                                                             "verifier 'nope'"),
        ({"verifier": "rubric", "items": [{"check": {"verifier": "test_raise"}}]},
         r"check 0 \(rubric\), item 0 \(test_raise\) failed: KeyError"),
    ]:
        with pytest.raises(VerifierError, match=fragment):
            score(sandbox, bad)


@pytest.mark.docker
def test_rubric_items_share_the_rubric_budget(sandbox):
    """Each item has its own timeout, capped by what the rubric has left; the rubric's default is their sum."""
    items = [{"check": {"verifier": "command", "command": "sleep 30", "timeout": 1}},
             {"check": {"verifier": "test_budget", "timeout": 2}},
             {"check": {"verifier": "test_budget"}}]
    start = time.monotonic()
    reward = score_task(sandbox, _task({"verifier": "rubric", "items": items}))
    assert time.monotonic() - start < 8
    budgets = [float(b) for b in re.findall(r"test_budget \(1\): 1\.00 ([\d.]+)", reward.reason)]
    assert "0:command (1): 0.00 `sleep 30` timed out" in reward.reason and reward.value == pytest.approx(2 / 3)
    assert 1.5 < budgets[0] <= 2.0 and 55 < budgets[1] <= 60.0, reward.reason
    # an explicit rubric timeout caps every item
    reward = score_task(sandbox, _task({"verifier": "rubric", "timeout": 3, "items": items[1:]}))
    budgets = [float(b) for b in re.findall(r"test_budget \(1\): 1\.00 ([\d.]+)", reward.reason)]
    assert len(budgets) == 2 and max(budgets) <= 3.0, reward.reason


# --- safety: hangs, crashes, bad verdicts -------------------------------------------------------------------------


@pytest.mark.docker
def test_a_hanging_or_crashing_verifier_raises_naming_the_check(sandbox, monkeypatch):
    monkeypatch.setattr(checks, "REPORT_GRACE", 0.5)  # no exec to wait for: do not wait the usual grace
    start = time.monotonic()
    with pytest.raises(VerifierError, match=r"task t/1, check 1 \(test_hang\) did not finish within its 1 s timeout"):
        score_task(sandbox, _task({"verifier": "command", "command": "true"}, {"verifier": "test_hang", "timeout": 1}))
    # cut at its 1 s timeout, not at the verifier's own 300 s wait: on the policy's sandbox, then on the pristine one
    # the failure rule starts to test it (a sandbox's start under load is the only other cost)
    assert 1.4 < time.monotonic() - start < 60
    with pytest.raises(VerifierError, match=r"check 0 \(test_raise\) failed: KeyError: \"the verifier's own bug\""):
        score(sandbox, {"verifier": "test_raise"})
    for bad in (1.5, -0.1, float("nan"), "1", True):
        with pytest.raises(VerifierError, match=r"check 0 \(test_bad_score\) returned score .*, expected \[0, 1\]"):
            score(sandbox, {"verifier": "test_bad_score", "value": bad})
    assert float(score(sandbox, {"verifier": "test_budget", "timeout": 0.5})[1]) <= 0.5
    for bad in ((1.0,), (1.0, "ok", ["parts"]), 1.0, None):
        with pytest.raises(VerifierError, match=r"expected \(score, reason\) or \(score, reason, parts\)"):
            score(sandbox, {"verifier": "test_returns", "value": bad})
    assert sandbox.exec("echo alive").output == "alive\n"  # the sandbox is untouched by all of it


def test_parts_go_into_the_breakdown_and_the_timeout_reaches_the_verifier():
    """Verifiers that bound one step with their ``timeout`` argument (a test run, a query) still get it."""
    reward = score_task(None, _task({"verifier": "test_parts", "timeout": 7, "x": 1}, {"verifier": "test_budget"}))
    assert reward.breakdown == {"test_parts:0": 0.5, "test_budget:1": 1.0, "test_parts:0/fail_to_pass": 1.0,
                                "test_parts:0/pass_to_pass": 0.0}
    assert reward.value == 0.75 and reward.reason.startswith('{"timeout": 7, "x": 1}; ')


@pytest.mark.docker
@pytest.mark.parametrize("check, failure", [
    ({"verifier": "test_raise"}, r"check 1 \(test_raise\) failed: KeyError"),
    ({"verifier": "test_hang", "timeout": 1}, r"check 1 \(test_hang\) did not finish within its 1 s timeout"),
])
def test_a_broken_verifier_fails_only_its_episode(check, failure, terminal_spec, run_id, docker_client, monkeypatch):
    """Through the real agent loop: the reference solution runs, then grading breaks; the episode comes back failed,
    with the reason, its sandbox removed, and the next episode is graded as usual."""
    monkeypatch.setattr(checks, "REPORT_GRACE", 0.5)  # no exec to wait for: do not wait the usual grace
    solved = make_task("write_file", 7)
    broken = Task(**{**solved.__dict__, "id": "terminal/write_file/broken", "checks": [*solved.checks, check]})
    results = []
    for task in (broken, solved):
        env = TerminalEnv(task, terminal_spec, run_id, client=docker_client)
        results.append(asyncio.run(run_episode(task, env, scripted_policy(task, CHAT), CHAT, limits(), "g")))
        assert list_run_containers(run_id, docker_client) == []
    failed, fine = results
    assert failed.failed and failed.finish_reason == "error" and failed.reward.value == 0.0
    assert failed.failure.startswith("verifier: task terminal/write_file/broken, ")
    assert re.search(failure, failed.failure), failed.failure
    assert not fine.failed and fine.reward.success and fine.finish_reason == "submit"


def test_unknown_verifiers_and_bad_timeouts_are_explained():
    with pytest.raises(VerifierError, match="unknown verifier 'tests_pass'.*command.*file_hash.*judge.*rubric"):
        score_task(None, _task({"verifier": "tests_pass"}))
    for bad in (0, -1, "10", float("inf"), True):
        with pytest.raises(VerifierError, match="timeout must be a positive number of seconds"):
            score_task(None, _task({"verifier": "test_budget", "timeout": bad}))
    builtins = {"command", "file_equals", "file_contains", "file_hash", "json_match", "rubric", "judge"}
    assert builtins <= set(known_verifiers())
