"""Task sources: seeded generators, JSONL files and Harbor folders behind one interface, chosen from the job config."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from seeded import terminal_task as make_task

from sandforge import registry
from sandforge.config import ConfigError, load_config
from sandforge.environments.task_sources import FiniteSource, TaskSourceError, load_jsonl, open_source
from seeded import dump_jsonl
from sandforge.registry import environment
from sandforge.job.task_sampler import TaskSampler, with_partial_credit
from sandforge.types import Task

ROOT = Path(__file__).resolve().parents[1]
HARBOR = ROOT / "tests" / "data" / "harbor"


@pytest.fixture
def jsonl(tmp_path) -> Path:
    """Six terminal tasks frozen as JSON lines: four train, two held-out, two families."""
    tasks = [make_task("write_file", s) for s in range(2)] + [make_task("count_words", s) for s in range(2)]
    tasks += [make_task("write_file", s, "heldout") for s in range(2)]
    path = tmp_path / "tasks.jsonl"
    dump_jsonl(tasks, path)
    return path


def _config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(body)
    return path


def test_jsonl_round_trips_tasks_exactly(jsonl):
    tasks = load_jsonl(jsonl, env="terminal")
    assert [asdict(t) for t in tasks] == [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert tasks[0] == make_task("write_file", 0)


@pytest.mark.parametrize("line, error", [
    ('{"id": "a", "env": "terminal"', r"line 2: not valid JSON"),
    ('[1, 2]', r"line 2: expected a JSON object \(a task\), got list"),
    ('{"id": "a", "env": "terminal", "family": "f", "instruction": "x", "checks": [{"verifier": "v"}], "sead": 1}',
     r"line 2: unknown task field\(s\) sead"),
    ('{"id": "a", "env": "terminal", "family": "f", "checks": [{"verifier": "v"}]}',
     r"line 2: missing task field\(s\) instruction"),
    ('{"id": "a", "env": "terminal", "family": "f", "instruction": "x", "checks": [{"verifier": "v"}], "seed": "1"}',
     r"line 2: 'seed' must be int"),
    ('{"id": "a", "env": "terminal", "family": "f", "instruction": "x", "checks": []}',
     r"line 2: 'checks' is empty"),
    ('{"id": "a", "env": "terminal", "family": "f", "instruction": "x", "checks": [{"path": "p"}]}',
     r"line 2: checks\[0\] must be an object with a 'verifier' name"),
    ('{"id": "a", "env": "terminal", "family": "f", "instruction": "x", "checks": [{"verifier": "v"}], '
     '"solution": [{"name": "bash", "args": {}}]}', r"line 2: solution\[0\] must be"),
    ('{"id": "a", "env": "terminal", "family": "f", "instruction": "x", "checks": [{"verifier": "v"}], '
     '"split": "test"}', r"line 2: 'split' must be one of train, heldout"),
    ('{"id": "a", "env": "browser", "family": "f", "instruction": "x", "checks": [{"verifier": "v"}]}',
     r"line 2: task 'a' is for env 'browser', but this file is used by the 'terminal' environment"),
    ('{"id": "terminal/write_file/0", "env": "terminal", "family": "f", "instruction": "x", '
     '"checks": [{"verifier": "v"}]}', r"line 2: task id 'terminal/write_file/0' repeats line 1"),
])
def test_jsonl_errors_name_file_line_and_problem(tmp_path, line, error):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(asdict(make_task("write_file", 0))) + "\n" + line + "\n")
    with pytest.raises(TaskSourceError, match=rf"bad\.jsonl {error}"):
        load_jsonl(path, env="terminal")


def test_a_finite_source_draws_by_seed_within_family_and_split(jsonl):
    source = open_source(environment("terminal"), jsonl)
    assert isinstance(source, FiniteSource) and source.families() == ["count_words", "write_file"]
    assert (source.count("train"), source.count("heldout")) == (4, 2)
    assert source.task("write_file", 5) == source.task("write_file", 5)
    train = {source.task("write_file", s).id for s in range(10)}
    heldout = {source.task("write_file", s, "heldout").id for s in range(10)}
    assert train == {"terminal/write_file/0", "terminal/write_file/1"} and not train & heldout
    assert len(heldout) == 2
    with pytest.raises(TaskSourceError, match=r"tasks.jsonl: no heldout tasks of family 'count_words'"):
        source.task("count_words", 0, "heldout")


def test_a_job_samples_from_its_jsonl_file(tmp_path, jsonl):
    cfg = load_config(_config(tmp_path, f"environments:\n  - name: terminal\n    tasks: {jsonl}\n"
                                        "    families: [count_words]\n"))
    first = [t.id for t in TaskSampler(cfg.environments, seed=3).sample(20)]
    assert set(first) == {"terminal/count_words/0", "terminal/count_words/1"}
    assert [t.id for t in TaskSampler(cfg.environments, seed=3).sample(20)] == first  # the run's seed decides


def test_two_sources_of_one_env_mix_by_weight(tmp_path, jsonl):
    cfg = load_config(_config(tmp_path, f"environments:\n  - name: terminal\n    tasks: {jsonl}\n"
                                        "  - name: terminal\n    families: [count_words]\n    weight: 3\n"))
    tasks = TaskSampler(cfg.environments, seed=0).sample(200)
    from_file = sum(t.id in {x.id for x in load_jsonl(jsonl)} for t in tasks)
    assert 25 < from_file < 75  # weight 1 against 3: about a quarter
    assert all(isinstance(t, Task) for t in tasks)


def test_partial_credit_marks_the_checks_that_can_give_it(tmp_path):
    """``partial_credit`` on one environment: its checks whose verifier gives near misses credit get ``partial``,
    the other environment's do not, and the tasks drawn are the same as without it."""
    body = "environments:\n  - name: terminal\n{}  - name: slack\n"
    plain = load_config(_config(tmp_path, body.format("")))
    marked = load_config(_config(tmp_path, body.format("    partial_credit: true\n")))
    tasks = TaskSampler(marked.environments, seed=0).sample(30)
    assert [t.id for t in tasks] == [t.id for t in TaskSampler(plain.environments, seed=0).sample(30)]
    assert {t.env for t in tasks} == {"terminal", "slack"}
    for task in tasks:
        assert [c.get("partial", False) for c in task.checks] == [task.env == "terminal"] * len(task.checks)

    task = make_task("write_file", 0)
    task.checks += [{"verifier": "file_equals", "path": "/x", "content": "y", "partial": False},
                    {"verifier": "command", "cmd": "true"}]
    assert [c.get("partial") for c in with_partial_credit(task).checks] == [True, False, None]
    assert "partial" not in task.checks[0]  # the task itself is left as it was


