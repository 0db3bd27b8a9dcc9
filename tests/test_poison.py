"""One message never holds up another, and the Poison queue (Exchange's PoisonThreshold).

Unit tests of the counting rules on a real queue database; then real node processes with the
test-only fault hook (``TRANSPORTD_TEST_FAULTS``, transportd/faults.py) making one message's
handling fail inside a loop, and kill -9 of a node while it handles a message.
"""

from __future__ import annotations

import json
import smtplib
import subprocess
import sys
import time

import pytest
from clusters import netid_of, one
from conftest import Sink, read_db, wait_for, write_toml
from helpers import folded

from transportd import faults
from transportd.node import handling
from transportd.node.handling import HandlingMark
from transportd.queue import messages as mq
from transportd.queue.messages import NewMessage
from transportd.queue.routing import NextHop, SMART_HOST
from transportd.queue.store import QueueStore

HOP = NextHop("smarthost:127.0.0.1:25", SMART_HOST, "127.0.0.1:25")


def new_message(subject: str = "hello", n_rcpts: int = 1) -> NewMessage:
    now = time.time()
    return NewMessage(network_message_id=f"id-{subject}-{time.time_ns()}", sender="a@example.test",
                      data=b"Subject: x\r\n\r\nbody\r\n", recipients={HOP: [f"r{i}@elsewhere.test" for i in range(n_rcpts)]},
                      received_at=now, expires_at=now + 3600, subject=subject)


@pytest.fixture
def store(tmp_path):
    s = QueueStore.open(tmp_path / "queue.db")
    yield s
    s.close()


# --------------------------------------------------------------------------- counting rules

def test_threshold_moves_to_poison_and_the_scheduler_and_expiry_skip_it(store):
    mid = store.transaction(lambda c: mq.enqueue(c, new_message("bad")))
    other = store.transaction(lambda c: mq.enqueue(c, new_message("good")))
    assert store.transaction(lambda c: mq.count_internal_failure(c, mid, 2)) is False
    assert store.transaction(lambda c: mq.count_internal_failure(c, mid, 2)) is True
    assert store.transaction(lambda c: mq.count_internal_failure(c, mid, 2)) is False  # already there
    due = store.read(lambda c: mq.due_work(c, time.time() + 1))
    assert [w.message_id for w in due] == [other]
    assert store.read(lambda c: [r["message_id"] for r in mq.expired_recipients(c, time.time() + 7200)]) == [other]
    poison = store.read(lambda c: mq.list_messages(c, mq.POISON))
    assert [m["id"] for m in poison] == [mid] and poison[0]["status"] == "Poison"
    queues = store.read(lambda c: mq.list_queues(c, time.time()))
    assert {q["identity"]: q["message_count"] for q in queues} == {HOP.identity: 1, mq.POISON: 1}

    assert store.transaction(lambda c: mq.release_from_poison(c, mid)) is True
    assert {w.message_id for w in store.read(lambda c: mq.due_work(c, time.time() + 1))} == {mid, other}
    row = store.read(lambda c: mq.message_row(c, mid))
    assert row["poison_count"] == 0 and row["poisoned"] == 0


def test_detection_off_counts_but_never_poisons(store):
    mid = store.transaction(lambda c: mq.enqueue(c, new_message()))
    for _ in range(5):
        assert store.transaction(lambda c: mq.count_internal_failure(c, mid, None)) is False
    assert store.read(lambda c: mq.message_row(c, mid))["poison_count"] == 5


def test_a_clean_attempt_forgets_earlier_failures(store):
    mid = store.transaction(lambda c: mq.enqueue(c, new_message()))
    store.transaction(lambda c: mq.count_internal_failure(c, mid, 2))
    store.transaction(lambda c: mq.reset_poison_count(c, mid))
    assert store.transaction(lambda c: mq.count_internal_failure(c, mid, 2)) is False


