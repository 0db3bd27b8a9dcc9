"""Delivery: the queue scheduler, the send connector (aiosmtplib), local mailbox delivery, expiry.

It owns taking due work from the queue database, one session per next hop
(several messages per session), turning each reply into an outcome
(2xx delivered, 4xx or no connection: DEFER and retry with back-off, 5xx: FAIL
and a DSN), expiry after *MessageExpirationTimeout*, and the background purge
of the Safety Net and the DeliveredTo table. It writes every outcome through the
store's group-commit writer and logs tracking events only after the commit.
It never sends a DSN to the null sender, nor for a DSN, nor for a copy marked
suppress_dsn (resubmitted from Safety Net).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
import uuid
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import aiosmtplib
from sqlalchemy import insert

from transportd import faults
from transportd.smtp import client as smtpclient
from transportd.queue import messages as mq
from transportd.config import peer_tls_options
from transportd.smtp.dsn import RecipientReport, build_dsn, dsn_needs_utf8, status_from_reply
from transportd.smtp.envelope import plan_send
from transportd.queue.messages import NewMessage, Outcome, WorkItem
from transportd.smtp.server import split_headers
from transportd.redundancy.protocol import ProtocolError
from transportd.queue.routing import DNS, MAILBOX, PEER, bifurcate
from transportd.queue.store import StoreError, shadow_forks

log = logging.getLogger("transportd.node.delivery")

EXPIRED_REPLY = "550 4.4.7 QUEUE.Expired; message expired"


@dataclass
class SmtpTarget:
    host: str
    port: int


class NextHopUnavailable(Exception):
    """No session could be opened to any host of a next hop (a DEFER for the whole batch)."""


class NextHopPermanentError(Exception):
    """The next hop can never be reached (no such domain, null MX): FAIL with this reply and a DSN."""

    def __init__(self, reply: str):
        super().__init__(reply)
        self.reply = reply


def dsn_message(cfg: Any, original: dict, original_body: bytes, reports: Sequence[RecipientReport],
                now: float) -> NewMessage | None:
    """The DSN (a new message from <>) for failed recipients, or None when none may be sent."""
    sender = original.get("sender") or ""
    if not sender or original.get("origin") == "dsn" or original.get("suppress_dsn"):
        return None
    if not reports:
        return None
    # RFC 6533: a UTF-8 DSN when the original came with SMTPUTF8 (its sender's side speaks it) and
    # holds UTF-8; it then travels with SMTPUTF8 itself. Otherwise the classic 7-bit DSN.
    utf8 = dsn_needs_utf8(sender, list(reports), original_body, bool(original.get("smtputf8")))
    data = build_dsn(
        reporting_mta=cfg.node.name, original_sender=sender, original_message=original_body,
        recipients=list(reports),
        arrival_date=_dt(original.get("received_at") or now), now=_dt(now), utf8=utf8,
    )
    head, _ = split_headers(data)
    msgid = ""
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"message-id:"):
            msgid = line.split(b":", 1)[1].strip().decode("ascii", "replace")
    return NewMessage(
        network_message_id=str(uuid.uuid4()), sender="", data=data,
        recipients=bifurcate([sender], cfg), received_at=now,
        expires_at=now + cfg.delivery.message_expiration_timeout,
        message_id=msgid, submit_time=email.utils.formatdate(now, usegmt=True),
        subject="Delivery delayed" if all(r.action == "delayed" for r in reports) else "Undeliverable",
        origin="dsn", smtputf8=utf8, body_type="8BITMIME" if utf8 else "",
        dsn_of=original.get("id"),
    )


def _dt(ts: float):
    from datetime import datetime, timezone
    return datetime.fromtimestamp(ts, tz=timezone.utc)


class DeliveryAgent:
    """Runs in the node's event loop: scheduler tick, per-queue sessions, housekeeping."""

    def __init__(self, node: Any):
        self.node = node
        self.cfg = node.cfg
        self.store = node.store
        self._wake = asyncio.Event()
        self._in_flight: set[int] = set()
        self._sessions_per_queue: dict[int, int] = defaultdict(int)
        self._sessions_total = 0
        self._tasks: set[asyncio.Task] = set()
        # One lock per mailbox being delivered to right now: held only by the deliveries using it,
        # so the table does not grow with every recipient ever seen.
        self._mailbox_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._last_housekeeping = 0.0
        self._rotate = 0  # round-robin start over the due queues
        self._last_expiry = 0.0
        self._stopping = False

    def wake(self) -> None:
        self._wake.set()

    # -------------------------------------------------------------------- main loop

    async def run(self) -> None:
        interval = self.cfg.delivery.queue_poll_interval
        while not self._stopping:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self._stopping:
                break
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - the loop must survive; the queue is the truth
                log.exception("delivery scheduler tick failed; retrying in %.1fs", interval)

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def tick(self) -> None:
        now = time.time()
        if now - self._last_expiry >= 1.0:
            self._last_expiry = now
            await self.expire(now)
        if now - self._last_housekeeping >= min(10.0, self.cfg.delivery.queue_poll_interval * 10):
            self._last_housekeeping = now
            await self.housekeeping(now)
            await self.release_orphans(now)
            if self.cfg.delivery.delay_notification_timeout > 0:
                await self.notify_delays(now)  # a scan of the queued messages: at this slower pace
        d = self.cfg.delivery
        busy = dict(self._sessions_per_queue)
        free_total = max(0, d.max_outbound_connections - self._sessions_total)

        def quota(qid: int) -> int:
            # As many recipients as this queue's free sessions can take: a saturated queue is skipped.
            free = min(d.max_per_domain_outbound_connections - busy.get(qid, 0), free_total)
            return max(0, free) * d.max_messages_per_connection
        self._rotate += 1
        work = await self.store.aread(lambda c: mq.due_work(c, now, exclude=self._in_flight, quota=quota,
                                                            start=self._rotate))
        by_queue: dict[int, list[WorkItem]] = defaultdict(list)
        for item in work:
            by_queue[item.queue_id].append(item)
        for qid, items in by_queue.items():
            while items and self._sessions_per_queue[qid] < d.max_per_domain_outbound_connections \
                    and self._sessions_total < d.max_outbound_connections:
                batch, items = items[:d.max_messages_per_connection], items[d.max_messages_per_connection:]
                ids = [r for it in batch for r in it.recipient_ids]
                claimed = set(await self.store.write(lambda c, ids=ids: mq.mark_active(c, ids, now)))
                for it in batch:
                    keep = [(r, a) for r, a in zip(it.recipient_ids, it.addresses) if r in claimed]
                    it.recipient_ids = [r for r, _ in keep]
                    it.addresses = [a for _, a in keep]
                batch = [it for it in batch if it.recipient_ids]
                if not batch:
                    continue
                self._in_flight.update(r for it in batch for r in it.recipient_ids)
                self._sessions_per_queue[qid] += 1
                self._sessions_total += 1
                task = asyncio.ensure_future(self._run_batch(qid, batch))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _run_batch(self, qid: int, batch: list[WorkItem]) -> None:
        try:
            if batch[0].delivery_type == MAILBOX:
                await self.deliver_local(batch)
            else:
                await self.deliver_smtp(batch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - per-message failures are caught below; this is the rest
            log.exception("delivery to queue %s failed unexpectedly", batch[0].queue_identity)
            # Back to Retry (counted per message) so they are not stuck until a restart.
            try:
                await self._internal_failure(batch, "deliver", exc)
            except Exception:  # noqa: BLE001
                log.exception("could not record the failure")
        finally:
            for it in batch:
                self._in_flight.difference_update(it.recipient_ids)
            self._sessions_per_queue[qid] -= 1
            self._sessions_total -= 1
            self.wake()

    # -------------------------------------------------------------------- outcomes

    def _dsn_for(self, it: WorkItem, row: dict, body: bytes, failed: list[Outcome], remote: str,
                 expiry: bool, now: float) -> NewMessage | None:
        faults.check("dsn", row)
        addr = dict(zip(it.recipient_ids, it.addresses))
        reports = [RecipientReport(address=addr[o.recipient_id], action="failed",
                                   status="4.4.7" if expiry else _status(o.reply), diagnostic=o.reply,
                                   remote_mta="" if expiry else remote) for o in failed]
        return dsn_message(self.cfg, row, body, reports, now)

    async def _commit(self, batch: list[WorkItem], outcomes: dict[int, list[Outcome]], now: float,
                      queue_error: str | None = None, remote: str = "",
                      forks: Sequence[tuple[int, str, str, int, str | None]] = (),
                      internal: dict[int, tuple[str, BaseException]] | None = None,
                      expiry: bool = False) -> None:
        """Write outcomes (and DSNs) durably, then log the tracking events.

        ``internal``: messages whose handling failed with an internal error (step, error); their
        outcomes are Retry with 451 4.3.0 and the failure counts towards the Poison queue, in the
        same commit. A message delivered to some recipient has its earlier failures forgotten.
        ``expiry``: the outcomes are expiries (no queue attempt; FAIL from ROUTING, DSN 4.4.7).
        """
        d = self.cfg.delivery
        hold = self.cfg.safety_net.safety_net_hold_time
        internal = dict(internal or {})
        # DSNs are built before the commit, one message at a time: a DSN that cannot be built
        # keeps that message's recipients in Retry (an internal failure), never failed silently,
        # and never holds up the other messages of the batch.
        dsns: dict[int, tuple[dict, NewMessage]] = {}
        for it in batch:
            outs = outcomes.get(it.message_id, [])
            failed = [o for o in outs if o.status == mq.FAILED]
            if not failed or it.message_id in internal:
                continue
            row, body = await self.store.aread(lambda c, m=it.message_id: (mq.message_row(c, m), mq.body(c, m)))
            if row is None or body is None:
                continue
            try:
                dsn = self._dsn_for(it, row, body, failed, remote, expiry, now)
            except Exception as exc:  # noqa: BLE001 - isolated per message (Poison queue)
                internal[it.message_id] = ("dsn", exc)
                reply = _internal_reply("dsn", exc)
                outcomes[it.message_id] = [Outcome(o.recipient_id, mq.RETRY, reply) if o.status == mq.FAILED
                                           else o for o in outs]
                continue
            if dsn is not None:
                dsns[it.message_id] = (row, dsn)
        threshold = self.node.poison_threshold

        def job(conn):
            created, poisoned = {}, []
            if batch and not expiry:
                mq.queue_attempt_result(conn, batch[0].queue_id, now, error=queue_error,
                                        retry_interval=d.transient_failure_retry_interval,
                                        retry_count=d.transient_failure_retry_count,
                                        long_interval=d.outbound_connection_failure_retry_interval)
            for it in batch:
                mid = it.message_id
                mq.record_outcomes(conn, outcomes.get(mid, []), now, retry_interval=d.transient_failure_retry_interval,
                                   retry_count=d.transient_failure_retry_count,
                                   long_interval=d.outbound_connection_failure_retry_interval)
                if mid in internal:
                    if mq.count_internal_failure(conn, mid, threshold):
                        poisoned.append(mid)
                elif any(o.status == mq.DELIVERED for o in outcomes.get(mid, ())):
                    mq.reset_poison_count(conn, mid)  # it got through: earlier failures no longer count
                if mid in dsns:
                    created[mid] = (mq.enqueue(conn, dsns[mid][1]), dsns[mid][1])
                for message_id, primary, guid, queue_id, primary_dbid in forks:
                    if message_id == mid:
                        conn.execute(insert(shadow_forks).values(message_id=message_id, primary_node=primary,
                                                                 shadow_guid=guid, queue_id=queue_id,
                                                                 created_at=now, primary_dbid=primary_dbid))
                mq.finish_if_done(conn, mid, now, hold)
            return created, poisoned

        created, poisoned = await self.store.write(job)
        rows = await self.store.aread(lambda c: {it.message_id: mq.message_row(c, it.message_id) for it in batch})
        for it in batch:
            row = rows.get(it.message_id) or {"id": it.message_id}
            if it.message_id in internal:
                step, exc = internal[it.message_id]
                ids = {"internal_message_id": it.message_id, "network_message_id": row.get("network_message_id", "")}
                log.error("%s of message %s to %s failed with an internal error: %s: %s", step, it.message_id,
                          it.queue_identity, exc.__class__.__name__, exc, exc_info=exc, extra=ids)
                self.node.metrics.internal_failures.labels(step).inc()
            self._log_outcomes(row, it, outcomes.get(it.message_id, []), remote, now, expiry=expiry)
            if it.message_id in created:
                dsn_id, dsn = created[it.message_id]
                self.node.log_dsn(row, dsn_id, dsn)
            if it.message_id in poisoned:
                step, exc = internal[it.message_id]
                self.node.poisoned(row, f"{step}: {exc.__class__.__name__}: {exc}")
        if created:
            self.wake()

    async def _internal_failure(self, items: list[WorkItem], step: str, exc: BaseException,
                                remote: str = "") -> None:
        """Record that handling ``items`` failed with an internal error (Retry, counted)."""
        reply = _internal_reply(step, exc)
        await self._commit(items, {it.message_id: [Outcome(r, mq.RETRY, reply) for r in it.recipient_ids]
                                   for it in items}, time.time(), remote=remote,
                           internal={it.message_id: (step, exc) for it in items}, expiry=step == "expire")

    def _log_outcomes(self, row: dict, it: WorkItem, outs: list[Outcome], remote: str, now: float,
                      expiry: bool = False) -> None:
        addr = dict(zip(it.recipient_ids, it.addresses))
        groups: dict[tuple[str, str, bool], list[str]] = defaultdict(list)
        for o in outs:
            groups[(o.status, o.reply, o.duplicate)].append(addr.get(o.recipient_id, ""))
        for (status, reply, dup), rcpts in groups.items():
            if status == mq.DELIVERED:
                if it.delivery_type == MAILBOX:
                    event = "DUPLICATEDELIVER" if dup else "DELIVER"
                    self.node.track(event, "STOREDRIVER", row, recipients=rcpts,
                                    recipient_status=["250 2.0.0 " + ("duplicate dropped" if dup else "delivered")]
                                    * len(rcpts), source_context=f"MDB:{it.next_hop}")
                elif it.delivery_type == PEER:
                    self.node.track("SEND", "SMTP", row, recipients=rcpts, recipient_status=[reply] * len(rcpts),
                                    source_context=reply, connector_id=it.queue_identity, server_ip=remote)
                else:
                    self.node.track("SENDEXTERNAL", "SMTP", row, recipients=rcpts,
                                    recipient_status=[reply] * len(rcpts), source_context=reply,
                                    connector_id=it.queue_identity, server_ip=remote)
            elif status == mq.RETRY:
                self.node.track("DEFER", "SMTP", row, recipients=rcpts, recipient_status=[reply] * len(rcpts),
                                source_context=it.queue_identity, connector_id=it.queue_identity)
            elif expiry:
                self.node.track("FAIL", "ROUTING", row, recipients=rcpts, recipient_status=[reply] * len(rcpts),
                                source_context="MessageExpired")
            else:
                self.node.track("FAIL", "SMTP", row, recipients=rcpts, recipient_status=[reply] * len(rcpts),
                                source_context=it.queue_identity, connector_id=it.queue_identity)

    # -------------------------------------------------------------------- local mailbox

    async def deliver_local(self, batch: list[WorkItem]) -> None:
        for it in batch:
            try:
                await self._deliver_local_one(it)
            except asyncio.CancelledError:
                raise
            except StoreError as exc:
                log.error("queue database unavailable while delivering message %s: %s", it.message_id, exc)
            except Exception as exc:  # noqa: BLE001 - one message never holds up the others
                await self._safely(self._internal_failure([it], "deliver", exc), it)

    async def _deliver_local_one(self, it: WorkItem) -> None:
        window = self.cfg.mailbox.duplicate_detection_window
        row, body = await self.store.aread(lambda c, m=it.message_id: (mq.message_row(c, m), mq.body(c, m)))
        now = time.time()
        if row is None or body is None:
            outs = [Outcome(r, mq.FAILED, "550 5.3.0 message body missing from the queue database")
                    for r in it.recipient_ids]
            await self._commit([it], {it.message_id: outs}, now)
            return
        await faults.acheck("deliver", row)
        outs: list[Outcome] = []
        for rid, address in zip(it.recipient_ids, it.addresses):
            lock = self._mailbox_locks.get(address.lower())
            if lock is None:
                lock = self._mailbox_locks[address.lower()] = asyncio.Lock()
            async with lock:
                dup = await self.store.aread(lambda c, a=address: mq.already_delivered(
                    c, a, row["message_id"], row["submit_time"], now, window))
                if dup:
                    outs.append(Outcome(rid, mq.DELIVERED, "250 2.0.0 duplicate", duplicate=True))
                    continue
                try:
                    _, stored = await asyncio.to_thread(
                        self.node.mailboxes.deliver, address, row["network_message_id"], body,
                        row["received_at"])
                except OSError as exc:
                    outs.append(Outcome(rid, mq.RETRY, f"451 4.3.0 mailbox store error: {exc.strerror}"))
                    continue
                outs.append(Outcome(rid, mq.DELIVERED, "250 2.0.0 delivered", duplicate=not stored))
                # Remembered before the mailbox lock is released, so that a copy of the same
                # message in a concurrent batch sees this delivery and is dropped as a duplicate.
                await self.store.write(lambda c, a=address: mq.remember_delivery(
                    c, a, row["message_id"], row["submit_time"], now))
        await self._commit([it], {it.message_id: outs}, now)

    # -------------------------------------------------------------------- SMTP send connector

    async def targets(self, item: WorkItem) -> list[SmtpTarget]:
        if item.delivery_type == PEER:
            peer = self.node.shadow.by_name.get(item.next_hop) if self.node.shadow else None
            if peer is None:
                raise NextHopUnavailable(f"{item.next_hop} is not a configured peer")
            host, _, port = peer.transport.rpartition(":")
            return [SmtpTarget(host, int(port))]
        if item.delivery_type == DNS:
            return await resolve_mx(item.next_hop, self.cfg.delivery.mx_port)
        host, _, port = item.next_hop.rpartition(":")
        return [SmtpTarget(host.strip("[]"), int(port))]

    async def _connect(self, targets: list[SmtpTarget], peer: str | None = None
                       ) -> tuple[aiosmtplib.SMTP, SmtpTarget]:
        d = self.cfg.delivery
        errors = []
        for t in targets:
            tls = peer_tls_options(self.cfg) if peer is not None else {"start_tls": None, "validate_certs": False}
            client = aiosmtplib.SMTP(hostname=t.host, port=t.port, local_hostname=self.cfg.node.name,
                                     timeout=d.send_connection_inactivity_timeout, **tls)
            try:
                await asyncio.wait_for(client.connect(timeout=d.send_connect_timeout), d.send_connect_timeout + 1)
                await client.ehlo()
                if peer is not None:
                    if self.node.shadow.enabled and client.supports_extension("xshadowrequest"):
                        await self.node.shadow.hop_session_start(client, peer)
                    else:  # no hop-by-hop shadow: shadow redundancy is disabled here or there
                        await self.node.shadow.peer_auth(client)
                return client, t
            except (aiosmtplib.SMTPException, OSError, asyncio.TimeoutError, ProtocolError) as exc:
                errors.append(f"{t.host}:{t.port}: {_describe(exc)}")
                try:
                    client.close()
                except Exception:  # noqa: BLE001
                    pass
        raise NextHopUnavailable("; ".join(errors) or "no hosts for next hop")

    async def deliver_smtp(self, batch: list[WorkItem]) -> None:
        now = time.time()
        peer = batch[0].next_hop if batch[0].delivery_type == PEER else None
        try:
            targets = await self.targets(batch[0])
            client, target = await self._connect(targets, peer)
        except NextHopPermanentError as exc:
            await self._commit(batch, {it.message_id: [Outcome(r, mq.FAILED, exc.reply) for r in it.recipient_ids]
                                       for it in batch}, now)
            return
        except NextHopUnavailable as exc:
            reply = f"451 4.4.0 Unable to connect to {batch[0].next_hop}: {exc}"
            await self._commit(batch, {it.message_id: [Outcome(r, mq.RETRY, reply) for r in it.recipient_ids]
                                       for it in batch}, now, queue_error=reply)
            return
        remote = target.host
        progressed = False  # anything delivered or failed in this session
        try:
            for i, it in enumerate(batch):
                guid = str(uuid.uuid4()) if peer and getattr(client, "peer_dbid", None) else None
                try:
                    outs = await self._send_one(client, it, xshadow=guid)
                except (aiosmtplib.SMTPServerDisconnected, aiosmtplib.SMTPTimeoutError, OSError) as exc:
                    reply = f"451 4.4.2 Connection to {target.host}:{target.port} lost: {_describe(exc)}"
                    rest = batch[i:]
                    await self._commit(rest, {x.message_id: [Outcome(r, mq.RETRY, reply) for r in x.recipient_ids]
                                              for x in rest}, time.time(), queue_error=reply, remote=remote)
                    return
                except (asyncio.CancelledError, StoreError):
                    raise
                except Exception as exc:  # noqa: BLE001 - this message only: the others go on
                    await self._internal_failure([it], "deliver", exc, remote=remote)
                    if i + 1 < len(batch) and not await _rset_ok(client):
                        # The session cannot go on: the rest is retried on a new one, not counted.
                        reply = f"451 4.4.2 Session to {target.host}:{target.port} reset after an internal error"
                        rest = batch[i + 1:]
                        await self._commit(rest, {x.message_id: [Outcome(r, mq.RETRY, reply)
                                                                 for r in x.recipient_ids] for x in rest},
                                           time.time(), remote=remote)
                        return
                    continue
                progressed = progressed or any(o.status != mq.RETRY for o in outs)
                # A session in which the next hop deferred everything puts the queue in Retry,
                # with the reply as its last error, as a failed connection does.
                queue_error = outs[-1].reply if outs and not progressed and i == len(batch) - 1 else None
                forks = [(it.message_id, peer, guid, it.queue_id, getattr(client, "peer_dbid", None))] if guid and any(
                    o.status == mq.DELIVERED for o in outs) else []
                await self._commit([it], {it.message_id: outs}, time.time(), queue_error=queue_error,
                                   remote=remote, forks=forks)
        finally:
            if getattr(client, "discards_unapplied", False):
                client.close()
            else:
                try:
                    await asyncio.wait_for(client.quit(), 5)
                except Exception:  # noqa: BLE001
                    client.close()

    async def _send_one(self, client: aiosmtplib.SMTP, it: WorkItem, xshadow: str | None = None) -> list[Outcome]:
        row, body = await self.store.aread(lambda c, m=it.message_id: (mq.message_row(c, m), mq.body(c, m)))
        if row is None or body is None:
            return [Outcome(r, mq.FAILED, "550 5.3.0 message body missing from the queue database")
                    for r in it.recipient_ids]
        await faults.acheck("deliver", row)
        # SMTPUTF8 and 8BITMIME as the message needs them and the next hop offers them; a next hop
        # that cannot take it gets no attempt (5.6.7 / 5.6.9 / 5.6.3 and a DSN).
        plan = plan_send(row["sender"], it.addresses, body, smtputf8=bool(row["smtputf8"]),
                         body_type=row["body_type"] or "",
                         next_hop_smtputf8=client.supports_extension("smtputf8"),
                         next_hop_8bitmime=client.supports_extension("8bitmime"))
        if plan.error:
            return [Outcome(r, mq.FAILED, plan.error) for r in it.recipient_ids]
        body = plan.data
        options = list(plan.options)
        if client.supports_extension("size"):
            options.append(f"SIZE={len(body)}")
        if xshadow:
            options.append(f"XSHADOW={xshadow}")
        try:
            await smtpclient.mail(client, row["sender"], options)
        except aiosmtplib.SMTPResponseException as exc:
            status = mq.FAILED if exc.code >= 500 else mq.RETRY
            await _rset(client)
            return [Outcome(r, status, _reply(exc)) for r in it.recipient_ids]
        outs: dict[int, Outcome] = {}
        accepted: list[int] = []
        for rid, address in zip(it.recipient_ids, it.addresses):
            try:
                resp = await smtpclient.rcpt(client, address)
                accepted.append(rid)
                outs[rid] = Outcome(rid, mq.DELIVERED, f"{resp.code} {resp.message}")
            except aiosmtplib.SMTPResponseException as exc:
                outs[rid] = Outcome(rid, mq.FAILED if exc.code >= 500 else mq.RETRY, _reply(exc))
        if not accepted:
            await _rset(client)
            return list(outs.values())
        try:
            resp = await client.data(body)
            reply = f"{resp.code} {resp.message}"
            for rid in accepted:
                outs[rid] = Outcome(rid, mq.DELIVERED, reply)
        except aiosmtplib.SMTPResponseException as exc:
            status = mq.FAILED if exc.code >= 500 else mq.RETRY
            for rid in accepted:
                outs[rid] = Outcome(rid, status, _reply(exc))
            await _rset(client)
        return list(outs.values())

    # -------------------------------------------------------------------- expiry and housekeeping

    async def expire(self, now: float) -> None:
        expired = await self.store.aread(lambda c: mq.expired_recipients(c, now))
        if not expired:
            return
        by_msg: dict[int, list[dict]] = defaultdict(list)
        for r in expired:
            by_msg[r["message_id"]].append(r)
        for mid, rcpts in by_msg.items():
            # Claim them (Active) so record_outcomes applies uniformly, then fail them with a DSN.
            ids = [r["id"] for r in rcpts]
            claimed = set(await self.store.write(lambda c, ids=ids: mq.mark_active(c, ids, now)))
            rcpts = [r for r in rcpts if r["id"] in claimed]
            if not rcpts:
                continue
            item = WorkItem(queue_id=0, queue_identity="expiry", delivery_type="Expiry", next_hop="",
                            message_id=mid, recipient_ids=[r["id"] for r in rcpts],
                            addresses=[r["address"] for r in rcpts])
            outs = [Outcome(r["id"], mq.FAILED, EXPIRED_REPLY + (f" (last error: {r['last_error']})"
                                                                 if r["last_error"] else "")) for r in rcpts]
            try:
                faults.check("expire", {"id": mid, **(await self.store.aread(lambda c, m=mid: mq.message_row(c, m))
                                                     or {})})
                await self._commit([item], {mid: outs}, now, expiry=True)
            except Exception as exc:  # noqa: BLE001 - one message never holds up the others
                await self._safely(self._internal_failure([item], "expire", exc), item)

    async def notify_delays(self, now: float) -> None:
        """One delay DSN (RFC 3464, action delayed) per message waiting longer than
        *DelayNotificationTimeout*; one message's failure never stops the others."""
        timeout = self.cfg.delivery.delay_notification_timeout
        due = await self.store.aread(lambda c: mq.delayed_messages(c, now, timeout))
        for m in due:
            try:
                body = await self.store.aread(lambda c, mid=m["id"]: mq.body(c, mid))
                if body is None:
                    continue
                faults.check("dsn", m)
                reports = [RecipientReport(address=r["address"], action="delayed",
                                           status=_status(r["last_error"] or "451 4.4.1"),
                                           diagnostic=r["last_error"] or "") for r in m["waiting"]]
                dsn = dsn_message(self.cfg, m, body, reports, now)

                def job(conn, mid=m["id"], dsn=dsn):
                    conn.execute(mq.UPDATE_MESSAGE, {"b_id": mid, "delay_dsn_at": now})
                    return mq.enqueue(conn, dsn) if dsn is not None else None
                dsn_id = await self.store.write(job)
            except Exception as exc:  # noqa: BLE001 - isolated per message
                await self.node.message_failed(m, "dsn", exc)
                continue
            if dsn_id is not None:
                self.node.log_dsn(m, dsn_id, dsn)
                self.wake()

    async def _safely(self, coro: Any, item: WorkItem) -> None:
        """Run a recording step; if even that fails, its recipients are left to the next tick."""
        try:
            await coro
        except Exception:  # noqa: BLE001
            log.exception("could not record the internal failure of message %s", item.message_id,
                          extra={"internal_message_id": item.message_id, "network_message_id": ""})

    async def release_orphans(self, now: float) -> None:
        """Recipients left Active, messages left pending, whose owner in this process is gone
        (a commit that failed): made deliverable again without a restart."""
        accepting = set(getattr(self.node, "accepting", ()))
        copy_timeout = self.cfg.shadow_redundancy.shadow_copy_timeout
        try:
            n_active, n_pending = await self.store.write(lambda c: mq.release_orphans(
                c, now, active_owned=set(self._in_flight), pending_owned=accepting, active_grace=1.0,
                pending_grace=copy_timeout + 5.0))
        except Exception as exc:  # noqa: BLE001 - tried again at the next housekeeping
            log.error("releasing orphaned transient states failed: %s", exc)
            return
        if n_active or n_pending:
            log.warning("%d recipient(s) left Active and %d message(s) left pending by a failed commit are "
                        "deliverable again", n_active, n_pending)
            self.wake()

    async def housekeeping(self, now: float) -> None:
        window = self.cfg.mailbox.duplicate_detection_window
        n_msgs, n_dup = await self.store.write(lambda c: mq.purge_expired(c, now, window))
        if n_msgs or n_dup:
            log.info("housekeeping: %d message(s) left the Safety Net, %d DeliveredTo entries expired",
                     n_msgs, n_dup)


async def resolve_mx(domain: str, port: int) -> list[SmtpTarget]:
    """MX hosts by preference, else the domain's own address (RFC 5321 5.1); [] when none."""
    import dns.asyncresolver
    import dns.exception
    import dns.resolver
    try:
        answer = await dns.asyncresolver.resolve(domain, "MX", lifetime=10)
        mx = sorted((r.preference, str(r.exchange).rstrip(".")) for r in answer)
        hosts = [h for _, h in mx if h]
        if not hosts:
            raise NextHopPermanentError(f"556 5.1.10 {domain} does not accept mail (null MX, RFC 7505)")
        return [SmtpTarget(h, port) for h in hosts]
    except dns.resolver.NoAnswer:
        return [SmtpTarget(domain, port)]
    except dns.resolver.NXDOMAIN:
        raise NextHopPermanentError(f"550 5.1.2 Host or domain name not found: {domain}") from None
    except dns.exception.DNSException as exc:
        raise NextHopUnavailable(f"MX lookup for {domain} failed: {exc}") from None


async def _rset_ok(client: aiosmtplib.SMTP) -> bool:
    """RSET after a failure in the middle of a transaction: True when the session can go on."""
    if not client.is_connected:
        return False
    try:
        await asyncio.wait_for(client.rset(), 10)
        return True
    except Exception:  # noqa: BLE001
        return False


async def _rset(client: aiosmtplib.SMTP) -> None:
    try:
        await client.rset()
    except aiosmtplib.SMTPException:
        pass


def _reply(exc: aiosmtplib.SMTPResponseException) -> str:
    return f"{exc.code} {exc.message}".strip()


def _status(reply: str) -> str:
    try:
        code = int(reply[:3])
    except ValueError:
        return "5.0.0"
    return status_from_reply(code, reply[4:])


def _internal_reply(step: str, exc: BaseException) -> str:
    return f"{mq.INTERNAL_ERROR} in {step}: {exc.__class__.__name__}: {_describe(exc)}"[:500]


def _describe(exc: BaseException) -> str:
    text = str(exc) or exc.__class__.__name__
    return text.replace("\r", " ").replace("\n", " ")[:300]
