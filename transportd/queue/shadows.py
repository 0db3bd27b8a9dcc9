"""Shadow redundancy's tables: shadow copies, where our messages are shadowed, discard events, peers.

It owns every query of shadow redundancy state in the queue database: the
shadow copies we hold for primaries (``messages.role = shadow``), where each of
our messages is shadowed (``message_shadows``) or forked hop by hop
(``shadow_forks``), the discard events we owe each shadow (``discard_events``,
handed out per session token and deleted only once acknowledged), what we know
of each primary (``shadow_contexts``), and filed resubmit requests. Each
function takes an open connection inside a transaction and the time as ``now``;
none talks to a peer, logs a tracking event or decides policy
(redundancy/ decides, node/ logs after the commit).
"""

from __future__ import annotations

from typing import Any, Iterable

from sqlalchemy import and_, bindparam, delete, func, insert, or_, select, update
from sqlalchemy.engine import Connection

from transportd import faults
from transportd.queue import messages as mq
from transportd.queue import notices
from transportd.queue.direct import Insert
from transportd.queue.routing import NextHop, route_config
from transportd.queue.store import (
    discard_events,
    message_shadows,
    messages,
    recipients,
    resubmit_requests,
    shadow_contexts,
    shadow_forks,
)

_INSERT_MESSAGE_SHADOW = Insert(message_shadows)  # on the path of every 250 (queue/direct.py)
_INSERT_DISCARD = insert(discard_events)
_INSERT_FORK = insert(shadow_forks)
_not_delay_notified = or_(discard_events.c.reason.is_(None), discard_events.c.reason != mq.DELAY_NOTIFIED)


# --------------------------------------------------------------------------- primary side

def record_shadow(conn: Connection, message_id: int, shadow_node: str, guid: str, now: float,
                  rank: int = 1, shadow_dbid: str | None = None) -> None:
    """``shadow_node`` holds a shadow copy of our message ``message_id`` under ``guid`` (its ``rank``),
    in its queue database ``shadow_dbid`` when it said which."""
    _INSERT_MESSAGE_SHADOW.run(conn, {"message_id": message_id, "shadow_node": shadow_node,
                                      "shadow_guid": guid, "created_at": now, "shadow_rank": rank,
                                      "shadow_dbid": shadow_dbid})


def _ranked(shadow_nodes: Iterable[str | tuple[str, int]]) -> list[tuple[str, int]]:
    """Peers with their ranks; a bare name takes its position (1, 2, ...)."""
    return [n if isinstance(n, tuple) else (n, i) for i, n in enumerate(shadow_nodes, 1)]


def discard_uncertain(conn: Connection, peers: Iterable[str], guid: str, now: float) -> None:
    """Discard events for copies a peer may hold that no message of ours refers to."""
    for peer in peers:
        conn.execute(_INSERT_DISCARD, {"shadow_node": peer, "shadow_guid": guid, "created_at": now})


def record_forks(conn: Connection, forks: Iterable[tuple[int, str, str, int, str | None]], now: float) -> None:
    """Hop-by-hop forks (message id, primary peer, guid, queue id, the peer's queue database ID)."""
    for message_id, primary, guid, queue_id, primary_dbid in forks:
        conn.execute(_INSERT_FORK, {"message_id": message_id, "primary_node": primary, "shadow_guid": guid,
                                    "queue_id": queue_id, "created_at": now, "primary_dbid": primary_dbid})


def redundancy_of(holders: int, wanted: int) -> str:
    """A message's redundancy for ``holders`` shadows of ``wanted``: ``shadowed``, ``partial``
    (some, fewer than shadow_copies: the missing ones are made in later heartbeat rounds) or
    ``unprotected``."""
    return "shadowed" if holders >= wanted else (mq.PARTIAL if holders else "unprotected")


# The reason of a per-recipient discard event for a delivered recipient (queue/messages.py's, with
# ``Failed=`` for a failed one, ``NotifyDelivered=``/``NotifyRelayed=`` for one whose notice of
# success is still queued): ``Delivered=<xtext of the address>``, handed out only to a shadow that
# asked for them.
PER_RECIPIENT = mq.RECIPIENT_DELIVERED


def record_delivered_recipients(conn: Connection, message_id: int, reasons: Iterable[str], now: float) -> int:
    """Per-recipient discard events: for each shadow of ``message_id``, one per reason (a recipient
    delivered while others wait; a failed one is told by ``mq.tell_shadows_failed``, which waits for
    its DSN). Returns how many were written."""
    shadows = conn.execute(select(message_shadows.c.shadow_node, message_shadows.c.shadow_guid)
                           .where(message_shadows.c.message_id == message_id)).all()
    n = 0
    for node, guid in shadows:
        for reason in reasons:
            conn.execute(_INSERT_DISCARD, {"shadow_node": node, "shadow_guid": guid, "created_at": now,
                                           "reason": reason})
            n += 1
    return n


def _recipient_done(primary: str, status: str, notice: str | None, last_error: str | None) -> dict:
    """What a per-recipient discard of ``primary`` writes on the recipient: ``status``, and a
    ``last_error`` saying why (a failure there; a success notice it owes, ``notice`` its action)."""
    if notice is not None:
        last_error = notices.notice_owed(notice, primary)
    elif status == mq.FAILED:
        last_error = failed_on(primary)
    return {"status": status, "last_error": last_error}


