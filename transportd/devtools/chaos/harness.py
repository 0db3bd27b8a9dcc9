"""One chaos run: cluster up, workload and nemesis, heal, drain, check, report.

It reuses ``transportd.devtools.cluster`` (configs for a 3-node, 2-site cluster and the
process runner) with short timers, with every peer link routed through the
fault proxy, and with node and sink output in log files under the run folder.
The run ends with a summary printed and written as JSON; ``ok`` in it is the
checker's verdict (lost = 0, unexpected = 0, no mailbox duplicates, and no
acknowledged message left in Retry with an internal error or in the Poison queue:
``held_rows`` reads every node's queue database after the drain).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from transportd.devtools import cluster as cluster_mod
from transportd.devtools.chaos.checker import (
    HeldRow,
    chaos_id,
    check,
    code_errors,
    scan_maildir_tree,
)
from transportd.devtools.chaos.disk import TmpfsDisks, cannot_mount, replies_while_full
from transportd.devtools.chaos.nemesis import FAULT_TYPES, PAIR_WEIGHTS, WEIGHTS, Nemesis, schedule
from transportd.devtools.chaos.preconditions import between_acks
from transportd.devtools.chaos.proxy import FaultProxy
from transportd.devtools.chaos.workload import Workload, WorkloadSettings
from transportd.queue.messages import NOT_REDUNDANT


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_listening(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


class QueueDbReads:
    """Read-only looks at the nodes' queue databases (what the nemesis's probes and the checker read)."""

    by_short: dict[str, cluster_mod.NodeSpec]

    def _read(self, short: str, sql: str) -> list[tuple]:
        """Rows from a read-only look at the node's queue database ([] if none or unreadable)."""
        return self._query(short, sql) or []

    def _query(self, short: str, sql: str) -> list[tuple] | None:
        """``_read``, but None when there is no database or it cannot be read."""
        db = Path(self.by_short[short].data_dir) / "queue.db"
        if not db.exists():
            return None
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2)
            try:
                return con.execute(sql).fetchall()
            finally:
                con.close()
        except sqlite3.Error:
            return None