def test_plugin_verifiers_declare_partial_credit_on_the_function(monkeypatch):
    """A verifier that is not registered (a plugin's, or one beside its environment) says it takes ``partial`` with a
    ``partial_credit`` attribute; one without it, an unknown one and one whose plugin fails to load are left alone."""

    def near(sandbox, args):
        return 1.0, "ok"

    def strict(sandbox, args):
        return 1.0, "ok"

    def broken():
        raise registry.PluginError("verifier 'x' of pkg cannot be loaded")

    near.partial_credit = True
    monkeypatch.setattr(registry, "verifier_plugins", lambda: {"near": near, "strict": strict})
    task = replace(make_task("write_file", 0), checks=[{"verifier": n} for n in ("near", "strict", "nope", "sql")])
    assert [c.get("partial") for c in with_partial_credit(task).checks] == [True, None, None, True]
    monkeypatch.setattr(registry, "verifier_plugins", broken)
    assert [c.get("partial") for c in with_partial_credit(task).checks] == [None, None, None, True]


def test_harbor_folder_from_the_config_brings_its_images(tmp_path):
    cfg = load_config(_config(tmp_path, f"environments:\n  - name: harbor\n    tasks: {HARBOR}\n"))
    sampler = TaskSampler(cfg.environments, seed=0)
    assert {t.id for t in sampler.sample(20)} == {"harbor/hello-file", "harbor/count-lines"}
    assert set(sampler.images()) == {"harbor/hello-file", "harbor/count-lines"}


