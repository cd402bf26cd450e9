"""`sandforge harbor check` as Harbor runs a task (#33 items 5 and 6), on the task shapes of tests/data/harbor/shapes:

- oracle-as-harbor: a Perl solve.sh, which only runs when executed as a file (its shebang), that needs
  DEBIAN_FRONTEND=noninteractive and /logs/agent as Harbor gives them, and puts a key in ``~/.ssh`` (the agent's own
  home, not the WORKDIR);
- unmapped-base: FROM an image of a private registry nobody here has, which ``--set sandbox.base_map=...`` maps;
- serve-on-port: graded on a service the agent leaves running. Root mode keeps it; hardened mode stops every process
  of the policy before grading (a security invariant), so the oracle's 0 there says why in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandforge.config import ConfigError
from sandforge.environments.harbor.tasks import load_task, replay_command
from sandforge.job.harbor_check import ORACLE_ENV, check, check_task, oracle_command, sandbox_settings
from sandforge.types import PolicyStop, Reward, Task

SHAPES = Path(__file__).resolve().parent / "data" / "harbor" / "shapes"
TOOLBOX_MAP = 'sandbox.base_map={"team/toolbox:*": base}'


# --- no Docker --------------------------------------------------------------------------------------------------------


def test_harbor_check_takes_sandbox_settings_from_set_and_from_a_job():
    assert sandbox_settings().base_map is None and sandbox_settings().warm_pool == 0
    cfg = sandbox_settings(None, [TOOLBOX_MAP, "sandbox.memory=1g"])
    assert (cfg.base_map, cfg.memory, cfg.warm_pool) == ({"team/toolbox:*": "base"}, "1g", 0)
    with pytest.raises(ConfigError, match=r"harbor check \(with command-line overrides\): invalid value for "
                                          r"'sandbox.base_map.toolbox:\*'"):
        sandbox_settings(None, ['sandbox.base_map={"toolbox:*": ubuntu}'])
    with pytest.raises(ConfigError, match=r"unknown key 'sandbox.memroy' \(did you mean 'memory'\?\)"):
        sandbox_settings(None, ["sandbox.memroy=1g"])
    with pytest.raises(ConfigError, match=r"--set 'trainer.steps=2': harbor check takes sandbox settings only"):
        sandbox_settings(None, ["trainer.steps=2"])
    job = sandbox_settings(Path(__file__).resolve().parents[1] / "configs" / "harbor.yaml", ["sandbox.cpus=2"])
    assert job.cpus == 2.0 and job.warm_pool == 0


def test_the_oracle_command_runs_solve_sh_as_a_file_with_harbors_env_and_log():
    command = oracle_command({"TOKEN": "a b", "DEBIAN_FRONTEND": "readline"})
    assert command.splitlines() == [
        "export DEBIAN_FRONTEND=readline TOKEN='a b'",  # [solution] env wins over Harbor's default
        "/solution/solve.sh > /logs/agent/oracle.txt 2>&1; rc=$?",
        "tail -c 4000 /logs/agent/oracle.txt; exit $rc"]
    assert oracle_command({}).startswith("export DEBIAN_FRONTEND=noninteractive\n") and ORACLE_ENV


def test_a_hardened_agents_home_is_its_own_and_a_root_agents_is_roots():
    """HOME was the WORKDIR for a non-root agent, so `ssh-keygen -f ~/.ssh/id_rsa` wrote into /app/.ssh."""
    hardened = load_task(SHAPES / "oracle-as-harbor", "hardened").sandbox
    assert hardened.home == "/home/sandbox" and "/home/sandbox" in hardened.scratch
    assert load_task(SHAPES / "oracle-as-harbor", "root").sandbox.home is None  # job_spec: root's /root


def test_the_warm_start_replays_a_solve_sh_by_its_shebang():
    perl = load_task(SHAPES / "oracle-as-harbor").solution[0].arguments["command"]
    text = (SHAPES / "oracle-as-harbor" / "solution" / "solve.sh").read_text()
    assert perl == f"/usr/bin/perl <<'SANDFORGE_SOLVE_EOF'\n{text.rstrip()}\nSANDFORGE_SOLVE_EOF"
    python = replay_command("#!/usr/bin/env python3\nprint(1)\n")
    assert python.startswith("/usr/bin/env python3 <<'SANDFORGE_SOLVE_EOF'\n#!/usr/bin/env python3\nprint(1)\n")
    for shell in ("#!/bin/bash\necho hi\n", "#!/usr/bin/env -S bash -e\necho hi\n", "echo no shebang\n",
                  "#!/bin/sh\necho hi\n"):
        assert replay_command(shell) == shell  # a shell script is typed as it is
    assert replay_command("#!/usr/bin/perl\nprint 'SANDFORGE_SOLVE_EOF';\n").startswith("#!/usr/bin/perl")


class _StoppedService:
    """A sandbox whose policy stop found a service; its one check scores 0 (or 1)."""

    workdir = "/app"

    def __init__(self, ports):
        self.ports = ports

    def stop_policy(self) -> PolicyStop:
        return PolicyStop(killed=2, listening=self.ports)


def test_a_zero_with_a_stopped_service_says_why_and_counts_it(monkeypatch):
    from sandforge.job.rollout_metrics import rollout_metrics
    from sandforge.types import Trajectory
    from sandforge.verifiers import checks

    score = {"value": 0.0}
    monkeypatch.setitem(checks.VERIFIERS, "probe", lambda sandbox, args: (score["value"], "reply: none"))
    task = Task(id="t", env="harbor", family="service", seed=0, instruction="serve", checks=[{"verifier": "probe"}])
    zero = checks.score_task(_StoppedService((8000,)), task)
    assert zero.value == 0.0 and zero.zero_causes == ["service_stopped"]
    assert zero.reason.startswith("reply: none; the policy's service on port 8000 was stopped before grading")
    assert "cannot score in this mode: run it as root" in zero.reason
    metrics = rollout_metrics([Trajectory(task=task, group="g", reward=zero)])
    assert metrics["reward/zero_service_stopped"] == 1
    score["value"] = 1.0  # a task that scored anyway: nothing to explain
    one = checks.score_task(_StoppedService((8000,)), task)
    assert one.reason == "reply: none" and one.zero_causes == []
    score["value"] = 0.0
    assert checks.score_task(_StoppedService(()), task).reason == "reply: none"  # no service, no note


def test_harbor_check_flags_a_reward_file_that_is_not_a_reward():
    """#56: a test.sh whose metric the answer drives out of [0, 1] scores 0 in training; the check's row says which
    run wrote it."""
    from test_harbor import RewardSandbox

    from sandforge.job.harbor_check import malformed_note
    from sandforge.verifiers.checks import score_task

    task = Task(id="t", env="harbor", family="f", seed=0, instruction="",
                checks=[{"verifier": "harbor_tests", "files": {"test.sh": "true"}, "timeout": 5}])
    note = malformed_note("noop", score_task(RewardSandbox({"reward.json": '{"r2": -0.4}'}), task))
    assert note.startswith("noop: test.sh wrote a reward that is not one, trained on as 0") and "-0.4" in note
    assert malformed_note("oracle", score_task(RewardSandbox({"reward.txt": "1"}), task)) is None


def test_named_rewards_become_curves_of_their_own():
    from sandforge.job.rollout_metrics import rollout_metrics
    from sandforge.types import Trajectory

    task = Task(id="t", env="harbor", family="f", seed=0, instruction="", checks=[{"verifier": "harbor_tests"}])
    rewards = [{"correctness": 1.0, "performance": 0.0}, {"correctness": 1.0, "performance": 1.0}]
    trajs = [Trajectory(task=task, group="g", reward=Reward(value=sum(r.values()) / 2, success=False, breakdown={
        "harbor_tests:0": sum(r.values()) / 2, **{f"harbor_tests:0/{k}": v for k, v in r.items()}})) for r in rewards]
    m = rollout_metrics(trajs)
    assert (m["reward/harbor/correctness"], m["reward/harbor/performance"]) == (1.0, 0.5)
    plain = Task(id="p", env="terminal", family="f", seed=0, instruction="", checks=[{"verifier": "rubric"}])
    m = rollout_metrics([Trajectory(task=plain, group="g", reward=Reward(1.0, True, {"rubric:0": 1.0,
                                                                                   "rubric:0/item": 1.0}))])
    assert not any(k.startswith("reward/terminal/") for k in m)  # a rubric's items are not named rewards


def test_the_jobs_reward_rule_reaches_training_and_held_out_tasks(tmp_path):
    from sandforge.config import EnvironmentConfig
    from sandforge.job.evaluation import heldout_tasks
    from sandforge.job.task_sampler import TaskSampler

    tasks = Path(__file__).resolve().parent / "data" / "harbor" / "harbor-0.25"
    env = EnvironmentConfig(name="harbor", tasks=tasks, reward_rule="min")
    drawn = TaskSampler([env], seed=0).sample(4)
    assert {c["reward"] for t in drawn for c in t.checks} == {"min"}
    held = heldout_tasks([EnvironmentConfig(name="harbor", tasks=tasks, heldout=1.0, reward_rule="correctness")], 8)
    assert held and {c["reward"] for t in held for c in t.checks} == {"correctness"}
    default = TaskSampler([EnvironmentConfig(name="harbor", tasks=tasks)], seed=0).sample(2)
    assert all("reward" not in c for t in default for c in t.checks)  # auto, the check's own default


# --- in containers ----------------------------------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["root", "hardened"])
def test_the_oracle_runs_as_harbor_runs_it(mode):
    """A Perl solve.sh scores 1 only when executed as a file with DEBIAN_FRONTEND=noninteractive, a writable
    /logs/agent and HOME the agent's own home (`bash /solution/solve.sh` failed on line 1; a hardened HOME was the
    WORKDIR, where test.sh does not look for ~/.ssh); the no-op scores 0."""
    [row] = check([SHAPES / "oracle-as-harbor"], mode=mode)
    assert (row.oracle, row.noop) == (1.0, 0.0), row


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["root", "hardened"])
def test_harbors_own_template_grades_offline_unmodified(mode):
    """#58: Harbor's `harbor tasks init` test.sh stopped offline at `apt-get update` (set -e), and had it gone on,
    `uvx --with pytest==8.4.1 ... pytest` ran `pytest==8.4.1` and exited 127: every such task scored 0 even with
    pytest in its image. The oracle scores 1 and the no-op 0, the task as Harbor's template writes it."""
    [row] = check([SHAPES / "harbor-template"], mode=mode)
    assert (row.oracle, row.noop) == (1.0, 0.0), row


