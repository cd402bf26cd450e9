import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandforge.config import ConfigError, apply_override, load_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_quickstart_loads_with_dotted_overrides():
    cfg = load_config(QUICKSTART, ["trainer.steps=2", "run.output_dir=/tmp/sf-x", "rollout.temperature=0.7"])
    assert cfg.trainer.steps == 2
    assert str(cfg.run.output_dir) == "/tmp/sf-x"
    assert cfg.rollout.temperature == 0.7
    assert cfg.logging.wandb.mode == "offline"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("trainer:\n  stpes: 2\n", "unknown key 'trainer.stpes' (did you mean 'steps'?)"),
        ("trainer:\n  steps: many\n", "invalid value for 'trainer.steps'"),
        ("environments:\n  - name: terminal\n    familes: [x]\n", "unknown key 'environments[0].familes'"),
        ("rollout:\n  group_size: 0\n", "invalid value for 'rollout.group_size'"),
        ("colour: blue\n", "unknown key 'colour'"),
        ("model:\n  arch: moe\n", "invalid value for 'model.arch'"),
        ("model:\n  init_from: /does/not/exist\n", "'model.init_from'"),
        ("trainer: [1, 2\n", "is not valid YAML"),
        ("environments:\n  - name: verifiers\n", "the verifiers environment needs `id`"),
        ("environments:\n  - name: terminal\n    id: reverse_words\n", "the 'terminal' environment takes neither"),
        ("environments:\n  - name: verifiers\n    id: x\n    families: [a]\n", "not `tasks` or `families`"),
    ],
)
def test_bad_configs_name_the_key_and_file(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert needle in message
    assert str(path) in message
    assert "\n" not in message


def test_bad_override_is_reported_as_an_override(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'trainer.setps'.*did you mean 'steps'"):
        load_config(QUICKSTART, ["trainer.setps=2"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(QUICKSTART, ["trainer.steps"])


def test_override_parses_yaml_values():
    raw: dict = {}
    apply_override(raw, "a.b=2")
    apply_override(raw, "a.c=[x, y]")
    apply_override(raw, "d=null")
    assert raw == {"a": {"b": 2, "c": ["x", "y"]}, "d": None}


def test_override_reaches_a_list_item_by_position_or_name():
    cfg = load_config(QUICKSTART, ["environments.browser.eval_tasks_per_family=1", "environments.0.weight=3"])
    by_name = {env.name: env for env in cfg.environments}
    assert by_name["browser"].eval_tasks_per_family == 1 and cfg.environments[0].weight == 3
    assert by_name["repo"].eval_tasks_per_family == 2  # the others as the file has them
    for override, needle in [("environments.nowhere.weight=2", "no item is named 'nowhere'.*terminal, repo"),
                             ("environments.9.weight=2", "has 5 item"),
                             ("environments.weight=2", "is a list; name an item of it")]:
        with pytest.raises(ConfigError, match=needle):
            load_config(QUICKSTART, [override])


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", "configs/quickstart.yaml", "trainer.stepz=2"], "trainer.stepz"),
        (["train", "configs/quickstart.yaml", "trainer.steps=two"], "trainer.steps"),
        (["train", "configs/missing.yaml"], "config file not found: configs/missing.yaml"),
        (["train", "configs/quickstart.yaml", "environments=[{name: nowhere}]"], "unknown environment 'nowhere'"),
        (["train", "configs/quickstart.yaml", "environments=[{name: terminal, families: [juggle]}]"], "juggle"),
        (["train", "configs/k3-scratch.yaml", "model.k3={d_modle: 64}"], "configs/k3-scratch.yaml: model.k3.d_modle"),
    ],
)
def test_cli_fails_fast_with_one_line(args, needle):
    """A bad config must fail before Ray, Docker or torch start: one line on stderr, non-zero exit, in seconds."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", *args], cwd=ROOT, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert elapsed < 5, f"config error took {elapsed:.1f}s"
