"""Discards applied on the shadow side (unit, on a real queue database with its group-commit writer)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from transportd.config import load_dict
from transportd.queue import messages as mq
from transportd.queue import shadows as sq
from transportd.queue.routing import bifurcate
from transportd.queue.store import QueueStore
from transportd.redundancy.shadow_queue import ShadowQueues


class Sink:
    """The node's EventSink, recording the tracking rows asked for."""

    metrics: Any = None

    def __init__(self) -> None:
        self.tracked: list[tuple[str, str]] = []

    def track(self, event_id: str, source: str, row: dict, *, recipients=None, **fields: Any) -> None:
        self.tracked.append((event_id, fields.get("source_context", "")))

    async def message_failed(self, row: dict, step: str, exc: BaseException) -> bool:
        return False


def test_a_discard_cut_short_by_its_caller_still_writes_every_hadiscard(tmp_path, monkeypatch):
    """A heartbeat's time limit (or a stop) cancelling the discard while its commit is under way
    left the copies removed with no HADISCARD row (a CI run: 1,003 shadows gone from the queue,
    none in the tracking log). The discard finishes on its own and tracks each copy."""
    cfg = load_dict({"node": {"name": "n2.t", "data_dir": str(tmp_path)}})
    store = QueueStore.open(tmp_path / "queue.db")
    store.start_writer()
    now = time.time()
    guids = [str(uuid.uuid4()) for _ in range(5)]

    def seed(conn):
        for i, guid in enumerate(guids):
            mq.enqueue(conn, mq.NewMessage(
                network_message_id=str(uuid.uuid4()), sender="a@x.test", data=b"Subject: s\r\n\r\nb\r\n",
                recipients=bifurcate([f"r{i}@far.test"], cfg), received_at=now, expires_at=now + 3600,
                origin="shadow", role="shadow", redundancy="shadow", shadow_guid=guid, primary_node="p1.t",
                primary_internal_id=i + 1, primary_dbid="db1"))
    store.transaction(seed)
    real = sq.apply_discards

    def slow_apply(*args, **kwargs):  # the commit of a large batch, in the writer thread
        time.sleep(0.4)
        return real(*args, **kwargs)
    monkeypatch.setattr(sq, "apply_discards", slow_apply)
    sink = Sink()
    queues = ShadowQueues(cfg, store, sink, reshadow=lambda rows, why: None)

    async def scenario() -> None:
        task = asyncio.create_task(queues.discard("p1.t", [(g, "DeletedByAdmin") for g in guids], now))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 5
        while len(sink.tracked) < len(guids) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    try:
        asyncio.run(scenario())
        assert sorted(sink.tracked) == sorted(("HADISCARD", f"DeletedByAdmin;{g}") for g in guids)
        left = store.read(lambda c: c.exec_driver_sql(
            "SELECT count(*) FROM messages WHERE role = 'shadow' AND state = 'Queued'").scalar())
        assert left == 0
    finally:
        store.close()


