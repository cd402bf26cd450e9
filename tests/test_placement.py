"""Where the trainer ranks and the engine run (job/fleet/placement.py), checked without a GPU: Ray is given logical GPUs
(``ray.init(num_gpus=2)``), so its accounting, its ``CUDA_VISIBLE_DEVICES`` and the placement group of a colocated
engine are real; only torch here has no CUDA, which a part placed on a GPU must then refuse in one line. The
colocated weight sync runs for real on CPU (shared-memory files where a GPU would pass CUDA IPC handles)."""

from __future__ import annotations

import pytest
import torch

from sandforge.config import EngineConfig, JobConfig, ModelConfig, RemoteEngineConfig, TrainerConfig
from sandforge.job.console import JobError
from sandforge.job.fleet.placement import GPU_SHARE, describe, placement_group, resolve_placement
from sandforge.models import device
from sandforge.trainer.rank import deepspeed_config
from sandforge.types import TrainingRow


def job(world: int = 1, trainer: str = "auto", engine: str = "auto", colocate: bool = False, **trainer_keys) -> JobConfig:
    return JobConfig(trainer=TrainerConfig(world_size=world, device=trainer, **trainer_keys),
                     engine=EngineConfig(device=engine, colocate=colocate))


# ---------------------------------------------------------------- resolving devices (no Ray)

@pytest.mark.parametrize("flags, bf16", [({"avx2", "fma"}, False), ({"avx512f", "avx512bw"}, False),
                                         ({"avx512f", "avx512_bf16"}, True), ({"avx512f", "amx_bf16", "amx_tile"}, True)])
def test_auto_precision_is_bf16_only_where_the_cpu_multiplies_bf16_natively(monkeypatch, flags, bf16):
    """A CPU without native bf16 (AMX or AVX-512 BF16) emulates it (a bf16 matmul many times slower than fp32): auto
    stays fp32 there."""
    monkeypatch.delenv(device.CPU_BF16_VAR, raising=False)
    monkeypatch.setattr(device, "cpu_flags", lambda: flags)
    assert resolve_placement(job(), gpus=0).bf16 is bf16
    assert ("bf16" in deepspeed_config(TrainerConfig(), cuda=False)) is bf16
    assert device.engine_dtype("auto", "cpu") == ("bfloat16" if bf16 else "float32")
    assert device.engine_dtype("auto", "cuda") == "bfloat16" and device.engine_dtype("float32", "cuda") == "float32"
    assert resolve_placement(job(bf16=True), gpus=0).bf16 is True  # a setting always wins


@pytest.mark.parametrize("value, bf16", [("0", False), ("1", True)])
def test_sandforge_cpu_bf16_decides_for_a_cpu_whatever_its_flags(monkeypatch, value, bf16):
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx512f", "amx_bf16"} if not bf16 else {"avx2"})
    monkeypatch.setenv(device.CPU_BF16_VAR, value)
    assert device.fast_bf16("cpu") is bf16 and device.fast_bf16("cuda") is True
    assert resolve_placement(job(bf16=not bf16), gpus=0).bf16 is (not bf16)  # a setting still wins



def test_a_machine_without_gpus_runs_everything_on_cpu_as_before(monkeypatch):
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx2", "fma"})
    p = resolve_placement(job(world=2), gpus=0)
    assert (p.trainer, p.engine, p.colocate, p.bf16, p.gpus) == ("cpu", "cpu", False, False, 0)
    assert p.weight_sync("auto") == "object_store"
    assert p.rank_options(0) == p.engine_options() == {"num_cpus": 0, "num_gpus": 0}  # nothing to hide: no GPU


def test_auto_gives_each_rank_a_gpu_then_the_engine_one_and_trains_in_bf16():
    p = resolve_placement(job(world=2), gpus=3)
    assert (p.trainer, p.engine, p.colocate, p.bf16, p.gpus) == ("cuda", "cuda", False, True, 3)
    assert [p.rank_options(r)["num_gpus"] for r in (0, 1)] == [1, 1] and p.engine_options()["num_gpus"] == 1
    assert p.weight_sync("auto") == "collective"
    assert resolve_placement(job(world=2, bf16=False), gpus=3).bf16 is False  # trainer.bf16 still decides


def test_auto_says_so_when_no_gpu_is_left_for_the_engine():
    p = resolve_placement(job(), gpus=1)
    assert (p.trainer, p.engine) == ("cuda", "cpu")
    assert "engine on cpu" in p.note and "engine.colocate" in p.note
    assert p.note in describe(p, ["cuda:0"], "cpu", "float32")


