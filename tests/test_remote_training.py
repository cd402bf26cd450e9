"""`sandforge train configs/terminal.yaml` with ``engine.remote``: the rollout workers generate through a `sandforge
serve` started in a subprocess, the trainer's weights reach it through disk after every step, and a server that dies
stops the run in one line."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from serve_process import serve_process  # noqa: E402 - tests/ is on sys.path

from sandforge.config import ModelConfig
from sandforge.models.bpe import load_tokenizer
from sandforge.models.build import build_policy, save_policy
from sandforge.types import Trajectory

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
# A random K3 policy straight into RL, a few short episodes a step: what is tested is the plumbing, not learning.
SHORT = ["pretrain.steps=0", "warmup.steps=0", "rollout.workers=1", "rollout.concurrency=2", "rollout.tasks_per_step=1",
         "rollout.group_size=2", "rollout.max_turns=2", "rollout.max_new_tokens=24", "logging.wandb.mode=disabled"]


def sandforge(*args: str) -> list[str]:
    return [sys.executable, "-m", "sandforge.job.cli", *args]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """What the server starts with: a K3 policy of the job's shape (the run's first push replaces its weights)."""
    tokenizer = load_tokenizer("bpe")
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("serve") / "policy"
    save_policy(build_policy(ModelConfig(), len(tokenizer)), directory, tokenizer=tokenizer)
    return directory




def loaded_versions(log: Path) -> list[tuple[int, str]]:
    """(version, directory) of every weight update the server announced, in order."""
    return [(int(v), path) for path, v in re.findall(r"loaded (\S+) as weight version (\d+)", log.read_text())]


def rows(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def rl_trajectories(out: Path) -> list[tuple[int, Trajectory]]:
    return [(r["step"], Trajectory.from_dict({k: v for k, v in r.items() if k not in ("step", "phase")}))
            for r in rows(out, "trajectories.jsonl") if r["phase"] == "rl"]


@pytest.fixture(scope="module")
def remote_run(checkpoint, tmp_path_factory, terminal_image):
    """Three RL steps of configs/terminal.yaml through the server; (run directory, server log, server URL)."""
    tmp = tmp_path_factory.mktemp("remote")
    log, out = tmp / "serve.log", tmp / "run"
    with serve_process(checkpoint, log, weights_dir=tmp / "weights") as (_, url):
        proc = subprocess.run(sandforge("train", "configs/terminal.yaml", f"run.output_dir={out}", "trainer.steps=3",
                                        f"engine.remote.url={url}", f"engine.remote.weights_dir={tmp / 'weights'}",
                                        *SHORT),
                              cwd=ROOT, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-5000:] + log.read_text()[-2000:]
        with urllib.request.urlopen(url + "/get_weight_version", timeout=30) as answer:
            final = json.loads(answer.read())
    return out, log, final


def test_the_server_takes_a_new_weight_version_every_step(remote_run):
    out, log, final = remote_run
    weights = (out.parent / "weights").resolve()  # the job's engine.remote.weights_dir, the server's --weights-dir
    # version 0: the policy RL starts from; then one per step, each from the directory the trainer wrote
    assert loaded_versions(log) == [(v, str(weights / f"version_{v}")) for v in range(4)]
    assert final == {"weight_version": "3"}
    assert [r["policy/version"] for r in rows(out, "metrics.jsonl") if r["phase"] == "rl"] == [1, 2, 3]
    # only the newest version stays on disk, and it is the policy the run ended with
    assert sorted(p.name for p in weights.iterdir()) == [".sandforge-admin-token", "version_3"]
    served_weights = load_file(weights / "version_3" / "model.safetensors")
    final_policy = load_file(out / "checkpoints" / "step_3" / "policy" / "model.safetensors")
    assert served_weights.keys() == final_policy.keys()
    assert all(torch.equal(served_weights[k], final_policy[k]) for k in final_policy)


def test_each_token_records_the_weight_version_that_sampled_it(remote_run):
    out, _, _ = remote_run
    trajs = rl_trajectories(out)
    assert sorted({step for step, _ in trajs}) == [0, 1, 2] and len(trajs) == 3 * 2
    for step, t in trajs:
        assert not t.failed, t.failure
        policy = [v for v, m in zip(t.token_versions, t.loss_mask) if m]
        assert policy and set(policy) == {step}, (step, set(policy))  # step s samples from the version pushed before it
        assert all(v == -1 for v, m in zip(t.token_versions, t.loss_mask) if not m)
        assert [turn.version for turn in t.turns] == [step] * len(t.turns)
        assert len(t.token_ids) == len(t.logprobs) == len(t.loss_mask)
        assert all(lp < 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m)
        # routing replay's input crossed the wire: every token fed to the MoE policy has its experts
        fed = t.turns[-1].prompt_tokens + t.turns[-1].generated_tokens - 1
        assert t.routed_experts is not None and all(e is not None for e in t.routed_experts[:fed])


def test_metrics_have_the_embedded_engines_shape(remote_run, tmp_path):
    out, _, _ = remote_run
    embedded = tmp_path / "embedded"
    proc = subprocess.run(sandforge("train", "configs/terminal.yaml", f"run.output_dir={embedded}", "trainer.steps=1",
                                    *SHORT), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    [want] = [r for r in rows(embedded, "metrics.jsonl") if r["phase"] == "rl"]
    for got in (r for r in rows(out, "metrics.jsonl") if r["phase"] == "rl"):
        assert set(got) == set(want), (set(got) ^ set(want))


def test_a_server_killed_mid_run_stops_it_in_one_line(checkpoint, tmp_path, terminal_image):
    log, out = tmp_path / "serve.log", tmp_path / "run"
    with serve_process(checkpoint, log, weights_dir=tmp_path / "weights") as (server, url):
        run = subprocess.Popen(sandforge("train", "configs/terminal.yaml", f"run.output_dir={out}", "trainer.steps=20",
                                         f"engine.remote.url={url}", "engine.remote.retries=2",
                                         f"engine.remote.weights_dir={tmp_path / 'weights'}", *SHORT),
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 600
            while not (out / "metrics.jsonl").is_file() or '"rl"' not in (out / "metrics.jsonl").read_text():
                assert run.poll() is None, run.communicate()[1][-5000:]
                assert time.monotonic() < deadline, "the run finished no RL step within 600 s"
                time.sleep(0.5)
            server.send_signal(signal.SIGKILL)  # mid-run: the next step's rollouts find no server
            stdout, stderr = run.communicate(timeout=300)
        finally:
            if run.poll() is None:
                run.kill()
                run.communicate()
    assert run.returncode == 1, stderr[-5000:]
    assert "Traceback" not in stdout + stderr, stderr[-5000:]
    last = stderr.strip().splitlines()[-1]
    # one line: the remote engine's URL, what went wrong, after the bounded retries
    assert last.startswith(f"error: remote engine {url}") or last.startswith("error: remote engine: "), last
    assert f"{url}/" in last and "cannot reach the server" in last and "(3 attempts)" in last, last
