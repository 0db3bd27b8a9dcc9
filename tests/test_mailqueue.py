"""Queue operations on a real (temporary) queue database with a pinned clock, and the mailbox store."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import insert, select, update

from transportd.queue import messages as mq
from transportd.queue.delivered import DeliveredLog
from transportd.queue.mailbox import MailboxStore, mailbox_name
from transportd.queue.routing import DNS, MAILBOX, SMART_HOST, NextHop
from transportd.queue.store import QueueStore, delivered_to, message_bodies, messages, queues, recipients

T0 = 1_700_000_000.0
LOCAL = NextHop("mailbox:local", MAILBOX, "local")
SMART = NextHop("smarthost:127.0.0.1:2500", SMART_HOST, "127.0.0.1:2500")
DNSHOP = NextHop("dns:remote.test", DNS, "remote.test")
RETRY_KW = dict(retry_interval=300.0, retry_count=3, long_interval=600.0)


@pytest.fixture
def store(tmp_path: Path):
    s = QueueStore.open(tmp_path / "queue.db")
    try:
        yield s
    finally:
        s.close()


def tx(store, fn):
    return store.transaction(fn)


def new(recips=None, *, nid="net-1", data=b"Subject: t\r\n\r\nbody\r\n", received=T0, expires=None, **kw):
    return mq.NewMessage(network_message_id=nid, sender="s@sender.test", data=data,
                         recipients=recips if recips is not None else {LOCAL: ["a@example.test"]},
                         received_at=received, expires_at=expires if expires is not None else received + 86400,
                         **kw)


def rows(store, table, *where):
    return store.read(lambda c: [dict(r) for r in c.execute(select(table).where(*where)).mappings()])


def rcpt_ids(store, mid):
    return [r["id"] for r in rows(store, recipients, recipients.c.message_id == mid)]


def enqueue(store, *a, **kw) -> int:
    msg = new(*a, **kw)
    return tx(store, lambda c: mq.enqueue(c, msg))


# --------------------------------------------------------------------------- enqueue

def test_enqueue_creates_message_body_and_a_row_per_recipient_and_hop(store) -> None:
    data = b"Subject: bifurcated\r\n\r\n" + bytes(range(256))
    mid = enqueue(store, {LOCAL: ["a@example.test", "b@example.test"], SMART: ["x@remote.test"]},
                  data=data, message_id="<m1@s>", submit_time="Mon", subject="bifurcated",
                  client_ip="127.0.0.1")
    m = rows(store, messages, messages.c.id == mid)[0]
    assert (m["network_message_id"], m["state"], m["role"], m["size"], m["message_id"], m["subject"]) == \
        ("net-1", "Queued", "primary", len(data), "<m1@s>", "bifurcated")
    assert m["received_at"] == T0 and m["expires_at"] == T0 + 86400
    assert store.read(lambda c: mq.body(c, mid)) == data
    qs = {q["identity"]: q for q in rows(store, queues)}
    assert set(qs) == {"mailbox:local", "smarthost:127.0.0.1:2500"}
    assert qs["mailbox:local"]["delivery_type"] == MAILBOX and qs["mailbox:local"]["next_hop"] == "local"
    rc = rows(store, recipients, recipients.c.message_id == mid)
    assert sorted((r["address"], r["queue_id"]) for r in rc) == sorted([
        ("a@example.test", qs["mailbox:local"]["id"]), ("b@example.test", qs["mailbox:local"]["id"]),
        ("x@remote.test", qs["smarthost:127.0.0.1:2500"]["id"])])
    assert all(r["status"] == "Ready" and r["attempts"] == 0 and r["next_retry_at"] == 0.0 for r in rc)


def test_queues_are_reused_across_messages(store) -> None:
    enqueue(store, {LOCAL: ["a@example.test"]}, nid="n1")
    enqueue(store, {LOCAL: ["b@example.test"], DNSHOP: ["r@remote.test"]}, nid="n2")
    assert sorted(q["identity"] for q in rows(store, queues)) == ["dns:remote.test", "mailbox:local"]
    assert store.read(lambda c: mq.resolve_queue(c, "mailbox:local"))["delivery_type"] == MAILBOX
    qid = store.read(lambda c: mq.resolve_queue(c, "dns:remote.test"))["id"]
    assert store.read(lambda c: mq.resolve_queue(c, str(qid)))["identity"] == "dns:remote.test"
    assert store.read(lambda c: mq.resolve_queue(c, "nope")) is None


# --------------------------------------------------------------------------- due work

def test_due_work_groups_per_queue_and_message(store) -> None:
    m1 = enqueue(store, {LOCAL: ["a@example.test", "b@example.test"], SMART: ["x@remote.test"]}, nid="n1")
    m2 = enqueue(store, {LOCAL: ["c@example.test"]}, nid="n2")
    work = store.read(lambda c: mq.due_work(c, T0))
    summary = [(w.queue_identity, w.message_id, w.addresses) for w in work]
    assert sorted(summary) == sorted([
        ("mailbox:local", m1, ["a@example.test", "b@example.test"]),
        ("smarthost:127.0.0.1:2500", m1, ["x@remote.test"]),
        ("mailbox:local", m2, ["c@example.test"]),
    ])
    smart = next(w for w in work if w.queue_identity.startswith("smarthost"))
    assert (smart.delivery_type, smart.next_hop) == (SMART_HOST, "127.0.0.1:2500")
    excluded = store.read(lambda c: mq.due_work(c, T0, exclude=rcpt_ids(store, m1)))
    assert [w.message_id for w in excluded] == [m2]
    # ``limit`` is per queue: one recipient from each of the two queues.
    one_each = store.read(lambda c: mq.due_work(c, T0, limit=1))
    assert sorted((w.queue_identity, len(w.recipient_ids)) for w in one_each) == [
        ("mailbox:local", 1), ("smarthost:127.0.0.1:2500", 1)]


def test_due_work_is_fair_across_queues(store) -> None:
    """A large queue (or one whose sessions are all busy) never hides another queue's work."""
    big = [enqueue(store, {SMART: [f"r{i}@remote.test"]}, nid=f"big{i}") for i in range(60)]
    local = enqueue(store, {LOCAL: ["a@example.test"]}, nid="local")
    work = store.read(lambda c: mq.due_work(c, T0, limit=20))
    assert local in {w.message_id for w in work}
    assert sum(len(w.recipient_ids) for w in work if w.message_id in big) == 20
    # The smart host's sessions are all busy (quota 0): its queue is not even read.
    smart_qid = next(w.queue_id for w in work if w.message_id in big)
    busy = store.read(lambda c: mq.due_work(c, T0, quota=lambda q: 0 if q == smart_qid else 20))
    assert [w.message_id for w in busy] == [local]
    # Round robin: the start rotates over the due queues.
    firsts = {store.read(lambda c, k=k: mq.due_work(c, T0, limit=1, start=k))[0].queue_identity for k in (0, 1)}
    assert firsts == {"mailbox:local", "smarthost:127.0.0.1:2500"}
    # In the order they were queued.
    assert [w.message_id for w in work if w.message_id in big] == big[:20]


