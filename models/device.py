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
