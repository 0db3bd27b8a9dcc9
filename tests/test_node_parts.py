"""The scheduler and each delivery connector built alone, over a real queue database: no node, no daemon.

The scheduler is driven with recording connectors (what it hands out, in which
batches, and what it commits); the mailbox connector writes a real Maildir; the
SMTP connector talks to Postfix's smtp-sink; the peer connector to a real node's transport
connector.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select, update

from transportd.config import load_dict
from transportd.node.connectors import MailboxConnector, SmtpConnector
from transportd.node.events import NodeEvents
from transportd.node.maintenance import Maintenance
from transportd.node.metrics import NodeMetrics
from transportd.node.outcomes import Delivered, OutcomeRecorder
from transportd.node.scheduler import Scheduler
from transportd.queue import messages as mq
from transportd.queue.delivered import DeliveredLog
from transportd.queue.mailbox import MailboxStore
from transportd.queue.messages import NewMessage, Outcome
from transportd.queue.routing import MAILBOX, SMART_HOST, NextHop
from transportd.queue.store import QueueStore, messages


class RecordingTracking:
    def __init__(self) -> None:
        self.events: list[tuple[str, list[str]]] = []

    def write(self, event_id: str, source: str, **fields) -> None:
        self.events.append((event_id, list(fields.get("recipients") or [])))

    def close(self) -> None:
        pass


def _cfg(tmp_path: Path, **delivery):
    return load_dict({"node": {"name": "unit.transportd.test", "data_dir": str(tmp_path)},
                      "frontend": {"listen": "127.0.0.1:2525"},
                      "delivery": {"queue_poll_interval": 0.05, **delivery},
                      "shadow_redundancy": {"shadow_redundancy_enabled": False}})


def _message(hop: NextHop, recipients: list[str], n: int) -> NewMessage:
    now = time.time()
    data = f"Subject: part {n}\r\nMessage-ID: <part-{n}@unit.test>\r\n\r\nbody {n}\r\n".encode()
    return NewMessage(network_message_id=f"00000000-0000-4000-8000-{n:012d}", sender="bob@remote.test", data=data,
                      recipients={hop: recipients}, received_at=now, expires_at=now + 3600,
                      message_id=f"<part-{n}@unit.test>", submit_time="Wed, 25 Nov 2026 05:00:00 +0000",
                      subject=f"part {n}")


@pytest.fixture
async def parts(tmp_path):
    cfg = _cfg(tmp_path, max_messages_per_connection=2, max_per_domain_outbound_connections=1)
    store = QueueStore.open(tmp_path / "queue.db")
    store.start_writer()
    tracking = RecordingTracking()
    events = NodeEvents(cfg, NodeMetrics(cfg.node.name), store, tracking)
    try:
        yield cfg, store, events, tracking
    finally:
        store.close()


class RecordingConnector:
    """Delivers everything it is given, a report per message, and remembers the batches."""

    def __init__(self, status: str = mq.DELIVERED, reply: str = "250 2.0.0 Ok"):
        self.batches: list[list[int]] = []
        self.status, self.reply = status, reply

    async def deliver(self, batch):
        self.batches.append([it.message_id for it in batch])
        for it in batch:
            await asyncio.sleep(0)
            yield Delivered([it], {it.message_id: [Outcome(r, self.status, self.reply) for r in it.recipient_ids]})


async def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_scheduler_hands_due_work_to_connectors_in_batches_and_commits(parts) -> None:
    cfg, store, events, tracking = parts
    hop = NextHop(f"{SMART_HOST}:x", SMART_HOST, "127.0.0.1:9")
    ids = [await store.write(lambda c, n=n: mq.enqueue(c, _message(hop, [f"r{n}@far.test"], n)))
           for n in range(5)]
    smtp = RecordingConnector()
    recorder = OutcomeRecorder(cfg, store, events)
    scheduler = Scheduler(cfg, store, recorder, Maintenance(cfg, store, events, recorder),
                          {MAILBOX: RecordingConnector(), "smtp": smtp})
    task = asyncio.ensure_future(scheduler.run())
    try:
        store.queue_changed.set()
        await _wait(lambda: sum(len(b) for b in smtp.batches) == 5)
        await _wait(lambda: all(store.read(lambda c: mq.message_row(c, i))["state"] == mq.SAFETY_NET for i in ids))
        # The rows are tracked after the commit that moved them: wait for them too.
        await _wait(lambda: [e for e, _ in tracking.events].count("SENDEXTERNAL") >= 5)
    finally:
        await scheduler.stop()
        task.cancel()
    # max_messages_per_connection = 2, one session at a time for the queue: 2 + 2 + 1, each once.
    assert sorted(len(b) for b in smtp.batches) == [1, 2, 2]
    assert sorted(i for b in smtp.batches for i in b) == ids
    assert [e for e, _ in tracking.events].count("SENDEXTERNAL") == 5
    assert scheduler.in_flight == set()


async def test_scheduler_leaves_work_in_retry_when_the_connector_defers(parts) -> None:
    cfg, store, events, tracking = parts
    hop = NextHop(f"{SMART_HOST}:y", SMART_HOST, "127.0.0.1:9")
    mid = await store.write(lambda c: mq.enqueue(c, _message(hop, ["a@far.test"], 1)))
    smtp = RecordingConnector(mq.RETRY, "451 4.3.0 try later")
    recorder = OutcomeRecorder(cfg, store, events)
    scheduler = Scheduler(cfg, store, recorder, Maintenance(cfg, store, events, recorder), {"smtp": smtp})
    await scheduler.tick()
    await _wait(lambda: smtp.batches and not scheduler.in_flight)
    detail = store.read(lambda c: mq.message_detail(c, mid))
    assert [r["status"] for r in detail["recipients"]] == [mq.RETRY]
    await scheduler.tick()  # not due again before the retry interval
    assert len(smtp.batches) == 1
    assert ("DEFER", ["a@far.test"]) in tracking.events


async def test_mailbox_connector_alone_delivers_and_drops_the_duplicate(parts, tmp_path) -> None:
    cfg, store, events, _ = parts
    hop = NextHop("mailbox:MDB01", MAILBOX, "MDB01")
    first = await store.write(lambda c: mq.enqueue(c, _message(hop, ["alice@example.test"], 7)))
    again = await store.write(lambda c: mq.enqueue(c, _message(hop, ["alice@example.test"], 7)))
    mailboxes = MailboxStore(tmp_path / "mailboxes", "unit")
    delivered = DeliveredLog(tmp_path / "mailboxes")
    connector = MailboxConnector(cfg, store, mailboxes, delivered)
    work = store.read(lambda c: mq.due_work(c, time.time()))
    reports = [d async for d in connector.deliver(work)]
    outs = {d.items[0].message_id: d.outcomes[d.items[0].message_id][0] for d in reports}
    assert outs[first].status == mq.DELIVERED and not outs[first].duplicate
    assert outs[again].status == mq.DELIVERED and outs[again].duplicate  # same Message-ID and Date
    assert len(mailboxes.list("alice@example.test")) == 1
    delivered.close()


async def test_mailbox_duplicate_detection_survives_a_new_queue_database(parts, tmp_path) -> None:
    """DeliveredTo lives beside the mailboxes: a node whose queue database was deleted still drops
    a client's retry of a message it delivered (new network id, same Message-ID and Date)."""
    cfg, store, events, _ = parts
    hop = NextHop("mailbox:MDB01", MAILBOX, "MDB01")
    await store.write(lambda c: mq.enqueue(c, _message(hop, ["alice@example.test"], 8)))
    mailboxes = MailboxStore(tmp_path / "mailboxes", "unit")
    delivered = DeliveredLog(tmp_path / "mailboxes")
    [report] = [d async for d in MailboxConnector(cfg, store, mailboxes, delivered).deliver(
        store.read(lambda c: mq.due_work(c, time.time())))]
    assert not next(iter(report.outcomes.values()))[0].duplicate
    delivered.close()
    # The queue database is gone: a fresh one, and the node's records reopened from the mailbox folder.
    fresh = QueueStore.open(tmp_path / "wiped" / "queue.db", create=True)
    fresh.start_writer()
    try:
        retry = _message(hop, ["Alice@Example.test"], 8)
        retry.network_message_id = "00000000-0000-4000-8000-999999999999"
        await fresh.write(lambda c: mq.enqueue(c, retry))
        delivered = DeliveredLog(tmp_path / "mailboxes")
        [report] = [d async for d in MailboxConnector(cfg, fresh, mailboxes, delivered).deliver(
            fresh.read(lambda c: mq.due_work(c, time.time())))]
        [out] = next(iter(report.outcomes.values()))
        assert out.status == mq.DELIVERED and out.duplicate and out.reply == "250 2.0.0 duplicate"
        assert len(mailboxes.list("alice@example.test")) == 1
        delivered.close()
    finally:
        fresh.close()


