""""Failed" means infrastructure failed (issue #23, item 4). A failed episode is dropped from the gradient, so a policy
that could turn its losing episodes into failed ones would never be penalised for them. Whatever the policy left
scores 0 with a reason and a cause (``reward/zero_<cause>``). Attacks through run_episode, the real verifiers and a
real terminal sandbox."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from agent_fakes import CHAT, limits
from seeded import terminal_task as make_task

from sandforge.environments.terminal.env import TerminalEnv
from sandforge.job.rollout_metrics import rollout_metrics
from sandforge.rollout.agent import run_episode
from sandforge.rollout.policy_client import scripted_policy
from sandforge.types import ToolCall

pytestmark = pytest.mark.docker

ANSWER = "/workspace/answer.txt"


def episode(commands: list[str], checks: list[dict], spec, run_id, client):
    calls = [ToolCall("bash", {"command": c}) for c in commands] + [ToolCall("submit")]
    task = replace(make_task("write_file", 3), checks=checks, solution=calls)
    env = TerminalEnv(task, spec, run_id, client=client)
    return asyncio.run(run_episode(task, env, scripted_policy(task, CHAT), CHAT, limits(max_turns=6), "g"))


def zero(traj, cause: str) -> str:
    """The episode was graded (not failed), scored 0 for ``cause``; its reason."""
    assert not traj.failed, traj.failure
    assert traj.reward.value == 0.0 and traj.reward.zero_causes == [cause], traj.reward
    return traj.reward.reason


def test_a_fifo_as_the_answer_scores_zero_at_once(terminal_spec, run_id, docker_client):
    """The read of a FIFO blocked past the check's timeout, so the episode failed. It is not a regular file: 0."""
    check = {"verifier": "file_equals", "path": ANSWER, "content": "42", "timeout": 5}
    started = time.monotonic()
    traj = episode([f"mkfifo {ANSWER}"], [check], terminal_spec, run_id, docker_client)
    assert "not a regular file (fifo)" in zero(traj, "not_a_file")
    assert time.monotonic() - started < 30  # it did not wait for a writer


def test_absurdly_nested_json_scores_zero(terminal_spec, run_id, docker_client):
    """200,000 nested `[` raised RecursionError in the parser, which failed the episode; it is malformed: 0."""
    check = {"verifier": "json_match", "path": "/workspace/out.json", "expected": {"ok": True}}
    traj = episode(["head -c 200000 /dev/zero | tr '\\0' '[' > /workspace/out.json"], [check], terminal_spec,
                   run_id, docker_client)
    assert "nested too deeply" in zero(traj, "malformed")


def test_a_deleted_database_scores_zero(repo_spec, run_id, docker_client):
    """The sql check's database deleted by the policy failed the episode; it is state the policy left: 0."""
    check = {"verifier": "sql", "db": "/workspace/app.db", "query": "SELECT 1", "expect": [[1]]}
    made = "python3 -c \"import sqlite3; sqlite3.connect('/workspace/app.db').execute('create table t(x)')\""
    traj = episode([made, "rm /workspace/app.db"], [check], repo_spec, run_id, docker_client)
    assert "no database" in zero(traj, "missing")


def test_a_link_out_of_the_workspace_is_never_followed(terminal_spec, run_id, docker_client):
    """The answer as a link to /etc/shadow: the reward was 0, but the reason quoted shadow's first bytes, and from
    there they went into trajectories.jsonl. The link is refused unread, by any file check, and through a linked
    folder too."""
    checks = [{"verifier": "file_equals", "path": ANSWER, "content": "42"},
              {"verifier": "file_contains", "path": "/workspace/etc/shadow", "text": "root"}]
    plant = f"ln -s /etc/shadow {ANSWER} && ln -s /etc /workspace/etc && echo linked"
    traj = episode([plant], checks, terminal_spec, run_id, docker_client)
    reason = zero(traj, "link")
    assert "root:" not in reason and "a link out of /workspace" in reason
    assert traj.reward.breakdown == {f"file_equals:{ANSWER}": 0.0, "file_contains:/workspace/etc/shadow": 0.0}


def test_links_inside_the_workspace_are_followed(terminal_spec, run_id, docker_client):
    """A link that stays in the workspace is an answer like any other."""
    check = {"verifier": "file_equals", "path": ANSWER, "content": "42"}
    traj = episode([f"mkdir -p /workspace/out && echo 42 > /workspace/out/a && ln -s out/a {ANSWER}"], [check],
                   terminal_spec, run_id, docker_client)
    assert traj.reward.success, traj.reward.reason