def apply_delivered_recipients(conn: Connection, primary: str, entries: Iterable[tuple[str, str]],
                               now: float, status: str = mq.DELIVERED, notice: str | None = None) -> list[str]:
    """Per-recipient discards of ``primary`` (GUID, address): those recipients of our queued shadow
    copy are done (the primary delivered them; with ``status`` FAILED, failed them, its DSN out), so
    a promotion delivers only the others and fails none a second time. With ``notice`` (the RFC
    3464 action, ``NotifyDelivered=``/``NotifyRelayed=``), delivered there with the success notice
    still owed: marked so (``notices.NOTICE_OWED``), and the copy stays for a promotion to send that
    notice; a later ``Delivered=`` for such a recipient (the notice is out) ends that. Returns the
    GUIDs of copies left with nothing to deliver nor notice to send (the caller discards them)."""
    done = {**_recipient_done(primary, status, notice, None), "completed_at": now}
    owed = notices.notice_owed_on(recipients.c.last_error)
    guids = []
    for guid, address in entries:
        row = conn.execute(select(messages.c.id).where(
            messages.c.role == "shadow", messages.c.primary_node == primary,
            messages.c.state.concat("") == mq.QUEUED, messages.c.shadow_guid == guid)).first()
        if row is None:
            continue
        conn.execute(update(recipients).where(
            recipients.c.message_id == row.id, recipients.c.address == address,
            recipients.c.status.not_in(mq.TERMINAL)).values(**done))
        if status == mq.DELIVERED and notice is None:  # the notice owed for it is out there
            conn.execute(update(recipients).where(
                recipients.c.message_id == row.id, recipients.c.address == address,
                recipients.c.status == mq.DELIVERED, owed).values(last_error=None))
        pending = conn.execute(select(func.count()).select_from(recipients).where(
            recipients.c.message_id == row.id,
            or_(recipients.c.status.not_in(mq.TERMINAL), and_(recipients.c.status == mq.DELIVERED, owed)))).scalar()
        if not pending:
            guids.append(guid)
    return list(dict.fromkeys(guids))


def apply_delay_notified(conn: Connection, primary: str, guids: Iterable[str], now: float) -> int:
    """``DelayNotified`` events of ``primary``: it sent the delay DSN of these messages (GUIDs), so
    our queued shadow copies of them note it (``delay_dsn_at``: a promotion sends none again). So
    does a message of ours whose fork it took hop by hop, once none of its own recipients waits
    here: should the peer be lost, the recipients routed again get no second notice; while some
    of its own wait, their notice is ours to send, on our own timer (the peer's covered only the
    recipients it took). The copies stay. Returns how many messages changed."""
    guids = list(dict.fromkeys(guids))
    # ``state || ''``: found by ix_messages_shadow (primary, GUID), not by reading every queued
    # message through ix_messages_state, which SQLite may choose without statistics.
    changed = conn.execute(update(messages).where(
        messages.c.role == "shadow", messages.c.primary_node == primary,
        messages.c.state.concat("") == mq.QUEUED, messages.c.shadow_guid.in_(guids),
        messages.c.delay_dsn_at.is_(None)).values(delay_dsn_at=now)).rowcount
    forked = select(shadow_forks.c.message_id).where(shadow_forks.c.primary_node == primary,
                                                     shadow_forks.c.shadow_guid.in_(guids))
    own_waiting = select(recipients.c.id).where(recipients.c.message_id == messages.c.id,
                                                recipients.c.status.in_((*mq.PENDING, mq.ACTIVE)))
    changed += conn.execute(update(messages).where(
        messages.c.id.in_(forked), messages.c.delay_dsn_at.is_(None), ~own_waiting.exists())
        .values(delay_dsn_at=now)).rowcount
    return changed


def failed_on(primary: str) -> str:
    """The ``last_error`` of a recipient ``primary`` told us it failed (``Failed=``), its DSN out."""
    return f"failed on the primary {primary}"


def delivered_by(primary: str) -> str:
    """The ``last_error`` of a recipient we handed ``primary`` hop by hop that it told us it
    delivered (``Delivered=`` for our fork): a lost peer's fork routes it no second time."""
    return f"delivered by the primary {primary}"


def apply_fork_recipients(conn: Connection, primary: str, entries: Iterable[tuple[str, str]],
                          now: float, status: str = mq.DELIVERED, notice: str | None = None) -> int:
    """Per-recipient discards of ``primary`` for our hop-by-hop forks (GUID, address): the
    recipients it took with that fork that it delivered (``status`` DELIVERED, marked with
    ``delivered_by``; with ``notice``, its success notice still owed there: marked so, and sent by
    ``requeue_forks`` should the peer be lost) or failed, its DSN out (FAILED), so that
    ``requeue_forks`` routes again only the others should it be lost (Exchange's shadow queue per
    next hop of the primary). The fork itself goes once they cover every recipient it took
    (``release_covered_forks``), or with the primary's discard of the message. Returns how many
    recipients changed."""
    done = {**_recipient_done(primary, status, notice, delivered_by(primary)), "completed_at": now}
    n = 0
    for guid, address in entries:
        for message_id, queue_id in conn.execute(select(shadow_forks.c.message_id, shadow_forks.c.queue_id).where(
                shadow_forks.c.primary_node == primary, shadow_forks.c.shadow_guid == guid)).all():
            n += conn.execute(update(recipients).where(
                recipients.c.message_id == message_id, recipients.c.queue_id == queue_id,
                recipients.c.address == address, recipients.c.status == mq.DELIVERED).values(**done)).rowcount
    return n