async def test_smtp_connector_alone_against_smtp_sink(parts, sink) -> None:
    cfg, store, _, _ = parts
    sink.start()
    hop = NextHop(f"smarthost:{sink.address}", SMART_HOST, sink.address)
    mids = [await store.write(lambda c, n=n: mq.enqueue(c, _message(hop, ["x@far.test", "y@far.test"], n)))
            for n in (1, 2)]
    work = store.read(lambda c: mq.due_work(c, time.time()))
    reports = [d async for d in SmtpConnector(cfg, store).deliver(work)]
    assert [d.items[0].message_id for d in reports] == mids  # one report per message, in order
    assert all(o.status == mq.DELIVERED and o.reply.startswith("250") for d in reports
               for outs in d.outcomes.values() for o in outs)
    assert len(sink.messages()) == 2


async def test_smtp_connector_reports_an_unreachable_next_hop_as_a_queue_retry(parts) -> None:
    cfg, store, _, _ = parts
    from conftest import free_port
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    hop = NextHop(f"smarthost:{address}", SMART_HOST, address)
    await store.write(lambda c: mq.enqueue(c, _message(hop, ["x@far.test"], 3)))
    work = store.read(lambda c: mq.due_work(c, time.time()))
    [report] = [d async for d in SmtpConnector(cfg, store).deliver(work)]
    assert report.queue_error and report.queue_error.startswith("451 4.4.0 Unable to connect")
    assert [o.status for outs in report.outcomes.values() for o in outs] == [mq.RETRY]


