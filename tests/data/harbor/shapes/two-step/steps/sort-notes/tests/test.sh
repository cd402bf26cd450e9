#!/bin/bash
# the step's set-up (workdir/setup.sh) appended banana to what the first step wrote; its workdir/ABOUT.txt is the agent's
if [ "$(cat /app/notes.txt 2>/dev/null)" = "$(printf 'apple\nbanana\nfig\npear')" ] && [ -f /app/ABOUT.txt ]; then r=1; else r=0; fi
echo "$r" > /logs/verifier/reward.txt
