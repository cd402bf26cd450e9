"""Checks run in a clean context (issue #23, item 2) and no grader's secret is in a process's argv (item 3).

Before the fix, root's one-off execs had the policy's workspace as HOME, so what the policy planted there ran as root
while it was graded: a shadow ``json.py`` in the cwd of the ``sql`` check's python, a user-site ``.pth`` file, a
``~/.gitconfig`` that trusts every repository and names a ``core.fsmonitor`` command. Each attack goes through
run_episode, the real verifiers and a real container (the repo image: python3 and git).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from agent_fakes import CHAT, limits
from seeded import terminal_task as make_task

from sandforge.sandbox.docker_sandbox import DockerSandbox
from sandforge.environments.terminal.env import TerminalEnv
from sandforge.rollout.agent import run_episode
from sandforge.rollout.policy_client import scripted_policy
from sandforge.types import ToolCall
from sandforge.verifiers.checks import score_task

pytestmark = pytest.mark.docker

SITE = "/workspace/.local/lib/python3.11/site-packages"  # the policy's user site: its HOME is the workspace


def episode(commands: list[str], checks: list[dict], spec, run_id, client):
    calls = [ToolCall("bash", {"command": c}) for c in commands] + [ToolCall("submit")]
    task = replace(make_task("write_file", 3), checks=checks, solution=calls)
    env = TerminalEnv(task, spec, run_id, client=client)
    traj = asyncio.run(run_episode(task, env, scripted_policy(task, CHAT), CHAT, limits(max_turns=6), "g"))
    assert not traj.failed, traj.failure
    return traj


def test_a_shadow_json_module_does_not_answer_the_sql_check(repo_spec, run_id, docker_client):
    """A `json.py` in the workspace printed the expected rows when the sql check's python imported it: reward 1 with
    no database at all. The check's python runs isolated (-I) from /: the database is missing, score 0."""
    shadow = "import sys\nprint('{\"rows\": [[42]]}')\nsys.exit(0)\n"
    plant = f"printf %s {_q(shadow)} > /workspace/json.py && echo planted"
    check = {"verifier": "sql", "db": "/workspace/app.db", "query": "SELECT answer FROM t", "expect": [[42]]}
    traj = episode([plant], [check], repo_spec, run_id, docker_client)
    assert traj.turns[0].observations[0].startswith("planted")
    assert traj.reward.value == 0.0, traj.reward.reason
    assert "no database" in traj.reward.reason


def test_a_user_site_pth_file_does_not_run_in_a_root_check(repo_spec, run_id, docker_client):
    """A `.pth` file in the policy's user site (its HOME is the workspace) ran as root in every python3 a check
    started, and printed the check's answer. Root's checks have root's HOME and no user site: score 0."""
    pth = "import os, sys; print('True'); sys.stdout.flush(); os._exit(0)\n"
    plant = f"mkdir -p {SITE} && printf %s {_q(pth)} > {SITE}/zz.pth && python3 -c pass | head -1"
    check = {"verifier": "command", "command": "python3 -c \"print(open('/workspace/answer.txt').read() == '42')\"",
             "pattern": "^True$"}
    traj = episode([plant], [check], repo_spec, run_id, docker_client)
    assert traj.turns[0].observations[0].startswith("True")  # it works on the policy's own python
    assert traj.reward.value == 0.0, traj.reward.reason


def test_a_planted_gitconfig_never_runs_as_root(repo_spec, run_id, docker_client):
    """`~/.gitconfig` in the workspace trusts every repository and names a core.fsmonitor command; a root check
    running `git status` ran it. Root's git reads no global or system config, so it never runs."""
    plant = ("git init -q /workspace/proj && echo x > /workspace/proj/f && "
             "git config --global safe.directory '*' && "
             "git config --global core.fsmonitor 'id -u > /tmp/fsmonitor-ran; true' && "
             "git -C /workspace/proj status --porcelain && cat /tmp/fsmonitor-ran && rm /tmp/fsmonitor-ran")
    check = {"verifier": "command", "command": "git -C /workspace/proj status --porcelain >/dev/null 2>&1; "
             "cat /tmp/fsmonitor-ran 2>/dev/null || echo never", "pattern": "^never$"}
    traj = episode([plant], [check], repo_spec, run_id, docker_client)
    assert "1000" in traj.turns[0].observations[0]  # the hook runs for the policy's own git
    assert traj.reward.success, traj.reward.reason


def test_a_check_as_root_gets_roots_home_and_a_clean_environment(repo_spec, run_id, docker_client):
    """What a root check sees: root's HOME, no user site, git without global or system config."""
    probe = ("echo HOME=$HOME; python3 -c 'import site, sys; print(\"usersite\", site.ENABLE_USER_SITE)'; "
             "echo git=$GIT_CONFIG_GLOBAL,$GIT_CONFIG_NOSYSTEM")
    with DockerSandbox.create(repo_spec, run_id, client=docker_client) as sb:
        out = sb.exec(probe, user="root", session=False).output
        assert "HOME=/root" in out and "usersite False" in out and "git=/dev/null,1" in out, out
        mine = sb.exec("echo HOME=$HOME", session=False).output  # the policy's own commands are unchanged
        assert "HOME=/workspace" in mine