@pytest.mark.parametrize("chunking", [True, False])
async def test_peer_connector_alone_relays_to_a_real_peer_node(tmp_path, make_node, chunking) -> None:
    """The peer connector with a Shadow Redundancy Manager built alone (shadow redundancy off: a
    plain authenticated relay) against a real node's transport connector, which stores the message
    in its mailbox store: one pipelined group ending in BDAT LAST, or in DATA where the peer
    offers no CHUNKING; a recipient the peer refuses fails alone."""
    from conftest import free_port, wait_port
    from transportd.devtools import cluster as cluster_mod
    from transportd.node.connectors import PeerConnector
    from transportd.queue.routing import PEER
    from transportd.redundancy.manager import ShadowManager

    me, secret, tport = "unit.transportd.test", "s3cret-for-the-unit", free_port()
    peer = make_node("peer", overrides={"transport": {"listen": f"127.0.0.1:{tport}", "chunking_enabled": chunking},
                                        "cluster": {"secret": secret}})
    peer.config_path.write_text(cluster_mod.render_toml(
        peer.sections, [{"name": me, "site": "site-a", "transport": "127.0.0.1:9"}]))
    peer.start()
    wait_port("127.0.0.1", tport, proc=peer.proc)

    cfg = load_dict({"node": {"name": me, "data_dir": str(tmp_path / "unit")}, "cluster": {"secret": secret},
                     "frontend": {"listen": "127.0.0.1:2525"}, "transport": {"listen": "127.0.0.1:2526"},
                     "shadow_redundancy": {"shadow_redundancy_enabled": False},
                     "peers": [{"name": peer.name, "site": "site-a", "transport": f"127.0.0.1:{tport}"}]})
    store = QueueStore.open(tmp_path / "unit.db")
    store.start_writer()
    try:
        events = NodeEvents(cfg, NodeMetrics(me), store, RecordingTracking())
        connector = PeerConnector(cfg, store, ShadowManager(cfg, store, events))
        hop = NextHop(f"peer:{peer.name}", PEER, peer.name)
        mid = await store.write(lambda c: mq.enqueue(c, _message(hop, ["alice@example.test", "bad address@x"], 7)))
        work = store.read(lambda c: mq.due_work(c, time.time()))
        [report] = [d async for d in connector.deliver(work)]
        good, bad = sorted(report.outcomes[mid], key=lambda o: o.recipient_id)
        assert good.status == mq.DELIVERED and good.reply.startswith("250 2.0.0"), good
        assert bad.status == mq.FAILED and bad.reply.startswith("501"), bad
        assert not report.forks  # no hop-by-hop shadow with shadow redundancy off
        files = await asyncio.to_thread(lambda: _wait_files(peer, "alice@example.test"))
        assert b"Subject: part 7" in files[0].read_bytes()
    finally:
        store.close()


def _wait_files(node, address: str) -> list[Path]:
    from conftest import wait_for
    return wait_for(lambda: node.maildir_files(address), timeout=10, what="the relayed message in the peer's mailbox")


# ------------------------------------------------------------------ the accept path's commits

class CopyingShadow:
    """A Shadow Redundancy Manager whose copies are already made: each accept gets ``result``."""
    enabled = True

    def __init__(self, result) -> None:
        self.result = result
        self.copies = 0

    async def make_shadow(self, msg, guid, recipients):
        self.copies += 1
        return self.result


def _accept_parts(tmp_path, **shadow_redundancy):
    from aiosmtpd.smtp import Envelope, Session

    from transportd.node.accept import AcceptPath
    cfg = load_dict({"node": {"name": "unit.transportd.test", "data_dir": str(tmp_path)},
                     "frontend": {"listen": "127.0.0.1:2525"}, "transport": {"listen": "127.0.0.1:2526"},
                     "cluster": {"secret": "s3cret-for-the-test"},
                     "peers": [{"name": p, "site": "site-b", "transport": f"127.0.0.1:{port}"}
                               for p, port in (("peer2.t", 9), ("peer3.t", 10))],
                     "routing": {"accepted_domains": ["example.test"], "smart_host": "127.0.0.1:9"},
                     "shadow_redundancy": {"shadow_redundancy_enabled": True, **shadow_redundancy}})
    envelope = Envelope()
    envelope.mail_from, envelope.rcpt_tos = "bob@remote.test", ["carol@elsewhere.test"]
    envelope.original_content = b"Subject: one commit\r\n\r\nbody\r\n"
    session = Session(asyncio.get_running_loop())
    session.peer, session.host_name = ("127.0.0.1", 40000), "client.test"
    return cfg, envelope, session, AcceptPath