def test_a_hop_by_hop_fork_never_discarded_expires_as_an_unacknowledged_shadow(tmp_path):
    """A message handed to a peer hop by hop stays here (a fork) until that peer's discard. A peer
    drops a discard event nobody asks for within ShadowMessageAutoDiscardInterval (this node down
    that long): nothing else would end the fork, and the message would stay queued for good. After
    SafetyNetHoldTime + MessageExpirationTimeout it expires (HADISCARD Expired), as a shadow does;
    a younger fork, and a message with a recipient still pending, are left as they are."""
    from sqlalchemy import select, update

    from transportd.queue.store import messages, recipients, shadow_forks

    cfg = load_dict({"node": {"name": "n2.t", "data_dir": str(tmp_path)}})
    store = QueueStore.open(tmp_path / "queue.db")
    now = 1_800_000_000.0
    expire_after = 4 * 86400

    def forked(conn, rcpts, handed, taken_at):
        mid = mq.enqueue(conn, mq.NewMessage(str(uuid.uuid4()), "a@x.test", b"Subject: s\r\n\r\nb\r\n",
                                             bifurcate(rcpts, cfg), taken_at, taken_at + 3600))
        rows = conn.execute(select(recipients.c.id, recipients.c.address).where(
            recipients.c.message_id == mid)).all()
        conn.execute(update(recipients).where(recipients.c.message_id == mid).values(status=mq.ACTIVE))
        mq.record_outcomes(conn, [mq.Outcome(r.id, mq.DELIVERED) for r in rows if r.address in handed],
                           taken_at, retry_interval=1, retry_count=1, long_interval=1)
        sq.record_forks(conn, [(mid, "p1.t", str(uuid.uuid4()), 1, "db1")], taken_at)
        assert not mq.finish_if_done(conn, mid, taken_at, 3600)  # held for the fork
        return mid

    try:
        old = store.transaction(lambda c: forked(c, ["r1@far.test"], {"r1@far.test"}, now - expire_after - 10))
        young = store.transaction(lambda c: forked(c, ["r2@far.test"], {"r2@far.test"}, now - 60))
        partial = store.transaction(lambda c: forked(c, ["r3@far.test", "r4@near.test"], {"r3@far.test"},
                                                     now - expire_after - 10))
        expired = store.transaction(lambda c: sq.shadow_housekeeping(
            c, now, auto_discard=2 * 86400, expire_after=expire_after, hold=2 * 86400, live_tokens=set()))
        assert [r["id"] for r in expired] == [old]
        state = store.read(lambda c: dict(c.execute(select(messages.c.id, messages.c.state)).all()))
        assert (state[old], state[young], state[partial]) == (mq.MSG_REMOVED, mq.QUEUED, mq.QUEUED)
        forks = store.read(lambda c: sorted(c.execute(select(shadow_forks.c.message_id)).scalars()))
        assert forks == [young]  # the partial message's fork ended; its pending recipient goes on
        assert "p1.t" in store.read(lambda c: sq.primaries_to_poll(c))  # the young fork still polls it
    finally:
        store.close()


