#!/bin/bash
# Reads a file beside it, as most terminal-bench solutions do: it works only from /solution, run as a file, and it
# needs its [solution] env.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$here/write_words.sh"
echo "$GREETING" >> /app/out/result.txt