class ChaosCluster(QueueDbReads, cluster_mod.Cluster):
    """cluster.Cluster with per-process log files and the operations the nemesis needs."""

    def __init__(self, directory: Path, specs: list[cluster_mod.NodeSpec], sink_address: str,
                 proxy: FaultProxy, say: Callable[[str], None]):
        super().__init__(directory, specs, sink_address)
        self.proxy = proxy
        self.say = say
        self.by_short = {s.short: s for s in specs}
        self.paused: set[str] = set()
        self.sink_refusing = False
        self.disks = TmpfsDisks()  # data directories on a tmpfs, for disk-full faults
        (directory / "logs").mkdir(exist_ok=True)

    def _spawn(self, label: str, args: list[str]) -> subprocess.Popen:
        # A node in its own process group: its receive workers are stopped and killed with it.
        with open(self.directory / "logs" / f"{label}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "transportd", *args], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=label != "sink")
        self.procs[label] = proc
        return proc

    def start(self) -> None:
        super().start()
        host, _, port = self.sink_address.rpartition(":")
        wait_listening(host, int(port), 30, self.procs["sink"])
        for spec in self.specs:
            self._wait_node(spec)

    def _wait_node(self, spec: cluster_mod.NodeSpec) -> None:
        host, _, port = spec.frontend.rpartition(":")
        wait_listening(host, int(port), 60, self.procs[spec.short])

    # -- nodes -------------------------------------------------------------------------

    def _signal_node(self, short: str, sig: int) -> None:
        """``sig`` to the node's whole process group (owner and receive workers)."""
        proc = self.procs[short]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self, short: str) -> None:
        proc = self.procs[short]
        if proc.poll() is None:
            self._signal_node(short, signal.SIGKILL)
            proc.wait(10)
        self.paused.discard(short)

    def workers_of(self, short: str) -> list[int]:
        """The PIDs of the node's receive worker processes (children of its process)."""
        return receive_workers(self.procs[short].pid)

    def kill_worker(self, short: str, pick: int) -> int | None:
        """kill -9 one receive worker of the node (the node starts it again); its PID, or None."""
        pids = self.workers_of(short)
        if not pids:
            return None
        pid = pids[pick % len(pids)]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return pid

    def wipe(self, short: str) -> None:
        """Delete the node's queue database (its mailboxes and tracking logs stay)."""
        db = Path(self.by_short[short].data_dir) / "queue.db"
        for suffix in ("", "-wal", "-shm", "-journal"):
            try:
                os.unlink(f"{db}{suffix}")
            except FileNotFoundError:
                pass

    def start_node(self, short: str) -> None:
        spec = self.by_short[short]
        if self.procs[short].poll() is None:
            return
        proc = self._spawn(short, ["serve", "--config", spec.config])
        spec.pid = proc.pid
        self._wait_node(spec)

    def pause(self, short: str) -> None:
        self._signal_node(short, signal.SIGSTOP)
        self.paused.add(short)

    def resume(self, short: str) -> None:
        self._signal_node(short, signal.SIGCONT)
        self.paused.discard(short)

    def _count(self, short: str, sql: str) -> int:
        """A read-only look at the node's queue database (0 if there is none yet, or unreadable)."""
        rows = self._read(short, sql)
        return int(rows[0][0]) if rows else 0

    def queued_external(self, short: str, statuses: tuple[str, ...] = ("Ready", "Retry", "Active")) -> int:
        """Primary messages on the node waiting for the sink (recipients in ``statuses``)."""
        return self._count(short, (
            "SELECT count(DISTINCT m.id) FROM messages m JOIN recipients r ON r.message_id = m.id "
            "JOIN queues q ON q.id = r.queue_id WHERE m.role = 'primary' AND m.state = 'Queued' "
            f"AND r.status IN ({', '.join(repr(s) for s in statuses)}) "
            "AND q.delivery_type = 'SmartHostConnectorDelivery'"))

    def queued_behind_sink(self) -> dict[str, int]:
        """Per node: primary messages the refusing sink has already deferred (Retry): settled, so
        acknowledged to their client, and held nowhere else when shadow redundancy is off."""
        return {short: self.queued_external(short, ("Retry",)) for short in self.by_short}

    def between_acks(self, short: str) -> int:
        """Copies the peers made in the last seconds as shadows of the node's current queue
        database whose message the node has not committed yet: between the shadow's 250 and the
        client's (the node commits after its copies, and its 250 follows the commit). The peers
        are read first, so a commit made meanwhile only hides a message; 0 when the node's
        database cannot be read."""
        dbid = self._read(short, "SELECT value FROM meta WHERE key = 'queue_database_id'")
        if not dbid:
            return 0
        fqdn = self.by_short[short].name.lower().replace("'", "''")
        since = time.time() - 10.0  # an older copy is an orphan (a refused message), not in the window
        shadows = [r[0] for peer in self.by_short if peer != short
                   for r in self._read(peer, "SELECT network_message_id FROM messages WHERE role = 'shadow' "
                                             f"AND state = 'Queued' AND primary_node = '{fqdn}' AND primary_dbid = "
                                             f"'{dbid[0][0]}' AND received_at > {since}")]
        if not shadows:
            return 0
        ids = ", ".join("'" + n.replace("'", "''") + "'" for n in shadows)
        committed = self._query(short, "SELECT network_message_id FROM messages WHERE role = 'primary' "
                                       f"AND network_message_id IN ({ids})")
        if committed is None:  # unreadable: say nothing rather than kill outside the window
            return 0
        return len(between_acks([r[0] for r in committed], shadows))

    def held_rows(self, short: str, attempts: int = 3) -> list[HeldRow] | None:
        """What the checker's internal-errors invariant needs from the node's queue database.

        Every pending recipient (not Delivered, Failed or Removed) of every message still queued
        as primary, with its status and last error, tagged with the message's chaos id; a message
        in the Poison queue (``messages.poisoned`` = 1, read only where the column exists) with
        none pending gets one row with status "". Read-only, like ``_count``; [] without a
        database, None if it could not be read.
        """
        db = Path(self.by_short[short].data_dir) / "queue.db"
        if not db.exists():
            return []
        for attempt in range(attempts):
            try:
                con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
                try:
                    cols = {row[1] for row in con.execute("PRAGMA table_info(messages)")}
                    poisoned = "m.poisoned" if "poisoned" in cols else "0"
                    rows = con.execute(
                        f"SELECT m.id, substr(b.data, 1, 16384), r.status, r.last_error, {poisoned} "
                        "FROM messages m JOIN message_bodies b ON b.message_id = m.id "
                        "LEFT JOIN recipients r ON r.message_id = m.id "
                        "AND r.status NOT IN ('Delivered', 'Failed', 'Removed') "
                        "WHERE m.role = 'primary' AND m.state = 'Queued' "
                        f"AND (r.message_id IS NOT NULL OR {poisoned} = 1)").fetchall()
                finally:
                    con.close()
                break
            except sqlite3.Error:
                if attempt + 1 == attempts:
                    return None
                time.sleep(0.5)
        out = []
        for message_id, data, status, last_error, is_poisoned in rows:
            run, number = chaos_id(bytes(data or b""))
            out.append(HeldRow(short, run, number, status or "", last_error or "", bool(is_poisoned),
                               int(message_id)))
        return out

    def queued_messages(self, short: str) -> int:
        """Messages (primary or shadow) the node still holds in its queues."""
        return self._count(short, "SELECT count(*) FROM messages WHERE state = 'Queued'")

    def shadow_holder(self, primary: str) -> str | None:
        """The peer holding most queued shadows of ``primary``'s messages (None: no peer holds one)."""
        counts = {short: self.shadows_of(short, primary) for short in self.by_short if short != primary}
        best = max(sorted(counts), key=lambda s: counts[s], default=None)
        return best if best is not None and counts[best] else None

    def shadows_of(self, holder: str, primary: str) -> int:
        """Queued shadows ``holder`` keeps of ``primary``'s messages."""
        fqdn = self.by_short[primary].name.lower().replace("'", "''")
        return self._count(holder, "SELECT count(*) FROM messages WHERE role = 'shadow' AND state = 'Queued' "
                                   f"AND primary_node = '{fqdn}'")

    def not_redundant(self) -> dict[str, int]:
        """Nodes holding queued primary mail without all its shadows on peers (mailqueue.NOT_REDUNDANT,
        and ``partial``: fewer than shadow_copies)."""
        states = ", ".join(f"'{s}'" for s in (*NOT_REDUNDANT, "partial"))
        counts = {short: self._count(short, "SELECT count(*) FROM messages WHERE role = 'primary' AND "
                                            f"state = 'Queued' AND redundancy IN ({states})")
                  for short in self.by_short}
        return {short: n for short, n in counts.items() if n}

    def links_of(self, short: str) -> list[str]:
        return [n for n in self.proxy.links if n.startswith(f"{short}->") or n.endswith(f"->{short}")]

    def links_between(self, a: str, b: str) -> list[str]:
        return [f"{a}->{b}", f"{b}->{a}"]

    # -- the sink ----------------------------------------------------------------------

    def sink_refuse(self, on: bool) -> None:
        self.sink_refusing = on
        proc = self.procs["sink"]
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1 if on else signal.SIGUSR2)

    def kill_sink(self) -> None:
        proc = self.procs["sink"]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def start_sink(self) -> None:
        if self.procs["sink"].poll() is None:
            return
        proc = self._spawn("sink", ["sink", "--listen", self.sink_address, "--dir", str(self.sink_dir)])
        host, _, port = self.sink_address.rpartition(":")
        wait_listening(host, int(port), 30, proc)
        if self.sink_refusing:
            proc.send_signal(signal.SIGUSR1)

    def heal_all(self) -> None:
        self.proxy.heal()
        self.disks.free_all()
        for short in list(self.paused):
            self.resume(short)
        for spec in self.specs:
            self.start_node(spec.short)
        self.start_sink()
        self.sink_refuse(False)