def test_a_lost_peers_forks_are_routed_again_not_put_back_in_its_queue(tmp_path):
    """The forks of a peer that is lost are resubmitted as Exchange resubmits its shadow messages:
    each recipient the peer took is routed as a new message's is. Drained to the peer (``redirect``),
    an outside recipient goes to the smart host and one of this node's mailboxes to its mailbox
    queue; one whose mailbox database lives on that peer waits for it again. A fork of another
    peer, and one that peer took from its current queue database, stay as they are."""
    from sqlalchemy import select, update

    from transportd.queue.store import queues, recipients, shadow_forks

    cfg = load_dict({"node": {"name": "n1.t", "data_dir": str(tmp_path)},
                     "routing": {"accepted_domains": ["example.test"], "mailbox_database": "MDB01",
                                 "mailbox_database_rules": ["dave@example.test=MDB02"],
                                 "smart_host": "127.0.0.1:2500"},
                     "mailbox_databases": {"MDB01": "n1.t", "MDB02": "p1.t"},
                     "cluster": {"secret": "s3cret"}, "transport": {"listen": "127.0.0.1:2526"},
                     "peers": [{"name": "p1.t", "site": "s", "transport": "127.0.0.2:2526"},
                               {"name": "p2.t", "site": "s", "transport": "127.0.0.3:2526"}]})
    store = QueueStore.open(tmp_path / "queue.db")
    now = 1_800_000_000.0

    def forked(conn, rcpts, peer, dbid, drain):
        mid = mq.enqueue(conn, mq.NewMessage(str(uuid.uuid4()), "a@x.test", b"Subject: s\r\n\r\nb\r\n",
                                             bifurcate(rcpts, cfg), now, now + 3600))
        if drain:
            mq.redirect_to_peer(conn, peer, now, message_id=mid)
        rows = conn.execute(select(recipients.c.id, recipients.c.queue_id).where(recipients.c.message_id == mid)).all()
        conn.execute(update(recipients).where(recipients.c.message_id == mid).values(status=mq.ACTIVE))
        mq.record_outcomes(conn, [mq.Outcome(r.id, mq.DELIVERED) for r in rows], now,
                           retry_interval=1, retry_count=1, long_interval=1)
        sq.record_forks(conn, [(mid, peer, str(uuid.uuid4()), rows[0].queue_id, dbid)], now)
        return mid

    def where(conn, mid):
        return sorted(conn.execute(select(recipients.c.address, queues.c.identity, recipients.c.status)
                                   .join(queues, queues.c.id == recipients.c.queue_id)
                                   .where(recipients.c.message_id == mid)).all())

    try:
        drained = store.transaction(lambda c: forked(
            c, ["carol@elsewhere.test", "alice@example.test", "dave@example.test"], "p1.t", "old", drain=True))
        for_dave = store.transaction(lambda c: forked(c, ["dave@example.test"], "p1.t", "old", drain=False))
        current = store.transaction(lambda c: forked(c, ["erin@elsewhere.test"], "p1.t", "new", drain=True))
        other = store.transaction(lambda c: forked(c, ["frank@elsewhere.test"], "p2.t", "x", drain=True))

        # a state change: p1.t is back with queue database "new"; forks taken from "old" are resubmitted
        rows = store.transaction(lambda c: sq.requeue_forks(c, "p1.t", "new", cfg, now))
        assert sorted(r["id"] for r in rows) == [drained, for_dave]
        assert all(r["shadow_guid"] for r in rows)
        assert store.read(lambda c: where(c, drained)) == [
            ("alice@example.test", "mailbox:MDB01", mq.READY),
            ("carol@elsewhere.test", "smarthost:127.0.0.1:2500", mq.READY),
            ("dave@example.test", "peer:p1.t", mq.READY)]
        assert store.read(lambda c: where(c, for_dave)) == [("dave@example.test", "peer:p1.t", mq.READY)]
        assert store.read(lambda c: where(c, current)) == [("erin@elsewhere.test", "peer:p1.t", mq.DELIVERED)]
        assert store.read(lambda c: where(c, other)) == [("frank@elsewhere.test", "peer:p2.t", mq.DELIVERED)]
        forks = store.read(lambda c: sorted(c.execute(select(shadow_forks.c.message_id)).scalars()))
        assert forks == sorted([current, other])
    finally:
        store.close()


def fork_holder(tmp_path):
    """The config, open queue database and clock of a node n1.t whose peer p1.t takes forks."""
    cfg = load_dict({"node": {"name": "n1.t", "data_dir": str(tmp_path)},
                     "routing": {"accepted_domains": ["example.test"], "smart_host": "127.0.0.1:2500"},
                     "cluster": {"secret": "s3cret"}, "transport": {"listen": "127.0.0.1:2526"},
                     "peers": [{"name": "p1.t", "site": "s", "transport": "127.0.0.2:2526"}]})
    store = QueueStore.open(tmp_path / "queue.db")
    store.start_writer()
    return cfg, store, time.time()


def fork_to_p1(conn, cfg, now: float, rcpts: list[str], shadow: str | None = None) -> tuple[int, str]:
    """A message of ours (with a shadow on ``shadow``, GUID ``ours-<id>``) handed to p1.t hop by
    hop: its recipients delivered there, a fork recorded. Returns (message id, the fork's GUID)."""
    from sqlalchemy import select, update

    from transportd.queue.store import recipients

    mid = mq.enqueue(conn, mq.NewMessage(str(uuid.uuid4()), "a@x.test", b"Subject: s\r\n\r\nb\r\n",
                                         bifurcate(rcpts, cfg), now, now + 3600))
    if shadow:
        sq.record_shadow(conn, mid, shadow, f"ours-{mid}", now)
    mq.redirect_to_peer(conn, "p1.t", now, message_id=mid)
    rows = conn.execute(select(recipients.c.id, recipients.c.queue_id).where(recipients.c.message_id == mid)).all()
    conn.execute(update(recipients).where(recipients.c.message_id == mid).values(status=mq.ACTIVE))
    mq.record_outcomes(conn, [mq.Outcome(r.id, mq.DELIVERED) for r in rows], now,
                       retry_interval=1, retry_count=1, long_interval=1)
    guid = str(uuid.uuid4())
    sq.record_forks(conn, [(mid, "p1.t", guid, rows[0].queue_id, "db1")], now)
    return mid, guid


