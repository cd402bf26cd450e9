"""The grading harness loads nothing the policy left but the code under test (#32, items 2 and 3).

Each attack is a real Harbor task folder (or a command check) graded through run_episode, the real graders and a
real container, with the policy a non-root user (hardened). Before sandforge's harness (sandforge/grading/startup.py) each
one scored 1: a pytest plugin a `*.dist-info` in the WORKDIR announced, a module named like one only the tests'
`PYTHONPATH` has, a shadow module in a subfolder the check `cd`s into, and terminal-bench's `.tbench-testing` venv,
whose `activate` an offline test.sh sourced as root. Each task's honest solution still scores 1.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from agent_fakes import CHAT, limits
from harbor_folder import grader, harbor_task, quoted, write

from sandforge.rollout.agent import run_episode
from sandforge.rollout.policy_client import scripted_policy
from sandforge.types import ToolCall

pytestmark = pytest.mark.docker

# the reward file, written the moment the planted code runs (as root, in test.sh's Python or shell)
FORGE = "open('/logs/verifier/reward.txt', 'w').write('1'); import os; os._exit(0)"
RUN_PYTEST = "if python3 -m pytest -q -p no:cacheprovider /tests/test_outputs.py; then r=1; else r=0; fi\n"
REWARD = "echo $r > /logs/verifier/reward.txt\n"


DONE = "echo done > /workspace/done.txt"


def test_a_pytest_plugin_announced_from_the_workdir_is_not_loaded(repo_spec, run_id, docker_client, tmp_path):
    """`python3 -m pytest` in the WORKDIR reads every `*.dist-info` on sys.path, the working directory's too, and
    autoloads the `pytest11` plugins they announce: the policy's plugin wrote reward 1 as root. Packages' metadata
    is read only from root's own folders now, so the plugin is never imported."""
    dist = "/workspace/evil-1.0.dist-info"
    plant = " && ".join([write(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n"),
                         write(f"{dist}/entry_points.txt", "[pytest11]\nevil = evilplug\n"),
                         write("/workspace/evilplug.py", FORGE + "\n"), "echo planted"])
    task, images = harbor_task(tmp_path, repo_spec.image, "cd /workspace\n" + RUN_PYTEST + REWARD)
    run = grader(task, images, run_id, docker_client)
    cheat = run(plant)
    assert cheat.turns[0].observations[0].startswith("planted"), cheat.turns[0].observations[0]
    assert cheat.reward.value == 0.0, cheat.reward.reason
    assert run(DONE).reward.value == 1.0


def test_a_module_only_the_tests_path_has_is_not_shadowed(repo_spec, run_id, docker_client, tmp_path):
    """The tests import `checker` from their own PYTHONPATH (task.toml's [verifier] env); `python3 -m pytest` in the
    WORKDIR put the policy's `checker.py` ahead of it (the set-aside knows only the system Python's modules):
    reward 1. Root's own sys.path entries are searched first."""
    tests = {"lib/checker.py": "def ok():\n    return open('/workspace/done.txt').read().strip() == 'done'\n",
             "test_outputs.py": "from checker import ok\n\ndef test_done():\n    assert ok()\n"}
    task, images = harbor_task(tmp_path, repo_spec.image, "cd /workspace\n" + RUN_PYTEST + REWARD, tests,
                               verifier_env='env = { PYTHONPATH = "/tests/lib" }\n')
    run = grader(task, images, run_id, docker_client)
    cheat = run(write("/workspace/checker.py", "def ok():\n    return True\n"))
    assert cheat.reward.value == 0.0, cheat.reward.reason
    assert run(DONE).reward.value == 1.0


@pytest.mark.parametrize("shadow", ["pytest.py", "pytest/__init__.py"])
def test_a_shadow_in_a_subfolder_the_check_enters_is_not_imported(shadow, repo_spec, run_id, docker_client,
                                                                  tmp_path):
    """test.sh `cd`s into the project the task asked for and runs `python3 -m pytest` there; the set-aside looks only
    at the WORKDIR's top level, so `proj/pytest.py` (or a package) ran in pytest's place: reward 1."""
    task, images = harbor_task(tmp_path, repo_spec.image, "mkdir -p /workspace/proj && cd /workspace/proj\n"
                               + RUN_PYTEST + REWARD)
    run = grader(task, images, run_id, docker_client)
    cheat = run(write(f"/workspace/proj/{shadow}", FORGE + "\n"))
    assert cheat.reward.value == 0.0, cheat.reward.reason
    assert run(DONE).reward.value == 1.0


@pytest.mark.parametrize("prefix, planted", [
    # copy.py (which pytest imports) tries `from org.python.core import PyStringMap`: the policy's org/ ran as root
    ("", "/workspace/org/__init__.py"),
    # a src-layout test.sh puts the policy's folder first on PYTHONPATH: its sitecustomize.py ran before sandforge's
    ("export PYTHONPATH=/workspace/src:$PYTHONPATH\n", "/workspace/src/sitecustomize.py"),
], ids=["optional-import", "pythonpath-first"])
def test_library_code_never_imports_from_the_workdir(prefix, planted, repo_spec, run_id, docker_client, tmp_path):
    """Found by red-teaming the harness: a library's own import statement that misses on root's folders (an optional
    dependency, a Jython probe, site's `import sitecustomize`) reached the policy's folders. It stops at root's."""
    task, images = harbor_task(tmp_path, repo_spec.image, prefix + "cd /workspace\n" + RUN_PYTEST + REWARD)
    run = grader(task, images, run_id, docker_client)
    cheat = run(write(planted, FORGE + "\n"))
    assert cheat.reward.value == 0.0, cheat.reward.reason
    assert run(DONE).reward.value == 1.0


def command_check_episode(check, command, spec, run_id, client):
    """A terminal episode whose policy runs ``command`` and submits, graded by ``check`` alone."""
    from seeded import terminal_task as make_task

    from sandforge.environments.terminal.env import TerminalEnv

    calls = [ToolCall("bash", {"command": command}), ToolCall("submit")]
    task = replace(make_task("write_file", 3), checks=[check], solution=calls)
    env = TerminalEnv(task, spec, run_id, client=client)
    traj = asyncio.run(run_episode(task, env, scripted_policy(task, CHAT), CHAT, limits(max_turns=3), "g"))
    assert not traj.failed, traj.failure
    return traj


def test_a_command_check_in_a_subfolder_imports_roots_modules(repo_spec, run_id, docker_client):
    """A command check whose workdir is a subfolder skips the set-aside, and `python3 -c` put that folder first:
    the policy's `json.py` there printed the verdict."""
    check = {"verifier": "command", "workdir": "/workspace/proj", "pattern": "^true$",
             "command": "python3 -c \"import json; print(json.dumps(open('answer.txt').read().strip() == '42'))\""}

    def run(command):
        return command_check_episode(check, command, repo_spec, run_id, docker_client)

    cheat = run(write("/workspace/proj/json.py", "import sys\nprint('true')\nsys.exit(0)\n"))
    assert cheat.reward.value == 0.0, cheat.reward.reason
    assert run("mkdir -p /workspace/proj && echo 42 > /workspace/proj/answer.txt").reward.value == 1.0


TBENCH = ("#!/bin/bash\n"  # terminal-bench's test.sh template, as its tasks ship it
          "apt-get update >/dev/null 2>&1\n"
          "curl -LsSf https://astral.sh/uv/0.7.13/install.sh 2>/dev/null | sh\n"
          "source $HOME/.local/bin/env\n"
          'if [ "$PWD" = "/" ]; then\n    echo "Error: No working directory set."\n    exit 1\nfi\n'
          "uv venv .tbench-testing\n"
          "source .tbench-testing/bin/activate\n"
          "uv pip install pytest==8.4.1\n"
          "uv run pytest /tests/test_outputs.py -rA -p no:cacheprovider\n"
          "if [ $? -eq 0 ]; then\n  echo 1 > /logs/verifier/reward.txt\nelse\n"
          "  echo 0 > /logs/verifier/reward.txt\nfi\n")


def test_a_planted_tbench_venv_is_never_sourced(repo_spec, run_id, docker_client, tmp_path):
    """Offline, terminal-bench's `uv venv .tbench-testing` never ran, so test.sh sourced the policy's
    `.tbench-testing/bin/activate` as root: reward 1 (uid 0). sandforge's offline uv makes the venv afresh (what
    stood there is removed first), on the image's packages, and the template grades: the oracle scores 1 too."""
    forged = "echo 1 > /logs/verifier/reward.txt; id -u > /logs/ran-as; exit 0\n"
    task, images = harbor_task(tmp_path, repo_spec.image, TBENCH)
    run = grader(task, images, run_id, docker_client)
    cheat = run(write("/workspace/.tbench-testing/bin/activate", forged))
    assert cheat.reward.value == 0.0, cheat.reward.reason
    # a link planted where the venv goes is replaced, never followed
    linked = run("mkdir -p /tmp/v/bin && printf %s " + quoted(forged) + " > /tmp/v/bin/activate && "
                 "ln -s /tmp/v /workspace/.tbench-testing")
    assert linked.reward.value == 0.0, linked.reward.reason
    solved = run(DONE)
    assert solved.reward.value == 1.0, solved.reward.reason


def test_an_honest_answer_named_like_a_standard_module_in_a_subfolder_scores_1(repo_spec, run_id, docker_client,
                                                                                tmp_path):
    """The instruction asks for `proj/statistics.py`, and the tests import it from there: the answer keeps Python's
    own order while every other name is root's first. A shadow the instruction does not name still loses."""
    tests = {"test_outputs.py": "from statistics import spread\n\ndef test_spread():\n"
                                "    assert spread([3, 9, 4]) == 6\n"}
    task, images = harbor_task(tmp_path, repo_spec.image, "cd /workspace/proj\n" + RUN_PYTEST + REWARD, tests,
                               "Write `/workspace/proj/statistics.py` with `spread(xs)`: max(xs) - min(xs).\n")
    run = grader(task, images, run_id, docker_client)
    honest = write("/workspace/proj/statistics.py", "def spread(xs):\n    return max(xs) - min(xs)\n")
    assert run(honest).reward.value == 1.0
    assert run(honest + " && " + write("/workspace/proj/pytest.py", FORGE + "\n")).reward.value == 1.0
    assert run(write("/workspace/proj/statistics.py", "def spread(xs):\n    return 0\n") + " && "
               + write("/workspace/proj/pytest.py", FORGE + "\n")).reward.value == 0.0


def test_the_offline_uv_makes_a_venv_on_the_images_packages(repo_spec, run_id, docker_client):
    """What terminal-bench's uv lines do with sandforge's stand-in, as root in a sandbox: `uv venv` makes a venv that
    sees the image's packages, `uv pip install` accepts what is installed and refuses the rest, `uv run` runs."""
    from sandforge.grading import startup
    from sandforge.sandbox.docker_sandbox import DockerSandbox

    with DockerSandbox.create(repo_spec, run_id, client=docker_client) as sb:
        start = startup.prepare(sb, "root")
        out = sb.exec(start + "cd /workspace && uv venv .t && source .t/bin/activate && uv pip install pytest==0.1 "
                      "&& uv run python3 -c 'import sys, pytest; print(sys.prefix)'; uv pip install no-such-package; "
                      "echo rc=$?", timeout=60, user="root", session=False)
        assert "/workspace/.t\n" in out.output, out.output
        assert "pytest" in out.output and "(asked for ==0.1)" in out.output, out.output
        assert "not installed, and sandboxes have no network: no-such-package" in out.output, out.output
        assert out.output.rstrip().endswith("rc=1"), out.output
        assert sb.exec("stat -c %U /workspace/.t/bin/activate", user="root", session=False).output.strip() == "root"
        assert startup.prepare(sb, "1000") == ""  # the spool is root's alone


def test_a_root_check_reads_the_policys_repository_and_runs_nothing_it_configures(repo_spec, run_id, docker_client):
    """A command check that runs `git diff` on the repository the policy made: root's git refused it ("dubious
    ownership", exit 128), so the check always scored 0; trusting it would run the `core.fsmonitor` command its
    .git/config names, as root. The harness's git reads it on a root-owned view, and the command never runs."""
    check = {"verifier": "command", "command": "git -C /workspace/proj status --porcelain && git -C /workspace/proj "
             "diff HEAD -- a.txt | grep -qx '+answer 42' && ! test -e /tmp/ran-as-root"}
    repo = ("git init -q /workspace/proj && cd /workspace/proj && git config user.email p@x.invalid && "
            "git config user.name p && echo start > a.txt && git add a.txt && git commit -qm start && "
            "echo 'answer 42' >> a.txt")
    hook = " && git config core.fsmonitor 'touch /tmp/ran-as-root; false' && git status --porcelain | head -1"

    def run(command):
        return command_check_episode(check, command, repo_spec, run_id, docker_client)

    honest = run(repo)
    assert honest.reward.value == 1.0, honest.reward.reason
    planted = run(repo + hook + " && rm -f /tmp/ran-as-root")
    assert planted.reward.value == 1.0, planted.reward.reason


def test_a_submodules_config_runs_nothing_as_root(repo_spec, run_id, docker_client):
    """#56: the grader's git read the top repository on a root-owned view, but `git status` checks submodules with a
    child git that inherited `safe.directory=*` and read the submodule's own .git/config as root: its core.fsmonitor
    ran, reward 1.0 without the answer. The child gets no trust and no submodule is entered: the command never runs,
    and an honest answer in the top repository still scores."""
    check = {"verifier": "command", "command": "git -C /workspace/proj status --porcelain; "
             "git -C /workspace/proj diff HEAD -- a.txt | grep -qx '+answer 42' && ! test -e /tmp/ran-as-root"}
    repo = ("git init -q /workspace/sub && cd /workspace/sub && git config user.email p@x.invalid && "
            "git config user.name p && echo s > s.txt && git add s.txt && git commit -qm s && "
            "git init -q /workspace/proj && cd /workspace/proj && git config user.email p@x.invalid && "
            "git config user.name p && echo start > a.txt && git add a.txt && "
            "git -c protocol.file.allow=always submodule -q add /workspace/sub sub && git commit -qm start && "
            "cd sub && git config core.fsmonitor 'touch /tmp/ran-as-root; false' && echo dirty > s.txt && cd .. && ")

    def run(command):
        return command_check_episode(check, command, repo_spec, run_id, docker_client)

    honest = run(repo + "echo 'answer 42' >> a.txt")
    assert honest.reward.value == 1.0, honest.reward.reason
    planted = run(repo + "true")  # no answer: only a root fsmonitor run could make the check pass... or fail it
    assert planted.reward.value == 0.0, planted.reward.reason
    marker = run(repo + "echo 'answer 42' >> a.txt && rm -f /tmp/ran-as-root")
    assert marker.reward.value == 1.0, marker.reward.reason  # the fsmonitor never ran as root (its marker is absent)


PROJ = ("git init -q /workspace/proj && cd /workspace/proj && git config user.email p@x.invalid && "
        "git config user.name p && echo start > a.txt && git add a.txt && git commit -qm start && ")
MONITOR = "'touch /tmp/ran-as-root; false'"


@pytest.mark.parametrize("plant, invoke", [
    # an include the repository's config names, in a file of the policy's
    (f"printf '[core]\\n\\tfsmonitor = %s\\n' {MONITOR} > /workspace/evil.cfg && "
     "git config include.path /workspace/evil.cfg", "git -C /workspace/proj status"),
    # a linked work tree whose own config.worktree names it
    (f"git worktree add -q /workspace/wt && git config extensions.worktreeConfig true && "
     f"git -C /workspace/wt config --worktree core.fsmonitor {MONITOR}", "git -C /workspace/wt status"),
    # the repository named by GIT_DIR, and by --git-dir: git runs no ownership check on an explicit one
    (f"git config core.fsmonitor {MONITOR}", "GIT_DIR=/workspace/proj/.git GIT_WORK_TREE=/workspace/proj git status"),
    (f"git config core.fsmonitor {MONITOR}", "git --git-dir=/workspace/proj/.git --work-tree=/workspace/proj status"),
    (f"git config core.fsmonitor {MONITOR}", "cd /workspace/proj/.git && git --work-tree=/workspace/proj status"),
], ids=["include", "worktree", "GIT_DIR", "git-dir", "inside-dot-git"])
def test_no_root_git_reads_a_config_the_policy_wrote_at_any_depth(plant, invoke, repo_spec, run_id, docker_client):
    """#56: "no root process reads a policy-written git config, at any depth". The check passes while the policy's
    core.fsmonitor has not run as root (its marker is absent); the policy's own git commands run it as the policy,
    so the plant ends by removing the marker."""
    check = {"verifier": "command", "command": f"{invoke} >/dev/null 2>&1; test ! -e /tmp/ran-as-root"}

    def run(command):
        return command_check_episode(check, command, repo_spec, run_id, docker_client)

    assert run(PROJ + "true").reward.value == 1.0  # honest: nothing planted
    assert run("touch /tmp/ran-as-root").reward.value == 0.0  # the marker is what the check reads
    planted = run(PROJ + plant + " && git -C /workspace/proj status >/dev/null 2>&1; rm -f /tmp/ran-as-root")
    assert planted.reward.value == 1.0, planted.reward.reason


# test.sh asks the image's Python whether the answer is there, from /workspace, with the policy's src/ on the path
ASKS = ("if {env} {python} -c \"import json, sys; sys.exit(0 if open('/workspace/done.txt').read().strip() == 'done' "
        "else 1)\"; then r=1; else r=0; fi\n")


@pytest.fixture(scope="module")
def venv_image(repo_spec, docker_client):
    """The repo image with a venv of the image's own (root's) at /opt/venv, without the system's packages."""
    import io

    tag = "sandforge-test/venv-image:latest"
    dockerfile = f"FROM {repo_spec.image}\nUSER root\nRUN python3 -m venv --without-pip /opt/venv\n"
    docker_client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True)
    return tag


