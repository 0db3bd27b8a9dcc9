"""Delivery agents, as Postfix's are to its qmgr: mailbox, SMTP (smart host, MX) and peer.

Both SMTP connectors send each message as one pipelined group where the next hop offers
PIPELINING: the SMTP connector to next hops outside the boundary (MAIL, RCPT, DATA in one write,
the body after 354; smtp/client.py), the peer connector to a boundary peer over the redundancy
layer's session (MAIL, RCPT, BDAT LAST and the body in one write).

Each connector has ``deliver(batch)``: it takes a batch of one queue's work
items and yields ``Delivered`` reports (outcomes per recipient) as it goes, so
the scheduler commits each message's outcome before the next is sent. A
connector reads the message it delivers from the queue database and never
writes an outcome itself; one message's failure is reported as an internal
failure of that message only, and the rest of the batch goes on. The SMTP
connectors mark in a ``DeliveryDrain`` a transaction under way until the
scheduler has committed its outcome, and start none once the node is stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, AsyncIterator

from transportd import faults
from transportd.config import parse_hostport
from transportd.errors import (
    PEER_FAILURES,
    NextHopPermanentError,
    NextHopUnavailable,
    PeerTransientError,
    ProtocolError,
    StoreError,
    TlsRequired,
)
from transportd.node.handling import NO_MARK, HandlingMark
from transportd.node.outcomes import Delivered, internal_failure
from transportd.queue import messages as mq
from transportd.queue.delivered import DeliveredLog, DeliveredLogError
from transportd.queue.mailbox import MailboxStore
from transportd.queue.messages import Outcome, WorkItem
from transportd.queue.routing import DNS, send_connector_for
from transportd.queue.store import QueueStore
from transportd.redundancy.manager import ShadowManager
from transportd.redundancy.peers import PeerSession, open_session
from transportd.smtp import client as smtpclient
from transportd.smtp.addresses import address_key
from transportd.smtp.client import NextHopSession, SessionCache, describe, failure
from transportd.smtp.dsnparams import DsnRequest
from transportd.smtp.envelope import SendPlan, plan_send
from transportd.smtp.mx import NextHopResolver, SmtpTarget
from transportd.smtp.transaction import OUT_OF_STEP

log = logging.getLogger("transportd.node.connectors")

MISSING_BODY = "550 5.3.0 message body missing from the queue database"
# Messages an SMTP connector plans (converts) at once, each in a worker thread: more gains nothing
# (the conversion holds the GIL), and the default executor keeps threads for the queue database.
CONVERSIONS_AT_ONCE = 2


class MailboxConnector:
    """Local delivery into the Maildir mailbox store, with duplicate detection (DeliveredTo kept
    beside the mailboxes, so a lost queue database does not forget what they hold)."""

    def __init__(self, cfg: Any, store: QueueStore, mailboxes: MailboxStore, delivered: DeliveredLog, *,
                 handling: HandlingMark = NO_MARK):
        self.cfg = cfg
        self.store = store
        self.handling = handling
        self.mailboxes = mailboxes
        self.delivered = delivered
        # One lock per mailbox being delivered to right now: held only by the deliveries using it.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    async def deliver(self, batch: list[WorkItem]) -> AsyncIterator[Delivered]:
        for it in batch:
            try:
                outs = await self._deliver_one(it)
            except asyncio.CancelledError:
                raise
            except StoreError as exc:  # left Active: released by the maintenance once the store is back
                log.error("queue database unavailable while delivering message %s: %s", it.message_id, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - one message never holds up the others
                yield internal_failure([it], "deliver", exc)
                continue
            yield Delivered([it], {it.message_id: outs})

    async def _deliver_one(self, it: WorkItem) -> list[Outcome]:
        window = self.cfg.mailbox.duplicate_detection_window
        row, body = self.store.read_here(lambda c, m=it.message_id: (mq.message_row(c, m), mq.body(c, m)))
        it.row = row
        now = time.time()
        if row is None or body is None:
            return [Outcome(r, mq.FAILED, MISSING_BODY, local=True) for r in it.recipient_ids]
        await faults.acheck("deliver", row)
        with self.handling.step(it.message_id, "deliver"):  # the content step a message could crash
            faults.check("deliver", row)
            # Final delivery: the reverse-path goes in as Return-Path (RFC 5321 4.4), "<>" for a DSN.
            body = b"Return-Path: <" + (row["sender"] or "").encode("utf-8", "surrogateescape") + b">\r\n" + body
        outs: list[Outcome] = []
        for rid, address in zip(it.recipient_ids, it.addresses):
            lock = self._locks.get(address_key(address))  # one mailbox however the address is spelt
            if lock is None:
                lock = self._locks[address_key(address)] = asyncio.Lock()
            async with lock:
                try:
                    dup = await asyncio.to_thread(self.delivered.seen, address, row["message_id"],
                                                  row["submit_time"], now, window)
                except DeliveredLogError as exc:
                    outs.append(Outcome(rid, mq.RETRY, f"451 4.3.0 mailbox store error: {exc}"))
                    continue
                if dup:
                    outs.append(Outcome(rid, mq.DELIVERED, "250 2.0.0 duplicate", duplicate=True))
                    continue
                try:
                    _, stored = await asyncio.to_thread(self.mailboxes.deliver, address, row["network_message_id"],
                                                        body, row["received_at"])
                except OSError as exc:
                    outs.append(Outcome(rid, mq.RETRY, f"451 4.3.0 mailbox store error: {exc.strerror}"))
                    continue
                outs.append(Outcome(rid, mq.DELIVERED, "250 2.0.0 delivered", duplicate=not stored))
                # Remembered before the mailbox lock is released, so that a copy of the same
                # message in a concurrent batch sees this delivery and is dropped as a duplicate.
                try:
                    await asyncio.to_thread(self.delivered.remember, address, row["message_id"],
                                            row["submit_time"], now)
                except DeliveredLogError as exc:  # stored: a later copy may be stored again, never lost
                    log.error("message %s stored for %s but its delivery not remembered: %s",
                              it.message_id, address, exc)
        return outs


class DeliveryDrain:
    """The deliveries a clean stop must let finish: the batches (their tasks) in a transaction whose
    outcome is not committed yet, which the next hop may already hold (its data and dot sent, the
    reply awaited). Cancelled there, a batch would leave the message Active, sent again after the
    restart; so the stop (``Scheduler.stop``) gives these their grace and cancels the others at
    once, and once ``stopping`` no batch starts another transaction."""

    def __init__(self) -> None:
        self.stopping = False
        self._in_transaction: set[asyncio.Task | None] = set()

    def transaction_begins(self) -> None:
        """The running batch writes its first command of a message."""
        self._in_transaction.add(asyncio.current_task())

    def outcome_recorded(self) -> None:
        """The running batch's outcome is committed (or the batch is over): nothing of it in flight."""
        self._in_transaction.discard(asyncio.current_task())

    def in_transaction(self, task: asyncio.Task | None = None) -> bool:
        return (task or asyncio.current_task()) in self._in_transaction


