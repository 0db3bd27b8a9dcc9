"""Operator bulk writes take turns with the running node's writer (postsuper never holds smtpd up).

A ``transportd message suspend|remove`` over thousands of queued messages, or a ``safetynet
resubmit`` over thousands of Safety Net copies, runs while a real node receives: another
sender's 250 (its message made durable by the node's group-commit writer) must not wait for
the command. Each CLI transaction takes the writer turn (``queue.db.writer-turn``) the node's
writer takes, is bounded in time as well as in messages, and the CLI yields between them; the
Safety Net scan reads outside any write transaction. Checked with a probe sending a message
every 0.1 s and timing the reply to its data; and that the commands still change exactly what
they selected.
"""

from __future__ import annotations

import smtplib
import subprocess
import sys
import threading
import time
import uuid

from conftest import free_port, read_db, wait_for

from transportd.config import load
from transportd.queue import messages as mq
from transportd.queue.routing import bifurcate
from transportd.queue.store import QueueStore, messages, recipients

# The longest a 250 may wait while a bulk command runs: a commit of the node's own (tens of ms on
# a busy machine) plus one bounded CLI transaction (~0.15 s) leave a wide margin; the old code
# held it for the whole command (seconds).
MAX_REPLY_WAIT = 2.5
QUIET = {"delivery": {"transient_failure_retry_interval": 300, "outbound_connection_failure_retry_interval": 300}}


def transportd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transportd", *args], capture_output=True, text=True,
                          timeout=240, check=False)


def seed(node, n: int, sender: str, to: str, *, safety_net: bool = False) -> None:
    """``n`` messages written with the queue layer's own functions while the node is stopped:
    deferred (their next try an hour away), or, with ``safety_net``, delivered and held in the
    Safety Net."""
    cfg = load(node.config_path)
    now = time.time()
    store = QueueStore.open(cfg.db_path, create=False, repair=False)
    try:
        def write(conn, start):
            made = []
            for i in range(start, min(n, start + 2000)):
                made.append(mq.enqueue(conn, mq.NewMessage(
                    network_message_id=str(uuid.uuid4()), sender=sender.format(i=i),
                    data=f"Subject: seeded {i}\r\n\r\n{'body ' * 200}\r\n".encode(),
                    recipients=bifurcate([to.format(i=i)], cfg), received_at=now - 600, expires_at=now + 86400,
                    subject=f"seeded {i}")))
            if safety_net:
                conn.execute(recipients.update().where(recipients.c.message_id.in_(made))
                             .values(status=mq.DELIVERED, completed_at=now - 60))
                conn.execute(messages.update().where(messages.c.id.in_(made)).values(
                    state=mq.SAFETY_NET, completed_at=now - 60, safety_net_until=now + 86400))
            else:
                conn.execute(recipients.update().where(recipients.c.message_id.in_(made))
                             .values(status=mq.RETRY, attempts=1, next_retry_at=now + 3600))
        for start in range(0, n, 2000):
            store.transaction(lambda conn, start=start: write(conn, start))
    finally:
        store.close()


class Probe:
    """Another sender: one message every ``interval`` s on its own session, each timed from the
    end of its data to the reply; (code, seconds) of each."""

    def __init__(self, port: int, interval: float = 0.1):
        self.port, self.interval = port, interval
        self.replies: list[tuple[int, float]] = []
        self.sent_ids: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with smtplib.SMTP("127.0.0.1", self.port, timeout=60) as s:
            s.ehlo("probe.test")
            while not self._stop.is_set():
                s.mail("probe@probe.test")
                s.rcpt("zed@elsewhere.test")
                code, _ = s.docmd("DATA")
                assert code == 354
                t0 = time.monotonic()
                s.send(b"Subject: probe\r\n\r\nprobe\r\n.\r\n")
                code, _ = s.getreply()
                self.replies.append((code, time.monotonic() - t0))
                if code != 250:
                    s.rset()
                self._stop.wait(self.interval)

    def __enter__(self) -> Probe:  # noqa: PYI034 - used only as itself
        self._thread.start()
        wait_for(lambda: len(self.replies) >= 3, timeout=20, what="the probe's first replies")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(70)

    def during(self, fn):
        """Run ``fn`` and return (its result, the probe's replies meanwhile)."""
        first, t0 = len(self.replies), time.monotonic()
        result = fn()
        print(f"took {time.monotonic() - t0:.2f} s")
        time.sleep(2 * self.interval)
        return result, self.replies[first:]


def assert_not_held_up(replies: list[tuple[int, float]], what: str) -> None:
    assert len(replies) >= 3, f"{what}: the probe got only {len(replies)} replies"
    codes = sorted({c for c, _ in replies})
    worst = max(t for _, t in replies)
    print(f"{what}: {len(replies)} probe replies, codes {codes}, worst wait {worst:.3f} s")
    assert codes == [250], f"{what}: the probe got {codes} ({replies})"
    assert worst < MAX_REPLY_WAIT, f"{what}: a 250 waited {worst:.2f} s (more than {MAX_REPLY_WAIT} s)"


SEEDED, OTHERS = 5000, 200