BOMBS = {
    "forking": "b() { b | b & }; b",  # forks as fast as it can
    "holding": "while :; do sleep 100000 & done",  # takes every pid and keeps them: no exec can start
}


@pytest.mark.parametrize("kind", sorted(BOMBS))
def test_a_fork_bomb_left_running_scores_zero(kind, terminal_spec, run_id, docker_client):
    """A detached fork bomb holding the sandbox's pids limit at submit: before the fix no exec could start or fork,
    so grading failed. The policy's processes are stopped first (by the sandbox's guard when no exec starts), and
    the missing answer scores 0."""
    bomb = f"setsid nohup bash -c '{BOMBS[kind]}' >/dev/null 2>&1 & sleep 2; echo left"
    check = {"verifier": "file_equals", "path": ANSWER, "content": "42"}
    traj = episode([bomb], [check], terminal_spec, run_id, docker_client)
    assert "missing" in zero(traj, "missing")


@pytest.mark.parametrize("check", [
    {"verifier": "command", "command": f"grep -qx 42 {ANSWER}"},
    {"verifier": "harbor_tests", "timeout": 60, "files": {"test.sh": (
        f"grep -qx 42 {ANSWER} && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt")}},
], ids=["command", "harbor_tests"])
def test_a_filled_output_spool_neither_fails_the_episode_nor_hides_an_honest_answer(check, terminal_image, run_id,
                                                                                     docker_client):
    """#56: the policy filled its own output spool (/run/sandforge/<uid>, 64 MiB); the grader then asked the policy's
    user for its ids through that spool, the OSError became a VerifierError, and the episode failed, an honest answer
    included. The ids are asked as root now: the answer scores 1, the fill alone 0, doing nothing 0; through a command
    check and a Harbor test.sh alike (its root is writable, as a Harbor task's is: /tests goes there)."""
    from sandforge.sandbox.docker_sandbox import SandboxSpec

    spec = SandboxSpec(image=terminal_image, read_only=False)
    fill = "cat /dev/zero > /run/sandforge/$(id -u)/fill; df -h /run/sandforge | tail -1"
    right = episode([f"echo 42 > {ANSWER}", fill], [check], spec, run_id, docker_client)
    assert not right.failed, right.failure
    assert right.reward.value == 1.0, right.reward.reason
    alone = episode([fill], [check], spec, run_id, docker_client)
    assert not alone.failed and alone.reward.value == 0.0, alone.failure
    nothing = episode([], [check], spec, run_id, docker_client)
    assert not nothing.failed and nothing.reward.value == 0.0, nothing.failure


def test_zero_causes_are_counted_apart_from_failures(terminal_spec, run_id, docker_client):
    """`reward/zero_<cause>` counts graded episodes by what the policy left; `episodes/failed_<kind>` stays for
    infrastructure."""
    check = {"verifier": "file_equals", "path": ANSWER, "content": "42"}
    missing = episode([], [check], terminal_spec, run_id, docker_client)
    fifo = episode([f"mkfifo {ANSWER}"], [check], terminal_spec, run_id, docker_client)
    right = episode([f"echo 42 > {ANSWER}"], [check], terminal_spec, run_id, docker_client)
    m = rollout_metrics([missing, fifo, right])
    assert m["episodes/failed"] == 0 and m["reward/mean"] == pytest.approx(1 / 3)
    assert m["reward/zero_missing"] == 1 and m["reward/zero_not_a_file"] == 1 and m["reward/zero_link"] == 0


def test_the_guard_stops_the_policy_without_an_exec(sandbox):
    """When the policy holds every pid, no exec can start; the sandbox's main process stops the policy's processes
    on SIGUSR1, with no fork. Seen from the host (`docker top`), nothing of the policy's is left."""
    assert sandbox.exec("env | grep -c ^SANDFORGE_").output == "0\n"  # the guard's script stays out of its shell
    held = sandbox.exec("setsid nohup bash -c 'while :; do sleep 100000 & done' >/dev/null 2>&1 & sleep 2; echo left")
    assert held.output.startswith("left")

    def policy_pids() -> list[str]:
        rows = sandbox._container.top(ps_args="-eo uid,pid,stat")["Processes"] or []
        return [pid for uid, pid, stat in rows if uid == "1000" and not stat.startswith("Z")]

    filling = time.monotonic() + 30  # a loaded machine forks slower: wait for the loop to take the pids
    while len(policy_pids()) <= 200 and time.monotonic() < filling:
        time.sleep(0.2)
    assert len(policy_pids()) > 200  # the pids limit is 256
    sandbox.signal_guard()
    deadline = time.monotonic() + 60
    while policy_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert policy_pids() == []
    assert sandbox.exec("echo graded", user="root", session=False).output == "graded\n"


