#!/bin/bash
# "Compile" /app/greet.sh into an executable in a fresh temp dir under /tmp and run it from there, as a Go or C
# task's tests do with their binary. Reward 1 when it greets by name.
build=$(mktemp -d /tmp/build.XXXXXX)
if [ -f /app/greet.sh ]; then
  { echo '#!/bin/sh'; cat /app/greet.sh; } > "$build/greet"
  chmod +x "$build/greet"
  out=$("$build/greet" harbor 2>&1)
  echo "greet printed: $out"
fi
if [ "${out:-}" = "hello, harbor" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
