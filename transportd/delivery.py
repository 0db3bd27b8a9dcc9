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
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import aiosmtplib
from sqlalchemy import insert

from . import mailqueue as mq
from .config import peer_tls_options
from .dsn import RecipientReport, build_dsn, status_from_reply
from .mailqueue import NewMessage, Outcome, WorkItem
from .receive import split_headers
from .protocol import ProtocolError
from .routing import DNS, MAILBOX, PEER, bifurcate
from .store import shadow_forks

log = logging.getLogger("transportd.delivery")

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


def _is_ascii(s: str) -> bool:
    try:
        s.encode("ascii")
        return True
    except UnicodeEncodeError:
        return False


def dsn_message(cfg: Any, original: dict, original_body: bytes, reports: Sequence[RecipientReport],
                now: float) -> NewMessage | None:
    """The DSN (a new message from <>) for failed recipients, or None when none may be sent."""
    sender = original.get("sender") or ""
    if not sender or original.get("origin") == "dsn" or original.get("suppress_dsn"):
        return None
    if not reports:
        return None
    data = build_dsn(
        reporting_mta=cfg.node.name, original_sender=sender, original_message=original_body,
        recipients=list(reports),
        arrival_date=_dt(original.get("received_at") or now), now=_dt(now),
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
        subject="Undeliverable", origin="dsn",
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
        self._mailbox_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._last_housekeeping = 0.0
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
        work = await self.store.aread(lambda c: mq.due_work(c, now, limit=1000, exclude=self._in_flight))
        by_queue: dict[int, list[WorkItem]] = defaultdict(list)
        for item in work:
            by_queue[item.queue_id].append(item)
        d = self.cfg.delivery
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
        except Exception:  # noqa: BLE001 - leave the recipients Active; reset on restart
            log.exception("delivery to queue %s failed unexpectedly", batch[0].queue_identity)
            # Put them back to Retry so they are not stuck until restart.
            outcomes = [Outcome(r, mq.RETRY, "451 4.3.0 internal delivery error")
                        for it in batch for r in it.recipient_ids]
            try:
                await self._commit(batch, {it.message_id: [o for o in outcomes if o.recipient_id in it.recipient_ids]
                                           for it in batch}, time.time())
            except Exception:  # noqa: BLE001
                log.exception("could not record the failure")
        finally:
            for it in batch:
                self._in_flight.difference_update(it.recipient_ids)
            self._sessions_per_queue[qid] -= 1
            self._sessions_total -= 1
            self.wake()

    # -------------------------------------------------------------------- outcomes

    async def _commit(self, batch: list[WorkItem], outcomes: dict[int, list[Outcome]], now: float,
                      queue_error: str | None = None, remote: str = "",
                      forks: Sequence[tuple[int, str, str, int, str | None]] = ()) -> None:
        """Write outcomes (and DSNs) durably, then log the tracking events."""
        d = self.cfg.delivery
        hold = self.cfg.safety_net.safety_net_hold_time
        bodies: dict[int, tuple[dict, bytes]] = {}
        for it in batch:
            if any(o.status == mq.FAILED for o in outcomes.get(it.message_id, [])):
                row, body = await self.store.aread(lambda c, m=it.message_id: (mq.message_row(c, m), mq.body(c, m)))
                if row is not None and body is not None:
                    bodies[it.message_id] = (row, body)

        def job(conn):
            result = {}
            if batch:
                mq.queue_attempt_result(conn, batch[0].queue_id, now, error=queue_error,
                                        retry_interval=d.transient_failure_retry_interval,
                                        retry_count=d.transient_failure_retry_count,
                                        long_interval=d.outbound_connection_failure_retry_interval)
            for it in batch:
                outs = outcomes.get(it.message_id, [])
                mq.record_outcomes(conn, outs, now, retry_interval=d.transient_failure_retry_interval,
                                   retry_count=d.transient_failure_retry_count,
                                   long_interval=d.outbound_connection_failure_retry_interval)
                dsn_id = None
                failed = [o for o in outs if o.status == mq.FAILED]
                if failed and it.message_id in bodies:
                    row, body = bodies[it.message_id]
                    addr = dict(zip(it.recipient_ids, it.addresses))
                    reports = [RecipientReport(address=addr[o.recipient_id], action="failed",
                                               status=_status(o.reply), diagnostic=o.reply,
                                               remote_mta=remote) for o in failed]
                    dsn = dsn_message(self.cfg, row, body, reports, now)
                    if dsn is not None:
                        dsn_id = (mq.enqueue(conn, dsn), dsn)
                for message_id, primary, guid, queue_id, primary_dbid in forks:
                    if message_id == it.message_id:
                        conn.execute(insert(shadow_forks).values(message_id=message_id, primary_node=primary,
                                                                 shadow_guid=guid, queue_id=queue_id,
                                                                 created_at=now, primary_dbid=primary_dbid))
                mq.finish_if_done(conn, it.message_id, now, hold)
                result[it.message_id] = dsn_id
            return result

        dsns = await self.store.write(job)
        rows = await self.store.aread(lambda c: {it.message_id: mq.message_row(c, it.message_id) for it in batch})
        for it in batch:
            self._log_outcomes(rows.get(it.message_id) or {}, it, outcomes.get(it.message_id, []), remote, now)
            created = dsns.get(it.message_id)
            if created:
                self.node.log_dsn(rows.get(it.message_id) or {}, created[0], created[1])
        if any(dsns.values()):
            self.wake()

    def _log_outcomes(self, row: dict, it: WorkItem, outs: list[Outcome], remote: str, now: float) -> None:
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
            else:
                self.node.track("FAIL", "SMTP", row, recipients=rcpts, recipient_status=[reply] * len(rcpts),
                                source_context=it.queue_identity, connector_id=it.queue_identity)

    # -------------------------------------------------------------------- local mailbox

    async def deliver_local(self, batch: list[WorkItem]) -> None:
        window = self.cfg.mailbox.duplicate_detection_window
        for it in batch:
            row, body = await self.store.aread(lambda c, m=it.message_id: (mq.message_row(c, m), mq.body(c, m)))
            now = time.time()
            if row is None or body is None:
                outs = [Outcome(r, mq.FAILED, "550 5.3.0 message body missing from the queue database")
                        for r in it.recipient_ids]
                await self._commit([it], {it.message_id: outs}, now)
                continue
            outs: list[Outcome] = []
            for rid, address in zip(it.recipient_ids, it.addresses):
                async with self._mailbox_locks[address.lower()]:
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
                    await self.node.shadow.hop_session_start(client, peer)
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
                guid = str(uuid.uuid4()) if peer else None
                try:
                    outs = await self._send_one(client, it, xshadow=guid)
                except (aiosmtplib.SMTPServerDisconnected, aiosmtplib.SMTPTimeoutError, OSError) as exc:
                    reply = f"451 4.4.2 Connection to {target.host}:{target.port} lost: {_describe(exc)}"
                    rest = batch[i:]
                    await self._commit(rest, {x.message_id: [Outcome(r, mq.RETRY, reply) for r in x.recipient_ids]
                                              for x in rest}, time.time(), queue_error=reply, remote=remote)
                    return
                progressed = progressed or any(o.status != mq.RETRY for o in outs)
                # A session in which the next hop deferred everything puts the queue in Retry,
                # with the reply as its last error, as a failed connection does.
                queue_error = outs[-1].reply if outs and not progressed and i == len(batch) - 1 else None
                forks = [(it.message_id, peer, guid, it.queue_id, getattr(client, "peer_dbid", None))] if peer and any(
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
        options = []
        utf8 = not _is_ascii(row["sender"]) or not all(_is_ascii(a) for a in it.addresses)
        if utf8:
            if not client.supports_extension("smtputf8"):
                return [Outcome(r, mq.FAILED, "550 5.6.7 next hop does not support SMTPUTF8")
                        for r in it.recipient_ids]
            options.append("SMTPUTF8")
        if not body.isascii():
            if client.supports_extension("8bitmime"):
                options.append("BODY=8BITMIME")
        if client.supports_extension("size"):
            options.append(f"SIZE={len(body)}")
        if xshadow:
            options.append(f"XSHADOW={xshadow}")
        try:
            await client.mail(row["sender"], options=options)
        except aiosmtplib.SMTPResponseException as exc:
            status = mq.FAILED if exc.code >= 500 else mq.RETRY
            await _rset(client)
            return [Outcome(r, status, _reply(exc)) for r in it.recipient_ids]
        outs: dict[int, Outcome] = {}
        accepted: list[int] = []
        for rid, address in zip(it.recipient_ids, it.addresses):
            try:
                resp = await client.rcpt(address)
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
            qid_item = WorkItem(queue_id=0, queue_identity="expiry", delivery_type="Expiry", next_hop="",
                                message_id=mid, recipient_ids=[r["id"] for r in rcpts],
                                addresses=[r["address"] for r in rcpts])
            reply = EXPIRED_REPLY
            outs = [Outcome(r["id"], mq.FAILED, reply + (f" (last error: {r['last_error']})" if r["last_error"]
                                                        else "")) for r in rcpts]
            await self._commit_expiry(qid_item, outs, now)

    async def _commit_expiry(self, it: WorkItem, outs: list[Outcome], now: float) -> None:
        # Same as _commit but without a queue attempt (there was no connection).
        hold = self.cfg.safety_net.safety_net_hold_time
        d = self.cfg.delivery
        row, body = await self.store.aread(lambda c: (mq.message_row(c, it.message_id), mq.body(c, it.message_id)))
        addr = dict(zip(it.recipient_ids, it.addresses))

        def job(conn):
            mq.record_outcomes(conn, outs, now, retry_interval=d.transient_failure_retry_interval,
                               retry_count=d.transient_failure_retry_count,
                               long_interval=d.outbound_connection_failure_retry_interval)
            created = None
            if row is not None and body is not None:
                reports = [RecipientReport(address=addr[o.recipient_id], action="failed", status="4.4.7",
                                           diagnostic=o.reply) for o in outs]
                dsn = dsn_message(self.cfg, row, body, reports, now)
                if dsn is not None:
                    created = (mq.enqueue(conn, dsn), dsn)
            mq.finish_if_done(conn, it.message_id, now, hold)
            return created

        created = await self.store.write(job)
        row = row or {}
        self.node.track("FAIL", "ROUTING", row, recipients=[addr[o.recipient_id] for o in outs],
                        recipient_status=[o.reply for o in outs], source_context="MessageExpired")
        if created:
            self.node.log_dsn(row, created[0], created[1])
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


def _describe(exc: BaseException) -> str:
    text = str(exc) or exc.__class__.__name__
    return text.replace("\r", " ").replace("\n", " ")[:300]
