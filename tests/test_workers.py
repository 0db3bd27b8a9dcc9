"""Receive worker processes (``frontend.workers``): several processes serve one node's frontend.

Real nodes on loopback with Postfix's smtp-sink as the next hop: the kernel spreads sessions over
the owner and its workers (SO_REUSEPORT); a worker's message is tracked and counted by the owner
and reaches its scheduler at once (the poll interval here is a minute); a worker killed with
SIGKILL under load loses no acknowledged message and is started again; workers stop with their
node and die with it. The settings themselves (auto, limits split) are checked without processes.
"""

from __future__ import annotations

import os
import signal
import smtplib
import threading
import time
from email.message import EmailMessage
from pathlib import Path

import pytest
from conftest import free_port, wait_for
from helpers import scrape, scrape_until, value

from transportd import config as cfgmod
from transportd.devtools.chaos.harness import receive_workers
from transportd.node.metrics import NodeMetrics
from transportd.node.receiver import Forward
from transportd.node.sessions import SessionTable
from transportd.node.workers import per_process, replay
from transportd.smtp import replies


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]
    except OSError:
        return False
    return state != "Z"


def send(port: int, subject: str, to: str = "carol@elsewhere.test") -> None:
    msg = EmailMessage()
    msg["From"] = "zed@example.test"
    msg["To"] = to
    msg["Subject"] = subject
    msg.set_content(f"body of {subject}\n")
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.send_message(msg)


def subjects(sink) -> set[str]:
    out = set()
    for raw in sink.messages():
        for line in raw.split(b"\n"):
            if line.startswith(b"Subject: "):
                out.add(line[9:].strip().decode())
                break
    return out


def workers_node(make_node, sink, workers: int, **delivery):
    port = free_port()
    node = make_node(smart_host=sink.address, overrides={
        "frontend": {"workers": workers}, "metrics": {"listen": f"127.0.0.1:{port}"},
        "delivery": delivery})
    node.metrics_port = port
    node.start()
    wait_for(lambda: len(receive_workers(node.proc.pid)) == workers - 1 and "receive worker" in node.log_path.read_text(),
             timeout=30, what=f"{workers - 1} receive worker(s) serving")
    wait_for(lambda: node.log_path.read_text().count("serving the frontend on") == workers - 1, timeout=30,
             what="every worker listening")
    return node


def test_workers_share_the_frontend_and_the_owner_tracks_counts_and_delivers_at_once(make_node, sink):
    sink.start()
    # A minute between queue scans: only the workers' "queue changed" can make delivery this quick.
    node = workers_node(make_node, sink, 3, queue_poll_interval=60)
    for i in range(12):
        subject = f"seq-{i}"
        send(node.port, subject)
        wait_for(lambda s=subject: s in subjects(sink), timeout=10, what=f"{subject} delivered at once")
    log = node.log_path.read_text()
    by_worker = {w: log.count(f"/w{w} INFO transportd: queued message") for w in (1, 2)}
    assert sum(by_worker.values()) >= 1, by_worker  # (2/3)^12 of the time no worker would take one
    # Every message, whichever process took it: one RECEIVE row in the owner's tracking log, counted once.
    rows = [line for p in (node.data_dir / "msgtrk").glob("MSGTRK*.LOG")
            for line in p.read_text(encoding="utf-8-sig").splitlines() if ",RECEIVE," in line]
    assert len(rows) == 12
    assert "Traceback" not in node.log_path.read_text()  # (a worker's tracking log once lacked an attribute)
    samples = scrape_until("127.0.0.1", node.metrics_port,
                           lambda s: value(s, "transportd_messages_received_total", connector="frontend") == 12,
                           "12 receptions counted by the owner")
    assert value(samples, "transportd_accept_latency_seconds_count") == 12
    assert value(samples, "transportd_connections_limit", connector="frontend") == 5000


