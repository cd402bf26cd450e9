#!/usr/bin/env bash
# On a lent GPU machine (the device tool), in one call, after `bash scripts/gpu_wheels.sh` here:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu"], timeout_s=540)
# Installs the carried wheels, then: the tests/gpu suite, bench/gpu_e2e.py (its JSON line is docs/gpus.md's figures),
# and, only where Docker and Ray are both there, a short `sandforge train configs/gpu.yaml`. Logs land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/sandforge . || exit 1
export PYTHONPATH=/tmp/sandforge:/tmp/site
cd /tmp && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)" | tee -a "$OUT/gpu.txt"
cd - >/dev/null
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/tests_gpu.log" | tail -25
timeout 280 python3 bench/gpu_e2e.py --hf-dir .gpu/smollm2-shape 2>&1 | tee "$OUT/gpu_e2e.log" | grep -v Warning | tail -6
if command -v docker >/dev/null && docker info >/dev/null 2>&1 && python3 -c "import ray" 2>/dev/null; then
    timeout 300 python3 -m sandforge.job.cli train configs/gpu.yaml trainer.steps=2 warmup.steps=2 2>&1 \
        | tee "$OUT/train_gpu.log" | tail -15
else
    echo "no Docker daemon or no Ray here: sandforge train configs/gpu.yaml cannot run on this machine" | tee "$OUT/train_gpu.log"
fi
