"""Harbor 1.4's separate verifier (#58): ``[verifier] environment_mode = "separate"``, the task's ``artifacts`` and its
``[[verifier.collect]]`` hooks (environments/harbor/separate.py, sandbox/trees.py).

test.sh runs in a fresh sandbox of its own image that receives only the declared artifacts and /logs/artifacts.
Two task folders in tests/data/harbor/shapes: separate-verifier (its verifier image built from tests/Dockerfile, the
expected answer baked into it, a collect hook writing a listing of the answer) and separate-same-image (a fresh sandbox
of the task's own image receiving /app less its ``*.log`` files). The attacks are what a policy would try once the
grader is elsewhere: a link to the grader's own expected file, a reward written where the shared grader would read it,
an artifact too large to carry; each scores 0, and the honest answer 1, in root and hardened mode.
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from sandforge.environments.harbor.env import HarborEnv
from sandforge.environments.harbor.grading import harbor_tests_verifier
from sandforge.environments.harbor.separate import SeparateArgs
from sandforge.environments.harbor.settings import HarborSettingsError, read_settings
from sandforge.environments.harbor.tasks import load_task, load_tasks
from sandforge.config import SandboxConfig
from sandforge.models.chat import ChatFormat
from sandforge.models.tokenizer import ByteTokenizer
from sandforge.rollout.agent import run_episode
from sandforge.rollout.episode import EpisodeLimits
from sandforge.rollout.policy_client import scripted_policy
from sandforge.sandbox.images import build_images
from sandforge.sandbox.job_spec import grading_spec, sandbox_spec
from sandforge.sandbox.trees import confine
from sandforge.types import ToolCall
from containers import list_run_containers

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "tests" / "data" / "harbor" / "shapes"
SEPARATE, SAME_IMAGE = SHAPES / "separate-verifier", SHAPES / "separate-same-image"
PYTEST = SHAPES / "separate-pytest"  # test.sh runs `pytest` in the WORKDIR, where pytest collects any conftest.py
CHAT = ChatFormat(ByteTokenizer())


# --- task.toml and the check (no Docker) ------------------------------------------------------------------------------


def test_a_separate_verifier_task_loads_with_its_grading_image_artifacts_and_hooks():
    [task], images = load_tasks(SEPARATE, "hardened")
    assert (task.image, task.grading_image) == ("harbor/separate-verifier", "harbor/separate-verifier-verifier")
    assert set(images) == {task.image, task.grading_image}
    assert images[task.grading_image].folder == SEPARATE / "tests"  # tests/Dockerfile, built in tests/
    check = task.checks[0]
    args = SeparateArgs.of(check["separate"])
    assert [a.source for a in args.artifacts] == ["/app/answer.txt"]
    assert [h.user for h in args.collect] == ["sandbox"]  # hardened: the hook runs as the agent, never as root
    assert check["timeout"] == args.budget() > args.test_timeout == 60.0
    assert "/logs/artifacts" in task.sandbox.scratch  # the agent and its hooks may leave files there
    assert not task.setup.get("not_honoured")
    [same], images = load_tasks(SAME_IMAGE, "root")
    assert same.grading_image == same.image and list(images) == [same.image]  # a fresh sandbox of the task's image
    assert SeparateArgs.of(same.checks[0]["separate"]).artifacts[0].exclude == ("*.log",)
    assert load_task(SHAPES / "compile-and-run").grading_image is None  # shared: test.sh in the agent's sandbox


@pytest.mark.parametrize("meta, error", [
    ({"verifier": {"environment_mode": "apart"}}, "[verifier] environment_mode must be one of 'shared' or 'separate'"),
    ({"verifier": {"environment_mode": "shared", "environment": {}}}, "cannot have a [verifier.environment]"),
    ({"verifier": {"collect": [{"timeout_sec": 5}]}}, "[verifier] collect 0 needs command"),
    ({"artifacts": ["out.txt"], "verifier": {"environment_mode": "separate"}}, "must be an absolute path"),
    ({"artifacts": ["/"], "verifier": {"environment_mode": "separate"}}, "must be an absolute path below /"),
    ({"artifacts": ["/app/../tests"], "verifier": {"environment_mode": "separate"}}, "without '..'"),
    ({"artifacts": ["/logs"], "verifier": {"environment_mode": "separate"}}, "grader's own /tests or /logs/verifier"),
    ({"artifacts": [{"source": "/tests/x"}], "verifier": {"environment": {}}}, "grader's own"),
])
def test_a_separate_verifier_that_cannot_be_run_soundly_is_refused_naming_the_file_and_key(meta, error):
    with pytest.raises(HarborSettingsError) as e:
        read_settings(meta, "t/task.toml")
    assert str(e.value).startswith("t/task.toml: ") and error in str(e.value), e.value


def test_what_a_separate_verifier_does_not_honour_is_named():
    s = read_settings({"artifacts": [{"source": "/app", "service": "db"}],
                       "verifier": {"environment": {"cpus": 4, "network_mode": "public"},
                                    "collect": [{"command": "x", "service": "db"}]}}, "t.toml")
    assert s.separate is not None and s.separate.artifacts == () and s.separate.collect == ()
    assert s.not_honoured == [
        "artifacts /app from service 'db' (only the agent's container runs here)",
        "[[verifier.collect]] in service 'db' (only the agent's container runs here)",
        "[verifier.environment] cpus (the grader's sandbox has the agent's limits)",
        "[verifier.environment] network_mode = 'public' (sandboxes have no network)"]
    shared = read_settings({"artifacts": ["/app"], "verifier": {"collect": [{"command": "x"}]}}, "t.toml")
    assert shared.separate is None and len(shared.not_honoured) == 2, shared.not_honoured


def test_the_check_refuses_a_malformed_separate_argument():
    with pytest.raises(ValueError, match="separate"):
        harbor_tests_verifier(None, {"files": {"test.sh": ""}, "separate": {"artifacts": [{"path": "/x"}]}})


def _tar(*members: tuple[str, str, str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        for name, kind, extra in members:
            info = tarfile.TarInfo(name)
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                t.addfile(info)
            elif kind in ("sym", "hard"):
                info.type, info.linkname = (tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE), extra
                t.addfile(info)
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
                t.addfile(info)
            else:
                info.size, info.mode = len(extra), 0o6755
                t.addfile(info, io.BytesIO(extra.encode()))
    return out.getvalue()


def test_confine_keeps_only_what_stays_inside_the_artifact():
    """Everything that would reach outside the artifact once extracted as root is dropped and named: absolute links,
    links that climb out, anything beneath a link, hard links, FIFOs, members outside the path or climbing out of it.
    Files, folders and links within the artifact stay; setuid and setgid bits go."""
    archive = _tar(("app", "dir", ""), ("app/answer.txt", "file", "hello"), ("app/abs", "sym", "/opt/grader/x"),
                   ("app/up", "sym", "../opt/grader/x"), ("app/same", "sym", "answer.txt"), ("app/d", "sym", "sub"),
                   ("app/d/evil", "file", "x"), ("app/hard", "hard", "app/answer.txt"), ("app/fifo", "fifo", ""),
                   ("etc/passwd", "file", "x"), ("app/../etc/shadow", "file", "x"))
    kept = confine(archive, "/app")
    assert kept.kept == 4 and len(kept.dropped) == 7, kept.dropped
    assert any("/app/abs (a link to /opt/grader/x: absolute)" == d for d in kept.dropped)
    assert any(d.startswith("/app/d/evil (beneath a link") for d in kept.dropped)
    members = {m.name: m for m in tarfile.open(fileobj=io.BytesIO(kept.archive))}
    assert set(members) == {"app", "app/answer.txt", "app/same", "app/d"}
    assert members["app/answer.txt"].mode == 0o755
    assert confine(_tar(("etc/x", "file", "y")), "/app").archive == b""  # nothing kept: nothing to extract
    with pytest.raises(ValueError, match="not a tar archive"):
        confine(b"garbage" * 100, "/app")


# --- in containers ----------------------------------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["root", "hardened"])
def test_harbor_check_oracle_1_noop_0_for_both_kinds_of_separate_verifier(mode):
    """`sandforge harbor check`: separate-verifier's oracle scores 1 only with the answer and the collect hook's
    listing in the verifier's own image; separate-same-image's only if /app arrived without its *.log file;
    separate-pytest's (a python base with pytest, mapped here) with its greeting."""
    from sandforge.job.harbor_check import check

    rows = check([SEPARATE, SAME_IMAGE, PYTEST], mode=mode)
    assert [(r.task, r.oracle, r.noop) for r in rows] == [("harbor/separate-verifier", 1.0, 0.0),
                                                         ("harbor/separate-same-image", 1.0, 0.0),
                                                         ("harbor/separate-pytest", 1.0, 0.0)], rows