def test_due_work_respects_next_retry_at(store) -> None:
    mid = enqueue(store)
    rid = rcpt_ids(store, mid)[0]
    tx(store, lambda c: c.execute(update(recipients).where(recipients.c.id == rid)
                                  .values(status="Retry", next_retry_at=T0 + 300)))
    assert store.read(lambda c: mq.due_work(c, T0 + 299.9)) == []
    assert [w.recipient_ids for w in store.read(lambda c: mq.due_work(c, T0 + 300))] == [[rid]]


def test_due_work_respects_queue_back_off(store) -> None:
    mid = enqueue(store)
    qid = rows(store, recipients, recipients.c.message_id == mid)[0]["queue_id"]
    nxt = tx(store, lambda c: mq.queue_attempt_result(c, qid, T0, error="connection refused", **RETRY_KW))
    assert nxt == T0 + 300
    q = rows(store, queues, queues.c.id == qid)[0]
    assert (q["retry_count"], q["next_retry_at"], q["last_error"]) == (1, T0 + 300, "connection refused")
    assert store.read(lambda c: mq.due_work(c, T0 + 10)) == []
    assert len(store.read(lambda c: mq.due_work(c, T0 + 300))) == 1
    tx(store, lambda c: mq.queue_attempt_result(c, qid, T0 + 300, error=None, **RETRY_KW))
    q = rows(store, queues, queues.c.id == qid)[0]
    assert (q["retry_count"], q["next_retry_at"], q["last_error"]) == (0, None, None)


def test_due_work_skips_suspended_queue_and_message(store) -> None:
    m1 = enqueue(store, {LOCAL: ["a@example.test"]}, nid="n1")
    m2 = enqueue(store, {SMART: ["x@remote.test"]}, nid="n2")
    smart_qid = store.read(lambda c: mq.resolve_queue(c, SMART.identity))["id"]
    tx(store, lambda c: mq.set_queue_suspended(c, smart_qid, True))
    assert [w.message_id for w in store.read(lambda c: mq.due_work(c, T0))] == [m1]
    assert tx(store, lambda c: mq.set_message_suspended(c, m1, True))
    assert store.read(lambda c: mq.due_work(c, T0)) == []
    tx(store, lambda c: mq.set_queue_suspended(c, smart_qid, False))
    tx(store, lambda c: mq.set_message_suspended(c, m1, False))
    assert sorted(w.message_id for w in store.read(lambda c: mq.due_work(c, T0))) == [m1, m2]


def test_due_work_skips_shadows_and_finished_messages(store) -> None:
    enqueue(store, nid="shadow", role="shadow", shadow_guid="g1", primary_node="n2.test")
    mid = enqueue(store, nid="done")
    tx(store, lambda c: c.execute(update(messages).where(messages.c.id == mid).values(state="SafetyNet")))
    assert store.read(lambda c: mq.due_work(c, T0)) == []


def test_mark_active_claims_only_pending(store) -> None:
    mid = enqueue(store, {LOCAL: ["a@example.test", "b@example.test", "c@example.test"]})
    a, b, c3 = rcpt_ids(store, mid)
    tx(store, lambda c: c.execute(update(recipients).where(recipients.c.id == b).values(status="Retry")))
    tx(store, lambda c: c.execute(update(recipients).where(recipients.c.id == c3).values(status="Delivered")))
    assert sorted(tx(store, lambda c: mq.mark_active(c, [a, b, c3], T0))) == [a, b]
    assert tx(store, lambda c: mq.mark_active(c, [a, b, c3], T0)) == []  # already Active
    assert tx(store, lambda c: mq.mark_active(c, [], T0)) == []
    st = {r["id"]: (r["status"], r["last_attempt_at"]) for r in rows(store, recipients)}
    assert st == {a: ("Active", T0), b: ("Active", T0), c3: ("Delivered", None)}
    assert store.read(lambda c: mq.due_work(c, T0 + 10_000)) == []


# --------------------------------------------------------------------------- outcomes and retries

@pytest.mark.parametrize("attempt, delay", [(1, 300.0), (2, 300.0), (3, 300.0), (4, 600.0), (10, 600.0)])
def test_retry_delay_schedule(attempt, delay) -> None:
    assert mq.retry_delay(attempt, **{"interval": 300.0, "count": 3, "long_interval": 600.0}) == delay


def test_retry_delay_with_zero_count_goes_long_at_once() -> None:
    assert mq.retry_delay(1, 300.0, 0, 600.0) == 600.0


def test_record_outcomes(store) -> None:
    mid = enqueue(store, {LOCAL: ["ok@example.test"], SMART: ["later@remote.test", "bad@remote.test"]})
    ids = dict(store.read(lambda c: c.execute(select(recipients.c.address, recipients.c.id)).all()))
    tx(store, lambda c: mq.mark_active(c, list(ids.values()), T0))
    tx(store, lambda c: mq.record_outcomes(c, [
        mq.Outcome(ids["ok@example.test"], mq.DELIVERED, "250 2.0.0 OK"),
        mq.Outcome(ids["later@remote.test"], mq.RETRY, "451 4.3.0 later"),
        mq.Outcome(ids["bad@remote.test"], mq.FAILED, "550 5.1.1 no such user"),
    ], T0 + 5, **RETRY_KW))
    r = {x["address"]: x for x in rows(store, recipients, recipients.c.message_id == mid)}
    assert (r["ok@example.test"]["status"], r["ok@example.test"]["attempts"],
            r["ok@example.test"]["completed_at"], r["ok@example.test"]["last_error"]) == ("Delivered", 1, T0 + 5, None)
    assert (r["later@remote.test"]["status"], r["later@remote.test"]["next_retry_at"],
            r["later@remote.test"]["last_error"], r["later@remote.test"]["completed_at"]) == \
        ("Retry", T0 + 5 + 300, "451 4.3.0 later", None)
    assert (r["bad@remote.test"]["status"], r["bad@remote.test"]["completed_at"],
            r["bad@remote.test"]["last_error"]) == ("Failed", T0 + 5, "550 5.1.1 no such user")
    assert not tx(store, lambda c: mq.finish_if_done(c, mid, T0 + 5, 3600))  # one still pending
    # The list shows the error the message waits on (the 451), not the bounced recipient's 550.
    [listed] = store.read(lambda c: mq.list_messages(c))
    assert (listed["status"], listed["last_error"]) == ("Retry", "451 4.3.0 later")


