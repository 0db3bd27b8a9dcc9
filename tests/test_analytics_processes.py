"""Tracking-log analytics on logs written by real clusters, and the scale benchmark at a small size.

A real 3-node cluster, mail sent, the primary killed: `transportd analyze` over the nodes' MSGTRK
folders reports the promotion, no loss and full coverage; a message partly delivered is held, not
lost. Each runs the CLI in its own process (the one Spark session here reads the job's output).
In a file of their own, apart from tests/test_analytics.py: the test run's processes
(pytest-xdist) take a file each, and these are the longest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_analytics import run_cli

pytest.importorskip("pyspark")

from transportd.analytics import job


@pytest.fixture(scope="module")
def spark():
    session = job.spark_session("local[2]", conf={"spark.sql.shuffle.partitions": "4"})
    yield session
    session.stop()


def test_real_cluster_primary_killed_analyze_reports_promotion_no_loss_full_coverage(procs, sink, tmp_path):
    from clusters import LocalCluster, accepted_with_shadow, send

    c = LocalCluster(procs, sink, tmp_path, {"shadow_redundancy": {
        "shadow_heartbeat_frequency": 0.5, "shadow_resubmit_time_span": 3}})
    c.start()
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]
    # The smart host is down: node1 keeps its message queued, shadowed on node3 (the other site).
    netid = accepted_with_shadow(n1, n3, send(n1, "carol@foreign.test"))
    other = accepted_with_shadow(n2, n3, send(n2, "dave@foreign.test"))
    n1.wait_event("DEFER", netid)
    n1.kill9()
    sink.start()
    n3.wait_event("RESUBMIT", netid, timeout=30)
    n3.wait_event("SENDEXTERNAL", netid, timeout=30)
    n2.wait_event("SENDEXTERNAL", other, timeout=30)
    n3.wait_event("HADISCARD", other, timeout=30)

    out = tmp_path / "analysis"
    folders = [str(n.cfg.tracking_dir) for n in (n1, n2, n3)]
    # An operator whose machine is not on UTC: the logs' times are UTC, and so is every time said
    res = run_cli("analyze", *folders, "--out", str(out), "--json", "--no-progress", "--master", "local[2]",
                  "--conf", "spark.sql.shuffle.partitions=4", env={"TZ": "Asia/Tokyo"})
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    stamps = sorted(line.split(",", 1)[0] for f in folders for p in Path(f).glob("MSGTRK*.LOG")
                    for line in p.read_text(encoding="utf-8-sig").splitlines() if line and not line.startswith("#"))
    assert (summary["log_start"], summary["log_end"]) == (stamps[0], stamps[-1])
    assert summary["failover_episodes"][0]["start"] >= stamps[0]
    assert summary["lost"] == 0 and summary["states"]["lost"] == 0
    assert summary["states"]["delivered"] == 2, summary["states"]
    assert summary["received"] == 2 and summary["redundancy_coverage"] == 1.0
    assert [(e["shadow_node"], e["primary"], e["reason"], e["messages"]) for e in summary["failover_episodes"]] == [
        (n3.name, n1.name, "ShadowHeartbeatFailure", 1)]
    assert summary["promoted"] == 1 and summary["duplicates"]["outside_boundary"] == 0
    assert (out / "report.html").is_file()


def test_real_cluster_partly_delivered_message_is_held_not_lost(spark, procs, sink, tmp_path):
    """One recipient delivered, the other waiting for the smart host (down): node1 still holds the
    message and node3 its shadow, so the job says in flight protected (it said in flight
    unprotected, and lost without the shadow, reading the DELIVER as the end of node1's copy)."""
    from clusters import LocalCluster, accepted_with_shadow, send

    c = LocalCluster(procs, sink, tmp_path, {"shadow_redundancy": {"shadow_heartbeat_frequency": 0.5}})
    c.start()
    n1, n3 = c["node1"], c["node3"]
    netid = accepted_with_shadow(n1, n3, send(n1, "ann@example.test,carol@foreign.test"))
    n1.wait_event("DELIVER", netid)
    n1.wait_event("DEFER", netid)

    out = tmp_path / "analysis"
    res = run_cli("analyze", *[str(n.cfg.tracking_dir) for n in c.nodes.values()], "--out", str(out), "--json",
                  "--no-progress", "--master", "local[2]", "--conf", "spark.sql.shuffle.partitions=4")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    assert summary["lost"] == 0 and summary["states"]["in flight protected"] == 1, summary["states"]
    [m] = [r.asDict() for r in spark.read.parquet(str(out / "messages")).collect() if r["network_message_id"] == netid]
    assert (m["recipients_delivered"], m["recipient_count"], m["live_copy_nodes"]) == (1, 2, sorted([n1.name, n3.name]))


# ------------------------------------------------------------------------------ benchmark


@pytest.mark.slow
def test_analytics_scale_benchmark_runs_small(tmp_path):
    out = tmp_path / "figures.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "analytics_scale.py"), "--messages", "1500",
                          "--json", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["matches_truth"] and figures["rows_per_s"] > 0 and figures["driver_jvm_peak_mib"] > 0