def test_a_worker_killed_under_load_loses_nothing_and_is_started_again(make_node, sink):
    sink.start()
    node = workers_node(make_node, sink, 2)
    victim = receive_workers(node.proc.pid)[0]
    acknowledged: list[str] = []
    refused: list[str] = []
    lock = threading.Lock()
    counter = iter(range(100000))
    deadline = time.monotonic() + 60

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                n = next(counter)
            if n >= 160:
                return
            subject = f"load-{n}"
            try:
                send(node.port, subject)
            except (smtplib.SMTPException, OSError):
                refused.append(subject)  # a session the dead worker held: the client retries later
                continue
            with lock:
                acknowledged.append(subject)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: len(acknowledged) >= 40, timeout=30, what="load under way")
    import os
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(90)
    assert len(acknowledged) >= 100
    wait_for(lambda: set(acknowledged) <= subjects(sink), timeout=60,
             what=f"all {len(acknowledged)} acknowledged messages at the sink")
    wait_for(lambda: [p for p in receive_workers(node.proc.pid) if p != victim], timeout=30,
             what="the worker started again")
    assert "receive worker 1 exited (signal 9)" in node.log_path.read_text()
    assert value(scrape("127.0.0.1", node.metrics_port), "transportd_receive_worker_restarts_total") == 1
    # The node still serves on every process.
    send(node.port, "after-restart")
    wait_for(lambda: "after-restart" in subjects(sink), timeout=15, what="mail after the restart")


def test_workers_stop_with_their_node_and_die_with_it(make_node, sink):
    sink.start()
    node = workers_node(make_node, sink, 3)
    pids = receive_workers(node.proc.pid)
    assert node.stop() == 0
    assert not [p for p in pids if alive(p)]
    node.start()
    wait_for(lambda: len(receive_workers(node.proc.pid)) == 2, timeout=30, what="workers after the restart")
    pids = receive_workers(node.proc.pid)
    node.kill9()  # the kernel ends the workers with their owner (PR_SET_PDEATHSIG)
    wait_for(lambda: not [p for p in pids if alive(p)], timeout=10, what="workers gone with their owner")


def test_a_second_node_on_the_same_address_is_refused_with_workers_too(make_node, sink):
    """SO_REUSEPORT, which the workers share the node's listener by, would let another node's listener
    join it and take a share of its mail into another queue; a second node with workers is refused
    as one without them is."""
    sink.start()
    first = workers_node(make_node, sink, 2)
    listen = first.sections["frontend"]["listen"]
    second = make_node("second", smart_host=sink.address, overrides={"frontend": {"workers": 2, "listen": listen}})
    second.start(wait=False)
    assert second.proc.wait(timeout=30) == 1
    assert f"cannot start: frontend.listen {listen}: cannot listen: Address already in use" in second.log()
    assert first.alive and len(receive_workers(first.proc.pid)) == 1


# ------------------------------------------------------------------------------ settings, no processes

def _cfg(**frontend) -> cfgmod.Config:
    return cfgmod.load_dict({"node": {"name": "n1.transportd.test"}, "frontend": frontend})


def test_workers_setting_auto_a_number_or_a_clear_error() -> None:
    assert _cfg().frontend.workers == "auto"
    assert cfgmod.worker_count(_cfg()) >= 1
    assert cfgmod.worker_count(_cfg(workers=4)) == 4
    for bad, needle in ((0, "out of range (1..256)"), (300, "out of range"), ("many", "expected auto or a number"),
                        (True, "expected auto or a number")):
        with pytest.raises(cfgmod.ConfigError, match="frontend.workers") as err:
            _cfg(workers=bad)
        assert needle in str(err.value)


def test_command_rate_is_split_and_connection_limits_stay_the_nodes() -> None:
    cfg = _cfg(max_inbound_connection=5000, max_inbound_connection_per_source=20, max_command_rate=0)
    assert per_process(cfg, 1) is cfg
    fe = per_process(cfg, 3).frontend  # connection limits: the node's, checked over all processes
    assert (fe.max_inbound_connection, fe.max_inbound_connection_per_source, fe.max_command_rate) == (5000, 20, 0)
    assert per_process(_cfg(max_command_rate=10), 4).frontend.max_command_rate == 3