class SessionLost(PeerTransientError):
    """The session broke in a later transaction of a message split over several (the next hop's
    limit of recipients per message): ``settled`` holds the outcomes the earlier ones got, which
    stand."""

    def __init__(self, cause: BaseException, settled: list[Outcome]):
        super().__init__(describe(cause))
        self.settled = settled


class SmtpConnector:
    """Delivery over SMTP: one session per batch, several messages per session; a session to a next
    hop outside the boundary is kept for the next batch a short while (``SessionCache``)."""

    def __init__(self, cfg: Any, store: QueueStore, *, handling: HandlingMark = NO_MARK,
                 drain: DeliveryDrain | None = None):
        self.cfg = cfg
        self.store = store
        self.handling = handling
        self.drain = drain or DeliveryDrain()
        self._converting = asyncio.Semaphore(CONVERSIONS_AT_ONCE)  # messages in _planned's worker threads
        d = cfg.delivery
        self._open_sessions: dict[tuple[str, str], int] = {}  # per next hop: sessions carrying a batch
        self._opening: dict[tuple[str, str], int] = {}  # per next hop: sessions being opened
        self._established: dict[tuple[str, str], float] = {}  # per next hop: when one last opened
        self.cache = SessionCache(d.connection_cache_time, d.max_messages_per_connection,
                                  d.max_per_domain_outbound_connections)
        self.resolver = NextHopResolver(
            [parse_hostport(s, default_port=53) for s in d.external_dns_servers], d.mx_port,
            own_names=[cfg.node.name],
            own_endpoints=[parse_hostport(a) for a in (*cfg.frontend.listen, *cfg.frontend.implicit_tls_listen,
                                                      cfg.transport.listen) if a])

    async def close(self) -> None:
        """QUIT the sessions kept for a next batch (the node stops)."""
        await self.cache.close()

    def _send_connector(self, item: WorkItem) -> Any | None:
        """The send connector of a queue, as the configuration has it now: by its domain's address
        space (MX), or by its smart hosts; None: routing.smart_host's or MX without one."""
        connectors = self.cfg.send_connectors
        if item.delivery_type == DNS:
            return send_connector_for(item.next_hop, connectors)
        return next((c for c in connectors if c.smart_hosts == item.next_hop), None)

    async def targets(self, item: WorkItem) -> list[SmtpTarget]:
        if item.delivery_type == DNS:
            return await self.resolver.targets(item.next_hop)
        return smart_host_targets(item.next_hop)

    async def open(self, item: WorkItem, messages: int = 1) -> tuple[Any, SmtpTarget, PeerSession | None]:
        """A session for a batch of ``messages`` to ``item``'s next hop: a kept one, else a new one."""
        client = self.cache.take(_cache_key(item), messages)
        if client is not None:
            return client, client.target, None
        return await self._connect(item)

    async def _connect(self, item: WorkItem) -> tuple[Any, SmtpTarget, PeerSession | None]:
        d = self.cfg.delivery
        connector = self._send_connector(item)
        client, target = await smtpclient.connect(
            await self.targets(item), local_hostname=self.cfg.node.name, timeout=d.send_connection_inactivity_timeout,
            connect_timeout=d.send_connect_timeout,
            tls=connector.tls_options() if connector else {"start_tls": None, "validate_certs": False})
        return client, target, None

    async def _first_on_kept(self, client: NextHopSession, it: WorkItem) -> tuple[NextHopSession, list[Outcome]]:
        """The batch's first message on a kept session; if the next hop closed that session while
        it waited (its idle timeout, as our write went out: found closed at MAIL, nothing of the
        message taken), once more on a new one. A session that broke once MAIL was accepted (after
        the dot, say, the reply lost) may have given the next hop the message, or a part of it
        (``SessionLost``): an ordinary failure, deferred for the retry interval (RFC 5321 4.5.4.1),
        never sent again at once."""
        try:
            return client, await self._send_one(client, it)
        except (OSError, PeerTransientError) as exc:
            if isinstance(exc, SessionLost) or not client.nothing_taken:
                raise
            log.info("kept session to %s:%s closed by the next hop (%s); opening a new one",
                     client.target.host, client.target.port, describe(exc))
            client.close()
        return await self._on_new_session(it)  # new: another kept one may be as stale

    async def _renewed(self, client: NextHopSession, it: WorkItem, carried: int,
                       reply: str, ended: bool) -> tuple[NextHopSession, list[Outcome]]:
        """The next hop ended with a 421, or deferred the MAIL of, a session that had carried
        messages or was kept from an earlier batch: its limit of messages per connection (Exim's
        smtp_accept_max_per_connection, Exchange's MaxMessagesPerConnection; OpenSMTPD's
        ``max-mails`` answers MAIL ``452 4.5.3`` and keeps the session open) or of idle time, not a
        refusal of the message, of which nothing was taken. It goes at once on a new session, as
        the batch's next ones do; a new session that carried nothing yet is never renewed so (a
        next hop refusing every session or every message)."""
        if ended:
            log.info("%s:%s ended the session after %d message(s) of this batch (%s); going on on a new one",
                     client.target.host, client.target.port, carried, reply)
            client.close()
        else:
            log.info("%s:%s deferred a further transaction on the session after %d message(s) of this batch "
                     "(%s); going on on a new one", client.target.host, client.target.port, carried, reply)
            await client.quit()
        return await self._on_new_session(it)

    async def _on_new_session(self, it: WorkItem) -> tuple[NextHopSession, list[Outcome]]:
        """``it`` on a new session to its next hop, which carries the rest of the batch; a session
        that fails here is closed and the batch goes on as after a failed first message."""
        try:
            client, _, _ = await self._connect(it)
        except NextHopUnavailable as exc:
            raise PeerTransientError(str(exc)) from None
        try:
            return client, await self._send_one(client, it)
        except BaseException:
            client.close()
            raise

    async def _open_counted(self, key: tuple[str, str], item: WorkItem,
                            messages: int) -> tuple[Any, SmtpTarget, PeerSession | None]:
        """``open``, counting per next hop the sessions being opened and open."""
        self._opening[key] = self._opening.get(key, 0) + 1
        try:
            opened = await self.open(item, messages)
        finally:
            self._opening[key] -= 1
        self._open_sessions[key] = self._open_sessions.get(key, 0) + 1
        self._established[key] = time.monotonic()
        return opened

    async def _at_limit(self, key: tuple[str, str]) -> int:
        """How many sessions a next hop that just turned one away (4xx greeting) takes from us: our
        sessions open or kept to it, once those opened beside this one have their answer (a burst's
        extra sessions are refused before the others' EHLO), or 1 when one opened a moment ago (the
        next hop still counts a connection just closed). 0: it takes none; a plain deferral."""
        deadline = time.monotonic() + self.cfg.delivery.send_connect_timeout
        while not self._open_sessions.get(key) and self._opening.get(key) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        n = self._open_sessions.get(key, 0) + self.cache.kept(key)
        recent = time.monotonic() - self._established.get(key, float("-inf")) <= 1 + self.cfg.delivery.connection_cache_time
        return n or int(recent)

    async def deliver(self, batch: list[WorkItem]) -> AsyncIterator[Delivered]:
        key = _cache_key(batch[0])
        try:
            client, target, peer_session = await self._open_counted(key, batch[0], len(batch))
        except NextHopPermanentError as exc:
            yield Delivered.every_recipient(batch, mq.FAILED, exc.reply)
            return
        except NextHopUnavailable as exc:
            reply = unreachable_reply(batch[0].next_hop, exc)
            most = await self._at_limit(key) if exc.busy else 0
            if most:
                # Up, and at its limit of connections from us (Exim's smtp_accept_max_per_host,
                # Exchange's MaxInboundConnectionPerSource): our other sessions carry the batch.
                log.info("%s turned a new session away (%s): its limit; at most %d session(s) to it for %.0fs",
                         batch[0].next_hop, exc, most, self.cfg.delivery.transient_failure_retry_interval)
                yield Delivered.every_recipient(batch, mq.READY, reply, concurrency=most)
                return
            yield Delivered.every_recipient(batch, mq.RETRY, reply, queue_error=reply)
            return
        try:
            async with contextlib.aclosing(self._deliver_on(client, target, peer_session, batch)) as reports:
                async for report in reports:
                    yield report
        finally:
            self._open_sessions[key] -= 1

    async def _deliver_on(self, client: Any, target: SmtpTarget, peer_session: PeerSession | None,
                          batch: list[WorkItem]) -> AsyncIterator[Delivered]:
        remote = {"remote": target.host, "remote_address": target.connect_to}
        progressed = False  # anything delivered or failed in this session
        finished = False  # every message of the batch had its go: the session may be kept
        carried = 0  # messages delivered on the session at hand
        try:
            for i, it in enumerate(batch):
                if self.drain.stopping:
                    break  # the rest stays Active: Ready again at the next start
                hop = peer_session is not None and peer_session.peer_queue_database_id is not None
                guid = str(uuid.uuid4()) if hop else None
                try:
                    if i == 0 and getattr(client, "reused", False):
                        client, outs = await self._first_on_kept(client, it)
                    else:
                        outs = await self._send_one(client, it, xshadow=guid)
                    ended = _ended_by_421(outs)
                    if peer_session is None and (carried or getattr(client, "reused", False)) and (
                            ended or _mail_deferred(client, outs)):
                        client, outs = await self._renewed(client, it, carried, outs[0].reply, ended)
                        carried = 0
                    carried += any(o.status == mq.DELIVERED for o in outs)
                except (OSError, PeerTransientError, ProtocolError) as exc:
                    yield _session_lost(batch[i:], target, exc, getattr(client, "awaiting", None), **remote)
                    return
                except (asyncio.CancelledError, StoreError):
                    raise
                except Exception as exc:  # noqa: BLE001 - this message only: the others go on
                    yield internal_failure([it], "deliver", exc, **remote)
                    if i + 1 < len(batch) and not await smtpclient.rset_ok(client):
                        # The session cannot go on: the rest is retried on a new one, not counted.
                        reply = f"451 4.4.2 Session to {target.host}:{target.port} reset after an internal error"
                        yield Delivered.every_recipient(batch[i + 1:], mq.RETRY, reply, **remote)
                        return
                    continue
                progressed = progressed or any(o.status != mq.RETRY for o in outs)
                # A session in which the next hop deferred everything at the session's level (a 421,
                # a 4xx to MAIL) puts the queue in Retry, with the reply as its last error, as a
                # failed connection does. A recipient's 4xx (greylisting, a full mailbox) defers
                # that recipient only: the queue's other mail goes on.
                queue_error = outs[-1].reply if outs and not progressed and i == len(batch) - 1 and (
                    _ended_by_421(outs) or _mail_deferred(client, outs)) else None
                forks = [(it.message_id, it.next_hop, guid, it.queue_id, peer_session.peer_queue_database_id)] \
                    if guid and peer_session and any(o.status == mq.DELIVERED for o in outs) else []
                yield Delivered([it], {it.message_id: outs}, queue_error=queue_error, **remote, forks=forks)
            finished = not self.drain.stopping
        finally:
            if self.drain.in_transaction():
                # Cut in the middle of a transaction (the stop's grace ran out): out of step, so
                # no QUIT, whose reply would be the one the transaction awaited.
                client.close()
            elif not (finished and peer_session is None and self.cache.keep(_cache_key(batch[0]), client)):
                await client.quit()  # a peer session sends no QUIT after a discard reply it could not apply

    async def _send_one(self, client: Any, it: WorkItem, xshadow: str | None = None) -> list[Outcome]:
        """One message as one transaction (``_transact``), or several where the next hop limits
        the recipients per message (``_transactions``); the outcome of each recipient."""
        row, body = self.store.read_here(lambda c, m=it.message_id: (mq.message_row(c, m), mq.body(c, m)))
        it.row = row
        if row is None or body is None:
            return [Outcome(r, mq.FAILED, MISSING_BODY, local=True) for r in it.recipient_ids]
        await faults.acheck("deliver", row)
        # SMTPUTF8 and 8BITMIME as the message needs them and the next hop offers them; a next hop
        # that cannot take it gets no attempt (5.6.7 / 5.6.9 / 5.6.3 and a DSN).
        async with self._converting:
            with self.handling.step(it.message_id, "deliver"):  # the content step a message could crash
                plan = await asyncio.to_thread(_planned, row, it.addresses, body, client.supports_extension("smtputf8"),
                                               client.supports_extension("8bitmime"))
        if plan.error:
            return [Outcome(r, mq.FAILED, plan.error, local=True) for r in it.recipient_ids]
        if plan.downgraded:
            log.info("DSN %s to %s sent as a classic 7-bit DSN (RFC 3464): %s does not offer SMTPUTF8",
                     it.message_id, ", ".join(it.addresses), it.next_hop)
        options = list(plan.options)
        if client.supports_extension("size"):
            options.append(f"SIZE={len(plan.data)}")
        dsn = DsnRequest.of(row.get("dsn_params") or "", it.addresses, it.dsn_params)  # RFC 3461, passed on
        it.dsn_passed = client.supports_extension("dsn")
        self.drain.transaction_begins()
        outs = await _transactions(
            lambda rcpts: self._transact(client, row["sender"], options, rcpts, plan.data, xshadow, dsn),
            list(it.addresses), list(it.recipient_ids), split=xshadow is None)
        if any(o.status != mq.DELIVERED for o in outs):
            await smtpclient.rset_ok(client)  # a refused MAIL or RCPT may leave the transaction open
        return outs

    async def _transact(self, client: NextHopSession, sender: str, options: list[str], recipients: list[str],
                        data: bytes, xshadow: str | None, dsn: DsnRequest | None = None) -> Any:
        return await client.transact(sender, options, recipients, data, dsn)


