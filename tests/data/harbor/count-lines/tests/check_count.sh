#!/bin/bash
# The image's input.txt has four lines; the answer must say so.
[ "$(tr -d '[:space:]' < /workspace/count.txt)" = "4" ]
