"""CPU per accepted message of the accept path alone: headers, the local commit, metrics and logs.

Runs ``transportd.node.accept.AcceptPath`` in this process over a real queue database (group-commit
writer, fsync) with shadow redundancy on, the shadow copies standing in for a peer that answers
after ``--copy-ms`` (awaited, no CPU here), N messages of SIZE bytes, C at a time, after a warm-up;
tracking rows go to no file (``TrackingLog.write`` has its own figures in docs/performance.md).
Prints the process's CPU per accepted message (the writer thread included), the wall time, and the
writer's jobs and batches per message: what issue 16's "one writer job on the primary per accepted
message" is about, without the SMTP sessions, the peer and the delivery around it.

    python benchmarks/accept_path_cpu.py --messages 3000 --concurrency 8
    python benchmarks/accept_path_cpu.py --messages 50 --warm-up 10   # the CI smoke size
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiosmtpd.smtp import Envelope, Session  # noqa: E402

from transportd.config import load_dict  # noqa: E402
from transportd.node.accept import AcceptPath  # noqa: E402
from transportd.node.events import NodeEvents, NullTrackingLog  # noqa: E402
from transportd.node.metrics import NodeMetrics  # noqa: E402
from transportd.queue.store import QueueStore  # noqa: E402
from transportd.redundancy.copies import ShadowResult  # noqa: E402


class AnsweringPeer:
    """A shadow copy that one peer holds after ``delay`` seconds."""

    enabled = True

    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def make_shadow(self, msg: object, guid: str, recipients: list[str]) -> ShadowResult:
        await asyncio.sleep(self.delay)
        return ShadowResult("peer2.bench.test", "250 2.6.0 queued",
                            holders=(("peer2.bench.test", 1, "250 2.6.0 queued"),))


async def measure(args: argparse.Namespace, data_dir: Path) -> dict:
    cfg = load_dict({"node": {"name": "node1.bench.test", "data_dir": str(data_dir)},
                     "frontend": {"listen": "127.0.0.1:2525"},
                     "routing": {"accepted_domains": ["example.test"], "smart_host": "127.0.0.1:9"},
                     "shadow_redundancy": {"shadow_redundancy_enabled": True}})
    store = QueueStore.open(data_dir / "queue.db")
    writer = store.start_writer()
    events = NodeEvents(cfg, NodeMetrics(cfg.node.name), store, NullTrackingLog())  # no tracking file
    path = AcceptPath(cfg, store, events, AnsweringPeer(args.copy_ms / 1000))
    body = b"Subject: accept path\r\n\r\n" + b"x" * max(0, args.size - 26) + b"\r\n"
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(args.concurrency)

    async def one() -> None:
        async with gate:
            envelope = Envelope()
            envelope.mail_from, envelope.rcpt_tos = "bob@remote.test", ["carol@elsewhere.test"]
            envelope.original_content = body
            session = Session(loop)
            session.peer, session.host_name = ("127.0.0.1", 40000), "client.bench.test"
            await path.accept(envelope, session, "frontend")
    try:
        await asyncio.gather(*(one() for _ in range(args.warm_up)))
        jobs, batches = writer.jobs_done, writer.batches
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.gather(*(one() for _ in range(args.messages)))
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        n = args.messages
        return {"messages": n, "concurrency": args.concurrency, "size": args.size, "copy_ms": args.copy_ms,
                "cpu_us_per_message": round(1e6 * cpu / n, 1), "wall_s": round(wall, 3),
                "writer_jobs_per_message": round((writer.jobs_done - jobs) / n, 3),
                "commits_per_message": round((writer.batches - batches) / n, 3),
                "load_average": os.getloadavg()[0]}
    finally:
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--size", type=int, default=10240)
    ap.add_argument("--copy-ms", type=float, default=2.0, help="the peer's answer to a shadow copy")
    ap.add_argument("--warm-up", type=int, default=200)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="transportd-accept-bench-"))
    try:
        figures = asyncio.run(measure(args, data_dir))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    for key, value in figures.items():
        print(f"{key:28} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
