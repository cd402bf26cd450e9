#!/usr/bin/perl
# Run as a file, as Harbor runs it: bash would not read this. The frontend comes from the environment Harbor gives
# the oracle, the key goes to the user's own home, and the log folder Harbor provides must be there.
use strict;
use warnings;
my $home = $ENV{HOME} or die "no HOME\n";
-d "/logs/agent" && -w "/logs/agent" or die "no writable /logs/agent\n";
mkdir "$home/.ssh", 0700 unless -d "$home/.ssh";
open(my $key, ">", "$home/.ssh/id_deploy") or die "cannot write $home/.ssh/id_deploy: $!\n";
print {$key} "deploy-key\n";
close $key;
open(my $out, ">", "/app/frontend.txt") or die "cannot write /app/frontend.txt: $!\n";
print {$out} ($ENV{DEBIAN_FRONTEND} // "unset"), "\n";
close $out;
print "key in $home/.ssh, frontend $ENV{DEBIAN_FRONTEND}\n";
