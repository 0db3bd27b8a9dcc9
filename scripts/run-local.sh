#!/usr/bin/env bash
# The README's main job: a 3-node, 2-site transportd cluster on loopback plus an external sink.
#   node1 127.0.0.11:2525 (site-a), node2 127.0.0.12:2525 (site-a), node3 127.0.0.13:2525 (site-b),
#   sink 127.0.0.10:2500 (outside the boundary, stores mail in data/cluster/sink/new).
# Ctrl-C stops every process. Extra arguments go to `transportd cluster up`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec transportd cluster up --data-dir data/cluster "$@"