def test_no_grader_secret_is_in_argv(repo_spec, run_id, docker_client):
    """A process that can read /proc (a root agent, which Harbor's root mode does not stop) saw the sql check's query,
    expected value and all, in python's argv. The query travels on stdin now."""
    secret = "s3cret-7f3a"
    snoop = ("nohup bash -c 'while :; do for f in /proc/[0-9]*/cmdline; do tr \"\\0\" \" \" < $f; echo; done; done "
             ">> /run/sandforge-root/argv' >/dev/null 2>&1 & echo started")
    # slow enough (about a second) that the snooping loop sees the query's process at least once
    query = (f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 2000000) "
             f"SELECT '{secret}', count(*) FROM c")
    task = replace(make_task("write_file", 3), checks=[
        {"verifier": "sql", "db": "/tmp/app.db", "query": query, "expect": [[secret, 2000000]]}])
    with DockerSandbox.create(repo_spec, run_id, client=docker_client) as sb:
        made = sb.exec("python3 -c \"import sqlite3; sqlite3.connect('/tmp/app.db').execute('create table t(x)')\"",
                       user="root", session=False)
        assert made.exit_code == 0, made.output
        assert sb.exec(snoop, user="root").output.startswith("started")
        reward = score_task(sb, task)
        assert reward.success, reward.reason
        seen = sb.exec("grep -c python3 /run/sandforge-root/argv; grep -c " + secret + " /run/sandforge-root/argv",
                       user="root", session=False).output.split()
        assert int(seen[0]) > 0  # the snooper saw the query's python
        assert seen[1] == "0", "the query's secret was in a process's argv"


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def test_a_shadow_module_in_the_workspace_is_set_aside_before_a_command_check(repo_spec, run_id, docker_client):
    """`python3 -c` puts its working directory (the workspace) first on sys.path, so the check's `import json` ran
    the policy's json.py, which printed the answer. New top-level modules named like ones the grader's Python
    imports are set aside first, and the reason says so; the policy's other files stay."""
    shadow = "import sys\nprint('true')\nsys.exit(0)\n"
    plant = f"printf %s {_q(shadow)} > json.py && echo 'x = 1' > mine.py && echo planted"
    check = {"verifier": "command", "pattern": "^true$",
             "command": "python3 -c \"import json; print(json.dumps(open('answer.txt').read().strip() == '42'))\""}
    traj = episode([plant], [check], repo_spec, run_id, docker_client)
    assert traj.turns[0].observations[0].startswith("planted")
    assert traj.reward.value == 0.0, traj.reward.reason
    assert "set aside before the check: json.py" in traj.reward.reason and "mine.py" not in traj.reward.reason


def test_a_planted_pytest_does_not_grade_a_harbor_task(repo_spec, run_id, docker_client, tmp_path):
    """A terminal-bench test.sh runs `python3 -m pytest` in the WORKDIR; a `pytest.py` the policy (hardened mode, a
    non-root user) left there exited 0 in pytest's place: reward 1. It is set aside; the task's oracle still
    scores 1."""
    from sandforge.config import SandboxConfig
    from sandforge.environments.harbor.env import HarborEnv
    from sandforge.environments.harbor.tasks import load_tasks
    from sandforge.sandbox.images import build_images
    from sandforge.sandbox.job_spec import sandbox_spec

    task_dir = tmp_path / "pytest-task"
    (task_dir / "tests").mkdir(parents=True)
    (task_dir / "solution").mkdir()
    (task_dir / "instruction.md").write_text("Write done into /workspace/done.txt.\n")
    (task_dir / "task.toml").write_text(f'version = "2.0"\n[environment]\ndocker_image = "{repo_spec.image}"\n'
                                        '[verifier]\ntimeout_sec = 60\n')
    (task_dir / "solution" / "solve.sh").write_text("echo done > /workspace/done.txt\n")
    (task_dir / "tests" / "test_outputs.py").write_text(
        "def test_done():\n    assert open('/workspace/done.txt').read().strip() == 'done'\n")
    (task_dir / "tests" / "test.sh").write_text(
        "cd /workspace\nif python3 -m pytest -q -p no:cacheprovider /tests/test_outputs.py; then r=1; else r=0; fi\n"
        "echo $r > /logs/verifier/reward.txt\n")
    [task], images = load_tasks(task_dir, "hardened")
    tags = build_images([], client=docker_client, show_progress=False, contexts=images)
    spec = sandbox_spec(SandboxConfig(), tags[task.image], HarborEnv, task.sandbox, docker_client)

    def run(calls):
        env = HarborEnv(task, spec, run_id, exec_timeout=20, client=docker_client)
        scripted = replace(task, solution=calls + [ToolCall("submit")])
        traj = asyncio.run(run_episode(task, env, scripted_policy(scripted, CHAT), CHAT, limits(max_turns=3), "g"))
        assert not traj.failed, traj.failure
        return traj

    planted = run([ToolCall("bash", {"command": "id -u; printf 'import sys\\nsys.exit(0)\\n' > /workspace/pytest.py"})])
    assert planted.turns[0].observations[0].startswith("1000\n[exit code 0]"), planted.turns[0].observations[0]
    assert planted.reward.value == 0.0, planted.reward.reason
    assert "set aside before the check: pytest.py" in planted.reward.reason
    solved = run(task.solution[:-1])
    assert solved.reward.value == 1.0, solved.reward.reason