def test_a_crash_counts_against_the_message_being_handled_only(store):
    """recover_at_start after an unclean stop counts the messages the handling mark names, not
    every message with a recipient left Active; after a clean stop it counts nothing."""
    handled = store.transaction(lambda c: mq.enqueue(c, new_message("handled")))
    waiting = store.transaction(lambda c: mq.enqueue(c, new_message("waiting", n_rcpts=2)))
    for w in store.read(lambda c: mq.due_work(c, time.time() + 1)):
        store.transaction(lambda c, ids=w.recipient_ids: mq.mark_active(c, ids, time.time()))
    assert store.transaction(lambda c: mq.recover_at_start(c, 2, [handled])) == ([], 3)
    for w in store.read(lambda c: mq.due_work(c, time.time() + 1)):
        store.transaction(lambda c, ids=w.recipient_ids: mq.mark_active(c, ids, time.time()))
    moved, ready = store.transaction(lambda c: mq.recover_at_start(c, 2, [handled, handled]))
    assert [r["id"] for r in moved] == [handled] and ready == 3
    assert store.read(lambda c: mq.message_row(c, waiting))["poison_count"] == 0
    store.transaction(mq.mark_clean_stop)
    other = store.transaction(lambda c: mq.enqueue(c, new_message("other")))
    assert store.transaction(lambda c: mq.recover_at_start(c, 1, [other])) == ([], 0)
    assert store.read(lambda c: mq.message_row(c, other))["poison_count"] == 0
    assert store.transaction(lambda c: mq.recover_at_start(c, 2, [424242])) == ([], 0)  # gone: nothing


def test_the_handling_mark_survives_the_process_that_wrote_it(tmp_path):
    """A process killed inside a step leaves the message's id and the step in DATA_DIR/handling;
    a step that ends leaves nothing; a torn or foreign file is read as far as it makes sense."""
    code = ("import os, sys; from pathlib import Path; from transportd.node.handling import HandlingMark\n"
            "mark, left = HandlingMark.open(Path(sys.argv[1]))\n"
            "with mark.step(7, 'deliver'):\n    pass\n"
            "with mark.step(12, 'dsn'):\n    os._exit(3)\n")
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False).returncode == 3
    mark, left = HandlingMark.open(tmp_path)
    assert left == [(12, "dsn")]
    assert HandlingMark.open(tmp_path)[1] == [(12, "dsn")]  # a start that fails before counting leaves it
    mark.clear()
    with mark.step(5, "deliver"):
        assert handling.parse((tmp_path / handling.FILE_NAME).read_bytes()) == [(5, "deliver")]
    with mark.step(6, "x" * 300), mark.step(8, "dsn"):  # a record longer than the usual 256 bytes
        assert handling.parse((tmp_path / handling.FILE_NAME).read_bytes()) == [(6, "x" * 300), (8, "dsn")]
    assert handling.parse((tmp_path / handling.FILE_NAME).read_bytes()) == []  # none of it left behind
    mark.close()
    assert HandlingMark.open(tmp_path)[1] == []
    (tmp_path / handling.FILE_NAME).write_bytes(b"12 dsn\nnonsense\n\xff\xfe 9\n-4 x\n31\n" + b"4" * 300)
    assert HandlingMark.open(tmp_path)[1] == [(12, "dsn"), (31, "handling")]  # no id past SQLite's 64 bits
    with handling.NO_MARK.step(1, "deliver"):  # the mark of a part built alone writes nothing
        pass


def test_savepoint_undoes_only_the_failing_block(store):
    def job(conn):
        mq.enqueue(conn, new_message("kept"))
        with pytest.raises(RuntimeError):
            with mq.savepoint(conn):
                mq.enqueue(conn, new_message("undone"))
                raise RuntimeError("boom")
    store.transaction(job)
    assert [m["subject"] for m in store.read(lambda c: mq.list_messages(c))] == ["kept"]


def test_fault_plan_matches_one_message_in_one_step():
    faults.configure({"match": "POISON", "steps": ["deliver"]})
    try:
        with pytest.raises(faults.InjectedFault):
            faults.check("deliver", {"subject": "a POISON message"})
        faults.check("deliver", {"subject": "fine"})
        faults.check("expire", {"subject": "a POISON message"})
        with pytest.raises(ValueError):
            faults.configure({"match": "x", "steps": ["nonsense"]})
    finally:
        faults.configure(None)
    faults.check("deliver", {"subject": "a POISON message"})


# --------------------------------------------------------------------------- real processes

def plan(*steps: str, action: str = "raise") -> str:
    return json.dumps({"match": "POISON", "steps": list(steps), "action": action})


