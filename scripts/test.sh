#!/usr/bin/env bash
# One command from a fresh machine to the full test suite, Docker tests included.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not docker"` or `bash scripts/test.sh tests/test_config.py`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The example plugin, installed from its own folder as users install one: `sandforge envs list` then shows `notes`.
.venv/bin/python -m pip install -q --no-deps --no-build-isolation ./examples/plugin_env
# The verifiers library at its pinned version, and the two verifiers environments written against it (tests/test_vf_envs.py)
.venv/bin/python -m pip install -q -e ".[test,verifiers]" >> .venv/setup.log 2>&1 \
  || { echo "[sandforge] pip install .[verifiers] failed: the end of .venv/setup.log:" >&2; tail -25 .venv/setup.log >&2; exit 1; }
.venv/bin/python -m pip install -q --no-deps --no-build-isolation ./examples/verifiers_envs/reverse_words \
  ./examples/verifiers_envs/guess_number
.venv/bin/sandforge images build
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export SANDFORGE_REQUIRE_DOCKER=1  # setup.sh started the daemon: container tests must run, not skip
export SANDFORGE_REQUIRE_MODELS=1  # setup.sh pulled smollm2-135m: tests on its tokenizer must run, not skip
# Two pytest workers share the machine, one test file each at a time (module fixtures run once), so that a test
# waiting on containers leaves the cores to another. Tests that need the host to themselves (marked alone: they restart
# the Docker daemon, or check what the host-wide reaper of dead runs did) then run one at a time. SANDFORGE_TEST_WORKERS=1: everything in one process, in file order.
workers=${SANDFORGE_TEST_WORKERS:-2}
if [ "$workers" -le 1 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
rc=0
.venv/bin/python -m pytest -q -n "$workers" --dist loadfile --alone=skip "$@" || rc=$?
alone=0
.venv/bin/python -m pytest -q --alone=only "$@" || alone=$?
if [ "$alone" -ne 0 ] && [ "$alone" -ne 5 ]; then rc=$alone; fi  # 5: none of them was selected
exit "$rc"
