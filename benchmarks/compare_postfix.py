"""transportd (3-node cluster, shadow redundancy on and off) against Postfix, same machine, same load.

Each load shape runs against each system one after the other in the same run:

1. ``on``: a 3-node transportd cluster on loopback with shadow redundancy on (two durable
   copies before each 250);
2. ``off``: the same cluster with shadow redundancy off (one durable copy);
3. ``postfix``: Debian's Postfix, configured here in a private temporary directory as a relay
   to the same smtp-sink, queue on the same disk (one durable copy). It listens on a
   loopback address only and never reads or changes /etc/postfix; it is stopped and its
   directory removed at the end.

The next hop is Postfix's smtp-sink. Load: Postfix's smtp-source for throughput, then a small
asyncio client of ours that times every end-of-DATA acknowledgement (p50/p99). Figures per
system and shape: accepted messages/s, delivered messages/s at the sink, ack latency p50/p99,
CPU seconds per 1,000 messages (every process of the system, threads and reaped children
included; load generator and sink excluded), peak RSS per node (per Postfix process and summed),
and the ratios on/postfix and on/off. Printed side by side and written to JSON.

    python3 benchmarks/compare_postfix.py                      # 10 KiB new+reused, 100 KiB
    python3 benchmarks/compare_postfix.py --long 60            # plus a >= 60 s run (make bench-compare)
    python3 benchmarks/compare_postfix.py --queued 20000       # RSS with N messages queued, next hop down
    python3 benchmarks/compare_postfix.py --drain 5000 --shapes '' --systems on   # drain a backlog
    python3 benchmarks/compare_postfix.py --messages 40 --latency-messages 20 --shapes 10k-new  # CI size

Load goes to every node's frontend of the cluster (sessions split over the nodes, the way a
load balancer or MX records would spread it) unless ``--entry node1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accept_throughput import _count_events, free_port, wait_port

from transportd.devtools.postfix import PostfixMTA

CLK = os.sysconf("SC_CLK_TCK")
SHAPES = {
    # name: (size in bytes, reuse connections, default message count)
    "10k-new": (10240, False, 2000),
    "10k-reuse": (10240, True, 2000),
    "100k-new": (102400, False, 500),
}
SOURCE = shutil.which("smtp-source") or "/usr/sbin/smtp-source"
SINK = shutil.which("smtp-sink") or "/usr/sbin/smtp-sink"


# ---------------------------------------------------------------------- /proc helpers

def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tree_pids(root: int) -> list[int]:
    """``root`` and every live descendant."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = _stat(int(entry))
            if f:
                children.setdefault(int(f[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_cpu(root: int) -> float:
    """CPU seconds of a process tree: live processes plus the children it has reaped."""
    total = 0.0
    for p in tree_pids(root):
        f = _stat(p)
        if f:
            total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
    return total / CLK


def status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------------- the next hop

class Sink:
    """smtp-sink with -c: a reader thread keeps the count of messages received."""

    def __init__(self, port: int):
        cmd = [SINK] + (["-u", "nobody"] if os.geteuid() == 0 else []) + ["-c", f"127.0.0.1:{port}", "512"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.port = port
        self.count = 0
        threading.Thread(target=self._read, daemon=True).start()
        wait_port(port)

    def _read(self) -> None:
        buf = b""
        assert self.proc.stdout is not None
        while True:
            chunk = self.proc.stdout.read1(4096)
            if not chunk:
                return
            buf = (buf + chunk)[-200:]
            found = re.findall(rb"mesg=(\d+)", buf)
            if found:
                self.count = int(found[-1])

    def wait_for(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.count >= n:
                return True
            time.sleep(0.05)
        return self.count >= n

    def stop(self) -> None:
        stop_proc(self.proc)


def stop_proc(p: subprocess.Popen, timeout: float = 10) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=5)


# ---------------------------------------------------------------------- systems

class TransportdCluster:
    def __init__(self, work: Path, sink_port: int, shadow: bool, sessions: int, entry: str, workers: int = 1,
                 delivery: dict | None = None):
        import random
        from transportd.devtools.cluster import generate
        self.name = ("on" if shadow else "off") + (f"-w{workers}" if workers > 1 else "")
        self.work = work / f"transportd-{self.name}"
        self.procs: list[subprocess.Popen] = []
        self.entry = entry
        base = random.randint(20, 200)
        self.specs = generate(self.work, nodes=3, sites=2, ip_base=base, frontend_port=free_port(),
                              transport_port=free_port(), sink_address=f"127.0.0.1:{sink_port}",
                              overrides={"node": {"log_level": "warning"},
                                         "routing": {"trusted_networks": ["127.0.0.0/8"]},
                                         "frontend": {"max_inbound_connection_per_source": max(50, sessions * 4),
                                                      "workers": workers},
                                         "shadow_redundancy": {"shadow_redundancy_enabled": shadow,
                                                               "shadow_heartbeat_frequency": 5},
                                         **({"delivery": delivery} if delivery else {})})

    def start(self) -> None:
        for spec in self.specs:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "transportd", "serve", "--config", spec.config],
                stderr=open(self.work / f"{spec.short}.log", "w"), stdin=subprocess.DEVNULL))
        for spec in self.specs:
            host, _, port = spec.frontend.rpartition(":")
            wait_port(int(port), host=host)

    def targets(self) -> list[str]:
        fronts = [s.frontend for s in self.specs]
        return fronts if self.entry == "all" else fronts[:1]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def cpu(self) -> float:
        return sum(tree_cpu(p) for p in self.pids())

    def cpu_by_node(self) -> dict[str, float]:
        """CPU seconds per node (its process tree: receive workers included)."""
        return {s.short: tree_cpu(p) for s, p in zip(self.specs, self.pids())}

    def rss(self) -> dict[str, float]:
        return {s.short: round(status_kb(p, "VmHWM") / 1024, 1) for s, p in zip(self.specs, self.pids())}

    def rss_now(self) -> dict[str, float]:
        return {s.short: round(status_kb(p, "VmRSS") / 1024, 1) for s, p in zip(self.specs, self.pids())}

    def shadows_made(self) -> int:
        return sum(_count_events(self.work / s.short / "msgtrk", "HAREDIRECT") for s in self.specs)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            stop_proc(p, 15)


class PostfixRelay(PostfixMTA):
    """Debian's Postfix from a private config/queue directory; loopback only; relays to the sink."""

    name = "postfix"

    def __init__(self, work: Path, sink_port: int, sessions: int):
        super().__init__(work, f"127.0.0.1:{sink_port}", name="postfix.bench.test",
                         process_limit=max(100, sessions * 4))

    def targets(self) -> list[str]:
        return [self.address]

    def cpu(self) -> float:
        return tree_cpu(self.master_pid)

    def rss(self) -> dict[str, float]:
        return {}

    def rss_now(self) -> dict[str, float]:
        # Proportional set size: Postfix's processes share their libraries; RSS would count them twice.
        return {"total_pss": round(sum(_pss_kb(p) for p in tree_pids(self.master_pid)) / 1024, 1)}

    def shadows_made(self) -> int:
        return 0


class RssSampler(threading.Thread):
    """Samples a system's RSS every ``every`` s: peaks per process and the time series."""

    def __init__(self, system: Any, every: float = 0.5):
        super().__init__(daemon=True)
        self.system, self.every = system, every
        self.peak: dict[str, float] = {}
        self.series: list[tuple[float, dict[str, float]]] = []
        self.stop_event = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop_event.is_set():
            now = self.system.rss_now()
            self.series.append((round(time.monotonic() - self.t0, 1), now))
            for k, v in now.items():
                self.peak[k] = max(self.peak.get(k, 0.0), v)
            if isinstance(self.system, PostfixRelay):
                for p in tree_pids(self.system.master_pid):
                    v = status_kb(p, "VmHWM") / 1024
                    self.peak["largest_process"] = round(max(self.peak.get("largest_process", 0.0), v), 1)
            self.stop_event.wait(self.every)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(5)


# ---------------------------------------------------------------------- load

def split_sessions(sessions: int, targets: list[str]) -> list[tuple[str, int]]:
    n = len(targets)
    return [(t, sessions // n + (1 if i < sessions % n else 0)) for i, t in enumerate(targets)
            if sessions // n + (1 if i < sessions % n else 0) > 0]


def run_smtp_source(targets: list[str], messages: int, sessions: int, size: int, reuse: bool,
                    timeout: float) -> float:
    """smtp-source instances (one per target, sessions and messages split); returns the wall time."""
    parts = split_sessions(sessions, targets)
    procs = []
    t0 = time.monotonic()
    left = messages
    for i, (target, s) in enumerate(parts):
        m = left if i == len(parts) - 1 else round(messages * s / sessions)
        left -= m
        cmd = [SOURCE, "-s", str(s), "-m", str(m), "-l", str(size), "-f", "bench@example.test",
               "-t", "rcpt@sink.test", "-N"] + (["-d"] if reuse else []) + [target]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.kill()
                    q.wait()
            raise RuntimeError("smtp-source timed out") from None
        if p.returncode != 0:
            raise RuntimeError(f"smtp-source failed: {err[-500:]}")
    return time.monotonic() - t0


def make_message(size: int) -> bytes:
    head = (b"From: <bench@example.test>\r\nTo: <rcpt@sink.test>\r\nSubject: latency probe\r\n\r\n")
    line = b"x" * 78 + b"\r\n"
    body = line * max(1, (size - len(head)) // len(line))
    return head + body + b".\r\n"


async def _reply(reader: asyncio.StreamReader) -> bytes:
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionError("connection closed")
        if line[3:4] != b"-":
            return line


async def _latency_session(target: str, count: int, reuse: bool, data: bytes, out: list[float],
                           failures: list[str], stop_at: float) -> None:
    host, _, port = target.rpartition(":")
    reader = writer = None
    try:
        for _ in range(count):
            if time.monotonic() > stop_at:
                return
            if writer is None:
                reader, writer = await asyncio.open_connection(host, int(port))
                await _reply(reader)
                writer.write(b"EHLO latency.client.test\r\n")
                await _reply(reader)
            writer.write(b"MAIL FROM:<bench@example.test>\r\nRCPT TO:<rcpt@sink.test>\r\nDATA\r\n")
            for _ in range(3):
                await _reply(reader)
            writer.write(data)
            t0 = time.perf_counter()
            reply = await _reply(reader)
            dt = time.perf_counter() - t0
            if reply.startswith(b"250"):
                out.append(dt)
            else:
                failures.append(reply.decode("ascii", "replace").strip())
            if not reuse:
                writer.write(b"QUIT\r\n")
                await _reply(reader)
                writer.close()
                writer = None
    except (OSError, ConnectionError) as exc:
        failures.append(str(exc))
    finally:
        if writer is not None:
            writer.write(b"QUIT\r\n")
            writer.close()


async def _latency_run(targets: list[str], messages: int, sessions: int, size: int, reuse: bool,
                       timeout: float) -> tuple[list[float], list[str], float]:
    data = make_message(size)
    out: list[float] = []
    failures: list[str] = []
    stop_at = time.monotonic() + timeout
    tasks = []
    per = [messages // sessions + (1 if i < messages % sessions else 0) for i in range(sessions)]
    for i in range(sessions):
        tasks.append(_latency_session(targets[i % len(targets)], per[i], reuse, data, out, failures, stop_at))
    t0 = time.monotonic()
    await asyncio.gather(*tasks)
    return out, failures, time.monotonic() - t0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


# ---------------------------------------------------------------------- one measurement

def measure(system: Any, sink: Sink, *, messages: int, sessions: int, size: int, reuse: bool,
            latency_messages: int, timeout: float, duration: float = 0) -> dict[str, Any]:
    """smtp-source's ``messages`` then the latency client's; with ``duration``, only the latency
    client, for that many seconds (the long run: bounded in time, every ack timed)."""
    sampler = RssSampler(system, every=0.5 if not duration else 5)
    sampler.start()
    base = sink.count
    by_node = getattr(system, "cpu_by_node", None)
    node_cpu0 = by_node() if by_node else {}
    cpu0 = system.cpu()
    t0 = time.monotonic()
    if duration:
        lat, failures, t_accept = asyncio.run(_latency_run(system.targets(), 10**9, sessions, size, reuse,
                                                           duration))
        messages, latency_messages = len(lat), 0
    else:
        t_accept = run_smtp_source(system.targets(), messages, sessions, size, reuse, timeout)
    backlog = messages - (sink.count - base)
    delivered_all = sink.wait_for(base + messages, timeout)
    t_deliver = time.monotonic() - t0
    delivered = sink.count - base
    cpu = system.cpu() - cpu0
    figures: dict[str, Any] = {
        "messages": messages, "accepted_per_s": round(messages / t_accept, 1),
        "accept_seconds": round(t_accept, 2),
        "delivered": delivered, "delivered_per_s": round(delivered / t_deliver, 1),
        "backlog_at_load_end": backlog,
        "cpu_s_per_1000": round(cpu / max(1, messages) * 1000, 2),
    }
    if by_node:  # where the CPU goes: with --entry node1, node1 is the primary, the others hold shadows
        figures["cpu_ms_per_message_by_node"] = {
            name: round((seconds - node_cpu0.get(name, 0.0)) / max(1, messages) * 1000, 2)
            for name, seconds in by_node().items()}
    if duration:
        figures.update({"latency_messages": len(lat), "latency_failures": len(failures),
                        "ack_p50_ms": round(percentile(lat, 50) * 1000, 2),
                        "ack_p99_ms": round(percentile(lat, 99) * 1000, 2)})
    if latency_messages:
        base2 = sink.count
        lat, failures, t_lat = asyncio.run(_latency_run(system.targets(), latency_messages, sessions, size,
                                                        reuse, timeout))
        sink.wait_for(base2 + len(lat), timeout)
        figures.update({
            "latency_messages": len(lat), "latency_failures": len(failures),
            "latency_accepted_per_s": round(len(lat) / t_lat, 1) if t_lat else 0,
            "ack_p50_ms": round(percentile(lat, 50) * 1000, 2),
            "ack_p99_ms": round(percentile(lat, 99) * 1000, 2),
        })
        if failures:
            figures["latency_failure_sample"] = failures[:3]
    sampler.stop()
    figures["peak_rss_mb"] = system.rss() or {k: v for k, v in sampler.peak.items()}
    if len(sampler.series) >= 4:
        # RSS after the first quarter of the run against the end: growth over the run
        figures["rss_quarter_mb"] = sampler.series[len(sampler.series) // 4][1]
        figures["rss_end_mb"] = sampler.series[-1][1]
    if duration:
        figures["rss_series"] = sampler.series
    figures["shadows_made"] = system.shadows_made()
    figures["all_delivered"] = delivered_all
    return figures


def make_system(kind: str, work: Path, sink_port: int, args: argparse.Namespace) -> Any:
    if kind == "postfix":
        return PostfixRelay(work, sink_port, args.sessions)
    shadow, _, workers = kind.partition("-w")  # on, off, on-w2 (2 receive processes per node), ...
    return TransportdCluster(work, sink_port, shadow == "on", args.sessions, args.entry, int(workers or 1))


def run_one(kind: str, shape: str, args: argparse.Namespace, messages: int | None = None,
            long_seconds: float = 0) -> dict[str, Any]:
    size, reuse, default_n = SHAPES[shape] if shape in SHAPES else SHAPES["10k-new"]
    n = messages or (args.messages if args.messages else default_n)
    if shape == "100k-new" and not messages and args.messages:
        n = max(1, args.messages // 4)
    work = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-"))
    sink = Sink(free_port())
    system = make_system(kind, work, sink.port, args)
    try:
        system.start()
        lat_n = args.latency_messages if args.latency_messages is not None else min(n, 1000)
        if shape == "100k-new":
            lat_n = max(1, lat_n // 4)
        figures = measure(system, sink, messages=n, sessions=args.sessions, size=size, reuse=reuse,
                          latency_messages=lat_n, timeout=args.timeout, duration=long_seconds)
        figures.update({"system": kind, "shape": shape, "size": size, "reuse": reuse,
                        "sessions": args.sessions})
        if isinstance(system, PostfixRelay):
            figures["postfix_master_pid"] = system.master_pid
        return figures
    finally:
        system.stop()
        sink.stop()
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
        else:
            print("kept", work, file=sys.stderr)


def queued_memory(args: argparse.Namespace) -> dict[str, Any]:
    """RSS per node with ``--queued`` messages held (next hop down), shadow redundancy on."""
    work = Path(tempfile.mkdtemp(prefix="bench-queued-"))
    down_port = free_port()  # nothing listens there: every delivery attempt fails and retries
    system = TransportdCluster(work, down_port, True, args.sessions, args.entry)
    sampler = RssSampler(system, every=2)
    try:
        system.start()
        sampler.start()
        t0 = time.monotonic()
        done, step = 0, max(1000, args.queued // 10)
        checkpoints = []
        while done < args.queued:
            n = min(step, args.queued - done)
            run_smtp_source(system.targets(), n, args.sessions, 10240, True, args.timeout)
            done += n
            checkpoints.append({"queued": done, "seconds": round(time.monotonic() - t0, 1),
                                "rss_mb": system.rss_now()})
            print(f"  queued {done}: rss {system.rss_now()}", file=sys.stderr, flush=True)
        return {"queued": done, "seconds": round(time.monotonic() - t0, 1), "checkpoints": checkpoints,
                "peak_rss_mb": system.rss()}
    finally:
        sampler.stop()
        system.stop()
        shutil.rmtree(work, ignore_errors=True)


def drain_backlog(args: argparse.Namespace) -> dict[str, Any]:
    """A backlog after an outage: ``--drain`` messages accepted while the next hop is down (shadow
    redundancy on, retries every second), then the next hop comes back; the seconds until the
    sink has them all, the messages per second and the cluster's CPU per message while draining.
    The queue lookups per delivery must not grow with the queue (tests/test_query_plans.py)."""
    work = Path(tempfile.mkdtemp(prefix="bench-drain-"))
    port = free_port()  # nothing listens there until the drain starts
    system = TransportdCluster(work, port, True, args.sessions, args.entry, delivery={
        "transient_failure_retry_interval": "1s", "outbound_connection_failure_retry_interval": "1s"})
    sink = None
    try:
        system.start()
        t0 = time.monotonic()
        run_smtp_source(system.targets(), args.drain, args.sessions, 10240, True, args.timeout)
        queued_s = time.monotonic() - t0
        time.sleep(2)  # the last deliveries fail and wait for their retry
        cpu0, t1 = system.cpu(), time.monotonic()
        sink = Sink(port)
        drained = sink.wait_for(args.drain, args.timeout)
        seconds = time.monotonic() - t1
        cpu = system.cpu() - cpu0
        return {"messages": args.drain, "queued_seconds": round(queued_s, 1), "drained": drained,
                "sink_count": sink.count, "drain_seconds": round(seconds, 2),
                "drain_per_s": round(sink.count / seconds, 1) if seconds else None,
                "cpu_ms_per_message": round(1000 * cpu / max(sink.count, 1), 2),
                "load_average": list(os.getloadavg())}
    finally:
        if sink is not None:
            sink.stop()
        system.stop()
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------- report

def machine() -> dict[str, Any]:
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except OSError:
        mem_kb = 0
    version = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "postfix"], capture_output=True,
                             text=True).stdout.strip()
    return {"nproc": os.cpu_count(), "cpu_model": cpu_model, "ram_gb": round(mem_kb / 1024 / 1024, 1),
            "kernel": platform.release(), "python": platform.python_version(), "postfix": version,
            "loadavg_at_start": os.getloadavg()}


def median(values: list[float]) -> float:
    s = sorted(v for v in values if not math.isnan(v))
    if not s:
        return float("nan")
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


KEYS = ["accepted_per_s", "delivered_per_s", "ack_p50_ms", "ack_p99_ms", "cpu_s_per_1000",
        "backlog_at_load_end"]


def summarize(runs: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shape in dict.fromkeys(r["shape"] for r in runs):
        per: dict[str, Any] = {}
        for kind in systems:
            rs = [r for r in runs if r["shape"] == shape and r["system"] == kind]
            if not rs:
                continue
            per[kind] = {k: median([r[k] for r in rs if k in r]) for k in KEYS if any(k in r for r in rs)}
            per[kind]["peak_rss_mb"] = rs[-1]["peak_rss_mb"]
            per[kind]["runs"] = len(rs)
        ratios = {}
        pairs = [("on", "postfix"), ("on", "off")]
        pairs += [(k, "off" + k[2:]) for k in per if k.startswith("on-w")]  # on/off at each worker count
        pairs += [(k, k.partition("-w")[0]) for k in per if "-w" in k]  # what the workers change
        for a, b in pairs:
            if a in per and b in per:
                ratios[f"{a}/{b}"] = {
                    "accepted_per_s": _ratio(per[a]["accepted_per_s"], per[b]["accepted_per_s"]),
                    "delivered_per_s": _ratio(per[a]["delivered_per_s"], per[b]["delivered_per_s"]),
                    "ack_p99_ms": _ratio(per[a].get("ack_p99_ms"), per[b].get("ack_p99_ms")),
                }
        out[shape] = {"systems": per, "ratios": ratios}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or not b:
        return None
    return round(a / b, 2)


def print_table(summary: dict[str, Any], systems: list[str]) -> None:
    rows = [("accepted msg/s", "accepted_per_s"), ("delivered msg/s", "delivered_per_s"),
            ("ack p50 ms", "ack_p50_ms"), ("ack p99 ms", "ack_p99_ms"), ("CPU s/1000 msg", "cpu_s_per_1000"),
            ("backlog at load end", "backlog_at_load_end")]
    for shape, block in summary.items():
        per = block["systems"]
        print(f"\n== {shape} ==")
        print(f"{'':22}" + "".join(f"{k:>14}" for k in systems if k in per)
              + "".join(f"{r:>12}" for r in block["ratios"]))
        for label, key in rows:
            line = f"{label:22}" + "".join(f"{_fmt(per[k].get(key)):>14}" for k in systems if k in per)
            line += "".join(f"{_fmt(v.get(key)):>12}" for v in block["ratios"].values())
            print(line)
        rss = "; ".join(f"{k}: {per[k]['peak_rss_mb']}" for k in systems if k in per)
        print(f"{'peak RSS MB':22}{rss}")


def markdown(result: dict[str, Any]) -> str:
    """docs/performance.md's table for a result JSON: one row per shape and system."""
    m = result["machine"]
    out = [f"Machine: {m['nproc']} CPUs ({m['cpu_model']}), {m['ram_gb']} GB RAM, Linux {m['kernel']}, "
           f"Python {m['python']}, Postfix {m['postfix']}; load average at start {m['loadavg_at_start']}.", "",
           "| shape | system | accepted msg/s | delivered msg/s | ack p50 ms | ack p99 ms | CPU s / 1000 msg "
           "| backlog at load end | peak RSS MB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for shape, block in result["summary"].items():
        for kind, f in block["systems"].items():
            rss = ", ".join(f"{k} {v}" for k, v in f["peak_rss_mb"].items())
            out.append(f"| {shape} | {kind} | {_fmt(f.get('accepted_per_s'))} | {_fmt(f.get('delivered_per_s'))} "
                       f"| {_fmt(f.get('ack_p50_ms'))} | {_fmt(f.get('ack_p99_ms'))} "
                       f"| {_fmt(f.get('cpu_s_per_1000'))} | {_fmt(f.get('backlog_at_load_end'))} | {rss} |")
        for name, r in block["ratios"].items():
            out.append(f"| {shape} | **{name}** | {_fmt(r['accepted_per_s'])} | {_fmt(r['delivered_per_s'])} "
                       f"| | {_fmt(r['ack_p99_ms'])} | | | |")
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="10k-new,10k-reuse,100k-new",
                    help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--systems", default="on,off,postfix",
                    help="comma-separated: on, off, postfix; on-wN / off-wN: N receive processes per node "
                         "(frontend.workers; plain on/off run one)")
    ap.add_argument("--scaling", action="store_true",
                    help="add on-wN and off-wN for N = 2 .. the cores at hand (the workers' scaling table)")
    ap.add_argument("--messages", type=int, default=0, help="messages per smtp-source run (0: per shape)")
    ap.add_argument("--latency-messages", type=int, default=None,
                    help="messages for the latency client (default min(messages, 1000))")
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=1, help="alternate the systems this many times (medians)")
    ap.add_argument("--long", type=float, default=0, metavar="SECONDS",
                    help="also a 10 KiB new-connection run of this long per system (the latency client)")
    ap.add_argument("--queued", type=int, default=0, metavar="N",
                    help="also measure RSS per node with N messages queued (next hop down)")
    ap.add_argument("--drain", type=int, default=0, metavar="N",
                    help="also time draining N messages queued while the next hop was down (on)")
    ap.add_argument("--entry", choices=["all", "node1"], default="all",
                    help="cluster load on every node's frontend (default) or on node1 only")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None, metavar="JSON",
                    help="print docs/performance.md's table for an earlier run's JSON and exit")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.scaling:
        cores = len(os.sched_getaffinity(0))
        systems += [f"{k}-w{n}" for n in range(2, cores + 1) for k in ("on", "off") if f"{k}-w{n}" not in systems]
    for s in systems:
        base, _, n = s.partition("-w")
        if base not in ("on", "off", "postfix") or (n and not n.isdigit()) or (n and base == "postfix"):
            ap.error(f"--systems: unknown system {s!r}")
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"--shapes: unknown shape {s!r}")
    skipped = {}
    if "postfix" in systems and (why := PostfixRelay.available()):
        print(f"skipping postfix: {why}", file=sys.stderr)
        skipped["postfix"] = why
        systems.remove("postfix")
    result: dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                              "skipped": skipped, "runs": []}
    started = time.time()
    for rep in range(args.repeat):
        for shape in shapes:
            for kind in systems:
                fig = run_one(kind, shape, args)
                fig["repeat"] = rep
                result["runs"].append(fig)
                print(json.dumps({k: fig[k] for k in ("system", "shape", *[k for k in KEYS if k in fig])}),
                      file=sys.stderr, flush=True)
    if args.long:
        for kind in systems:
            fig = run_one(kind, "long", args, messages=1, long_seconds=args.long)
            fig["shape"] = "long"
            result["runs"].append(fig)
            print(json.dumps({k: fig.get(k) for k in ("system", "shape", "accept_seconds", *KEYS)}),
                  file=sys.stderr, flush=True)
    if args.queued:
        result["queued_memory"] = queued_memory(args)
    if args.drain:
        result["drain"] = drain_backlog(args)
        print(json.dumps({"drain": result["drain"]}), file=sys.stderr, flush=True)
    result["summary"] = summarize(result["runs"], systems)
    result["seconds"] = round(time.time() - started, 1)
    print_table(result["summary"], systems)
    if "queued_memory" in result:
        q = result["queued_memory"]
        print(f"\nqueued {q['queued']} messages (next hop down): peak RSS per node {q['peak_rss_mb']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    ok = all(r["all_delivered"] for r in result["runs"]) and result.get("drain", {}).get("drained", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
