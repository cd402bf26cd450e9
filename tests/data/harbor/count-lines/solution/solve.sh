#!/bin/bash
printf 'a\nb\nc\n' > /workspace/input.txt
wc -l < /workspace/input.txt > /workspace/count.txt