class PeerConnector(SmtpConnector):
    """Delivery to a peer's transport connector as primary: authenticated, and hop by hop (the
    peer becomes primary, we keep a fork as its shadow) when both sides run shadow redundancy."""

    def __init__(self, cfg: Any, store: QueueStore, shadow: ShadowManager, *, handling: HandlingMark = NO_MARK,
                 drain: DeliveryDrain | None = None):
        super().__init__(cfg, store, handling=handling, drain=drain)
        self.shadow = shadow

    async def targets(self, item: WorkItem) -> list[SmtpTarget]:
        peer = self.shadow.by_name.get(item.next_hop)
        if peer is None:
            raise NextHopUnavailable(f"{item.next_hop} is not a configured peer")
        host, _, port = peer.transport.rpartition(":")
        return [SmtpTarget(host.strip("[]"), int(port))]

    async def open(self, item: WorkItem, messages: int = 1) -> tuple[Any, SmtpTarget, PeerSession | None]:
        """An authenticated pipelining session to the peer (smtp/wire.py), started hop by hop
        (XSHADOW and the discard exchange) when both sides run shadow redundancy. The session is
        also the connector's client: ``_send_one`` relays each message on it as one group."""
        d = self.cfg.delivery
        [target] = await self.targets(item)
        peer = self.shadow.by_name[item.next_hop]
        session: PeerSession | None = None
        try:
            session = await open_session(peer, local_fqdn=self.shadow.node_name, secret=self.cfg.cluster.secret,
                                         tls=self.shadow.pool.tls, timeout=d.send_connection_inactivity_timeout,
                                         shadows=False, connect_timeout=d.send_connect_timeout)
            # Hop by hop with a peer of either version: 2013 advertises XSHADOWREQUEST, 2010 XSHADOW.
            if self.shadow.enabled and (session.client.supports_extension("xshadowrequest")
                                        or session.client.supports_extension("xshadow")):
                await self.shadow.heartbeat.hop_session_start(session)
        except PEER_FAILURES as exc:
            if session is not None:
                session.close()
            if isinstance(exc, TlsRequired):  # its text names the peer's host already
                raise NextHopUnavailable(describe(exc), tls_status=exc.status) from None
            raise NextHopUnavailable(f"{target.host}:{target.port}: {failure(exc)}") from None
        return session, target, session

    async def _transact(self, client: PeerSession, sender: str, options: list[str], recipients: list[str],
                        data: bytes, xshadow: str | None, dsn: DsnRequest | None = None) -> Any:
        """MAIL (``XSHADOW=`` hop by hop), RCPT and BDAT LAST (or DATA) in one write."""
        return await client.relay(sender, options, recipients, data, xshadow, dsn)


