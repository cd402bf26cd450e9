"""Every YAML in configs/ is a valid job, and the mixed one trains a step over all built-in environments at once.

(Each environment's own config has its one-step test beside the environment's tests; terminal's is test_train_e2e,
quickstart's (shortened) is test_quickstart.)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sandforge.job.cli import validate_job
from sandforge.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
BUILTIN = {"terminal", "repo", "slack", "notion", "browser"}


def test_there_is_one_config_per_environment_and_a_mixed_one():
    names = {p.stem for p in CONFIGS}
    assert {"quickstart", "k3-scratch", "terminal", "mixed", "repo", "slack", "notion", "browser", "harbor"} <= names
    mixed = load_config(ROOT / "configs" / "mixed.yaml", [])
    assert {e.name for e in mixed.environments} == BUILTIN


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_is_a_valid_job(path):
    cfg = load_config(path, [])
    validate_job(cfg, str(path))


def test_a_harness_whose_own_prompt_outgrows_the_context_is_refused_at_start():
    """Claude Code's system prompt and tools take about 29k tokens before the task: a job with a smaller context is
    refused in one line naming both numbers, not at every episode's first request."""
    from sandforge.config import ConfigError, JobConfig

    def job(harness: str, context: int, **options) -> JobConfig:
        return JobConfig.model_validate({"environments": [{"name": "repo"}], "rollout": {"max_context": context},
                                         "agent": {"harness": harness, "options": options}})

    with pytest.raises(ConfigError, match=r"job.yaml: 'agent.harness' claude-code sends about 29,450 tokens .* "
                                          r"'rollout.max_context' 4096"):
        validate_job(job("claude-code", 4096), "job.yaml")
    validate_job(job("codex", 32768), "job.yaml")
    with pytest.raises(ConfigError, match=r"agent.options: codex takes model, got \['turns'\]"):
        validate_job(job("codex", 32768, turns=3), "job.yaml")


@pytest.mark.docker
@pytest.mark.slow
def test_mixed_config_warm_starts_and_trains_one_step_in_every_environment(tmp_path):
    out = tmp_path / "run"
    overrides = ["trainer.steps=1", "warmup.steps=2", "warmup.episodes=5", "warmup.batch_size=5",
                 "rollout.tasks_per_step=5", "rollout.group_size=2", "rollout.max_new_tokens=32",
                 "eval.tasks_per_family=0", "logging.wandb.mode=disabled", f"run.output_dir={out}"]
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "train", "configs/mixed.yaml", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    warm = [r for r in rows if r["phase"] == "warmup"]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(warm) == 5 and len(rl) == 10
    # reference solutions of whichever environments were drawn pass their own verifiers through the real loop
    assert all(r["reward"]["success"] for r in warm), [(r["task"]["id"], r["reward"]) for r in warm]
    assert not any(r["failed"] for r in rl), [(r["task"]["id"], r["failure"]) for r in rl if r["failed"]]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["phase"] == "rl"] == [0]