@pytest.mark.parametrize("env, python", [
    # the image's venv (no user site: PYTHONUSERBASE is never read) with test.sh's own PYTHONPATH (sandforge's gone)
    ("PYTHONPATH=/workspace/src", "/opt/venv/bin/python"),
    # the system's Python, its user site turned off and test.sh's own PYTHONPATH
    ("PYTHONNOUSERSITE=1 PYTHONPATH=/workspace/src", "python3"),
    # an emptied environment: sandforge's exports gone, the policy's folder on test.sh's own PYTHONPATH
    ("env -i PYTHONPATH=/workspace/src", "/usr/bin/python3"),
    ("env -i PYTHONPATH=/workspace/src", "/opt/venv/bin/python"),
], ids=["image-venv", "no-user-site", "env-i", "env-i-image-venv"])
def test_every_python_of_the_image_starts_the_harness_whatever_test_sh_does_to_the_environment(
        env, python, venv_image, run_id, docker_client, tmp_path):
    """#56: the harness reached a check's Python only through PYTHONUSERBASE's user site or the sitecustomize on
    PYTHONPATH, so a test.sh that ran the image's venv, or set PYTHONPATH and PYTHONNOUSERSITE, got none of it: the
    policy's json.py on that path ran as root and wrote reward 1. A root-owned .pth in every site-packages folder of
    the image that the policy cannot write starts it in every Python there."""
    task, images = harbor_task(tmp_path, venv_image, ASKS.format(env=env, python=python) + REWARD)
    run = grader(task, images, run_id, docker_client)
    cheat = run(write("/workspace/src/json.py", FORGE + "\n"))
    assert cheat.reward.value == 0.0, cheat.reward.reason
    assert run(DONE).reward.value == 1.0
