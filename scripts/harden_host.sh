#!/usr/bin/env bash
# Turn on the kernel's own guards for shared sticky folders (/tmp), which these hosts ship off. Graders run as root in
# the policy's sandbox after the policy is gone, but among what it left: with the guards off, a link the policy
# planted at a predictable /tmp path turns a root test.sh's `> /tmp/report.txt` into a write wherever the link
# points (a reward file, the tests, the system), and a file or FIFO planted there is opened as if root's. The
# switches are the host's (not namespaced): a container cannot change them. sandforge's preflight warns when off.
#   fs.protected_symlinks=1  a link in a sticky world-writable folder is followed only by its owner or the folder's
#   fs.protected_regular=2   root's O_CREAT open of another user's file in a sticky folder fails (no write-through)
#   fs.protected_fifos=2     the same for FIFOs
#   fs.protected_hardlinks=1 a hard link needs ownership of (or access to) its target
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
for kv in protected_symlinks=1 protected_regular=2 protected_fifos=2 protected_hardlinks=1; do
  name=${kv%%=*} value=${kv#*=} file=/proc/sys/fs/${kv%%=*}
  [ -r "$file" ] || continue  # a kernel without the switch
  have=$(cat "$file")
  [ "$have" -ge "$value" ] && continue
  if echo "$value" | $SUDO tee "$file" >/dev/null 2>&1; then
    echo "[sandforge] set fs.$name from $have to $value (the kernel's guard for links and files in /tmp)"
  else
    echo "[sandforge] could not set fs.$name=$value (it is $have): root graders are open to links planted in /tmp" >&2
  fi
done