@pytest.mark.parametrize("plant, moved", [
    # one shadow module larger than the verifiers' 64 MiB spool: the set-aside copied it there and failed (ENOSPC)
    ("head -c 100000000 /dev/zero > json.py && echo planted", "json.py"),
    # 30,000 names that each shadow a module (X.<n>.so imports as X): one mv per name passed the 30 s limit
    ("for i in $(seq 30000); do : > json.$i.so; done && echo planted", "and 29995 more"),
])
def test_the_set_aside_cannot_be_made_to_fail(plant, moved, repo_spec, run_id, docker_client):
    """Turning a loss into a failed episode takes it out of the gradient (#32, item 4). The set-aside renames on the
    workdir's own filesystem, in batches: it holds whatever the policy planted, and the check grades (0 here)."""
    check = {"verifier": "command", "pattern": "^True$",
             "command": "python3 -c \"print(open('answer.txt').read().strip() == '42')\""}
    traj = episode([plant], [check], repo_spec, run_id, docker_client)
    assert traj.turns[0].observations[0].startswith("planted"), traj.turns[0].observations[0]
    assert traj.reward.value == 0.0 and "set aside before the check" in traj.reward.reason, traj.reward.reason
    assert moved in traj.reward.reason, traj.reward.reason


def test_an_honest_solution_named_like_a_standard_module_scores_1(repo_spec, run_id, docker_client, tmp_path):
    """A task that asks for `statistics.py` (#32): its tests import the policy's module, which is the code under test.
    The set-aside moved it (a new top-level file named like a standard module) and the honest solution scored 0. A
    Python file the instruction names in the workdir is the task's answer and stays; anything else that shadows a
    module the grader imports is still set aside."""
    from sandforge.config import SandboxConfig
    from sandforge.environments.harbor.env import HarborEnv
    from sandforge.environments.harbor.tasks import load_tasks
    from sandforge.sandbox.images import build_images
    from sandforge.sandbox.job_spec import sandbox_spec

    task_dir = tmp_path / "statistics-task"
    (task_dir / "tests").mkdir(parents=True)
    (task_dir / "instruction.md").write_text(
        "Write `/workspace/statistics.py` with a function `spread(xs)` that returns max(xs) - min(xs).\n")
    (task_dir / "task.toml").write_text(f'version = "2.0"\n[environment]\ndocker_image = "{repo_spec.image}"\n'
                                        '[verifier]\ntimeout_sec = 60\n')
    (task_dir / "tests" / "test_outputs.py").write_text(
        "from statistics import spread\n\ndef test_spread():\n    assert spread([3, 9, 4]) == 6\n")
    (task_dir / "tests" / "test.sh").write_text(
        "cd /workspace\nif python3 -m pytest -q -p no:cacheprovider /tests/test_outputs.py; then r=1; else r=0; fi\n"
        "echo $r > /logs/verifier/reward.txt\n")
    [task], images = load_tasks(task_dir, "hardened")
    tags = build_images([], client=docker_client, show_progress=False, contexts=images)
    spec = sandbox_spec(SandboxConfig(), tags[task.image], HarborEnv, task.sandbox, docker_client)

    def run(command):
        env = HarborEnv(task, spec, run_id, exec_timeout=20, client=docker_client)
        scripted = replace(task, solution=[ToolCall("bash", {"command": command}), ToolCall("submit")])
        traj = asyncio.run(run_episode(task, env, scripted_policy(scripted, CHAT), CHAT, limits(max_turns=3), "g"))
        assert not traj.failed, traj.failure
        return traj

    honest = "printf 'def spread(xs):\\n    return max(xs) - min(xs)\\n' > /workspace/statistics.py"
    solved = run(honest)
    assert solved.reward.value == 1.0, solved.reward.reason
    assert "set aside" not in solved.reward.reason, solved.reward.reason
    # the same answer, plus a module the instruction never named: that one still goes
    planted = run(honest + " && printf 'import sys\\nsys.exit(0)\\n' > /workspace/pytest.py")
    assert planted.reward.value == 1.0 and "set aside before the check: pytest.py" in planted.reward.reason
    cheat = run("printf 'import sys\\nsys.exit(0)\\n' > /workspace/pytest.py")
    assert cheat.reward.value == 0.0 and "set aside before the check: pytest.py" in cheat.reward.reason
