#!/usr/bin/env bash
# One command from a fresh machine to a running RL job: install, start Docker, build images, train.
# Extra arguments are passed to `sandforge train` as overrides, e.g. `bash scripts/quickstart.sh trainer.steps=2`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/sandforge images build
exec .venv/bin/sandforge train configs/quickstart.yaml "$@"