async def test_an_accepted_message_is_one_writer_job_holding_its_shadows(tmp_path, parts) -> None:
    """Issue 16: one writer job on the primary per accepted message: the message and where its
    shadows went in the same commit, which the 250 follows (no second, settling commit)."""
    from transportd.queue.store import message_shadows, messages
    from transportd.redundancy.copies import ShadowResult
    _, store, events, tracking = parts
    cfg, envelope, session, AcceptPath = _accept_parts(tmp_path, shadow_copies=2)
    holders = (("peer2.t", 1, "250 2.6.0 ok"), ("peer3.t", 2, "250 2.6.0 ok"))
    shadow = CopyingShadow(ShadowResult("peer2.t", "250 2.6.0 ok", uncertain=("peer4.t",), holders=holders))
    path = AcceptPath(cfg, store, events, shadow)
    jobs = store.writer.jobs_done
    mid = await path.accept(envelope, session, "frontend")
    assert store.writer.jobs_done - jobs == 1 and shadow.copies == 1
    rows = store.read(lambda c: c.execute(messages.select()).mappings().all())
    assert [(r["id"], r["redundancy"]) for r in rows] == [(mid, "shadowed")]
    shadows = store.read(lambda c: c.execute(message_shadows.select()).mappings().all())
    assert sorted((s["shadow_node"], s["shadow_rank"]) for s in shadows) == [("peer2.t", 1), ("peer3.t", 2)]
    assert store.read(lambda c: [r.shadow_node for r in c.exec_driver_sql(
        "SELECT shadow_node FROM discard_events")]) == ["peer4.t"]  # the copy a broken session may have left
    assert [e for e, _ in tracking.events] == ["RECEIVE", "HAREDIRECT", "HAREDIRECT"]


async def test_a_message_refused_for_want_of_shadows_writes_only_the_discards(tmp_path, parts) -> None:
    """RejectMessageOnShadowFailure: 451 4.4.0 before anything is written here but the discard
    events of the copies made (fewer than min_shadow_copies) and of any uncertain one."""
    from transportd.errors import MessageRejected
    from transportd.redundancy.copies import ShadowResult
    _, store, events, tracking = parts
    cfg, envelope, session, AcceptPath = _accept_parts(tmp_path, shadow_copies=2, min_shadow_copies=2,
                                                       reject_message_on_shadow_failure=True)
    shadow = CopyingShadow(ShadowResult("peer2.t", "250 2.6.0 ok", uncertain=("peer3.t",),
                                        holders=(("peer2.t", 1, "250 2.6.0 ok"),), failures="peer3.t: timeout"))
    path = AcceptPath(cfg, store, events, shadow)
    with pytest.raises(MessageRejected) as refused:
        await path.accept(envelope, session, "frontend")
    assert refused.value.args[0].startswith("451 4.4.0"), refused.value.args
    assert store.read(lambda c: c.exec_driver_sql("SELECT count(*) FROM messages").scalar()) == 0
    assert sorted(store.read(lambda c: [r.shadow_node for r in c.exec_driver_sql(
        "SELECT shadow_node FROM discard_events")])) == ["peer2.t", "peer3.t"]
    assert tracking.events == []


@pytest.mark.parametrize(("reply", "over"), [
    ((452, "4.5.3 Too many recipients"), True),             # RFC 5321 4.5.3.1.10
    ((452, "Too many recipients"), True),                   # no enhanced code, said in the text
    ((552, "5.5.3 Too many recipients"), True),             # RFC 821's code, taken as temporary
    ((451, "4.5.3 Too many recipients: Too many recipients"), True),  # OpenSMTPD's max-rcpt
    ((550, "5.5.3 Too many recipients"), True),             # RFC 3463 X.5.3: split the message
    ((452, "4.2.2 Mailbox full"), False),                   # about the recipient: deferred
    ((451, "4.3.0 Try again later"), False),
    ((450, "4.5.30 not an enhanced code we know"), False),
    ((550, "5.1.1 User unknown"), False),
    ((250, "2.1.5 Ok"), False),
])
def test_a_rcpt_refused_for_too_many_recipients_is_known_by_its_code(reply, over):
    from transportd.node.connectors import _over_recipient_limit
    assert _over_recipient_limit(reply) is over


# ------------------------------------------------------------------ a primary reached on a hop-by-hop session

class HopSession:
    """A delivery session to a primary that answers XSHADOW and XQDISCARD (no discards)."""

    def __init__(self, name: str, dbid: str):
        self.peer = type("Peer", (), {"name": name})()
        self.dbid = dbid

    async def identify(self) -> str:
        return self.dbid

    async def take_discards(self) -> list:
        return []


async def test_a_hop_by_hop_session_that_reaches_a_primary_ends_its_down_time(tmp_path):
    """A primary our heartbeats could not reach, reached by a hop-by-hop delivery session, is no
    longer down: the promotion span and the Primary Safety Net's unreachable time start again at
    its next failure (the old start counted, so one failed heartbeat promoted at once)."""
    from transportd.queue import shadows as sq
    from transportd.redundancy.manager import ShadowManager

    primary = "primary.transportd.test"
    cfg = load_dict({"node": {"name": "unit.transportd.test", "data_dir": str(tmp_path)},
                     "cluster": {"secret": "s3cret-for-the-test"}, "frontend": {"listen": "127.0.0.1:2525"},
                     "transport": {"listen": "127.0.0.1:2526"},
                     "peers": [{"name": primary, "site": "site-a", "transport": "127.0.0.1:9"}]})
    store = QueueStore.open(tmp_path / "unit.db")
    store.start_writer()
    try:
        manager = ShadowManager(cfg, store, NodeEvents(cfg, NodeMetrics("unit"), store, RecordingTracking()))
        dbid = "11111111-1111-4111-8111-111111111111"
        long_ago = time.time() - 86400
        await store.write(lambda c: sq.upsert_context(c, primary, queue_database_id=dbid, consecutive_failures=9,
                                                      unreachable_since=long_ago, down_since=long_ago))
        await manager.heartbeat.hop_session_start(HopSession(primary, dbid))
        ctx = store.read(lambda c: sq.shadow_context(c, primary))
        assert (ctx["consecutive_failures"], ctx["unreachable_since"], ctx["down_since"]) == (0, None, None)
        assert ctx["last_heartbeat_at"] > long_ago
    finally:
        store.close()