def test_retry_schedule_over_attempts(store) -> None:
    mid = enqueue(store)
    rid = rcpt_ids(store, mid)[0]
    now = T0
    delays = []
    for _ in range(6):
        assert tx(store, lambda c: mq.mark_active(c, [rid], now)) == [rid]
        tx(store, lambda c: mq.record_outcomes(c, [mq.Outcome(rid, mq.RETRY, "451 try later")], now, **RETRY_KW))
        row = rows(store, recipients, recipients.c.id == rid)[0]
        delays.append(row["next_retry_at"] - now)
        assert store.read(lambda c: mq.due_work(c, row["next_retry_at"] - 1)) == []
        now = row["next_retry_at"]
        assert len(store.read(lambda c: mq.due_work(c, now))) == 1
    assert delays == [300.0, 300.0, 300.0, 600.0, 600.0, 600.0]
    assert rows(store, recipients, recipients.c.id == rid)[0]["attempts"] == 6


def test_outcome_for_a_recipient_no_longer_active_is_ignored(store) -> None:
    mid = enqueue(store)
    rid = rcpt_ids(store, mid)[0]
    tx(store, lambda c: mq.mark_active(c, [rid], T0))
    removed = tx(store, lambda c: mq.remove_message(c, mid, T0 + 1))
    assert removed == [{"id": rid, "address": "a@example.test"}]
    tx(store, lambda c: mq.record_outcomes(c, [mq.Outcome(rid, mq.DELIVERED)], T0 + 2, **RETRY_KW))
    tx(store, lambda c: mq.record_outcomes(c, [mq.Outcome(999_999, mq.DELIVERED)], T0 + 2, **RETRY_KW))
    r = rows(store, recipients, recipients.c.id == rid)[0]
    assert (r["status"], r["attempts"]) == ("Removed", 0)


def test_queue_connection_failures_follow_the_schedule(store) -> None:
    enqueue(store, {SMART: ["x@remote.test"]})
    qid = store.read(lambda c: mq.resolve_queue(c, SMART.identity))["id"]
    got = [tx(store, lambda c, t=t: mq.queue_attempt_result(c, qid, t, error="refused", **RETRY_KW)) - t
           for t in (T0, T0 + 1000, T0 + 2000, T0 + 3000, T0 + 4000)]
    assert got == [300.0, 300.0, 300.0, 600.0, 600.0]
    assert tx(store, lambda c: mq.retry_queue_now(c, qid)) == 1
    assert rows(store, queues, queues.c.id == qid)[0]["next_retry_at"] is None


def test_sessions_failing_together_spend_one_quick_retry(store) -> None:
    """Parallel sessions to one next hop that fail in the same round are one connection failure:
    each failure while the queue already waits for its retry keeps that retry and its count (it
    records its error); the next round's failure counts again."""
    enqueue(store, {SMART: ["x@remote.test"]})
    qid = store.read(lambda c: mq.resolve_queue(c, SMART.identity))["id"]
    first = tx(store, lambda c: mq.queue_attempt_result(c, qid, T0, error="refused", **RETRY_KW))
    for i in range(1, 6):  # four more sessions of the same round fail within the second
        assert tx(store, lambda c, i=i: mq.queue_attempt_result(c, qid, T0 + i / 10, error=f"refused {i}",
                                                                 **RETRY_KW)) == first == T0 + 300
    q = rows(store, queues, queues.c.id == qid)[0]
    assert (q["retry_count"], q["next_retry_at"], q["last_error"]) == (1, T0 + 300, "refused 5")
    got = [tx(store, lambda c, t=t: mq.queue_attempt_result(c, qid, t, error="refused", **RETRY_KW)) - t
           for t in (T0 + 300, T0 + 600)]
    assert got == [300.0, 300.0] and rows(store, queues, queues.c.id == qid)[0]["retry_count"] == 3
    assert tx(store, lambda c: mq.queue_attempt_result(c, qid, T0 + 900, error="refused", **RETRY_KW)) == T0 + 1500


def test_queue_retry_counts_and_touches_only_the_mail_this_node_delivers(store) -> None:
    """Retry-Queue makes due (and counts, as queue list does) the recipients of queued primary
    copies; a shadow copy's, a Safety Net copy's, a suspended or a Poison message's rows stay."""
    mine = enqueue(store, {SMART: ["x@remote.test"]}, nid="mine")
    others = [enqueue(store, {SMART: ["s@remote.test"]}, nid="shadow", role="shadow"),
              enqueue(store, {SMART: ["n@remote.test"]}, nid="netted"),
              enqueue(store, {SMART: ["h@remote.test"]}, nid="held"),
              enqueue(store, {SMART: ["p@remote.test"]}, nid="poison")]
    tx(store, lambda c: c.execute(update(messages).where(messages.c.id == others[1]).values(state="SafetyNet")))
    tx(store, lambda c: mq.set_message_suspended(c, others[2], True))
    tx(store, lambda c: mq.count_internal_failure(c, others[3], 1))
    tx(store, lambda c: c.execute(update(recipients).values(status="Retry", next_retry_at=T0 + 300)))
    qid = store.read(lambda c: mq.resolve_queue(c, SMART.identity))["id"]
    assert tx(store, lambda c: mq.retry_queue_now(c, qid)) == 1
    due = {r["message_id"]: r["next_retry_at"] for r in rows(store, recipients)}
    assert due == {mine: 0.0, **dict.fromkeys(others, T0 + 300)}


def test_expired_recipients(store) -> None:
    old = enqueue(store, {LOCAL: ["a@example.test"], SMART: ["x@remote.test"]}, nid="old", expires=T0 + 100)
    enqueue(store, nid="young", expires=T0 + 10_000)
    enqueue(store, nid="shadow", expires=T0 + 100, role="shadow")
    a, x = rcpt_ids(store, old)
    tx(store, lambda c: mq.mark_active(c, [a], T0))  # in flight: not expired under the sender's feet
    assert store.read(lambda c: mq.expired_recipients(c, T0 + 99)) == []
    got = store.read(lambda c: mq.expired_recipients(c, T0 + 100))
    assert [(r["id"], r["address"], r["message_id"]) for r in got] == [(x, "x@remote.test", old)]


