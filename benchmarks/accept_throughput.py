"""Accept and delivery throughput of one transportd node, measured with Postfix's smtp-source.

Starts a node on loopback relaying to Postfix's smtp-sink, drives it with
smtp-source (N messages, S sessions, SIZE bytes each, optionally reusing
connections), and prints accepted messages/s (smtp-source's wall time) and
end-to-end delivered messages/s (until the sink has them all), plus the node's
peak RSS. Figures go to stdout and, with --json, to a file.

    python benchmarks/accept_throughput.py --messages 2000 --sessions 10 --size 10240
    python benchmarks/accept_throughput.py --messages 50 --sessions 2   # the CI smoke size
    python benchmarks/accept_throughput.py --nodes 3 --shadow on        # a 3-node cluster, load on node1
    python benchmarks/accept_throughput.py --nodes 3 --shadow off       # the same without shadow copies
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listening on 127.0.0.1:{port}")


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--size", type=int, default=10240)
    ap.add_argument("--reuse", action="store_true", help="smtp-source -d: reuse connections")
    ap.add_argument("--timeout", type=float, default=600, help="give up after this many seconds")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--nodes", type=int, default=1, help="1: a single node; more: a local cluster, load on node1")
    ap.add_argument("--shadow", choices=["on", "off"], default="on", help="shadow redundancy (with --nodes > 1)")
    args = ap.parse_args()

    source = shutil.which("smtp-source") or "/usr/sbin/smtp-source"
    sink_bin = shutil.which("smtp-sink") or "/usr/sbin/smtp-sink"
    work = Path(tempfile.mkdtemp(prefix="transportd-bench-"))
    os.chmod(work, 0o777)
    node_port, sink_port = free_port(), free_port()
    cfg = work / "node.toml"
    node_host = "127.0.0.1"
    configs = [cfg]
    if args.nodes > 1:
        import random
        from transportd.devtools.cluster import generate
        base = random.randint(20, 200)
        specs = generate(work / "cluster", nodes=args.nodes, sites=min(2, args.nodes), ip_base=base,
                         frontend_port=node_port, transport_port=free_port(),
                         sink_address=f"127.0.0.1:{sink_port}",
                         overrides={"node": {"log_level": "warning"},
                                    "frontend": {"max_inbound_connection_per_source": max(20, args.sessions * 2)},
                                    "shadow_redundancy": {"shadow_redundancy_enabled": args.shadow == "on",
                                                          "shadow_heartbeat_frequency": 5}})
        configs = [Path(sp.config) for sp in specs]
        node_host = specs[0].frontend.rpartition(":")[0]
    cfg.write_text(f"""
[node]
name = "bench.transportd.test"
data_dir = "{work}/data"
log_level = "warning"
[frontend]
listen = "127.0.0.1:{node_port}"
max_inbound_connection_per_source = {max(20, args.sessions * 2)}
[routing]
accepted_domains = ["example.test"]
trusted_networks = ["127.0.0.1/32"]
smart_host = "127.0.0.1:{sink_port}"
[shadow_redundancy]
shadow_redundancy_enabled = false
""")
    procs: list[subprocess.Popen] = []
    try:
        sink_cmd = [sink_bin] + (["-u", "nobody"] if os.geteuid() == 0 else []) + [
            "-c", f"127.0.0.1:{sink_port}", "256"]
        sink = subprocess.Popen(sink_cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(sink)
        nodes = []
        for i, c in enumerate(configs):
            nodes.append(subprocess.Popen([sys.executable, "-m", "transportd", "serve", "--config", str(c)],
                                          stderr=open(work / f"node{i + 1}.log", "w")))
        procs.extend(nodes)
        node = nodes[0]
        wait_port(sink_port)
        wait_port(node_port, host=node_host)
        cpu0 = _cpu(node.pid)
        cmd = [source, "-s", str(args.sessions), "-m", str(args.messages), "-l", str(args.size),
               "-f", "bench@example.test", "-t", "rcpt@sink.test", "-N"]
        if args.reuse:
            cmd.append("-d")
        cmd.append(f"{node_host}:{node_port}")
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
        t_accept = time.monotonic() - t0
        # delivered = the node's tracking log has a SENDEXTERNAL per message
        deadline = time.monotonic() + args.timeout
        delivered = 0
        while time.monotonic() < deadline:
            delivered = _count_events(work / "data" / "msgtrk", "SENDEXTERNAL") if args.nodes == 1 else \
                _count_events(work / "cluster" / "node1" / "msgtrk", "SENDEXTERNAL")
            if delivered >= args.messages:
                break
            time.sleep(0.1)
        t_deliver = time.monotonic() - t0
        cpu = _cpu(node.pid) - cpu0
        figures = {
            "messages": args.messages, "sessions": args.sessions, "size": args.size, "reuse": args.reuse,
            "nodes": args.nodes, "shadow": args.shadow if args.nodes > 1 else "n/a",
            "accepted_per_s": round(args.messages / t_accept, 1),
            "delivered": delivered,
            "delivered_per_s": round(delivered / t_deliver, 1),
            "cpu_s_per_1000": round(cpu / max(1, args.messages) * 1000, 2),
            "node_peak_rss_mb": round(rss_kb(node.pid) / 1024, 1),
            "shadows_made": _count_events(work / "cluster" / "node1" / "msgtrk", "HAREDIRECT") if args.nodes > 1 else 0,
        }
        print(json.dumps(figures))
        for k, v in figures.items():
            print(f"  {k:18} {v}")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
        return 0 if delivered >= args.messages else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
        else:
            print("kept", work)


def _cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def _count_events(folder: Path, event: str) -> int:
    n = 0
    if folder.is_dir():
        for f in folder.glob("MSGTRK*.LOG"):
            with open(f, "rb") as fh:
                for line in fh:
                    if f",{event},".encode() in line:
                        n += 1
    return n


if __name__ == "__main__":
    sys.exit(main())