def _planned(row: dict, addresses: list[str], body: bytes, next_hop_smtputf8: bool,
             next_hop_8bitmime: bool) -> SendPlan:
    """``plan_send`` for one message, in a worker thread: a conversion to 7 bit (smtp/mime7bit.py)
    takes time that grows with the message, and the event loop goes on with every other delivery
    and session meanwhile (a message never holds up another). The message is in its handling step
    (node/handling.py) all the while: one that crashes the node here is counted as before."""
    faults.check("deliver", row)
    return plan_send(row["sender"], addresses, body, smtputf8=bool(row["smtputf8"]), body_type=row["body_type"] or "",
                     next_hop_smtputf8=next_hop_smtputf8, next_hop_8bitmime=next_hop_8bitmime)


def smart_host_targets(next_hop: str, rng: random.Random | None = None) -> list[SmtpTarget]:
    """The smart hosts of a queue (``host:port``, several joined by commas) in a random order:
    each session starts at one of them, so the load is spread, and goes on to the next where one
    does not answer (Exchange's send connector with several SmartHosts: load balanced, fault
    tolerant)."""
    targets = []
    for hop in next_hop.split(","):
        host, _, port = hop.rpartition(":")
        targets.append(SmtpTarget(host.strip("[]"), int(port)))
    (rng or random).shuffle(targets)
    return targets