def test_bulk_suspend_and_remove_let_the_nodes_writer_take_turns(make_node):
    node = make_node(smart_host=f"127.0.0.1:{free_port()}", overrides=QUIET).start()  # next hop down
    assert node.stop() == 0
    seed(node, SEEDED, "s{i}@bulk.example", "r{i}@elsewhere.test")
    seed(node, OTHERS, "u{i}@keep.example", "k{i}@elsewhere.test")
    node.start()
    db = node.data_dir / "queue.db"
    count = ("SELECT sender LIKE '%@bulk.example', sum(suspended), count(*) FROM messages "
             "WHERE role = 'primary' AND state = 'Queued' AND sender != 'probe@probe.test' GROUP BY 1 ORDER BY 1")
    assert read_db(db, count) == [(0, 0, OTHERS), (1, 0, SEEDED)]

    with Probe(node.port) as probe:
        res, replies = probe.during(lambda: transportd("message", "suspend", "--filter", "sender=*@bulk.example",
                                                       "--config", str(node.config_path)))
        assert res.returncode == 0, res
        assert f"{SEEDED} message(s) suspended in " in res.stdout, res.stdout
        assert_not_held_up(replies, "message suspend (batches of 500)")
        assert read_db(db, count) == [(0, 0, OTHERS), (1, SEEDED, SEEDED)]

        res, replies = probe.during(lambda: transportd("message", "remove", "--filter", "sender=*@bulk.example",
                                                       "--batch-size", "100000", "--config", str(node.config_path)))
        assert res.returncode == 0, res
        assert f"{SEEDED} message(s) removed in " in res.stdout, res.stdout
        assert_not_held_up(replies, "message remove --batch-size 100000")
    # Exactly the selected ones: the others (and the probe's) still queued, untouched.
    assert read_db(db, count) == [(0, 0, OTHERS)]
    probe_queued = read_db(db, "SELECT count(*), sum(suspended) FROM messages WHERE sender = 'probe@probe.test' "
                               "AND state = 'Queued'")[0]
    assert probe_queued == (len(probe.replies), 0), probe_queued
    assert "database is locked" not in node.log()


COPIES, LOCAL = 12000, 40


def test_safety_net_resubmit_reads_outside_the_write_transaction(make_node):
    """A request over thousands of Safety Net copies, nearly all of them for recipients outside
    the boundary (never resubmitted): the node's 250s do not wait for the scan, and exactly the
    copies for the destination are queued again, each with its RESUBMIT row."""
    node = make_node(smart_host=f"127.0.0.1:{free_port()}", overrides=QUIET).start()
    assert node.stop() == 0
    seed(node, COPIES, "s{i}@far.example", "r{i}@elsewhere.test", safety_net=True)
    seed(node, LOCAL, "l{i}@far.example", "alice@example.test", safety_net=True)
    node.start()
    db = node.data_dir / "queue.db"
    assert read_db(db, "SELECT count(*) FROM messages WHERE state = 'SafetyNet'") == [(COPIES + LOCAL,)]
    local = [i for (i,) in read_db(db, "SELECT id FROM messages WHERE sender LIKE 'l%' ORDER BY id")]
    start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
    with Probe(node.port) as probe:
        res, replies = probe.during(lambda: transportd("safetynet", "resubmit", "--destination", "local",
                                                       "--start", start, "--config", str(node.config_path)))
    assert res.returncode == 0, res
    assert f"{LOCAL} message(s) resubmitted to local" in res.stdout, res.stdout
    assert_not_held_up(replies, "safetynet resubmit")
    again = read_db(db, "SELECT sender, origin FROM messages WHERE origin = 'resubmit' ORDER BY id")
    assert again == [(f"l{i}@far.example", "resubmit") for i in range(LOCAL)], again
    rows = node.tracking(event_id="RESUBMIT")
    assert sorted(int(r["reference"]) for r in rows) == local
    assert "database is locked" not in node.log()


def test_a_bulk_transaction_ends_after_its_batch_size_or_its_time(tmp_path, monkeypatch):
    """``bulk.in_turns``: every id once, in order; a transaction takes at most ``max_batch`` ids,
    and fewer once about ``budget`` seconds of work have passed (checked between steps)."""
    from transportd.queue import bulk
    monkeypatch.setattr(bulk, "YIELD_TIME", 0)
    store = QueueStore.open(tmp_path / "queue.db")
    try:
        seen: list[int] = []

        def cheap(conn, chunk):
            seen.extend(chunk)
            return list(chunk)
        assert [len(t) for t in bulk.in_turns(store, list(range(100)), cheap, max_batch=30)] == [30, 30, 30, 10]
        assert seen == list(range(100))

        def dear(conn, chunk):  # 10 ms an id: a first step of 16 ids is past a 0.1 s budget
            time.sleep(0.01 * len(chunk))
            return list(chunk)
        done = list(bulk.in_turns(store, list(range(40)), dear, max_batch=500, budget=0.1))
        assert [len(t) for t in done] == [bulk.STEP, bulk.STEP, 40 - 2 * bulk.STEP]
        assert [i for t in done for i in t] == list(range(40))
    finally:
        store.close()