@pytest.mark.docker
def test_harbor_check_set_maps_a_base_it_does_not_know():
    """Without a mapping the row says how to add one; `--set sandbox.base_map=...` on the command line builds the
    task on the local base, and its oracle scores 1 and the no-op 0."""
    unmapped = check_task(SHAPES / "unmapped-base", "root", None, sandbox_settings(), client=_client(), run_id="t")
    assert unmapped.image == "-" and unmapped.oracle is None, unmapped
    assert ("base image registry.sandforge-test.invalid/team/toolbox:3 is not on this host, cannot be pulled, and "
            "sandbox.base_map maps nothing to it") in unmapped.reason, unmapped
    assert "harbor check --set 'sandbox.base_map={\"team/toolbox:*\": base}'" in unmapped.reason, unmapped
    sandforge = Path(sys.executable).parent / "sandforge"
    out = subprocess.run([str(sandforge), "harbor", "check", str(SHAPES / "unmapped-base"), "--set", TOOLBOX_MAP],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "250"})
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "Harbor tasks: 1/1 fine" in text, text
    assert "FROM registry.sandforge-test.invalid/team/toolbox:3 is not here; built on" in " ".join(text.split()), text
    bad = subprocess.run([str(sandforge), "harbor", "check", str(SHAPES / "unmapped-base"), "--set",
                          "sandbox.base_map=[base]"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid value for 'sandbox.base_map'" in bad.stderr, bad.stderr


@pytest.mark.docker
def test_a_service_left_running_scores_as_root_and_says_why_it_cannot_hardened():
    """Root mode grades the oracle's pong server (1; no-op 0). Hardened, the policy stop ends it before test.sh: the
    oracle's 0 names the port and the mode, not a bare "reward 0"."""
    [root] = check([SHAPES / "serve-on-port"], mode="root")
    assert (root.oracle, root.noop) == (1.0, 0.0), root
    [hardened] = check([SHAPES / "serve-on-port"], mode="hardened")
    assert (hardened.oracle, hardened.noop) == (0.0, 0.0), hardened
    assert "the policy's service on port 8000 was stopped before grading" in hardened.reason, hardened
    assert "cannot score in this mode" in hardened.reason, hardened


def _client():
    from sandforge.sandbox.daemon import docker_client

    return docker_client()


def test_the_warm_starts_hint_follows_how_the_replay_ended():
    """It always asked whether rollout.max_turns was too short, even for a replay that ended because solve.sh read a
    file beside it in /solution."""
    from types import SimpleNamespace

    from sandforge.job.cold_start import replay_hint
    from sandforge.types import Trajectory, Turn

    task = load_task(SHAPES / "oracle-as-harbor")
    rollout = SimpleNamespace(max_turns=3, max_context=2048)

    def ended(reason: str, output: str = "") -> Trajectory:
        turn = Turn(index=0, prompt_tokens=0, generated_tokens=0, observation_tokens=0, finish_reason="stop",
                    tool_calls=[task.solution[0]], observations=[output])
        return Trajectory(task=task, group="g", turns=[turn], finish_reason=reason)

    assert replay_hint([ended("max_turns")], rollout) == ("; is rollout.max_turns (3, or the environment's own "
                                                          "max_turns) shorter than its reference solution?")
    assert "rollout.max_context (2048 tokens)" in replay_hint([ended("context")], rollout)
    missing = ended("submit", "cp: cannot stat '/solution/files/patch.diff': No such file or directory")
    assert "reads files beside solve.sh in /solution" in replay_hint([missing], rollout)
    assert "sandforge harbor check" in replay_hint([missing], rollout)
    assert replay_hint([ended("submit", "wrong answer")], rollout) == ""


@pytest.mark.docker
def test_the_warm_starts_replay_of_a_solution_folder_writes_every_file_as_it_is(tmp_path, terminal_image, run_id,
                                                                              docker_client):
    """#58: a solve.sh that runs the files beside it works only from /solution; the warm start types the whole folder
    there through the bash tool (text as here-documents, other bytes as base64, nested folders, the executable bit)
    and runs solve.sh as a file with its [solution] env. The bytes that land are the folder's."""
    from sandforge.environments.harbor.tasks import replay_solution
    from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec

    folder = tmp_path / "solution"
    (folder / "data").mkdir(parents=True)
    files = {"solve.sh": b'#!/bin/bash\nset -eu\ncd "$(dirname "$0")"\n./data/run.sh > /tmp/said.txt\necho "$TOKEN"\n',
             "data/run.sh": b"#!/bin/sh\necho ran from $(pwd)\n", "data/blob.bin": bytes(range(256)) * 3,
             "notes.txt": b"no newline at the end", "marker.txt": b"SANDFORGE_FILE_EOF\n"}
    for rel, data in files.items():
        (folder / rel).write_bytes(data)
    (folder / "data" / "run.sh").chmod(0o755)
    assert replay_solution(folder, {}) != replay_solution(folder, {"TOKEN": "x"})
    command = replay_solution(folder, {"TOKEN": "a b"})
    with DockerSandbox.create(SandboxSpec(image=terminal_image, read_only=False), run_id, client=docker_client) as box:
        ran = box.exec(command, user="root", session=False, timeout=30)
        assert ran.exit_code == 0 and ran.output.strip().endswith("a b"), ran.output
        for rel, data in files.items():
            assert box.get_file(f"/solution/{rel}", user="root") == data, rel
        assert box.read_file("/tmp/said.txt", user="root") == "ran from /solution\n"
        said = box.exec("export | grep -c TOKEN || true", user="root", session=False).output.strip()
        assert said == "0"  # the [solution] env ended with solve.sh's subshell
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "solve.sh").write_text("echo hi > /app/out.txt\n")
    assert replay_solution(alone, {}) == replay_command("echo hi > /app/out.txt\n")  # what a policy types