def release_covered_forks(conn: Connection, primary: str, guids: Iterable[str], now: float,
                          hold: float) -> list[tuple[dict, str]]:
    """Forks handed to ``primary`` (among ``guids``) whose every recipient its per-recipient
    discards now cover (``apply_fork_recipients``: delivered there, or failed with the DSN out;
    one whose notice of success it still owes is not covered): released as its discard of the
    message releases them (``release_forks``), without waiting for that discard. A recipient of
    the message handed to that peer's queue and not covered (in this fork or another one to it)
    keeps the fork. Returns (our message's row, GUID) of each released."""
    covered = []
    for guid in dict.fromkeys(guids):
        for message_id, queue_id in conn.execute(select(shadow_forks.c.message_id, shadow_forks.c.queue_id).where(
                shadow_forks.c.primary_node == primary, shadow_forks.c.shadow_guid == guid)).all():
            told = conn.execute(select(
                func.count(), func.sum(or_(recipients.c.last_error.is_(None),
                                           recipients.c.last_error != delivered_by(primary)))).where(
                recipients.c.message_id == message_id, recipients.c.queue_id == queue_id,
                recipients.c.status == mq.DELIVERED)).one()
            failed_there = conn.execute(select(func.count()).select_from(recipients).where(
                recipients.c.message_id == message_id, recipients.c.queue_id == queue_id,
                recipients.c.status == mq.FAILED, recipients.c.last_error == failed_on(primary))).scalar()
            if not told[1] and (told[0] or failed_there):
                covered.append(guid)
    return release_forks(conn, primary, list(dict.fromkeys(covered)), now, hold) if covered else []


def take_discard_events(conn: Connection, shadow_node: str, n: int, token: str, recipients: bool = False,
                        failed: bool = False, notify: bool = False, delay: bool = False) -> list[tuple[str, str | None]]:
    """Up to ``n`` (guid, reason) discard events for ``shadow_node``, marked as handed out on
    ``token``; per-recipient ones (``Delivered=``) only with ``recipients`` (the shadow asked), and
    ``Failed=`` ones only with ``failed`` too. ``NotifyDelivered=``/``NotifyRelayed=`` ones go as
    such only with ``notify`` too, as ``Delivered=`` to a shadow that asked for per-recipient
    entries without it (what it was handed before: a promotion of its copy does not deliver the
    recipient again, nor send its notice). ``DelayNotified`` ones only with ``delay`` too (and the
    others): a shadow that did not ask would refuse the whole batch; they wait for the housekeeping
    then, as any event nobody takes (a promotion of its copy sends the delay notice again, as before)."""
    unasked = [] if recipients else [PER_RECIPIENT, *mq.RECIPIENT_NOTIFY]
    unasked += [] if recipients and failed else [mq.RECIPIENT_FAILED]
    unasked += [] if recipients and failed and notify and delay else [mq.DELAY_NOTIFIED]
    only = [or_(discard_events.c.reason.is_(None),
                and_(*[discard_events.c.reason.not_like(f"{k}%") for k in unasked]))] if unasked else []
    rows = conn.execute(select(discard_events.c.id, discard_events.c.shadow_guid, discard_events.c.reason)
                        .where(discard_events.c.shadow_node == shadow_node, discard_events.c.sent_token.is_(None),
                               *only)
                        .order_by(discard_events.c.id).limit(n)).all()
    if rows:
        conn.execute(update(discard_events).where(discard_events.c.id.in_([r.id for r in rows]))
                     .values(sent_token=token))
    return [(r.shadow_guid, r.reason if notify else _as_delivered(r.reason)) for r in rows]


def _as_delivered(reason: str | None) -> str | None:
    """A ``NotifyDelivered=``/``NotifyRelayed=`` reason as ``Delivered=`` (for a shadow that did not
    ask for them); any other as it is."""
    for kind in mq.RECIPIENT_NOTIFY:
        if reason and reason.startswith(kind):
            return mq.RECIPIENT_DELIVERED + reason[len(kind):]
    return reason


def settle_discard_events(conn: Connection, token: str, acknowledged: bool) -> None:
    """Events handed out on ``token``: deleted when acknowledged (QUIT), else handed out again."""
    cond = discard_events.c.sent_token == token
    if acknowledged:
        conn.execute(delete(discard_events).where(cond))
    else:
        conn.execute(update(discard_events).where(cond).values(sent_token=None))


def claim_lost_shadows(conn: Connection, peer: str, before: float | None, now: float,
                       dbid: str | None = None) -> list[dict]:
    """Our queued messages whose shadow on ``peer`` is lost: forget those shadows and mark the
    messages ``reshadowing``; returns their rows. With ``dbid`` (the queue database ``peer`` has
    now), a copy recorded in another one of its databases (the peer named it when it took the copy)
    is lost, whenever it was made, and one recorded in ``dbid`` is current. A copy recorded without
    one (a peer that does not say) is lost when made before ``before`` (when the peer's new queue
    database was first seen; the copies recorded since are current); without ``before``, such a
    copy is kept. Each forgotten copy also gets a discard event: one made on the new database all
    the same (a session can copy there before the change is seen) would otherwise stay held with
    no discard ever sent, and be promoted, a second owner, if we fail; for a copy that went with
    the old database the discard is a no-op there."""
    held_in = message_shadows.c.shadow_dbid
    older = [] if before is None else [message_shadows.c.created_at < before]
    if dbid is None:
        which = older
    else:
        which = [(held_in.is_not(None) & (held_in != dbid))] + ([held_in.is_(None) & older[0]] if older else [])
    if not which:
        return []
    lost = (message_shadows.c.shadow_node == peer) & or_(*which)
    rows = [dict(r) for r in conn.execute(
        select(messages).join(message_shadows, message_shadows.c.message_id == messages.c.id)
        .where(lost, messages.c.role == "primary", messages.c.state == mq.QUEUED)).mappings()]
    ids = list({r["id"] for r in rows})
    if ids:
        guids = conn.execute(select(message_shadows.c.shadow_guid).where(
            message_shadows.c.message_id.in_(ids), lost).distinct()).scalars().all()
        for guid in guids:
            discard_uncertain(conn, [peer], guid, now)
        conn.execute(delete(message_shadows).where(message_shadows.c.message_id.in_(ids), lost))
        conn.execute(update(messages).where(messages.c.id.in_(ids)).values(redundancy="reshadowing"))
    return list({r["id"]: r for r in rows}.values())


