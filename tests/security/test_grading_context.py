"""Before any check runs, the policy is gone (issue #23, item 1): a process the policy leaves running cannot race,
read or rewrite a grader. Attacks through run_episode, the real verifiers and a real terminal sandbox."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from agent_fakes import CHAT, limits
from seeded import terminal_task as make_task

from sandforge.environments.terminal.env import TerminalEnv
from sandforge.rollout.agent import run_episode
from sandforge.rollout.policy_client import scripted_policy
from sandforge.types import ToolCall

pytestmark = pytest.mark.docker

# stamps PASS at the head of every output spool of this user's commands, and outlives the episode
SPOOL_FORGER = ("nohup bash -c 'while true; do for f in /run/sandforge/*/out.* /run/sandforge/*/*/out.*; do "
                "[ -f \"$f\" ] && ! grep -q ^PASS \"$f\" 2>/dev/null && printf \"PASS\\n\" > \"$f\"; done; done' "
                ">/dev/null 2>&1 & echo started")


def episode(calls: list[ToolCall], checks: list[dict], spec, run_id, client):
    task = replace(make_task("write_file", 3), checks=checks, solution=calls + [ToolCall("submit")])
    env = TerminalEnv(task, spec, run_id, client=client)
    return asyncio.run(run_episode(task, env, scripted_policy(task, CHAT), CHAT, limits(max_turns=4), "g"))


def test_a_lingering_process_cannot_rewrite_a_check_run_as_the_policys_user(terminal_spec, run_id, docker_client):
    """A `command` check run as the policy's user prints FAIL, slowly; the policy's loop, left behind, would turn
    what the check printed into PASS. It is dead before the check starts: reward 0."""
    check = {"verifier": "command", "command": "sleep 1; echo FAIL", "pattern": "^PASS", "user": "sandbox"}
    traj = episode([ToolCall("bash", {"command": SPOOL_FORGER})], [check], terminal_spec, run_id, docker_client)
    assert not traj.failed, traj.failure
    assert traj.turns[0].observations[0].startswith("started")
    assert (traj.reward.value, traj.reward.success) == (0.0, False), traj.reward.reason


def test_checks_never_see_a_process_the_policy_started(terminal_spec, run_id, docker_client):
    """A daemon the policy detached (setsid, nohup, a double fork) is gone when the checks run."""
    plant = "setsid nohup sleep 1000 >/dev/null 2>&1 & (sleep 999 &) ; sleep 0.2; pgrep -c -u sandbox"
    check = {"verifier": "command", "command": "pgrep -u sandbox || echo none", "pattern": "^none$"}
    traj = episode([ToolCall("bash", {"command": plant})], [check], terminal_spec, run_id, docker_client)
    assert not traj.failed, traj.failure
    assert int(traj.turns[0].observations[0].split()[0]) >= 2  # they were running during the episode
    assert traj.reward.success, traj.reward.reason