@pytest.fixture(scope="module")
def images(docker_client) -> dict[str, str]:
    contexts = {}
    for folder in (SEPARATE, PYTEST):
        for mode in ("root", "hardened"):
            contexts |= {f"{name}-{mode}": ctx for name, ctx in load_tasks(folder, mode)[1].items()}
    return build_images([], client=docker_client, show_progress=False, contexts=contexts)


def _episode(mode: str, calls: list[ToolCall], images, run_id, client, folder: Path = SEPARATE):
    """One episode of the task at ``folder`` with a scripted policy, through the real agent loop and grading."""
    task = load_task(folder, mode)
    spec = sandbox_spec(SandboxConfig(), images[f"{task.image}-{mode}"], HarborEnv, task.sandbox, client)
    spec = replace(spec, grading=grading_spec(SandboxConfig(), images[f"{task.grading_image}-{mode}"], HarborEnv,
                                              task.sandbox, client))
    env = HarborEnv(task, spec, run_id, exec_timeout=30, client=client)
    scripted = replace(task, solution=[*calls, ToolCall("submit")])
    limits = EpisodeLimits(max_turns=len(calls) + 1, max_context=16384, max_new_tokens=4096, stop_ids=CHAT.stop_ids)
    traj = asyncio.run(run_episode(task, env, scripted_policy(scripted, CHAT), CHAT, limits, group="g"))
    assert not traj.failed, traj.failure
    return traj.reward


