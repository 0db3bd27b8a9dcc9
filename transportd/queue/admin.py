"""Operator queries and actions on the queue database, for the CLI and the metrics collector.

It owns every query the ``transportd`` command line and the Prometheus collector run:
resolving a queue by name and acting on it, listing and acting on one message or on
every message a selection (``selection.py``: ids, ``--filter`` terms) matches, a batch
per transaction, the Safety Net and shadow views, filing a shadow resubmit request, the
node's recorded name (and whether a node of another name may take the database over) and
config path, and the grouped counts behind the scrape-time
gauges. Each
function takes an open SQLAlchemy connection (inside ``QueueStore.read`` or
``QueueStore.transaction``) and builds on ``messages`` and ``safetynet`` where those
already have the query. It never formats output, never speaks SMTP, never writes
tracking logs and never composes a DSN: the caller passes a builder for that.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from sqlalchemy import and_, case, func, insert, literal, select
from sqlalchemy.engine import Connection

from transportd.queue import messages as mq
from transportd.queue import selection as sel
from transportd.queue import shadows as sq
from transportd.queue.selection import Selection
from transportd.queue.store import (
    discard_events,
    messages,
    meta,
    queues,
    recipients,
    resubmit_requests,
    shadow_contexts,
    shadow_forks,
)

# Builds the NDR of a removed message: (message row, its body, the removed recipients) -> a new
# message, or None when none may be sent.
NdrBuilder = Callable[[dict, bytes, list[dict]], mq.NewMessage | None]


# --------------------------------------------------------------------------- node facts

def recorded_config_path(db_path: Path) -> str | None:
    """The config file the node's daemon last ran with, read without changing the file (no WAL
    switch, no migration); None when the database is absent, unreadable or has none."""
    if not db_path.is_file():
        return None
    try:
        con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        try:
            row = con.execute("SELECT value FROM meta WHERE key = 'config_path'").fetchone()
        finally:
            con.close()
    except sqlite3.Error:
        return None
    return row[0] if row else None


def recorded_node_name(conn: Connection) -> str | None:
    """The node name the queue database was created for, or None when it has none."""
    row = conn.execute(meta.select().where(meta.c.key == "node_name")).mappings().first()
    return row["value"] if row and row["value"] else None


def held_under_node_name(conn: Connection) -> dict[str, int]:
    """What this queue database holds that peers know under the node's name, or that another
    node started on a copy of it would deliver a second time: queued messages (ours, and the
    shadows we hold of peers' messages: their primaries name us as the holder, we name them),
    forks of ours handed to peers hop by hop (they hold them as ours) and discard events our
    shadows have not fetched yet. The non-zero counts by what they are."""
    held = {
        "queued message(s)": conn.execute(select(func.count()).select_from(messages).where(
            messages.c.role == "primary", messages.c.state == mq.QUEUED)).scalar(),
        "shadow(s) of peers' messages": conn.execute(select(func.count()).select_from(messages).where(
            messages.c.role == "shadow", messages.c.state == mq.QUEUED)).scalar(),
        "hop-by-hop fork(s) held by peers": conn.execute(select(func.count()).select_from(shadow_forks)).scalar(),
        "discard event(s) peers have not fetched": conn.execute(
            select(func.count()).select_from(discard_events)).scalar(),
    }
    return {what: n for what, n in held.items() if n}


def adopt_node_name(conn: Connection, name: str) -> tuple[str | None, dict[str, int]]:
    """At start: the name the queue database was made by (or last run as), and, when it is not
    ``name``, what it holds under that name (``held_under_node_name``). Nothing held: ``name`` is
    recorded (a node renamed, or a copy of a drained node's data dir, starts as ``name``)."""
    recorded = recorded_node_name(conn)
    if recorded is not None and recorded.lower() == name.lower():
        return recorded, {}
    held = held_under_node_name(conn) if recorded is not None else {}
    if not held:
        conn.execute(meta.delete().where(meta.c.key == "node_name"))
        conn.execute(insert(meta).values(key="node_name", value=name))
    return recorded, held


# --------------------------------------------------------------------------- queues

def set_queue_suspended_by_name(conn: Connection, name: str, suspended: bool) -> dict | None:
    """Suspend-Queue / Resume-Queue by identity or id; the queue row (``changed``: False when it
    already was so), or None when there is none."""
    q = mq.resolve_queue(conn, name)
    if q is not None:
        q["changed"] = mq.set_queue_suspended(conn, q["id"], suspended)
    return q


def retry_queue_by_name(conn: Connection, name: str) -> dict | None:
    """Retry-Queue by identity or id; the queue row, or None when there is none. A suspended queue
    is left as it is (``changed`` False): nothing leaves it until it is resumed."""
    q = mq.resolve_queue(conn, name)
    if q is not None:
        q["changed"] = not q["suspended"]
        if q["changed"]:
            q["recipients"] = mq.retry_queue_now(conn, q["id"])
    return q


# --------------------------------------------------------------------------- messages

def messages_in_queue(conn: Connection, queue: str | None, include_done: bool, selection: Selection | None = None,
                      now: float | None = None, limit: int | None = 1000) -> list[dict] | None:
    """Primary messages, of one queue (identity, id or ``Poison``) when given, and matching
    ``selection`` when given (at most ``limit``, oldest first); None when no such queue."""
    now = time.time() if now is None else now
    ids = None
    if selection is not None and not selection.empty:
        ids = selected_ids(conn, selection, now, include_done=include_done)
    if queue is not None and queue.lower() == mq.POISON.lower():
        return mq.list_messages(conn, mq.POISON, include_done=include_done, ids=ids, limit=limit, now=now)
    qid = None
    if queue is not None:
        q = mq.resolve_queue(conn, queue)
        if q is None:
            return None
        qid = q["id"]
    return mq.list_messages(conn, qid, include_done=include_done, ids=ids, limit=limit, now=now)


# --------------------------------------------------------------------------- many messages at once
#
# A bulk command first reads the ids its selection matches (``selected_ids``), then acts on them a
# batch per transaction (``*_batch``): each batch selects again, among its ids, what still matches
# (a message delivered meanwhile is left alone) and runs the one-message action on each, so a
# removal by filter tells the shadows exactly as ``message remove ID`` does.

def selected_ids(conn: Connection, selection: Selection, now: float, include_done: bool = False,
                 limit: int | None = None) -> list[int]:
    """The ids of the messages ``selection`` matches, oldest first."""
    stmt = select(messages.c.id).where(sel.condition(selection, now, include_done)).order_by(messages.c.id)
    if limit is not None:
        stmt = stmt.limit(limit)
    return list(conn.execute(stmt).scalars())


def listed(conn: Connection, ids: Sequence[int], include_done: bool = False) -> list[dict]:
    """``message list`` rows of these messages, in id order."""
    return mq.list_messages(conn, include_done=include_done, ids=ids, limit=None)


def unknown_ids(conn: Connection, ids: Sequence[int]) -> list[int]:
    """Of ``ids``, those that are no queued message an operator command acts on."""
    found = set(conn.execute(select(messages.c.id).where(
        sel.condition(sel.Selection(ids=tuple(ids)), 0.0))).scalars())
    return [i for i in ids if i not in found]


def shadow_copies_named(conn: Connection, ids: Sequence[int]) -> dict[int, str]:
    """Of ``ids``, the queued shadow copies (not an operator command's to act on): id -> primary."""
    return dict(conn.execute(select(messages.c.id, messages.c.primary_node).where(
        messages.c.id.in_(list(ids)), messages.c.role == "shadow", messages.c.state == mq.QUEUED,
        messages.c.poisoned == 0)).all())


def _still_matching(conn: Connection, ids: Sequence[int], selection: Selection, now: float) -> list[int]:
    return list(conn.execute(select(messages.c.id).where(sel.condition(selection, now, among=ids))
                             .order_by(messages.c.id)).scalars())


def remove_batch(conn: Connection, ids: Sequence[int], selection: Selection, now: float,
                 make_ndr: NdrBuilder | None = None) -> list[tuple[dict, list[dict], tuple[int, Any] | None]]:
    """Remove-Message for the ``ids`` that still match ``selection``, each as ``remove_queued_message``."""
    out = []
    for mid in _still_matching(conn, ids, selection, now):
        result = remove_queued_message(conn, mid, now, make_ndr)
        if result is not None:
            out.append(result)
    return out


def suspend_batch(conn: Connection, ids: Sequence[int], selection: Selection, now: float) -> list[dict]:
    """Suspend-Message for the ``ids`` that still match ``selection``; their rows."""
    out = []
    for mid in _still_matching(conn, ids, selection, now):
        if suspend_message(conn, mid):
            out.append(mq.message_row(conn, mid))
    return out


def resume_batch(conn: Connection, ids: Sequence[int], selection: Selection, now: float
                 ) -> list[tuple[dict, bool]]:
    """Resume-Message for the ``ids`` that still match ``selection``: (row, released from the Poison queue)."""
    out = []
    for mid in _still_matching(conn, ids, selection, now):
        row, released, ok = resume_message(conn, mid)
        if ok:
            out.append((row, released))
    return out


def message_with_body(conn: Connection, message_id: int, now: float | None = None) -> dict | None:
    """One message's detail (recipients, shadows, status) with its ``body``; None when there is none."""
    m = mq.message_detail(conn, message_id, now)
    if m is not None:
        m["body"] = mq.body(conn, message_id)
    return m


def suspend_message(conn: Connection, message_id: int) -> bool:
    """Suspend-Message; False when no queued message has that id."""
    return mq.set_message_suspended(conn, message_id, True)


def resume_message(conn: Connection, message_id: int) -> tuple[dict | None, bool, bool]:
    """Resume-Message, also out of the Poison queue (its failure count reset).

    Returns (the message row, released from the Poison queue, resumed at all)."""
    row = mq.message_row(conn, message_id)
    released = mq.release_from_poison(conn, message_id)
    resumed = mq.set_message_suspended(conn, message_id, False)
    return row, released, resumed or released


def remove_queued_message(conn: Connection, message_id: int, now: float, make_ndr: NdrBuilder | None = None
                          ) -> tuple[dict, list[dict], tuple[int, Any] | None] | None:
    """Remove-Message: its pending recipients become Removed; with ``make_ndr``, the NDR it builds
    is queued in the same transaction.

    Returns (the message row, the removed recipients, (NDR id, NDR) or None), or None when no
    queued message has that id."""
    row = mq.message_row(conn, message_id)
    if row is None or row["state"] != mq.QUEUED:
        return None
    body = mq.body(conn, message_id)
    removed = mq.remove_message(conn, message_id, now)
    created = None
    if make_ndr is not None and body is not None and removed:
        dsn = make_ndr(row, body, removed)
        if dsn is not None:
            created = (mq.enqueue(conn, dsn), dsn)
    return row, removed, created


# --------------------------------------------------------------------------- Safety Net

def safety_net_messages(conn: Connection, roles: Sequence[str]) -> list[dict]:
    """Messages held in the Safety Net of the given roles (``primary``, ``shadow``), oldest first."""
    return [dict(r) for r in conn.execute(
        select(messages).where(messages.c.state == mq.SAFETY_NET, messages.c.role.in_(tuple(roles)))
        .order_by(messages.c.id)).mappings()]


def file_resubmit_request(conn: Connection, primary: str, destination: str, start: float, end: float,
                          now: float) -> int:
    """A shadow resubmit request, carried out by the running node once ``primary`` has been
    unreachable long enough; returns its id."""
    result = conn.execute(insert(resubmit_requests).values(
        for_primary=primary, destination=destination, start_at=start, end_at=end, created_at=now))
    return result.inserted_primary_key[0]


# --------------------------------------------------------------------------- shadows

def shadow_summary(conn: Connection) -> list[dict]:
    """Per primary this node holds shadows for: shadows queued, Shadow Safety Net copies, and its
    shadow context (last heartbeat, consecutive failures, queue database id, last error). A
    primary no longer polled (no shadow, fork or resubmit request left for it) shows no failures
    but ``sq.NOT_POLLED`` in their place: the failures of its last polls say nothing of it now (it
    may be back), and no poll will clear them."""
    polled = set(sq.primaries_to_poll(conn))
    held = dict(conn.execute(select(messages.c.primary_node, func.count()).where(
        messages.c.role == "shadow", messages.c.state == mq.QUEUED).group_by(messages.c.primary_node)).all())
    safety = dict(conn.execute(select(messages.c.primary_node, func.count()).where(
        messages.c.role == "shadow", messages.c.state == mq.SAFETY_NET).group_by(messages.c.primary_node)).all())
    ctx = {r["peer"]: dict(r) for r in conn.execute(select(shadow_contexts)).mappings()}
    out = []
    for primary in sorted(set(held) | set(safety) | set(ctx)):
        c = ctx.get(primary, {})
        stale = primary not in polled and bool(c.get("consecutive_failures") or c.get("last_error"))
        out.append({"primary": primary, "shadows": held.get(primary, 0),
                    "shadow_safety_net": safety.get(primary, 0),
                    "last_heartbeat_at": c.get("last_heartbeat_at"),
                    "consecutive_failures": 0 if stale else c.get("consecutive_failures", 0),
                    "queue_database_id": c.get("queue_database_id"),
                    "last_error": sq.NOT_POLLED if stale else c.get("last_error") or ""})
    return out


def shadow_copies(conn: Connection, primary: str, include_done: bool) -> list[dict]:
    """The shadow copies held for ``primary``, queued ones only unless ``include_done``."""
    stmt = select(messages).where(messages.c.role == "shadow",
                                  messages.c.primary_node == primary.lower()).order_by(messages.c.id)
    if not include_done:
        stmt = stmt.where(messages.c.state == mq.QUEUED)
    return [dict(r) for r in conn.execute(stmt).mappings()]


# --------------------------------------------------------------------------- metrics

def queue_gauges(conn: Connection, now: float | None = None) -> dict[str, Any]:
    """Grouped counts for the scrape-time gauges: ``queues`` (identity, recipient status, messages),
    ``shadows`` (primary, copies), ``safety_net`` (role, messages), ``not_redundant`` (redundancy
    state, messages), ``poison`` (messages held in the Poison queue), ``oldest`` (identity, the
    earliest received_at of a message waiting in it), ``poison_oldest``, ``suspended`` (identities)
    and ``contexts`` (primary, last successful heartbeat, consecutive failures)."""
    # A message an operator suspended counts as Suspended (as Get-Message shows it), not as the
    # Ready or Retry it would otherwise be: held mail is not mail waiting to go. A Ready recipient
    # waiting for its queue's next retry counts as Retry, as message list and --filter state=
    # show it (mq.waits_for_queue_retry): an alert on Retry sees a queue stuck behind a next hop
    # that is down, all of its mail, not only the message that was tried.
    now = time.time() if now is None else now
    waits = and_(recipients.c.status == mq.READY, queues.c.suspended == 0, queues.c.next_retry_at > now)
    state = case((messages.c.suspended == 1, literal(mq.SUSPENDED)), (waits, literal(mq.RETRY)),
                 else_=recipients.c.status)
    q = conn.execute(
        select(queues.c.identity, state, func.count(func.distinct(recipients.c.message_id)))
        .join(recipients, recipients.c.queue_id == queues.c.id)
        .join(messages, messages.c.id == recipients.c.message_id)
        .where(recipients.c.status.not_in(mq.TERMINAL), messages.c.role == "primary",
               messages.c.state == mq.QUEUED, messages.c.poisoned == 0)
        .group_by(queues.c.identity, state)).all()
    shadows = conn.execute(
        select(messages.c.primary_node, func.count())
        .where(messages.c.role == "shadow", messages.c.state == mq.QUEUED)
        .group_by(messages.c.primary_node)).all()
    nets = conn.execute(
        select(messages.c.role, func.count()).where(messages.c.state == mq.SAFETY_NET)
        .group_by(messages.c.role)).all()
    exposed = conn.execute(
        select(messages.c.redundancy, func.count())
        .where(messages.c.role == "primary", messages.c.state == mq.QUEUED,
               messages.c.redundancy.in_((*mq.NOT_REDUNDANT, mq.PARTIAL)))
        .group_by(messages.c.redundancy)).all()
    poison = conn.execute(select(func.count()).select_from(messages).where(
        messages.c.poisoned == 1, messages.c.state == mq.QUEUED)).scalar() or 0
    oldest = conn.execute(
        select(queues.c.identity, func.min(messages.c.received_at))
        .join(recipients, recipients.c.queue_id == queues.c.id)
        .join(messages, messages.c.id == recipients.c.message_id)
        .where(recipients.c.status.not_in(mq.TERMINAL), messages.c.role == "primary",
               messages.c.state == mq.QUEUED, messages.c.poisoned == 0)
        .group_by(queues.c.identity)).all()
    poison_oldest = conn.execute(select(func.min(messages.c.received_at)).where(
        messages.c.poisoned == 1, messages.c.state == mq.QUEUED)).scalar()
    suspended = list(conn.execute(select(queues.c.identity).where(queues.c.suspended == 1)).scalars())
    contexts = conn.execute(select(shadow_contexts.c.peer, shadow_contexts.c.last_heartbeat_at,
                                   shadow_contexts.c.consecutive_failures)).all()
    return {"queues": q, "shadows": shadows, "safety_net": nets, "not_redundant": exposed, "poison": poison,
            "oldest": oldest, "poison_oldest": poison_oldest, "suspended": suspended, "contexts": contexts}
