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
from sandforge.sandbox.docker_sandbox import SandboxSpec
from sandforge.models.chat import ChatFormat
from sandforge.models.tokenizer import ByteTokenizer
from sandforge.rollout.agent import run_episode
from sandforge.rollout.episode import EpisodeLimits
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


CARDS = '''"""A plugin whose tasks come as a folder of its own format: one ``<name>.card`` file per task, its first line the
family, the rest the answer to write. Its sandboxes run the terminal env and image."""

from pathlib import Path

from sandforge.environments.task_sources import TaskSourceError
from sandforge.types import Task, ToolCall

ENVIRONMENT = {"env": "sandforge.environments.terminal.env:TerminalEnv", "tasks": "cards_env", "image": "terminal",
               "folder_loader": "cards_env:load_cards"}
DOTTED = {**ENVIRONMENT, "folder_loader": "cards_env.load_cards"}
FAMILIES = {}  # no seeded tasks: cards only
ANSWER = "/workspace/answer.txt"


def load_cards(path: Path, mode: str, heldout: float):
    if not path.is_dir():
        raise TaskSourceError(f"{path}: cards come as a folder of .card files")
    tasks = []
    for card in sorted(path.glob("*.card")):
        family, answer = card.read_text().split("\\n", 1)
        tasks.append(Task(id=f"cards/{card.stem}", env="cards", family=family, seed=0,
                          instruction=f"Write {answer!r} to {ANSWER}.",
                          checks=[{"verifier": "file_equals", "path": ANSWER, "content": answer}],
                          solution=[ToolCall("write_file", {"path": ANSWER, "content": answer}), ToolCall("submit")],
                          split="heldout" if card.stem.startswith("held") else "train"))
    return tasks, {}
'''


@pytest.fixture
def cards_plugin(tmp_path, monkeypatch):
    """An installed plugin as pip leaves one: a package and a dist-info folder declaring its entry point."""
    site = tmp_path / "site"
    (site / "cards_env").mkdir(parents=True)
    (site / "cards_env" / "__init__.py").write_text(CARDS)
    info = site / "cards_env-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cards-env\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENVIRONMENT_GROUP}]\ncards = cards_env:ENVIRONMENT\n")
    monkeypatch.syspath_prepend(str(site))
    deck = tmp_path / "deck"
    deck.mkdir()
    for name, text in {"a": "greet\nhello", "b": "greet\nhi there", "c": "count\n3", "held-d": "greet\nmoi"}.items():
        (deck / f"{name}.card").write_text(text)
    yield deck
    sys.modules.pop("cards_env", None)


def test_a_plugin_brings_its_own_task_folder_format(cards_plugin, tmp_path):
    """A job's `tasks:` folder in the plugin's format is read by the plugin's folder loader, as Harbor's is by its."""
    from importlib.metadata import EntryPoint

    import gymnasium

    from sandforge.config import load_config
    from sandforge.environments.gym_registry import register_environments
    from sandforge.environments.task_sources import open_source
    from sandforge.job.task_sampler import TaskSampler

    deck = cards_plugin
    entry = registry.environment("cards")
    assert (entry.source, entry.folder_loader) == ("plugin cards-env 0.1", "cards_env:load_cards")
    with pytest.raises(registry.PluginError, match=r"'folder_loader' must name a function as 'module:function'"):
        registry._plugin(EntryPoint(name="cards", value="cards_env:DOTTED", group=registry.ENVIRONMENT_GROUP))
    config = tmp_path / "job.yaml"
    config.write_text(f"environments:\n  - name: cards\n    tasks: {deck}\n    families: [greet]\n")
    sampler = TaskSampler(load_config(config).environments, seed=0)
    assert {t.id for t in sampler.sample(30)} == {"cards/a", "cards/b"}
    assert {t.id for t in sampler.sample(10, "heldout")} == {"cards/held-d"}
    assert sampler.sample(1)[0].checks[0]["content"] in {"hello", "hi there"}
    source = open_source(entry, deck)
    assert source.families() == ["count", "greet"] and (source.count("train"), source.count("heldout")) == (3, 1)

    # what the folder loader says of a path it does not read, and what an env without one says of the folder
    config.write_text(f"environments:\n  - name: cards\n    tasks: {config}\n")
    with pytest.raises(ValueError, match=r"environments\[0\].tasks: .*job.yaml: cards come as a folder of .card"):
        TaskSampler(load_config(config).environments, seed=0)
    with pytest.raises(ValueError, match=r"a directory of tasks runs in the 'harbor' or 'cards' environment, not "
                                         r"'terminal'"):
        open_source(registry.environment("terminal"), deck)

    # gymnasium: a task folder of the format makes the plugin's env, as a Harbor task directory makes Harbor-v0's
    one = tmp_path / "one"
    one.mkdir()
    (one / "x.card").write_text("greet\nhey")
    env_id = register_environments()["cards"]
    try:
        env = gymnasium.make(env_id, task=str(one), image="unused").unwrapped
        assert env.task.id == "cards/x" and env.task.checks[0]["content"] == "hey"
        with pytest.raises(ValueError, match="holds 4 tasks; make one env per task directory"):
            gymnasium.make(env_id, task=str(deck), image="unused")
    finally:
        gymnasium.registry.pop(env_id, None)


def test_a_task_module_needs_only_families_and_a_make_task_of_its_own_still_counts(tmp_path, monkeypatch):
    """The entry looks a family up in FAMILIES (one error for an unknown one); a plugin written when task modules
    had to define ``make_task`` keeps its own."""
    from importlib.metadata import EntryPoint

    (tmp_path / "bare_env.py").write_text('SPEC = {"env": "bare_env:E", "tasks": "bare_env"}\n'
                                          'FAMILIES = {"echo": lambda seed, split="train": ("echo", seed, split)}\n')
    (tmp_path / "old_env.py").write_text('SPEC = {"env": "old_env:E", "tasks": "old_env"}\nFAMILIES = {"echo": None}\n'
                                         'def make_task(family, seed, split="train"):\n    return ("own", seed)\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    bare = registry._plugin(EntryPoint(name="bare", value="bare_env:SPEC", group=registry.ENVIRONMENT_GROUP))
    old = registry._plugin(EntryPoint(name="old", value="old_env:SPEC", group=registry.ENVIRONMENT_GROUP))
    try:
        assert bare.make_task()("echo", 3, "heldout") == ("echo", 3, "heldout")
        with pytest.raises(ValueError, match="unknown bare task family 'nope': use one of echo"):
            bare.make_task()("nope", 1)
        assert old.make_task()("echo", 3) == ("own", 3)
    finally:
        for name in ("bare_env", "old_env"):
            sys.modules.pop(name, None)
