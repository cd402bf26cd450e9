"""Weight sync: the collective channel (Gloo here, NCCL on GPU) delivers exactly the sender's weights and version."""

import socket
import threading

import pytest
import torch

from sandforge.models.weight_channel import WeightChannel, flatten, unflatten


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"b.weight": torch.randn(3, 4, generator=g), "a.bias": torch.randn(5, generator=g),
            "moe.bias": torch.randn(7, generator=g).double(), "step": torch.tensor([seed])}


def test_flatten_round_trip():
    sd = state(0)
    back = unflatten(flatten(sd, torch.device("cpu")), sd)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_channel_broadcasts_weights_and_versions():
    port, sent = free_port(), [state(1), state(2)]
    got, errors = [], []

    def engine():
        try:
            ch = WeightChannel("127.0.0.1", port, rank=1, timeout_s=60)
            for _ in sent:
                got.append(ch.receive(state(0)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=engine)
    t.start()
    ch = WeightChannel("127.0.0.1", port, rank=0, timeout_s=60)
    assert [ch.send(sd, v) for v, sd in zip((7, 8), sent)] == [7, 8]
    t.join(60)
    assert not errors and [v for _, v in got] == [7, 8]
    for (sd, _), want in zip(got, sent):
        assert all(torch.equal(sd[k], want[k]) and sd[k].dtype == want[k].dtype for k in want)


def test_a_different_layout_fails_with_the_numbers():
    port, errors = free_port(), []

    def engine():
        ch = WeightChannel("127.0.0.1", port, rank=1, timeout_s=5)
        with pytest.raises(ValueError, match="same model config") as e:
            ch.receive({"w": torch.zeros(2)})
        errors.append(e)

    t = threading.Thread(target=engine)
    t.start()
    ch = WeightChannel("127.0.0.1", port, rank=0, timeout_s=5)
    try:
        ch.send(state(1), 1)
    except RuntimeError:
        pass  # the receiver stops reading: the sender's later broadcasts may fail
    t.join(60)
    assert errors


@pytest.mark.docker
def test_a_run_with_collective_sync_and_routing_replay(tmp_path, terminal_image):
    """Two RL steps with weights broadcast over Gloo and the engine's experts replayed: each push reaches the engine
    as the version the loop counts, and the mismatch rate is logged."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "sandforge.job.cli", "train", "configs/terminal.yaml", f"run.output_dir={tmp_path}",
         "trainer.steps=2", "warmup.steps=0", "rollout.tasks_per_step=1", "rollout.group_size=2", "rollout.max_turns=1",
         "rollout.max_new_tokens=8", "rollout.workers=1", "sandbox.warm_pool=1", "logging.wandb.mode=disabled",
         "trainer.weight_sync=collective", "trainer.routing_replay=true"],
        cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["policy/version"]) for r in rows] == [(0, 1), (1, 2)]
    assert all(0.0 <= r["router/mismatch_rate"] <= 1.0 for r in rows)


def test_a_bfloat16_engine_takes_the_trainers_fp32_weights_over_the_channel():
    """engine.dtype bfloat16: the trainer still sends fp32, the engine receives that layout and serves it cast."""
    from dataclasses import replace

    from engine_sync import push_over_channel

    from sandforge.config import EngineConfig
    from sandforge.models.k3.model import PRESETS, K3Model
    from sandforge.engine import EngineActor

    cfg = replace(PRESETS["k3-nano"], vocab_size=512, max_seq_len=96)
    trainer = K3Model(cfg)
    engine = EngineActor({"arch": "k3", **cfg.to_dict()}, EngineConfig(max_batch_size=2, session_memory_mb=8,
                                                                          dtype="bfloat16"), 0, 1)
    assert {p.dtype for p in engine.core.model.parameters()} == {torch.bfloat16}

    def send(port: int) -> None:
        WeightChannel("127.0.0.1", port, rank=0, timeout_s=60).send(trainer.state_dict(), 3)

    assert push_over_channel(engine, send) == 3
    got = engine.core.model.state_dict()
    for k, v in trainer.state_dict().items():
        assert torch.equal(got[k], v.to(got[k].dtype)), k
