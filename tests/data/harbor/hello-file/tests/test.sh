#!/bin/bash
# Harbor convention: write the reward (a number) to /logs/verifier/reward.txt.
if [ "$(cat /workspace/hello.txt 2>/dev/null)" = "Hello, sandforge!" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
