"""Delivery outcomes tracked, then made durable: recipient states, queue retry state, DSNs, forks.

It owns turning what a connector reports (a ``Delivered`` batch: outcomes per
recipient, the queue's error, hop-by-hop forks, internal failures) into one
commit through the store's group-commit writer, building the DSNs of failed
recipients before that commit (one message at a time: a DSN that cannot be
built keeps that message in Retry as an internal failure), counting internal
failures towards the Poison queue, and the tracking events: those of the
outcomes before the commit (they happened at the next hop or in the mailbox
whether it is recorded or not: a kill -9 right after the commit must not lose
them), those of what the commit made (a DSN, a move to Poison) after it. It
never sends a DSN to the null sender, nor for a DSN, nor for a copy marked
suppress_dsn (resubmitted from the Safety Net). It never talks SMTP.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Iterable, Sequence

from transportd import faults
from transportd.errors import StoreError
from transportd.node.events import NodeEvents
from transportd.queue import messages as mq
from transportd.queue import shadows as sq
from transportd.queue.messages import NewMessage, Outcome, WorkItem
from transportd.queue.notices import dsn_message, utc
from transportd.queue.routing import MAILBOX, PEER
from transportd.queue.store import QueueStore
from transportd.redundancy.protocol import delivered_reason, notice_reason
from transportd.smtp import dsnparams
from transportd.smtp.client import describe
from transportd.smtp.dsn import RecipientReport, status_from_reply
from transportd.tracking import format_datetime

log = logging.getLogger("transportd.node.outcomes")


@dataclass
class Delivered:
    """What a connector reports for some messages of a batch, committed as one."""
    items: list[WorkItem]
    outcomes: dict[int, list[Outcome]]  # message id -> one outcome per recipient row
    queue_error: str | None = None  # the next hop itself failed (the queue goes to Retry)
    remote: str = ""  # the host that answered
    remote_address: str = ""  # its address, where the host is a name (MX lookup); else ``remote`` is one
    forks: Sequence[tuple[int, str, str, int, str | None]] = ()  # hop-by-hop shadows kept here
    internal: dict[int, tuple[str, BaseException]] = field(default_factory=dict)  # message id -> (step, error)
    expiry: bool = False  # expiries: FAIL from ROUTING, DSN 4.4.7, no queue attempt
    # The next hop turned a new session away (a 4xx greeting) while ours to it were open: its limit
    # of connections per client. The recipients went back unattempted (READY: no DEFER, no attempt,
    # no queue retry) and the scheduler opens at most this many sessions to it for a while.
    concurrency: int | None = None

    @classmethod
    def every_recipient(cls, items: list[WorkItem], status: str, reply: str, **kw: Any) -> "Delivered":
        return cls(items, {it.message_id: [Outcome(r, status, reply) for r in it.recipient_ids] for it in items},
                   **kw)


def internal_failure(items: list[WorkItem], step: str, exc: BaseException, remote: str = "",
                     remote_address: str = "") -> Delivered:
    """Handling ``items`` failed with an internal error: Retry with 451 4.3.0, counted."""
    reply = internal_reply(step, exc)
    return Delivered.every_recipient(items, mq.RETRY, reply, remote=remote, remote_address=remote_address,
                                     internal={it.message_id: (step, exc) for it in items}, expiry=step == "expire")


def internal_reply(step: str, exc: BaseException) -> str:
    return f"{mq.INTERNAL_ERROR} in {step}: {exc.__class__.__name__}: {describe(exc)}"[:500]


def status_of(reply: str) -> str:
    """The enhanced status code of a reply, from its text or else its code."""
    try:
        code = int(reply[:3])
    except ValueError:
        return "5.0.0"
    return status_from_reply(code, reply[4:])


def _to_tell(it: WorkItem, outs: list[Outcome]) -> list[Outcome]:
    """The outcomes the sender is told of (RFC 3461 4.1): a failure unless NOTIFY leaves FAILURE out;
    a success where NOTIFY has SUCCESS and we are the last to see it: stored in a mailbox here
    (delivered), or sent on to a next hop that does not offer DSN (relayed); one that does offer
    it took NOTIFY with the message and tells the sender itself."""
    params = dict(zip(it.recipient_ids, it.dsn_params))
    out = []
    for o in outs:
        p = params.get(o.recipient_id, "")
        failure = o.status == mq.FAILED and dsnparams.wants(p, dsnparams.FAILURE)
        success = o.status == mq.DELIVERED and not o.duplicate and dsnparams.wants(p, dsnparams.SUCCESS) \
            and (it.delivery_type == MAILBOX or not it.dsn_passed)
        if failure or success:
            out.append(o)
    return out


def _action(it: WorkItem, o: Outcome) -> str:
    if o.status == mq.FAILED:
        return "failed"
    return "delivered" if it.delivery_type == MAILBOX else "relayed"


def _delivered_reasons(it: WorkItem, outs: Iterable[Outcome], noticed: Iterable[Outcome] = ()) -> list[str]:
    """The per-recipient discard reasons of the recipients of ``it`` delivered in ``outs``
    (an address too long for a reply line is left to the message's own discard): ``Delivered=``,
    or for those in ``noticed`` (a success notice queued for them now: RFC 3461 NOTIFY=SUCCESS)
    ``NotifyDelivered=``/``NotifyRelayed=``, so that a promotion sends that notice rather than
    losing it (``Delivered=`` follows once it is out, ``mq.tell_shadows_notified``)."""
    address = dict(zip(it.recipient_ids, it.addresses))
    notice = {o.recipient_id: _action(it, o) for o in noticed if o.status == mq.DELIVERED}
    reasons = (notice_reason(address[o.recipient_id], notice[o.recipient_id]) if o.recipient_id in notice
               else delivered_reason(address[o.recipient_id]) for o in outs
               if o.status == mq.DELIVERED and o.recipient_id in address)
    return [r for r in dict.fromkeys(reasons) if len(r) <= MAX_PER_RECIPIENT_REASON]


def _failed_addresses(it: WorkItem, outs: Iterable[Outcome]) -> list[str]:
    """The addresses of the recipients of ``it`` failed in ``outs``."""
    address = dict(zip(it.recipient_ids, it.addresses))
    return list(dict.fromkeys(address[o.recipient_id] for o in outs
                              if o.status == mq.FAILED and o.recipient_id in address))


MAX_PER_RECIPIENT_REASON = mq.MAX_RECIPIENT_REASON


class OutcomeRecorder:
    def __init__(self, cfg: Any, store: QueueStore, events: NodeEvents):
        self.cfg = cfg
        self.store = store
        self.events = events

    def _dsn_for(self, it: WorkItem, row: dict, body: bytes, told: list[Outcome], remote: str,
                 expiry: bool, now: float) -> NewMessage | None:
        faults.check("dsn", row)
        addr = dict(zip(it.recipient_ids, it.addresses))
        params = dict(zip(it.recipient_ids, it.dsn_params))
        reports = [RecipientReport(address=addr[o.recipient_id], action=_action(it, o),
                                   status="4.4.7" if expiry else status_of(o.reply), diagnostic=o.reply,
                                   remote_mta="" if expiry or o.local or it.delivery_type == MAILBOX else remote,
                                   last_attempt=None if expiry else utc(now),
                                   original_recipient=dsnparams.orcpt_of(params.get(o.recipient_id, "")))
                   for o in told]
        return dsn_message(self.cfg, row, body, reports, now)

    async def _build_dsns(self, d: Delivered, now: float) -> dict[int, tuple[dict, NewMessage]]:
        """DSNs built before the commit, one message at a time: a DSN that cannot be built keeps
        that message's recipients in Retry (an internal failure), never failed silently."""
        dsns: dict[int, tuple[dict, NewMessage]] = {}
        for it in d.items:
            outs = d.outcomes.get(it.message_id, [])
            told = _to_tell(it, outs)
            if not told or it.message_id in d.internal:
                continue
            row, body = await self.store.aread(lambda c, m=it.message_id: (mq.message_row(c, m), mq.body(c, m)))
            if row is None or body is None:
                continue
            try:
                with self.events.handling.step(it.message_id, "dsn"):  # a content step a message could crash
                    dsn = self._dsn_for(it, row, body, told, d.remote, d.expiry, now)
            except Exception as exc:  # noqa: BLE001 - isolated per message (Poison queue)
                d.internal[it.message_id] = ("dsn", exc)
                reply = internal_reply("dsn", exc)
                d.outcomes[it.message_id] = [Outcome(o.recipient_id, mq.RETRY, reply) if o.status == mq.FAILED
                                             else o for o in outs]
                continue
            if dsn is not None:
                dsns[it.message_id] = (row, dsn)
        return dsns

    async def commit(self, d: Delivered, now: float | None = None) -> None:
        """Log the outcomes' tracking events, then write the outcomes (and DSNs, forks, poison
        counts) durably, then log what that commit made (DSNs, moves to the Poison queue).
        A message delivered to some recipient has its earlier internal failures forgotten."""
        now = time.time() if now is None else now
        dl = self.cfg.delivery
        hold = self.cfg.safety_net.safety_net_hold_time
        retry = {"retry_interval": dl.transient_failure_retry_interval,
                 "retry_count": dl.transient_failure_retry_count,
                 "long_interval": dl.outbound_connection_failure_retry_interval}
        dsns = await self._build_dsns(d, now)
        threshold = self.events.poison_threshold

        def job(conn):
            created, poisoned = {}, []
            if d.items and not d.expiry:
                mq.queue_attempt_result(conn, d.items[0].queue_id, now, error=d.queue_error, **retry)
            for it in d.items:
                mid = it.message_id
                mq.record_outcomes(conn, d.outcomes.get(mid, []), now, ready_delay=dl.queue_poll_interval, **retry)
                if mid in d.internal:
                    if mq.count_internal_failure(conn, mid, threshold):
                        poisoned.append(mid)
                elif any(o.status == mq.DELIVERED for o in d.outcomes.get(mid, ())):
                    mq.reset_poison_count(conn, mid)  # it got through: earlier failures no longer count
                if mid in dsns:
                    created[mid] = (mq.enqueue(conn, dsns[mid][1]), dsns[mid][1])
                forks = [f for f in d.forks if f[0] == mid]
                sq.record_forks(conn, forks, now)
                finished = mq.finish_if_done(conn, mid, now, hold)
                if finished != mq.FINISHED:
                    # Delivered or failed while others wait, or done while a DSN about it is not
                    # out yet (its shadows stay to protect the DSN, up to the expiration time):
                    # the shadows learn it per recipient, so that a promotion of theirs does not
                    # deliver these a second time, nor fail them again with a second DSN (a
                    # failed one once its DSN is out: until then they protect the DSN; when it
                    # is out of a finished message, its shadows go). A delivered one whose success
                    # notice was queued now is told with it (a promotion sends the notice). Those
                    # a peer took hop by hop: its fork covers them.
                    outs = d.outcomes.get(mid, [])
                    noticed = _to_tell(it, outs) if mid in dsns else []
                    delivered = [] if forks else _delivered_reasons(it, outs, noticed)
                    if delivered:
                        sq.record_delivered_recipients(conn, mid, delivered, now)
                    failed = [] if finished else _failed_addresses(it, d.outcomes.get(mid, ()))
                    if failed:
                        mq.tell_shadows_failed(conn, mid, now, failed)
            return created, poisoned

        rows = {it.message_id: it.row for it in d.items if it.row is not None}
        unread = [it.message_id for it in d.items if it.row is None]
        if unread:
            rows.update(await self.store.aread(lambda c: {m: mq.message_row(c, m) for m in unread}))
        # The outcomes happened before they are recorded (the next hop answered, the mailbox
        # holds the message): their tracking rows and log lines go first, so that a crash
        # between the two cannot leave a delivered message that tracking shows as never
        # delivered. A crash before the commit sends it again, and the second row tells so.
        for it in d.items:
            row = rows.get(it.message_id) or {"id": it.message_id}
            if it.message_id in d.internal:
                step, exc = d.internal[it.message_id]
                ids = {"internal_message_id": it.message_id, "network_message_id": row.get("network_message_id", "")}
                # the queue database refusing a commit (a full disk) is one line, no traceback
                log.error("%s of message %s to %s failed with an internal error: %s: %s", step, it.message_id,
                          it.queue_identity, exc.__class__.__name__, exc,
                          exc_info=None if isinstance(exc, StoreError) else exc, extra=ids)
                self.events.metrics.internal_failures.labels(step).inc()
            self._track(row, it, d.outcomes.get(it.message_id, []), d.remote, d.remote_address, expiry=d.expiry)
            failed = _failed_addresses(it, d.outcomes.get(it.message_id, ()))
            if failed and row.get("sender") == "":
                # No DSN says so (none for the null sender, RFC 5321 4.5.5): the log does.
                reply = next(o.reply for o in d.outcomes[it.message_id] if o.status == mq.FAILED)
                log.warning("DSN %s to %s could not be delivered and is dropped: %s", it.message_id,
                            ", ".join(failed), reply, extra={"internal_message_id": it.message_id,
                                                             "network_message_id": row.get("network_message_id", "")})

        created, poisoned = await self.store.write(job, queue_changed=bool(dsns))  # a DSN is new work
        for it in d.items:
            faults.check("recorded", rows.get(it.message_id))  # test-only: a kill -9 right after the commit
        # What the commit made: the DSNs (their internal ids) and the moves to the Poison queue.
        for it in d.items:
            row = rows.get(it.message_id) or {"id": it.message_id}
            if it.message_id in created:
                dsn_id, dsn = created[it.message_id]
                self.events.log_dsn(row, dsn_id, dsn)
            if it.message_id in poisoned:
                step, exc = d.internal[it.message_id]
                self.events.poisoned(row, f"{step}: {exc.__class__.__name__}: {exc}")

    async def commit_safely(self, d: Delivered, item: WorkItem) -> None:
        """Commit an internal failure; if even that fails, its recipients are left to the next tick."""
        ids = {"internal_message_id": item.message_id, "network_message_id": ""}
        try:
            await self.commit(d)
        except StoreError as exc:  # the database (a full disk): one line, no traceback
            log.error("could not record the internal failure of message %s: %s", item.message_id, exc, extra=ids)
        except Exception:  # noqa: BLE001
            log.exception("could not record the internal failure of message %s", item.message_id, extra=ids)

    def _track(self, row: dict, it: WorkItem, outs: list[Outcome], remote: str, remote_address: str = "",
               expiry: bool = False) -> None:
        addr = dict(zip(it.recipient_ids, it.addresses))
        groups: dict[tuple[str, str, bool], list[str]] = defaultdict(list)
        for o in outs:
            groups[(o.status, o.reply, o.duplicate)].append(addr.get(o.recipient_id, ""))
        track = self.events.track
        # message-info of DELIVER and SEND rows: "the message origination date-time in UTC" (here,
        # when this node received it)
        origination = format_datetime(datetime.fromtimestamp(row["received_at"], UTC)) if row.get(
            "received_at") else ""
        for (status, reply, dup), rcpts in groups.items():
            statuses = [reply] * len(rcpts)
            if status == mq.DELIVERED and it.delivery_type == MAILBOX:
                track("DUPLICATEDELIVER" if dup else "DELIVER", "STOREDRIVER", row, recipients=rcpts,
                      recipient_status=["250 2.0.0 " + ("duplicate dropped" if dup else "delivered")] * len(rcpts),
                      source_context=f"MDB:{it.next_hop}", message_info=origination)
            elif status == mq.DELIVERED:
                # As Exchange writes SEND rows: the sending server in client-hostname, the next hop
                # (a peer by its node name, else the host that answered) in server-hostname.
                track("SEND" if it.delivery_type == PEER else "SENDEXTERNAL", "SMTP", row, recipients=rcpts,
                      recipient_status=statuses, source_context=reply, connector_id=it.queue_identity,
                      message_info=origination,
                      server_ip=remote_address or remote, client_hostname=self.cfg.node.name,
                      server_hostname=it.next_hop if it.delivery_type == PEER else remote)
            elif status == mq.READY:
                continue  # handed back unattempted (the next hop's connection limit): no event
            elif status == mq.RETRY:
                track("DEFER", "SMTP", row, recipients=rcpts, recipient_status=statuses,
                      source_context=it.queue_identity, connector_id=it.queue_identity)
            elif expiry:
                track("FAIL", "ROUTING", row, recipients=rcpts, recipient_status=statuses,
                      source_context="MessageExpired", connector_id=it.queue_identity)
            else:
                track("FAIL", "SMTP", row, recipients=rcpts, recipient_status=statuses,
                      source_context=it.queue_identity, connector_id=it.queue_identity)
