#!/bin/bash
# The key must be in the agent's home (root's, or the non-root agent's under /home), not in the WORKDIR.
key=
for f in /root/.ssh/id_deploy /home/*/.ssh/id_deploy; do [ -f "$f" ] && key=$f; done
echo "key: ${key:-none}; frontend: $(cat /app/frontend.txt 2>/dev/null)"
if [ -n "$key" ] && [ "$(cat "$key")" = "deploy-key" ] && [ "$(cat /app/frontend.txt 2>/dev/null)" = "noninteractive" ]
then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt
fi
