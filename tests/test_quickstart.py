"""The quickstart (configs/quickstart.yaml), shortened to minutes, as a new user starts it (`bash
scripts/quickstart.sh`, its output redirected to a file as a CI log or `nohup` would) on the real SmolLM2-135M-Instruct
weights that set-up pulled: the pretrained model's held-out evaluation, the SFT warm start, RL over every built-in
environment with held-out evaluations (sampled and greedy), and every artefact a user is told to look at, each checked
for shape. What reaches the file is what the user needs: no setuptools or Ray notices, a line at least every 30 s
however long a phase takes, and the run directory holds the browser episodes' screenshots, shown in report.html.
Every process of the run is import-traced (tests/import_trace/sitecustomize.py), and ARCHITECTURE.md names every
module they load.

The full run (the README's numbers) takes about 40 minutes; this one keeps the config's environments, families,
model, adapters and algorithm and shrinks only the counts. One run serves every test here: it is the suite's longest."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENVS = {"terminal", "repo", "slack", "notion", "browser"}

SHORT = ["warmup.steps=2", "warmup.episodes=5", "warmup.batch_size=4", "trainer.steps=1",
         "eval.tasks_per_family=1", "eval.samples=2", "rollout.tasks_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=48", "rollout.max_turns=3", "environments.repo.eval_tasks_per_family=1",
         "environments.browser.eval_tasks_per_family=1"]
NOISE = re.compile(r"setuptools|SetuptoolsDeprecationWarning|easy_install|Token authentication|RAY_AUTH_MODE|"
                   r"Started a local Ray instance|is ignored: it is neither|\[WARNING\]|real_accelerator", re.I)
LONGEST_SILENCE_S = 33.0  # the heartbeat's 30 s, plus its 1 s tick and this test's polling


def follow(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None
           ) -> tuple[int, list[tuple[float, str]]]:
    """Run ``cmd`` with stdout and stderr into ``log``; (exit code, each line with the time it appeared)."""
    lines: list[tuple[float, str]] = []
    seen = 0
    start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        while True:
            done = proc.poll() is not None
            text = log.read_bytes().decode(errors="replace")
            complete = text[seen:].rpartition("\n")[0]
            if complete:
                now = time.monotonic() - start
                lines += [(now, line) for line in complete.split("\n")]
                seen += len(complete) + 1
            if done:
                return proc.returncode, lines
            if time.monotonic() - start > timeout:
                proc.kill()
                pytest.fail(f"quickstart did not finish within {timeout:.0f} s; last lines: {lines[-10:]}")
            time.sleep(0.5)


@dataclass(frozen=True)
class Quickstart:
    out: Path  # the run directory
    lines: list[tuple[float, str]]  # each line of its output, with the second it appeared
    trace: Path  # one file of imported module names per process

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


@pytest.fixture(scope="module")
def run(tmp_path_factory, terminal_image) -> Quickstart:
    from pulled_models import pulled

    pulled("smollm2-135m")  # skips without the set-up's models (fails under SANDFORGE_REQUIRE_MODELS)
    base = tmp_path_factory.mktemp("quickstart")
    out, trace = base / "run", base / "import_trace"
    trace.mkdir()
    env = dict(os.environ, SANDFORGE_TEST_IMPORT_TRACE=str(trace),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests" / "import_trace"),
                                                         os.environ.get("PYTHONPATH")])))
    code, lines = follow(["bash", "scripts/quickstart.sh", f"run.output_dir={out}", *SHORT], base / "out.log",
                         timeout=1800, env=env)
    result = Quickstart(out, lines, trace)
    assert code == 0, result.text[-4000:]
    return result


pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_quickstart_covers_every_builtin_environment():
    from sandforge.config import load_config

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [])
    assert {e.name for e in cfg.environments} == ENVS
    assert cfg.model.arch == "hf" and cfg.model.path == "smollm2-135m" and cfg.model.lora is not None
    assert cfg.pretrain.steps == 0 and cfg.warmup.steps > 0  # a pretrained model: no synthetic pretraining
    assert cfg.trainer.steps > 0 and cfg.eval.tasks_per_family > 0 and cfg.eval.base and cfg.eval.greedy
    scratch = load_config(ROOT / "configs" / "k3-scratch.yaml", [])  # the from-scratch recipe it replaced
    assert scratch.model.arch == "k3" and scratch.pretrain.steps > 0 and {e.name for e in scratch.environments} == ENVS


def test_eval_json_has_before_and_after_per_environment(run):
    out, stderr = run.out, run.text
    result = json.loads((out / "eval.json").read_text())
    assert [h["step"] for h in result["history"]] == [0, 1]  # RL's start and end (test_eval.py: eval.every)
    base, before, after = result["base"], result["before"], result["after"]
    assert base["base"] and before["step"] == 0 and after["step"] == 1 and result["k"] == 2
    for summary, samples in ((base, 1), (before, 2), (after, 2)):  # the base sampled once a task (eval.base_samples)
        assert set(summary["per_env"]) == ENVS
        assert 0.0 <= summary["success"] <= summary["pass@k"] <= 1.0 and 0.0 <= summary["stderr"] <= 0.5
        assert all(s["episodes"] == s["tasks"] * samples for s in summary["per_env"].values())
        greedy = summary["greedy"]  # one greedy episode per task
        assert set(greedy["per_env"]) == ENVS and all(s["episodes"] == s["tasks"] for s in greedy["per_env"].values())
    assert set(result["delta_points"]["per_env"]) == ENVS
    assert result["delta_points"]["success"] == pytest.approx(100 * (after["success"] - before["success"]), abs=0.01)
    assert result["over_base"]["success"] == pytest.approx(100 * (after["success"] - base["success"]), abs=0.01)
    assert result["delta_points"]["greedy"] == pytest.approx(
        100 * (after["greedy"]["success"] - before["greedy"]["success"]), abs=0.01)
    assert "held-out success (eval.json)" in stderr and "pretrained base" in stderr and "min left" in stderr


def test_report_png_and_html(run):
    out = run.out
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    html = (out / "report.html").read_text()
    assert html.startswith("<!doctype html>") or html.lower().startswith("<!doctype html>")
    assert "data:image/png;base64," in html and "held-out" in html.lower()


def test_wandb_offline_run_has_the_same_curves(run):
    from wandb_offline import find_run_file, history_rows

    out = run.out
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    history = history_rows(find_run_file(out))
    evals = [r for r in metrics if r["phase"] == "eval"]
    (base,) = [r for r in metrics if r["phase"] == "eval_base"]
    for env in ENVS:
        for key, rows in ((f"eval/success/{env}", evals), (f"eval/greedy/success/{env}", evals),
                          (f"eval_base/success/{env}", [base])):
            assert [r[key] for r in history if key in r] == [r[key] for r in rows], key
    rl = [r for r in metrics if r["phase"] == "rl"]
    assert len(rl) == 1  # two RL steps and their weight syncs: test_train_e2e.py
    for key in ("reward/mean", "entropy", "turns/mean", "response/length_mean"):
        assert [r[key] for r in history if key in r] == pytest.approx([r[key] for r in rl]), key
    assert any(f"success/{env}" in r for r in history for env in ENVS)
    assert [r["warmup/loss"] for r in history if "warmup/loss" in r] == pytest.approx(
        [r["warmup/loss"] for r in metrics if r["phase"] == "warmup"])
    (fresh,) = [r for r in metrics if r["phase"] == "rl_start"]  # trainer.fresh_optimizer
    assert fresh["rl_start/optimizer_states_reset"] > 0


def test_the_output_redirected_to_a_file_is_what_the_user_needs(run):
    lines, text = run.lines, run.text
    noise = [line for _, line in lines if NOISE.search(line)]
    assert not noise, noise
    times = [0.0] + [t for t, _ in lines]
    gaps = [(b - a, lines[i][1]) for i, (a, b) in enumerate(zip(times, times[1:]))]
    longest = max(gaps)
    assert longest[0] <= LONGEST_SILENCE_S, f"{longest[0]:.0f} s of silence before: {longest[1]!r}"
    assert any("trainer: 1 rank on cpu" in line for _, line in lines), text[-3000:]  # where each part runs


def test_the_browser_episodes_screenshots_are_kept_and_shown(run):
    run_dir = run.out
    rows = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    acted = [r for r in rows if r["task"]["env"] == "browser" and not r["failed"]  # episodes that used the browser
             and any(c["name"] != "submit" for m in r["messages"] for c in m.get("tool_calls") or [])]
    assert acted and all(r["metadata"].get("screenshots") for r in acted), [r["metadata"] for r in acted]
    browser = acted
    shots = [run_dir / p for r in browser for p in r["metadata"]["screenshots"]]
    assert all(p.is_file() and p.read_bytes().startswith(b"\x89PNG") for p in shots)
    page = (run_dir / "report.html").read_text()
    assert f'src="{browser[-1]["metadata"]["screenshots"][-1]}"' in page


def test_architecture_names_every_module_the_quickstart_loads(run):
    """The driver, the trainer rank, the engine and the rollout workers: ARCHITECTURE.md names each module's file."""
    traced = {name for f in run.trace.glob("*.txt") for name in f.read_text().split()}
    # the trace reached every kind of process: the driver, a trainer rank, the engine, a rollout worker
    assert {"sandforge.job.run", "sandforge.trainer.rank", "sandforge.engine.llama",
            "sandforge.rollout.worker"} <= traced
    assert not unnamed_in_architecture(traced), unnamed_in_architecture(traced)


def unnamed_in_architecture(traced: set[str]) -> list[str]:
    """The files of the ``traced`` modules (packages' ``__init__.py`` aside) whose path ARCHITECTURE.md never names."""
    from test_layering import modules

    text = (ROOT / "ARCHITECTURE.md").read_text()
    paths = {str(path.relative_to(ROOT)) for name, path in modules(ROOT).items() if name in traced}
    return sorted(p for p in paths if not p.endswith("__init__.py") and p not in text)
