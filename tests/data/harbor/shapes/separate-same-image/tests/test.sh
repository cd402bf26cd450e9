#!/bin/bash
# In a fresh container of the task's image: /app arrived as an artifact, less its *.log files.
if [ -e /app/work.log ]; then echo "an excluded file arrived"; echo 0 > /logs/verifier/reward.txt; exit 0; fi
if [ "$(cat /app/out/result.txt 2>/dev/null)" = "42" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
