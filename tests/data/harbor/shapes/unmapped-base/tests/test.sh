#!/bin/bash
if [ "$(cat /srv/app/status.txt 2>/dev/null)" = "ready" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
