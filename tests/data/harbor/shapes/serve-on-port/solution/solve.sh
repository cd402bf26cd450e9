#!/bin/bash
# A pong server on 127.0.0.1:8000, detached so that it outlives this script.
cat > /app/pong.pl <<'PERL'
use IO::Socket::INET;
my $server = IO::Socket::INET->new(LocalAddr => "127.0.0.1", LocalPort => 8000, Listen => 5, ReuseAddr => 1)
  or die "cannot listen: $!\n";
while (my $client = $server->accept) {
  while (my $line = <$client>) { print $client "pong\n"; }
  close $client;
}
PERL
setsid perl /app/pong.pl > /app/pong.log 2>&1 < /dev/null &
for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && { echo "listening on 8000"; exit 0; }; sleep 0.1; done
echo "the server did not start: $(cat /app/pong.log)"; exit 1