# --------------------------------------------------------------------------- completion, Safety Net, purge

def _deliver_all(store, mid, now):
    ids = rcpt_ids(store, mid)
    tx(store, lambda c: mq.mark_active(c, ids, now))
    tx(store, lambda c: mq.record_outcomes(c, [mq.Outcome(i, mq.DELIVERED) for i in ids], now, **RETRY_KW))


def test_finish_if_done_moves_to_safety_net(store) -> None:
    mid = enqueue(store)
    assert not tx(store, lambda c: mq.finish_if_done(c, mid, T0, 7200))  # still Ready
    _deliver_all(store, mid, T0 + 10)
    assert tx(store, lambda c: mq.finish_if_done(c, mid, T0 + 10, 7200))
    m = rows(store, messages, messages.c.id == mid)[0]
    assert (m["state"], m["completed_at"], m["safety_net_until"]) == ("SafetyNet", T0 + 10, T0 + 10 + 7200)
    assert store.read(lambda c: mq.body(c, mid)) is not None  # kept for resubmission
    assert not tx(store, lambda c: mq.finish_if_done(c, mid, T0 + 20, 7200))  # only once
    assert store.read(lambda c: mq.list_messages(c)) == []
    listed = store.read(lambda c: mq.list_messages(c, include_done=True))
    assert [x["status"] for x in listed] == ["SafetyNet"]


def test_finish_with_zero_hold_removes_the_body(store) -> None:
    mid = enqueue(store)
    _deliver_all(store, mid, T0)
    assert tx(store, lambda c: mq.finish_if_done(c, mid, T0, 0))
    m = rows(store, messages, messages.c.id == mid)[0]
    assert m["state"] == "Removed" and m["safety_net_until"] is None
    assert store.read(lambda c: mq.body(c, mid)) is None


def test_purge_expired(store) -> None:
    keep = enqueue(store, nid="keep")
    held = enqueue(store, nid="held")
    gone = enqueue(store, nid="gone")
    removed = enqueue(store, nid="removed")
    _deliver_all(store, held, T0)
    _deliver_all(store, gone, T0)
    tx(store, lambda c: mq.finish_if_done(c, held, T0, 7200))
    tx(store, lambda c: mq.finish_if_done(c, gone, T0, 3600))
    tx(store, lambda c: mq.remove_message(c, removed, T0))
    for i, at in enumerate((T0 + 3600 - 1800 - 1, T0 + 3600 - 1800 + 1, T0 + 3600)):
        tx(store, lambda c, i=i, at=at: c.execute(insert(delivered_to).values(
            recipient=f"r{i}@example.test", message_id=f"<m{i}>", submit_time="d", delivered_at=at)))

    n_msgs, n_dup = tx(store, lambda c: mq.purge_expired(c, T0 + 3600, duplicate_window=1800))
    assert (n_msgs, n_dup) == (2, 1)
    left = {m["network_message_id"]: m["state"] for m in rows(store, messages)}
    assert left == {"keep": "Queued", "held": "SafetyNet"}
    assert {r["message_id"] for r in rows(store, recipients)} == {keep, held}
    assert {b["message_id"] for b in rows(store, message_bodies)} == {keep, held}
    assert sorted(d["recipient"] for d in rows(store, delivered_to)) == ["r1@example.test", "r2@example.test"]

    assert tx(store, lambda c: mq.purge_expired(c, T0 + 7199, 1800))[0] == 0
    assert tx(store, lambda c: mq.purge_expired(c, T0 + 7200, 1800))[0] == 1
    assert [m["network_message_id"] for m in rows(store, messages)] == ["keep"]


def test_empty_queues_idle_for_queue_max_idle_time_are_removed_and_made_again(store) -> None:
    """Exchange's QueueMaxIdleTime: a queue no recipient row (of any status) and no fork a peer
    holds names, not suspended, idle since its last attempt (else since it was made), is removed;
    mail for its next hop makes it again, under a new id."""
    from transportd.queue import shadows as sq
    from transportd.queue.routing import PEER

    idle = 180.0
    empty = NextHop("dns:empty.test", DNS, "empty.test")
    held = NextHop("dns:held.test", DNS, "held.test")
    peer = NextHop("peer:node2.test", PEER, "node2.test")
    waiting = enqueue(store, {LOCAL: ["a@example.test"]}, nid="waiting")
    in_safety_net = enqueue(store, {SMART: ["x@remote.test"]}, nid="safety-net")
    _deliver_all(store, in_safety_net, T0)
    tx(store, lambda c: mq.finish_if_done(c, in_safety_net, T0, 7200))
    for nid, hop in (("gone", DNSHOP), ("held", held)):
        mid = enqueue(store, {hop: ["r@remote.test"]}, nid=nid)
        _deliver_all(store, mid, T0)
        tx(store, lambda c, mid=mid: mq.finish_if_done(c, mid, T0, 0))  # no Safety Net: purged at once
    assert tx(store, lambda c: mq.purge_expired(c, T0, 1800))[0] == 2
    ids = {h.identity: tx(store, lambda c, h=h: mq.queue_id_for(c, h, T0)) for h in (empty, held, peer, DNSHOP)}
    tx(store, lambda c: sq.record_forks(c, [(waiting, peer.identity, "guid-1", ids[peer.identity], None)], T0))
    tx(store, lambda c: mq.set_queue_suspended(c, ids[held.identity], True))
    tx(store, lambda c: mq.queue_attempt_result(c, ids[DNSHOP.identity], T0 + 100, error=None, **RETRY_KW))

    def remove(now, limit=1000):
        return tx(store, lambda c: mq.remove_idle_queues(c, now, idle, limit))

    def listed(now):
        return {q["identity"]: q["state"] for q in store.read(lambda c: mq.list_queues(c, now))}

    assert remove(T0 + idle - 1) == []
    assert remove(T0 + idle) == ["dns:empty.test"]  # made at T0, never tried
    assert remove(T0 + 100 + idle - 1) == []  # its last attempt counts, not when it was made
    assert remove(T0 + 100 + idle) == ["dns:remote.test"]
    # Kept: a waiting recipient, a Safety Net copy's recipient, a fork a peer holds, an operator's hold.
    assert listed(T0 + 1000) == {"mailbox:local": "Ready", SMART.identity: "Ready", "dns:held.test": "Suspended",
                                 "peer:node2.test": "Ready"}
    tx(store, lambda c: mq.set_queue_suspended(c, ids[held.identity], False))
    assert remove(T0 + 1000) == ["dns:held.test"]  # resumed: empty and idle
    assert tx(store, lambda c: mq.purge_expired(c, T0 + 7200, 1800))[0] == 1
    assert remove(T0 + 7200) == [SMART.identity]  # once its last message left the Safety Net
    assert set(listed(T0 + 7200)) == {"mailbox:local", "peer:node2.test"}

    # Mail for a removed queue's next hop makes it again (a new id: ids are never reused), due now.
    again = enqueue(store, {DNSHOP: ["r2@remote.test"]}, nid="again", received=T0 + 7300)
    q = store.read(lambda c: mq.resolve_queue(c, DNSHOP.identity))
    assert q["id"] > max(ids.values()) and q["created_at"] == T0 + 7300 and q["retry_count"] == 0
    assert [(w.queue_identity, w.message_id) for w in store.read(lambda c: mq.due_work(c, T0 + 7300))] == \
        [("mailbox:local", waiting), (DNSHOP.identity, again)]
    assert remove(T0 + 7300 + 10 * idle) == []  # its recipient holds it

    # Bounded work per call: many rounds drain many.
    for i in range(5):
        tx(store, lambda c, i=i: mq.queue_id_for(c, NextHop(f"dns:d{i}.test", DNS, f"d{i}.test"), T0))
    assert remove(T0 + 7300, limit=2) == ["dns:d0.test", "dns:d1.test"]
    assert remove(T0 + 7300, limit=2) == ["dns:d2.test", "dns:d3.test"]
    assert remove(T0 + 7300, limit=2) == ["dns:d4.test"]


