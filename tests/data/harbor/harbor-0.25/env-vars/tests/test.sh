#!/bin/bash
# SECRET_WORD comes from [environment.env]; ANSWER_FILE from [verifier.env], which wins over [environment.env].
if [ -z "$SECRET_WORD" ] || [ "$ANSWER_FILE" != /workspace/answer.txt ]; then
  echo "the task's environment did not reach test.sh (SECRET_WORD='$SECRET_WORD', ANSWER_FILE='$ANSWER_FILE')"
  exit 1
fi
if [ "$(cat "$ANSWER_FILE" 2>/dev/null)" = "$SECRET_WORD" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