def _cache_key(item: WorkItem) -> tuple[str, str]:
    """Sessions are kept per next hop (a smart host, or a domain's MX hosts), as queues are."""
    return item.delivery_type, item.next_hop


async def _transactions(transact: Callable[[list[str]], Awaitable[Any]], addresses: list[str], rids: list[int],
                        split: bool) -> list[Outcome]:
    """A message's transactions on one session: each recipient's outcome from its RCPT reply and
    the data reply, MAIL's refusal for all. RFC 5321 4.5.3.1.10: the recipients over the next hop's
    limit per message (452, or 552 as RFC 821 had it) go at once in the session's next transaction,
    while each delivers some (not ``split``: a hop-by-hop relay is one fork per message, its
    over-limit recipients wait). A session that breaks after one of them finished raises
    SessionLost with the outcomes settled so far: the next hop holds what those delivered."""
    outs: list[Outcome] = []
    while True:
        try:
            replies = await transact(addresses)
        except (OSError, PeerTransientError, ProtocolError) as exc:
            if outs:
                raise SessionLost(exc, outs) from exc
            raise
        these = [_outcome(rid, replies.mail if replies.mail[0] != 250 else
                          rcpt if rcpt[0] not in (250, 251) else replies.data)
                 for rid, rcpt in zip(rids, replies.recipients)]
        over = [k for k, rcpt in enumerate(replies.recipients) if _over_recipient_limit(rcpt)] \
            if replies.data[0] == 250 and split else []
        if not over or len(over) == len(addresses):
            return outs + these
        retried = set(over)
        outs += [o for k, o in enumerate(these) if k not in retried]
        addresses, rids = [addresses[k] for k in over], [rids[k] for k in over]