def schedulable(fault_types: list[str] | None, no_disk: str | None) -> list[str] | None:
    """The fault types to draw from (None: all): without a tmpfs (``no_disk``, why not), no disk-full;
    [] when nothing is left (then no fault at all)."""
    if not no_disk:
        return fault_types
    return [t for t in (fault_types or [*WEIGHTS, *PAIR_WEIGHTS]) if t != "disk-full"]


def receive_workers(owner: int) -> list[int]:
    """The PIDs of the receive worker processes (frontend.workers) of the node process ``owner``."""
    try:
        children = Path(f"/proc/{owner}/task/{owner}/children").read_text().split()
    except OSError:
        return []
    out = []
    for pid in children:
        try:
            if b"worker_entry" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except OSError:
            continue
    return out


def pick_ports(ip_base: int, nodes: int) -> tuple[int, int]:
    """A frontend/transport port pair free on every node address, and room for the proxy ports."""
    for front in range(25300, 26000, 10):
        ips = [f"127.0.0.{ip_base + i}" for i in range(nodes)] + [f"127.0.0.{ip_base - 1}"]
        ports = [front, front + 1] + [front + 2 + j for j in range(nodes)]
        if all(port_free(ip, p) for ip in ips for p in ports):
            return front, front + 1
    raise RuntimeError(f"no free ports on 127.0.0.{ip_base}..")


