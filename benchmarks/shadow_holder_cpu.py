"""CPU per shadow copy on the node that holds it: the transport connector's side of shadow redundancy.

Starts one real node (``transportd serve``, its own queue database with fsync, tracking log on)
and plays its peer from this process: C authenticated sessions to its transport connector
(EHLO, AUTH, XSHADOWREQUEST once each, as a primary's kept sessions are), then N shadow copies of
SIZE bytes (MAIL ``XSHADOW=``, RCPT, ``BDAT n LAST`` in one write, the 250 2.6.0 awaited), C at a
time, after a warm-up. Prints the node process's CPU per copy (user + system from /proc, its
writer thread included) and the wall time: what a shadow costs its holder, without the primary,
the delivery and the two other nodes of ``compare_postfix.py --entry node1`` around it. The node
never hears from its "primary" again (heartbeats fail, the resubmit span is an hour), so it only
holds the copies.

    python benchmarks/shadow_holder_cpu.py --messages 4000 --concurrency 4
    python benchmarks/shadow_holder_cpu.py --messages 40 --warm-up 10   # the CI smoke size
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accept_throughput import free_port, wait_port

from transportd.devtools.cluster import render_toml
from transportd.redundancy.peers import open_session
from transportd.redundancy.protocol import Peer

HOLDER = "holder.bench.test"
PRIMARY = "primary.bench.test"
SECRET = "bench-secret-0123456789"


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU of a process (all its threads), or of one of its threads, from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def message(size: int, i: int) -> bytes:
    # As a primary sends its copies: its Received field first, naming the network-message-id
    # (the holder reads it from there instead of making one).
    head = (f"Received: from client.bench.test ([127.0.0.1])\r\n\tby {PRIMARY} (Frontend) with ESMTP"
            f" id {uuid.uuid4()};\r\n\tSat, 28 Nov 2026 12:00:00 +0000\r\n"
            f"From: a@example.test\r\nTo: b@foreign.test\r\nSubject: copy {i}\r\n"
            f"Message-ID: <{uuid.uuid4()}@bench.test>\r\nDate: Sat, 28 Nov 2026 12:00:00 +0000\r\n\r\n")
    line = b"x" * 76 + b"\r\n"
    body = line * max(1, (size - len(head)) // len(line))
    return head.encode() + body


async def play(port: int, dbid: str, messages: int, warm_up: int, concurrency: int, size: int,
               pid: int) -> dict:
    peer = Peer(HOLDER, "site-a", f"127.0.0.1:{port}")
    sessions = [await open_session(peer, local_fqdn=PRIMARY, secret=SECRET, tls={}, timeout=30)
                for _ in range(concurrency)]
    for s in sessions:
        await s.shadow_request(dbid)
    bodies = [message(size, i) for i in range(64)]

    async def phase(count: int) -> None:
        todo = iter(range(count))

        async def worker(s) -> None:
            for i in todo:
                r = await s.copy("a@example.test", [], ["b@foreign.test"], bodies[i % len(bodies)],
                                 str(uuid.uuid4()))
                if not r.accepted:
                    raise SystemExit(f"copy {i} refused: {r.reply}")
        await asyncio.gather(*(worker(s) for s in sessions))

    await phase(warm_up)
    await asyncio.sleep(0.5)  # the warm-up's last commits land before the count starts
    marks = {"cpu0": cpu_seconds(pid), "main0": cpu_seconds(pid, pid), "t0": time.perf_counter()}
    await phase(messages)
    main = cpu_seconds(pid, pid) - marks["main0"]
    wall = time.perf_counter() - marks["t0"]
    cpu = cpu_seconds(pid) - marks["cpu0"]
    for s in sessions:
        await s.quit()
    return {"copies": messages, "size": size, "concurrency": concurrency, "wall_s": round(wall, 3),
            "copies_per_s": round(messages / wall, 1), "cpu_ms_per_copy": round(1000 * cpu / messages, 3),
            # the event loop's thread, and the others (the queue database's group-commit writer)
            "main_thread_cpu_ms_per_copy": round(1000 * main / messages, 3),
            "other_threads_cpu_ms_per_copy": round(1000 * max(0.0, cpu - main) / messages, 3)}


def _shadows_held(db: Path) -> int:
    import sqlite3
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM messages WHERE role = 'shadow'").fetchone()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=4000)
    ap.add_argument("--warm-up", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--size", type=int, default=10 * 1024)
    ap.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="holder-bench-"))
    fport, tport = free_port(), free_port()
    sections = {
        "node": {"name": HOLDER, "site": "site-a", "data_dir": str(work / "data"), "log_level": "warning"},
        "cluster": {"secret": SECRET},
        "frontend": {"listen": f"127.0.0.1:{fport}", "workers": 1},
        "transport": {"listen": f"127.0.0.1:{tport}"},
        "routing": {"accepted_domains": ["example.test"]},
        "shadow_redundancy": {"shadow_heartbeat_frequency": 3600, "shadow_resubmit_time_span": 3600},
    }
    config = work / "node.toml"
    config.write_text(render_toml(sections, [{"name": PRIMARY, "site": "site-a", "transport": "127.0.0.1:9"}]))
    log = open(work / "node.log", "wb")  # noqa: SIM115 - held by the child for its life
    proc = subprocess.Popen([sys.executable, "-m", "transportd", "serve", "--config", str(config)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=str(Path.cwd()))
    try:
        try:
            wait_port(tport, timeout=30)
        except SystemExit:
            raise SystemExit(f"the node did not listen (exit code {proc.poll()}):\n"
                             f"{(work / 'node.log').read_text()}") from None
        load = os.getloadavg()[0]
        result = asyncio.run(play(tport, str(uuid.uuid4()), args.messages, args.warm_up, args.concurrency,
                                  args.size, proc.pid))
        result["load_before"] = round(load, 2)
        result["load_after"] = round(os.getloadavg()[0], 2)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()
        held = _shadows_held(work / "data" / "queue.db")
        shutil.rmtree(work, ignore_errors=True)
    result["shadows_held"] = held  # warm-up and measured copies, as the node's queue database has them
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['copies']} copies of {result['size']} bytes, {result['concurrency']} sessions: "
              f"{result['cpu_ms_per_copy']} ms of the holder's CPU per copy (event loop "
              f"{result['main_thread_cpu_ms_per_copy']}, writer {result['other_threads_cpu_ms_per_copy']}), "
              f"{result['copies_per_s']} copies/s "
              f"(load {result['load_before']} -> {result['load_after']}; {held} shadows held)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
