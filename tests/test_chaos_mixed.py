"""A chaos run at CI size on a mixed cluster with receive workers: nothing acknowledged is lost.

node1 runs shadow redundancy version 2010 (delayed acknowledgement, promotion where it is
bypassed), node2 and node3 run 2013; every node has two receive processes. Seed 7's schedule
(checked below, since it is pure) wipes node1 behind a refusing sink, kills node1's receive
workers twice under load, kill-wipes node3, pauses node1 and partitions node2 from node3.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from transportd.devtools.chaos.nemesis import schedule

SEED = 7
TYPES = "kill-worker,kill,kill-wipe,wipe-behind-refusing-sink,partition,pause,sink-refuse"


@pytest.mark.chaos
def test_mixed_2010_2013_cluster_with_worker_kills_loses_nothing(tmp_path):
    plan = schedule(SEED, 6, ["node1", "node2", "node3"], resubmit_span=4.0, types=TYPES.split(","),
                    first="wipe-behind-refusing-sink")
    kinds = [(f.type, f.targets[0] if f.targets else None) for f in plan]
    assert kinds.count(("kill-worker", "node1")) == 2 and ("wipe-behind-refusing-sink", "node1") in kinds
    out = tmp_path / "summary.json"
    res = subprocess.run([sys.executable, "-m", "transportd", "chaos", "--messages", "300", "--faults", "6",
                          "--seed", str(SEED), "--versions", "2010,2013,2013", "--fault-types", TYPES,
                          "--ip-base", "131", "--dir", str(tmp_path / "run"), "--json", str(out),
                          "--drain-timeout", "90"], capture_output=True, text=True, timeout=900)
    report = (res.stdout + res.stderr)[-3000:]
    s = json.loads(out.read_text())
    assert s["nemesis_error"] is None, report
    notes = [f["note"] for f in s["faults"] if f["type"] == "kill-worker"]
    assert len(notes) == 2 and all(n.startswith("worker pid") for n in notes), report  # a worker was there to kill
    assert s["acknowledged"] >= 270, report
    assert (s["lost"], s["unexpected"], s["duplicates"]["mailbox"], s["internal_errors"]) == (0, 0, 0, 0), report
    assert res.returncode == 0, report
    node1 = (tmp_path / "run" / "logs" / "node1.log").read_text(errors="replace")
    assert "acknowledged after" in node1  # node1 ran 2010: delayed acknowledgements
    assert "receive worker 1 exited (signal 9)" in node1