def unreachable_reply(next_hop: str, exc: NextHopUnavailable) -> str:
    """The deferral of a batch no session could be opened for. Every host reached and TLS,
    required of it, not had: a TLS failure, never "Unable to connect" (the connection succeeded),
    with TlsRequired's enhanced status code (X.7.10, X.7.5: smtp/wire.py) and a 451: retried as
    any deferral, never bounced for it, never sent in plaintext. Else RFC 3463's X.4.0, Exchange's
    "Unable to connect", each host named once (not again where the next hop is that host)."""
    if exc.tls_status:
        return f"451 {exc.tls_status} TLS required but not available: {exc}"
    if exc.only == next_hop and exc.reason:
        return f"451 4.4.0 Unable to connect to {next_hop}: {exc.reason}"
    return f"451 4.4.0 Unable to connect to {next_hop}: {exc}"


# The steps after which a next hop that breaks the session may hold the message: its data was sent.
AFTER_THE_DATA = ("end of data", "BDAT LAST")


def _session_lost(items: list[WorkItem], target: SmtpTarget, exc: BaseException, step: str | None = None,
                  **remote: str) -> Delivered:
    """The session broke while ``items[0]`` was being sent: its recipients, and the rest of the
    batch, go to Retry with the queue, but for those an earlier transaction of the message settled
    (``SessionLost``): a recipient the next hop took is recorded delivered, never sent again.
    The reply names the host once, the command whose reply was awaited (``step``), and, when that
    was the data's, that the next hop may hold the message (Postfix: "message may be sent more
    than once"): sent again at the retry, it may arrive twice (RFC 5321 6.1)."""
    where = f"{target.host}:{target.port}"
    reason = (str(exc) if isinstance(exc, TimeoutError) else failure(exc)) or "timed out"
    for named in (f" from {where}", f"{where} ", f" from {target.host}"):  # the wire's texts name it
        reason = reason.replace(named, "")
    maybe = "; the next hop may hold the message, which may be sent more than once" if step in AFTER_THE_DATA else ""
    at = f" awaiting the reply to {step}" if step and OUT_OF_STEP not in reason else ""  # (that names it)
    if isinstance(exc, ProtocolError) or isinstance(exc.__cause__, ProtocolError):
        reply = f"451 4.4.2 Session with {where} given up{at}: {reason}{maybe}"
    else:
        reply = f"451 4.4.2 Connection to {where} lost{at}: {reason}{maybe}"
    lost = Delivered.every_recipient(items, mq.RETRY, reply, queue_error=reply, **remote)
    settled = {o.recipient_id: o for o in exc.settled} if isinstance(exc, SessionLost) else {}
    first = items[0].message_id
    lost.outcomes[first] = [settled.get(o.recipient_id, o) for o in lost.outcomes[first]]
    return lost