def test_a_failed_recipient_is_told_to_the_shadows_once_its_dsn_is_out(tmp_path):
    """A recipient the primary failed is told per recipient (``Failed=``) only once no DSN of its
    message is queued (until then the shadows protect the DSN: a promotion makes it again); the
    DSN's end tells them. Handed only to a shadow that asked for ``Failed=`` entries too; on the
    shadow the recipient becomes Failed (not Delivered) and a copy left with nothing is returned."""
    from transportd.queue import shadows as sq
    from transportd.redundancy import protocol

    assert mq.RECIPIENT_FAILED == protocol.FAILED and mq.RECIPIENT_DELIVERED == protocol.DELIVERED
    hop = NextHop("smarthost:127.0.0.1:25", SMART_HOST, "127.0.0.1:25")
    primary = QueueStore.open(tmp_path / "primary.db")
    try:
        mid = primary.transaction(lambda c: mq.enqueue(c, _message(hop, ["a@x.test", "b@x.test"], 1)))
        primary.transaction(lambda c: sq.record_shadow(c, mid, "shadow.t", "g-1", time.time()))
        dsn = _message(hop, ["bob@remote.test"], 2)
        dsn.dsn_of, dsn.sender, dsn.origin = mid, "", "dsn"
        dsn_id = primary.transaction(lambda c: mq.enqueue(c, dsn))
        assert primary.transaction(lambda c: mq.tell_shadows_failed(c, mid, time.time(), ["a@x.test"])) == 0
        primary.transaction(lambda c: c.exec_driver_sql(
            "UPDATE recipients SET status = 'Failed' WHERE message_id = ? AND address = 'a@x.test'", (mid,)))
        primary.transaction(lambda c: c.exec_driver_sql(
            "UPDATE recipients SET status = 'Delivered' WHERE message_id = ?", (dsn_id,)))
        assert primary.transaction(lambda c: mq.finish_if_done(c, dsn_id, time.time(), 0))  # the DSN is out
        reason = protocol.failed_reason("a@x.test")
        assert primary.transaction(lambda c: sq.take_discard_events(c, "shadow.t", 10, "t1", True)) == []
        assert primary.transaction(lambda c: sq.take_discard_events(c, "shadow.t", 10, "t2", True, True)) == [
            ("g-1", reason)]
    finally:
        primary.close()

    shadow = QueueStore.open(tmp_path / "shadow.db")
    try:
        msg = _message(hop, ["a@x.test", "b@x.test"], 3)
        msg.role, msg.redundancy, msg.shadow_guid, msg.primary_node = "shadow", "shadow", "g-1", "primary.t"
        copy = shadow.transaction(lambda c: mq.enqueue(c, msg))
        assert shadow.transaction(lambda c: sq.apply_delivered_recipients(
            c, "primary.t", [("g-1", "a@x.test")], time.time(), mq.FAILED)) == []
        statuses = dict(shadow.read(lambda c: c.exec_driver_sql(
            "SELECT address, status FROM recipients WHERE message_id = ?", (copy,)).fetchall()))
        assert statuses == {"a@x.test": mq.FAILED, "b@x.test": mq.READY}
        assert shadow.transaction(lambda c: sq.apply_delivered_recipients(
            c, "primary.t", [("g-1", "b@x.test")], time.time())) == ["g-1"]
    finally:
        shadow.close()