def claim_unprotected(conn: Connection, limit: int) -> list[dict]:
    """Up to ``limit`` queued messages without a shadow or with fewer than wanted, marked ``reshadowing``."""
    rows = [dict(r) for r in conn.execute(
        select(messages).where(messages.c.role == "primary", messages.c.state == mq.QUEUED,
                               messages.c.redundancy.in_(("unprotected", mq.PARTIAL)), messages.c.poisoned == 0)
        .order_by(messages.c.id).limit(limit)).mappings()]
    if rows:
        conn.execute(update(messages).where(messages.c.id.in_([r["id"] for r in rows]))
                     .values(redundancy="reshadowing"))
    return rows


def want_shadow_copies(conn: Connection, wanted: int) -> int:
    """Start-up under ``shadow_copies`` = ``wanted``: queued messages of ours that are
    ``shadowed`` with fewer peers holding a shadow (accepted while the setting was lower) become
    ``partial``, so that the heartbeat rounds make the missing copies (``claim_unprotected``);
    returns how many. One statement, nothing at all when ``wanted`` is 1 (every shadowed message
    has a shadow). A message taken hop by hop keeps its one shadow, the peer that handed it to us
    (docs/PROTOCOL.md sections 3 and 9): that holder is the client the message came from."""
    if wanted <= 1:
        return 0
    holders = (select(func.count(message_shadows.c.shadow_node.distinct()))
               .where(message_shadows.c.message_id == messages.c.id).scalar_subquery())
    hop_by_hop = (select(message_shadows.c.message_id)
                  .where(message_shadows.c.message_id == messages.c.id,
                         message_shadows.c.shadow_node == func.lower(messages.c.client_hostname)).exists())
    return conn.execute(update(messages).where(
        messages.c.role == "primary", messages.c.state == mq.QUEUED, messages.c.redundancy == "shadowed",
        holders < wanted, ~hop_by_hop).values(redundancy=mq.PARTIAL)).rowcount


def mark_unprotected(conn: Connection, message_id: int) -> None:
    """A re-shadow that failed: the message waits for the next round without a shadow."""
    conn.execute(update(messages).where(messages.c.id == message_id, messages.c.redundancy == "reshadowing")
                 .values(redundancy="unprotected"))


def reshadow_inputs(conn: Connection, message_id: int) -> tuple[bytes | None, dict[str, str], list[tuple[str, int]]]:
    """What a new shadow of ``message_id`` needs: its body, the recipients still to deliver (with
    their RFC 3461 parameters, in order), and the peers that hold a shadow of it already, with
    their ranks."""
    addrs = {r.address: r.dsn_params for r in conn.execute(select(recipients.c.address, recipients.c.dsn_params).where(
        recipients.c.message_id == message_id, recipients.c.status.not_in(mq.TERMINAL)))}
    holders = [(r.shadow_node, r.shadow_rank) for r in conn.execute(
        select(message_shadows.c.shadow_node, message_shadows.c.shadow_rank).where(
            message_shadows.c.message_id == message_id))]
    return mq.body(conn, message_id), addrs, holders


def message_guid(conn: Connection, message_id: int, promoted_guid: str | None) -> tuple[str | None, set[str]]:
    """The shadow GUID a new shadow of ``message_id`` carries, and the peers it must not go to now.

    Every copy of a message carries one GUID (docs/PROTOCOL.md section 9): the one its shadows
    have (``promoted_guid``, the GUID of the copy we promoted, first: the other holders of the
    lost primary's message keep that one, and whoever promotes after us names it in its
    XSHADOWADOPT); None when no copy has one yet (a new GUID will do). A peer with a discard event
    for that GUID still pending (a copy forgotten, uncertain, or surplus) would apply it to a new
    copy too: it gets none until it has taken the event (its next poll)."""
    guid = promoted_guid or conn.execute(select(message_shadows.c.shadow_guid).where(
        message_shadows.c.message_id == message_id).order_by(message_shadows.c.created_at).limit(1)).scalar()
    if guid is None:
        return None, set()
    # A DelayNotified event is no discard: it holds for a new copy as well (the notice is out).
    busy = set(conn.execute(select(discard_events.c.shadow_node).where(
        discard_events.c.shadow_guid == guid, _not_delay_notified).distinct()).scalars())
    return guid, busy


def settle_reshadow(conn: Connection, message_id: int, shadow_nodes: Iterable[str | tuple[str, int]], guid: str,
                    uncertain: Iterable[str], had_recipients: bool, now: float, wanted: int = 1,
                    databases: dict[str, str] | None = None) -> str | None:
    """Record a re-shadow's result (the new copies, under ``guid``, each with the queue database
    its peer named in ``databases``); returns the message state. A copy made for a message that was
    delivered (or removed) meanwhile gets its discard event at once."""
    discard_uncertain(conn, uncertain, guid, now)
    state, delay_dsn_at = conn.execute(select(messages.c.state, messages.c.delay_dsn_at).where(
        messages.c.id == message_id)).first() or (None, None)
    for node, rank in _ranked(shadow_nodes):
        record_shadow(conn, message_id, node, guid, now, rank, (databases or {}).get(node))
        if state != mq.QUEUED:
            discard_uncertain(conn, [node], guid, now)
        elif delay_dsn_at is not None:  # its delay notice is out: the new copy is told, as the others were
            mq.tell_delay_notified(conn, message_id, now, [(node, guid)])
    # by peer: two copies on one peer (a new shadow and an adopted one) are one peer's protection
    held = conn.execute(select(func.count(message_shadows.c.shadow_node.distinct()))
                        .where(message_shadows.c.message_id == message_id)).scalar() or 0
    redundancy = redundancy_of(held, wanted) if had_recipients or held else "none"
    mq.UPDATE_MESSAGE.run(conn, {"redundancy": redundancy}, message_id)
    return state


