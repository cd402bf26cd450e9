#!/bin/bash
# Two named rewards in reward.json, as Harbor's multi-reward tasks write them (no "reward" key).
correctness=1
for pair in "0 0" "1 1" "2 1" "10 55" "20 6765"; do
  set -- $pair
  [ "$(timeout 10 bash /workspace/fib.sh "$1" 2>/dev/null)" = "$2" ] || correctness=0
done
performance=0
if [ "$(timeout 2 bash /workspace/fib.sh 90 2>/dev/null)" = "2880067194370816120" ]; then performance=1; fi
printf '{"correctness": %s, "performance": %s}\n' "$correctness" "$performance" > /logs/verifier/reward.json
