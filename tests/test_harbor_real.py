"""Harbor tasks as terminal-bench 2.x writes them, unmodified (tests/data/harbor_real): a digest-pinned registry FROM
that cannot be pulled here (mapped to the local base), a PATH without /usr/sbin, WORKDIR /app with a root agent, a
solve.sh that reads its sibling files from /solution and needs its [solution] env, task.toml limits, timeouts and
[verifier] env, test.sh that refuses to run from / and writes reward.json. And a task whose base cannot be had."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sandforge.environments.harbor.dockerfile import BaseImageError, rewrite, short_name
from sandforge.environments.harbor.settings import read_settings
from sandforge.environments.harbor.tasks import compact_checks, load_task, load_tasks
from sandforge.environments.task_sources import heldout_by_hash
from sandforge.types import ToolCall

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "tests" / "data" / "harbor_real"
PINNED = REAL / "digest-pinned"
SANDFORGE = Path(sys.executable).parent / "sandforge"


# --- no Docker --------------------------------------------------------------------------------------------------------


def test_task_toml_is_honoured_and_what_is_not_is_named():
    task = load_task(PINNED)
    assert task.sandbox.overrides() == {"user": "root", "workdir": "/app", "cpus": 1.0, "memory": "768m",
                                                 "workspace_size": "1024m"}
    assert task.agent_timeout == 120.0 and task.setup["solution_env"] == {"GREETING": "hello from the oracle"}
    (check,) = task.checks
    assert (check["timeout"], check["user"], check["env"], check["workdir"]) == (60.0, "root", {"EXPECTED_LINES": "4"},
                                                                               "/app")
    assert "not_honoured" not in task.setup  # storage_mb included: everything in it is honoured
    s = read_settings({"verifier": {}, "environment": {"allow_internet": True, "gpus": 1}, "agent": {"model": "x"},
                       "extras": {"a": 1}}, "t.toml")
    assert s.verifier_timeout == 600.0  # Harbor's default, not 120
    assert s.not_honoured == ["[environment] allow_internet = true (sandboxes have no network)",
                              "[environment] gpus (sandboxes get no GPU)", "[agent] model", "[extras]"]
    assert load_task(PINNED, mode="hardened").sandbox.user == "sandbox"


def test_from_images_are_kept_mapped_or_refused_in_one_line():
    assert short_name("public.ecr.aws/docker/library/debian:bookworm-slim@sha256:ab") == "debian:bookworm-slim"
    assert short_name("python:3.12-slim") == "python:3.12-slim" and short_name("ghcr.io/o/img") == "o/img:latest"
    text = ("FROM python:3.12-slim AS build\nWORKDIR /src\nRUN echo a \\\n FROM not-a-stage\n"
            "FROM build\nFROM ubuntu:24.04\nARG BASE\nFROM ${BASE}\n")
    out = rewrite(text, "harbor/t", "sandforge/base:bookworm", present=lambda ref: ref == "ubuntu:24.04")
    lines = out.dockerfile.splitlines()
    assert lines[0] == "FROM sandforge/base:bookworm AS build" and "python3-pip" in out.dockerfile
    assert " FROM not-a-stage" in lines and "FROM build" in lines and "FROM ubuntu:24.04" in lines
    assert "FROM ${BASE}" in lines and len(out.notes) == 1 and "python:3.12-slim -> base+python" in out.notes[0]
    # #58: the note says what the task gets instead: a minimal userland, Debian's Python for the one it named
    assert "no procps" in out.notes[0] and "Python 3.11, not the 3.12 the image names" in out.notes[0], out.notes
    with pytest.raises(BaseImageError, match=r"^harbor/t: base image quay.io/x/y:1 is not on this host, cannot be "
                                             r"pulled, and sandbox.base_map maps nothing to it \(map it in the "
                                             r"job's sandbox section, or `sandforge harbor check --set "
                                             r"'sandbox.base_map=\{\"x/y:\*\": base\}'`; base\+python adds "
                                             r"Debian's python3; the map adds to the default one\)$"):
        rewrite("FROM quay.io/x/y:1\n", "harbor/t", "b", present=lambda ref: False)
    # #58: a map adds to the defaults (copying the hint's one pattern broke every other task), its own tried first
    kept = rewrite("FROM debian:bookworm\nFROM ubuntu:24.04\nFROM team/x:1\n", "harbor/t", "b", present=lambda ref: False,
                   base_map={"team/x:*": "base+python", "ubuntu:*": "base+python"}).dockerfile
    assert kept.count("FROM b") == 3 and kept.count("python3-pip") == 2, kept
    with pytest.raises(BaseImageError, match=r"base_map=\{\"acme/python-tools:\*\": base\+python\}"):
        rewrite("FROM acme/python-tools:3\n", "harbor/t", "b", present=lambda ref: False)  # python: base+python
    hardened = rewrite("FROM debian:bookworm\nWORKDIR /app\n", "harbor/t", "b", lambda ref: True, mode="hardened")
    assert "/usr/sbin/useradd --uid 1000" in hardened.dockerfile and 'chown -R sandbox: "$w"' in hardened.dockerfile


def test_pinned_pip_installs_of_run_lines_are_found():
    """What the build will need as wheels (a build here reaches no package index): the specs of every pip install."""
    from sandforge.environments.harbor.dockerfile import pip_requirements

    text = ("RUN apt-get update && \\\n    apt-get install -y python3-pip\n"
            "RUN pip3 install --no-cache-dir --break-system-packages pytest==8.4.1 pandas==2.3.2\n"
            "RUN python3 -m venv /opt/v && /opt/v/bin/pip install --no-cache-dir \\\n"
            "   pytest-json-ctrf==0.5.0 'requests[socks]>=2,<3' -r req.txt ./local https://x/y.whl -i http://idx\n"
            "RUN uv pip install --system numpy; /usr/bin/python3 -m pip install pytest==8.4.1\n")
    assert pip_requirements(text) == ["pytest==8.4.1", "pandas==2.3.2", "pytest-json-ctrf==0.5.0",
                                      "requests[socks]>=2,<3", "numpy"]
    from sandforge.environments.harbor.dockerfile import requirement_files

    folder = Path(__file__).parent / "data" / "harbor_real"  # no requirements files: nothing
    assert requirement_files(folder) == []
    mapped = rewrite("FROM debian:bookworm\nRUN pip install six\n", "t", "b", lambda ref: False, wheels=True)
    assert mapped.dockerfile.splitlines()[1:3] == ["COPY sandforge-wheels/ /opt/sandforge-wheels/",
                                                   "ENV PIP_FIND_LINKS=/opt/sandforge-wheels PIP_NO_INDEX=1"]


def test_a_hash_locked_requirements_file_is_read_without_its_hashes(tmp_path):
    """terminal-bench's `pip install --require-hashes -r requirements.txt` (CRLF line ends, continuations): the
    specs are fetched on the host, the hashes stay for the build's pip to check."""
    from sandforge.environments.harbor.dockerfile import requirement_files

    (tmp_path / "requirements.txt").write_bytes(
        b"# pinned\r\niniconfig==2.3.0 \\\r\n    --hash=sha256:c763 \\\r\n    --hash=sha256:f631\r\n"
        b"pytest==9.0.3 --hash=sha256:aa  # the runner\r\n--index-url https://x\r\n")
    assert requirement_files(tmp_path) == ["iniconfig==2.3.0", "pytest==9.0.3"]