def bash(command: str) -> ToolCall:
    return ToolCall("bash", {"command": command})


HONEST = bash("echo 'hello separate' > /app/answer.txt")


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["root", "hardened"])
def test_a_link_to_the_graders_own_answer_is_not_passed_on(mode, images, run_id, docker_client):
    """The expected text lives at /opt/grader/expected.txt in the verifier's image. A policy that cannot know it makes
    its answer a link there (absolute, or climbing out of /app): extracted as it is, test.sh would compare the
    expected file with itself. The link is dropped and named; the honest answer scores 1."""
    assert _episode(mode, [HONEST], images, run_id, docker_client).value == 1.0
    for link in ("/opt/grader/expected.txt", "../opt/grader/expected.txt"):
        reward = _episode(mode, [bash(f"ln -sf {link} /app/answer.txt")], images, run_id, docker_client)
        assert reward.value == 0.0, reward.reason
        assert f"a link to {link}" in reward.reason and "not passed on" in reward.reason, reward.reason
    assert list_run_containers(run_id, docker_client) == []  # the graders' sandboxes went with the episodes


@pytest.mark.docker
def test_what_the_policy_leaves_outside_the_artifacts_never_reaches_the_grader(images, run_id, docker_client):
    """A root agent writes a perfect reward where the shared grader reads it, replaces the `cmp` test.sh calls with
    one that always agrees, and plants a listing beside the hook's: none of it is an artifact, so none of it is in
    the grader's sandbox, and without the answer the episode scores 0 (the same plants beside the honest answer still
    score 1)."""
    plants = bash("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && printf '#!/bin/sh\\nexit 0\\n' "
                  "> /usr/bin/cmp && echo answer.txt > /logs/artifacts/listing.txt.bak")
    reward = _episode("root", [plants], images, run_id, docker_client)
    assert reward.value == 0.0, reward.reason
    assert _episode("root", [plants, HONEST], images, run_id, docker_client).value == 1.0