def test_a_delivered_recipient_whose_success_notice_waits_is_told_so_until_the_notice_is_out(tmp_path):
    """A recipient delivered with its success notice (NOTIFY=SUCCESS) queued is told per recipient
    as such (``NotifyRelayed=``) to a shadow that asked (``XQDISCARD n RCPT FAILED NOTIFY``), as
    ``Delivered=`` to one that asked for per-recipient entries alone (as before); once the notice
    is out, ``Delivered=`` follows. On the shadow such a recipient is delivered but keeps the copy
    (nothing else pending: not returned for discarding); a promotion then queues the notice
    ("relayed", 2.0.0) and finishes the copy, delivering nothing again; a ``Delivered=`` instead
    ends the wait and empties the copy."""
    from transportd.queue import notices
    from transportd.queue import shadows as sq
    from transportd.redundancy import protocol

    assert mq.RECIPIENT_NOTIFY == (protocol.NOTIFY_DELIVERED, protocol.NOTIFY_RELAYED)
    cfg = _cfg(tmp_path)
    hop = NextHop("smarthost:127.0.0.1:25", SMART_HOST, "127.0.0.1:25")
    primary = QueueStore.open(tmp_path / "primary.db")
    try:
        msg = _message(hop, ["a@x.test", "b@x.test"], 1)
        msg.dsn_rcpt = {"a@x.test": "NOTIFY=SUCCESS"}
        mid = primary.transaction(lambda c: mq.enqueue(c, msg))
        primary.transaction(lambda c: sq.record_shadow(c, mid, "shadow.t", "g-1", time.time()))
        dsn = _message(hop, ["bob@remote.test"], 2)
        dsn.dsn_of, dsn.sender, dsn.origin = mid, "", "dsn"
        dsn_id = primary.transaction(lambda c: mq.enqueue(c, dsn))
        primary.transaction(lambda c: c.exec_driver_sql(
            "UPDATE recipients SET status = 'Delivered' WHERE message_id = ? AND address = 'a@x.test'", (mid,)))
        notice = protocol.notice_reason("a@x.test", "relayed")
        assert notice == "NotifyRelayed=a@x.test"
        primary.transaction(lambda c: sq.record_delivered_recipients(c, mid, [notice], time.time()))
        assert primary.transaction(lambda c: sq.take_discard_events(c, "shadow.t", 10, "t1")) == []
        assert primary.transaction(lambda c: sq.take_discard_events(c, "shadow.t", 10, "t2", True, True)) == [
            ("g-1", protocol.delivered_reason("a@x.test"))]  # an older shadow: as before
        primary.transaction(lambda c: sq.settle_discard_events(c, "t2", False))
        assert primary.transaction(lambda c: sq.take_discard_events(c, "shadow.t", 10, "t3", True, True, True)) == [
            ("g-1", notice)]
        primary.transaction(lambda c: sq.settle_discard_events(c, "t3", True))
        primary.transaction(lambda c: c.exec_driver_sql(
            "UPDATE recipients SET status = 'Delivered' WHERE message_id = ?", (dsn_id,)))
        assert primary.transaction(lambda c: mq.finish_if_done(c, dsn_id, time.time(), 0))  # the notice is out
        assert primary.transaction(lambda c: sq.take_discard_events(c, "shadow.t", 10, "t4", True, True, True)) == [
            ("g-1", protocol.delivered_reason("a@x.test"))]
    finally:
        primary.close()

    shadow = QueueStore.open(tmp_path / "shadow.db")
    try:
        copies = []
        for n in (3, 4):
            copy = _message(hop, ["a@x.test", "b@x.test"], n)
            copy.role, copy.redundancy, copy.shadow_guid, copy.primary_node = "shadow", "shadow", f"g-{n}", "primary.t"
            copy.dsn_rcpt = {"a@x.test": "NOTIFY=SUCCESS"}
            copies.append(shadow.transaction(lambda c, copy=copy: mq.enqueue(c, copy)))
            for status, notice, address in ((mq.DELIVERED, "relayed", "a@x.test"), (mq.FAILED, None, "b@x.test")):
                assert shadow.transaction(lambda c, n=n, s=status, t=notice, a=address: sq.apply_delivered_recipients(
                    c, "primary.t", [(f"g-{n}", a)], time.time(), s, t)) == []  # the notice keeps the copy
        # g-4: the notice is out there (Delivered=): nothing is left to do with the copy.
        assert shadow.transaction(lambda c: sq.apply_delivered_recipients(
            c, "primary.t", [("g-4", "a@x.test")], time.time())) == ["g-4"]
        # g-3: the primary is lost: the promotion sends the notice and delivers nothing.
        promoted = shadow.transaction(lambda c: [r["id"] for r in sq.promote_page(c, "primary.t", None, 10)])
        assert copies[0] in promoted
        [(original, notice_id, made)] = shadow.transaction(
            lambda c: notices.send_owed_notices(c, cfg, [copies[0]], time.time()))
        assert original["id"] == copies[0] and made.sender == "" and made.dsn_of == copies[0]
        assert [a for v in made.recipients.values() for a in v] == ["bob@remote.test"]
        text = made.data.decode()
        assert "Action: relayed" in text and "Status: 2.0.0" in text and "rfc822; a@x.test" in text.lower(), text
        row = shadow.read(lambda c: mq.message_row(c, copies[0]))
        assert row["state"] != mq.QUEUED and shadow.read(lambda c: mq.message_row(c, notice_id))["dsn_of"] == copies[0]
        assert shadow.read(lambda c: c.exec_driver_sql(
            "SELECT count(*) FROM recipients WHERE message_id = ? AND status IN ('Ready', 'Retry')",
            (copies[0],)).scalar()) == 0
        assert shadow.transaction(lambda c: notices.send_owed_notices(c, cfg, [copies[0]], time.time())) == []
    finally:
        shadow.close()