# --------------------------------------------------------------------------- duplicate detection

def test_delivered_log_honours_the_window(tmp_path) -> None:
    """DeliveredTo beside the mailboxes (queue/delivered.py)."""
    log = DeliveredLog(tmp_path / "mailboxes")
    args = ("Alice@Example.Test", "<m1@s>", "Mon, 06 Jan 2025 10:00:00 +0000")
    assert not log.seen(*args, T0, 3600)
    log.remember(*args, T0)
    assert log.path.parent == tmp_path / "mailboxes" and log.path.name.startswith(".")
    assert log.seen("alice@example.test", *args[1:], T0 + 10, 3600)
    assert log.seen(*args, T0 + 3599, 3600)
    assert not log.seen(*args, T0 + 3600, 3600)  # window over
    assert not log.seen("bob@example.test", *args[1:], T0, 3600)
    assert not log.seen(args[0], "<other@s>", args[2], T0, 3600)
    assert not log.seen(args[0], args[1], "Tue", T0, 3600)
    # remembering again refreshes the row
    log.remember(*args, T0 + 5000)
    assert log.seen(*args, T0 + 5000 + 3599, 3600)
    assert log.count() == 1
    log.close()
    # a new process (or a node whose queue database was deleted) reads the same records
    again = DeliveredLog(tmp_path / "mailboxes")
    assert again.seen(*args, T0 + 5001, 3600)
    log.remember("b@example.test", "<m2@s>", "d", T0 + 100)
    assert again.purge(T0 + 3701, 3600) == 1 and again.count() == 1
    again.close()


def test_delivered_log_merges_legacy_rows_and_survives_a_corrupt_file(store, tmp_path) -> None:
    for i, at in enumerate((T0, T0 + 10)):
        tx(store, lambda c, i=i, at=at: c.execute(insert(delivered_to).values(
            recipient=f"r{i}@example.test", message_id=f"<m{i}>", submit_time="d", delivered_at=at)))
    log = DeliveredLog(tmp_path / "mailboxes")
    log.remember("r1@example.test", "<m1>", "d", T0 + 50)
    rows = store.read(mq.legacy_delivered_to)
    assert sorted(rows) == [("r0@example.test", "<m0>", "d", T0), ("r1@example.test", "<m1>", "d", T0 + 10)]
    assert log.merge(rows) == 2
    tx(store, lambda c: mq.drop_legacy_delivered_to(c, rows))
    assert store.read(mq.legacy_delivered_to) == []
    assert log.seen("r0@example.test", "<m0>", "d", T0 + 1, 3600)
    assert log.seen("r1@example.test", "<m1>", "d", T0 + 3600 + 40, 3600)  # the later time kept
    log.close()
    log.path.write_bytes(b"this is not a database" * 100)
    for suffix in ("-wal", "-shm"):
        Path(f"{log.path}{suffix}").unlink(missing_ok=True)
    fresh = DeliveredLog(tmp_path / "mailboxes")
    assert not fresh.seen("r0@example.test", "<m0>", "d", T0 + 1, 3600)   # moved aside, started afresh
    assert list((tmp_path / "mailboxes").glob(".delivered_to.sqlite.corrupt-*"))
    fresh.remember("r0@example.test", "<m0>", "d", T0)
    assert fresh.count() == 1
    fresh.close()


def test_messages_without_message_id_are_never_duplicates(tmp_path) -> None:
    log = DeliveredLog(tmp_path)
    log.remember("a@example.test", "", "d", T0)
    assert log.count() == 0
    assert not log.seen("a@example.test", "", "d", T0, 3600)
    log.close()


# --------------------------------------------------------------------------- restart, removal, views

def test_recover_after_restart_resets_active_to_ready(store) -> None:
    mid = enqueue(store, {LOCAL: ["a@example.test", "b@example.test", "c@example.test"]})
    a, b, c3 = rcpt_ids(store, mid)
    tx(store, lambda c: mq.mark_active(c, [a, b], T0))
    tx(store, lambda c: mq.record_outcomes(c, [mq.Outcome(b, mq.DELIVERED)], T0, **RETRY_KW))
    assert tx(store, mq.recover_after_restart) == 1
    st = {r["id"]: (r["status"], r["next_retry_at"]) for r in rows(store, recipients)}
    assert st == {a: ("Ready", 0.0), b: ("Delivered", 0.0), c3: ("Ready", 0.0)}
    assert tx(store, mq.recover_after_restart) == 0
    assert sorted(store.read(lambda c: mq.due_work(c, T0))[0].recipient_ids) == [a, c3]


