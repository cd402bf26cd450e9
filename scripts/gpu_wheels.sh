#!/usr/bin/env bash
# Here, before a session's GPU checks: what scripts/gpu_check.sh needs on a lent GPU machine that it lacks, into .whl/
# (Python 3.12 wheels; that machine reaches no registry) and .gpu/ (SmolLM2's config and tokenizer, without its
# 538 MB of weights: bench/gpu_e2e.py builds the same shapes with random weights). Both are git-ignored via
# .git/info/exclude and travel by the device tool's `carry` (64 MiB in all: Ray's 79 MB wheel cannot, so the checks
# run without Ray; see docs/gpus.md).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
rm -rf .whl .gpu && mkdir -p .whl .gpu/smollm2-shape
platform=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: "${platform[@]}" -d .whl \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0 \
    fla-core==0.6.0
# deepspeed is an sdist: build a pure-Python wheel of it (its ops are JIT-built where they run)
DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
src=~/.cache/sandforge/models/catalog/smollm2-135m
cp "$src"/{config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} .gpu/smollm2-shape/
du -sh .whl .gpu