def record_adopted(conn: Connection, peer: str, adopted: Iterable[tuple[int, str, int]],
                   now: float) -> list[tuple[int, str, int]]:
    """``peer`` kept its copies of promoted messages (message id, guid, rank) as our shadows
    (XSHADOWADOPT). A message finished meanwhile gets its discard event at once. A copy adopted at
    a rank another peer's shadow of the message holds already (a peer that answered late, after
    the message got a new shadow at that rank; or two lower ranks closed up to rank 1) is surplus:
    both would take ownership together should we be lost. It is not recorded but gets a discard
    event (the peer drops it at its next poll), and the message a new shadow ranked after the
    others if it lacks one. Returns the surplus copies."""
    surplus = []
    for message_id, guid, rank in adopted:
        taken = conn.execute(select(message_shadows.c.shadow_node).where(
            message_shadows.c.message_id == message_id, message_shadows.c.shadow_rank == rank,
            message_shadows.c.shadow_node != peer).limit(1)).first()
        state, delay_dsn_at = conn.execute(select(messages.c.state, messages.c.delay_dsn_at).where(
            messages.c.id == message_id)).first() or (None, None)
        if taken is None:
            record_shadow(conn, message_id, peer, guid, now, rank)
            if state == mq.QUEUED and delay_dsn_at is not None:  # we (or the lost primary) sent its delay notice
                mq.tell_delay_notified(conn, message_id, now, [(peer, guid)])
        else:
            surplus.append((message_id, guid, rank))
        if taken is not None or state != mq.QUEUED:
            discard_uncertain(conn, [peer], guid, now)
    return surplus


def shadow_status(conn: Connection, shadow_node: str, guids: list[str], peers: list[str]) -> tuple[set[str], set[str]]:
    """XQSTATUS from ``shadow_node``: of these shadow-message GUIDs, (those with a whole-message
    discard event pending for it, those of a message we know in any state). A message is known
    while its row lives (to the end of its Safety Net hold): by a shadow recorded for it
    (``message_shadows``, read whole: no index by GUID, and a heartbeat asks a bounded batch), or
    as a copy of that GUID we promoted (found by ix_messages_shadow, its primary being a peer)."""
    per_recipient = and_(*[discard_events.c.reason.not_like(f"{k}%") for k in (
        PER_RECIPIENT, mq.RECIPIENT_FAILED, *mq.RECIPIENT_NOTIFY, mq.DELAY_NOTIFIED)])
    done = set(conn.execute(select(discard_events.c.shadow_guid).where(
        discard_events.c.shadow_node == shadow_node, discard_events.c.shadow_guid.in_(guids),
        or_(discard_events.c.reason.is_(None), per_recipient))).scalars())
    known = set(conn.execute(select(message_shadows.c.shadow_guid).where(
        message_shadows.c.shadow_guid.in_(guids))).scalars())
    known.update(conn.execute(select(messages.c.shadow_guid).where(
        messages.c.primary_node.in_(peers), messages.c.shadow_guid.in_(guids))).scalars())
    return done, known


def messages_present(conn: Connection, ids: list[int]) -> set[int]:
    """Which of our messages ``ids`` the queue database still has, in any state (asked 500 at a
    time: a promotion may name tens of thousands, past SQLite's limit of bound parameters)."""
    found: set[int] = set()
    for i in range(0, len(ids), 500):
        found.update(conn.execute(select(messages.c.id).where(messages.c.id.in_(ids[i:i + 500]))).scalars())
    return found


# --------------------------------------------------------------------------- shadow side

def shadow_context(conn: Connection, primary: str) -> dict | None:
    """What we know of ``primary``: its queue database ID, heartbeat times and failures."""
    row = conn.execute(select(shadow_contexts).where(shadow_contexts.c.peer == primary)).mappings().first()
    return dict(row) if row else None


def upsert_context(conn: Connection, primary: str, **values: Any) -> None:
    exists = conn.execute(select(func.count()).select_from(shadow_contexts)
                          .where(shadow_contexts.c.peer == primary)).scalar()
    if exists:
        conn.execute(update(shadow_contexts).where(shadow_contexts.c.peer == primary).values(**values))
    else:
        conn.execute(insert(shadow_contexts).values({"peer": primary, "consecutive_failures": 0, **values}))


def shadow_holders(conn: Connection) -> set[str]:
    """Every peer that holds a shadow of a message still queued here, or of one processed whose
    DSN is not out yet (``finish_if_done`` keeps its shadows to protect that DSN: no discard
    event yet), or has a discard event waiting (it fetches it with XQDISCARD). The rows of a
    message processed since (in the Safety Net) stay for its history, but once the discard is
    fetched the holder has moved its copy to its Shadow Safety Net: it has nothing left to ask
    this node about."""
    dsn = messages.alias("dsn")
    dsn_queued = select(dsn.c.id).where(dsn.c.dsn_of == messages.c.id, dsn.c.state.concat("") == mq.QUEUED)
    holders = conn.execute(select(message_shadows.c.shadow_node).join(
        messages, messages.c.id == message_shadows.c.message_id).where(
        or_(messages.c.state == mq.QUEUED, dsn_queued.exists())).distinct()).scalars().all()
    waiting = conn.execute(select(discard_events.c.shadow_node).distinct()).scalars().all()
    return {*holders, *waiting}


