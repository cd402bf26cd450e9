"""`sandforge train configs/terminal.yaml` end to end on real parts: Docker, Ray, DeepSpeed, wandb (offline)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from sandforge.models.chat import ChatFormat
from sandforge.models.bpe import load_tokenizer
from sandforge.types import Trajectory
from wandb_offline import find_run_file, history_rows

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "pretrain.steps=150",  # copying syllable words into calls: 8 demonstrations alone do not teach the format
    "pretrain.batch_size=16",
    "warmup.steps=60",
    "warmup.episodes=8",
    "rollout.workers=2",
    "rollout.concurrency=2",
    "rollout.tasks_per_step=2",
    "rollout.group_size=2",
    "rollout.max_turns=3",
    "rollout.max_new_tokens=128",
]


TINY = ["trainer.steps=1", "warmup.episodes=4", "rollout.tasks_per_step=1", "rollout.group_size=2",
        "rollout.max_turns=2", "logging.wandb.mode=disabled"]


def sandforge(*args: str, **kwargs):
    return [sys.executable, "-m", "sandforge.job.cli", *args]


def one_step_run(out: Path, *overrides: str) -> None:
    """A one-step quickstart run into ``out`` with ``overrides``; fails the test with the run's stderr if it fails."""
    proc = subprocess.run(sandforge("train", "configs/terminal.yaml", f"run.output_dir={out}", *TINY, *overrides),
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory, terminal_image):
    out = tmp_path_factory.mktemp("quickstart") / "run"
    started = time.time()
    proc = subprocess.run(
        sandforge("train", "configs/terminal.yaml", "trainer.steps=2", f"run.output_dir={out}", *SMALL),
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out, started


def trajectories(out: Path, phase: str) -> list[Trajectory]:
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    return [Trajectory.from_dict({k: v for k, v in r.items() if k not in ("step", "phase")}) for r in rows
            if r["phase"] == phase]


def test_containers_were_created_and_all_removed(quickstart_run, docker_client):
    from containers import list_run_containers

    out, _ = quickstart_run
    run_id = (out / "run_id").read_text().strip()
    episodes = trajectories(out, "warmup") + trajectories(out, "rl")
    sandboxes = [t.metadata["sandbox"] for t in episodes]
    assert len(episodes) == 8 + 2 * 2 * 2 and all(sandboxes)  # warm start + two RL steps
    assert len(set(sandboxes)) == len(sandboxes)  # one container per episode, never reused
    assert all(run_id in name for name in sandboxes)
    assert list_run_containers(run_id, client=docker_client) == []
    assert not docker_client.containers.list(all=True, filters={"name": sandboxes[0]})


def test_policy_turns_ran_tools_in_the_container(quickstart_run):
    out, _ = quickstart_run
    rl = trajectories(out, "rl")
    assert len(rl) == 2 * 2 * 2
    ran = [t for t in rl if sum(1 for turn in t.turns if turn.executed) >= 2]
    assert ran, "no episode had two turns whose tool calls ran: " + json.dumps([t.turns[0].observations for t in rl])
    # what the tools returned came from the container, and it is in the history the policy saw
    assert any(obs for t in ran for turn in t.turns for obs in turn.observations)


def test_loss_mask_covers_exactly_the_policy_tokens(quickstart_run):
    out, _ = quickstart_run
    chat = ChatFormat(load_tokenizer(out / "checkpoints" / "step_0" / "policy"))
    for t in trajectories(out, "rl"):
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
        expected = [0] * len(t.token_ids)
        for i, turn in enumerate(t.turns):
            span = slice(turn.prompt_tokens, turn.prompt_tokens + turn.generated_tokens)
            expected[span] = [1] * turn.generated_tokens
            # each turn's generation parses to the assistant message recorded for it (reasoning kept)
            message, _ = chat.parse_assistant(t.token_ids[span])
            assistant = [m for m in t.messages if m.role == "assistant"][i]
            assert message == assistant
            if i + 1 < len(t.turns):  # token in, token out: the next prompt extends this sequence exactly
                assert t.turns[i + 1].prompt_tokens == turn.prompt_tokens + turn.generated_tokens + turn.observation_tokens
        assert t.loss_mask == expected
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m)


def test_rewards_come_from_the_verifier(quickstart_run):
    out, _ = quickstart_run
    warm = trajectories(out, "warmup")
    assert warm and all(t.reward.success and t.reward.value == 1.0 for t in warm)  # reference solutions pass
    for t in trajectories(out, "rl"):
        assert not t.failed, t.failure
        assert set(t.reward.breakdown) == {f"{c['verifier']}:{c['path']}" for c in t.task.checks}
        assert t.reward.value == sum(t.reward.breakdown.values()) / len(t.reward.breakdown)


def test_policy_weights_changed(quickstart_run):
    out, _ = quickstart_run
    start = load_file(out / "checkpoints" / "step_0" / "policy" / "model.safetensors")
    end = load_file(out / "checkpoints" / "step_2" / "policy" / "model.safetensors")
    assert start.keys() == end.keys()
    assert any(not (start[k] == end[k]).all() for k in start)