def test_sessions_are_counted_over_all_processes_against_the_nodes_limits() -> None:
    """Each process writes its own row of the shared table and checks the sum of all rows: the
    node's per-source limit holds however the kernel spreads a client's sessions."""
    owner_table = SessionTable(3)
    worker_table = SessionTable(3, os.dup(owner_table.fd))  # what a worker maps from the fd it is given
    try:
        owner = owner_table.counter(0, 10, 4)
        worker = worker_table.counter(2, 10, 4)
        assert owner.acquire("192.0.2.1") is None
        assert worker.acquire("192.0.2.1") is None
        assert worker.acquire("192.0.2.1") is None
        assert owner.acquire("192.0.2.1") is None
        assert worker.acquire("192.0.2.1") == replies.S421_TOO_MANY_FROM_SOURCE  # 4 open over two processes
        assert owner.acquire("192.0.2.1") == replies.S421_TOO_MANY_FROM_SOURCE
        assert (owner.total, worker.total, owner_table.total()) == (2, 2, 4)
        assert all(worker.acquire(f"198.51.100.{i}") is None for i in range(6))
        assert owner.acquire("203.0.113.9") == replies.S421_TOO_MANY_CONNECTIONS  # 10 open in all
        worker.release("192.0.2.1")
        assert owner.acquire("192.0.2.1") is None
        owner_table.clear(2)  # worker 2 died: the owner drops its row before starting it again
        assert owner_table.total() == 3
        assert owner.acquire("192.0.2.1") is None
    finally:
        worker_table.close()
        owner_table.close()


def test_sessions_right_after_start_are_not_refused_while_workers_start(make_node, sink) -> None:
    """The node's per-source limit holds from its first second: before the workers listen, the
    owner alone serves every session (the kernel has no other listener) and must not refuse at a
    third of the limit; once they listen, a 7th session is refused whichever process gets it."""
    node = make_node(smart_host=sink.address, overrides={
        "frontend": {"workers": 3, "max_inbound_connection_per_source": 6}})
    node.start()
    sessions = []
    try:
        for _ in range(6):
            s = smtplib.SMTP(timeout=30)
            code, banner = s.connect("127.0.0.1", node.port)
            assert code == 220, banner
            sessions.append(s)
        wait_for(lambda: node.log_path.read_text().count("serving the frontend on") == 2, timeout=30,
                 what="both workers listening")
        for _ in range(3):  # wherever the kernel puts it, a 7th session is over the node's limit
            s = smtplib.SMTP(timeout=30)
            try:
                assert s.connect("127.0.0.1", node.port)[0] == 421
            except smtplib.SMTPServerDisconnected:
                pass  # the 421 and the close raced the read: refused either way
            finally:
                s.close()
        # the metrics show the node's sessions (every process's row of the shared table)
        assert _frontend_open(node) == 6
        for s in sessions[:2]:
            s.quit()
        wait_for(lambda: _frontend_open(node) == 4, timeout=10, what="two sessions fewer in /metrics")
    finally:
        for s in sessions:
            s.close()


def test_a_client_at_its_limit_that_quits_and_connects_again_at_once_is_served(make_node, sink) -> None:
    """A session's place is given back with its 221, not when its process next sees the socket
    closed: the client's next session, at once on another worker, is not counted against it."""
    sink.start()
    node = make_node(smart_host=sink.address, overrides={
        "frontend": {"workers": 3, "max_inbound_connection_per_source": 2}}).start()
    wait_for(lambda: node.log_path.read_text().count("serving the frontend on") == 2, timeout=30,
             what="both workers listening")
    held = smtplib.SMTP("127.0.0.1", node.port, timeout=30)  # one session held: one place left
    refused = 0
    try:
        for _ in range(150):
            s = smtplib.SMTP(timeout=30)
            try:
                if s.connect("127.0.0.1", node.port)[0] != 220:
                    refused += 1
                s.quit()
            except smtplib.SMTPServerDisconnected:
                refused += 1
            finally:
                s.close()
    finally:
        held.close()
    assert refused == 0, f"{refused} of 150 sessions refused under the limit"


def _frontend_open(node) -> float:
    host, _, port = node.metrics_listen.rpartition(":")
    return value(scrape(host, int(port)), "transportd_connections_open", connector="frontend")


def test_forwarded_metric_calls_replay_on_the_owners_metrics() -> None:
    """What a worker records (attribute reads, labels(), then inc/observe/on_event) is applied to
    the owner's real counters by replaying the steps."""
    sent: list = []
    remote = Forward(sent.append, "metric")
    remote.internal_failures.labels("shadow").inc()
    remote.accept_latency.observe(0.25)
    remote.on_event("RECEIVE", {"id": 1}, "frontend", "")
    assert [f[0] for f in sent] == ["metric"] * 3
    owner = NodeMetrics("n1.transportd.test", 50)
    for frame in sent:
        replay(owner, frame[1])
    assert owner.internal_failures.labels("shadow")._value.get() == 1
    assert owner.received.labels("frontend")._value.get() == 1