def test_a_colocated_engine_shares_rank_0s_gpu_and_takes_weights_by_direct_copy():
    p = resolve_placement(job(colocate=True), gpus=1)
    assert (p.trainer, p.engine, p.colocate, p.gpus) == ("cuda", "cuda", True, 1)
    assert p.rank_options(0)["num_gpus"] + p.engine_options()["num_gpus"] == 1
    assert p.engine_options()["num_gpus"] == GPU_SHARE
    assert p.weight_sync("auto") == "colocated"
    assert p.weight_sync("auto", spread=True) == "collective"  # ZeRO-3 / experts spread: rank 0 lacks the model
    line = describe(p, ["cuda:0"], "cuda:0", "bfloat16")
    assert line == "trainer: 1 rank on cuda:0 (bf16, nccl) · engine: cuda:0, shared with rank 0 (bfloat16)"


@pytest.mark.parametrize("cfg, gpus, words", [
    (job(trainer="cuda"), 0, ["trainer.device is cuda", "no GPU"]),
    (job(world=2, trainer="cuda"), 1, ["trainer.device is cuda", "1 GPU", "world_size 2"]),
    (job(engine="cuda"), 1, ["engine.device is cuda", "engine.colocate"]),
    (job(colocate=True), 0, ["engine.colocate", "cpu"]),
])
def test_a_device_ray_cannot_place_is_a_one_line_error_never_a_silent_cpu_run(cfg, gpus, words):
    with pytest.raises(JobError) as e:
        resolve_placement(cfg, gpus=gpus)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_eval_and_serve_place_only_the_engine():
    p = resolve_placement(job(colocate=True), gpus=1, trains=False)
    assert (p.trainer, p.engine, p.colocate, p.world_size) == ("cpu", "cuda", False, 0)
    assert describe(p, [], "cuda:0", "bfloat16") == "engine: cuda:0 (bfloat16)"


def test_a_remote_engine_is_not_placed():
    cfg = JobConfig(engine=EngineConfig(remote=RemoteEngineConfig(url="http://127.0.0.1:9")))
    p = resolve_placement(cfg, gpus=1)
    assert (p.trainer, p.engine) == ("cuda", "remote")
    assert describe(p, ["cuda:0"], None, "float32") == "trainer: 1 rank on cuda:0 (bf16, nccl) · engine: remote"


def test_cpu_only_describes_itself():
    p = resolve_placement(job(world=2), gpus=0)
    assert describe(p, ["cpu", "cpu"], "cpu", "float32") == "trainer: 2 ranks on cpu (fp32, gloo) · engine: cpu (float32)"


@pytest.mark.parametrize("yaml, words", [
    ("engine: {colocate: true}\ntrainer: {device: cpu}\n", "engine.colocate.*trainer.device"),
    ("engine: {colocate: true}\ntrainer: {mode: async}\n", "engine.colocate.*async"),
    ("trainer: {weight_sync: colocated}\n", "weight_sync.*colocate"),
    ("trainer: {device: gpu}\n", "trainer.device"),
])
def test_config_refuses_devices_and_colocation_that_cannot_work(tmp_path, yaml, words):
    from sandforge.config import ConfigError, load_config

    path = tmp_path / "job.yaml"
    path.write_text(yaml)
    with pytest.raises(ConfigError, match=words):
        load_config(path)


# ---------------------------------------------------------------- Ray with logical GPUs

def probe_class():
    """A part that says what it sees of its placement (defined here, so Ray ships it by value to its workers)."""

    class Probe:
        def seen(self) -> dict:
            import os

            import ray

            from sandforge.models.device import where

            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            return {"visible": visible, "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                    "where": where("cuda" if visible else "cpu")}

    return Probe


@pytest.fixture(scope="module")
def logical_gpus():
    import ray

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 1024**2)
    yield ray
    ray.shutdown()


def _free_gpus(ray) -> float:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # killed actors give their GPUs back asynchronously
        free = ray.available_resources().get("GPU", 0)
        if free == 2:
            return free
        time.sleep(0.2)
    return ray.available_resources().get("GPU", 0)


def test_ray_gives_each_cuda_part_its_own_gpu(logical_gpus):
    ray = logical_gpus
    from sandforge.job.fleet.placement import cluster_gpus

    assert cluster_gpus() == 2
    p = resolve_placement(job(), gpus=cluster_gpus())
    probe = ray.remote(probe_class())
    rank = probe.options(**p.rank_options(0)).remote()
    engine = probe.options(**p.engine_options()).remote()
    seen = ray.get([rank.seen.remote(), engine.seen.remote()])
    assert ray.available_resources().get("GPU", 0) == 0  # both reserved
    assert {s["visible"] for s in seen} == {"0", "1"}  # one GPU each, kept apart
    assert all(s["gpu_ids"] == [s["visible"]] and s["where"] == f"cuda:{s['visible']}" for s in seen)
    for actor in (rank, engine):
        ray.kill(actor)
    assert _free_gpus(ray) == 2