def test_reward_logged_to_wandb_and_metrics_for_each_step(quickstart_run):
    out, _ = quickstart_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    for key in ("reward/mean", "success/rate", "response/length_mean", "turns/mean", "loss", "kl", "grad_norm",
                "time/rollout", "time/train", "signal/silent/terminal", "signal/success/terminal",
                "signal/flat_groups"):
        assert all(key in r for r in rl), key
    wandb_rows = [r for r in history_rows(find_run_file(out)) if "reward/mean" in r]
    assert [r["step"] for r in wandb_rows] == [0, 1]
    assert [r["reward/mean"] for r in wandb_rows] == pytest.approx([r["reward/mean"] for r in rl])
    assert (out / "config.yaml").is_file()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_the_run_and_removes_its_containers(tmp_path, docker_client, terminal_image, signum):
    from containers import list_run_containers

    out = tmp_path / "run"
    proc = subprocess.Popen(
        sandforge("train", "configs/terminal.yaml", "trainer.steps=50", f"run.output_dir={out}", "warmup.steps=0",
                  "rollout.max_turns=20", "logging.wandb.mode=disabled"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.time() + 300
        run_id = None
        while time.time() < deadline:
            if run_id is None and (out / "run_id").exists():
                run_id = (out / "run_id").read_text().strip()
            if run_id and list_run_containers(run_id, client=docker_client):
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        else:
            pytest.fail("the run never started a container")
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted" in output
    assert list_run_containers(run_id, client=docker_client) == []


def test_two_trainer_ranks_shard_the_optimizer(tmp_path, terminal_image):
    """trainer.world_size=2: two DeepSpeed ranks (ZeRO-2 over gloo) step together and each saves its optimizer shard."""
    out = tmp_path / "run"
    one_step_run(out, "trainer.world_size=2", "warmup.steps=4")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [0]
    assert all(r["warmup/grad_norm"] > 0 for r in rows if r["phase"] == "warmup")
    shards = sorted(p.name for p in (out / "checkpoints" / "step_1").glob("*optim_states.pt"))
    assert len(shards) == 2 and "rank_0" in shards[0] and "rank_1" in shards[1], shards


def test_the_k3_policy_trains_end_to_end(tmp_path, terminal_image):
    """model.arch=k3: the K3 model (KDA + MLA, AttnRes, LatentMoE) generates, trains and checkpoints through the same loop."""
    from sandforge.models.k3.model import K3Model
    from sandforge.models.build import load_policy

    out = tmp_path / "run"
    one_step_run(out, "model.arch=k3", "warmup.steps=5")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(rl) == 1 and rl[0]["moe/max_load_ratio"] >= 1.0  # LatentMoE balancing ran after the optimizer step
    policy = load_policy(out / "checkpoints" / "step_1" / "policy")
    assert isinstance(policy, K3Model)
    assert json.loads((out / "checkpoints" / "step_1" / "policy" / "config.json").read_text())["arch"] == "k3"


def test_a_local_hugging_face_model_trains_end_to_end(tmp_path, terminal_image):
    """model.arch=hf: a local HF causal LM (a tiny offline Qwen3-MoE) with its own tokenizer and chat template."""
    from test_hf import save_tiny_qwen3_moe

    model_dir = save_tiny_qwen3_moe(tmp_path / "qwen3moe", max_positions=4096, sharpen=1.0)

    out = tmp_path / "run"
    one_step_run(out, "model.arch=hf", f"model.path={model_dir}", "warmup.steps=3", "rollout.max_new_tokens=32")
    warm = trajectories(out, "warmup")
    assert warm and all(t.reward.success for t in warm)  # reference episodes rendered with the model's own template
    rl = trajectories(out, "rl")
    assert len(rl) == 2 and not any(t.failed for t in rl), [t.failure for t in rl]
    saved = out / "checkpoints" / "step_1" / "policy"
    assert (saved / "config.json").is_file() and (saved / "tokenizer.json").is_file()


def test_the_warm_start_learns_from_a_file_of_conversations(tmp_path):
    """``warmup.data`` with no reference episodes (#55): `sandforge sft` trains on a JSONL file of chat conversations
    and writes the policy RL would start from."""
    conversation = {"messages": [
        {"role": "user", "content": "Create /workspace/a.txt holding hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "bash", "arguments": json.dumps({"command": "echo hi > /workspace/a.txt"})}}]},
        {"role": "tool", "tool_call_id": "1", "content": "[exit code 0]"},
        {"role": "assistant", "content": "done"}]}
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(conversation) for _ in range(6)) + "\n")
    out = tmp_path / "run"
    proc = subprocess.run(sandforge("sft", "configs/terminal.yaml", "warmup.steps=2", "warmup.episodes=0",
                                    f"warmup.data={data}", "pretrain.steps=0", f"run.output_dir={out}",
                                    "logging.wandb.mode=disabled"), cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = proc.stdout + proc.stderr  # the console writes to stderr
    assert f"warm start: 6 conversations from {data}" in said, said[-2000:]
    assert (out / "checkpoints" / "step_0" / "policy" / "config.json").is_file()