# A conftest.py that turns every test's report into a pass: pytest collects it from the folder it runs in.
PASS_ALL = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["root", "hardened"])
def test_a_planted_conftest_never_reaches_a_separate_verifier(mode, images, run_id, docker_client, tmp_path):
    """separate-pytest's test.sh runs `pytest` from /app, so pytest collects /app/conftest.py. The policy plants one
    that passes every test and writes no greeting. Graded in the agent's own sandbox (the same task with its
    [verifier] table made shared: SECURITY.md lists this as not covered there) it scores 1; graded by the separate
    verifier, which receives only /app/greeting.txt, 0. The honest greeting scores 1 either way."""
    plant = ToolCall("write_file", {"path": "/app/conftest.py", "content": PASS_ALL})
    honest = bash("echo 'Hello, Harbor!' > /app/greeting.txt")
    assert _episode(mode, [honest], images, run_id, docker_client, PYTEST).value == 1.0
    reward = _episode(mode, [plant], images, run_id, docker_client, PYTEST)
    assert reward.value == 0.0, reward.reason
    if mode == "root":  # the attack is real: the same plant, graded where it was planted, passes
        shared = tmp_path / "shared-pytest"
        shutil.copytree(PYTEST, shared)
        toml = shared / "task.toml"
        toml.write_text(toml.read_text().replace('environment_mode = "separate"', 'environment_mode = "shared"')
                        .replace('artifacts = ["/app/greeting.txt"]', ""))
        [task], built = load_tasks(shared, mode)
        tags = build_images([], client=docker_client, show_progress=False, contexts=built)
        spec = sandbox_spec(SandboxConfig(), tags[task.image], HarborEnv, task.sandbox, docker_client)
        env = HarborEnv(task, spec, run_id, exec_timeout=30, client=docker_client)
        scripted = replace(task, solution=[plant, ToolCall("submit")])
        limits = EpisodeLimits(max_turns=2, max_context=16384, max_new_tokens=4096, stop_ids=CHAT.stop_ids)
        traj = asyncio.run(run_episode(task, env, scripted_policy(scripted, CHAT), CHAT, limits, group="g"))
        assert task.grading_image is None and traj.reward.value == 1.0, traj.reward.reason


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["root", "hardened"])
def test_an_artifact_too_large_to_carry_scores_zero_with_its_cause(mode, images, run_id, docker_client):
    """A 200 MiB sparse answer (under the sandbox's 256 MiB file size limit) costs the policy nothing to make and the
    host 200 MiB to carry: past the artifacts' 128 MiB cap the episode scores 0 with the cause too_large, and is not
    failed."""
    reward = _episode(mode, [bash("truncate -s 200M /app/answer.txt")], images, run_id, docker_client)
    assert (reward.value, reward.zero_causes) == (0.0, ["too_large"]), reward.reason


@pytest.mark.docker
def test_a_collect_hook_that_fails_on_what_the_policy_left_is_named_and_grading_goes_on(images, run_id,
                                                                                       docker_client):
    """The policy writes no answer: the hook's `ls -l /app/answer.txt` fails. Harbor runs the verifier whatever its
    hooks did; here too, and the reason names the hook."""
    reward = _episode("hardened", [bash("true")], images, run_id, docker_client)
    assert reward.value == 0.0 and "collect hook 0 exited 2" in reward.reason, reward.reason


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_separate_verifier_task_trains_for_one_step(tmp_path):
    """`sandforge train configs/harbor.yaml` on separate-verifier: the rollout worker's pool gives each episode's
    sandbox the grader's spec, the episodes are graded in the verifier's own sandbox, and one RL step is taken."""
    out = tmp_path / "run"
    overrides = ["trainer.steps=1", "warmup.steps=0", "rollout.workers=1", "rollout.concurrency=2",
                 "rollout.tasks_per_step=1", "rollout.group_size=2", "rollout.max_turns=2", "rollout.max_new_tokens=32",
                 "trainer.grad_accum_steps=1", "logging.wandb.mode=disabled", f"run.output_dir={out}",
                 f"environments.harbor.tasks={SEPARATE}"]
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "train", "configs/harbor.yaml", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and {r["task"]["id"] for r in rows} == {"harbor/separate-verifier"}
    assert all(not r["failed"] and r["reward"]["reason"].startswith("test.sh") for r in rows), rows[0]["failure"]