def test_a_delay_notice_is_told_to_the_shadows_which_keep_their_copy_and_send_none_again(tmp_path):
    """The primary's delay DSN (``record_delay_dsn``) queues, in its commit, a ``DelayNotified``
    event per shadow: handed only to a shadow that asked (``XQDISCARD n RCPT FAILED NOTIFY
    DELAY``), no discard (XQSTATUS still says Held; a new copy may go to that peer), and told to a
    shadow made later too. On the shadow it notes the notice on the copy, which stays queued, and
    on a fork handed to that primary: a promoted copy is not owed one again."""
    from transportd.queue import shadows as sq
    from transportd.queue.store import shadow_forks
    from transportd.redundancy import protocol

    assert mq.DELAY_NOTIFIED == protocol.DELAY_NOTIFIED
    hop = NextHop("smarthost:127.0.0.1:25", SMART_HOST, "127.0.0.1:25")
    primary = QueueStore.open(tmp_path / "primary.db")
    try:
        mid = primary.transaction(lambda c: mq.enqueue(c, _message(hop, ["a@x.test"], 1)))
        primary.transaction(lambda c: sq.record_shadow(c, mid, "shadow.t", "g-1", time.time()))
        assert primary.transaction(lambda c: mq.record_delay_dsn(c, mid, None, time.time())) is None
        for asked in [(), (True,), (True, True), (True, True, True)]:  # older shadows: not handed out
            assert primary.transaction(lambda c, a=asked: sq.take_discard_events(c, "shadow.t", 10, "t0", *a)) == []
        assert primary.read(lambda c: sq.shadow_status(c, "shadow.t", ["g-1"], [])) == (set(), {"g-1"})
        assert primary.read(lambda c: sq.message_guid(c, mid, None)) == ("g-1", set())  # not busy
        # A shadow made after the notice (re-shadowing) is told too.
        primary.transaction(lambda c: sq.settle_reshadow(c, mid, [("other.t", 2)], "g-1", [], True, time.time()))
        assert primary.transaction(lambda c: sq.take_discard_events(c, "shadow.t", 10, "t1", True, True, True,
                                                                    True)) == [("g-1", "DelayNotified")]
        assert primary.transaction(lambda c: sq.take_discard_events(c, "other.t", 10, "t2", True, True, True,
                                                                    True)) == [("g-1", "DelayNotified")]
    finally:
        primary.close()

    shadow = QueueStore.open(tmp_path / "shadow.db")
    try:
        copy = _message(hop, ["a@x.test"], 2)
        copy.role, copy.redundancy, copy.shadow_guid, copy.primary_node = "shadow", "shadow", "g-1", "primary.t"
        copy_id = shadow.transaction(lambda c: mq.enqueue(c, copy))
        # Our messages whose forks primary.t took hop by hop (their recipients there: Delivered
        # here, as the hop-by-hop outcome records them); one also has a recipient of its own waiting.
        forked = shadow.transaction(lambda c: mq.enqueue(c, _message(hop, ["b@x.test"], 3)))
        mixed = shadow.transaction(lambda c: mq.enqueue(c, _message(hop, ["b@x.test", "c@y.test"], 4)))
        for message_id, guid in ((forked, "g-1"), (mixed, "g-2")):
            shadow.transaction(lambda c, m=message_id, g=guid: c.execute(shadow_forks.insert().values(
                message_id=m, primary_node="primary.t", shadow_guid=g, queue_id=0, created_at=time.time())))
        shadow.transaction(lambda c: c.exec_driver_sql(
            "UPDATE recipients SET status = 'Delivered' WHERE address = 'b@x.test'"))
        assert shadow.transaction(lambda c: sq.apply_delay_notified(c, "primary.t", ["g-1", "g-2"], time.time())) == 2
        assert shadow.transaction(lambda c: sq.apply_delay_notified(c, "primary.t", ["g-1", "g-2"], time.time())) == 0
        row = shadow.read(lambda c: mq.message_row(c, copy_id))
        assert row["state"] == mq.QUEUED and row["role"] == "shadow" and row["delay_dsn_at"] is not None
        assert shadow.read(lambda c: mq.message_row(c, forked))["delay_dsn_at"] is not None
        # c@y.test waits here: its delay notice is this node's to send (the peer's covered b@x.test).
        assert shadow.read(lambda c: mq.message_row(c, mixed))["delay_dsn_at"] is None
        shadow.transaction(lambda c: c.exec_driver_sql("UPDATE recipients SET status = 'Retry' "
                                                       f"WHERE message_id = {mixed}"))
        assert [m["id"] for m in shadow.read(lambda c: mq.delayed_messages(c, time.time() + 3600, 1))] == [mixed]
        shadow.transaction(lambda c: mq.record_delay_dsn(c, mixed, None, time.time()))
        shadow.transaction(lambda c: sq.promote_page(c, "primary.t", None, 10))
        shadow.transaction(lambda c: c.exec_driver_sql("UPDATE recipients SET status = 'Retry'"))
        assert shadow.read(lambda c: mq.delayed_messages(c, time.time() + 3600, 1)) == []
    finally:
        shadow.close()


