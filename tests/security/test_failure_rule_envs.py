"""The failure rule (#56) on every built-in environment's own grader: the apps' and the browser's state checks (an SQL
query of the app's database, run in the policy's sandbox) and the repo's hidden tests (the policy's package listed
and read out of its sandbox, then run in a fresh one). Each environment's reference solution is played through the
real env on a real container; then faults drawn by hypothesis are injected into the grader's reads of that sandbox
(tests/security/test_failure_rule.py's ``Faulty``). A fault the grader hit gives a verdict short of the honest 1 with
a reason, never a failed episode; the same sandbox read without a fault still scores 1."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_failure_rule import FAULTS, Faulty

from sandforge.registry import environment
from sandforge.sandbox.docker_sandbox import SandboxSpec
from sandforge.sandbox.images import build_images
from sandforge.sandbox.lifecycle import remove_run_containers
from sandforge.types import ToolCall
from sandforge.verifiers.checks import score_task

pytestmark = pytest.mark.docker

# each environment's reference task (family, seed) and what its grader is
GRADED = {
    "slack": ("post_message", 5),  # sql on the app's database
    "notion": ("create_page", 5),  # sql on the app's database
    "browser": ("booking", 5),  # sql on the site's database
    "repo": ("off_by_one", 5),  # repo_tests: listing, reads, pytest in a fresh sandbox
}


@pytest.fixture(scope="module")
def solved(docker_client):
    """Per environment: (its env after the reference solution, the task), the env left open for grading."""
    run_id = f"test-{uuid.uuid4().hex[:12]}"
    entries = {name: environment(name) for name in GRADED}
    images = build_images(sorted({e.image_name for e in entries.values()}), client=docker_client,
                          show_progress=False)
    envs = {}
    try:
        for name, (family, seed) in GRADED.items():
            entry = entries[name]
            task = entry.make_task()(family, seed)
            env_class = entry.env_class()
            spec = SandboxSpec(image=images[entry.image_name], **env_class.sandbox_defaults)
            env = env_class(task, spec, run_id, client=docker_client)
            envs[name] = (env, task)
            env.reset()
            for call in task.solution:
                if call.name != "submit":
                    env.step(ToolCall(call.name, call.arguments))
        yield envs
    finally:
        for env, _ in envs.values():
            env.close()
        remove_run_containers(run_id, docker_client)


@pytest.fixture(scope="module")
def reads(solved):
    """Per environment: how many reads of its sandbox its grader makes on the honest answer (each scored 1)."""
    counts = {}
    for name, (env, task) in solved.items():
        counted = Faulty(env.sandbox, 0, None)
        reward = score_task(counted, task)
        assert reward.success and reward.value == 1.0, (name, reward.reason)
        counts[name] = counted.reads
    return counts


def test_each_environments_reference_scores_one_through_its_own_grader(reads):
    assert all(n >= 1 for n in reads.values()), reads  # and each scored 1 (the fixture)


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(GRADED)), fault=FAULTS, garbage=st.text(max_size=200), data=st.data())
def test_a_fault_in_any_read_of_an_environments_sandbox_scores_zero_with_a_cause_never_fails(solved, reads, name,
                                                                                           fault, garbage, data):
    env, task = solved[name]
    at = data.draw(st.integers(1, reads[name]), label="at")  # one of the reads the grader makes
    sandbox = Faulty(env.sandbox, at, fault, garbage)
    reward = score_task(sandbox, task)  # raises VerifierError if the episode would fail
    assert sandbox.reads >= at
    if fault is None:
        return
    if isinstance(fault, OSError) and sandbox.hit == "get_file":  # a file too large or gone: left out, as deleted
        assert reward.reason, reward
    else:  # a verdict short of the honest answer's, with a cause
        assert reward.value < 1.0 and reward.reason, (name, fault, reward)