def test_held_out_split_by_a_stable_hash_and_compact_trajectory_rows():
    names = [f"task-{i}" for i in range(400)]
    held = [n for n in names if heldout_by_hash(n, 0.25)]
    assert 70 <= len(held) <= 130 and held == [n for n in names if heldout_by_hash(n, 0.25)]
    assert not any(heldout_by_hash(n, 0.0) for n in names)
    tasks, _ = load_tasks(REAL / "digest-pinned", heldout=1.0)
    assert tasks[0].split == "heldout"
    row = compact_checks(json.loads(json.dumps(tasks[0].__dict__, default=lambda o: o.__dict__)))
    files = row["checks"][0]["files"]
    assert set(files["test.sh"]) == {"sha256", "bytes"} and len(json.dumps(row)) < 2000


def test_generic_code_reaches_harbors_hooks_through_its_registry_entry():
    """The run log and the fleet's image list name no environment: each asks the task's registry entry."""
    from dataclasses import asdict

    from sandforge.registry import environment

    tasks, images = load_tasks(REAL / "digest-pinned")
    row = json.loads(json.dumps(asdict(tasks[0])))
    kept = environment("harbor").logged_task(row)
    assert set(kept["checks"][0]["files"]["test.sh"]) == {"sha256", "bytes"}
    assert environment("terminal").logged_task(row) is row  # an env without the hook: the row as it is
    (context,) = images.values()
    assert environment("harbor").job_image_context(context, {"x:*": "base"}).prepare.base_map == {"x:*": "base"}
    assert environment("terminal").job_image_context(context, {"x:*": "base"}) is context