def primaries_to_poll(conn: Connection) -> list[str]:
    """Every primary we hold a shadow or a fork for, or have a resubmit request filed for."""
    held = conn.execute(select(messages.c.primary_node).where(
        messages.c.role == "shadow", messages.c.state == mq.QUEUED).distinct()).scalars().all()
    forks = conn.execute(select(shadow_forks.c.primary_node).distinct()).scalars().all()
    asked = conn.execute(select(resubmit_requests.c.for_primary).where(
        resubmit_requests.c.done_at.is_(None)).distinct()).scalars().all()
    return sorted({p for p in [*held, *forks, *asked] if p})


def copies_to_verify(conn: Connection, primary: str, *, before: float, since: float, rank_delay: float,
                     after: tuple[int, float], limit: int) -> list[tuple[str, int, float]]:
    """Copies of ``primary`` to ask it about (XQSTATUS): our queued shadows of it taken before
    ``before`` (a rank k copy k - 1 ``rank_delay`` earlier: a lower rank promotes and adopts it
    first) and our hop-by-hop forks handed to it before ``before``, both since ``since``; up to
    ``limit`` of each, after the cursor ``after`` (the last shadow's id, the last fork's time).
    Returns (GUID, shadow id or 0, fork time or 0.0)."""
    rank = func.coalesce(messages.c.shadow_rank, 1) - 1
    shadows = conn.execute(select(messages.c.shadow_guid, messages.c.id).where(
        messages.c.role == "shadow", messages.c.primary_node == primary, messages.c.state.concat("") == mq.QUEUED,
        messages.c.received_at + rank * rank_delay < before, messages.c.received_at >= since,
        messages.c.id > after[0]).order_by(messages.c.id).limit(limit)).all()
    forks = conn.execute(select(shadow_forks.c.shadow_guid, shadow_forks.c.created_at).where(
        shadow_forks.c.primary_node == primary, shadow_forks.c.created_at < before,
        shadow_forks.c.created_at >= since, shadow_forks.c.created_at > after[1])
        .order_by(shadow_forks.c.created_at).limit(limit)).all()
    return [(g, i, 0.0) for g, i in shadows if g] + [(g, 0, at) for g, at in forks]


# The last error of a primary whose failing polls ended because no shadow of it is held any more.
NOT_POLLED = "not polled: no shadows held"


def settle_unpolled(conn: Connection, polled: Iterable[str]) -> int:
    """Primaries no longer polled (``polled``: ``primaries_to_poll``) forget the failures of their
    last polls (``NOT_POLLED`` in their place): nothing is promoted for them, and a shadow taken
    from one later starts a new count rather than one from a streak long past. Returns how many
    contexts changed."""
    stale = or_(shadow_contexts.c.consecutive_failures > 0, shadow_contexts.c.last_error != NOT_POLLED,
                shadow_contexts.c.unreachable_since.is_not(None), shadow_contexts.c.down_since.is_not(None))
    return conn.execute(update(shadow_contexts).where(shadow_contexts.c.peer.not_in(list(polled)), stale).values(
        consecutive_failures=0, last_error=NOT_POLLED, unreachable_since=None, down_since=None)).rowcount


def apply_discards(conn: Connection, primary: str, reasons: dict[str, str | None], now: float,
                   hold: float) -> tuple[list[dict], list[tuple[dict, Exception]]]:
    """Shadows of ``primary`` named in ``reasons``: processed ones (no reason) to the Shadow Safety
    Net, ones removed by an operator there (a reason) removed here. One copy at a time: a copy
    whose handling fails stays a shadow and is returned with its error; the others go on."""
    rows, failed = [], []
    # ``state || ''``: found by ix_messages_shadow (primary, GUID), not by reading every queued
    # message through ix_messages_state, which SQLite may choose without statistics.
    for r in conn.execute(select(messages).where(
            messages.c.role == "shadow", messages.c.primary_node == primary,
            messages.c.state.concat("") == mq.QUEUED, messages.c.shadow_guid.in_(list(reasons)))).mappings():
        try:
            faults.check("discard", r)
            rows.append(dict(r))
        except Exception as exc:  # noqa: BLE001 - isolated per message (Poison queue)
            failed.append((dict(r), exc))
    kept = [r["id"] for r in rows if not reasons.get(r["shadow_guid"])]
    removed = [r["id"] for r in rows if reasons.get(r["shadow_guid"])]
    if kept:
        conn.execute(update(messages).where(messages.c.id.in_(kept)).values(
            state=mq.SAFETY_NET, completed_at=now, safety_net_until=now + hold))
    if removed:
        conn.execute(update(messages).where(messages.c.id.in_(removed)).values(
            state=mq.MSG_REMOVED, completed_at=now))
    return rows, failed


def release_relayed_shadows(conn: Connection, primary: str, network_message_id: str, addresses: Iterable[str],
                            now: float, hold: float) -> list[dict]:
    """``primary`` handed us its message ``network_message_id`` hop by hop for ``addresses`` (a
    ``redirect``'s drain, a mailbox database of ours): we are its primary for them now, ``primary``
    keeping the fork (docs/PROTOCOL.md section 3). Those recipients of our queued shadow copies of
    that message from ``primary`` are done here, as by its ``Delivered=`` entries: a promotion
    would send them a second time beside our own copy (Exchange discards the shadow at the
    hand-over). A copy left with nothing to deliver nor notice to send goes to the Shadow Safety
    Net, as by the primary's discard; one with other recipients (held on ``primary``, or for
    another next hop) stays a shadow for them. Returns the rows of the copies released."""
    wanted = {a.lower() for a in addresses}
    owed = notices.notice_owed_on(recipients.c.last_error)
    released = []
    # ``state || ''``: found by ix_messages_network_id, not by reading every queued message.
    for m in conn.execute(select(messages).where(
            messages.c.network_message_id == network_message_id, messages.c.role == "shadow",
            messages.c.primary_node == primary, messages.c.state.concat("") == mq.QUEUED)).mappings().all():
        covered = [rid for rid, address in conn.execute(select(recipients.c.id, recipients.c.address).where(
            recipients.c.message_id == m["id"], recipients.c.status.not_in(mq.TERMINAL))).all()
            if address.lower() in wanted]
        if not covered:
            continue
        conn.execute(update(recipients).where(recipients.c.id.in_(covered)).values(
            status=mq.DELIVERED, last_error=None, completed_at=now))
        if not conn.execute(select(func.count()).select_from(recipients).where(
                recipients.c.message_id == m["id"],
                or_(recipients.c.status.not_in(mq.TERMINAL), and_(recipients.c.status == mq.DELIVERED, owed)))).scalar():
            released.append(dict(m))
    if released:
        conn.execute(update(messages).where(messages.c.id.in_([m["id"] for m in released])).values(
            state=mq.SAFETY_NET, completed_at=now, safety_net_until=now + hold))
    return released