def run(*, messages: int, faults: int, seed: int, shadow: bool, directory: Path, clients: int = 6,
        ip_base: int = 101, rate: float | None = None, heartbeat: float = 1.0, resubmit_span: float = 4.0,
        drain_timeout: float = 120.0, say: Callable[[str], None] = print,
        fault_types: list[str] | None = None, versions: list[str] | None = None,
        expect_loss: bool = False, concurrent: int = 1, shadow_copies: int = 1) -> dict[str, Any]:
    """One run; returns the summary (also written to ``directory/summary.json``).

    ``expect_loss``: a control run (shadow redundancy off, or too few shadows for the faults),
    which passes only if it lost mail. ``versions``: shadow redundancy version per node (a mixed
    2010/2013 cluster). ``concurrent``: up to that many faults at once (pair faults among them);
    ``shadow_copies``: shadows per message (N-way, docs/PROTOCOL.md section 9)."""
    nodes = 3
    directory.mkdir(parents=True, exist_ok=True)
    run_id = secrets.token_hex(4)
    first = "wipe-behind-refusing-sink"
    no_disk = cannot_mount(directory) if "disk-full" in (fault_types or WEIGHTS) else None
    if no_disk:
        say(f"disk-full faults not scheduled: {no_disk}")
    fault_types = schedulable(fault_types, no_disk)
    plan = schedule(seed, faults, [f"node{i + 1}" for i in range(nodes)], resubmit_span=resubmit_span,
                    types=fault_types, first=first if not fault_types or first in fault_types else None,
                    concurrent=concurrent) if fault_types != [] else []
    say(f"chaos run {run_id}: seed {seed}, {messages} messages, {faults} faults, "
        f"shadow redundancy {'on' if shadow else 'OFF (control run)'}; folder {directory}")
    say(f"replay with: transportd chaos --seed {seed} --messages {messages} --faults {faults}"
        f"{'' if shadow else ' --no-shadow'}{' --fault-types ' + ','.join(fault_types) if fault_types else ''}"
        f"{' --versions ' + ','.join(versions) if versions else ''}"
        f"{f' --concurrent {concurrent}' if concurrent > 1 else ''}"
        f"{f' --shadow-copies {shadow_copies}' if shadow_copies > 1 else ''}")
    front, transport = pick_ports(ip_base, nodes)
    sink_address = f"127.0.0.{ip_base - 1}:{front}"
    proxy = FaultProxy()

    def peer_transport(spec: cluster_mod.NodeSpec, peer: cluster_mod.NodeSpec) -> str:
        host, _, port = peer.transport.rpartition(":")
        listen = (host, int(port) + int(spec.short[4:]))  # node i's link to a peer: peer transport + i
        proxy.add(f"{spec.short}->{peer.short}", listen, (host, int(port)))
        return f"{host}:{listen[1]}"

    settle = resubmit_span + 3 * heartbeat
    overrides = {
        "node": {"log_level": "info"},
        "shadow_redundancy": {"shadow_redundancy_enabled": shadow, "shadow_heartbeat_frequency": heartbeat,
                              "shadow_resubmit_time_span": resubmit_span, "shadow_copy_timeout": 5,
                              # 2010-mode nodes (--versions): the same heartbeat, and promotion where
                              # delayed acknowledgement is bypassed (a refusing sink), not acking unprotected
                              "shadow_heartbeat_timeout_interval": heartbeat,
                              "shadow_heartbeat_retry_count": max(1, round(resubmit_span / heartbeat)),
                              "promotion_enabled": True,
                              # N-way: rank k waits (k - 1) of these more than rank 1 (at least a heartbeat)
                              "shadow_copies": shadow_copies, "shadow_rank_delay": max(heartbeat, resubmit_span / 2)},
        "delivery": {"queue_poll_interval": 0.2, "transient_failure_retry_interval": 1,
                     "outbound_connection_failure_retry_interval": 1, "send_connect_timeout": 2,
                     "send_connection_inactivity_timeout": 10},
        # Two receive processes per node whatever the machine's cores: kill-worker has one to kill.
        "frontend": {"connection_inactivity_timeout": 30, "max_inbound_connection_per_source": 200, "workers": 2,
                     "max_acknowledgement_delay": 10},
    }
    specs = cluster_mod.generate(directory, nodes=nodes, sites=2, ip_base=ip_base, frontend_port=front,
                                 transport_port=transport, sink_address=sink_address, overrides=overrides,
                                 peer_transport=peer_transport, versions=versions)
    cluster = ChaosCluster(directory, specs, sink_address, proxy, say)
    alone_2010 = lone_2010_nodes(specs, versions) if shadow else []
    for short in alone_2010:
        say(f"{short} runs Exchange 2010's design with no other node in its site: where delayed "
            "acknowledgement is bypassed (a refusing sink) it acknowledges with its only copy, as "
            "Exchange 2010 does (docs/exchange2010.md); a wipe of it then loses that mail")
    for short in sorted({f.targets[0] for f in plan if f.type == "disk-full"}):
        cluster.disks.mount(short, Path(cluster.by_short[short].data_dir))
        say(f"{short}: data directory on a tmpfs (disk-full faults)")
    frontends = [(s.frontend.rpartition(":")[0], front) for s in specs]
    mean_fault = 6.0 + 2.5
    span = max(10.0, faults * mean_fault)
    rate = rate or max(2.0, messages / span)
    workload = Workload(run_id, frontends, WorkloadSettings(messages, clients, rate), seed)
    nemesis = Nemesis(cluster, plan, settle=settle, say=lambda m: say(f"[nemesis] {m}"), concurrent=concurrent)
    t0 = time.monotonic()
    summary: dict[str, Any] = {}
    try:
        proxy.start()
        cluster.start()
        say(f"cluster up: {', '.join(s.short + ' ' + s.frontend for s in specs)}; sink {sink_address}; "
            f"{len(proxy.links)} proxied peer links; pacing {rate:.1f} msg/s with {clients} clients")
        workload.start()
        nemesis.start()
        last = 0.0
        while nemesis.thread.is_alive() or workload.sent_so_far < messages:
            time.sleep(0.5)
            if time.monotonic() - last > 15:
                last = time.monotonic()
                say(f"progress: {workload.sent_so_far}/{messages} messages started, "
                    f"{len(nemesis.log.faults)}/{faults} faults done")
        nemesis.thread.join()
        healed_at = time.monotonic()
        say("nemesis done; everything healed; clients finish their retries")
        workload.retry_until = time.monotonic() + 60
        if not workload.join(timeout=120):
            say("some clients still busy after 120 s; stopping them")
            workload.stop.set()
            workload.join(timeout=30)
        say("draining")
        verdict = _drain(cluster, workload, run_id, drain_timeout, settle, say)
        summary = verdict.summary()
        errors = _node_code_errors(cluster)
        summary.update({
            "code_errors": len(errors), "code_error_examples": errors[:20], "lone_2010_nodes": alone_2010,
            "seed": seed, "messages": messages, "faults_planned": faults, "shadow_redundancy": shadow,
            "concurrent": concurrent, "shadow_copies": shadow_copies,
            "faults_overlapping": sum(1 for f in nemesis.log.faults if f.overlap and f.done),
            "clients": clients, "heartbeat": heartbeat, "resubmit_span": resubmit_span,
            "utf8_sent": sum(1 for h in workload.history.values() if h.utf8),
            "faults": nemesis.log.as_json(),
            "fault_counts": _count_types([f for f in nemesis.log.faults if f.done]),
            # Faults whose precondition never held: not applied, not counted above.
            "faults_not_done": [f"{f.describe()}: {f.note}" for f in nemesis.log.faults if not f.done],
            # How long the cluster took to be redundant again before each fault (the nemesis waits).
            "recovery_wait_max": max((f.recovery_wait for f in nemesis.log.faults), default=0.0),
            "recovery_wait_total": round(sum(f.recovery_wait for f in nemesis.log.faults), 1),
            "nemesis_error": repr(nemesis.error) if nemesis.error else None,
            "disk_full_unavailable": no_disk,
            "disk_full": _disk_full_replies(nemesis.log.faults, workload, cluster),
            "duration_seconds": round(time.monotonic() - t0, 1),
            "drain_seconds": round(time.monotonic() - healed_at, 1),
            "directory": str(directory),
            "expect_loss": expect_loss,
        })
        summary["passed"], summary["verdict_reason"] = judge(summary, expect_loss)
    finally:
        workload.stop.set()
        nemesis.stop.set()
        for short in list(cluster.paused):
            cluster.resume(short)
        cluster.stop()
        cluster.disks.unmount_all()
        proxy.stop()
    (directory / "summary.json").write_text(json.dumps(summary, indent=2))
    # Every attempt of every message, for looking into a lost or duplicated one.
    (directory / "history.json").write_text(json.dumps(
        {n: {"recipients": h.recipients, "utf8": h.utf8, "outcome": h.outcome,
             "attempts": [asdict(a) for a in h.attempts]}
         for n, h in workload.history.items()}))
    return summary


