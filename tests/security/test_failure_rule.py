"""The failure rule, once where checks return (#56): an episode fails only on host-side facts. Faults injected into
every read a check makes of the policy's sandbox (its execs, file reads: what the policy could have made raise, hang
or return nonsense) give 0 with a cause, never a failed episode; faults of the host (a sandbox that is no longer
running, no fresh sandbox to be had, a check broken by itself) still fail it. Real verifiers on a real terminal
sandbox; the faults are drawn by hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sandforge.types import ExecResult, SandboxError, Task
from sandforge.verifiers.checks import VerifierError, register, score_task

pytestmark = pytest.mark.docker

ANSWER = "/workspace/answer.txt"
# checks of every built-in kind that reads the sandbox, each scoring 1 on the honest answer the fixture leaves
CHECKS = [
    {"verifier": "file_equals", "path": ANSWER, "content": "42"},
    {"verifier": "file_contains", "path": ANSWER, "text": "42"},
    {"verifier": "json_match", "path": "/workspace/out.json", "expected": {"ok": True}},
    {"verifier": "command", "command": "grep -q 42 /workspace/answer.txt"},
    {"verifier": "harbor_tests", "timeout": 60, "files": {"test.sh": (
        "grep -qx 42 /workspace/answer.txt && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt")}},
    {"verifier": "rubric", "items": [
        {"weight": 1, "check": {"verifier": "file_equals", "path": ANSWER, "content": "42"}},
        {"weight": 1, "check": {"verifier": "command", "command": "test -s /workspace/out.json"}}]},
]


class Faulty:
    """The policy's sandbox as a check reads it, with a fault at read number ``at`` (exec, get_file, read_file): it
    raises ``fault`` or, for an exec, returns ``garbage`` as the command's output. Everything else is the real
    sandbox's, ``fresh()`` included (a pristine sandbox from the same image)."""

    def __init__(self, real, at: int, fault: BaseException | None, garbage: str = ""):
        self.real, self.at, self.fault, self.garbage, self.reads = real, at, fault, garbage, 0
        self.hit = ""  # the method whose read took the fault

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _read(self, method, *args, **kwargs):
        self.reads += 1
        if self.reads == self.at:
            self.hit = method
            if self.fault is not None:
                raise self.fault
            if method == "exec":
                return ExecResult(1, self.garbage, False, 0.0)
        return getattr(self.real, method)(*args, **kwargs)

    def exec(self, *args, **kwargs):
        return self._read("exec", *args, **kwargs)

    def get_file(self, *args, **kwargs):
        return self._read("get_file", *args, **kwargs)

    def read_file(self, *args, **kwargs):
        return self._read("read_file", *args, **kwargs)


FAULTS = st.one_of(
    st.builds(OSError, st.text(max_size=20)), st.builds(ValueError, st.text(max_size=20)),
    st.builds(KeyError, st.text(max_size=10)), st.builds(RecursionError), st.builds(MemoryError),
    st.builds(SandboxError, st.text(max_size=20)), st.builds(UnicodeDecodeError, st.just("utf-8"), st.just(b"\xff"),
                                                            st.just(0), st.just(1), st.just("bad")),
    st.none())  # None: an exec's output is garbage instead


@pytest.fixture(scope="module")
def answered(terminal_image, docker_client):
    """A terminal sandbox holding the honest answers (its root writable, as a Harbor task's is: test.sh goes in
    /tests)."""
    import uuid

    from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec
    from sandforge.sandbox.lifecycle import remove_run_containers

    run_id = f"test-{uuid.uuid4().hex[:12]}"
    box = DockerSandbox.create(SandboxSpec(image=terminal_image, read_only=False), run_id, client=docker_client)
    box.write_file(ANSWER, "42\n")
    box.write_file("/workspace/out.json", '{"ok": true}')
    yield box
    box.close()
    remove_run_containers(run_id, docker_client)


def task(checks) -> Task:
    return Task(id="t/1", env="terminal", family="f", seed=1, instruction="answer", checks=list(checks))


def test_the_honest_answer_scores_one_through_every_check(answered):
    reward = score_task(answered, task(CHECKS))
    assert reward.success and reward.value == 1.0, reward.reason


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(check=st.sampled_from(CHECKS), at=st.integers(1, 4), fault=FAULTS, garbage=st.text(max_size=200))
@example(check=CHECKS[0], at=1, fault=None, garbage="")  # the examining exec says nothing (CI, stop 61)
def test_a_fault_in_any_read_of_the_policys_sandbox_scores_zero_with_a_cause_never_fails(answered, check, at, fault,
                                                                                          garbage):
    sandbox = Faulty(answered, at, fault, garbage)
    reward = score_task(sandbox, task([check]))  # raises VerifierError if the episode would fail
    if sandbox.reads >= at and fault is not None:  # the fault was hit: a verdict short of the honest answer's
        assert reward.value < 1.0 and reward.reason, (fault, reward)
        if check["verifier"] != "rubric":  # a rubric's other item still scores
            assert reward.value == 0.0, (fault, reward)


def test_faults_of_the_host_still_fail_the_episode(answered, monkeypatch):
    """A sandbox that is no longer running, no fresh sandbox to test on, a check that raises on a pristine sandbox
    too (broken by itself), and a check refused before it ran: failed, with the check's error."""
    broken = Faulty(answered, 1, OSError("the policy's spool is full"))
    monkeypatch.setattr(type(answered), "alive", lambda self: False)
    with pytest.raises(VerifierError, match="spool is full"):
        score_task(broken, task(CHECKS[:1]))
    monkeypatch.undo()

    def no_fresh():
        raise SandboxError("the Docker daemon is gone")

    gone = Faulty(answered, 1, OSError("unreadable"))
    gone.fresh = no_fresh
    with pytest.raises(VerifierError, match="unreadable"):
        score_task(gone, task(CHECKS[:1]))

    def always_raises(sandbox, args):
        raise RuntimeError("the verifier's own bug")

    register("test_failure_rule_bug")(always_raises)
    with pytest.raises(VerifierError, match="the verifier's own bug"):
        score_task(answered, task([{"verifier": "test_failure_rule_bug"}]))
    with pytest.raises(VerifierError, match="unknown verifier"):
        score_task(Faulty(answered, 1, OSError("x")), task([{"verifier": "no_such_verifier"}]))


def test_a_check_the_policys_leavings_broke_scores_zero_and_says_so(answered):
    """A verifier with a bug only the policy's state triggers (here: it chokes on the answer's text): the same check
    on a pristine sandbox returns a verdict, so the episode is scored 0 with the cause broke_check."""

    def brittle(sandbox, args):
        text = sandbox.read_file(ANSWER)
        if text is not None and "42" in text:
            raise ValueError("cannot parse 42")
        return 0.0, "no answer"

    register("test_failure_rule_brittle")(brittle)
    reward = score_task(answered, task([{"verifier": "test_failure_rule_brittle"}]))
    assert reward.value == 0.0 and reward.zero_causes == ["broke_check"], reward
    assert "cannot parse 42" in reward.reason and "fresh sandbox" in reward.reason
