"""Plugins: examples/plugin_env is a pip package of its own; once installed, its environment and its verifier are
found through the entry-point groups and train like built-ins.

The package is installed here with ``pip install --target`` into a temporary folder on the path, so the test needs
no write access to the environment and always installs the example as it is now (scripts/test.sh also installs it
into the venv, for users' `sandforge envs list`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandforge import registry
from sandforge.environments.sandbox.docker_sandbox import SandboxSpec
from sandforge.models.chat import ChatFormat
from sandforge.models.tokenizer import ByteTokenizer
from sandforge.rollout.agent import EpisodeLimits, run_episode
from sandforge.rollout.policy_client import scripted_policy
from sandforge.types import ToolCall

ROOT = Path(__file__).resolve().parents[1]
CHAT = ChatFormat(ByteTokenizer())


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """The example installed from its own folder (a copy, so the build leaves nothing in the repository)."""
    tmp = tmp_path_factory.mktemp("plugin")
    src = shutil.copytree(ROOT / "examples" / "plugin_env", tmp / "src")
    target = tmp / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(src)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return target


@pytest.fixture
def plugin_installed(plugin_path, monkeypatch):
    """This process sees the plugin (entry points are read from sys.path); subprocesses get it via PYTHONPATH."""
    monkeypatch.syspath_prepend(str(plugin_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(plugin_path), os.environ.get("PYTHONPATH")])))
    registry.verifier_plugins.cache_clear()
    yield plugin_path
    registry.verifier_plugins.cache_clear()
    for name in [m for m in sys.modules if m.startswith("sandforge_notes_env")]:
        del sys.modules[name]


def test_an_unknown_environment_names_the_known_ones_and_the_plugin_group():
    with pytest.raises(KeyError, match="unknown environment 'nope'; known: .*harbor, .*terminal.*sandforge.environments"):
        registry.environment("nope")


def test_the_installed_plugin_registers_its_environment_and_verifier(plugin_installed):
    entry = registry.environment("notes")
    assert entry.source == "plugin sandforge-notes-env 0.1.0"
    assert entry.families() == ["add_notes"] and entry.image_name == "terminal"
    assert entry.image_context() == registry.environment("terminal").image_context()
    assert callable(registry.find_verifier("notes_equal")) and registry.find_verifier("nope") is None
    schema = {t["name"]: t for t in entry.env_class()(entry.make_task()("add_notes", 1), None, "r").tools}
    # the plugin's Args section reached the tool schema
    assert schema["add_note"]["parameters"]["properties"]["text"]["description"] == "the note, a single line."


@pytest.mark.docker
def test_plugin_tasks_score_through_the_plugin_verifier(plugin_installed, terminal_image, run_id, docker_client):
    entry = registry.environment("notes")
    task = entry.make_task()("add_notes", 7)
    limits = EpisodeLimits(max_turns=6, max_context=8192, max_new_tokens=512, stop_ids=CHAT.stop_ids)
    env = entry.env_class()(task, SandboxSpec(image=terminal_image), run_id, client=docker_client)
    solved = asyncio.run(run_episode(task, env, scripted_policy(task, CHAT), CHAT, limits, "g"))
    assert not solved.failed, solved.failure
    assert (solved.reward.value, solved.reward.reason) == (1.0, "notes match")
    lazy = type(task)(**{**task.__dict__, "solution": [ToolCall("add_note", {"text": "wrong"}), ToolCall("submit")]})
    wrong = asyncio.run(run_episode(task, env, scripted_policy(lazy, CHAT), CHAT, limits, "g"))
    assert not wrong.failed and wrong.reward.value < 1.0 and "expected" in wrong.reward.reason


def test_envs_list_shows_the_plugin(plugin_installed):
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "envs", "list"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert "plugin sandforge-notes-env 0.1.0" in rows["notes"] and "add_notes" in rows["notes"]
    assert "train seeded, heldout seeded" in rows["notes"] and rows["notes"].endswith("sandforge/terminal")


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_training_step_on_the_plugin_env(plugin_installed, terminal_image, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "train", "examples/plugin_env/config.yaml",
                           "trainer.steps=1", f"run.output_dir={out}", "rollout.tasks_per_step=1",
                           "rollout.max_turns=2", "rollout.max_new_tokens=32", "logging.wandb.mode=disabled"],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["task"]["env"] == "notes" and not r["failed"] for r in rows), rows[0]["failure"]
    assert all(r["task"]["checks"][0]["verifier"] == "notes_equal" for r in rows)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m.get("phase") == "rl"] == [0]


def test_a_plugin_with_its_own_dockerfile_and_broken_plugins(tmp_path, monkeypatch):
    """Entry points as a plugin declares them: an image from the plugin's own package; wrong shapes name the plugin."""
    from importlib.metadata import EntryPoint

    package = tmp_path / "own_image_env"
    package.mkdir()
    (package / "__init__.py").write_text('SPEC = {"env": "own_image_env.env:E", "tasks": "own_image_env.tasks"}\n'
                                         'BAD = {"env": "own_image_env.env:E"}\nREUSE = {**SPEC, "image": "nope"}\n'
                                         'SLACK = {**SPEC, "image": "slack"}\n')
    (package / "Dockerfile").write_text("FROM scratch\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def entry(value: str) -> EntryPoint:
        return EntryPoint(name="own", value=value, group=registry.ENVIRONMENT_GROUP)

    own = registry._plugin(entry("own_image_env:SPEC"))
    assert (own.image_name, own.image_context()) == ("own", package)
    slack = registry._plugin(entry("own_image_env:SLACK"))  # slack's image is the mock apps' shared one
    assert (slack.image_name, slack.image_context()) == ("apps", registry.environment("slack").image_context())
    with pytest.raises(registry.PluginError, match=r"entry point 'own' \(own_image_env:BAD\).*must be a dict with"):
        registry._plugin(entry("own_image_env:BAD"))
    with pytest.raises(registry.PluginError, match=r"'image' 'nope' is not a built-in env"):
        registry._plugin(entry("own_image_env:REUSE"))
    with pytest.raises(registry.PluginError, match=r"\(missing_module:SPEC\).*cannot be loaded: ModuleNotFoundError"):
        registry._plugin(entry("missing_module:SPEC"))
