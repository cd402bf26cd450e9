#!/bin/bash
# A service that takes a few seconds to be ready, then the container's own command.
( sleep 3; echo ready-7731 > /run/service-token ) &
exec "$@"
