"""Where a job's parts run: the trainer ranks and the engine, each on CPU or on GPUs that Ray places.

``trainer.device`` and ``engine.device`` take ``auto``, ``cpu`` or ``cuda``:

- a CUDA trainer rank asks Ray for one GPU (``num_gpus=1``), so Ray both reserves it and keeps ranks apart (each sees
  its own GPU as ``cuda:0`` through ``CUDA_VISIBLE_DEVICES``);
- a CUDA engine asks for a GPU of its own, or with ``engine.colocate`` shares rank 0's: both are scheduled into the
  same one-GPU bundle of a placement group, with ``GPU_SHARE`` of it each (Ray's accounting; memory is shared as the
  engine frees its caches while the trainer steps);
- ``auto`` is cuda when the Ray cluster has the GPUs for it (the ranks first, then the engine), cpu otherwise;
- ``cuda`` that Ray cannot place is a one-line error, never a silent fallback to CPU.

A part placed on CPU asks for ``num_gpus=0`` and gets ``CUDA_VISIBLE_DEVICES=""`` (Ray would leave it unset, and the
part would see every GPU of its node), so it never touches one by accident.
The run states where each part ended up in one line (``describe``), from what the actors themselves report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sandforge.config import JobConfig
from sandforge.job.console import JobError
from sandforge.models.device import fast_bf16

HIDE_GPUS = {"runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}
GPU_SHARE = 0.5  # a colocated engine's share of rank 0's GPU in Ray's accounting (rank 0 keeps the rest)


@dataclass(frozen=True)
class Placement:
    trainer: str  # "cpu" or "cuda"
    engine: str  # "cpu", "cuda" or "remote" (engine.remote: a separate server, nothing placed here)
    world_size: int
    colocate: bool = False  # the engine shares rank 0's GPU
    bf16: bool = False  # the ranks train in bf16 with fp32 master weights
    note: str = ""  # why auto chose what it chose, when that is worth a word
    cluster_gpus: int = 0  # GPUs the cluster has: with none, a CPU part has nothing to hide

    @property
    def gpus(self) -> int:
        """Whole GPUs the job reserves."""
        return (self.world_size if self.trainer == "cuda" else 0) + (self.engine == "cuda" and not self.colocate)

    def needs_bundles(self) -> bool:
        return self.colocate

    def rank_options(self, rank: int, bundles: Any = None) -> dict:
        """Ray actor options of trainer rank ``rank`` (``bundles``: the placement group ``placement_group`` made)."""
        if self.trainer != "cuda":
            return self._cpu()
        share = 1 - GPU_SHARE if self.colocate and rank == 0 else 1
        return {"num_cpus": 0, "num_gpus": share} | _in_bundle(bundles, rank)

    def engine_options(self, bundles: Any = None) -> dict:
        if self.engine != "cuda":
            return self._cpu()
        if self.colocate:
            return {"num_cpus": 0, "num_gpus": GPU_SHARE} | _in_bundle(bundles, 0)
        return {"num_cpus": 0, "num_gpus": 1}

    def _cpu(self) -> dict:
        return {"num_cpus": 0, "num_gpus": 0} | (HIDE_GPUS if self.cluster_gpus else {})

    def weight_sync(self, mode: str, spread: bool = False) -> str:
        """``trainer.weight_sync`` resolved: auto is a direct copy when colocated (unless the model is ``spread``
        over the ranks: expert parallelism, ZeRO-3), a collective when a GPU takes part, the object store otherwise."""
        if mode != "auto":
            return mode
        if self.colocate and not spread:
            return "colocated"
        return "collective" if "cuda" in (self.trainer, self.engine) else "object_store"


def _in_bundle(bundles: Any, index: int) -> dict:
    if bundles is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(bundles, placement_group_bundle_index=index)}


def cluster_gpus() -> int:
    """Whole GPUs the running Ray cluster has (logical ones included: ``ray.init(num_gpus=N)``)."""
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def resolve_placement(cfg: JobConfig, gpus: int, trains: bool = True) -> Placement:
    """Where each part runs, given the cluster's ``gpus``; raises JobError (one line) for a ``cuda`` Ray cannot place.
    ``trains``: the job has trainer ranks (eval and serve have none)."""
    t, e = cfg.trainer, cfg.engine
    world = t.world_size if trains else 0
    remote = e.remote is not None
    if t.device == "cuda" and gpus < world:
        raise JobError(f"trainer.device is cuda but Ray can place {_gpus(gpus)} for trainer.world_size {world} (one "
                       "GPU per rank): use trainer.device auto or cpu, fewer ranks, or a cluster with more GPUs")
    trainer = "cpu" if world == 0 else ("cuda" if t.device == "cuda" or (t.device == "auto" and gpus >= world)
                                        else "cpu")
    if trainer == "cpu" and t.device == "auto" and 0 < gpus < world:
        note = f"trainer on cpu: {world} ranks need {world} GPUs, Ray has {gpus}"
    else:
        note = ""
    if remote:
        return Placement(trainer, "remote", world, bf16=_bf16(t.bf16, trainer), note=note, cluster_gpus=gpus)
    colocate = e.colocate and trainer == "cuda"
    if e.colocate and world and trainer != "cuda":
        raise JobError(f"engine.colocate shares trainer rank 0's GPU, but the trainer runs on cpu (Ray has "
                           f"{_gpus(gpus)}): drop engine.colocate, or give the run GPUs")
    left = gpus - (world if trainer == "cuda" else 0)
    if colocate:
        engine = "cuda"
    elif e.device == "cuda":
        if left < 1:
            raise JobError(f"engine.device is cuda but Ray has no GPU left for it ({_gpus(gpus)}, "
                           f"{world if trainer == 'cuda' else 0} taken by the trainer ranks): set engine.colocate "
                           "true to share rank 0's GPU, or engine.device cpu")
        engine = "cuda"
    elif e.device == "auto" and left >= 1:
        engine = "cuda"
    else:
        engine = "cpu"
        if e.device == "auto" and trainer == "cuda":
            note = "engine on cpu: no GPU left after the trainer ranks (engine.colocate true shares rank 0's)"
    return Placement(trainer, engine, world, colocate, _bf16(t.bf16, trainer), note, gpus)


def _bf16(setting: bool | None, trainer: str) -> bool:
    return fast_bf16(trainer) if setting is None else setting


def _gpus(n: int) -> str:
    return "no GPU" if n == 0 else f"{n} GPU{'s' * (n != 1)}"


def placement_group(placement: Placement):
    """The bundles colocated parts are scheduled into (one GPU per rank; the engine joins rank 0's), ready; or None."""
    if not placement.needs_bundles():
        return None
    import ray
    from ray.util.placement_group import placement_group as make_group

    group = make_group([{"GPU": 1}] * placement.world_size, strategy="PACK")
    if not group.wait(timeout_seconds=60):
        raise JobError(f"Ray could not reserve {placement.world_size} GPU(s) for the colocated trainer and engine "
                       f"within 60 s (cluster: {ray.cluster_resources().get('GPU', 0)} GPUs)")
    return group


def describe(placement: Placement, ranks: list[str], engine: str | None, engine_dtype: str) -> str:
    """The run's line on where its parts run, from what they report, e.g.
    ``trainer: 1 rank on cuda:0 (bf16, nccl) · engine: cuda:0, shared with rank 0 (bfloat16)``."""
    parts = []
    if ranks:
        where = ", ".join(dict.fromkeys(ranks))
        precision = "bf16" if placement.bf16 else "fp32"
        backend = "nccl" if placement.trainer == "cuda" else "gloo"
        parts.append(f"trainer: {len(ranks)} rank{'s' * (len(ranks) != 1)} on {where} ({precision}, {backend})")
    if placement.engine == "remote":
        parts.append("engine: remote")
    elif engine is not None:
        shared = ", shared with rank 0" if placement.colocate else ""
        parts.append(f"engine: {engine}{shared} ({engine_dtype})")
    line = " · ".join(parts)
    return f"{line} · {placement.note}" if placement.note else line
