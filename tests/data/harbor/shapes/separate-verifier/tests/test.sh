#!/bin/bash
# In the verifier's own container: the answer arrives as an artifact, its listing from the collect hook.
if cmp -s /app/answer.txt /opt/grader/expected.txt && grep -q answer.txt /logs/artifacts/listing.txt; then
  echo 1 > /logs/verifier/reward.txt
else
  echo "answer: $(head -c 100 /app/answer.txt 2>&1)"
  echo 0 > /logs/verifier/reward.txt
fi
