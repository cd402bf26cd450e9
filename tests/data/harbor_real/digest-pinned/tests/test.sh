#!/usr/bin/env bash
# As terminal-bench's test.sh: refuses to run from /, writes its verdict to /logs/verifier (here reward.json).
if [ "$PWD" = "/" ]; then
  echo "Error: No working directory set. Please set a WORKDIR in your Dockerfile."
  exit 1
fi
mkdir -p /logs/verifier
reward=0
if [ -f /app/out/result.txt ] \
   && [ "$(wc -l < /app/out/result.txt)" -eq "${EXPECTED_LINES:-missing}" ] \
   && [ "$(head -3 /app/out/result.txt)" = "$(cat /app/data/words.txt)" ] \
   && [ "$(tail -1 /app/out/result.txt)" = "hello from the oracle" ]; then
  reward=1
fi
printf '{"reward": %s, "lines": %s}\n' "$reward" "$(wc -l < /app/out/result.txt 2>/dev/null || echo 0)" \
  > /logs/verifier/reward.json
