#!/usr/bin/env bash
# In the sandbox, as the policy's user: start the loopback forwarder to the episode's proxy socket, wait until it
# listens, then run the harness's command ($SANDFORGE_HARNESS_COMMAND) in the task's working directory. The harness's
# own exit status is this script's; 97 says the forwarder never started. The forwarder stops with the harness.
set -u
python3 "$SANDFORGE_HARNESS_DIR/forward.py" "$SANDFORGE_PROXY_SOCKET" "$SANDFORGE_PROXY_PORT" \
  > "$SANDFORGE_HARNESS_DIR/forward.log" 2>&1 &
FORWARDER=$!
for _ in $(seq 600); do  # up to 30 s on a loaded host
  grep -q forwarding "$SANDFORGE_HARNESS_DIR/forward.log" 2>/dev/null && break
  sleep 0.05
done
if ! grep -q forwarding "$SANDFORGE_HARNESS_DIR/forward.log" 2>/dev/null; then
  cat "$SANDFORGE_HARNESS_DIR/forward.log" 2>/dev/null
  exit 97  # the forwarder never listened: the episode fails (infrastructure), it is not the policy's 0
fi
cd "$SANDFORGE_WORKDIR" && eval "$SANDFORGE_HARNESS_COMMAND"
status=$?
# the forwarder is sandforge's: gone before grading, so its port never reads as a service the policy left running
kill "$FORWARDER" 2>/dev/null
wait "$FORWARDER" 2>/dev/null
exit "$status"
