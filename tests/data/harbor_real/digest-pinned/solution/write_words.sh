#!/bin/bash
set -euo pipefail
test "$PWD" = /app  # Harbor runs solve.sh in the image's WORKDIR
words > /app/out/result.txt