def release_forks(conn: Connection, primary: str, guids: list[str], now: float,
                  hold: float) -> list[tuple[dict, str]]:
    """Forks handed to ``primary`` that it discarded (or whose every recipient its per-recipient
    discards cover, ``release_covered_forks``): our message may now leave the queue."""
    found = conn.execute(select(shadow_forks.c.message_id, shadow_forks.c.shadow_guid).where(
        shadow_forks.c.primary_node == primary, shadow_forks.c.shadow_guid.in_(guids))).all()
    if not found:
        return []
    conn.execute(delete(shadow_forks).where(shadow_forks.c.primary_node == primary,
                                            shadow_forks.c.shadow_guid.in_(guids)))
    out = []
    for message_id, guid in found:
        mq.finish_if_done(conn, message_id, now, hold)
        out.append((mq.message_row(conn, message_id) or {"id": message_id}, guid))
    return out


def _older(column: Any, keep_dbid: str | None) -> list:
    return [] if keep_dbid is None else [or_(column.is_(None), column != keep_dbid)]


def promote_page(conn: Connection, primary: str, keep_dbid: str | None, limit: int,
                 max_rank: int | None = None, guids: list[str] | None = None) -> list[dict]:
    """Up to ``limit`` shadows of ``primary`` made primary copies of ours (``reshadowing``).
    With ``keep_dbid``, shadows made from that queue database stay shadows; with ``max_rank``,
    shadows of a higher rank wait (N-way: a lower rank promotes and adopts them first); with
    ``guids``, only those copies."""
    ranked = [] if max_rank is None else [messages.c.shadow_rank <= max_rank]
    ranked += [] if guids is None else [messages.c.shadow_guid.in_(guids)]
    rows = conn.execute(select(messages).where(
        messages.c.role == "shadow", messages.c.primary_node == primary,
        messages.c.state == mq.QUEUED, messages.c.poisoned == 0, *ranked,
        *_older(messages.c.primary_dbid, keep_dbid)).order_by(messages.c.id).limit(limit)).mappings().all()
    ids = [r["id"] for r in rows]
    if ids:
        conn.execute(update(messages).where(messages.c.id.in_(ids)).values(
            role="primary", origin="promoted", redundancy="reshadowing"))
    return [dict(r) for r in rows]


def waiting_ranks(conn: Connection, primary: str, rank: int, keep_dbid: str | None = None) -> bool:
    """Whether queued shadows of ``primary`` of a rank above ``rank`` wait for their turn (with
    ``keep_dbid``: only those made from an older queue database of it)."""
    return conn.execute(select(messages.c.id).where(
        messages.c.role == "shadow", messages.c.primary_node == primary, messages.c.state == mq.QUEUED,
        messages.c.shadow_rank > rank, *_older(messages.c.primary_dbid, keep_dbid)).limit(1)).first() is not None


def adopt_shadows(conn: Connection, old_primary: str, new_primary: str, new_dbid: str | None, rank: int,
                  guids: list[str]) -> list[dict]:
    """XSHADOWADOPT: our queued shadows of ``old_primary`` named in ``guids`` become shadows of
    ``new_primary`` (which promoted them from copies of ``rank``), ``rank`` closer to ownership;
    returns their rows as updated. A copy promoted or discarded here already is not adopted."""
    rows = [dict(r) for r in conn.execute(select(messages).where(
        messages.c.role == "shadow", messages.c.primary_node == old_primary, messages.c.state == mq.QUEUED,
        messages.c.shadow_guid.in_(guids))).mappings()]
    for r in rows:
        r.update(primary_node=new_primary, primary_dbid=new_dbid, shadow_rank=max(1, (r["shadow_rank"] or 1) - rank))
        conn.execute(update(messages).where(messages.c.id == r["id"]).values(
            primary_node=new_primary, primary_dbid=new_dbid, shadow_rank=r["shadow_rank"]))
    return rows


