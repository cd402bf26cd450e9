#!/bin/bash
# Reward 1 when a service on 127.0.0.1:8000 answers a line with pong.
reply=
if exec 3<>/dev/tcp/127.0.0.1/8000; then
  echo ping >&3
  read -r -t 5 reply <&3
fi
echo "reply: ${reply:-none}"
if [ "$reply" = "pong" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
