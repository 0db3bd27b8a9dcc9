"""The queue database's per-delivery lookups use the index they were written for.

SQLite has no statistics here (no ANALYZE): given ``state = 'Queued'`` beside a more selective
term, its planner may choose ix_messages_state and read every queued message for each one
delivered (0.5 ms at 2,000 queued, growing with the queue). The plans are read with EXPLAIN QUERY
PLAN on the statements SQLite is given (SQLAlchemy's and those queue/direct.py runs on the driver
connection, as SQLite's trace hook shows them, values inlined), over a queue of 2,000 messages.
"""

from __future__ import annotations

from sqlalchemy import create_engine

from transportd.queue import messages as mq
from transportd.queue.store import messages, metadata


def _plans(run) -> list[str]:
    engine = create_engine("sqlite://")
    metadata.create_all(engine)
    sent: list[str] = []
    with engine.begin() as conn:
        conn.execute(messages.insert(), [
            {"id": i, "network_message_id": f"n{i}", "received_at": 1.0, "expires_at": 2.0, "size": 10,
             "state": mq.QUEUED, "role": "shadow" if i % 2 else "primary", "primary_node": f"p{i % 3}",
             "shadow_guid": f"g{i}"} for i in range(1, 2001)])
        raw = conn.connection.driver_connection
        raw.set_trace_callback(sent.append)
        try:
            run(conn)
        finally:
            raw.set_trace_callback(None)
        return [" / ".join(r[3] for r in raw.execute("EXPLAIN QUERY PLAN " + sql).fetchall())
                for sql in sent if sql.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE"))]


def test_finishing_a_message_finds_its_dsns_by_dsn_of_not_by_state() -> None:
    done = _plans(lambda c: mq.finish_if_done(c, 1000, 5.0, 60.0))[0]
    assert "ix_messages_dsn_of" in done and "ix_messages_state" not in done, done
    [dsns] = _plans(lambda c: c.execute(mq._DSN_PENDING, {"b_id": 1000}).scalar())
    assert "ix_messages_dsn_of" in dsns and "ix_messages_state" not in dsns, dsns


def test_a_discard_finds_its_shadows_by_primary_and_guid() -> None:
    from transportd.queue import shadows as sq

    plans = _plans(lambda c: sq.apply_discards(c, "p1", {"g1": None, "g4": None}, 5.0, 60.0))
    assert "ix_messages_shadow" in plans[0] and "ix_messages_state" not in plans[0], plans[0]


def test_orphaned_pending_messages_are_found_without_reading_every_message() -> None:
    """The maintenance pass (every ten poll intervals) looks for messages left ``pending``: by the
    partial index of those (schema 5), not a read of the whole table, Safety Net included."""
    import time

    plans = _plans(lambda c: mq.release_orphans(c, time.time(), active_owned=set(), pending_owned=set(),
                                               active_grace=1.0, pending_grace=5.0))
    [pending] = [p for p in plans if "messages" in p]
    assert "ix_messages_pending" in pending and "SCAN" not in pending, pending


def test_claiming_recipients_looks_them_up_by_id() -> None:
    """Each delivery batch claims its recipients (mark_active): by id, not by reading every Ready or
    Retry recipient through ix_recipients_due."""
    from transportd.queue.store import recipients

    def run(c):
        c.exec_driver_sql("PRAGMA foreign_keys = OFF")
        c.execute(recipients.insert(), [{"id": i, "message_id": i, "address": "a@b.test", "queue_id": 1,
                                         "status": mq.READY, "attempts": 0} for i in range(1, 2001)])
        assert mq.mark_active(c, list(range(5, 11)), 10.0) == list(range(5, 11))  # 4+ ids: the old plan

    select_plan = next(p for p in _plans(run) if "recipients" in p and "SEARCH" in p)
    assert "INTEGER PRIMARY KEY" in select_plan and "ix_recipients_due" not in select_plan, select_plan


def test_discard_events_handed_out_are_settled_by_their_token() -> None:
    """Discard events pile up while a shadow is away (one per message it holds); settling the
    ones handed out on a session finds them by its token (schema 5), not by reading them all."""
    from transportd.queue import shadows as sq

    plans = _plans(lambda c: (sq.settle_discard_events(c, "tok", True), sq.settle_discard_events(c, "tok", False)))
    assert len(plans) == 2 and all("ix_discard_events_token" in p for p in plans), plans


def test_idle_queue_removal_finds_recipients_by_queue_and_reads_the_forks_once() -> None:
    """Housekeeping's removal of empty idle queues asks, per queue, whether a recipient names it:
    through ix_recipients_queue_due, never a read of every recipient per queue; shadow_forks (no
    index by queue) is read once per statement, not once per queue."""
    [plan] = _plans(lambda c: mq.remove_idle_queues(c, 1000.0, 180.0))
    assert "SEARCH r USING COVERING INDEX ix_recipients_queue_due (queue_id=?)" in plan, plan
    assert "SCAN r" not in plan and "SCAN f" in plan, plan
    assert plan.count("CORRELATED") == 1, plan  # the recipients' probe only: the forks' list is made once
