"""The accept path: from a received DATA to a durable message, shadowed before the 250.

It owns what happens between the end of DATA and the reply: headers added
(Received, Message-ID, Date), the loop check (hop count), bifurcation per next
hop, the local commit and the shadow copy made concurrently (shadow
redundancy), settling where the shadow went (or accepting unprotected, or
refusing with 451 4.4.0 under *RejectMessageOnShadowFailure*), and the RECEIVE
and HAREDIRECT tracking events, written before delivery may take the message.
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
from transportd.redundancy.server import peer_name
from transportd.smtp.frontend import new_network_message_id, prepare_message, received_as
from transportd.smtp.headers import hop_count, network_id_from
from transportd.smtp.replies import (
    S451_NOT_REDUNDANT,
    S451_STORE_UNAVAILABLE,
    S554_HOP_COUNT,
    S554_NO_VALID_RECIPIENTS,
)

log = logging.getLogger("transportd")


# Where the 2010 seed bypasses delayed acknowledgement (mq.acknowledgement_state's reasons).
BYPASSES = ("QueueRetry", "QueueSuspended", "QueueLength")


def tracking_row(internal_id: int, msg: NewMessage) -> dict:
    """The message fields a tracking event of the accept path carries."""
    return {"id": internal_id, "network_message_id": msg.network_message_id, "message_id": msg.message_id,
            "sender": msg.sender, "subject": msg.subject, "size": len(msg.data),
            "client_ip": msg.client_ip, "client_hostname": msg.client_hostname}


class AcceptPath:
    def __init__(self, cfg: Any, store: QueueStore, events: NodeEvents, shadow: ShadowManager | None):
        self.cfg = cfg
        self.store = store
        self.events = events
        self.shadow = shadow
        self.accepting: set[int] = set()  # messages between their local commit and their settle
        self._promotions = 0  # shadow redundancy promotions made (2010): the same-site peers in turn

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
            client_ip=client_ip, client_hostname=session.host_name or "", origin="smtp",
            smtputf8=smtputf8, body_type=body_type,
        )

    async def accept(self, envelope: Envelope, session: Session, connector: str) -> int:
        """Make the message durable and return its internal id (the 250 follows)."""
        now = time.time()
        if not envelope.rcpt_tos:
            raise MessageRejected(S554_NO_VALID_RECIPIENTS)
        msg = self._message(envelope, session, connector, now)
        session.accepted_message_id = msg.message_id  # for a reply that names it (Exchange's acceptance reply)
        # Every line logged while accepting it (the shadow copy's too) carries its id and client.
        with log_context(network_message_id=msg.network_message_id, client=msg.client_ip or None,
                         peer=peer_name(session)):
            return await self._accept(msg, session, connector, now)

    async def _accept(self, msg: NewMessage, session: Session, connector: str, now: float) -> int:
        netid = msg.network_message_id
        hops = hop_count(msg.data)
        if hops > self.cfg.frontend.max_hop_count:
            log.warning("message from %s looped (%d Received headers): refused", msg.client_ip, hops,
                        extra=message_ids({"network_message_id": netid}))
            raise MessageRejected(S554_HOP_COUNT)
        shadow_plan: list[tuple[str, str]] = []
        peer_conn = getattr(session, "redundancy", None)  # the transport connector's protocol state
        if peer_conn is not None and peer_conn.shadow_guid and peer_conn.xshadow_peer:
            # Hop-by-hop (docs/PROTOCOL.md section 3): the sending peer keeps the shadow; we are primary.
            shadow_plan = [(peer_conn.xshadow_peer, peer_conn.shadow_guid)]
            msg.redundancy = "shadowed"
        elif self.cfg.shadow_redundancy.shadow_redundancy_enabled and self.cfg.shadow_redundancy.version == "2010":
            # 2010: a sender that cannot keep a shadow gets a delayed acknowledgement instead of a copy.
            return await self._accept_delayed(msg, connector, now)
        elif self.shadow is not None and self.shadow.enabled:
            msg.redundancy = "pending"
        guid = str(uuid.uuid4())
        recipients = list(dict.fromkeys(a for addrs in msg.recipients.values() for a in addrs))

        def commit(conn):
            mid = mq.enqueue(conn, msg)
            for node, g in shadow_plan:
                sq.record_shadow(conn, mid, node, g, now)
            return mid

        local = asyncio.ensure_future(self.store.write(commit, queue_changed=msg.redundancy != "pending"))
        remote = None
        if msg.redundancy == "pending":
            remote = asyncio.ensure_future(self.shadow.make_shadow(msg, guid, recipients))
        try:
            internal_id = await local
        except StoreError as exc:
            log.error("queue database unavailable, answering 451: %s", exc,
                      extra=message_ids({"network_message_id": netid}))
            if remote is not None:
                await self._discard_orphan_copy(await remote, guid, netid, now)
            raise MessageRejected(S451_STORE_UNAVAILABLE) from None
        self.accepting.add(internal_id)  # "pending" belongs to this call until it settles
        try:
            await self._settle_and_track(internal_id, msg, connector, remote, guid, recipients, now)
            log.info("queued message %d (network id %s) from <%s> for %d recipient(s)",
                     internal_id, netid, msg.sender, sum(len(v) for v in msg.recipients.values()),
                     extra=message_ids({"id": internal_id, "network_message_id": netid}))
            self.events.metrics.accept_latency.observe(time.time() - now)
            return internal_id
        finally:
            self.accepting.discard(internal_id)

    def _track_receive(self, row: dict, msg: NewMessage, connector: str, recipients: list[str]) -> None:
        self.events.track("RECEIVE", "SMTP", row, recipients=recipients, source_context=connector,
                          connector_id=f"{self.cfg.node.name}\\{connector}", directionality="Incoming",
                          client_ip=msg.client_ip, client_hostname=msg.client_hostname)

    async def _accept_delayed(self, msg: NewMessage, connector: str, now: float) -> int:
        """Shadow redundancy 2010: durable here, delivery starts at once, and the 250 waits until the
        message has reached its next hops (or a peer holds it with us as its shadow), a bypass of the
        seed applies (target queue in Retry, Suspended, over 100 messages), or
        *MaxAcknowledgementDelay* has passed. With *shadow redundancy promotion* a bypass relays the
        message to a node of the site first; one found at once is decided in the commit itself, so
        the message never waits in the bypassed queue."""
        target = self._promotion_target()

        def commit(c):
            mid = mq.enqueue(c, msg)
            bypass = mq.acknowledgement_state(c, mid, now)
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
            reason = await self._acknowledgement(internal_id, now)
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

    async def _acknowledgement(self, internal_id: int, started: float) -> str:
        """Wait for the delayed acknowledgement; returns why it may go (mq.acknowledgement_state's
        reasons, or MaxAcknowledgementDelay)."""
        deadline = started + self.cfg.frontend.max_acknowledgement_delay
        pause = 0.01
        while True:
            now = time.time()
            try:
                reason = await self.store.aread(lambda c: mq.acknowledgement_state(c, internal_id, now))
            except StoreError:
                reason = None  # durable already: wait out the delay rather than fail the sender
            if reason is not None:
                return reason
            if now >= deadline:
                return "MaxAcknowledgementDelay"
            await asyncio.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 0.25)

    async def _discard_orphan_copy(self, result: ShadowResult, guid: str, netid: str, now: float) -> None:
        """The local commit failed: a peer may hold a copy nobody will discard; ask it to, if we can."""
        peers = tuple(p for p in (result.peer, *result.uncertain) if p)
        if peers:
            try:
                await self.store.write(lambda c: sq.discard_uncertain(c, peers, guid, now))
            except StoreError:
                log.error("could not queue a discard for shadow %s on %s; it expires on its own",
                          guid, ", ".join(peers), extra=message_ids({"network_message_id": netid}))

    async def _settle_and_track(self, internal_id: int, msg: NewMessage, connector: str, remote: Any, guid: str,
                                recipients: list[str], now: float) -> None:
        shadow_result = None
        shadow_error: Exception | None = None
        if remote is not None:
            try:
                shadow_result = await remote
            except Exception as exc:  # noqa: BLE001 - the local copy exists: settle it, never strand it
                shadow_error = exc
                shadow_result = ShadowResult(None, f"internal error: {exc.__class__.__name__}: {exc}")
        if shadow_result is not None and not self._enough(shadow_result) \
                and self.cfg.shadow_redundancy.reject_message_on_shadow_failure:
            await self._settle(internal_id, msg, shadow_result, guid, now)  # raises 451 4.4.0
        row = tracking_row(internal_id, msg)
        self._track_receive(row, msg, connector, recipients)
        if shadow_result is None:
            return
        if shadow_result.peer:
            for peer, _rank, reply in shadow_result.holders:
                self.events.track("HAREDIRECT", "SMTP", row, recipients=recipients, source_context=f"{peer}={reply}")
            if shadow_result.failures:
                log.warning("message %d has %d of %d shadow copies (on %s); the missing ones are made in later "
                            "heartbeat rounds: %s", internal_id, len(shadow_result.holders),
                            self.cfg.shadow_redundancy.shadow_copies, ", ".join(shadow_result.peers),
                            shadow_result.failures, extra=message_ids(row))
        else:
            self.events.track("HAREDIRECTFAIL", "SMTP", row, recipients=recipients,
                              source_context=shadow_result.reply)
        # Only now may delivery take it: its tracking rows never precede RECEIVE/HAREDIRECT.
        await self._settle(internal_id, msg, shadow_result, guid, now)
        if shadow_error is not None:
            await self.events.message_failed(row, "shadow", shadow_error)

    def _enough(self, result: ShadowResult) -> bool:
        """At least *min_shadow_copies* shadows: fewer is a shadow failure."""
        return len(result.holders) >= self.cfg.shadow_redundancy.min_shadow_copies

    async def _settle(self, internal_id: int, msg: NewMessage, result: ShadowResult, guid: str, now: float) -> None:
        """Record where the shadows went; with too few, accept (unprotected or partial) or refuse
        (451 4.4.0, and the copies made are discarded)."""
        faults.check("settle", msg)
        if result.uncertain:
            await self.store.write(lambda c: sq.discard_uncertain(c, result.uncertain, guid, now))
        if self._enough(result) or not self.cfg.shadow_redundancy.reject_message_on_shadow_failure:
            wanted = self.cfg.shadow_redundancy.shadow_copies
            holders = [(p, r) for p, r, _ in result.holders]
            await self.store.write(lambda c: sq.settle_accepted(c, internal_id, holders, guid, now, wanted),
                                   queue_changed=True)
            return
        if result.peers:
            await self.store.write(lambda c: sq.discard_uncertain(c, result.peers, guid, now))
        await self.store.write(lambda c: sq.drop_unacknowledged(c, internal_id))
        log.warning("no shadow could be made (%s): message refused with 451 4.4.0", result.reply,
                    extra=message_ids({"id": internal_id, "network_message_id": msg.network_message_id}))
        raise MessageRejected(S451_NOT_REDUNDANT)