def requeue_forks(conn: Connection, primary: str, keep_dbid: str | None, cfg: Any, now: float,
                  owed: list | None = None, guids: list[str] | None = None) -> list[dict]:
    """Forks handed to ``primary``, resubmitted (the peer is lost): each recipient it took is routed
    again as a newly accepted message's is (``queue/routing.py``; Exchange resubmits the shadow
    messages through categorization, "delivered to another" server / "transmitted to the next
    hop"). A recipient whose next hop is that peer (its mailbox database lives there) waits for it
    again, the receiving store dropping a duplicate; one that was only drained there (``redirect``,
    or shadow redundancy promotion) goes to its own next hop. A recipient the peer told us it
    delivered or failed (``apply_fork_recipients``) is not routed again; one whose success notice it
    owed gets that notice from us instead (appended to ``owed``: (original row, DSN id, DSN), for
    the tracking rows). Each returned row carries the fork's shadow-message GUID as ``shadow_guid``.
    With ``guids``, only those forks (ones it does not know)."""
    which = [shadow_forks.c.primary_node == primary, *_older(shadow_forks.c.primary_dbid, keep_dbid)]
    which += [] if guids is None else [shadow_forks.c.shadow_guid.in_(guids)]
    found = conn.execute(select(
        shadow_forks.c.message_id, shadow_forks.c.queue_id, shadow_forks.c.shadow_guid).where(*which)).all()
    # Those it told us it delivered (Delivered=) are done, those whose success notice it owed too
    # (sent here instead, ``notices.send_owed_notices``); those it failed are FAILED here already.
    done_there = or_(recipients.c.last_error.is_(None), and_(recipients.c.last_error != delivered_by(primary),
                                                             ~notices.notice_owed_on(recipients.c.last_error)))
    queue_ids: dict[NextHop, int] = {}
    by_queue: dict[int, list[int]] = {}
    for message_id, queue_id, _ in found:
        for rid, address in conn.execute(select(recipients.c.id, recipients.c.address).where(
                recipients.c.message_id == message_id, recipients.c.queue_id == queue_id,
                recipients.c.status == mq.DELIVERED, done_there)).all():
            hop = route_config(address, cfg)
            if hop not in queue_ids:
                queue_ids[hop] = mq.queue_id_for(conn, hop, now)
            by_queue.setdefault(queue_ids[hop], []).append(rid)
    for queue_id, ids in by_queue.items():
        for i in range(0, len(ids), 500):  # SQLite's limit of bound parameters
            conn.execute(update(recipients).where(recipients.c.id.in_(ids[i:i + 500])).values(
                queue_id=queue_id, status=mq.READY, next_retry_at=0.0, completed_at=None))
    conn.execute(delete(shadow_forks).where(*which))
    if owed is not None:  # the success notices the peer owed for what it delivered (finishing those messages)
        owed.extend(notices.send_owed_notices(conn, cfg, [m for m, _, _ in found], now))
    for message_id in {m for m, _, _ in found}:
        try:  # a message whose every fork recipient the peer processed has nothing left to route
            mq.finish_if_done(conn, message_id, now, cfg.safety_net.safety_net_hold_time)
        except LookupError:
            continue
    return [{**(mq.message_row(conn, m) or {"id": m}), "shadow_guid": guid} for m, _, guid in found]


def open_resubmit_requests(conn: Connection, primary: str) -> list[dict]:
    return [dict(r) for r in conn.execute(select(resubmit_requests).where(
        resubmit_requests.c.for_primary == primary, resubmit_requests.c.done_at.is_(None))).mappings()]


def close_resubmit_request(conn: Connection, request_id: int, now: float, result: str) -> None:
    conn.execute(update(resubmit_requests).where(resubmit_requests.c.id == request_id)
                 .values(done_at=now, result=result))


_OPEN_TOKENS = select(discard_events.c.sent_token).where(discard_events.c.sent_token.is_not(None)).distinct()
_EVENT_TOKEN = bindparam("b_tokens", expanding=True)


def shadow_housekeeping(conn: Connection, now: float, *, auto_discard: float, expire_after: float,
                        hold: float, live_tokens: set[str]) -> list[dict]:
    """Drop discard events nobody asked for within ``auto_discard``, close resubmit requests older
    than the Safety Net, hand out again the events of sessions gone (not in ``live_tokens``), and
    remove shadows never discarded within ``expire_after``, hop-by-hop forks too (the copy we kept
    of a message a peer took as primary: its discard event may have been dropped on the peer, and
    nothing else would ever end it); returns the rows of the copies that expired."""
    conn.execute(delete(discard_events).where(discard_events.c.created_at < now - auto_discard))
    conn.execute(update(resubmit_requests).where(
        resubmit_requests.c.done_at.is_(None), resubmit_requests.c.created_at < now - hold)
        .values(done_at=now, result="expired: its primary answered throughout"))
    orphans = [t for t in conn.execute(_OPEN_TOKENS).scalars() if t not in live_tokens]
    if orphans:
        conn.execute(update(discard_events).where(discard_events.c.sent_token.in_(_EVENT_TOKEN))
                     .values(sent_token=None), {"b_tokens": orphans})
    rows = conn.execute(select(messages).where(
        messages.c.role == "shadow", messages.c.state == mq.QUEUED,
        messages.c.received_at < now - expire_after).limit(1000)).mappings().all()  # the rest next round
    ids = [r["id"] for r in rows]
    if ids:
        conn.execute(update(messages).where(messages.c.id.in_(ids)).values(state=mq.MSG_REMOVED, completed_at=now))
    return [dict(r) for r in rows] + _expire_forks(conn, now, now - expire_after)


def _expire_forks(conn: Connection, now: float, before: float) -> list[dict]:
    """Forks taken before ``before`` end as an unacknowledged shadow does (Exchange: it expires
    after SafetyNetHoldTime + MessageExpirationTimeout): the message leaves the queue once nothing
    else of it is pending, not kept in the Safety Net; returns the messages that ended."""
    old = shadow_forks.c.created_at < before
    ids = sorted(set(conn.execute(select(shadow_forks.c.message_id).where(old).limit(1000)).scalars()))
    if not ids:
        return []
    conn.execute(delete(shadow_forks).where(old, shadow_forks.c.message_id.in_(ids)))
    ended = []
    for mid in ids:
        try:
            if mq.finish_if_done(conn, mid, now, 0.0):
                ended.append(mid)
        except LookupError:  # a fork left by a message no longer in the queue: nothing to end
            continue
    return [mq.message_row(conn, mid) or {"id": mid} for mid in ended]
