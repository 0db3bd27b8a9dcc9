#!/usr/bin/env bash
# One transportd node on 127.0.0.1:2525 with a sink on 127.0.0.1:2500 standing in for the internet.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p data
transportd sink --listen 127.0.0.1:2500 --dir data/sink &
SINK_PID=$!
trap 'kill "$SINK_PID" 2>/dev/null || true; wait "$SINK_PID" 2>/dev/null || true' EXIT
transportd serve --config config/single-node.toml
