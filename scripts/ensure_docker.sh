#!/usr/bin/env bash
# Make sure a Docker daemon answers, installing Debian's docker.io (and debootstrap, which builds the base image when no
# registry can be pulled from) if needed, and starting dockerd in the background if it is not running.
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  echo "[sandforge] installing ${need[*]} (apt)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

if timeout 10 docker info >/dev/null 2>&1; then
  exit 0
fi

echo "[sandforge] starting dockerd (log: /var/log/sandforge-dockerd.log)"
$SUDO sh -c 'nohup dockerd >/var/log/sandforge-dockerd.log 2>&1 &'
for _ in $(seq 1 60); do
  if timeout 5 docker info >/dev/null 2>&1; then
    echo "[sandforge] docker daemon is up"
    exit 0
  fi
  sleep 1
done
echo "[sandforge] dockerd did not answer within 60 s; see /var/log/sandforge-dockerd.log" >&2
tail -n 20 /var/log/sandforge-dockerd.log >&2 || true
exit 1
