"""Queue operations on the queue database: enqueue, due work, outcomes, operator actions, views.

Each function takes an open SQLAlchemy connection inside a transaction and a
``now`` (epoch seconds) where time matters, so the daemon's group-commit writer
and the CLI share the same code, and tests can pin the clock. Nothing here
talks SMTP or writes tracking logs: callers log after the commit.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from sqlalchemy import and_, bindparam, delete, func, insert, or_, select, update
from sqlalchemy.engine import Connection

from transportd.queue.direct import Insert, Update, driver, placeholders
from transportd.queue.routing import PEER, NextHop
from transportd.queue.store import (delivered_to, discard_events, message_bodies, message_shadows, messages,
                                    meta, queues, recipients, shadow_forks)
from transportd.smtp import dsnparams
from transportd.smtp.dsnparams import xtext_encode

# recipient statuses
READY, RETRY, ACTIVE, DELIVERED, FAILED, REMOVED = "Ready", "Retry", "Active", "Delivered", "Failed", "Removed"
PENDING = (READY, RETRY)
TERMINAL = (DELIVERED, FAILED, REMOVED)
SUSPENDED = "Suspended"  # a view's state (queue or message an operator holds), not a recipient's
# Queued primary messages in these redundancy states have no live copy on a peer: "reshadowing"
# (promoted, or their shadow node lost its database; a new shadow is being made) and "unprotected"
# (accepted, or left, without one; the heartbeat loop retries).
NOT_REDUNDANT = ("reshadowing", "unprotected")
# Queued primary messages with fewer shadows than shadow_copies (N-way): the missing ones are
# made in later heartbeat rounds.
PARTIAL = "partial"
# message states
QUEUED, SAFETY_NET, MSG_REMOVED = "Queued", "SafetyNet", "Removed"
# The reasons of per-recipient discard events (docs/PROTOCOL.md section 4; redundancy/protocol.py's
# DELIVERED and FAILED, their wire text): ``Delivered=``/``Failed=<xtext of the address>``, handed
# out only to a shadow that asked for that kind. A longer one than MAX_RECIPIENT_REASON octets (an
# address too long for a reply line) is not made: the message's own discard covers that recipient.
RECIPIENT_DELIVERED, RECIPIENT_FAILED = "Delivered=", "Failed="
# ... and of a recipient delivered whose success notice (RFC 3461 NOTIFY=SUCCESS) is still queued:
# handed out as such only to a shadow that asked (a promotion of its copy sends the notice instead
# of delivering again), as ``Delivered=`` to one that asked for per-recipient entries alone.
RECIPIENT_NOTIFY = ("NotifyDelivered=", "NotifyRelayed=")
# ... and of a message whose delay DSN (DelayNotificationTimeout) went to the sender: not a discard
# (the shadow keeps its copy and notes the notice on it, so a promotion sends no second one),
# handed out only to a shadow that asked (redundancy/protocol.py's DELAY_NOTIFIED, its wire text).
DELAY_NOTIFIED = "DelayNotified"
MAX_RECIPIENT_REASON = 1000  # octets: a reply line stays far below the peers' 4096
# The Poison queue (Exchange's): not a next hop but the messages held with ``poisoned`` = 1.
POISON = "Poison"
# The reply prefix of every internal failure recorded on a recipient (never a 5xx: the sender's
# mail is kept and retried, or held in the Poison queue).
INTERNAL_ERROR = "451 4.3.0 internal error"


@dataclass
class NewMessage:
    network_message_id: str
    sender: str
    data: bytes
    recipients: dict[NextHop, list[str]]
    received_at: float
    expires_at: float
    message_id: str = ""
    submit_time: str = ""
    subject: str = ""
    author: str = ""  # the Sender (else From) address of its header: MSGTRK's sender-address
    client_ip: str = ""
    client_hostname: str = ""
    origin: str = "smtp"
    suppress_dsn: bool = False
    role: str = "primary"
    redundancy: str = "none"
    shadow_guid: str | None = None
    primary_node: str | None = None
    primary_internal_id: int | None = None
    primary_dbid: str | None = None
    shadow_rank: int = 1  # on a shadow: when it may take ownership (N-way)
    smtputf8: bool = False  # received with the SMTPUTF8 MAIL parameter (RFC 6531)
    body_type: str = ""     # the BODY= it was received with: "8BITMIME", "7BIT" or "" (not given)
    dsn_of: int | None = None  # a DSN: the message it reports on
    # RFC 3461 parameters as received (smtp/dsnparams.py): MAIL's RET=/ENVID=, and each
    # recipient's NOTIFY=/ORCPT= by its address in lower case.
    dsn_mail: str = ""
    dsn_rcpt: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    """The result of one delivery attempt for one recipient row."""
    recipient_id: int
    status: str  # DELIVERED | RETRY | FAILED, or READY: handed back unattempted
    reply: str = ""
    duplicate: bool = False
    # the reply is this node's own (no attempt: a next hop that cannot take the message, its body
    # gone), not one a remote server sent: a DSN names no Remote-MTA for it (RFC 3464 2.3.5)
    local: bool = False


@dataclass
class WorkItem:
    queue_id: int
    queue_identity: str
    delivery_type: str
    next_hop: str
    message_id: int
    recipient_ids: list[int] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    dsn_params: list[str] = field(default_factory=list)  # RFC 3461 NOTIFY=/ORCPT= per address, as received
    dsn_passed: bool = False  # the next hop took them (it offers DSN): its own notices follow, not ours
    # The message's row once a connector has read it to send: the outcome's tracking rows use it
    # (only fields a message never changes) instead of reading it again.
    row: dict | None = None


# --------------------------------------------------------------------------- queues

# Statements of the per-message path, run directly on the SQLite connection (queue/direct.py:
# SQLAlchemy's execute() of a prebuilt statement cost ~40 us each, SQLite's own work 2-5 us).
_QUEUE_BY_IDENTITY = "SELECT id FROM queues WHERE identity = ?"
_INSERT_MESSAGE = Insert(messages)
_INSERT_BODY = Insert(message_bodies)
_INSERT_RECIPIENTS = Insert(recipients)
_RECIPIENT_STATE = "SELECT status, attempts FROM recipients WHERE id = ?"
_UPDATE_RECIPIENT = Update(recipients)
_UPDATE_QUEUE = Update(queues)
UPDATE_MESSAGE = Update(messages)
_MESSAGE_STATE = select(messages.c.state, messages.c.dsn_of).where(messages.c.id == bindparam("b_id"))
# ``state || ''``: a message's DSNs are found by ix_messages_dsn_of. On ``state = 'Queued'`` SQLite
# (no ANALYZE statistics) may choose ix_messages_state instead and read every queued message, for
# each delivered one: 0.5 ms at 2,000 queued here, growing with the queue.
_DSN_PENDING = select(func.count()).select_from(messages).where(
    messages.c.dsn_of == bindparam("b_id"), messages.c.state.concat("") == QUEUED)
_DONE_CHECK = (
    "SELECT m.state, m.dsn_of,"
    " (SELECT count(*) FROM recipients r WHERE r.message_id = m.id"
    f" AND r.status NOT IN ({', '.join(repr(s) for s in TERMINAL)})) AS pending,"
    " (SELECT count(*) FROM shadow_forks f WHERE f.message_id = m.id) AS forks,"
    f" (SELECT count(*) FROM messages d WHERE d.dsn_of = m.id AND d.state || '' = '{QUEUED}') AS dsns_out"
    " FROM messages m WHERE m.id = ?")
"""What ``finish_if_done`` asks of a message, in one statement: its state and the message it is a
DSN of, its recipients not yet terminal, the forks a peer holds as primary, its DSNs not yet out."""
_SHADOWS_OF = "SELECT shadow_node, shadow_guid FROM message_shadows WHERE message_id = ?"
_FAILED_RECIPIENTS = select(recipients.c.address).where(recipients.c.message_id == bindparam("b_id"),
                                                        recipients.c.status == FAILED)
# Delivered recipients of a message, except those behind a fork a peer holds (its own to tell).
_DELIVERED_RECIPIENTS = select(recipients.c.address, recipients.c.dsn_params).where(
    recipients.c.message_id == bindparam("b_id"), recipients.c.status == DELIVERED,
    recipients.c.queue_id.not_in(select(shadow_forks.c.queue_id).where(shadow_forks.c.message_id == bindparam("b_id"))))
_INSERT_DISCARD = Insert(discard_events)
_DELETE_BODY = "DELETE FROM message_bodies WHERE message_id = ?"
# By their ids (the primary key): on ``status IN (...)`` SQLite may choose ix_recipients_due and read
# every pending recipient per claim (1.1 ms at 10,000 Ready here, growing with the queue).
_CLAIMABLE = "SELECT id FROM recipients WHERE id IN ({}) AND status || '' IN " + f"({', '.join(repr(s) for s in PENDING)})"
_CLAIM = "UPDATE recipients SET status = ?, {} = ? WHERE id IN ({})"


def queue_id_for(conn: Connection, hop: NextHop, now: float) -> int:
    row = driver(conn).execute(_QUEUE_BY_IDENTITY, (hop.identity,)).fetchone()
    if row is not None:
        return row[0]
    return conn.execute(insert(queues).values(
        identity=hop.identity, delivery_type=hop.delivery_type, next_hop=hop.next_hop,
        suspended=0, retry_count=0, created_at=now)).inserted_primary_key[0]


_PENDING_ROUTES = (
    "SELECT r.id, r.address, q.identity, q.suspended FROM recipients r"
    " JOIN messages m ON m.id = r.message_id JOIN queues q ON q.id = r.queue_id"
    f" WHERE r.status IN ({', '.join(repr(s) for s in PENDING)}) AND m.state = '{QUEUED}'"
    " AND q.delivery_type != ?")


def reroute_queued(conn: Connection, route: Callable[[str], NextHop], now: float
                   ) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
    """Waiting recipients (Ready, Retry) of queued messages, primary copies and shadows alike,
    moved to the queue ``route`` gives them now, where that is another one: a routing change
    (a new smart host, send connector or mailbox database owner) applies to mail already queued,
    as Postfix resolves a deferred message's next hop again at each attempt and Exchange's
    ``Retry-Queue -Resubmit`` routes a queue's messages again. A moved recipient is due at once
    (its new next hop was never tried). Left where they are: recipients in a delivery attempt,
    those in a queue an operator suspended (the hold is the queue's; returned apart, so the
    caller says so), and those in a queue to a peer of the boundary (a redirect's drain, or a
    mailbox database the peer owns: the peer routes them by its own configuration). A recipient
    ``route`` cannot route (ValueError) stays. Returns ({(old queue, new queue): recipients
    moved}, {(old queue, new queue): recipients held in a suspended queue})."""
    moved: dict[tuple[str, str], int] = {}
    held: dict[tuple[str, str], int] = {}
    hops: dict[str, NextHop | None] = {}
    by_hop: dict[NextHop, list[int]] = {}
    for rid, address, identity, suspended in driver(conn).execute(_PENDING_ROUTES, (PEER,)).fetchall():
        if address not in hops:
            try:
                hops[address] = route(address)
            except ValueError:
                hops[address] = None
        hop = hops[address]
        if hop is None or hop.identity == identity:
            continue
        counts = held if suspended else moved
        counts[(identity, hop.identity)] = counts.get((identity, hop.identity), 0) + 1
        if not suspended:
            by_hop.setdefault(hop, []).append(rid)
    for hop, ids in by_hop.items():
        qid = queue_id_for(conn, hop, now)
        for i in range(0, len(ids), 500):  # SQLite's limit of bound parameters
            conn.execute(update(recipients).where(recipients.c.id.in_(ids[i:i + 500]))
                         .values(queue_id=qid, next_retry_at=0.0))
    return moved, held


def resolve_queue(conn: Connection, name: str) -> dict | None:
    """A queue by identity (in any case: host and domain names are) or numeric id."""
    cond = func.lower(queues.c.identity) == name.lower()
    if name.isdigit():
        cond = or_(cond, queues.c.id == int(name))
    row = conn.execute(select(queues).where(cond)).mappings().first()
    return dict(row) if row else None


# --------------------------------------------------------------------------- enqueue

def enqueue(conn: Connection, msg: NewMessage) -> int:
    """Insert a message, its body and one recipient row per (recipient, next hop)."""
    mid = _INSERT_MESSAGE.run(conn, dict(
        network_message_id=msg.network_message_id, message_id=msg.message_id,
        submit_time=msg.submit_time, sender=msg.sender, subject=msg.subject[:500], author=msg.author,
        size=len(msg.data), received_at=msg.received_at, expires_at=msg.expires_at,
        client_ip=msg.client_ip, client_hostname=msg.client_hostname, origin=msg.origin,
        role=msg.role, state=QUEUED, suspended=0, suppress_dsn=int(msg.suppress_dsn),
        shadow_guid=msg.shadow_guid, primary_node=msg.primary_node,
        primary_internal_id=msg.primary_internal_id, redundancy=msg.redundancy,
        primary_dbid=msg.primary_dbid, shadow_rank=msg.shadow_rank, smtputf8=int(msg.smtputf8), body_type=msg.body_type, dsn_of=msg.dsn_of,
        dsn_params=msg.dsn_mail,
    ))
    _INSERT_BODY.run(conn, {"message_id": mid, "data": msg.data})
    rows = []
    for hop, addrs in msg.recipients.items():
        qid = queue_id_for(conn, hop, msg.received_at)
        for a in addrs:
            rows.append({"message_id": mid, "address": a, "queue_id": qid, "status": READY,
                         "attempts": 0, "next_retry_at": 0.0,
                         "dsn_params": msg.dsn_rcpt.get(a.lower(), "") if msg.dsn_rcpt else ""})
    if rows:
        _INSERT_RECIPIENTS.run_many(conn, rows)
    return mid


_BODY = "SELECT data FROM message_bodies WHERE message_id = ?"
_MESSAGE_ROW = "SELECT * FROM messages WHERE id = ?"


def body(conn: Connection, message_id: int) -> bytes | None:
    row = driver(conn).execute(_BODY, (message_id,)).fetchone()
    return row[0] if row else None


# Delayed acknowledgement (shadow redundancy 2010) is bypassed for a queue holding more than this.
ACK_QUEUE_LIMIT = 100


def acknowledgement_state(conn: Connection, message_id: int, now: float,
                          promoting: set[int] | None = None) -> str | None:
    """Delayed acknowledgement (shadow redundancy 2010): why a held 250 may go now, or None to wait.

    ``Delivered``: no recipient is pending any more (delivered to every next hop, failed, or handed
    to a peer that made it redundant hop by hop). The bypasses of the 2010 seed: ``QueueRetry``
    (a target queue is in Retry, as ``queue list`` shows it: its next retry time not yet come; or
    the message's recipients entered it since the message was added: an earlier failure whose
    retry time has passed is not Retry, the next attempt will tell), ``QueueSuspended``,
    ``QueueLength`` (a target queue holds more than ACK_QUEUE_LIMIT messages). A suspended message
    changes nothing.

    ``promoting`` (shadow redundancy promotion on, 2010 SP1): the ids of the queues that went past
    ACK_QUEUE_LIMIT, kept by the caller between calls. The seed's SP1 column: once a queue has
    more than 100 messages, promotion goes on "for subsequent messages until the queue clears",
    so such a queue stays ``QueueLength`` while it holds any message besides this one, and leaves
    the set once it holds none. Without it (skipping the delay), only more than 100 counts ("until
    the target queue size falls below 100")."""
    rows = conn.execute(
        select(recipients.c.status, recipients.c.queue_id, queues.c.suspended, queues.c.retry_count,
               queues.c.next_retry_at)
        .join(queues, recipients.c.queue_id == queues.c.id).where(recipients.c.message_id == message_id)).all()
    pending = [r for r in rows if r.status not in TERMINAL]
    if not pending:
        return "Delivered"
    if any(r.suspended for r in pending):
        return "QueueSuspended"
    if any(r.status == RETRY or (r.next_retry_at or 0.0) > now for r in pending):  # Retry as Get-Queue says it
        return "QueueRetry"
    targets = {r.queue_id for r in pending}
    held = dict(conn.execute(select(recipients.c.queue_id, func.count(func.distinct(recipients.c.message_id))).where(
        recipients.c.queue_id.in_(targets), recipients.c.status.in_((READY, RETRY, ACTIVE)))
        .group_by(recipients.c.queue_id)).all())
    over = False
    for queue_id in targets:
        count = held.get(queue_id, 0)
        if count > ACK_QUEUE_LIMIT:
            over = True
            if promoting is not None:
                promoting.add(queue_id)
        elif promoting is not None and queue_id in promoting:
            if count > 1:  # other messages than this one still wait there
                over = True
            else:
                promoting.discard(queue_id)
    return "QueueLength" if over else None


def waiting_recipients(conn: Connection, message_ids: Sequence[int]) -> dict[int, list[str]]:
    """The recipients still to deliver (Ready, Retry, Active) of each message, in their order."""
    out: dict[int, list[str]] = {m: [] for m in message_ids}
    ids = list(message_ids)
    for i in range(0, len(ids), 500):  # SQLite's limit of bound parameters
        for mid, address in conn.execute(
                select(recipients.c.message_id, recipients.c.address)
                .where(recipients.c.message_id.in_(ids[i:i + 500]), recipients.c.status.not_in(TERMINAL))
                .order_by(recipients.c.id)).all():
            out[mid].append(address)
    return out


def message_row(conn: Connection, message_id: int) -> dict | None:
    cur = driver(conn).execute(_MESSAGE_ROW, (message_id,))
    row = cur.fetchone()
    return dict(zip((d[0] for d in cur.description), row)) if row else None


# --------------------------------------------------------------------------- crash recovery

def recover_after_restart(conn: Connection) -> int:
    """Recipients left Active by a crash become Ready again; returns how many.

    A message whose shadow outcome was never recorded (a crash between the commit and the
    peer's answer) is delivered: whether its 250 went out is unknown, so it must not be lost.
    """
    conn.execute(update(messages).where(messages.c.redundancy == "pending").values(redundancy="unknown"))
    # A promoted or re-protected copy whose new shadow was being made: the heartbeat loop retries it.
    conn.execute(update(messages).where(messages.c.redundancy == "reshadowing").values(redundancy="unprotected"))
    # Discard events handed out on sessions that never reached QUIT are handed out again.
    conn.execute(update(discard_events).where(discard_events.c.sent_token.is_not(None)).values(sent_token=None))
    return conn.execute(update(recipients).where(recipients.c.status == ACTIVE)
                        .values(status=READY, next_retry_at=0.0)).rowcount


# --------------------------------------------------------------------------- poison messages

_POISON_STATE = select(messages.c.poison_count, messages.c.poisoned).where(messages.c.id == bindparam("b_id"))
_RESET_POISON_COUNT = "UPDATE messages SET poison_count = 0 WHERE id = ? AND poison_count > 0"


# meta key written by a clean stop; its absence at start means the node crashed.
CLEAN_STOP = "clean_stop"


def remember_config_path(conn: Connection, path: str) -> None:
    """The config file the daemon runs with (the CLI given only --data-dir reads it from here)."""
    conn.execute(meta.delete().where(meta.c.key == "config_path"))
    conn.execute(meta.insert().values(key="config_path", value=path))


def mark_clean_stop(conn: Connection) -> int:
    """The stop was clean (the next start counts no crash). Recipients whose delivery the stop
    cut (its grace ran out) are Ready again now, not at the next start: the stopped node's queue
    shows them waiting, not in a delivery. Returns how many."""
    conn.execute(meta.insert().values(key=CLEAN_STOP, value="1"))
    return conn.execute(update(recipients).where(recipients.c.status == ACTIVE)
                        .values(status=READY, next_retry_at=0.0)).rowcount


def recover_at_start(conn: Connection, poison_threshold: int | None,
                     handled: Iterable[int] = ()) -> tuple[list[dict], int]:
    """Start-up: a crash (no clean-stop mark) counts against the messages the node was handling
    in a step that could kill it (``handled``, node/handling.py; the Poison queue); recipients
    left Active are Ready again. Returns (messages moved to the Poison queue now, recipients
    made Ready)."""
    crashed = conn.execute(meta.select().where(meta.c.key == CLEAN_STOP)).first() is None
    conn.execute(meta.delete().where(meta.c.key == CLEAN_STOP))
    poisoned = count_crashes(conn, poison_threshold, handled) if crashed else []
    return poisoned, recover_after_restart(conn)


def count_internal_failure(conn: Connection, message_id: int, threshold: int | None) -> bool:
    """One more internal failure while handling a message; at ``threshold`` (None: detection off)
    it is moved to the Poison queue. Returns True when it was moved just now."""
    row = conn.execute(_POISON_STATE, {"b_id": message_id}).first()
    if row is None or row.poisoned:
        return False
    count = row.poison_count + 1
    poisoned = threshold is not None and count >= threshold
    UPDATE_MESSAGE.run(conn, {"poison_count": count, "poisoned": int(poisoned)}, message_id)
    return poisoned


def reset_poison_count(conn: Connection, message_id: int) -> None:
    """Handled without an internal failure: earlier failures (or crashes) no longer count."""
    driver(conn).execute(_RESET_POISON_COUNT, (message_id,))


def count_crashes(conn: Connection, threshold: int | None, handled: Iterable[int]) -> list[dict]:
    """At start after a crash: each message the node was handling in a step that could kill it
    counts one internal failure, as Exchange counts a crash against the message being processed,
    so a message that kills the daemon cannot crash-loop it. Messages merely being delivered
    (waiting on a next hop) are not suspects. Returns the messages moved to the Poison queue now."""
    moved = [m for m in dict.fromkeys(handled) if count_internal_failure(conn, m, threshold)]
    return [r for r in (message_row(conn, m) for m in moved) if r]


def release_from_poison(conn: Connection, message_id: int) -> bool:
    """Resume-Message on a poison message: back to its queues, its failure count forgotten."""
    return driver(conn).execute(_RELEASE_POISON, (message_id, QUEUED)).rowcount > 0


@contextlib.contextmanager
def savepoint(conn: Connection, name: str = "one_message") -> Iterator[None]:
    """Undo only this block's changes when it raises (one message inside a job of many)."""
    raw = driver(conn)
    raw.execute(f"SAVEPOINT {name}")
    try:
        yield
    except BaseException:
        raw.execute(f"ROLLBACK TO SAVEPOINT {name}")
        raw.execute(f"RELEASE SAVEPOINT {name}")
        raise
    raw.execute(f"RELEASE SAVEPOINT {name}")


# --------------------------------------------------------------------------- orphaned transient states

def release_orphans(conn: Connection, now: float, *, active_owned: set[int], pending_owned: set[int],
                    active_grace: float, pending_grace: float) -> tuple[int, int]:
    """Transient states whose owner is gone, back to states the loops take, without a restart:
    recipients left Active (an outcome that could not be recorded) become Ready; messages left
    ``pending`` (a shadow outcome that could not be recorded) become ``unknown`` and deliverable,
    as after a restart. ``*_owned``: ids this process is working on now (left alone)."""
    stale = [r for r in conn.execute(select(recipients.c.id).where(
        recipients.c.status == ACTIVE, recipients.c.last_attempt_at < now - active_grace)).scalars()
        if r not in active_owned]
    if stale:
        driver(conn).execute(_CLAIM.format("next_retry_at", placeholders(len(stale))), (READY, 0.0, *stale))
    pending = [m for m in conn.execute(select(messages.c.id).where(
        messages.c.redundancy == "pending", messages.c.received_at < now - pending_grace)).scalars()
        if m not in pending_owned]
    if pending:
        conn.execute(update(messages).where(messages.c.id.in_(pending)).values(redundancy="unknown"))
    return len(stale), len(pending)


# --------------------------------------------------------------------------- scheduling

# Run on every scheduler tick (each accepted message wakes the scheduler): built once.
# Fair scheduling (as Postfix's qmgr across destinations): the queues with due work are found by
# one index probe each, then each queue gives at most its own quota of recipients, so one large or
# slow queue can neither fill a fetch nor make it cost more than its quota.
_DUE_QUEUES = (
    select(queues.c.id, queues.c.identity, queues.c.delivery_type, queues.c.next_hop)
    .where(queues.c.suspended == 0,
           or_(queues.c.next_retry_at.is_(None), queues.c.next_retry_at <= bindparam("b_now")),
           select(recipients.c.id).where(recipients.c.queue_id == queues.c.id, recipients.c.status.in_(PENDING),
                                         recipients.c.next_retry_at <= bindparam("b_now")).exists())
    .order_by(queues.c.id)
)
_DUE_IN_QUEUE = (
    select(recipients.c.id, recipients.c.address, recipients.c.message_id, recipients.c.dsn_params)
    .join(messages, messages.c.id == recipients.c.message_id)
    .where(recipients.c.queue_id == bindparam("b_qid"), recipients.c.status.in_(PENDING),
           recipients.c.next_retry_at <= bindparam("b_now"),
           messages.c.suspended == 0, messages.c.state == QUEUED, messages.c.role == "primary",
           messages.c.redundancy != "pending", messages.c.poisoned == 0)
    .limit(bindparam("b_limit"))
)


def due_work(conn: Connection, now: float, limit: int = 500, exclude: Iterable[int] = (),
             quota: Callable[[int], int] | None = None, start: int = 0) -> list[WorkItem]:
    """Pending recipients whose retry time has come, in unsuspended messages and queues.

    Queue by queue, round-robin from the ``start``-th due queue; each queue gives at most
    ``quota(queue id)`` recipients (default ``limit``; 0 skips the queue without reading it),
    in the order they were queued. Grouped per (queue, message).
    """
    excluded = set(exclude)
    due = conn.execute(_DUE_QUEUES, {"b_now": now}).all()
    if due:
        k = start % len(due)
        due = due[k:] + due[:k]
    out: list[WorkItem] = []
    for q in due:
        n = limit if quota is None else quota(q.id)
        if n <= 0:
            continue
        items: dict[int, WorkItem] = {}
        for r in conn.execute(_DUE_IN_QUEUE, {"b_qid": q.id, "b_now": now, "b_limit": n}):
            if r.id in excluded:
                continue
            item = items.get(r.message_id)
            if item is None:
                item = items[r.message_id] = WorkItem(q.id, q.identity, q.delivery_type, q.next_hop, r.message_id)
            item.recipient_ids.append(r.id)
            item.addresses.append(r.address)
            item.dsn_params.append(r.dsn_params)
        out.extend(items.values())
    return out


def mark_active(conn: Connection, recipient_ids: Sequence[int], now: float) -> list[int]:
    """Claim pending recipients for sending; returns the ids actually claimed."""
    if not recipient_ids:
        return []
    raw = driver(conn)
    claimed = [r[0] for r in raw.execute(_CLAIMABLE.format(placeholders(len(recipient_ids))), list(recipient_ids))]
    if claimed:
        raw.execute(_CLAIM.format("last_attempt_at", placeholders(len(claimed))), (ACTIVE, now, *claimed))
    return claimed


def expired_recipients(conn: Connection, now: float, limit: int = 1000) -> list[dict]:
    """Pending recipients of expired messages, at most ``limit`` (the rest at the next pass)."""
    stmt = (select(recipients.c.id, recipients.c.address, recipients.c.message_id,
                   recipients.c.last_error, recipients.c.dsn_params)
            .join(messages, messages.c.id == recipients.c.message_id)
            .where(recipients.c.status.in_(PENDING), messages.c.expires_at <= now,
                   messages.c.state == QUEUED, messages.c.role == "primary", messages.c.poisoned == 0)
            .limit(limit))
    return [dict(r) for r in conn.execute(stmt).mappings()]


def delayed_messages(conn: Connection, now: float, timeout: float, limit: int = 100) -> list[dict]:
    """Messages owed a delay DSN: queued (as primary, not held) since before ``now - timeout`` with
    a recipient still waiting in Retry, a sender to tell, and none sent yet. With their waiting
    recipients (address, last error, DSN parameters, last attempt)."""
    rows = [dict(r) for r in conn.execute(select(messages).where(
        messages.c.state == QUEUED, messages.c.role == "primary", messages.c.poisoned == 0,
        messages.c.suspended == 0, messages.c.delay_dsn_at.is_(None), messages.c.received_at <= now - timeout,
        messages.c.sender != "", messages.c.origin != "dsn", messages.c.suppress_dsn == 0,
        select(recipients.c.id).where(recipients.c.message_id == messages.c.id,
                                      recipients.c.status == RETRY).exists())
        .order_by(messages.c.id).limit(limit)).mappings()]
    for m in rows:
        m["waiting"] = [dict(r) for r in conn.execute(select(
            recipients.c.address, recipients.c.last_error, recipients.c.dsn_params,
            recipients.c.last_attempt_at).where(
            recipients.c.message_id == m["id"], recipients.c.status == RETRY)).mappings()]
    return rows


def record_delay_dsn(conn: Connection, message_id: int, dsn: NewMessage | None, now: float) -> int | None:
    """A delay DSN was sent for ``message_id`` (never again); returns the DSN's id, if one was made.
    Its shadows are told in the same commit (``tell_delay_notified``): a promotion of theirs sends
    none again (one was due, made or not needed: the same decision)."""
    UPDATE_MESSAGE.run(conn, {"delay_dsn_at": now}, message_id)
    tell_delay_notified(conn, message_id, now)
    return enqueue(conn, dsn) if dsn is not None else None


def tell_delay_notified(conn: Connection, message_id: int, now: float,
                        shadows: Iterable[tuple[str, str]] | None = None) -> int:
    """One ``DelayNotified`` event for each shadow (node, GUID) of ``message_id`` (default: all its
    shadows): its delay notice is out, so the shadow notes it on its copy. Returns how many."""
    told = list(driver(conn).execute(_SHADOWS_OF, (message_id,)).fetchall() if shadows is None else shadows)
    for node, guid in told:
        _INSERT_DISCARD.run(conn, {"shadow_node": node, "shadow_guid": guid, "created_at": now,
                                   "reason": DELAY_NOTIFIED})
    return len(told)


def retry_delay(attempt: int, interval: float, count: int, long_interval: float) -> float:
    """Exchange's schedule: ``count`` retries ``interval`` apart, then ``long_interval``."""
    return interval if attempt <= count else long_interval


def record_outcomes(conn: Connection, outcomes: Sequence[Outcome], now: float, *,
                    retry_interval: float, retry_count: int, long_interval: float, ready_delay: float = 0.0) -> None:
    """Write each recipient's result; a recipient no longer Active (removed meanwhile) is left alone.
    READY hands a recipient back unattempted: due again after ``ready_delay``, no attempt counted."""
    raw = driver(conn)
    for o in outcomes:
        row = raw.execute(_RECIPIENT_STATE, (o.recipient_id,)).fetchone()
        if row is None or row[0] != ACTIVE:
            continue
        attempts = row[1] + 1
        if o.status == READY:
            values = {"status": READY, "attempts": row[1], "next_retry_at": now + ready_delay, "last_error": o.reply}
        elif o.status == RETRY:
            delay = retry_delay(attempts, retry_interval, retry_count, long_interval)
            values = dict(status=RETRY, attempts=attempts, next_retry_at=now + delay, last_error=o.reply)
        elif o.status == DELIVERED:
            values = dict(status=DELIVERED, attempts=attempts, completed_at=now, last_error=None)
        else:
            values = dict(status=FAILED, attempts=attempts, completed_at=now, last_error=o.reply)
        _UPDATE_RECIPIENT.run(conn, values, o.recipient_id)


def queue_attempt_result(conn: Connection, queue_id: int, now: float, *, error: str | None,
                         retry_interval: float, retry_count: int, long_interval: float) -> float | None:
    """Record a connection-level result on the queue; returns the next retry time on failure.

    A failure while the queue already waits for its next retry is one of the same round: the
    sessions opened in parallel to that next hop (up to max_per_domain_outbound_connections) that
    fail together are one connection failure, not one each, so a blip of a few seconds does not
    spend every quick retry (TransientFailureRetryCount) at once and hold the queue for the long
    interval. Only its last error is recorded then."""
    if error is None:
        _UPDATE_QUEUE.run(conn, {"retry_count": 0, "next_retry_at": None, "last_error": None,
                                 "last_attempt_at": now}, queue_id)
        return None
    row = conn.execute(select(queues.c.retry_count, queues.c.next_retry_at).where(queues.c.id == queue_id)).first()
    if row is not None and row.next_retry_at is not None and row.next_retry_at > now:
        conn.execute(update(queues).where(queues.c.id == queue_id).values(last_error=error[:1000], last_attempt_at=now))
        return row.next_retry_at
    count = ((row.retry_count if row is not None else 0) or 0) + 1
    nxt = now + retry_delay(count, retry_interval, retry_count, long_interval)
    conn.execute(update(queues).where(queues.c.id == queue_id).values(
        retry_count=count, next_retry_at=nxt, last_error=error[:1000], last_attempt_at=now))
    return nxt


# What ``finish_if_done`` did: nothing (0, false), finished the message and told its shadows to
# discard it, or finished it while a DSN about it is not out yet (its shadows stay to protect it).
FINISHED, FINISHED_SHADOWS_KEPT = 1, 2


def finish_if_done(conn: Connection, message_id: int, now: float, safety_net_hold: float) -> int:
    """A message with every recipient terminal moves to the Primary Safety Net (or is dropped);
    0 when it is not done, else FINISHED or FINISHED_SHADOWS_KEPT."""
    raw = driver(conn)
    row = raw.execute(_DONE_CHECK, (message_id,)).fetchone()
    if row is None:
        raise LookupError(f"message {message_id} is not in the queue database")
    state, dsn_of, pending, forks, dsns_out = row
    if pending:
        return 0
    if forks:
        return 0  # a peer holds a fork as primary: we keep our copy until its discard
    if state != QUEUED:
        return 0
    # The message is processed: one discard event per shadow context (docs/PROTOCOL.md section 4),
    # unless a DSN about it is not out yet: its shadows stay until then (a DSN is protected by
    # them: if this node is lost first, the promoted copy fails again and makes the DSN again).
    if not dsns_out:
        _discard_shadows_of(conn, message_id, now)
    if safety_net_hold > 0:
        UPDATE_MESSAGE.run(conn, {"state": SAFETY_NET, "completed_at": now,
                                  "safety_net_until": now + safety_net_hold}, message_id)
    else:
        UPDATE_MESSAGE.run(conn, {"state": MSG_REMOVED, "completed_at": now}, message_id)
        raw.execute(_DELETE_BODY, (message_id,))
    if dsn_of is not None:
        _dsn_out(conn, dsn_of, now)
    return FINISHED_SHADOWS_KEPT if dsns_out else FINISHED


def _discard_shadows_of(conn: Connection, message_id: int, now: float) -> None:
    for node, guid in driver(conn).execute(_SHADOWS_OF, (message_id,)).fetchall():
        _INSERT_DISCARD.run(conn, {"shadow_node": node, "shadow_guid": guid, "created_at": now})


def _dsn_out(conn: Connection, message_id: int, now: float) -> None:
    """A DSN about ``message_id`` left the queue (processed, or removed). Once none is left, the
    message's shadows go if it is done; if it still waits, they learn the recipients it failed, and
    that those delivered with a notice of success owed are done (``tell_shadows_notified``)."""
    parent = conn.execute(_MESSAGE_STATE, {"b_id": message_id}).first()
    if parent is None or conn.execute(_DSN_PENDING, {"b_id": message_id}).scalar():
        return
    if parent.state != QUEUED:
        _discard_shadows_of(conn, message_id, now)
    else:
        tell_shadows_failed(conn, message_id, now)
        tell_shadows_notified(conn, message_id, now)


def tell_shadows_notified(conn: Connection, message_id: int, now: float) -> int:
    """Per-recipient discard events (``Delivered=``) for the shadows of ``message_id``, once no DSN
    about it is queued, for its delivered recipients that asked for a notice of success (RFC 3461
    NOTIFY=SUCCESS): they were told ``NotifyDelivered=``/``NotifyRelayed=`` (a promotion sends the
    notice), and the notice is out now. One told before (or whose notice a next hop sent) comes
    again: a no-op for the shadow. Returns how many."""
    if conn.execute(_DSN_PENDING, {"b_id": message_id}).scalar():
        return 0
    addresses = [a for a, params in conn.execute(_DELIVERED_RECIPIENTS, {"b_id": message_id}).all()
                 if dsnparams.wants(params or "", dsnparams.SUCCESS)]
    return _tell_shadows(conn, message_id, now, RECIPIENT_DELIVERED, addresses)


def _tell_shadows(conn: Connection, message_id: int, now: float, kind: str, addresses: Iterable[str]) -> int:
    """One per-recipient discard event (``kind`` and the address) per shadow of ``message_id`` and
    address (one too long for a reply line is left to the message's own discard)."""
    reasons = [r for r in dict.fromkeys(kind + xtext_encode(a) for a in addresses) if len(r) <= MAX_RECIPIENT_REASON]
    if not reasons:
        return 0
    n = 0
    for node, guid in driver(conn).execute(_SHADOWS_OF, (message_id,)).fetchall():
        for reason in reasons:
            _INSERT_DISCARD.run(conn, {"shadow_node": node, "shadow_guid": guid, "created_at": now,
                                       "reason": reason})
            n += 1
    return n


def tell_shadows_failed(conn: Connection, message_id: int, now: float,
                        addresses: Iterable[str] | None = None) -> int:
    """Per-recipient discard events (``Failed=``) for the shadows of ``message_id``: ``addresses``
    (without them, every recipient of it that failed) are finished here, so a promotion of theirs
    neither tries them again nor sends a second DSN. None while a DSN about the message is still
    queued: its shadows protect that DSN (a promotion fails the recipient again and makes it
    again), and the DSN's end tells them instead (``_dsn_out``). A recipient may be told twice
    (each time a message's last DSN leaves); a shadow takes that as a no-op. Returns how many."""
    if conn.execute(_DSN_PENDING, {"b_id": message_id}).scalar():
        return 0
    if addresses is None:
        addresses = conn.execute(_FAILED_RECIPIENTS, {"b_id": message_id}).scalars().all()
    return _tell_shadows(conn, message_id, now, RECIPIENT_FAILED, addresses)


PURGE_BATCH = 1000  # Safety Net copies dropped per transaction (the writer serves others between)


def purge_expired(conn: Connection, now: float, duplicate_window: float) -> tuple[int, int]:
    """Drop Safety Net copies past their hold time (at most PURGE_BATCH: a return of that many
    says more may wait) and DeliveredTo rows past the window."""
    ids = conn.execute(select(messages.c.id).where(
        or_(and_(messages.c.state == SAFETY_NET, messages.c.safety_net_until <= now),
            messages.c.state == MSG_REMOVED)).limit(PURGE_BATCH)).scalars().all()
    if ids:
        conn.execute(delete(message_shadows).where(message_shadows.c.message_id.in_(ids)))
        conn.execute(delete(recipients).where(recipients.c.message_id.in_(ids)))
        conn.execute(delete(message_bodies).where(message_bodies.c.message_id.in_(ids)))
        conn.execute(delete(messages).where(messages.c.id.in_(ids)))
    n_dup = conn.execute(delete(delivered_to).where(
        delivered_to.c.delivered_at < now - duplicate_window)).rowcount
    return len(ids), n_dup


# Exchange removes a delivery queue once it has been empty and idle for QueueMaxIdleTime and makes
# it again when mail for its next hop comes: a node that sent to 10,000 domains kept 10,000 rows
# here, each one scanned by every due-queue probe. Removed here: a queue no recipient row references
# (any status: the recipients of Safety Net and shadow copies keep theirs), no fork a peer holds
# (shadow_forks.queue_id) names, not held by an operator (a suspended queue stays listed), and
# idle since its last attempt (else since it was made). One statement: a recipient inserted into
# the queue by another transaction is either seen here or finds it gone and makes it again
# (``queue_id_for``); ids are never reused (AUTOINCREMENT), so nothing can point at a new queue by
# an old id. ``NOT IN`` reads shadow_forks once per statement (it has no index by queue).
_REMOVE_IDLE_QUEUES = (
    "DELETE FROM queues WHERE id IN (SELECT q.id FROM queues q WHERE q.suspended = 0"
    " AND coalesce(q.last_attempt_at, q.created_at) <= ?"
    " AND NOT EXISTS (SELECT 1 FROM recipients r WHERE r.queue_id = q.id)"
    " AND q.id NOT IN (SELECT f.queue_id FROM shadow_forks f)"
    " ORDER BY q.id LIMIT ?) RETURNING identity")


def remove_idle_queues(conn: Connection, now: float, max_idle: float, limit: int = 1000) -> list[str]:
    """Delivery queues empty (no recipient row, no fork a peer holds), not suspended and idle for
    ``max_idle`` seconds (*QueueMaxIdleTime*): removed, at most ``limit`` per call; returns their
    identities. Mail for the same next hop makes the queue again."""
    return [r[0] for r in driver(conn).execute(_REMOVE_IDLE_QUEUES, (now - max_idle, limit)).fetchall()]


# --------------------------------------------------------------------------- duplicate detection

def legacy_delivered_to(conn: Connection, limit: int = 10_000) -> list[tuple[str, str, str, float]]:
    """DeliveredTo rows an older version kept in the queue database (duplicate detection now lives
    with the mailbox store, queue/delivered.py): the daemon moves them there at start."""
    return [tuple(r) for r in conn.execute(select(
        delivered_to.c.recipient, delivered_to.c.message_id, delivered_to.c.submit_time,
        delivered_to.c.delivered_at).limit(limit)).all()]


def drop_legacy_delivered_to(conn: Connection, rows: Sequence[tuple[str, str, str, float]]) -> None:
    """Forget the rows once the mailbox store's records hold them."""
    for recipient, message_id, submit_time, _ in rows:
        conn.execute(delete(delivered_to).where(
            delivered_to.c.recipient == recipient, delivered_to.c.message_id == message_id,
            delivered_to.c.submit_time == submit_time))


# --------------------------------------------------------------------------- operator actions

def set_queue_suspended(conn: Connection, queue_id: int, suspended: bool) -> bool:
    """Suspend-Queue / Resume-Queue; False when the queue already was so."""
    return conn.execute(update(queues).where(queues.c.id == queue_id, queues.c.suspended == int(not suspended))
                        .values(suspended=int(suspended))).rowcount > 0


def retry_queue_now(conn: Connection, queue_id: int) -> int:
    """Retry-Queue: forget the queue's back-off and make its pending recipients due now; returns
    how many, counted as ``list_queues`` counts a queue's mail: recipients of this node's queued
    primary copies that are neither suspended nor held in the Poison queue (the recipients of
    shadow copies and of Safety Net copies keep their rows, untouched: nothing here delivers them)."""
    conn.execute(update(queues).where(queues.c.id == queue_id).values(next_retry_at=None))
    deliverable = select(messages.c.id).where(messages.c.role == "primary", messages.c.state == QUEUED,
                                             messages.c.suspended == 0, messages.c.poisoned == 0)
    return conn.execute(update(recipients).where(
        recipients.c.queue_id == queue_id, recipients.c.status.in_(PENDING),
        recipients.c.message_id.in_(deliverable)).values(next_retry_at=0.0)).rowcount


def set_message_suspended(conn: Connection, message_id: int, suspended: bool) -> bool:
    """Suspend or resume a queued message; False when it is not queued or already so."""
    return driver(conn).execute(_SET_SUSPENDED, (int(suspended), message_id, QUEUED, int(not suspended))).rowcount > 0


_NOT_TERMINAL = f"status NOT IN ({', '.join('?' * len(TERMINAL))})"
_PENDING_OF = f"SELECT id, address FROM recipients WHERE message_id = ? AND {_NOT_TERMINAL} ORDER BY id"
_REMOVE_PENDING = (f"UPDATE recipients SET status = ?, completed_at = ?, last_error = ? "
                   f"WHERE message_id = ? AND {_NOT_TERMINAL}")
_MARK_REMOVED = "UPDATE messages SET state = ?, completed_at = ? WHERE id = ?"
_DELETE_FORKS = "DELETE FROM shadow_forks WHERE message_id = ?"
_SET_SUSPENDED = "UPDATE messages SET suspended = ? WHERE id = ? AND state = ? AND suspended = ?"
_RELEASE_POISON = "UPDATE messages SET poisoned = 0, poison_count = 0 WHERE id = ? AND state = ? AND poisoned = 1"


def remove_message(conn: Connection, message_id: int, now: float) -> list[dict]:
    """Remove-Message: pending recipients become Removed; returns them (for the NDR and DROP)."""
    # On the driver connection, as the per-message paths of delivery: building these statements
    # with SQLAlchemy was ~2/3 of a removal's time (a bulk removal holds the writer turn for it).
    raw = driver(conn)
    pending = [{"id": i, "address": a} for i, a in raw.execute(_PENDING_OF, (message_id, *TERMINAL)).fetchall()]
    raw.execute(_REMOVE_PENDING, (REMOVED, now, "Removed by administrator", message_id, *TERMINAL))
    raw.execute(_MARK_REMOVED, (MSG_REMOVED, now, message_id))
    raw.execute(_DELETE_BODY, (message_id,))
    # Its shadows are told (a later promotion must not deliver it): one discard event per shadow,
    # DeletedByAdmin. A fork a peer took as primary is released here (the peer delivers it).
    for node, guid in raw.execute(_SHADOWS_OF, (message_id,)).fetchall():
        _INSERT_DISCARD.run(conn, {"shadow_node": node, "shadow_guid": guid, "created_at": now,
                                   "reason": "DeletedByAdmin"})
    raw.execute(_DELETE_FORKS, (message_id,))
    # A DSN removed: the message it reported on no longer waits for it to keep its shadows (nor
    # to tell them of the recipients it failed).
    dsn_of = conn.execute(_MESSAGE_STATE, {"b_id": message_id}).one().dsn_of
    if dsn_of is not None:
        _dsn_out(conn, dsn_of, now)
    return [dict(r) for r in pending]


# --------------------------------------------------------------------------- views (CLI)

def queue_state(q: dict[str, Any], active: int, now: float) -> str:
    if q["suspended"]:
        return SUSPENDED
    if active:
        return "Active"
    if q["next_retry_at"] and q["next_retry_at"] > now:
        return "Retry"
    return "Ready"


def list_queues(conn: Connection, now: float) -> list[dict]:
    counts: dict[int, dict[str, int]] = {}
    stmt = (select(recipients.c.queue_id, recipients.c.status, func.count(func.distinct(recipients.c.message_id)))
            .join(messages, messages.c.id == recipients.c.message_id)
            .where(recipients.c.status.not_in(TERMINAL), messages.c.role == "primary", messages.c.poisoned == 0)
            .group_by(recipients.c.queue_id, recipients.c.status))
    for qid, status, n in conn.execute(stmt):
        counts.setdefault(qid, {})[status] = n
    msg_counts = dict(conn.execute(
        select(recipients.c.queue_id, func.count(func.distinct(recipients.c.message_id)))
        .join(messages, messages.c.id == recipients.c.message_id)
        .where(recipients.c.status.not_in(TERMINAL), messages.c.role == "primary", messages.c.poisoned == 0)
        .group_by(recipients.c.queue_id)).all())
    out = []
    for q in conn.execute(select(queues).order_by(queues.c.id)).mappings():
        c = counts.get(q["id"], {})
        out.append({
            "identity": q["identity"], "id": q["id"], "delivery_type": q["delivery_type"],
            "next_hop": q["next_hop"], "state": queue_state(dict(q), c.get(ACTIVE, 0), now),
            "message_count": msg_counts.get(q["id"], 0),
            "next_retry_at": q["next_retry_at"] if q["next_retry_at"] and q["next_retry_at"] > now else None,
            "last_error": q["last_error"] or "",
            "retry_count": q["retry_count"],
        })
    # The Poison queue (messages held after repeated internal failures): listed, like Get-Queue
    # lists it, only while it holds messages.
    poison = conn.execute(select(func.count()).select_from(messages).where(
        messages.c.poisoned == 1, messages.c.state == QUEUED)).scalar() or 0
    if poison:
        out.append({"identity": POISON, "id": None, "delivery_type": "Undefined", "next_hop": "Poison Message",
                    "state": "Ready", "message_count": poison, "next_retry_at": None, "last_error": "",
                    "retry_count": 0})
    return out


def message_status(rcpt_statuses: Sequence[str], suspended: bool, state: str, poisoned: bool = False) -> str:
    if state == SAFETY_NET:
        return "SafetyNet"
    if state == MSG_REMOVED:
        return "Removed"
    if poisoned:
        return POISON
    if suspended:
        return SUSPENDED
    pending = [s for s in rcpt_statuses if s not in TERMINAL]
    if not pending:
        return "Delivered" if DELIVERED in rcpt_statuses else (FAILED if FAILED in rcpt_statuses else "Removed")
    for s in (ACTIVE, RETRY, READY):
        if s in pending:
            return s
    return pending[0]


def waits_for_queue_retry(status: str, queue_suspended: Any, queue_next_retry_at: float | None, now: float) -> bool:
    """Whether a recipient waits for its queue's next retry: Ready in a queue in Retry (as ``queue
    list`` shows it: not suspended, its next retry time not yet come). The scheduler takes none of
    its recipients before then (``_DUE_QUEUES``), so the views show it as Retry (deferred), as
    Exchange shows the messages of a queue in Retry and Postfix puts the mail for a destination it
    found down in its deferred queue without trying it; its recipient row stays Ready."""
    return status == READY and not queue_suspended and bool(queue_next_retry_at) and queue_next_retry_at > now


def _view_recipients(conn: Connection, where: Any, now: float) -> Iterator[dict]:
    """Recipient rows (with their queue's identity) as the views show them: one waiting for its
    queue's next retry is Retry, with that time as its next retry."""
    rstmt = (select(recipients, queues.c.identity.label("queue"), queues.c.suspended.label("queue_suspended"),
                    queues.c.next_retry_at.label("queue_next_retry_at"))
             .join(queues, queues.c.id == recipients.c.queue_id)
             .where(where).order_by(recipients.c.id))
    for row in conn.execute(rstmt).mappings():
        r = dict(row)
        queue_suspended, queue_retry = r.pop("queue_suspended"), r.pop("queue_next_retry_at")
        if waits_for_queue_retry(r["status"], queue_suspended, queue_retry, now):
            r["status"], r["next_retry_at"] = RETRY, queue_retry
        yield r


def list_messages(conn: Connection, queue_id: int | str | None = None, include_done: bool = False,
                  role: str = "primary", limit: int | None = 1000, ids: Sequence[int] | None = None,
                  now: float | None = None) -> list[dict]:
    """Messages of one role, or of one queue: a next hop's id, or POISON (primary and shadow copies);
    with ``ids``, those messages (whatever their role) and no others. ``now`` (default: the
    clock) tells which queues are in Retry."""
    now = time.time() if now is None else now
    if queue_id == POISON:
        stmt = select(messages).where(messages.c.poisoned == 1, messages.c.state == QUEUED)
        queue_id = None
    elif ids is not None:
        stmt = select(messages)
    else:
        stmt = select(messages).where(messages.c.role == role)
    if ids is not None:
        stmt = stmt.where(messages.c.id.in_(list(ids)))
    stmt = stmt.order_by(messages.c.id)
    if limit is not None:
        stmt = stmt.limit(limit)
    if not include_done:
        stmt = stmt.where(messages.c.state == QUEUED)
    if queue_id is not None:
        # Without --all, a message is "in" a queue only while it has a recipient pending there
        # (a bifurcated message whose local copy was delivered has left the mailbox queue).
        in_queue = recipients.c.queue_id == queue_id
        if not include_done:
            in_queue = and_(in_queue, recipients.c.status.not_in(TERMINAL))
        stmt = stmt.where(messages.c.id.in_(select(recipients.c.message_id).where(in_queue)))
    rows = [dict(r) for r in conn.execute(stmt).mappings()]
    if not rows:
        return []
    ids = [r["id"] for r in rows]
    per: dict[int, list[dict]] = {}
    for r in _view_recipients(conn, recipients.c.message_id.in_(ids), now):
        per.setdefault(r["message_id"], []).append(r)
    out = []
    for m in rows:
        rc = per.get(m["id"], [])
        if queue_id is not None:
            rc_q = [r for r in rc if r["queue_id"] == queue_id]
        else:
            rc_q = rc
        # The error a message waits on is a pending recipient's; a finished one's (a 550 that
        # was bounced) only when none waits.
        waiting = [r["last_error"] for r in rc_q if r["last_error"] and r["status"] not in TERMINAL]
        errors = waiting or [r["last_error"] for r in rc_q if r["last_error"]]
        retries = [r["next_retry_at"] for r in rc_q if r["status"] == RETRY and r["next_retry_at"]]
        out.append({
            "id": m["id"], "network_message_id": m["network_message_id"], "message_id": m["message_id"],
            "from": m["sender"], "subject": m["subject"], "size": m["size"],
            "received_at": m["received_at"], "expires_at": m["expires_at"],
            "status": message_status([r["status"] for r in rc_q], bool(m["suspended"]), m["state"],
                                     bool(m["poisoned"])),
            "queues": [POISON] if m["poisoned"] and m["state"] == QUEUED else sorted({r["queue"] for r in rc_q}),
            "recipient_count": len(rc_q),
            "next_retry_at": min(retries) if retries else None,
            "last_error": errors[-1] if errors else "",
            "origin": m["origin"], "redundancy": m["redundancy"], "role": m["role"],
            "poison_count": m["poison_count"],
        })
    return out


def message_detail(conn: Connection, message_id: int, now: float | None = None) -> dict | None:
    """One message with its recipients (as ``list_messages`` shows them), shadows and status."""
    m = message_row(conn, message_id)
    if m is None:
        return None
    now = time.time() if now is None else now
    m["recipients"] = list(_view_recipients(conn, recipients.c.message_id == message_id, now))
    m["shadows"] = [dict(r) for r in conn.execute(
        select(message_shadows).where(message_shadows.c.message_id == message_id)).mappings()]
    m["status"] = message_status([r["status"] for r in m["recipients"]], bool(m["suspended"]), m["state"],
                                 bool(m["poisoned"]))
    return m


def redirect_to_peer(conn: Connection, target: str, now: float, message_id: int | None = None) -> list[dict]:
    """Redirect-Message: move every pending recipient of our primary messages (or of the one
    ``message_id``: shadow redundancy promotion) to the queue for ``target`` (delivered hop by hop
    with XSHADOW, so each message stays protected on the way). Recipients being sent right now
    (Active) finish where they are. Messages an operator suspended (or held in the Poison queue)
    stay here, held as they are: a redirect releases nothing. So do, on a drain, the recipients
    of a queue an operator suspended (the hold is the queue's: the peer would send them on to the
    same next hop at once); a promotion moves them, a suspended queue being one of its reasons
    (``acknowledgement_state``'s QueueSuspended). Returns the moved messages."""
    qid = queue_id_for(conn, NextHop(f"peer:{target}", PEER, target), now)
    which = [] if message_id is None else [recipients.c.message_id == message_id]
    held_queues = [] if message_id is not None else [
        recipients.c.queue_id.not_in(select(queues.c.id).where(queues.c.suspended == 1))]
    rows = conn.execute(
        select(recipients.c.message_id, func.count())
        .join(messages, messages.c.id == recipients.c.message_id)
        .where(recipients.c.status.in_(PENDING), recipients.c.queue_id != qid,
               messages.c.role == "primary", messages.c.state == QUEUED,
               messages.c.suspended == 0, messages.c.poisoned == 0, *which, *held_queues)
        .group_by(recipients.c.message_id)).all()
    ids = [r[0] for r in rows]
    if ids:
        conn.execute(update(recipients).where(
            recipients.c.message_id.in_(ids), recipients.c.status.in_(PENDING), recipients.c.queue_id != qid,
            *held_queues).values(queue_id=qid, status=READY, next_retry_at=0.0))
    return [message_row(conn, m) for m in ids]


def in_attempt_here(conn: Connection, target: str) -> int:
    """Messages a redirect to ``target`` has yet to move because a recipient of theirs is in a
    delivery attempt here (Active): what the attempt leaves pending can be moved when it ends
    (unless its queue is suspended: that stays here anyway)."""
    peer_queue = conn.execute(select(queues.c.id).where(queues.c.identity == f"peer:{target}")).scalar()
    return conn.execute(
        select(func.count(func.distinct(recipients.c.message_id)))
        .join(messages, messages.c.id == recipients.c.message_id)
        .join(queues, queues.c.id == recipients.c.queue_id)
        .where(recipients.c.status == ACTIVE, recipients.c.queue_id != (peer_queue or -1), queues.c.suspended == 0,
               messages.c.role == "primary", messages.c.state == QUEUED,
               messages.c.suspended == 0, messages.c.poisoned == 0)).scalar() or 0


def held_messages(conn: Connection) -> dict[str, int]:
    """Queued primary messages a redirect leaves here, by hold, each counted once (the first that
    applies): ``poison`` (the Poison queue), ``suspended message`` (an operator's ``message
    suspend``), ``suspended queue`` (a pending recipient in a queue an operator suspended)."""
    queued = [messages.c.role == "primary", messages.c.state == QUEUED]
    in_suspended_queue = select(recipients.c.message_id).join(queues, queues.c.id == recipients.c.queue_id).where(
        queues.c.suspended == 1, recipients.c.status.in_(PENDING))

    def count(*where) -> int:
        return conn.execute(select(func.count()).select_from(messages).where(*queued, *where)).scalar() or 0
    return {"poison": count(messages.c.poisoned == 1),
            "suspended message": count(messages.c.poisoned == 0, messages.c.suspended == 1),
            "suspended queue": count(messages.c.poisoned == 0, messages.c.suspended == 0,
                                     messages.c.id.in_(in_suspended_queue))}