# --- in containers ----------------------------------------------------------------------------------------------------


@pytest.mark.docker
def test_harbor_check_prints_one_row_per_task_with_the_failure_line():
    """`sandforge harbor check` on the folder: the pinned task builds on the mapped base, its oracle scores 1 and
    doing nothing 0; the task whose base cannot be had is one row saying so; the exit code says not all are fine."""
    out = subprocess.run([str(SANDFORGE), "harbor", "check", str(REAL)], capture_output=True, text=True, timeout=900,
                         env={**__import__("os").environ, "COLUMNS": "250"})
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    pinned = next(line for line in text.splitlines() if "harbor/digest-pinned" in line and "built" in line)
    cells = [c.strip() for c in pinned.split("│")]
    assert cells[2:6] == ["built", "1", "0", cells[5]], pinned
    assert "built on sandforge/base:bookworm instead" in text
    missing = next(line for line in text.splitlines() if "harbor/missing-base" in line and "failed" in line)
    assert "quay.io/nowhere/custom-runtime:7 is not on this host" in missing


@pytest.mark.docker
def test_hardened_mode_runs_the_same_oracle_as_a_non_root_agent():
    from sandforge.job.harbor_check import check

    [row] = check([PINNED], mode="hardened")
    assert (row.oracle, row.noop) == (1.0, 0.0), row


@pytest.mark.docker
@pytest.mark.parametrize("mode, uid", [("root", "0"), ("hardened", "1000")])
def test_a_training_episode_runs_as_the_tasks_user_in_its_workdir(mode, uid, docker_client, run_id):
    """The rollout worker's sandbox for the task (its spec from task.toml and the image): the policy's shell starts
    in /app as root, or as uid 1000 in hardened mode, can do the work there, and the episode scores 1."""
    from dataclasses import replace

    from agent_fakes import CHAT, limits

    from sandforge.config import SandboxConfig
    from sandforge.environments.harbor.env import HarborEnv
    from sandforge.sandbox.images import build_images
    from sandforge.rollout.agent import run_episode
    from sandforge.rollout.policy_client import scripted_policy
    from sandforge.sandbox.job_spec import sandbox_spec

    [task], images = load_tasks(PINNED, mode)
    tags = build_images([], client=docker_client, show_progress=False, contexts=images)
    spec = sandbox_spec(SandboxConfig(), tags[task.image], HarborEnv, task.sandbox, docker_client)
    assert (spec.workdir, spec.memory, spec.cpus) == ("/app", "768m", 1.0)
    env = HarborEnv(task, spec, run_id, exec_timeout=20, client=docker_client)
    work = "pwd; id -u; words > out/result.txt && echo 'hello from the oracle' >> out/result.txt"
    scripted = replace(task, solution=[ToolCall("bash", {"command": work}), ToolCall("submit")])
    traj = asyncio.run(run_episode(task, env, scripted_policy(scripted, CHAT), CHAT, limits(max_turns=3), "g"))
    assert not traj.failed, traj.failure
    assert traj.turns[0].observations[0].startswith(f"/app\n{uid}\n"), traj.turns[0].observations[0]
    assert (traj.reward.value, traj.reward.success) == (1.0, True), traj.reward.reason

    # the warm start's replay of the task's own solve.sh (#58), which runs write_words.sh beside it in /solution
    # and needs its [solution] env: typed through the bash tool, as a policy could type it, it verifies
    env = HarborEnv(task, spec, run_id, exec_timeout=20, client=docker_client)
    traj = asyncio.run(run_episode(task, env, scripted_policy(task, CHAT), CHAT, limits(max_turns=3), "g"))
    assert not traj.failed, traj.failure
    assert (traj.reward.value, traj.reward.success) == (1.0, True), (traj.reward.reason, traj.turns[0].observations)


VENV_TASK = """FROM debian:bookworm-slim
WORKDIR /app
RUN mkdir -p /app/src /app/.venv/bin /app/tools/env/bin && echo 'x = 1' > /app/src/main.py \\
 && printf 'home = /usr/bin\\n' > /app/.venv/pyvenv.cfg && printf '#!/bin/sh\\necho real\\n' > /app/.venv/bin/python \\
 && printf 'home = /usr/bin\\n' > /app/tools/env/pyvenv.cfg && echo tool > /app/tools/notes.txt \\
 && chmod +x /app/.venv/bin/python
"""


