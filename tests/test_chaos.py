"""The chaos harness (issue 6): checker and schedule as pure logic, then real runs.

The real runs start ``python -m transportd chaos`` (3 nodes, 2 sites, a sink, a fault
proxy on every peer link) at a small size: with shadow redundancy on, nothing
acknowledged may be lost and nothing unexpected may arrive; the control run, same
seed with shadow redundancy off, must report lost > 0, proving the checker can fail.
CHAOS_MESSAGES / CHAOS_FAULTS / CHAOS_SEED make them bigger by hand.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from transportd import mailqueue as mq
from transportd.chaos.checker import (
    ACK,
    REFUSED,
    REJECTED,
    UNKNOWN,
    Attempt,
    Delivery,
    Sent,
    check,
    parse_delivery,
    scan_maildir_tree,
)
from transportd.chaos.harness import ChaosCluster
from transportd.chaos.nemesis import FAULT_TYPES, Fault, Nemesis, schedule
from transportd.chaos.proxy import FaultProxy
from transportd.chaos.workload import message_bytes, recipients_for
from transportd.cluster import NodeSpec
from transportd.routing import MAILBOX, NextHop
from transportd.store import QueueStore

RUN = "abc123"


def sent(n: int, rcpts: list[str], *outcomes: str) -> Sent:
    return Sent(n, rcpts, [Attempt(o) for o in outcomes])


def dl(n: int, rcpt: str, where: str = "external", run: str = RUN) -> Delivery:
    return Delivery(run, n, rcpt, where)


# ------------------------------------------------------------------------------ checker

def test_checker_counts_lost_unexpected_duplicates_recovered():
    history = {
        1: sent(1, ["a@elsewhere.test"], UNKNOWN, ACK),           # acked, arrived twice (external dup)
        2: sent(2, ["u@example.test"], ACK),                      # acked, never arrived: lost
        3: sent(3, ["a@elsewhere.test"], UNKNOWN),                # unknown, arrived: recovered
        4: sent(4, ["u@example.test", "b@elsewhere.test"], ACK),  # bifurcated: one side missing: lost
        5: sent(5, ["a@elsewhere.test"], REFUSED, REJECTED),      # rejected, not arrived: fine
        6: sent(6, ["u@example.test"], ACK),                      # mailbox duplicate
    }
    deliveries = [dl(1, "a@elsewhere.test"), dl(1, "a@elsewhere.test"), dl(3, "a@elsewhere.test"),
                  dl(4, "u@example.test", "mailbox"), dl(6, "u@example.test", "mailbox"),
                  dl(6, "u@example.test", "mailbox"),
                  dl(99, "a@elsewhere.test"),                     # never sent: unexpected
                  dl(1, "x@elsewhere.test"),                      # not a recipient of #1: unexpected
                  dl(1, "a@elsewhere.test", run="other")]         # another run's mail: unexpected
    v = check(RUN, history, deliveries)
    assert v.lost == [(2, "u@example.test"), (4, "b@elsewhere.test")]
    assert len(v.unexpected) == 3
    assert (v.duplicates_external, v.duplicates_mailbox) == (1, 1)
    assert v.recovered == 1
    assert (v.acknowledged, v.unknown, v.rejected) == (4, 1, 1)
    assert not v.ok
    s = v.summary()
    assert s["lost"] == 2 and s["unexpected"] == 3 and s["ok"] is False


def test_checker_ok_when_everything_acknowledged_arrived():
    history = {1: sent(1, ["A@Elsewhere.test"], ACK), 2: sent(2, ["u@example.test"], REFUSED, ACK)}
    v = check(RUN, history, [dl(1, "a@elsewhere.test"), dl(2, "u@example.test", "mailbox")])
    assert v.ok and not v.lost and not v.unexpected and v.attempts == 3


def test_delivery_parsing_from_sink_and_mailbox_files(tmp_path):
    data = message_bytes(RUN, 42, ["a@elsewhere.test", "u@example.test"], 500, "Sun, 22 Nov 2026 05:00:00 GMT")
    sink_file = b"X-Sink-Mail-From: <c@chaos.test>\r\nX-Sink-Rcpt-To: <a@elsewhere.test>, <b@elsewhere.test>\r\n" + data
    got = parse_delivery(sink_file, where="external")
    assert [(d.run, d.number, d.recipient) for d in got] == [(RUN, 42, "a@elsewhere.test"), (RUN, 42, "b@elsewhere.test")]
    # A body line that looks like the header does not count: only the header block is read.
    assert parse_delivery(b"Subject: x\r\n\r\nX-Chaos-Id: abc123-7\r\n", where="mailbox", recipient="u@x")[0].number == -1
    box = tmp_path / "mailboxes" / "u%2Bx@example.test" / "new"
    box.mkdir(parents=True)
    (box / "1.id.host,S=1").write_bytes(data)
    (tmp_path / "sink" / "new").mkdir(parents=True)
    (tmp_path / "sink" / "new" / "m1").write_bytes(sink_file)
    found = scan_maildir_tree(tmp_path / "mailboxes", "mailbox", per_recipient_folders=True)
    assert [(d.number, d.recipient, d.where) for d in found] == [(42, "u+x@example.test", "mailbox")]
    assert len(scan_maildir_tree(tmp_path / "sink", "external", per_recipient_folders=False)) == 2


def test_recipients_mix_local_external_and_bifurcated():
    import random
    rng = random.Random(1)
    kinds = {tuple(sorted(r.split("@")[1] for r in recipients_for(n, rng))) for n in range(200)}
    assert kinds == {("example.test",), ("elsewhere.test",), ("elsewhere.test", "example.test")}


# ------------------------------------------------------------------------------ nemesis schedule

def test_schedule_is_reproducible_from_the_seed_and_covers_the_fault_types():
    nodes = ["node1", "node2", "node3"]
    a = schedule(7, 200, nodes, resubmit_span=4)
    b = schedule(7, 200, nodes, resubmit_span=4)
    assert [f.describe() for f in a] == [f.describe() for f in b]
    assert [f.describe() for f in a] != [f.describe() for f in schedule(8, 200, nodes, resubmit_span=4)]
    assert a[0].type == "wipe-behind-refusing-sink"
    assert {f.type for f in a} == set(FAULT_TYPES)
    for f in a:
        if f.type in ("partition", "delay", "reset"):
            assert len(set(f.targets)) == 2
        elif f.type.startswith("sink"):
            assert f.targets == []
        else:
            assert len(f.targets) == 1 and f.targets[0] in nodes
    assert any(f.type == "pause" and f.duration > 4 for f in a), "some pauses outlast the resubmit span"


class _ExposedCluster:
    """Stands in for ChaosCluster: not redundant for the first ``exposed_polls`` looks."""

    def __init__(self, exposed_polls: int):
        self.exposed_polls = exposed_polls
        self.events: list[str] = []

    def not_redundant(self) -> dict[str, int]:
        if self.exposed_polls > 0:
            self.exposed_polls -= 1
            self.events.append("exposed")
            return {"node2": 3}
        self.events.append("redundant")
        return {}

    def sink_refuse(self, on: bool) -> None:
        self.events.append(f"refuse {on}")

    def heal_all(self) -> None:
        self.events.append("heal")


def _sink_faults(n: int) -> list[Fault]:
    return [Fault(i + 1, "sink-refuse", [], duration=0.01, wait_before=0.0) for i in range(n)]


def test_nemesis_waits_for_redundancy_before_each_fault():
    cluster = _ExposedCluster(exposed_polls=3)
    said: list[str] = []
    nemesis = Nemesis(cluster, _sink_faults(2), settle=0, say=said.append, recovery_timeout=30)
    nemesis.start()
    nemesis.thread.join(20)
    assert not nemesis.thread.is_alive() and nemesis.error is None
    first, second = nemesis.log.faults
    assert first.recovery_wait >= 0.5, "three exposed looks, 0.25 s apart"
    assert second.recovery_wait < 0.25
    assert cluster.events[:5] == ["exposed", "exposed", "exposed", "redundant", "refuse True"]
    assert not any("still not redundant" in line for line in said)


def test_nemesis_goes_ahead_when_redundancy_does_not_come_back_in_time():
    cluster = _ExposedCluster(exposed_polls=10**6)
    said: list[str] = []
    nemesis = Nemesis(cluster, _sink_faults(1), settle=0, say=said.append, recovery_timeout=0.5)
    nemesis.start()
    nemesis.thread.join(20)
    assert nemesis.log.faults[0].recovery_wait >= 0.5
    assert "refuse True" in cluster.events
    assert any("still not redundant after 0.5s: {'node2': 3}" in line for line in said)


def test_not_redundant_counts_queued_primaries_without_a_shadow(tmp_path):
    """The SQL the nemesis waits on, against real queue databases (a missing one counts 0)."""
    specs = {}
    for short, states in (("node1", ["shadowed", "reshadowing", "unprotected", "unprotected"]),
                          ("node2", ["shadowed", "none", "pending"]), ("node3", None)):
        folder = tmp_path / short
        folder.mkdir()
        specs[short] = NodeSpec(short, short, "site-a", "", "", str(folder), "")
        if states is None:
            continue
        store = QueueStore.open(folder / "queue.db")
        try:
            for i, redundancy in enumerate(states):
                msg = mq.NewMessage(network_message_id=f"{short}-{i}", sender="s@sender.test",
                                    data=b"Subject: t\r\n\r\nbody\r\n",
                                    recipients={NextHop("mailbox:local", MAILBOX, "local"): ["a@example.test"]},
                                    received_at=1.0, expires_at=86400.0, redundancy=redundancy)
                store.transaction(lambda c, m=msg: mq.enqueue(c, m))
        finally:
            store.close()
    cluster = object.__new__(ChaosCluster)  # only the queue databases are needed
    cluster.by_short = specs
    assert cluster.not_redundant() == {"node1": 3}


# ------------------------------------------------------------------------------ fault proxy

def _echo(c: socket.socket) -> None:
    with c:
        try:
            for data in iter(lambda: c.recv(100), b""):
                c.sendall(data)
        except OSError:
            pass


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(c,), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_fault_proxy_forwards_delays_cuts_and_resets():
    srv, port = _echo_server()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        lport = probe.getsockname()[1]
    proxy = FaultProxy()
    proxy.add("a->b", ("127.0.0.1", lport), ("127.0.0.1", port))
    proxy.start()
    try:
        with socket.create_connection(("127.0.0.1", lport), timeout=3) as c:
            c.sendall(b"hello")
            assert c.recv(100) == b"hello"
        proxy.set(["a->b"], "ok", 0.4)
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", lport), timeout=3) as c:
            t = time.monotonic()
            c.sendall(b"slow")
            assert c.recv(100) == b"slow"
            assert time.monotonic() - t >= 0.7  # held back in both directions
        proxy.set(["a->b"], "cut")
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", lport), timeout=3) as c:
            c.settimeout(0.5)
            c.sendall(b"void")
            with pytest.raises(socket.timeout):
                c.recv(100)
        proxy.set(["a->b"], "reset")
        time.sleep(0.1)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):  # at connect or at first use
            with socket.create_connection(("127.0.0.1", lport), timeout=3) as c:
                c.sendall(b"x")
                time.sleep(0.1)
                c.recv(100)
        proxy.heal()
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", lport), timeout=3) as c:
            c.sendall(b"again")
            assert c.recv(100) == b"again"
    finally:
        proxy.stop()
        srv.close()


def test_fault_proxy_stays_on_loopback():
    with pytest.raises(ValueError):
        FaultProxy().add("x", ("0.0.0.0", 1), ("127.0.0.1", 2))


# ------------------------------------------------------------------------------ real runs

MESSAGES = int(os.environ.get("CHAOS_MESSAGES", "300"))
FAULTS = int(os.environ.get("CHAOS_FAULTS", "6"))
SEED = int(os.environ.get("CHAOS_SEED", "4242"))


class ChaosRun:
    """``transportd chaos`` as a real process, started at once; ``result()`` waits for its summary."""

    def __init__(self, folder: Path, *extra: str, ip_base: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.out = folder / "summary.json"
        self.log = folder / "chaos.out"
        cmd = [sys.executable, "-m", "transportd", "chaos", "--messages", str(MESSAGES), "--faults", str(FAULTS),
               "--seed", str(SEED), "--ip-base", str(ip_base), "--dir", str(folder / "run"),
               "--json", str(self.out), "--drain-timeout", "90", *extra]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def result(self) -> tuple[int, dict, str]:
        try:
            code = self.proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        report = self.log.read_text(errors="replace")[-3000:]
        assert self.out.exists(), f"no summary written:\n{report}"
        return code, json.loads(self.out.read_text()), report

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the harness stops its cluster on SIGTERM via its finally block
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def chaos_runs(tmp_path_factory):
    """The shadow run and its control run (same seed, shadow redundancy off), side by side."""
    base = tmp_path_factory.mktemp("chaos")
    runs = {"shadow": ChaosRun(base / "shadow", ip_base=111),
            "control": ChaosRun(base / "control", "--no-shadow", "--expect-loss", ip_base=121)}
    try:
        yield runs
    finally:
        for r in runs.values():
            r.stop()


@pytest.mark.chaos
def test_chaos_run_loses_nothing_acknowledged(chaos_runs):
    code, s, report = chaos_runs["shadow"].result()
    assert s["nemesis_error"] is None, report
    assert len(s["faults"]) == FAULTS, report
    assert s["acknowledged"] >= MESSAGES * 0.9, report
    assert s["lost"] == 0, report
    assert s["unexpected"] == 0, report
    assert s["duplicates"]["mailbox"] == 0, report
    assert s["internal_errors"] == 0, report  # nothing acknowledged stranded by an internal error
    assert s["utf8_sent"] > 0, report         # internationalized mail is part of the workload
    assert code == 0, report
    assert "wipe-behind-refusing-sink" in s["fault_counts"]


@pytest.mark.chaos
def test_chaos_control_run_without_shadow_redundancy_loses_mail(chaos_runs):
    code, s, report = chaos_runs["control"].result()
    assert s["shadow_redundancy"] is False
    assert s["lost"] > 0, report
    assert s["unexpected"] == 0, report
    assert code == 0, report


def test_sink_refuses_on_sigusr1_and_accepts_on_sigusr2(procs, tmp_path):
    import signal
    import smtplib

    from conftest import free_port, wait_port
    port = free_port()
    proc = procs.add(subprocess.Popen([sys.executable, "-m", "transportd", "sink", "--listen", f"127.0.0.1:{port}",
                                       "--dir", str(tmp_path / "sink")], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    wait_port("127.0.0.1", port, proc=proc)

    def send() -> int:
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as s:
            s.ehlo("t.test")
            s.mail("a@x.test")
            s.rcpt("b@elsewhere.test")
            return s.data(b"Subject: t\r\n\r\nhi\r\n")[0]

    assert send() == 250
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.3)
    assert send() == 451
    proc.send_signal(signal.SIGUSR2)
    time.sleep(0.3)
    assert send() == 250
    assert len(list((tmp_path / "sink" / "new").iterdir())) == 2


# --------------------------------------------------------------------------- internationalized mail and internal errors

def test_utf8_deliveries_are_matched_at_the_sink_and_in_mailbox_folders(tmp_path: Path) -> None:
    from transportd.chaos.workload import internationalized
    from transportd.mailbox import mailbox_name
    local, external = internationalized(["user3@example.test", "rcpt7@elsewhere.test"])
    assert (local, external) == ("üser3@example.test", "rcpt-ñ7@elsewhere.test")
    data = message_bytes("r1", 5, [local, external], 600, "Wed, 25 Nov 2026 10:00:00 +0000", utf8=True)
    assert "Subject: chaos r1 #5 — grüße".encode() in data and b"X-Chaos-Id: r1-5" in data
    sink = tmp_path / "sink" / "new"
    sink.mkdir(parents=True)
    (sink / "m1").write_bytes(f"X-Sink-Mail-From: <klïent@chaos.test>\r\nX-Sink-Rcpt-To: <{external}>\r\n"
                              .encode() + data)
    box = tmp_path / "mailboxes" / mailbox_name(local) / "new"
    box.mkdir(parents=True)
    (box / "m1").write_bytes(data)
    assert mailbox_name(local).isascii()
    deliveries = (scan_maildir_tree(tmp_path / "sink", "external", per_recipient_folders=False)
                  + scan_maildir_tree(tmp_path / "mailboxes", "mailbox", per_recipient_folders=True))
    sent = Sent(5, [local, external], [Attempt("ack", "n1")], utf8=True)
    verdict = check("r1", {5: sent}, deliveries)
    assert verdict.ok and not verdict.lost and not verdict.unexpected, verdict.summary()


def test_internal_errors_and_poison_fail_the_verdict() -> None:
    from transportd.chaos.checker import HeldRow
    history = {1: Sent(1, ["a@example.test"], [Attempt("ack", "n1")])}
    deliveries = [Delivery("r1", 1, "a@example.test", "mailbox")]
    assert check("r1", history, deliveries, []).ok
    retry = HeldRow("node1", "r1", 1, "Retry", "451 4.3.0 internal error in deliver: KeyError: 'x'", False)
    poison = HeldRow("node2", "r1", 1, "Retry", "", True)
    transient = HeldRow("node1", "r1", 1, "Retry", "451 4.4.0 Unable to connect", False)
    other_run = HeldRow("node1", "r0", 1, "Retry", "451 4.3.0 internal error in dsn", False)
    assert check("r1", history, deliveries, [transient, other_run]).ok
    for bad in (retry, poison):
        v = check("r1", history, deliveries, [transient, bad])
        assert not v.ok and v.summary()["internal_errors"] == 1, v.summary()


def test_workload_sends_a_share_of_utf8_messages_with_the_same_recipients_otherwise() -> None:
    from transportd.chaos.workload import Workload, WorkloadSettings
    with_utf8 = Workload("r", [("127.0.0.1", 1)], WorkloadSettings(messages=400, clients=1, rate=1), seed=7)
    without = Workload("r", [("127.0.0.1", 1)], WorkloadSettings(messages=400, clients=1, rate=1, utf8_share=0),
                       seed=7)
    utf8 = [s for s in with_utf8.history.values() if s.utf8]
    assert 0.08 < len(utf8) / 400 < 0.25
    assert all(not r.isascii() for s in utf8 for r in s.recipients)
    for n, s in with_utf8.history.items():
        if not s.utf8:
            assert s.recipients == without.history[n].recipients
