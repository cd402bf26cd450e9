#!/bin/bash
# Write the program, then try it as a developer would (`go run` builds into /tmp and executes from there).
printf 'echo "hello, $1"\n' > /app/greet.sh
build=$(mktemp -d)
{ echo '#!/bin/sh'; cat /app/greet.sh; } > "$build/greet" && chmod +x "$build/greet"
[ "$("$build/greet" harbor)" = "hello, harbor" ] && rm -rf "$build"