def test_a_forks_recipients_the_peer_processed_are_not_routed_again(tmp_path):
    """The holder of a hop-by-hop fork is its peer's shadow: the peer's ``Delivered=`` and
    ``Failed=`` entries for the fork's GUID mark those recipients (delivered there; failed, its DSN
    out), so when the peer is lost only the recipient still waiting on it is routed again. Every
    recipient of a fork the peer processed: the fork is released then (the message ends), and
    nothing is left to route."""
    from sqlalchemy import select

    from transportd.queue.store import messages, queues, recipients

    cfg, store, now = fork_holder(tmp_path)

    def forked(conn, rcpts):
        return fork_to_p1(conn, cfg, now, rcpts)

    def where(conn, mid):
        return sorted(conn.execute(select(recipients.c.address, queues.c.identity, recipients.c.status)
                                   .join(queues, queues.c.id == recipients.c.queue_id)
                                   .where(recipients.c.message_id == mid)).all())

    try:
        three, g3 = store.transaction(lambda c: forked(c, ["ok@far.test", "bad@far.test", "grey@far.test"]))
        both, g2 = store.transaction(lambda c: forked(c, ["ok2@far.test", "bad2@far.test"]))
        shadow_queues = ShadowQueues(cfg, store, Sink(), reshadow=lambda rows, why: None)
        asyncio.run(shadow_queues.discard("p1.t", [
            (g3, "Delivered=ok@far.test"), (g3, "Failed=bad@far.test"),
            (g2, "Delivered=ok2@far.test"), (g2, "Failed=bad2@far.test")], now))
        rows = store.transaction(lambda c: sq.requeue_forks(c, "p1.t", None, cfg, now))
        assert [r["id"] for r in rows] == [three]
        assert store.read(lambda c: where(c, three)) == [
            ("bad@far.test", "peer:p1.t", mq.FAILED),
            ("grey@far.test", "smarthost:127.0.0.1:2500", mq.READY),
            ("ok@far.test", "peer:p1.t", mq.DELIVERED)]
        assert store.read(lambda c: where(c, both)) == [
            ("bad2@far.test", "peer:p1.t", mq.FAILED), ("ok2@far.test", "peer:p1.t", mq.DELIVERED)]
        states = store.read(lambda c: dict(c.execute(select(messages.c.id, messages.c.state)).all()))
        assert states == {three: mq.QUEUED, both: mq.SAFETY_NET}
    finally:
        store.close()


