#!/usr/bin/env bash
# The README's main job: a transportd node on 127.0.0.1:2525 with a sink on 127.0.0.1:2500
# standing in for the internet. Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p data
transportd sink --listen 127.0.0.1:2500 --dir data/sink &
SINK_PID=$!
trap 'kill "$SINK_PID" 2>/dev/null || true; wait "$SINK_PID" 2>/dev/null || true' EXIT
cat <<'MSG'

  transportd is starting on 127.0.0.1:2525. Try, in another terminal:
    swaks --server 127.0.0.1:2525 --to alice@example.test        # local mailbox: data/single-node/mailboxes/
    swaks --server 127.0.0.1:2525 --to someone@elsewhere.test    # relayed to the sink: data/sink/new/
    transportd queue list --config config/single-node.toml
    transportd tracking search --config config/single-node.toml

MSG
transportd serve --config config/single-node.toml