def assert_full_yet_graded(sb, full):
    """The fill hit its cap (not the memory limit), and the sandbox lives and is graded: 0, the answer missing."""
    from sandforge.types import Task
    from sandforge.verifiers.checks import score_task

    assert "No space left on device" in full.output and not full.oom_killed, full
    assert sb.alive() and sb.exec("echo alive", user="root", session=False).output == "alive\n"
    task = Task(id="t", env="terminal", family="f", seed=0, instruction="",
                checks=[{"verifier": "file_equals", "path": "/workspace/answer.txt", "content": "42"}])
    reward = score_task(sb, task)
    assert reward.value == 0.0 and "missing" in reward.reason, reward


def test_a_workspace_cap_larger_than_the_memory_limit_cannot_oom_the_sandbox(terminal_image, run_id, docker_client):
    """A Harbor task's WORKDIR cap (1 GiB by default) in a 512 MiB sandbox: writing 600 MB there OOM-killed the
    container, and the episode failed (#32, item 4). The cap is fitted inside the memory limit: the write gets "No space
    left on device", the sandbox lives, and the checks grade it (0 here)."""
    from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec

    spec = SandboxSpec(image=terminal_image, memory="512m", workspace_size="1g")
    with DockerSandbox.create(spec, run_id, client=docker_client) as sb:
        full = sb.exec("for i in 1 2 3; do head -c 200m /dev/zero > /workspace/fill$i || break; done; echo exit=$?",
                       timeout=120)  # three files: each stays under the 256m file-size limit
        assert_full_yet_graded(sb, full)


def test_every_tmpfs_filled_at_once_cannot_oom_the_sandbox(terminal_image, run_id, docker_client):
    """Each cap fitted the memory limit alone, not all of them together: a hardened Harbor agent's WORKDIR (1 GiB),
    /tmp and three scratch folders (128 MiB each) in 512 MiB, filled at once, still exhausted the sandbox's memory (#32,
    item 4). The caps are fitted together: every write past them gets "No space left on device", the sandbox lives
    and is graded."""
    from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec

    scratch = ("/home/sandbox", "/var/tmp", "/run/lock")
    spec = SandboxSpec(image=terminal_image, memory="512m", workspace_size="1g", scratch=scratch)
    with DockerSandbox.create(spec, run_id, client=docker_client) as sb:
        fill = "; ".join(f"for i in 1 2; do head -c 200m /dev/zero > {d}/fill$i || break; done"
                         for d in ("/workspace", "/tmp", *scratch))
        full = sb.exec(fill + "; echo filled", timeout=180)
        assert_full_yet_graded(sb, full)


def test_the_tmpfs_caps_fit_the_memory_limit_together():
    from sandforge.sandbox.spec import RESERVE, SPOOL_SIZE, SandboxSpec, parse_size

    room = parse_size("512m") - 2 * parse_size(SPOOL_SIZE) - parse_size(RESERVE)
    default = SandboxSpec(image="x")  # the defaults fit as given
    assert (default.workspace_size, default.tmp_size) == ("192m", "128m")
    harbor = SandboxSpec(image="x", memory="512m", workspace_size="1g", scratch=("/home/a", "/var/tmp", "/run/lock"))
    total = parse_size(harbor.workspace_size) + 4 * parse_size(harbor.tmp_size)
    assert room - 8 * 1024 <= total <= room  # scaled alike: 1 GiB : 128 MiB kept
    assert abs(parse_size(harbor.workspace_size) / parse_size(harbor.tmp_size) - 8) < 0.01
    roomy = SandboxSpec(image="x", memory="4g", workspace_size="1g", scratch=("/var/tmp",))
    assert (roomy.workspace_size, roomy.tmp_size) == ("1g", "128m")
    disk = SandboxSpec(image="x", memory="256m", workspace_size=None)
    assert disk.workspace_size is None and parse_size(disk.tmp_size) <= parse_size("256m") - 2 * parse_size(
        SPOOL_SIZE) - parse_size(RESERVE)
