#!/bin/bash
if [ "$(cat /app/notes.txt 2>/dev/null)" = "$(printf 'apple\nfig\npear')" ]; then r=1; else r=0; fi
echo "$r" > /logs/verifier/reward.txt