def test_remove_message(store) -> None:
    mid = enqueue(store, {LOCAL: ["done@example.test", "p@example.test"], SMART: ["x@remote.test"]})
    done = rcpt_ids(store, mid)[0]
    tx(store, lambda c: mq.mark_active(c, [done], T0))
    tx(store, lambda c: mq.record_outcomes(c, [mq.Outcome(done, mq.DELIVERED)], T0, **RETRY_KW))
    pending = tx(store, lambda c: mq.remove_message(c, mid, T0 + 1))
    assert sorted(p["address"] for p in pending) == ["p@example.test", "x@remote.test"]
    st = {r["address"]: (r["status"], r["last_error"]) for r in rows(store, recipients)}
    assert st == {"done@example.test": ("Delivered", None),
                  "p@example.test": ("Removed", "Removed by administrator"),
                  "x@remote.test": ("Removed", "Removed by administrator")}
    m = rows(store, messages, messages.c.id == mid)[0]
    assert (m["state"], m["completed_at"]) == ("Removed", T0 + 1)
    assert store.read(lambda c: mq.body(c, mid)) is None
    assert store.read(lambda c: mq.due_work(c, T0 + 10)) == []
    assert not tx(store, lambda c: mq.set_message_suspended(c, mid, True))  # not Queued any more


def test_list_queues_states(store) -> None:
    enqueue(store, {LOCAL: ["a@example.test"], SMART: ["x@remote.test"], DNSHOP: ["r@remote.test"]}, nid="n1")
    m2 = enqueue(store, {LOCAL: ["b@example.test"], SMART: ["y@remote.test"]}, nid="n2")
    q = {x["identity"]: x for x in store.read(lambda c: mq.list_queues(c, T0))}
    assert {k: (v["state"], v["message_count"]) for k, v in q.items()} == {
        "mailbox:local": ("Ready", 2), SMART.identity: ("Ready", 2), "dns:remote.test": ("Ready", 1)}

    smart_id, dns_id = q[SMART.identity]["id"], q["dns:remote.test"]["id"]
    tx(store, lambda c: mq.queue_attempt_result(c, smart_id, T0, error="421 busy", **RETRY_KW))
    tx(store, lambda c: mq.set_queue_suspended(c, dns_id, True))
    local_ids = [r["id"] for r in rows(store, recipients, recipients.c.message_id == m2,
                                       recipients.c.address == "b@example.test")]
    tx(store, lambda c: mq.mark_active(c, local_ids, T0))

    q = {x["identity"]: x for x in store.read(lambda c: mq.list_queues(c, T0 + 1))}
    assert q["mailbox:local"]["state"] == "Active"
    assert q[SMART.identity]["state"] == "Retry"
    assert q[SMART.identity]["next_retry_at"] == T0 + 300
    assert q[SMART.identity]["last_error"] == "421 busy" and q[SMART.identity]["retry_count"] == 1
    assert q["dns:remote.test"]["state"] == "Suspended"
    # the injected clock decides Retry vs Ready
    later = {x["identity"]: x for x in store.read(lambda c: mq.list_queues(c, T0 + 300))}
    assert later[SMART.identity]["state"] == "Ready" and later[SMART.identity]["next_retry_at"] is None

    # finished recipients no longer count
    tx(store, lambda c: mq.record_outcomes(c, [mq.Outcome(i, mq.DELIVERED) for i in local_ids], T0, **RETRY_KW))
    q = {x["identity"]: x for x in store.read(lambda c: mq.list_queues(c, T0 + 300))}
    assert q["mailbox:local"]["state"] == "Ready" and q["mailbox:local"]["message_count"] == 1


def test_message_status_view(store) -> None:
    assert mq.message_status(["Ready", "Active"], False, "Queued") == "Active"
    assert mq.message_status(["Ready", "Retry"], False, "Queued") == "Retry"
    assert mq.message_status(["Ready"], True, "Queued") == "Suspended"
    assert mq.message_status(["Delivered", "Failed"], False, "Queued") == "Delivered"
    assert mq.message_status(["Failed"], False, "Queued") == "Failed"
    assert mq.message_status(["Delivered"], False, "SafetyNet") == "SafetyNet"
    mid = enqueue(store)
    detail = store.read(lambda c: mq.message_detail(c, mid))
    assert detail["status"] == "Ready" and [r["queue"] for r in detail["recipients"]] == ["mailbox:local"]
    assert store.read(lambda c: mq.message_detail(c, 424242)) is None


# --------------------------------------------------------------------------- mailbox store

def test_mailbox_deliver_writes_exact_bytes_once(tmp_path: Path) -> None:
    mb = MailboxStore(tmp_path / "mailboxes", hostname="host/with:odd")
    data = b"Received: x\r\n\r\n" + bytes(range(256)) * 10 + b"\r\n.\r\n"
    path, stored = mb.deliver("Alice@Example.Test", "net-1", data, received_at=T0)
    assert stored
    assert path.parent == tmp_path / "mailboxes" / "alice@example.test" / "new"
    assert path.read_bytes() == data
    assert path.name == f"{int(T0)}.net-1.host_with_odd,S={len(data)}"
    assert list((path.parent.parent / "tmp").iterdir()) == []
    again, stored_again = mb.deliver("alice@example.test", "net-1", b"other bytes", received_at=T0 + 9)
    assert (again, stored_again) == (path, False)
    assert mb.list("alice@example.test") == [path]
    assert path.read_bytes() == data
    assert mb.has("ALICE@example.test", "net-1") and not mb.has("alice@example.test", "net-2")
    second, ok = mb.deliver("alice@example.test", "net-2", b"two", received_at=T0)
    assert ok and len(mb.list("alice@example.test")) == 2 and second.read_bytes() == b"two"


def test_mailbox_finds_a_copy_moved_to_cur(tmp_path: Path) -> None:
    mb = MailboxStore(tmp_path, hostname="h")
    path, _ = mb.deliver("a@example.test", "net-9", b"x", received_at=T0)
    moved = path.parent.parent / "cur" / (path.name + ":2,S")
    path.rename(moved)
    assert mb.deliver("a@example.test", "net-9", b"x") == (moved, False)


@pytest.mark.parametrize("address", [
    "../x@y", "../../etc/passwd", "/abs@y", "a/b@y", "..", ".", "...", ".hidden@y", "a\\b@y",
    "a\x00b@y", "ü@y", "a..b@y", "%2E%2E", " ", "x@y/../..", "....//..@y",
])
def test_mailbox_name_stays_under_root(tmp_path: Path, address: str) -> None:
    name = mailbox_name(address)
    assert name and "/" not in name and "\x00" not in name and "\\" not in name
    assert name not in (".", "..")
    assert not name.startswith(".") and ".." not in name
    root = tmp_path / "mailboxes"
    mb = MailboxStore(root, hostname="h")
    folder = mb.maildir(address)
    assert folder.parent == root
    path, stored = mb.deliver(address, "net-1", b"data", received_at=T0)
    assert stored and path.resolve().is_relative_to(root.resolve())
    assert [p.name for p in root.iterdir()] == [name]