def judge(summary: dict[str, Any], expect_loss: bool) -> tuple[bool, str]:
    """Whether the run passed, and why not. A run passes on the checker's verdict (lost 0,
    unexpected 0, no mailbox duplicate, no internal error) and no code error in the nodes' logs
    (any run: a bug is one whether or not shadows are on); a control run (``expect_loss``,
    shadow redundancy off) passes only if it lost mail and nothing unexpected arrived: a control
    that loses nothing fails, whatever the seed (the harness did not show it can see a loss)."""
    lost, unexpected = summary.get("lost", 0), summary.get("unexpected", 1)
    if summary.get("nemesis_error"):
        return False, f"the nemesis failed: {summary['nemesis_error']}"
    if summary.get("code_errors"):
        return False, (f"{summary['code_errors']} line(s) of the nodes' logs name an exception only a bug "
                       f"raises, first: {(summary.get('code_error_examples') or [''])[0][:300]}")
    rejected_full = [d for d in summary.get("disk_full") or [] if d.get("5xx")]
    if rejected_full:
        return False, "a node answered 5xx while its disk was full: " + ", ".join(
            f"{d['node']} (fault {d['fault']}: {d['5xx']})" for d in rejected_full)
    if expect_loss:
        if unexpected:
            return False, f"control run: {unexpected} unexpected deliveries"
        if not lost:
            return False, "control run lost nothing: the harness did not show it can see a loss"
        return True, f"control run lost {lost}, as it must"
    if summary.get("ok"):
        return True, "lost 0, unexpected 0, no mailbox duplicate, no internal error"
    why = (f"lost {lost}, unexpected {unexpected}, mailbox duplicates "
           f"{summary.get('duplicates', {}).get('mailbox')}, internal errors {summary.get('internal_errors')}")
    if lost and (summary.get("shadow_copies") or 1) < 2 and summary.get("fault_counts", {}).get(
            "double-wipe-behind-refusing-sink"):
        why += ("; with one shadow per message a double wipe (a primary and its shadow holder at once) "
                "loses their queued mail for certain: run pair faults with --shadow-copies 2")
    if lost and summary.get("lone_2010_nodes"):
        why += (f"; {', '.join(summary['lone_2010_nodes'])} ran Exchange 2010's design alone in its site, "
                "which acknowledges behind a refusing next hop with its only copy (docs/exchange2010.md): "
                "give a 2010 node a site peer (--versions 2010,2013,2013)")
    return False, why