def test_a_run_opens_its_task_sources_once(tmp_path, jsonl, monkeypatch):
    """The preflight opens the job's sources (``validate_job`` returns its TaskSampler); the fleet's image list, the
    ETA's count of held-out episodes and every held-out evaluation take them from it and open none again."""
    from sandforge.job import task_sampler
    from sandforge.job.eta import eval_episodes
    from sandforge.job.evaluation import heldout_tasks
    from sandforge.job.fleet.lifecycle import job_images
    from sandforge.job.preflight import validate_job

    cfg = load_config(_config(tmp_path, f"environments:\n  - name: terminal\n    tasks: {jsonl}\n"
                                        f"  - name: harbor\n    tasks: {HARBOR}\n"
                                        "eval:\n  tasks_per_family: 1\nwarmup:\n  steps: 0\n"))
    opened = []
    real = task_sampler.open_source
    monkeypatch.setattr(task_sampler, "open_source", lambda *a, **k: opened.append(a[0].name) or real(*a, **k))
    sampler = validate_job(cfg)
    assert opened == ["terminal", "harbor"]
    assert set(job_images(cfg, sampler)) >= {"harbor/hello-file"}
    assert eval_episodes(cfg, sources=sampler.sources) > 0
    assert heldout_tasks(cfg.environments, 1, sampler.sources)
    assert opened == ["terminal", "harbor"]  # nothing opened again


def test_config_errors_name_the_key_and_file(tmp_path, jsonl):
    missing = _config(tmp_path, "environments:\n  - name: terminal\n    tasks: nowhere.jsonl\n")
    with pytest.raises(ConfigError, match=r"job.yaml: invalid value for 'environments\[0\].tasks': .*no such file"):
        load_config(missing)
    cfg = load_config(_config(tmp_path, "environments:\n  - name: harbor\n"))
    with pytest.raises(ValueError, match=r"environments\[0\].tasks: the 'harbor' environment has no seeded tasks"):
        TaskSampler(cfg.environments, 0)
    cfg = load_config(_config(tmp_path, f"environments:\n  - name: harbor\n    tasks: {jsonl}\n"))
    with pytest.raises(ValueError, match=r"environments\[0\].tasks: .*reads Harbor task directories"):
        TaskSampler(cfg.environments, 0)
    cfg = load_config(_config(tmp_path, f"environments:\n  - name: terminal\n    tasks: {HARBOR}\n"))
    with pytest.raises(ValueError, match=r"environments\[0\].tasks: .*runs in the 'harbor' environment"):
        TaskSampler(cfg.environments, 0)


def test_train_fails_fast_on_a_bad_task_file(tmp_path, jsonl):
    """Before Ray, Docker or torch start: one line naming the key, the file and the line."""
    jsonl.write_text(jsonl.read_text() + '{"id": "x"}\n')
    config = _config(tmp_path, f"environments:\n  - name: terminal\n    tasks: {jsonl}\n")
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "train", str(config)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: environments[0].tasks: {jsonl} line 7: missing task field(s) env, "
                                   "family, instruction, checks")


def test_rl_weight_leaves_an_environment_to_the_warm_start(tmp_path):
    """``rl_weight: 0``: the warm start draws the environment's tasks by ``weight``, RL draws none of them; an
    environment without ``rl_weight`` keeps its ``weight`` for both."""
    cfg = load_config(_config(tmp_path, "environments:\n  - name: terminal\n  - name: slack\n    rl_weight: 0\n"))
    sampler = TaskSampler(cfg.environments, seed=0)
    assert {t.env for t in sampler.sample(40, phase="warmup")} == {"terminal", "slack"}
    assert {t.env for t in sampler.sample(40)} == {"terminal"}
    assert {t.env for t in sampler.sample(10, "heldout", phase="rl")} == {"terminal"}

    leaning = load_config(_config(tmp_path, "environments:\n  - name: terminal\n  - name: slack\n    rl_weight: 3\n"))
    drawn = TaskSampler(leaning.environments, seed=0).sample(200)
    assert 125 < sum(t.env == "slack" for t in drawn) < 175  # 3 against terminal's weight 1: about three quarters
    with pytest.raises(ValueError, match="draw phase 'sft': one of warmup, rl"):
        sampler.sample(1, phase="sft")


def test_a_job_whose_rl_draws_nothing_is_refused(tmp_path):
    body = "environments:\n  - name: terminal\n    rl_weight: 0\n"
    with pytest.raises(ConfigError, match=r"every environment has 'rl_weight' 0.*trainer.steps=0"):
        load_config(_config(tmp_path, body))
    assert load_config(_config(tmp_path, body + "trainer:\n  steps: 0\n")).trainer.steps == 0