def test_mailbox_names_are_distinct() -> None:
    addresses = ["a/b@y", "a%2Fb@y", "a_b@y", "a..b@y", "a.%2Eb@y", ".a@y", "%2Ea@y", "ü@y", "%C3%BC@y"]
    names = [mailbox_name(a) for a in addresses]
    assert len(set(names)) == len(names), dict(zip(addresses, names))
    assert mailbox_name("Alice@Example.Test") == mailbox_name("alice@example.test") == "alice@example.test"


def test_redirect_leaves_suspended_and_poison_messages_held(store) -> None:
    """Redirect-Message drains the queues, but releases nothing an operator (or the Poison
    queue) holds: those stay here, still held."""
    free = enqueue(store, {SMART: ["x@remote.test"]}, nid="free")
    held = enqueue(store, {SMART: ["y@remote.test"]}, nid="held")
    poison = enqueue(store, {SMART: ["z@remote.test"]}, nid="poison")
    tx(store, lambda c: mq.set_message_suspended(c, held, True))
    tx(store, lambda c: (mq.count_internal_failure(c, poison, 1)))
    moved = tx(store, lambda c: mq.redirect_to_peer(c, "node2.transportd.test", T0))
    assert [m["id"] for m in moved] == [free]
    assert rows(store, messages, messages.c.id == held)[0]["suspended"] == 1
    queues_of = {r["message_id"]: r["queue_id"] for r in rows(store, recipients)}
    assert queues_of[held] == queues_of[poison] != queues_of[free]
    assert store.read(mq.held_messages) == {"poison": 1, "suspended message": 1, "suspended queue": 0}


def test_a_drain_leaves_a_suspended_queue_held_a_promotion_moves_it(store) -> None:
    """Suspend-Queue's hold is the queue's: a drain leaves its recipients (the peer would send
    them to the same next hop at once) and counts them; shadow redundancy promotion moves a
    message out of a suspended queue, that being one of its reasons (QueueSuspended)."""
    one = enqueue(store, {SMART: ["x@remote.test"]}, nid="one")
    two = enqueue(store, {SMART: ["y@remote.test"]}, nid="two")
    queue_id = rows(store, recipients, recipients.c.message_id == one)[0]["queue_id"]
    tx(store, lambda c: mq.set_queue_suspended(c, queue_id, True))
    assert tx(store, lambda c: mq.redirect_to_peer(c, "node2.transportd.test", T0)) == []
    assert store.read(mq.held_messages) == {"poison": 0, "suspended message": 0, "suspended queue": 2}
    moved = tx(store, lambda c: mq.redirect_to_peer(c, "node2.transportd.test", T0, message_id=two))
    assert [m["id"] for m in moved] == [two]
    assert store.read(mq.held_messages) == {"poison": 0, "suspended message": 0, "suspended queue": 1}


def test_redirect_moves_what_an_attempt_leaves_pending_once_it_ends(store) -> None:
    """A recipient in a delivery attempt (Active) stays where it is; ``in_attempt_here`` counts its
    message until the attempt ends, and a deferral is moved by the next redirect."""
    target = "node2.transportd.test"
    two = enqueue(store, {SMART: ["x@remote.test", "y@remote.test"]}, nid="two")
    other = enqueue(store, {SMART: ["z@remote.test"]}, nid="other")
    x, y = tx(store, lambda c: c.execute(select(recipients.c.id).where(recipients.c.message_id == two)
                                         .order_by(recipients.c.id)).scalars().all())
    tx(store, lambda c: mq.mark_active(c, [x], T0))
    assert store.read(lambda c: mq.in_attempt_here(c, target)) == 1  # before the peer's queue exists
    assert {m["id"] for m in tx(store, lambda c: mq.redirect_to_peer(c, target, T0))} == {two, other}
    assert store.read(lambda c: mq.in_attempt_here(c, target)) == 1
    tx(store, lambda c: mq.record_outcomes(c, [mq.Outcome(x, mq.RETRY, "451 4.3.0 try later")], T0 + 1,
                                           retry_interval=1, retry_count=1, long_interval=1))
    assert store.read(lambda c: mq.in_attempt_here(c, target)) == 0
    assert [m["id"] for m in tx(store, lambda c: mq.redirect_to_peer(c, target, T0 + 2))] == [two]
    assert len({r["queue_id"] for r in rows(store, recipients)}) == 1  # x, y and z all in the peer's queue
    assert store.read(lambda c: mq.in_attempt_here(c, "node3.transportd.test")) == 0


def test_a_dsn_keeps_the_originals_shadows_until_it_is_out(store) -> None:
    """The NDR is protected by the original's shadow: no discard event for it while the DSN
    about it is queued; one as soon as the DSN is processed."""
    from transportd.queue.store import discard_events, message_shadows

    def finish(mid, when):
        def job(conn):
            ids = conn.execute(select(recipients.c.id).where(recipients.c.message_id == mid)).scalars().all()
            mq.mark_active(conn, ids, when)
            mq.record_outcomes(conn, [mq.Outcome(r, mq.FAILED if mid == original else mq.DELIVERED) for r in ids],
                               when, retry_interval=1, retry_count=1, long_interval=1)
            mq.finish_if_done(conn, mid, when, 3600)
        tx(store, job)
    original = enqueue(store, {SMART: ["x@remote.test"]}, nid="orig")
    tx(store, lambda c: c.execute(message_shadows.insert().values(message_id=original, shadow_node="node3.t",
                                                                    shadow_guid="g-1", created_at=T0)))
    dsn = enqueue(store, {SMART: ["s@sender.test"]}, nid="dsn", origin="dsn", dsn_of=original)
    finish(original, T0 + 1)
    assert rows(store, messages, messages.c.id == original)[0]["state"] == mq.SAFETY_NET
    assert rows(store, discard_events) == []
    finish(dsn, T0 + 2)
    assert [(r["shadow_node"], r["shadow_guid"]) for r in rows(store, discard_events)] == [("node3.t", "g-1")]


# --------------------------------------------------------------------------- delayed acknowledgement (2010)