@pytest.mark.docker
def test_a_hardened_agent_owns_its_workdir_but_cannot_replace_the_venvs_in_it_or_own_the_system(tmp_path, docker_client,
                                                                                             run_id):
    """#56/#58: hardened mode's `chown -R` of the WORKDIR handed the agent the image's venv there (test.sh runs its
    python as root: plant code, score 1), and with no WORKDIR of the image's own it ran on "/" (the build failed on
    /sys; had it not, the agent would own /usr and /etc). In the episode's own sandbox (the WORKDIR a tmpfs filled
    from the image), the agent still edits and adds files in its workdir."""
    from dataclasses import replace

    from agent_fakes import CHAT, limits

    from sandforge.config import SandboxConfig
    from sandforge.environments.harbor.env import HarborEnv
    from sandforge.sandbox.images import build_images
    from sandforge.sandbox.job_spec import sandbox_spec
    from sandforge.rollout.agent import run_episode
    from sandforge.rollout.policy_client import scripted_policy

    def task(name: str, dockerfile: str) -> Path:
        folder = tmp_path / name
        (folder / "environment").mkdir(parents=True)
        (folder / "tests").mkdir()
        (folder / "instruction.md").write_text("Do the thing.\n")
        (folder / "task.toml").write_text('version = "1.0"\n')
        (folder / "environment" / "Dockerfile").write_text(dockerfile)
        (folder / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
        return folder

    def as_agent(folder: Path, script: str) -> str:
        [t], images = load_tasks(folder, "hardened")
        tags = build_images([], client=docker_client, show_progress=False, contexts=images)
        spec = sandbox_spec(SandboxConfig(), tags[t.image], HarborEnv, t.sandbox, docker_client)
        env = HarborEnv(t, spec, run_id, exec_timeout=20, client=docker_client)
        scripted = replace(t, solution=[ToolCall("bash", {"command": script}), ToolCall("submit")])
        traj = asyncio.run(run_episode(t, env, scripted_policy(scripted, CHAT), CHAT, limits(max_turns=3), "g"))
        assert not traj.failed, traj.failure
        return traj.turns[0].observations[0]

    system = as_agent(task("no-workdir", "FROM debian:bookworm-slim\n"),
                      "id -u; stat -c %U /usr /etc /; touch /usr/x 2>/dev/null || echo refused")
    assert system.split()[:5] == ["1000", "root", "root", "root", "refused"], system
    tried = as_agent(task("venv-in-workdir", VENV_TASK), """cd /app; id -u
        echo 'x = 2' > src/main.py && touch new.txt && mkdir made && echo edited
        echo 'echo planted' > .venv/bin/python 2>/dev/null || echo no-write
        mv .venv .venv-old 2>/dev/null || echo no-rename
        rm -rf .venv 2>/dev/null; [ -f .venv/bin/python ] && echo kept
        mv tools tools-old 2>/dev/null || echo no-rename-parent
        echo x > tools/env/evil 2>/dev/null || echo no-add-in-venv
        echo y > tools/notes.txt && echo notes-edited
        .venv/bin/python""")
    said = [line for line in tried.splitlines() if not line.startswith("bash:")]  # the shell's own refusals
    assert said[:9] == ["1000", "edited", "no-write", "no-rename", "kept", "no-rename-parent",
                                 "no-add-in-venv", "notes-edited", "real"], tried


@pytest.mark.docker
def test_a_task_that_names_only_its_image_builds_from_it(tmp_path):
    """`[environment] docker_image` instead of environment/Dockerfile (Harbor allows either): built FROM that image,
    mapped here to the local base."""
    from sandforge.job.harbor_check import check

    task = tmp_path / "image-only"
    (task / "tests").mkdir(parents=True)
    (task / "solution").mkdir()
    (task / "instruction.md").write_text("Create /tmp/done.\n")
    (task / "task.toml").write_text('version = "2.0"\n[environment]\ndocker_image = "debian:bookworm-slim"\n'
                                    'workdir = "/srv"\n')
    (task / "tests" / "test.sh").write_text("#!/bin/bash\n[ -f /srv/done ] && echo 1 > /logs/verifier/reward.txt "
                                            "|| echo 0 > /logs/verifier/reward.txt\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\ntouch done\n")
    assert load_task(task).setup["docker_image"] == "debian:bookworm-slim"
    [row] = check([task])
    assert (row.oracle, row.noop) == (1.0, 0.0), row
    assert any("debian:bookworm-slim is not here" in note for note in row.notes), row.notes
