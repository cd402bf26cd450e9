#!/bin/bash
# Writes reward.json instead of reward.txt (Harbor accepts either); the check itself sits beside test.sh.
if bash /tests/check_count.sh; then reward=1; else reward=0; fi
printf '{"reward": %s}\n' "$reward" > /logs/verifier/reward.json
