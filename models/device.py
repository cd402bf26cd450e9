"""The part's side of placement (job/fleet/placement.py decides; the trainer ranks and the engine call these inside their
own processes): check that a part placed on a GPU can use it, and say where it runs.
"""

from __future__ import annotations

import os

import torch


def part_device(kind: str, part: str) -> torch.device:
    """The torch device of a part placed on ``kind`` ("cpu" or "cuda"), checked: Ray may hand a GPU to a process whose
    torch cannot use it (a CPU build of torch, a driver mismatch), which is a one-line error, never a run on CPU."""
    if kind != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise RuntimeError(f"{part}: placed on a GPU (CUDA_VISIBLE_DEVICES={visible}) but torch {torch.__version__} "
                           "here cannot use CUDA: install a CUDA build of torch on this node, or set the part's device "
                           "to cpu")
    return torch.device("cuda", torch.cuda.current_device())


def where(kind: str) -> str:
    """What a part placed on ``kind`` reports: ``cuda:<id>`` with the GPU id Ray assigned (the physical one, as
    ``nvidia-smi`` numbers it; inside the process that GPU is ``cuda:0``) or ``cpu``."""
    if kind != "cuda":
        return "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return f"cuda:{visible.split(',')[0]}" if visible else "cuda"


def fast_bf16(kind: str) -> bool:
    """Whether bf16 pays on a part placed on ``kind``: always on a GPU; on a CPU with native bf16 matmuls, AMX
    (``amx_bf16``: the quickstart measured 1.4x the engine's and 2x the trainer's tokens/s of fp32) or AVX-512 BF16
    (``avx512_bf16``: on a 2-core AMD EPYC, 2026-12-06, ``bench/trainer.py --sections precision`` 1.63x the trainer's
    tokens/s, ``bench/engine_replay.py`` 1.65x the engine's). A CPU with neither emulates bf16 matmuls: on a 2-core
    AMD EPYC without AVX-512, five 2048-square bf16 matmuls had not finished after 100 s where fp32 ran at 75 GFLOP/s
    (2026-12-04), so ``auto`` is fp32 there. ``SANDFORGE_CPU_BF16=0`` (or ``1``) decides for a CPU
    instead of its flags: the test suite sets 0, so that its figures and tolerances do not depend on the host's AMX."""
    if kind == "cuda":
        return True
    override = os.environ.get(CPU_BF16_VAR, "")
    if override in ("0", "1"):
        return override == "1"
    return bool(NATIVE_BF16 & cpu_flags())


NATIVE_BF16 = frozenset({"amx_bf16", "avx512_bf16"})  # /proc/cpuinfo flags of a CPU that multiplies bf16 natively


CPU_BF16_VAR = "SANDFORGE_CPU_BF16"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def engine_dtype(setting: str, kind: str) -> str:
    """``engine.dtype`` resolved: ``auto`` is bfloat16 where ``fast_bf16(kind)``, else float32."""
    if setting != "auto":
        return setting
    return "bfloat16" if fast_bf16(kind) else "float32"
