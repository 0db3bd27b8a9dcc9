"""Storage faults while running: the disk holding the data dir fills up.

The node's data dir is a small tmpfs mounted for the test (conftest's ``small_disk``: needs
root; skipped otherwise, saying so). While the disk is full the daemon answers 4xx (never 5xx, never a 250 it
cannot keep), stays up, keeps every message it acknowledged, and accepts mail again
once space returns; a restart afterwards still finds every acknowledged message.
A corrupt queue database found at start-up is covered in test_store.py
(test_daemon_moves_garbage_database_aside_and_serves). Two tests keep the tracking logs
from filling a disk at all: their retention limits.
A disk whose fsync fails (strace's fault injection) is covered last: what a failed commit
reported as failed does not come back after a crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import smtplib
import subprocess
import time
from pathlib import Path

import pytest
from clusters import FOREIGN
from conftest import free_port, queued_id, wait_for
from helpers import fill

BODY = b"Subject: disk %d\r\n\r\n" + (b"x" * 76 + b"\r\n") * 120  # ~10 KB


def send(port: int, n: int, host: str = "127.0.0.1") -> tuple[int, str]:
    try:
        with smtplib.SMTP(host, port, timeout=20) as s:
            s.ehlo("disk.test")
            s.mail("a@remote.test")
            code, msg = s.rcpt("bob@elsewhere.test")
            if code != 250:
                return code, msg.decode()
            code, msg = s.data(BODY % n)
            return code, msg.decode()
    except smtplib.SMTPResponseException as exc:
        return exc.smtp_code, exc.smtp_error.decode()


def test_disk_full_answers_4xx_keeps_acknowledged_and_recovers(make_node, small_disk):
    # The smart host does not answer: every message stays queued on the full disk.
    node = make_node(smart_host=f"127.0.0.1:{free_port()}",
                     overrides={"node": {"data_dir": str(small_disk / "data")}})
    node.data_dir = small_disk / "data"
    node.start()
    acked: set[int] = set()
    for n in range(5):
        code, msg = send(node.port, n)
        assert code == 250, msg
        acked.add(int(re.search(r"queued as (\d+)", msg).group(1)))

    fill(small_disk)
    replies = [send(node.port, 100 + n) for n in range(6)]
    for code, msg in replies:
        assert code == 250 or 400 <= code < 500, (code, msg)
        if code == 250:
            acked.add(int(re.search(r"queued as (\d+)", msg).group(1)))
    assert any(400 <= code < 500 for code, _ in replies), f"the full disk was never noticed: {replies}"
    assert node.alive
    time.sleep(3)  # the scheduler's passes (retries due every second) fail meanwhile: said once, not a storm
    full_log = node.log()
    assert "Traceback" not in full_log and "Background on this error" not in full_log, full_log[-3000:]
    assert full_log.count("queue database commit failed") <= 2, full_log[-3000:]

    os.unlink(small_disk / "filler")

    def accepted_again():
        code, msg = send(node.port, 200)
        return msg if code == 250 else None
    msg = wait_for(accepted_again, timeout=20, interval=0.5, what="a 250 once space returned")
    acked.add(int(re.search(r"queued as (\d+)", msg).group(1)))

    assert node.stop() == 0
    node.start()
    ids = {m["id"] for m in node.cli_json("message", "list", "--all")}
    assert acked <= ids, f"acknowledged but lost: {sorted(acked - ids)}"
    assert node.alive
    log = node.log()
    assert "queue database unavailable, answering 451" in log and "disk is full" in log
    assert "queue database commits succeed again" in log


def test_a_stopped_nodes_queue_is_listed_on_a_full_disk_and_nothing_is_written(make_node, small_disk):
    """With the node stopped and its disk full, opening the database as usual fails (SQLite
    cannot make its -shm); the listings read the file as it stands, with a warning, and an
    action that would change the queue is refused and changes nothing."""
    node = make_node(smart_host=f"127.0.0.1:{free_port()}",
                     overrides={"node": {"data_dir": str(small_disk / "data")}})
    node.data_dir = small_disk / "data"
    node.start()
    acked = set()
    for n in range(3):
        code, msg = send(node.port, n)
        assert code == 250, msg
        acked.add(int(re.search(r"queued as (\d+)", msg).group(1)))
    assert node.stop() == 0
    fill(small_disk)
    db = node.data_dir / "queue.db"
    before = db.read_bytes()

    listed = node.cli("message", "list", "--json")
    assert {json.loads(line)["id"] for line in listed.stdout.splitlines()} == acked
    assert "read as it stands on disk" in listed.stderr and "Traceback" not in listed.stderr
    queues = node.cli("queue", "list")
    assert "3" in queues.stdout, queues.stdout
    shown = node.cli("message", "show", str(min(acked)))
    assert "disk 0" in shown.stdout, shown.stdout
    node.cli("shadow", "list")
    node.cli("safetynet", "list")
    refused = node.cli("message", "suspend", str(min(acked)), check=False)
    assert refused.returncode != 0 and "cannot be used" in refused.stderr, refused
    assert "Traceback" not in refused.stderr
    assert db.read_bytes() == before

    os.unlink(small_disk / "filler")
    node.start()
    rows = {m["id"]: m for m in node.cli_json("message", "list")}
    assert set(rows) == acked and all(r["status"] != "Suspended" for r in rows.values()), rows


def test_a_full_tracking_log_volume_costs_no_tracking_row(make_node, sink, small_disk):
    """The tracking logs on a volume of their own (tracking.message_tracking_log_path, as Exchange
    sites often keep them) that fills up: mail goes on (the queue database has room), each row the
    volume refuses is kept and written once it has room again, by the next row or within a second
    without one, in full and once."""
    sink.start()
    node = make_node(smart_host=sink.address,
                     overrides={"tracking": {"message_tracking_log_path": str(small_disk / "msgtrk")}}).start()
    ids = [int(re.search(r"queued as (\d+)", send(node.port, n)[1]).group(1)) for n in range(3)]
    wait_for(lambda: len(node.tracking(event_id="SENDEXTERNAL")) == 3, timeout=15, what="3 sent")
    fill(small_disk)
    for n in range(3, 8):
        code, msg = send(node.port, n)
        assert code == 250, msg  # the queue database is elsewhere: a full tracking volume refuses no mail
        ids.append(int(re.search(r"queued as (\d+)", msg).group(1)))
    wait_for(lambda: len(sink.messages()) >= 8, timeout=15, what="8 at the sink")
    refused = set(re.findall(r"cannot write tracking log \((\w+) (\d+)\)", node.log()))
    assert ("RECEIVE", str(ids[-1])) in refused, node.log()[-3000:]
    os.unlink(small_disk / "filler")  # the maintenance round (or the last message's late row) writes the kept ones

    def all_written():
        got = [(r["event-id"], r["internal-message-id"]) for r in node.tracking()]
        return got if refused <= set(got) else None
    rows = wait_for(all_written, timeout=10, what="the kept tracking rows written")
    # said once they are in, whichever wrote them (the maintenance round or a late row)
    wait_for(lambda: "tracking log writable again: wrote" in node.log(), timeout=5, what="the log line")
    assert len(rows) == len(set(rows)), "a kept row was written twice"
    for i in ids:
        assert ("RECEIVE", str(i)) in rows and ("SENDEXTERNAL", str(i)) in rows, i
    assert node.alive


def test_tracking_logs_past_retention_are_removed_by_the_running_node(make_node, sink):
    """MessageTrackingLogMaxAge and MessageTrackingLogMaxDirectorySize: a tracking-log file last
    written before the age limit is removed, then the oldest files while the folder is over the
    size limit, by the running node's housekeeping; the file being written and files that are not
    tracking logs stay, and mail goes on. With MessageTrackingLogSubjectLoggingEnabled off the
    rows carry no subject (the message still does)."""
    sink.start()
    node = make_node(smart_host=sink.address, overrides={"tracking": {
        "message_tracking_log_max_file_size": "2KB", "message_tracking_log_max_directory_size": "8KB",
        "message_tracking_log_max_age": "1d", "message_tracking_log_subject_logging_enabled": False}})
    folder = node.data_dir / "msgtrk"
    folder.mkdir(parents=True)
    old = folder / "MSGTRK20260101-1.LOG"
    old.write_bytes(b"#Software: transportd\r\n")
    long_ago = os.path.getmtime(old) - 40 * 86400
    os.utime(old, (long_ago, long_ago))
    notes = folder / "README.txt"  # not a tracking log: never removed, never counted
    notes.write_bytes(b"n" * 20000)
    os.utime(notes, (long_ago, long_ago))
    node.start()
    for n in range(20):
        code, msg = send(node.port, n)
        assert code == 250, msg
    wait_for(lambda: len(sink.messages()) >= 20, timeout=30, what="20 at the sink")

    def folder_size() -> int:
        return sum(p.stat().st_size for p in folder.glob("MSGTRK*.LOG"))
    wait_for(lambda: folder_size() <= 8 * 1024, timeout=15, what="the folder within 8KB")
    log = node.log()
    assert re.search(r"tracking log retention: removed MSGTRK20260101-1\.LOG \(\d+ bytes\), older than "
                     r"message_tracking_log_max_age", log), log[-3000:]
    removed = re.findall(r"tracking log retention: removed (MSGTRK\S+) \(\d+ bytes\), folder over "
                         r"message_tracking_log_max_directory_size", log)
    assert removed and not any((folder / name).exists() for name in removed), removed
    assert not old.exists() and notes.exists()
    code, msg = send(node.port, 20)  # the node writes on into its current file
    assert code == 250, msg
    last = re.search(r"queued as (\d+)", msg).group(1)
    wait_for(lambda: [r for r in node.tracking(event_id="SENDEXTERNAL") if r["internal-message-id"] == last],
             timeout=15, what="the 21st message's SENDEXTERNAL row")
    rows = [r for r in node.tracking() if r["internal-message-id"] == last]
    assert {r["event-id"] for r in rows} == {"RECEIVE", "SENDEXTERNAL"}
    assert all(r["message-subject"] == "" for r in rows), rows
    assert any(b"Subject: disk 20" in m for m in sink.messages())
    assert node.alive and "Traceback" not in node.log()


def test_a_copy_whose_message_could_not_be_committed_is_discarded_once_there_is_room(cluster, sink, small_disk):
    """node1's disk is full between the shadow copy and its own commit: the sender gets a 4xx and
    sends again, so the peer's copy must not stay (a promotion would deliver it a second time).
    The discard the full database refused is kept and recorded with the next commit that finds
    room; the peer drops the copy at its next heartbeat."""
    sink.start()
    c = cluster()
    node1 = c["node1"]
    node1.set("node", "data_dir", str(small_disk / "data"))
    c.start()
    queued_id(node1.swaks(FOREIGN))

    def held_for_node1() -> int:
        return sum(c[s].shadow_row(node1.name)["shadows"] for s in ("node2", "node3"))
    wait_for(lambda: held_for_node1() == 0, timeout=15, what="the first message's shadow discarded")

    fill(small_disk)
    replies = [send(node1.frontend_port, 100 + n, host=node1.host) for n in range(3)]
    assert node1.proc.poll() is None
    assert all(code == 250 or 400 <= code < 500 for code, _ in replies), replies
    assert any(400 <= code < 500 for code, _ in replies), f"the full disk was never noticed: {replies}"
    wait_for(lambda: held_for_node1() >= 1, timeout=10, what="a peer holding a copy of a refused message")

    os.unlink(small_disk / "filler")
    wait_for(lambda: node1.swaks(FOREIGN).returncode == 0, timeout=20, what="node1 to accept again")
    wait_for(lambda: held_for_node1() == 0, timeout=15, what="the orphaned copies discarded by their peers")
    assert "is queued with the next message the queue database takes" in node1.log()
    assert "orphaned shadow cop" in node1.log()


def test_orphaned_copies_of_a_worker_that_never_commits_again_are_discarded_on_their_own(cluster, sink, small_disk):
    """Two receive processes; node1's disk is full between each shadow copy and its commit, so every
    sender gets 451 4.3.0 while node2 holds the copies. Space returns and no message comes again:
    no commit of either process would carry the discards it holds. They are retried on their own,
    node2 drops the copies within a few heartbeats, and a node1 lost afterwards has nothing of
    them promoted and delivered (the senders were told to try again: a promoted copy would be a
    second delivery of each)."""
    sink.start()
    c = cluster(nodes=2, sites=1, overrides={"frontend": {"workers": 2}})
    node1, node2 = c["node1"], c["node2"]
    node1.set("node", "data_dir", str(small_disk / "data"))
    c.start()
    queued_id(node1.swaks(FOREIGN))
    wait_for(lambda: len(sink.messages()) == 1, timeout=15, what="the first message at the sink")
    wait_for(lambda: node2.shadow_row(node1.name)["shadows"] == 0, timeout=15, what="its shadow discarded")

    fill(small_disk)
    big = b"Subject: refused %d\r\n\r\n" + (b"y" * 76 + b"\r\n") * 3000  # ~230 KB: past the WAL's free room
    replies = []
    for n in range(12):  # a session each: the kernel spreads them over both processes
        try:
            with smtplib.SMTP(node1.host, node1.frontend_port, timeout=20) as s:
                s.ehlo("disk.test")
                s.mail("a@remote.test")
                s.rcpt(FOREIGN)
                replies.append(s.data(big % n))
        except smtplib.SMTPResponseException as exc:
            replies.append((exc.smtp_code, exc.smtp_error))
    assert all(code == 451 for code, _ in replies), replies
    held = node2.shadow_row(node1.name)["shadows"]
    assert held == len(replies), (held, replies)
    assert "is queued with the next message the queue database takes" in node1.log()

    os.unlink(small_disk / "filler")  # room again, and no message comes: nothing commits for them
    wait_for(lambda: node2.shadow_row(node1.name)["shadows"] == 0, timeout=10,
             what="node2's copies of the refused messages discarded without another message")
    assert "orphaned shadow cop" in node1.log()

    node1.proc.kill()  # kill -9: node2 promotes whatever it still holds of node1 after the span
    node1.proc.wait(timeout=10)
    time.sleep(node2.cfg.shadow_redundancy.shadow_resubmit_time_span + 3)
    assert not any(b"Subject: refused" in m for m in sink.messages()), "a refused message was delivered"
    assert not node2.tracking(event_id="RESUBMIT"), node2.tracking(event_id="RESUBMIT")


@contextlib.contextmanager
def failing_fsyncs(pid: int, when: str = "1"):
    """The fdatasync calls of process ``pid`` fail with EIO (strace's fault injection; ``when`` in
    its syntax: "1" the first one after attaching, "1+" every one), as a disk that loses a write."""
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if os.geteuid() != 0 and scope.exists() and scope.read_text().strip() != "0":
        pytest.skip("strace cannot attach to the node here (ptrace_scope)")
    strace = subprocess.Popen(["strace", "-f", "-p", str(pid), "-e", "trace=fdatasync",
                               "-e", f"inject=fdatasync:error=EIO:when={when}", "-o", os.devnull],
                              stderr=subprocess.PIPE, text=True)
    try:
        line = strace.stderr.readline()
        assert "attached" in line, line  # every thread is attached before strace goes on
        time.sleep(0.3)
        yield
    finally:
        strace.terminate()  # detaches; the node runs on
        strace.wait(timeout=10)


def test_a_message_refused_at_a_failed_fsync_does_not_come_back_after_a_crash(make_node):
    """The fsync of the message's commit fails: its frames are in the write-ahead log, complete,
    only not counted yet, so recovery after a crash would bring the message back and deliver the
    one the sender was told 451 to send again (twice, once it does). The node settles the failed
    commit before it answers: after a kill -9 the message is not there."""
    node = make_node(smart_host=f"127.0.0.1:{free_port()}")
    node.start()
    time.sleep(1)  # the start's own commits are behind us
    with failing_fsyncs(node.proc.pid):
        code, msg = send(node.port, 1)
    assert code == 451 and msg.startswith("4.3.0"), (code, msg)
    node.kill9()
    node.start()
    assert node.cli_json("message", "list", "--all") == []
    code, msg = send(node.port, 2)
    assert code == 250, msg
    assert "could not be settled" not in node.log()

