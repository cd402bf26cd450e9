"""The quickstart (configs/quickstart.yaml), shortened to minutes, on the real SmolLM2-135M-Instruct weights that
set-up pulled: the pretrained model's held-out evaluation, the SFT warm start, RL over every built-in environment with
held-out evaluations (sampled and greedy), and every artefact a user is told to look at, each checked for shape.

The full run (the README's numbers) takes about 40 minutes; this one keeps the config's environments, families,
model, adapters and algorithm and shrinks only the counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENVS = {"terminal", "repo", "slack", "notion", "browser"}

SHORT = ["warmup.steps=2", "warmup.episodes=5", "warmup.batch_size=4", "trainer.steps=2", "eval.every=1",
         "eval.tasks_per_family=1", "eval.samples=2", "rollout.tasks_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=48", "rollout.max_turns=3", "environments.repo.eval_tasks_per_family=1",
         "environments.browser.eval_tasks_per_family=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, terminal_image):
    from pulled_models import pulled

    pulled("smollm2-135m")  # skips without the set-up's models (fails under SANDFORGE_REQUIRE_MODELS)
    out = tmp_path_factory.mktemp("quickstart") / "run"
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "train", "configs/quickstart.yaml",
                           f"run.output_dir={out}", *SHORT], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc.stderr


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
    out, stderr = run
    result = json.loads((out / "eval.json").read_text())
    assert [h["step"] for h in result["history"]] == [0, 1, 2]
    base, before, after = result["base"], result["before"], result["after"]
    assert base["base"] and before["step"] == 0 and after["step"] == 2 and result["k"] == 2
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
    out, _ = run
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    html = (out / "report.html").read_text()
    assert html.startswith("<!doctype html>") or html.lower().startswith("<!doctype html>")
    assert "data:image/png;base64," in html and "held-out" in html.lower()


def test_wandb_offline_run_has_the_same_curves(run):
    from wandb_offline import find_run_file, history_rows

    out, _ = run
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    history = history_rows(find_run_file(out))
    evals = [r for r in metrics if r["phase"] == "eval"]
    (base,) = [r for r in metrics if r["phase"] == "eval_base"]
    for env in ENVS:
        for key, rows in ((f"eval/success/{env}", evals), (f"eval/greedy/success/{env}", evals),
                          (f"eval_base/success/{env}", [base])):
            assert [r[key] for r in history if key in r] == [r[key] for r in rows], key
    rl = [r for r in metrics if r["phase"] == "rl"]
    assert len(rl) == 2
    for key in ("reward/mean", "entropy", "turns/mean", "response/length_mean"):
        assert [r[key] for r in history if key in r] == pytest.approx([r[key] for r in rl]), key
    assert any(f"success/{env}" in r for r in history for env in ENVS)
    assert [r["warmup/loss"] for r in history if "warmup/loss" in r] == pytest.approx(
        [r["warmup/loss"] for r in metrics if r["phase"] == "warmup"])
    (fresh,) = [r for r in metrics if r["phase"] == "rl_start"]  # trainer.fresh_optimizer
    assert fresh["rl_start/optimizer_states_reset"] > 0
