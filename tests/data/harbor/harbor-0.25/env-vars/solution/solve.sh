#!/bin/bash
# Fails rather than writing an empty answer when the task's environment is missing.
echo "${SECRET_WORD:?SECRET_WORD is not set}" > /workspace/answer.txt