def test_a_colocated_engine_lands_on_rank_0s_gpu(logical_gpus):
    ray = logical_gpus
    p = resolve_placement(job(colocate=True), gpus=2)
    bundles = placement_group(p)
    try:
        probe = ray.remote(probe_class())
        rank = probe.options(**p.rank_options(0, bundles)).remote()
        engine = probe.options(**p.engine_options(bundles)).remote()
        seen = ray.get([rank.seen.remote(), engine.seen.remote()])
        assert seen[0]["visible"] == seen[1]["visible"] and seen[0]["where"] == seen[1]["where"]
        assert ray.available_resources().get("GPU", 0) == 1  # one GPU for both
        for actor in (rank, engine):
            ray.kill(actor)
    finally:
        ray.util.remove_placement_group(bundles)
    assert _free_gpus(ray) == 2


def test_a_cpu_part_sees_no_gpu_on_a_node_that_has_some(logical_gpus):
    ray = logical_gpus
    p = resolve_placement(job(trainer="cpu", engine="cpu"), gpus=2)
    engine = ray.remote(probe_class()).options(**p.engine_options()).remote()
    assert ray.get(engine.seen.remote()) == {"visible": "", "gpu_ids": [], "where": "cpu"}
    ray.kill(engine)


def test_a_rank_ray_put_on_a_gpu_that_torch_cannot_use_fails_in_one_line(logical_gpus):
    """Never a silent CPU run: the real TrainerRank, placed on a (logical) GPU, refuses to start."""
    ray = logical_gpus
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: tests/gpu covers the real thing")
    from sandforge.job.fleet.lifecycle import free_port
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    p = resolve_placement(job(trainer="cuda"), gpus=2)
    model = ModelConfig(arch="k3", preset="k3-nano", tokenizer="bytes")
    rank = ray.remote(TrainerRank).options(**p.rank_options(0)).remote(
        0, 1, "127.0.0.1", free_port(), model, TrainerConfig(), RolloutShape(1.0, 64), 0, 1, p.trainer)
    with pytest.raises(ray.exceptions.RayActorError) as e:
        ray.get(rank.device_name.remote())
    assert "trainer rank 0: placed on a GPU (CUDA_VISIBLE_DEVICES=" in str(e.value)
    assert "cannot use CUDA" in str(e.value)


def test_colocated_weight_sync_copies_rank_0s_own_memory_into_the_engine(logical_gpus):
    """A real DeepSpeed rank and a real engine in two processes (on CPU: shared-memory files where a GPU passes CUDA
    IPC handles). Only handles cross: the blob is a small fraction of the weights. After a training step the next
    push serves the new weights, equal to the rank's, cast to the engine's bfloat16."""
    ray = logical_gpus
    from sandforge.job.fleet.lifecycle import free_port
    from sandforge.job.fleet.weight_sync import WeightSync
    from sandforge.engine import EngineActor
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    model = ModelConfig(arch="k3", preset="k3-nano", tokenizer="bytes",
                        k3=dict(d_model=32, n_heads=2, head_dim=16, d_ff=32, d_expert=16))
    p = resolve_placement(job(trainer="cpu", engine="cpu"), gpus=2)
    rank = ray.remote(TrainerRank).options(**p.rank_options(0)).remote(
        0, 1, "127.0.0.1", free_port(), model, TrainerConfig(lr=1e-2), RolloutShape(1.0, 64), 0, 2, "cpu")
    config = ray.get(rank.model_config_dict.remote())
    engine = ray.remote(EngineActor).options(**p.engine_options()).remote(
        config, EngineConfig(max_batch_size=2, session_memory_mb=8, dtype="bfloat16"), 0, 1, "cpu")
    try:
        sync = WeightSync("colocated", [rank], engine, free_port(), gather_all=False)
        blob = ray.get(rank.share_weights.remote())
        weights = ray.get(rank.get_weights.remote())
        assert len(blob) < 0.05 * sum(v.numel() * v.element_size() for v in weights.values())
        for version in (1, 2):
            assert sync.push(version) == version == ray.get(engine.version.remote())
            served = ray.get(engine.stats.remote())["version"]
            assert served == version
            got = ray.get(engine.served_weights.remote())
            want = ray.get(rank.get_weights.remote())
            assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)
            rows = [TrainingRow(token_ids=list(range(3, 19)), loss_mask=[0] * 4 + [1] * 12, logprobs=[0.0] * 16,
                                advantages=[1.0] * 16)]
            ray.get(rank.train_step.remote(rows, 12))
        assert not all(torch.equal(want[k], v) for k, v in weights.items())  # the step moved the weights
    finally:
        for actor in (rank, engine):
            ray.kill(actor)
