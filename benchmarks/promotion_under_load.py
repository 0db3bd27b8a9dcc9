"""A ShadowStateChange promotion of many shadows while clients send.

A 3-node, 2-site cluster on loopback delivering to Postfix's smtp-sink. Before it starts, node3's
queue database is given N shadow copies of node1's messages, recorded under an older queue
database ID of node1 (as if node1 had lost its queue): node1's first shadow request (or node3's
first heartbeat) tells node3 the new ID, and node3 promotes all N at once. Meanwhile clients send
10 KiB messages to every node's frontend with a new connection each, timing every
acknowledgement. Printed: ack latency of the other sessions (p50/p99/max), shadow requests that
failed (HAREDIRECTFAIL on any node: a request timed out or was refused), how long the promotion
took, node3's peak RSS, the load average. Targets (docs/reliability.md): p99 < 1 s, no shadow request
failed, RSS < 150 MB per node (with --shadows 100000).

    python3 benchmarks/promotion_under_load.py --shadows 20000 --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accept_throughput import _count_events, free_port, wait_port  # noqa: E402
from compare_postfix import Sink, _latency_run, percentile, status_kb, stop_proc  # noqa: E402

from transportd import config as config_mod  # noqa: E402
from transportd.queue import messages as mq  # noqa: E402
from transportd.devtools.cluster import generate  # noqa: E402
from transportd.queue.routing import bifurcate  # noqa: E402
from transportd.queue.store import QueueStore, shadow_contexts  # noqa: E402


def plant_shadows(cfg, primary: str, n: int) -> None:
    """N shadows of ``primary`` in node3's queue database, from an older queue database of it."""
    old_dbid = str(uuid.uuid4())
    store = QueueStore.open(cfg.db_path, node_name=cfg.node.name)
    now = time.time()
    body = (b"From: <bench@example.test>\r\nTo: <rcpt@sink.test>\r\nSubject: planted shadow\r\n\r\n"
            + b"x" * 78 + b"\r\n") * 1
    try:
        store.transaction(lambda c: c.execute(shadow_contexts.insert().values(
            peer=primary, queue_database_id=old_dbid, consecutive_failures=0, last_heartbeat_at=now)))
        for start in range(0, n, 5000):
            def job(conn, start=start):
                for i in range(start, min(n, start + 5000)):
                    rcpt = f"r{i}@sink.test"
                    mq.enqueue(conn, mq.NewMessage(
                        network_message_id=str(uuid.uuid4()), sender="bench@example.test", data=body,
                        recipients=bifurcate([rcpt], cfg), received_at=now, expires_at=now + 86400,
                        subject="planted shadow", origin="shadow", role="shadow", redundancy="shadow",
                        shadow_guid=str(uuid.uuid4()), primary_node=primary, primary_dbid=old_dbid))
            store.transaction(job)
    finally:
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shadows", type=int, default=20000)
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the clients send")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--rate-messages", type=int, default=3000, help="at most this many messages in all")
    ap.add_argument("--json", default="benchmarks/results/promotion_under_load.json")
    ap.add_argument("--keep", action="store_true", help="keep the nodes' folders and logs (kept anyway when the run fails)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="transportd-promotion-"))
    finished = False
    sink = Sink(free_port())
    procs: list[subprocess.Popen] = []
    load_start = os.getloadavg()
    try:
        specs = generate(work, nodes=3, sites=2, ip_base=random.randint(20, 200), frontend_port=free_port(),
                         transport_port=free_port(), sink_address=f"127.0.0.1:{sink.port}",
                         overrides={"node": {"log_level": "warning"},
                                    "routing": {"trusted_networks": ["127.0.0.0/8"]},
                                    "frontend": {"max_inbound_connection_per_source": 200},
                                    "shadow_redundancy": {"shadow_heartbeat_frequency": 1,
                                                          "shadow_resubmit_time_span": 3600}})
        node1, node3 = specs[0], specs[2]
        cfg3 = config_mod.load(node3.config)
        t0 = time.monotonic()
        plant_shadows(cfg3, node1.name, args.shadows)
        print(f"planted {args.shadows} shadows of {node1.name} in {node3.short}'s queue database "
              f"({time.monotonic() - t0:.1f} s)", flush=True)
        for spec in specs:
            procs.append(subprocess.Popen([sys.executable, "-m", "transportd", "serve", "--config", spec.config],
                                          stderr=open(work / f"{spec.short}.log", "w"), stdin=subprocess.DEVNULL))
        for spec in specs:
            host, _, port = spec.frontend.rpartition(":")
            wait_port(int(port), host=host)
        peak = {"rss_mb": 0.0}
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak["rss_mb"] = max(peak["rss_mb"], status_kb(procs[2].pid, "VmRSS") / 1024)
                stop.wait(0.25)
        threading.Thread(target=sample, daemon=True).start()
        msgtrk3 = Path(cfg3.tracking_dir)
        started = time.monotonic()
        promoted_at: list[float] = []

        def watch() -> None:
            while not stop.is_set():
                if _count_events(msgtrk3, "RESUBMIT") >= args.shadows:
                    promoted_at.append(time.monotonic() - started)
                    return
                stop.wait(0.5)
        threading.Thread(target=watch, daemon=True).start()
        acks, failures, took = asyncio.run(_latency_run([s.frontend for s in specs], args.rate_messages,
                                                        args.sessions, 10240, False, args.seconds))
        deadline = time.monotonic() + 300
        while not promoted_at and time.monotonic() < deadline:
            time.sleep(0.5)
        stop.set()
        haredirectfail = sum(_count_events(Path(config_mod.load(s.config).tracking_dir), "HAREDIRECTFAIL")
                             for s in specs)
        result = {
            "shadows": args.shadows, "load_seconds": round(took, 1), "acknowledged": len(acks),
            "client_failures": len(failures), "failure_examples": failures[:5],
            "ack_p50_ms": round(percentile(acks, 50) * 1000, 1), "ack_p99_ms": round(percentile(acks, 99) * 1000, 1),
            "ack_max_ms": round(max(acks, default=float("nan")) * 1000, 1),
            "shadow_requests_failed": haredirectfail,
            "promotion_seconds": round(promoted_at[0], 1) if promoted_at else None,
            "node3_peak_rss_mb": round(peak["rss_mb"], 1),
            "loadavg_before": [round(x, 2) for x in load_start], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "nproc": os.cpu_count(),
        }
        print(json.dumps(result, indent=2))
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        finished = True
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            stop_proc(p, 20)
        sink.stop()
        if args.keep or not finished:
            print(f"nodes' folders and logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