def lone_2010_nodes(specs: list, versions: list[str] | None) -> list[str]:
    """The nodes running version 2010 with no other node in their site: shadow redundancy
    promotion relays only within a site, so such a node acknowledges unprotected wherever delayed
    acknowledgement is bypassed."""
    if not versions:
        return []
    sites = [s.site for s in specs]
    return [spec.short for spec, version in zip(specs, versions, strict=False)
            if version == "2010" and sites.count(spec.site) == 1]


def _node_code_errors(cluster: ChaosCluster) -> list[str]:
    """The nodes' log lines naming an exception only a bug raises (checker.code_errors)."""
    found: list[str] = []
    for short in sorted(cluster.by_short):
        path = cluster.directory / "logs" / f"{short}.log"
        if path.exists():
            with open(path, encoding="utf-8", errors="replace") as f:
                found += code_errors(f)
    return found


def _disk_full_replies(faults: list, workload: Workload, cluster: ChaosCluster) -> list[dict[str, Any]]:
    """Per disk-full fault, what the clients got from the full node while its disk was full."""
    attempts = [(a.node, a.outcome, a.detail, a.at) for h in workload.history.values() for a in h.attempts]
    out = []
    for f in faults:
        if f.type == "disk-full" and f.done and f.started_at:
            ip = cluster.by_short[f.targets[0]].frontend.rpartition(":")[0]
            out.append({"fault": f.index, "node": f.targets[0],
                        **replies_while_full(attempts, ip, f.started_at, f.ended_at or f.started_at)})
    return out


