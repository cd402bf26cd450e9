"""One fleet for every command: train, sft, eval and serve start their processes through job/fleet/lifecycle.py, so a change to
its set-up reaches all of them; its actors run at the driver's priority; and `sandforge eval` works on jobs whose
images are not a built-in environment's (Harbor tasks, a plugin's environment)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> Path:
    """An untrained k3-nano checkpoint with the shipped tokenizer: what `--checkpoint` and `serve` take."""
    import torch

    from sandforge.config import ModelConfig
    from sandforge.models.bpe import load_tokenizer
    from sandforge.models.build import build_policy, save_policy

    torch.manual_seed(0)
    tokenizer = load_tokenizer("bpe")
    directory = tmp_path_factory.mktemp("fleet") / "policy"
    save_policy(build_policy(ModelConfig(), len(tokenizer)), directory, tokenizer=tokenizer)
    return directory


def test_a_change_to_the_fleet_set_up_reaches_train_sft_eval_and_serve(tmp_path, tiny_policy, monkeypatch):
    """The set-up is changed once, in job/fleet/lifecycle.py (Ray refuses to start); every command runs into the change."""
    from typer.testing import CliRunner

    from sandforge.job.fleet import lifecycle as fleet
    from sandforge.job.cli import app
    from sandforge.job.console import JobError

    started = []

    def refuse(cfg):
        started.append(cfg.run.name)
        raise JobError(f"the fleet refused to start Ray for {cfg.run.name}")

    monkeypatch.setattr(fleet, "build_job_images", lambda cfg, sampler=None: {})  # no Docker needed to get as far as Ray
    monkeypatch.setattr(fleet, "start_ray", refuse)
    runner = CliRunner()
    out = f"run.output_dir={tmp_path / 'run'}"
    commands = {
        "train": ["train", "configs/terminal.yaml", out, "run.name=train-job"],
        "sft": ["sft", "configs/terminal.yaml", out, "run.name=sft-job", "warmup.steps=1"],
        "eval": ["eval", "configs/terminal.yaml", "run.name=eval-job", "--checkpoint", str(tiny_policy)],
        "serve": ["serve", str(tiny_policy), "--port", "0"],
    }
    for name, args in commands.items():
        result = runner.invoke(app, args)
        assert result.exit_code != 0, (name, result.output)
        assert f"error: the fleet refused to start Ray for {started[-1]}" in result.output, (name, result.output)
    assert started == ["train-job", "sft-job", "eval-job", "serve"]


def test_fleet_actors_run_at_the_drivers_priority(tiny_policy):
    """Ray starts its workers at nice 15 unless told otherwise: a trainer rank then loses most of a core to any normal
    process. A driver at nice 3 gets workers at nice 3."""
    script = textwrap.dedent(f"""
        import os, ray
        os.nice(3)
        from sandforge.config import JobConfig
        from sandforge.job.fleet.lifecycle import checkpoint_policy, open_fleet
        with open_fleet(JobConfig(), "nice-test", frozenset({{"engine"}}), policy=checkpoint_policy({str(tiny_policy)!r})):
            niceness = ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote())
        print("driver", os.nice(0), "worker", niceness)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-4:] == ["driver", "3", "worker", "3"], proc.stdout


def test_each_dead_run_reaped_at_start_up_is_named_on_a_line_of_its_own(monkeypatch, capsys):
    """Off a terminal the console is 80 columns wide: one line listing several reaped runs wrapped mid-list, so the
    line that starts "reaped" did not name the run a reader (or a chaos test) looked for."""
    from sandforge.config import load_config
    from sandforge.sandbox import daemon, images, lifecycle
    from sandforge.job.fleet import lifecycle as fleet

    dead = {"terminal-20261201-213527-ffe6d3": 1, "terminal-20261201-230108-509307": 2}
    monkeypatch.setattr(daemon, "docker_client", lambda: None)
    monkeypatch.setattr(lifecycle, "reap_dead_runs", lambda client: dead)
    monkeypatch.setattr(images, "build_images", lambda *args, **kwargs: {})
    fleet.build_job_images(load_config(ROOT / "configs/terminal.yaml", []))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("reaped")]
    assert lines == [f"reaped {n} container(s) of dead run {run}" for run, n in dead.items()]


def _eval(config: str, policy: Path, out: Path, *overrides: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "eval", config, *overrides, "eval.samples=2",
                           "--checkpoint", str(policy), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.docker
def test_eval_runs_held_out_harbor_tasks_in_their_own_images(tmp_path, tiny_policy, docker_client):
    """A Harbor job's images are its tasks' own Dockerfiles: eval builds them as a training run does."""
    tasks = tmp_path / "tasks"
    for name in ("hello-file", "count-lines"):
        shutil.copytree(ROOT / "tests/data/harbor" / name, tasks / name)
        toml = tasks / name / "task.toml"
        toml.write_text(toml.read_text().replace("[metadata]\n", '[metadata]\nsplit = "heldout"\n'))
    summary = _eval("configs/harbor.yaml", tiny_policy, tmp_path / "eval.json", f"environments=[{{name: harbor, "
                    f"tasks: {tasks}}}]", "eval.tasks_per_family=1", "rollout.max_turns=2", "rollout.max_new_tokens=32")
    harbor = summary["per_env"]["harbor"]
    assert (harbor["tasks"], harbor["episodes"], harbor["failed"]) == (2, 4, 0), summary
    assert summary["checkpoint"] == str(tiny_policy)


@pytest.mark.docker
def test_eval_runs_a_plugin_environment_in_its_own_image(tmp_path, tiny_policy, docker_client):
    """The example plugin (examples/plugin_env, installed by scripts/test.sh) brings its own Dockerfile."""
    from sandforge.registry import environments

    if "notes" not in environments():
        pytest.skip("the example plugin is not installed (scripts/test.sh installs it)")
    summary = _eval("examples/plugin_env/config.yaml", tiny_policy, tmp_path / "eval.json", "eval.tasks_per_family=1",
                    "rollout.max_turns=2", "rollout.max_new_tokens=32")
    notes = summary["per_env"]["notes"]
    assert notes["tasks"] >= 1 and notes["episodes"] == 2 * notes["tasks"] and notes["failed"] == 0, summary