def test_a_holder_whose_shadow_protects_a_queued_dsn_is_still_a_shadow_holder(tmp_path):
    """A message finished while its NDR waits keeps its shadows (``finish_if_done``: no discard
    event yet, the shadows protect the DSN): their holder stays among ``shadow_holders``, so a
    peer taken out of [[peers]] meanwhile may still fetch that discard (and is not left to
    promote the copy and fail the recipient, a second NDR). Once the NDR is out and the
    discard fetched, it is not."""
    from transportd.queue import shadows as sq

    hop = NextHop("smarthost:127.0.0.1:25", SMART_HOST, "127.0.0.1:25")
    store = QueueStore.open(tmp_path / "queue.db")
    try:
        mid = store.transaction(lambda c: mq.enqueue(c, _message(hop, ["a@x.test"], 1)))
        store.transaction(lambda c: sq.record_shadow(c, mid, "holder.t", "g-1", time.time()))
        ndr = _message(hop, ["bob@remote.test"], 2)
        ndr.dsn_of, ndr.sender = mid, ""
        ndr_id = store.transaction(lambda c: mq.enqueue(c, ndr))
        store.transaction(lambda c: c.exec_driver_sql(f"UPDATE recipients SET status = 'Failed' WHERE message_id = {mid}"))
        assert store.transaction(lambda c: mq.finish_if_done(c, mid, time.time(), 3600)) == mq.FINISHED_SHADOWS_KEPT
        assert store.read(lambda c: mq.message_row(c, mid))["state"] == mq.SAFETY_NET
        assert store.read(sq.shadow_holders) == {"holder.t"}
        # The NDR delivered: the message's discard is queued for the holder, which fetches it.
        store.transaction(lambda c: c.exec_driver_sql(f"UPDATE recipients SET status = 'Delivered' "
                                                      f"WHERE message_id = {ndr_id}"))
        store.transaction(lambda c: mq.finish_if_done(c, ndr_id, time.time(), 3600))
        assert store.read(sq.shadow_holders) == {"holder.t"}  # its discard waits
        assert store.transaction(lambda c: sq.take_discard_events(c, "holder.t", 10, "t1")) == [("g-1", None)]
        store.transaction(lambda c: sq.settle_discard_events(c, "t1", True))
        assert store.read(sq.shadow_holders) == set()
    finally:
        store.close()


def test_per_recipient_discards_are_handed_only_to_a_shadow_that_asks(tmp_path):
    """The primary's per-recipient events go to a shadow that asked (``XQDISCARD n RCPT``), never
    to one that did not (an older node, a 2010 peer: its discards go on as before); on the shadow
    they mark that recipient of the copy done, and a copy left with nothing to deliver is
    returned for discarding."""
    from transportd.queue import shadows as sq
    from transportd.redundancy import protocol

    assert sq.PER_RECIPIENT == protocol.DELIVERED
    hop = NextHop("smarthost:127.0.0.1:25", SMART_HOST, "127.0.0.1:25")
    primary = QueueStore.open(tmp_path / "primary.db")
    try:
        mid = primary.transaction(lambda c: mq.enqueue(c, _message(hop, ["a@x.test", "b@x.test"], 1)))
        primary.transaction(lambda c: sq.record_shadow(c, mid, "shadow.t", "g-1", time.time()))
        primary.transaction(lambda c: sq.discard_uncertain(c, ["shadow.t"], "g-0", time.time()))
        reason = protocol.delivered_reason("a@x.test")
        assert primary.transaction(lambda c: sq.record_delivered_recipients(c, mid, [reason], time.time())) == 1
        assert primary.transaction(lambda c: sq.take_discard_events(c, "shadow.t", 10, "old")) == [("g-0", None)]
        primary.transaction(lambda c: sq.settle_discard_events(c, "old", False))
        assert primary.transaction(lambda c: sq.take_discard_events(c, "shadow.t", 10, "new", True)) == [
            ("g-0", None), ("g-1", reason)]
    finally:
        primary.close()

    shadow = QueueStore.open(tmp_path / "shadow.db")
    try:
        msg = _message(hop, ["a@x.test", "b@x.test"], 2)
        msg.role, msg.redundancy, msg.shadow_guid, msg.primary_node = "shadow", "shadow", "g-1", "primary.t"
        copy = shadow.transaction(lambda c: mq.enqueue(c, msg))
        assert shadow.transaction(lambda c: sq.apply_delivered_recipients(
            c, "primary.t", [("g-1", "a@x.test"), ("g-9", "a@x.test")], time.time())) == []
        statuses = dict(shadow.read(lambda c: c.exec_driver_sql(
            "SELECT address, status FROM recipients WHERE message_id = ?", (copy,)).fetchall()))
        assert statuses == {"a@x.test": mq.DELIVERED, "b@x.test": mq.READY}
        assert shadow.transaction(lambda c: sq.apply_delivered_recipients(
            c, "primary.t", [("g-1", "b@x.test")], time.time())) == ["g-1"]
    finally:
        shadow.close()


async def test_housekeeping_purges_every_safety_net_copy_past_its_hold_not_one_batch(parts) -> None:
    """A round of housekeeping drops every Safety Net copy past SafetyNetHoldTime, batch after
    batch: one batch a round (1,000) let copies outstay their hold and pile up under load."""
    cfg, store, events, _ = parts
    hop = NextHop(f"{SMART_HOST}:z", SMART_HOST, "127.0.0.1:9")
    n = mq.PURGE_BATCH * 2 + 500
    now = time.time()

    def fill(conn):
        ids = [mq.enqueue(conn, _message(hop, [f"r{i}@far.test"], i)) for i in range(n)]
        conn.execute(update(messages).where(messages.c.id.in_(ids[:n - 1]))
                     .values(state=mq.SAFETY_NET, safety_net_until=now - 1))
        conn.execute(update(messages).where(messages.c.id == ids[-1])
                     .values(state=mq.SAFETY_NET, safety_net_until=now + 3600))  # still held
    await store.write(fill)
    recorder = OutcomeRecorder(cfg, store, events)
    await Maintenance(cfg, store, events, recorder).housekeeping(now)
    left = store.read(lambda c: c.execute(select(func.count()).select_from(messages)).scalar())
    assert left == 1