def smtp_send(port: int, subject: str, rcpt: str, sender: str = "bob@example.test",
              host: str = "127.0.0.1", utf8: bool = False) -> int:
    data = (f"From: <{sender}>\r\nTo: <{rcpt}>\r\nSubject: {subject}\r\n"
            f"Message-ID: <{time.time_ns()}@client.test>\r\n\r\nbody of {subject}\r\n").encode("utf-8")
    with smtplib.SMTP(host, port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail(sender, ["SMTPUTF8"] if utf8 else [])
        assert s.rcpt(rcpt)[0] == 250
        code, reply = s.data(data)
        assert code == 250, (code, reply)
    return int(reply.decode().rsplit(" ", 1)[1])


def db_rows(node, sql: str, args: tuple = ()) -> list[tuple]:
    return read_db(node.data_dir / "queue.db", sql, args)


def poison_ids(node) -> list[int]:
    return [m["id"] for m in node.cli_json("message", "list", "--queue", "Poison")]


def sink_subjects(sink) -> list[str]:
    import re
    return sorted(m.group(1).decode() for data in sink.messages()
                  for m in [re.search(rb"^Subject: (.*?)\r?$", data, re.MULTILINE)] if m)


def assert_shown_held_in_poison(node, mid: int, rcpt: str, was: str) -> None:
    """``message show`` of a message held in the Poison queue shows its recipient there, Poison (as
    ``message list`` shows the message), not in its next hop's queue with the status it had when
    it was moved (nothing delivers it until it is resumed); --json keeps the recorded status."""
    listed, = node.cli_json("message", "list", str(mid))
    assert (listed["status"], listed["queues"]) == ("Poison", ["Poison"]), listed
    out = node.cli("message", "show", str(mid)).stdout
    line, = [ln for ln in out.splitlines() if ln.startswith(rcpt)]
    assert line.split()[1:3] == ["Poison", "Poison"], out
    assert "in the Poison queue after 2 internal failure(s)" in out and f"message resume {mid}" in out, out
    shown, = node.cli_json("message", "show", str(mid))
    assert shown["status"] == "Poison" and [r["status"] for r in shown["recipients"]] == [was], shown


@pytest.mark.parametrize("where", ["external", "mailbox"])
def test_one_message_failing_in_a_delivery_batch_leaves_the_others_and_ends_in_poison(make_node, sink, where):
    """Five messages in one batch (one session to the smart host, or one mailbox batch): the one
    whose handling raises is retried with 451 4.3.0, then held in the Poison queue at the
    second failure; the others are delivered at once. ``message resume`` releases it."""
    node = make_node(smart_host=sink.address)
    node.env["TRANSPORTD_TEST_FAULTS"] = plan("deliver")
    node.start()
    rcpt = "carol@elsewhere.test" if where == "external" else "alice@example.test"
    queue = f"smarthost:{sink.address}" if where == "external" else "mailbox:local"
    first = smtp_send(node.port, "first", rcpt)
    if where == "external":
        wait_for(lambda: any(q["identity"] == queue and q["state"] == "Retry"
                             for q in node.cli_json("queue", "list")), timeout=10, what="the queue in Retry")
    else:
        wait_for(lambda: node.maildir_files(rcpt), timeout=10, what="the first delivery")
    node.cli("queue", "suspend", queue)
    ids = [smtp_send(node.port, s, rcpt) for s in ("ok 1", "ok 2", "POISON", "ok 3", "ok 4")]
    bad = ids[2]
    if where == "external":
        sink.start()
    node.cli("queue", "resume", queue)
    node.cli("queue", "retry", queue)

    if where == "external":
        wait_for(lambda: sink_subjects(sink) == ["first", "ok 1", "ok 2", "ok 3", "ok 4"], timeout=15,
                 what="every other message at the sink")
    else:
        wait_for(lambda: len(node.maildir_files(rcpt)) == 5, timeout=15, what="every other message stored")
    wait_for(lambda: poison_ids(node) == [bad], timeout=15, what="the bad message in the Poison queue")
    assert first not in poison_ids(node)
    (status, error), = db_rows(node, "SELECT status, last_error FROM recipients WHERE message_id = ?", (bad,))
    assert status == "Retry" and error.startswith("451 4.3.0 internal error in deliver: InjectedFault"), error
    queues = {q["identity"]: q["message_count"] for q in node.cli_json("queue", "list")}
    assert queues["Poison"] == 1 and queues[queue] == 0
    assert_shown_held_in_poison(node, bad, rcpt, was="Retry")
    # the row is written just after the commit that moved the message
    def events_to_poison():
        events = [e["event-id"] for e in node.tracking(internal_message_id=str(bad))]
        return events if events[-1:] == ["POISONMESSAGE"] else None
    events = wait_for(events_to_poison, timeout=5, what="the POISONMESSAGE row")
    assert events.count("DEFER") == 2, events
    assert "failed with an internal error" in node.log() and "moved to the Poison queue" in node.log()
    time.sleep(2.5)  # waiting for absence: held, so not retried, not expired, no DSN
    assert poison_ids(node) == [bad] and not node.tracking(event_id="DSN")

    # Released by the operator (with the fault gone after a restart), it is delivered.
    node.stop()
    node.env.clear()
    node.start()
    assert "from the Poison queue" in node.cli("message", "resume", str(bad)).stdout
    if where == "external":
        wait_for(lambda: "POISON" in sink_subjects(sink), timeout=10, what="the released message at the sink")
    else:
        wait_for(lambda: len(node.maildir_files(rcpt)) == 6, timeout=10, what="the released message stored")
    assert poison_ids(node) == []


def test_dsn_and_expiry_failures_are_isolated_per_message(make_node, sink):
    """A DSN that cannot be built keeps that message in Retry (then Poison), never failed
    silently; expiry of the others goes on with their DSNs."""
    sink.start()  # Postfix's smtp-sink: no SMTPUTF8, so UTF-8 recipients fail with 5.6.7 and a DSN
    node = make_node(smart_host=sink.address,
                     overrides={"delivery": {"message_expiration_timeout": 4}})
    node.env["TRANSPORTD_TEST_FAULTS"] = plan("dsn", "expire")
    node.start()
    good = smtp_send(node.port, "fine ü", "δοκιμή@elsewhere.test", sender="bob@example.test", utf8=True)
    bad = smtp_send(node.port, "POISON ü", "δοκιμή@elsewhere.test", sender="bob@example.test", utf8=True)
    wait_for(lambda: any("Undeliverable" in p.read_text(errors="replace")
                         for p in node.maildir_files("bob@example.test")), timeout=10, what="the good DSN")
    wait_for(lambda: bad in poison_ids(node), timeout=15, what="the bad message in Poison (dsn)")
    assert good not in poison_ids(node)
    assert len(node.maildir_files("bob@example.test")) == 1, "a DSN for the poison message"

    # Expiry: the next hop refuses connections; both expire after 4 s, only the bad one fails to.
    sink.stop()
    good2 = smtp_send(node.port, "expiring", "carol@elsewhere.test")
    bad2 = smtp_send(node.port, "POISON expiring", "carol@elsewhere.test")
    wait_for(lambda: len(node.maildir_files("bob@example.test")) == 2, timeout=20, what="the expiry DSN")
    wait_for(lambda: bad2 in poison_ids(node), timeout=20, what="the bad message in Poison (expire)")
    fails = [e for e in node.tracking(event_id="FAIL") if e["internal-message-id"] == str(good2)]
    assert fails and fails[0]["source-context"] == "MessageExpired"


def test_kill_9_twice_while_a_message_hangs_the_node_puts_it_in_poison(make_node, sink):
    """A message whose content step never ends (here: the fault's synchronous spin in the
    conversion for the next hop, as a parser sent into a loop; then kill -9, as an operator or a
    watchdog would) twice is in the Poison queue at the next start, and the node runs and
    delivers the others. The conversion runs in a worker thread: while it spins, the node goes
    on with other messages. The messages that were only waiting on the next hop at those kills
    are not counted."""
    sink.start()
    node = make_node(smart_host=sink.address)
    node.env["TRANSPORTD_TEST_FAULTS"] = plan("deliver", action="spin")
    node.start()
    smtp_send(node.port, "before", "carol@elsewhere.test")
    wait_for(lambda: sink_subjects(sink) == ["before"], timeout=10, what="a first delivery")
    bad = smtp_send(node.port, "POISON", "carol@elsewhere.test")
    mark = node.data_dir / handling.FILE_NAME

    for attempt in range(2):
        wait_for(lambda: handling.parse(mark.read_bytes()) == [(bad, "deliver")], timeout=10,
                 what="the message to hang in its content step")
        smtp_send(node.port, f"meanwhile {attempt}", "alice@example.test")  # the event loop goes on
        wait_for(lambda n=attempt + 1: len(node.maildir_files("alice@example.test")) == n, timeout=10,
                 what="a local delivery while the message hangs in its conversion")
        node.kill9()
        assert poison_ids(node) == []
        node.start()
    wait_for(lambda: poison_ids(node) == [bad], timeout=10, what="the message in Poison after two crashes")
    assert node.alive
    assert_shown_held_in_poison(node, bad, "carol@elsewhere.test", was="Ready")  # Active at the kill: Ready again
    smtp_send(node.port, "after", "carol@elsewhere.test")
    wait_for(lambda: sink_subjects(sink) == ["after", "before"], timeout=10, what="the node to deliver again")
    assert [e["event-id"] for e in node.tracking(internal_message_id=str(bad))][-1] == "POISONMESSAGE"
    assert "crashed while handling it (step deliver)" in node.log()
    assert handling.parse(mark.read_bytes()) == []


def test_a_message_slow_to_convert_to_7bit_holds_up_no_other_delivery(make_node, sink, procs):
    """The audit's message: BODY=8BITMIME, 280 KB, a part whose folded Content-Type names it with
    20,000 encoded-words, an 8-bit body, to a next hop without 8BITMIME (smtp-sink -8). Its
    conversion to 7 bit took the whole node 40 s (Python's email package on that field, its time
    the square of the length, on the event loop). Ten ordinary messages sent a second later to
    another next hop are delivered within a few seconds; the big one arrives converted."""
    sink.start(("-8",))
    fast = Sink(procs).start()
    try:
        node = make_node(smart_host=sink.address)
        node.sections["send_connectors"] = [{"name": "fast", "address_spaces": ["fast.test"],
                                             "smart_hosts": [fast.address]}]
        write_toml(node.config_path, node.sections)
        node.start()
        field = folded(b'Content-Type: text/plain; name="' + b"=?utf-8?q?a?= " * 20_000 + b'"')
        data = (b"From: <bob@example.test>\r\nSubject: slow to convert\r\nMessage-ID: <slowconv@client.test>\r\n"
                b"MIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary=\"b\"\r\n\r\n--b\r\n"
                + field + b"\r\n\xe9\xe9 body\r\n--b--\r\n")
        assert len(data) > 280_000
        with smtplib.SMTP("127.0.0.1", node.port, timeout=120) as s:
            s.ehlo("client.test")
            s.sendmail("bob@example.test", ["carol@elsewhere.test"], data, mail_options=["BODY=8BITMIME"])
        time.sleep(1)  # its delivery under way (the audit's timing)
        start = time.monotonic()
        with smtplib.SMTP("127.0.0.1", node.port, timeout=120) as s:
            for i in range(10):
                s.sendmail("bob@example.test", [f"n{i}@fast.test"], f"Subject: ordinary {i}\r\n\r\nx\r\n")
        wait_for(lambda: len(fast.messages()) == 10, timeout=120, interval=0.05, what="the ten ordinary messages")
        took = time.monotonic() - start
        assert took < 5, f"the ordinary messages were delivered only after {took:.1f} s"
        stored = one(wait_for(sink.messages, timeout=30, what="the big message at its next hop"))
        assert stored.isascii() and b"=E9=E9 body" in stored
    finally:
        fast.stop()
        fast.cleanup()


def test_kill_9_while_messages_wait_on_the_next_hop_counts_against_none(make_node, sink):
    """Two kill -9s while a message's delivery waits (the fault's "hang": a next hop that never
    answers; the node itself runs on) are not its fault: at the third start it is still queued
    with no failure counted, and it is delivered once the wait is gone."""
    sink.start()
    node = make_node(smart_host=sink.address)
    node.env["TRANSPORTD_TEST_FAULTS"] = plan("deliver", action="hang")
    node.start()
    waiting = smtp_send(node.port, "POISON waits", "carol@elsewhere.test")

    def active() -> bool:
        return db_rows(node, "SELECT count(*) FROM recipients WHERE message_id = ? AND status = 'Active'",
                       (waiting,))[0][0] == 1
    for _ in range(2):
        wait_for(active, timeout=10, what="the node to be delivering the message")
        assert node.cli("health").returncode == 0  # the node serves while the delivery waits
        node.kill9()
        node.start()
    wait_for(active, timeout=10, what="the node to be delivering the message again")
    assert poison_ids(node) == []
    assert db_rows(node, "SELECT poison_count FROM messages WHERE id = ?", (waiting,)) == [(0,)]
    node.kill9()
    del node.env["TRANSPORTD_TEST_FAULTS"]
    node.start()
    wait_for(lambda: sink_subjects(sink) == ["POISON waits"], timeout=10, what="the delivery")
    assert "crashed while handling" not in node.log()


# --------------------------------------------------------------------------- the shadow loops (a cluster)

# (the 3-node ``cluster`` fixture is conftest's)

FOREIGN = "bob@elsewhere.test"


def test_shadow_copy_and_protect_rounds_isolate_one_message(cluster):
    """node1 accepts four messages while its peers are down (all unprotected); one of them fails
    in the shadow steps. When the peers are back, the next "protect unprotected" round shadows
    the other three; the bad one is held in the Poison queue after its second failure."""
    c = cluster()
    node1 = c["node1"]
    node1.env["TRANSPORTD_TEST_FAULTS"] = plan("shadow", "reshadow")
    c.start("node1")
    ids = {s: smtp_send(node1.frontend_port, s, FOREIGN, host=node1.host)
           for s in ("ok 1", "ok 2", "POISON", "ok 3")}
    fails = {int(e["internal-message-id"]): e["source-context"] for e in node1.tracking(event_id="HAREDIRECTFAIL")}
    assert set(fails) == set(ids.values())
    assert "internal error: InjectedFault" in fails[ids["POISON"]]
    c.start("node2", "node3")
    good = [ids[s] for s in ("ok 1", "ok 2", "ok 3")]
    wait_for(lambda: {int(e["internal-message-id"]) for e in node1.tracking(event_id="HAREDIRECT")} == set(good),
             timeout=15, what="the other messages to get their shadow")
    wait_for(lambda: [m["id"] for m in node1.cli_json("message", "list", "--queue", "Poison")] == [ids["POISON"]],
             timeout=15, what="the bad message in the Poison queue")
    redundancy = {m["id"]: m["redundancy"] for m in node1.messages(include_done=False)}
    assert all(redundancy[i] == "shadowed" for i in good), redundancy
    assert "reshadow of message" in node1.log() and "failed with an internal error" in node1.log()


def test_discard_and_promotion_isolate_one_message(cluster, sink):
    """On the shadow node (node3), one message fails in discard, promotion and delivery: the
    others are discarded, promoted and delivered as if nothing happened; the bad ones end in
    node3's Poison queue, not delivered twice."""
    c = cluster()
    node1, node3 = c["node1"], c["node3"]
    node3.env["TRANSPORTD_TEST_FAULTS"] = plan("discard", "promote", "deliver")
    sink.start()
    c.start()

    def subjects_at(n) -> set[str]:
        return {e["message-subject"] for e in n.tracking(event_id="HADISCARD")}
    first = {s: smtp_send(node1.frontend_port, s, FOREIGN, host=node1.host) for s in ("ok d1", "POISON d", "ok d2")}
    wait_for(lambda: subjects_at(node3) == {"ok d1", "ok d2"}, timeout=15, what="node3 to discard the others")
    wait_for(lambda: "discard of message" in node3.log(), timeout=5, what="the discard failure logged")
    held = [m for m in node3.cli_json("shadow", "show", node1.name) if m["state"] == "Shadow"]
    assert [m["network_message_id"] for m in held] == [netid_of(node1, first["POISON d"])], held

    sink.stop()
    second = {s: smtp_send(node1.frontend_port, s, FOREIGN, host=node1.host) for s in ("ok p1", "POISON p", "ok p2")}
    assert len(second) == 3
    node1.proc.kill()
    node1.proc.wait(10)
    sink.start()
    wait_for(lambda: {"ok p1", "ok p2"} <= set(sink_subjects(sink)), timeout=20,
             what="node3 to promote and deliver the others")
    poison = wait_for(lambda: (lambda rows: rows if len(rows) == 2 else None)(
        node3.cli_json("message", "list", "--queue", "Poison")), timeout=15, what="two messages in node3's Poison")
    assert {m["subject"] for m in poison} == {"POISON d", "POISON p"}
    assert sink_subjects(sink).count("POISON d") == 1  # delivered once, by node1, before it died
    assert "POISON p" not in sink_subjects(sink)
    assert "promote of message" in node3.log()
    assert len(first) == 3


def test_safety_net_resubmit_skips_one_bad_copy_and_resubmits_the_others(make_node, monkeypatch):
    node = make_node().start()
    ids = [smtp_send(node.port, s, "alice@example.test") for s in ("ok 1", "POISON", "ok 2")]
    wait_for(lambda: len(node.maildir_files("alice@example.test")) == 3, timeout=10, what="three deliveries")
    monkeypatch.setenv("TRANSPORTD_TEST_FAULTS", plan("resubmit"))
    start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
    res = node.cli("safetynet", "resubmit", "--destination", "local", "--start", start)
    assert "2 message(s) resubmitted" in res.stdout, res.stdout
    assert f"message {ids[1]} " in res.stderr and "could not be resubmitted: InjectedFault" in res.stderr
