"""Weight sync: the collective channel (Gloo here, NCCL on GPU) delivers exactly the sender's weights and version."""

import socket
import threading

import pytest
import torch

from sandforge.models.weight_sync import WeightChannel, flatten, unflatten


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