def _count_types(faults: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in faults:
        out[f.type] = out.get(f.type, 0) + 1
    return out


def _drain(cluster: ChaosCluster, workload: Workload, run_id: str, timeout: float, settle: float,
           say: Callable[[str], None]):
    """Check until nothing acknowledged is missing (then a short linger for late copies) or the time is up."""
    deadline = time.monotonic() + timeout
    mailboxes = Path(cluster.by_short["node1"].data_dir) / "mailboxes"
    seen, quiet_since = -1, time.monotonic()
    while True:
        deliveries = (scan_maildir_tree(cluster.sink_dir, "external", per_recipient_folders=False)
                      + scan_maildir_tree(mailboxes, "mailbox", per_recipient_folders=True))
        verdict = check(run_id, workload.history, deliveries)
        if not verdict.lost or time.monotonic() > deadline:
            break
        if len(deliveries) != seen:
            seen, quiet_since = len(deliveries), time.monotonic()
        elif (time.monotonic() - quiet_since > max(20.0, 3 * settle)
              and all(cluster.queued_messages(s.short) == 0 for s in cluster.specs)):
            say(f"nothing queued anywhere and nothing delivered for {time.monotonic() - quiet_since:.0f} s: "
                f"{len(verdict.lost)} acknowledged delivery(ies) missing")
            break
        time.sleep(1.0)
    time.sleep(min(settle, max(0.0, deadline - time.monotonic())))
    deliveries = (scan_maildir_tree(cluster.sink_dir, "external", per_recipient_folders=False)
                  + scan_maildir_tree(mailboxes, "mailbox", per_recipient_folders=True))
    held = []
    for spec in cluster.specs:
        rows = cluster.held_rows(spec.short)
        if rows is None:
            say(f"{spec.short}: queue database unreadable; its internal errors are not counted")
        held.extend(rows or [])
    return check(run_id, workload.history, deliveries, held)


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"chaos run {s.get('run')} (seed {s.get('seed')}, shadow redundancy "
        f"{'on' if s.get('shadow_redundancy') else 'off'}): {s.get('duration_seconds')} s",
        f"  sent {s.get('sent')} messages in {s.get('attempts')} attempts: acknowledged {s.get('acknowledged')}, "
        f"rejected {s.get('rejected')}, unknown {s.get('unknown')}; internationalized (SMTPUTF8) "
        f"{s.get('utf8_sent')}",
        f"  faults: {sum(s.get('fault_counts', {}).values())} done "
        + ", ".join(f"{k} {v}" for k, v in sorted(s.get("fault_counts", {}).items()))
        + (f"; {len(s['faults_not_done'])} not done (precondition never held)" if s.get("faults_not_done") else ""),
        f"  waited for redundancy before faults: {s.get('recovery_wait_total')} s in all, "
        f"{s.get('recovery_wait_max')} s at most",
        f"  lost {s.get('lost')}   unexpected {s.get('unexpected')}   duplicates mailbox "
        f"{s.get('duplicates', {}).get('mailbox')} external {s.get('duplicates', {}).get('external')}   "
        f"recovered {s.get('recovered')}   internal errors {s.get('internal_errors')}",
    ]
    if s.get("lost_examples"):
        lines.append(f"  lost: {', '.join(s['lost_examples'][:10])}")
    if s.get("unexpected_examples"):
        lines.append(f"  unexpected: {', '.join(s['unexpected_examples'][:10])}")
    if s.get("internal_error_examples"):
        lines.append(f"  internal errors: {', '.join(s['internal_error_examples'][:10])}")
    if s.get("code_errors"):
        lines.append(f"  code errors in the nodes' logs: {s['code_errors']}")
        lines += [f"    {line[:300]}" for line in s.get("code_error_examples", [])[:5]]
    for d in s.get("disk_full") or []:
        lines.append(f"  disk full on {d['node']} (fault {d['fault']}): clients got {d['ack']} ack, {d['4xx']} 4xx, "
                     f"{d['5xx']} 5xx, {d['unknown']} unknown from it")
    if s.get("disk_full_unavailable"):
        lines.append(f"  disk-full faults not scheduled: {s['disk_full_unavailable']}")
    for line in s.get("faults_not_done", []):
        lines.append(f"  not done: {line}")
    passed = s.get("passed", s.get("ok"))
    lines.append(f"  verdict: {'OK' if passed else 'FAILED'}"
                 + (f" ({s['verdict_reason']})" if s.get("verdict_reason") else ""))
    return "\n".join(lines)


__all__ = ["FAULT_TYPES", "format_summary", "judge", "run"]