def _over_recipient_limit(reply: tuple[int, str]) -> bool:
    """A RCPT refused for too many recipients in the transaction: not about the recipient, so it
    is retried, never failed. By its enhanced code X.5.3 whatever the reply code (RFC 3463: the
    message is to be split, the other recipients sent in a later transaction; OpenSMTPD's
    ``max-rcpt`` answers ``451 4.5.3``), or a 452, or the 552 RFC 821 had (RFC 5321 4.5.3.1.10:
    taken as the same, temporary), saying so in its text."""
    code, text = reply
    if 400 <= code < 600 and text.split(" ", 1)[0] in ("4.5.3", "5.5.3"):
        return True
    return code in (452, 552) and "too many recipients" in text.lower()


def _ended_by_421(outs: list[Outcome]) -> bool:
    """Every recipient of the message deferred by a 421: the next hop closed the session (RFC 5321
    3.8) before taking anything of it."""
    return bool(outs) and all(o.status == mq.RETRY and o.reply.startswith("421") for o in outs)


def _mail_deferred(client: Any, outs: list[Outcome]) -> bool:
    """The message's MAIL got a 4xx on ``client`` (every recipient deferred with it, nothing taken)."""
    return bool(outs) and getattr(client, "mail_deferred", False) and all(o.status == mq.RETRY for o in outs)


def _outcome(recipient_id: int, reply: tuple[int, str]) -> Outcome:
    code, text = reply
    status = mq.DELIVERED if code == 250 else mq.RETRY if code < 500 or _over_recipient_limit(reply) \
        else mq.FAILED
    return Outcome(recipient_id, status, f"{code} {text}")
