"""tests/gpu: the CUDA fast paths against their references, and the trainer and engine on a GPU. Collected only where
torch sees CUDA (CI is CPU-only; scripts/gpu_check.sh runs them on a lent GPU machine)."""

import os

import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else os.environ.get("DS_ACCELERATOR", "cpu")
