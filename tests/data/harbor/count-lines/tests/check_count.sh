#!/bin/bash
# 1 when count.txt holds the line count of input.txt and input.txt has three lines.
[ -f /workspace/input.txt ] && [ "$(wc -l < /workspace/input.txt)" -eq 3 ] \
  && [ "$(tr -d '[:space:]' < /workspace/count.txt)" = "3" ]
