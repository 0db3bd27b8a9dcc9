"""The accept path: from a received DATA to a durable message, shadowed before the 250.

It owns what happens between the end of DATA and the reply: headers added
(Received, Message-ID, Date), the loop check (hop count), bifurcation per next
hop, the shadow copies (shadow redundancy) and then one local commit that holds
the message and where its shadows went (or accepting unprotected, or refusing
with 451 4.4.0 under *RejectMessageOnShadowFailure* before anything is written
here), and the RECEIVE and HAREDIRECT tracking events, written before delivery
may take the message.
A message it cannot make durable is refused with a 4xx, never acknowledged.
With shadow redundancy version 2010 there is no copy before the 250: a sender
that cannot keep a shadow itself gets a delayed acknowledgement instead (held
until the message reached its next hops, a bypass applies, or
*MaxAcknowledgementDelay* passed).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from aiosmtpd.smtp import Envelope, Session

from transportd import faults
from transportd.errors import MessageRejected, StoreError
from transportd.node.events import NodeEvents, message_ids
from transportd.node.logs import log_context
from transportd.queue import messages as mq
from transportd.queue import shadows as sq
from transportd.queue.messages import NewMessage
from transportd.queue.routing import bifurcate
from transportd.queue.store import QueueStore
from transportd.redundancy.copies import ShadowResult
from transportd.redundancy.manager import ShadowManager
from transportd.redundancy.protocol import heartbeat_period
from transportd.redundancy.server import peer_name
from transportd.smtp.frontend import new_network_message_id, prepare_message, received_as
from transportd.smtp.headers import header_size, hop_count, network_id_from
from transportd.smtp.replies import (
    S451_NOT_REDUNDANT,
    S451_STORE_UNAVAILABLE,
    S552_HEADER_TOO_BIG,
    S554_HOP_COUNT,
    S554_NO_VALID_RECIPIENTS,
)

log = logging.getLogger("transportd")


# Where the 2010 seed bypasses delayed acknowledgement (mq.acknowledgement_state's reasons).
BYPASSES = ("QueueRetry", "QueueSuspended", "QueueLength")


class OrphanCopies:
    """Shadow copies no local message refers to (the message refused, or its commit failed): a
    peer may hold one nobody would discard, so each gets a discard event. Those the queue database
    did not take either (a full disk) are held in memory, at most ``limit``, and recorded with the
    next commit that succeeds or, without one, by a retry of their own every ``retry_interval``
    (a process whose every commit failed may take no message again for a long time, and the peer
    would promote what it holds should this node be lost meanwhile): the peer drops a copy the
    sender sends again after our 4xx instead of promoting it later (past ``limit`` the copies
    expire on their own). A crash loses what is held: the peer learns it from its heartbeat's
    XQSTATUS and promotes the copy, a duplicate (docs/reliability.md)."""

    def __init__(self, store: QueueStore, limit: int = 10_000, retry_interval: float = 5.0):
        self.store = store
        self.limit = limit
        self.retry_interval = retry_interval
        self._held: list[tuple[tuple[str, ...], str, float]] = []
        self._retrying: asyncio.Task | None = None

    async def discard(self, result: ShadowResult, guid: str, netid: str, now: float) -> None:
        peers = tuple(dict.fromkeys((*result.peers, *result.uncertain)))
        if not peers:
            return
        try:
            await self.store.write(lambda c: sq.discard_uncertain(c, peers, guid, now))
        except StoreError:
            held = len(self._held) < self.limit
            if held:
                self._held.append((peers, guid, now))
                self._retry_soon()
            log.error("could not queue a discard for shadow %s on %s; %s", guid, ", ".join(peers),
                      "it is queued with the next message the queue database takes" if held
                      else "it expires on its own", extra=message_ids({"network_message_id": netid}))

    def take(self) -> list[tuple[tuple[str, ...], str, float]]:
        held, self._held = self._held, []
        return held

    def give_back(self, held: list[tuple[tuple[str, ...], str, float]]) -> None:
        self._held[:0] = held
        if self._held:
            self._retry_soon()

    @staticmethod
    def recorded(held: list) -> None:
        if held:
            log.info("discards of %d orphaned shadow cop%s recorded now: their peers drop them at the next "
                     "heartbeat", len(held), "y" if len(held) == 1 else "ies")

    def _retry_soon(self) -> None:
        if self._retrying is None or self._retrying.done():
            self._retrying = asyncio.ensure_future(self._retry())

    async def _retry(self) -> None:
        """Record the held discards on their own, every ``retry_interval`` until they are in."""
        while self._held:
            await asyncio.sleep(self.retry_interval)
            held = self.take()

            def record(c, held=held):
                for peers, guid, at in held:
                    sq.discard_uncertain(c, peers, guid, at)
            try:
                await self.store.write(record)
            except StoreError:
                self._held[:0] = held  # still no room: the next retry (or commit) takes them
                continue
            except BaseException:
                self._held[:0] = held
                raise
            self.recorded(held)


def tracking_row(internal_id: int, msg: NewMessage) -> dict:
    """The message fields a tracking event of the accept path carries."""
    return {"id": internal_id, "network_message_id": msg.network_message_id, "message_id": msg.message_id,
            "sender": msg.sender, "author": msg.author, "subject": msg.subject, "size": len(msg.data),
            "client_ip": msg.client_ip, "client_hostname": msg.client_hostname}


def check_header_size(envelope: Envelope, session: Session, limit: int) -> None:
    """MaxHeaderSize, before any header is parsed: a header section of megabytes is refused for
    its size (552 5.3.4), as Exchange does, not parsed (seconds of the event loop) and relayed.
    Every client is held to it, on either connector, but an authenticated boundary peer: its node
    applied the limit when the message came in (and a peer's copy must not be refused here)."""
    if peer_name(session) is None and header_size(envelope.original_content or b"") > limit:
        log.warning("message from %s refused: header section over frontend.max_header_size (%d octets)",
                    str((session.peer or ("", 0))[0]), limit)
        raise MessageRejected(S552_HEADER_TOO_BIG)


def hop_limit(session: Session, cfg: Any) -> int:
    """The Received fields a message may come with (Exchange's MaxHopCount): ours, added on
    receipt, is not one of them. An authenticated boundary peer may bring one more per node of
    the boundary: a message the frontend took with max_hop_count fields gains one at each node it
    passes inside the boundary (the frontend node's, then a hop-by-hop primary's, or a promoted
    shadow's on its way to the mailbox node), and the boundary must not refuse (an NDR) what it
    acknowledged. A path that passes no node twice stays within that allowance, so a routing loop
    between peers is still stopped, after at most one more round. (Counting our own field at the
    frontend instead would allow one hop inside the boundary, not the two of a promoted copy.)"""
    limit = cfg.frontend.max_hop_count
    return limit + len(cfg.peers) + 1 if peer_name(session) is not None else limit


def check_hop_count(msg: NewMessage, session: Session, cfg: Any) -> None:
    """RFC 5321 6.3's loop detection: more Received fields than ``hop_limit`` is 554 5.4.14."""
    hops = hop_count(msg.data) - 1
    if hops > hop_limit(session, cfg):
        log.warning("message from %s looped (%d Received headers): refused", msg.client_ip, hops,
                    extra=message_ids({"network_message_id": msg.network_message_id}))
        raise MessageRejected(S554_HOP_COUNT)


class AcceptPath:
    def __init__(self, cfg: Any, store: QueueStore, events: NodeEvents, shadow: ShadowManager | None):
        self.cfg = cfg
        self.store = store
        self.events = events
        self.shadow = shadow
        self._promotions = 0  # shadow redundancy promotions made (2010): the same-site peers in turn
        self._promoting_queues: set[int] = set()  # past 100 messages, promoted until they clear (2010 SP1)
        # Held discards are retried on their own within a heartbeat (the peers poll no sooner).
        self._orphans = OrphanCopies(store, retry_interval=min(5.0, max(0.2, heartbeat_period(cfg.shadow_redundancy))))

    def _message(self, envelope: Envelope, session: Session, connector: str, now: float) -> NewMessage:
        cfg = self.cfg
        client_ip = str((session.peer or ("", 0))[0])
        data = envelope.original_content or b""
        netid = (peer_name(session) and network_id_from(data)) or new_network_message_id()
        smtputf8, body_type = received_as(envelope)
        prepared = prepare_message(data, node_name=cfg.node.name, client_ip=client_ip,
                                   helo=session.host_name or "", network_message_id=netid, now=now,
                                   connector=connector, tls=session.ssl is not None,
                                   extended=bool(getattr(session, "extended_smtp", True)),
                                   authenticated=bool(session.authenticated), smtputf8=smtputf8)
        return NewMessage(
            network_message_id=netid, data=prepared.data,
            sender="" if envelope.mail_from in (None, "<>") else envelope.mail_from,
            recipients=bifurcate(envelope.rcpt_tos, cfg), received_at=now,
            expires_at=now + cfg.delivery.message_expiration_timeout,
            message_id=prepared.message_id, submit_time=prepared.submit_time, subject=prepared.subject,
            author=prepared.author, client_ip=client_ip, client_hostname=session.host_name or "", origin="smtp",
            smtputf8=smtputf8, body_type=body_type,
            dsn_mail=getattr(envelope, "dsn_mail", ""), dsn_rcpt=getattr(envelope, "dsn_rcpt", {}),
        )

    async def accept(self, envelope: Envelope, session: Session, connector: str) -> int:
        """Make the message durable and return its internal id (the 250 follows)."""
        now = time.time()
        if not envelope.rcpt_tos:
            raise MessageRejected(S554_NO_VALID_RECIPIENTS)
        check_header_size(envelope, session, self.cfg.frontend.max_header_size)
        msg = self._message(envelope, session, connector, now)
        session.accepted_message_id = msg.message_id  # for a reply that names it (Exchange's acceptance reply)
        # Every line logged while accepting it (the shadow copy's too) carries its id and client.
        with log_context(network_message_id=msg.network_message_id, client=msg.client_ip or None,
                         peer=peer_name(session)):
            return await self._accept(msg, session, connector, now)

    async def _accept(self, msg: NewMessage, session: Session, connector: str, now: float) -> int:
        check_hop_count(msg, session, self.cfg)
        recipients = list(dict.fromkeys(a for addrs in msg.recipients.values() for a in addrs))
        peer_conn = getattr(session, "redundancy", None)  # the transport connector's protocol state
        if peer_conn is not None and peer_conn.shadow_guid and peer_conn.xshadow_peer:
            # Hop-by-hop (docs/PROTOCOL.md section 3): the sending peer keeps the shadow; we are primary.
            msg.redundancy = "shadowed"
            holders = [(peer_conn.xshadow_peer, 1)]
            return await self._commit(msg, connector, recipients, peer_conn.shadow_guid, holders, now,
                                      relayed_by=peer_conn.xshadow_peer)
        if self.cfg.shadow_redundancy.shadow_redundancy_enabled and self.cfg.shadow_redundancy.version == "2010":
            # 2010: a sender that cannot keep a shadow gets a delayed acknowledgement instead of a copy.
            return await self._accept_delayed(msg, connector, now)
        if self.shadow is not None and self.shadow.enabled:
            return await self._accept_shadowed(msg, connector, recipients, now)
        return await self._commit(msg, connector, recipients, "", [], now)

    async def _accept_shadowed(self, msg: NewMessage, connector: str, recipients: list[str], now: float) -> int:
        """Shadow redundancy (2013 and later): the shadow copies first, then one local commit that
        holds the message and where its shadows went (one writer job per message); the 250 follows
        that commit. Too few copies: accepted with fewer (``partial``, ``unprotected``:
        HAREDIRECTFAIL) or, under RejectMessageOnShadowFailure, refused with 451 4.4.0 before
        anything is written here, the copies made being discarded."""
        netid = msg.network_message_id
        sr = self.cfg.shadow_redundancy
        guid = str(uuid.uuid4())
        shadow_error: Exception | None = None
        try:
            result = await self.shadow.make_shadow(msg, guid, recipients)
        except Exception as exc:  # noqa: BLE001 - nothing is written yet: accept unprotected or refuse
            shadow_error = exc
            result = ShadowResult(None, f"internal error: {exc.__class__.__name__}: {exc}")
        if not self._enough(result) and sr.reject_message_on_shadow_failure:
            await self._orphans.discard(result, guid, netid, now)
            log.warning("no shadow could be made (%s): message refused with 451 4.4.0", result.reply,
                        extra=message_ids({"network_message_id": netid}))
            raise MessageRejected(S451_NOT_REDUNDANT)
        msg.redundancy = sq.redundancy_of(len(result.holders), sr.shadow_copies)
        holders = [(p, r) for p, r, _ in result.holders]
        internal_id = await self._commit(msg, connector, recipients, guid, holders, now, result)
        if shadow_error is not None:
            await self.events.message_failed(tracking_row(internal_id, msg), "shadow", shadow_error)
        return internal_id

    async def _commit(self, msg: NewMessage, connector: str, recipients: list[str], guid: str,
                      holders: list[tuple[str, int]], now: float, result: ShadowResult | None = None,
                      relayed_by: str | None = None) -> int:
        """The one local commit of an accepted message: the message, where its shadows are
        (``holders`` under ``guid``) and a discard event for each copy a peer may hold uncounted;
        hop by hop from ``relayed_by``, our shadows of its copy released for the recipients we take
        (``sq.release_relayed_shadows``); then the HADISCARD rows of those released, its RECEIVE and
        HAREDIRECT(FAIL) rows, before the scheduler runs again, so delivery's rows never precede
        them. A failed commit is 451 4.3.0 (the copies made get discard events if the queue
        database takes any)."""
        netid = msg.network_message_id
        uncertain = result.uncertain if result is not None else ()
        # The shadows' time is when they exist (after the copy), not when the message came: a
        # peer's new queue database first seen by the copy's own session must not count this one
        # among the shadows it lost (Heartbeat._state_change, claim_lost_shadows).
        made_at = time.time()
        orphans = self._orphans.take()  # this commit records their discards
        databases = result.databases if result is not None else {}  # which of its databases holds each copy

        def commit(conn):
            mid = mq.enqueue(conn, msg)
            for node, rank in holders:
                sq.record_shadow(conn, mid, node, guid, made_at, rank, databases.get(node))
            sq.discard_uncertain(conn, uncertain, guid, now)
            for peers, orphan_guid, at in orphans:
                sq.discard_uncertain(conn, peers, orphan_guid, at)
            return mid, sq.release_relayed_shadows(conn, relayed_by, netid, recipients, now,
                                                   self.cfg.safety_net.safety_net_hold_time) if relayed_by else []
        try:
            faults.check("settle", msg)  # test-only: this commit settles the accept (the step's name)
            internal_id, released = await self.store.write(commit, queue_changed=True)
            self._orphans.recorded(orphans)
        except Exception as exc:
            self._orphans.give_back(orphans)  # for the next commit
            if result is not None:
                await self._orphans.discard(result, guid, netid, now)
            if not isinstance(exc, StoreError):
                raise  # 451 4.3.0 at the frontend
            log.error("queue database unavailable, answering 451: %s", exc,
                      extra=message_ids({"network_message_id": netid}))
            raise MessageRejected(S451_STORE_UNAVAILABLE) from None
        for r in released:  # the shadow's end is tracked before the primary copy's start
            self.events.track("HADISCARD", "SMTP", r, source_context=f"ExplicitlyDiscarded;{r['shadow_guid']}",
                              client_hostname=relayed_by)
        row = tracking_row(internal_id, msg)
        self._track_receive(row, msg, connector, recipients)
        if result is not None and result.peer:
            for peer, _rank, reply in result.holders:
                self.events.track("HAREDIRECT", "SMTP", row, recipients=recipients, source_context=f"{peer}={reply}")
            if result.failures:
                log.warning("message %d has %d of %d shadow copies (on %s); the missing ones are made in later "
                            "heartbeat rounds: %s", internal_id, len(result.holders),
                            self.cfg.shadow_redundancy.shadow_copies, ", ".join(result.peers), result.failures,
                            extra=message_ids(row))
        elif result is not None:
            self.events.track("HAREDIRECTFAIL", "SMTP", row, recipients=recipients, source_context=result.reply)
        log.info("queued message %d (network id %s) from <%s> for %d recipient(s)",
                 internal_id, netid, msg.sender, sum(len(v) for v in msg.recipients.values()),
                 extra=message_ids({"id": internal_id, "network_message_id": netid}))
        self.events.metrics.accept_latency.observe(time.time() - now)
        return internal_id

    def _track_receive(self, row: dict, msg: NewMessage, connector: str, recipients: list[str]) -> None:
        self.events.track("RECEIVE", "SMTP", row, recipients=recipients, source_context=connector,
                          connector_id=f"{self.cfg.node.name}\\{connector}", directionality="Incoming",
                          client_ip=msg.client_ip, client_hostname=msg.client_hostname)

    async def _accept_delayed(self, msg: NewMessage, connector: str, now: float) -> int:
        """Shadow redundancy 2010: durable here, delivery starts at once, and the 250 waits until the
        message has reached its next hops (or a peer holds it with us as its shadow), a bypass of the
        seed applies (target queue in Retry, Suspended, over 100 messages: with promotion, until it
        clears), or
        *MaxAcknowledgementDelay* has passed. With *shadow redundancy promotion* a bypass relays the
        message to a node of the site first; one found at once is decided in the commit itself, so
        the message never waits in the bypassed queue."""
        target = self._promotion_target()

        def commit(c):
            mid = mq.enqueue(c, msg)
            bypass = mq.acknowledgement_state(c, mid, now, self._promoting_queues if target else None)
            moved = bypass in BYPASSES and target is not None and bool(
                mq.redirect_to_peer(c, target, now, message_id=mid))
            return mid, bypass, moved
        try:
            internal_id, bypass, moved = await self.store.write(commit, queue_changed=True)
        except StoreError as exc:
            log.error("queue database unavailable, answering 451: %s", exc,
                      extra=message_ids({"network_message_id": msg.network_message_id}))
            raise MessageRejected(S451_STORE_UNAVAILABLE) from None
        row = tracking_row(internal_id, msg)
        recipients = list(dict.fromkeys(a for addrs in msg.recipients.values() for a in addrs))
        self._track_receive(row, msg, connector, recipients)
        if moved:
            reason = await self._promoted(internal_id, row, bypass, target, now)
        elif bypass in BYPASSES:
            reason = bypass
        else:
            reason = await self._acknowledgement(internal_id, now, self._promoting_queues if target else None)
            if reason in BYPASSES and target is not None:  # entered Retry since: promote now
                moved = await self.store.write(lambda c: mq.redirect_to_peer(c, target, time.time(),
                                                                             message_id=internal_id),
                                               queue_changed=True)
                if moved:
                    reason = await self._promoted(internal_id, row, reason, target, now)
        delay = time.time() - now
        self.events.metrics.acknowledgement_delay.labels(reason).observe(delay)
        # MSGTRK has no field for it: an AGENTINFO row (as Exchange's agents write) carries it.
        self.events.track("AGENTINFO", "AGENT", row, recipients=recipients, source_context="DelayedAcknowledgement",
                          custom_data=f"S:AckDelay={delay:.3f};S:Reason={reason}")
        log.info("queued message %d (network id %s) from <%s>; acknowledged after %.3fs (%s)", internal_id,
                 msg.network_message_id, msg.sender, delay, reason,
                 extra=message_ids({"id": internal_id, "network_message_id": msg.network_message_id}))
        self.events.metrics.accept_latency.observe(delay)
        return internal_id

    def _promotion_target(self) -> str | None:
        """Shadow redundancy promotion (2010 SP1): the node of this site a bypassed message is relayed
        to (the site's peers in turn), or None (promotion off, or no other node in the site)."""
        if not self.cfg.shadow_redundancy.promotion_enabled:
            return None
        site = [p.name for p in self.cfg.peers if p.site == self.cfg.node.site]
        if not site:
            return None
        self._promotions += 1
        return site[self._promotions % len(site)]

    async def _promoted(self, internal_id: int, row: dict, bypass: str, target: str, started: float) -> str:
        """The message was relayed to ``target`` instead of being acknowledged at once: it takes the
        message as primary while this node keeps the shadow (hop by hop); the 250 waits for that."""
        self.events.track("HAREDIRECT", "SMTP", row, source_context=f"ShadowRedundancyPromotion;{bypass};{target}")
        reason = await self._acknowledgement(internal_id, started)
        return f"Promoted:{reason}" if reason == "Delivered" else reason

    async def _acknowledgement(self, internal_id: int, started: float, promoting: set[int] | None = None) -> str:
        """Wait for the delayed acknowledgement; returns why it may go (mq.acknowledgement_state's
        reasons, or MaxAcknowledgementDelay); ``promoting``: the queues promotion is on for."""
        deadline = started + self.cfg.frontend.max_acknowledgement_delay
        pause = 0.01
        while True:
            now = time.time()
            try:
                reason = await self.store.aread(lambda c: mq.acknowledgement_state(c, internal_id, now, promoting))
            except StoreError:
                reason = None  # durable already: wait out the delay rather than fail the sender
            if reason is not None:
                return reason
            if now >= deadline:
                return "MaxAcknowledgementDelay"
            await asyncio.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 0.25)

    def _enough(self, result: ShadowResult) -> bool:
        """At least *min_shadow_copies* shadows: fewer is a shadow failure."""
        return len(result.holders) >= self.cfg.shadow_redundancy.min_shadow_copies