def test_acknowledgement_state_says_when_a_held_250_may_go(store) -> None:
    mid = enqueue(store, {SMART: ["x@remote.test"], LOCAL: ["a@example.test"]})

    def state(now: float = T0 + 1, promoting: set | None = None):
        return store.read(lambda c: mq.acknowledgement_state(c, mid, now, promoting))

    def set_rcpt(address: str, **values) -> None:
        tx(store, lambda c: c.execute(update(recipients).where(recipients.c.message_id == mid,
                                                               recipients.c.address == address).values(**values)))

    def set_queue(identity: str, **values) -> None:
        tx(store, lambda c: c.execute(update(queues).where(queues.c.identity == identity).values(**values)))

    assert state() is None  # waiting: nothing delivered, no bypass
    set_rcpt("a@example.test", status=mq.DELIVERED)
    assert state() is None  # one next hop still to go
    set_queue(SMART.identity, suspended=1)
    assert state() == "QueueSuspended"
    set_queue(SMART.identity, suspended=0, retry_count=1, next_retry_at=T0 + 60)
    assert state() == "QueueRetry"
    # Failures before, their retry time passed: the queue is Ready (queue list says so), not Retry
    set_queue(SMART.identity, retry_count=3, next_retry_at=T0)
    assert store.read(lambda c: [q["state"] for q in mq.list_queues(c, T0 + 1)
                                 if q["identity"] == SMART.identity]) == ["Ready"]
    assert state() is None
    set_queue(SMART.identity, retry_count=0, next_retry_at=None)
    set_rcpt("x@remote.test", status=mq.RETRY)
    assert state() == "QueueRetry"  # it entered Retry since it was added
    set_rcpt("x@remote.test", status=mq.ACTIVE)
    assert state() is None
    # A suspended message changes nothing (the seed): only its queue's state counts.
    tx(store, lambda c: mq.set_message_suspended(c, mid, True))
    assert state() is None
    tx(store, lambda c: mq.set_message_suspended(c, mid, False))
    for i in range(99):
        enqueue(store, {SMART: [f"o{i}@remote.test"]}, nid=f"other-{i}")
    assert state() is None  # 100 messages in the queue, this one included
    enqueue(store, {SMART: ["o99@remote.test"]}, nid="other-99")
    assert state() == "QueueLength"  # more than 100
    # With promotion (2010 SP1), a queue that went past 100 is promoted for "until the queue
    # clears"; skipping the delay stops at 100 or fewer.
    promoting: set = set()
    assert state(promoting=promoting) == "QueueLength"
    smart_queue = store.read(lambda c: c.execute(select(queues.c.id).where(queues.c.identity == SMART.identity))
                             .scalar_one())
    assert promoting == {smart_queue}

    def deliver_others(first: int, last: int) -> None:
        tx(store, lambda c: c.execute(update(recipients).where(recipients.c.address.in_(
            [f"o{i}@remote.test" for i in range(first, last)])).values(status=mq.DELIVERED)))

    deliver_others(0, 50)
    assert state() is None  # 51 messages: not more than 100
    assert state(promoting=promoting) == "QueueLength"  # the queue has not cleared
    deliver_others(50, 99)
    assert state(promoting=promoting) == "QueueLength"  # one other message still waits
    deliver_others(99, 100)
    assert state(promoting=promoting) is None and promoting == set()  # cleared: back to waiting
    assert state(promoting=promoting) is None
    set_rcpt("x@remote.test", status=mq.DELIVERED)
    assert state() == "Delivered"


def test_reroute_moves_waiting_recipients_to_the_queue_their_route_names_now(store) -> None:
    """A routing change applies to queued mail: waiting recipients (Ready, Retry) of queued copies,
    shadows included, go to the queue the new route names, due at once. Recipients in an attempt,
    delivered, in a suspended queue (counted apart), or in a peer's queue stay where they are."""
    new_smart = NextHop("smarthost:127.0.0.1:2600", SMART_HOST, "127.0.0.1:2600")
    peer = NextHop("peer:node2.transportd.test", "SmtpRelayToMailboxDeliveryGroup", "node2.transportd.test")
    held_hop = NextHop("dns:held.test", DNS, "held.test")

    def route(address: str) -> NextHop:
        if address == "bad@remote.test":
            raise ValueError("cannot be routed")
        return LOCAL if address.endswith("@example.test") else new_smart

    waiting = enqueue(store, {SMART: ["x@remote.test", "y@remote.test", "bad@remote.test"],
                              LOCAL: ["a@example.test"]}, nid="waiting")
    shadow = enqueue(store, {SMART: ["s@remote.test"]}, nid="shadow", role="shadow")
    drained = enqueue(store, {peer: ["p@remote.test"]}, nid="drained")
    held = enqueue(store, {held_hop: ["h@remote.test"]}, nid="held")
    ids = {r["address"]: r["id"] for r in rows(store, recipients)}
    tx(store, lambda c: c.execute(update(recipients).where(recipients.c.id == ids["y@remote.test"])
                                  .values(status="Retry", next_retry_at=T0 + 300, attempts=2)))
    tx(store, lambda c: mq.mark_active(c, [ids["x@remote.test"]], T0))
    held_qid = rows(store, recipients, recipients.c.id == ids["h@remote.test"])[0]["queue_id"]
    tx(store, lambda c: mq.set_queue_suspended(c, held_qid, True))
    before = {r["id"]: r for r in rows(store, recipients)}

    moved, kept = tx(store, lambda c: mq.reroute_queued(c, route, T0 + 10))

    assert moved == {(SMART.identity, new_smart.identity): 2}  # y (Retry) and the shadow's s
    assert kept == {(held_hop.identity, new_smart.identity): 1}
    new_qid = rows(store, queues, queues.c.identity == new_smart.identity)[0]["id"]
    after = {r["id"]: r for r in rows(store, recipients)}
    y, s = after[ids["y@remote.test"]], after[ids["s@remote.test"]]
    assert (y["queue_id"], y["status"], y["next_retry_at"], y["attempts"]) == (new_qid, "Retry", 0.0, 2)
    assert (s["queue_id"], s["status"]) == (new_qid, "Ready")
    for unmoved in ("x@remote.test", "bad@remote.test", "a@example.test", "p@remote.test", "h@remote.test"):
        assert after[ids[unmoved]] == before[ids[unmoved]], unmoved
    assert {waiting, shadow, drained, held} == {r["message_id"] for r in after.values()}
    # a second pass finds nothing more to move
    assert tx(store, lambda c: mq.reroute_queued(c, route, T0 + 20)) == ({}, kept)