def test_a_fork_is_released_once_its_peers_per_recipient_discards_cover_every_recipient(tmp_path):
    """The peer's ``Delivered=``/``Failed=`` entries for a fork's GUID that cover every recipient it
    took release the fork at once, as the peer's discard of the whole message does: our message
    ends (its shadows get their discard event) and HADISCARD ``ExplicitlyDiscarded;<guid>`` is
    tracked. One covered recipient of two keeps it; so does one whose notice of success the peer
    still owes (``NotifyRelayed=``), until ``Delivered=`` follows. The fork stayed until the peer's
    discard of the whole message."""
    from sqlalchemy import select

    from transportd.queue.store import discard_events, messages, shadow_forks

    cfg, store, now = fork_holder(tmp_path)

    def forked(conn, rcpts):
        return fork_to_p1(conn, cfg, now, rcpts, shadow="s2.t")

    def state(conn, mid):
        forks = conn.execute(select(shadow_forks.c.shadow_guid).where(shadow_forks.c.message_id == mid)).all()
        discards = conn.execute(select(discard_events.c.shadow_guid).where(
            discard_events.c.shadow_guid == f"ours-{mid}", discard_events.c.reason.is_(None))).all()
        return (len(forks), conn.execute(select(messages.c.state).where(messages.c.id == mid)).scalar(),
                len(discards))

    try:
        two, g2 = store.transaction(lambda c: forked(c, ["ok@far.test", "bad@far.test"]))
        owed, g1 = store.transaction(lambda c: forked(c, ["ok1@far.test"]))
        sink = Sink()
        shadow_queues = ShadowQueues(cfg, store, sink, reshadow=lambda rows, why: None)
        asyncio.run(shadow_queues.discard("p1.t", [(g2, "Delivered=ok@far.test"), (g1, "NotifyRelayed=ok1@far.test")],
                                          now))
        assert store.read(lambda c: state(c, two)) == (1, mq.QUEUED, 0)
        assert store.read(lambda c: state(c, owed)) == (1, mq.QUEUED, 0)
        assert not [t for t in sink.tracked if t[0] == "HADISCARD"]
        assert asyncio.run(shadow_queues.discard("p1.t", [(g2, "Failed=bad@far.test")], now)) == 1
        assert store.read(lambda c: state(c, two)) == (0, mq.SAFETY_NET, 1)
        assert ("HADISCARD", f"ExplicitlyDiscarded;{g2}") in sink.tracked
        assert store.read(lambda c: state(c, owed)) == (1, mq.QUEUED, 0)
        asyncio.run(shadow_queues.discard("p1.t", [(g1, "Delivered=ok1@far.test")], now))  # the notice is out
        assert store.read(lambda c: state(c, owed)) == (0, mq.SAFETY_NET, 1)
        assert [t for t in sink.tracked if t[0] == "HADISCARD"] == [
            ("HADISCARD", f"ExplicitlyDiscarded;{g2}"), ("HADISCARD", f"ExplicitlyDiscarded;{g1}")]
        # The peer's later discard of the whole message finds nothing more to release.
        assert asyncio.run(shadow_queues.discard("p1.t", [(g2, None), (g1, None)], now)) == 0
        assert len([t for t in sink.tracked if t[0] == "HADISCARD"]) == 2
    finally:
        store.close()


def test_an_unacknowledged_shadow_that_expires_is_a_warning_with_its_ids(tmp_path, caplog):
    """A shadow expiring (SafetyNetHoldTime + MessageExpirationTimeout without a discard) means
    its primary never released it: said at WARNING, with how many and which, not only as an
    HADISCARD Expired row."""
    import logging

    cfg = load_dict({"node": {"name": "n2.t", "data_dir": str(tmp_path)}})
    store = QueueStore.open(tmp_path / "queue.db")
    store.start_writer()
    now = time.time()
    old = now - cfg.safety_net.safety_net_hold_time - cfg.delivery.message_expiration_timeout - 60

    def seed(conn):
        return [mq.enqueue(conn, mq.NewMessage(
            network_message_id=str(uuid.uuid4()), sender="a@x.test", data=b"Subject: s\r\n\r\nb\r\n",
            recipients=bifurcate([f"r{i}@far.test"], cfg), received_at=at, expires_at=at + 3600,
            origin="shadow", role="shadow", redundancy="shadow", shadow_guid=str(uuid.uuid4()), primary_node="p1.t",
            primary_dbid="db1")) for i, at in enumerate((old, old, now))]
    ids = store.transaction(seed)
    sink = Sink()
    queues = ShadowQueues(cfg, store, sink, reshadow=lambda rows, why: None)
    try:
        with caplog.at_level(logging.INFO, logger="transportd.redundancy.shadow_queue"):
            asyncio.run(queues.housekeeping(now, set()))
        assert sink.tracked == [("HADISCARD", "Expired")] * 2
        [warning] = [r for r in caplog.records if "expired unacknowledged" in r.getMessage()]
        assert warning.levelno == logging.WARNING
        assert warning.getMessage().startswith("2 shadow copies expired unacknowledged (no discard from p1.t ")
        assert f"ids: {ids[0]}, {ids[1]}" in warning.getMessage()
    finally:
        store.close()
