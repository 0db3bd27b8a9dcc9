"""The Shadow Redundancy Manager: shadows before acknowledgement, discards, heartbeats, promotion.

Primary side: ``make_shadow`` copies a message to a peer's transport connector
(XSHADOWREQUEST once per reused session, then ``MAIL FROM:<..> XSHADOW=<guid>``)
and returns the peer's ``250 2.6.0`` reply; ``take_discard_events`` answers a
shadow's XQDISCARD from the persisted discard events.
Shadow side: ``store_shadow`` keeps a copy in the shadow queue of its primary;
the heartbeat loop polls every primary we hold shadows for (XSHADOW +
XQDISCARD), moves discarded copies to the Shadow Safety Net (HADISCARD), and
promotes all shadows of a primary after *ShadowResubmitTimeSpan* of failed
heartbeats or at once when its queue database ID changed. All state lives in
the queue database; the rules themselves are pure functions in protocol.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiosmtplib
from sqlalchemy import delete, func, insert, or_, select, update

from transportd import faults
from transportd.smtp import client as smtpclient
from transportd.queue import messages as mq
from transportd.config import peer_tls_options
from transportd.smtp.envelope import message_parameters
from transportd.queue.messages import NewMessage
from transportd.redundancy.protocol import (Peer, ProtocolError, after_heartbeat, decode_dbid, encode_fqdn, unreachable_since,
                       format_xshadowrequest, parse_discard_entries, shadow_attempts)
from transportd.smtp.server import header_fields, new_network_message_id, received_as
from transportd.queue.routing import bifurcate
from transportd.queue.store import (discard_events, message_shadows, messages, recipients, resubmit_requests, shadow_contexts,
                    shadow_forks)

log = logging.getLogger("transportd.redundancy.manager")

DISCARD_BATCH = 50
# Copies made redundant again at once after a promotion, a peer's lost database or a failed
# shadow (each on its own peer session): one at a time left a window a second failure could hit.
RESHADOW_CONCURRENCY = 8
# Unprotected messages retried per heartbeat round.
REPROTECT_BATCH = 64
# Shadows promoted per commit (and tracked before the loop runs anything else).
PROMOTE_PAGE = 500
# What re-shadowing a promoted copy needs of its row (and its tracking rows show).
_RESHADOW_FIELDS = ("id", "network_message_id", "message_id", "sender", "subject", "size", "smtputf8",
                    "body_type")


@dataclass
class ShadowResult:
    peer: str | None
    reply: str  # the peer's DATA reply, or the reasons no shadow could be made
    # Peers that may hold a copy although we do not count it (the session broke after DATA):
    # they get a discard event for the GUID, so no copy is left behind forever.
    uncertain: tuple[str, ...] = ()


class PeerSession:
    """One authenticated session to a peer's transport connector."""

    def __init__(self, client: aiosmtplib.SMTP, peer: Peer):
        self.client = client
        self.peer = peer
        self.shadow_requested = False

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass


class ShadowManager:
    def __init__(self, node: Any):
        self.node = node
        self.cfg = node.cfg
        self.sr = node.cfg.shadow_redundancy
        self.peers = [Peer(p.name, p.site, p.transport) for p in node.cfg.peers]
        self.by_name = {p.name: p for p in self.peers}
        self.accepting = True
        self._idle: dict[str, list[PeerSession]] = {}
        self._rotate = 0
        self._seen_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        self._reshadow_slots = asyncio.Semaphore(RESHADOW_CONCURRENCY)
        self._sweep: asyncio.Task | None = None
        # Tokens of the transport sessions open now: a discard id handed out on any other token
        # belongs to a session gone without settling it, and is handed out again (housekeeping).
        self.live_discard_tokens: set[str] = set()
        # Primaries whose ShadowStateChange promotion is running (primary -> its new queue database ID).
        self._state_changes: dict[str, str] = {}
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def node_name(self) -> str:
        return self.cfg.node.name.lower()

    @property
    def queue_database_id(self) -> str:
        return self.node.store.queue_database_id

    @property
    def enabled(self) -> bool:
        return bool(self.sr.shadow_redundancy_enabled and self.peers)

    def start(self) -> None:
        if self.peers:
            self._task = asyncio.ensure_future(self._heartbeat_loop())

    async def stop(self) -> None:
        self._stopping = True
        self.accepting = False
        tasks = [t for t in (self._task, *self._background) if t is not None]
        for t in tasks:
            t.cancel()  # a copy left "reshadowing" is retried after the restart (recover_after_restart)
        await asyncio.gather(*tasks, return_exceptions=True)
        for sessions in self._idle.values():
            for s in sessions:
                s.close()
        self._idle.clear()

    # ================================================================== sessions to peers

    async def _open(self, peer: Peer, shadows: bool = True) -> PeerSession:
        """An authenticated session; ``shadows``: for making shadow copies (the peer must offer
        XSHADOWREQUEST). A heartbeat needs only XSHADOW + XQDISCARD, which a peer with shadow
        redundancy disabled still answers for the copies others hold of its mail."""
        host, _, port = peer.transport.rpartition(":")
        client = aiosmtplib.SMTP(hostname=host, port=int(port), local_hostname=self.node_name,
                                 timeout=max(5.0, min(30.0, self.sr.shadow_heartbeat_frequency)),
                                 **peer_tls_options(self.cfg))
        await client.connect()
        try:
            await client.ehlo()
            if shadows and not client.supports_extension("xshadowrequest"):
                raise ProtocolError(f"{peer.name} does not advertise XSHADOWREQUEST")
            await client.auth_plain(self.node_name, self.cfg.cluster.secret)
        except BaseException:
            client.close()
            raise
        return PeerSession(client, peer)

    async def _session(self, peer: Peer, shadows: bool = True) -> PeerSession:
        idle = self._idle.setdefault(peer.name, [])
        while idle:
            s = idle.pop()
            if s.client.is_connected:
                return s
            s.close()
        return await self._open(peer, shadows)

    def _release(self, s: PeerSession, ok: bool) -> None:
        if ok and s.client.is_connected and not self._stopping:
            idle = self._idle.setdefault(s.peer.name, [])
            if len(idle) < 16:
                idle.append(s)
                return
        s.close()

    # ================================================================== primary side

    def attempts(self) -> list[Peer]:
        self._rotate += 1
        return shadow_attempts(self.peers, self.cfg.node.site, self.sr.shadow_message_preference_setting,
                               self.sr.max_retries_for_remote_site_shadow,
                               self.sr.max_retries_for_local_site_shadow, rotate=self._rotate)

    async def make_shadow(self, msg: NewMessage, guid: str, recipients: list[str],
                          exclude: str | None = None) -> ShadowResult:
        """Copy ``msg`` to a peer before the sender gets its 250; tries peers as configured."""
        faults.check("shadow", msg)
        reasons: list[str] = []
        # The copy travels as the message came: SMTPUTF8 and BODY=8BITMIME when it needs them.
        params = message_parameters(msg.sender, recipients, msg.data, smtputf8=msg.smtputf8,
                                    body_type=msg.body_type)
        candidates = [p for p in self.attempts() if p.name != exclude]
        if not candidates:
            return ShadowResult(None, "No suitable shadow servers")
        uncertain: list[str] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.sr.shadow_copy_timeout
        timed_out: set[str] = set()
        for i, peer in enumerate(candidates):
            if peer.name in timed_out:
                continue  # a peer that hung once (partitioned, paused) would eat the others' time
            s: PeerSession | None = None
            ok = False
            sent_data = False
            remaining = deadline - loop.time()
            if remaining <= 0:
                reasons.append(f"no shadow within shadow_copy_timeout ({self.sr.shadow_copy_timeout:g}s)")
                break
            # Each distinct peer still to try gets a fair share of what is left, so one silent peer
            # cannot leave a healthy one untried (found by `transportd chaos`, docs/reliability.md).
            left = len({p.name for p in candidates[i:] if p.name not in timed_out})
            try:
                async with asyncio.timeout(remaining / max(1, left)):
                    s = await self._session(peer)
                    if not s.shadow_requested:
                        resp = await s.client.execute_command(
                            *format_xshadowrequest(self.node_name, self.queue_database_id).encode("ascii").split(b" "))
                        if resp.code != 250:
                            raise ProtocolError(f"XSHADOWREQUEST answered {resp.code} {resp.message}")
                        s.shadow_requested = True
                    await smtpclient.mail(s.client, msg.sender, [*params, f"XSHADOW={guid}"])
                    for r in recipients:
                        await smtpclient.rcpt(s.client, r)
                    sent_data = True
                    resp = await s.client.data(msg.data)
                    reply = f"{resp.code} {resp.message}"
                    if resp.code == 250 and "2.6.0" in resp.message:
                        ok = True
                        return ShadowResult(peer.name, reply, tuple(u for u in uncertain if u != peer.name))
                    reasons.append(f"{peer.name}: {reply}")
            except aiosmtplib.SMTPResponseException as exc:
                reasons.append(f"{peer.name}: {exc.code} {exc.message}")
                if s is not None:
                    try:
                        await s.client.rset()
                        ok = True  # the session itself is fine
                    except Exception:  # noqa: BLE001
                        ok = False
            except (aiosmtplib.SMTPException, OSError, ProtocolError, asyncio.TimeoutError) as exc:
                reasons.append(f"{peer.name}: {str(exc) or exc.__class__.__name__}")
                if isinstance(exc, (asyncio.TimeoutError, aiosmtplib.SMTPTimeoutError)):
                    timed_out.add(peer.name)
                if sent_data and peer.name not in uncertain:
                    uncertain.append(peer.name)
            finally:
                if s is not None:
                    self._release(s, ok)
        return ShadowResult(None, "; ".join(dict.fromkeys(reasons)) or "No suitable shadow servers",
                            tuple(uncertain))

    async def peer_auth(self, client: aiosmtplib.SMTP) -> None:
        """Prove membership on a delivery session to a peer that takes the message as primary
        without a hop-by-hop shadow (shadow redundancy disabled here or there)."""
        await client.auth_plain(self.node_name, self.cfg.cluster.secret)

    async def hop_session_start(self, client: aiosmtplib.SMTP, peer_name: str) -> str:
        """Authenticate and announce ourselves with XSHADOW on a hop-by-hop delivery session.

        Returns the peer's queue database ID; a changed ID promotes what we hold for it at once.
        """
        if not client.supports_extension("xshadowrequest"):
            raise ProtocolError(f"{peer_name} does not advertise XSHADOWREQUEST")
        await client.auth_plain(self.node_name, self.cfg.cluster.secret)
        resp = await client.execute_command(b"XSHADOW", encode_fqdn(self.node_name).encode("ascii"))
        if resp.code != 250:
            raise ProtocolError(f"XSHADOW answered {resp.code} {resp.message}")
        dbid = decode_dbid(resp.message.strip())
        await self.primary_seen(peer_name, dbid)
        client.peer_dbid = dbid  # the forks sent on this session belong to that queue database
        # PROTOCOL.md 4: the discard exchange runs on every session to the primary, not only the heartbeat.
        discarded: list[tuple[str, str | None]] = []
        try:
            while True:
                resp = await client.execute_command(b"XQDISCARD", str(DISCARD_BATCH).encode())
                batch = parse_discard_entries(resp.code, resp.message.splitlines())
                discarded.extend(batch)
                if len(batch) < DISCARD_BATCH:
                    break
        except ProtocolError as exc:
            log.error("XQDISCARD on a session to %s: protocol violation: %s; keeping every shadow of it",
                      peer_name, exc)
            discarded = []
            # End this session without QUIT: a QUIT would acknowledge ids we did not apply.
            client.discards_unapplied = True
        else:
            # PROTOCOL.md 4: this exchange is a heartbeat, whichever session carried it.
            await self._upsert_context(peer_name, last_heartbeat_at=time.time(), consecutive_failures=0,
                                       last_error=None)
        if discarded:
            await self.discard(peer_name, discarded, time.time())
        return dbid

    async def take_discard_events(self, shadow_node: str, n: int, token: str) -> list[tuple[str, str | None]]:
        """Up to ``n`` discard ids for a shadow, marked as handed out on session ``token``.

        They are deleted when that session ends with QUIT (the shadow applied them first) and
        handed out again if it breaks: a discard is never lost to a dropped connection.
        """
        def job(conn):
            rows = conn.execute(select(discard_events.c.id, discard_events.c.shadow_guid, discard_events.c.reason)
                                .where(discard_events.c.shadow_node == shadow_node,
                                       discard_events.c.sent_token.is_(None))
                                .order_by(discard_events.c.id).limit(n)).all()
            if rows:
                conn.execute(update(discard_events).where(discard_events.c.id.in_([r.id for r in rows]))
                             .values(sent_token=token))
            return [(r.shadow_guid, r.reason) for r in rows]
        return await self.node.store.write(job)

    async def settle_discard_events(self, token: str, acknowledged: bool) -> None:
        def job(conn):
            cond = discard_events.c.sent_token == token
            if acknowledged:
                conn.execute(delete(discard_events).where(cond))
            else:
                conn.execute(update(discard_events).where(cond).values(sent_token=None))
        await self.node.store.write(job)

    # ================================================================== shadow side

    async def primary_seen(self, primary: str, dbid: str) -> None:
        """A primary announced its queue database ID (XSHADOWREQUEST): promote at once on a change.

        Shielded: it runs inside the announcing peer's session, and a peer that gives up and
        disconnects cancels that handler; a promotion cut off after its first step would leave the
        promoted copies ``pending`` (never delivered) until a restart (found by `transportd chaos`).
        One at a time, so two sessions announcing the same new ID promote once."""
        await asyncio.shield(self._primary_seen(primary, dbid))

    async def _primary_seen(self, primary: str, dbid: str) -> None:
        async with self._seen_lock:
            await self._primary_seen_locked(primary, dbid)

    async def _primary_seen_locked(self, primary: str, dbid: str) -> None:
        recorded = await self.node.store.aread(lambda c: c.execute(
            select(shadow_contexts.c.queue_database_id).where(shadow_contexts.c.peer == primary)).scalar())
        if not recorded:
            await self._upsert_context(primary, queue_database_id=dbid)
        elif recorded != dbid and self._state_changes.get(primary) != dbid:
            log.warning("primary %s has a new queue database ID (%s, was %s): promoting its shadows",
                        primary, dbid, recorded)
            # In the background, out of the lock: the peer is waiting for its XSHADOWREQUEST reply,
            # and other sessions' shadow requests must not wait for a promotion of thousands.
            self._state_changes[primary] = dbid
            self._spawn(self._state_change(primary, dbid), f"promoting the shadows of {primary}")

    async def _state_change(self, primary: str, dbid: str) -> None:
        try:
            await self.promote(primary, "ShadowStateChange", keep_dbid=dbid)
            # Recorded only once every old copy is promoted: a crash half-way finds the change again.
            await self._upsert_context(primary, queue_database_id=dbid)
        finally:
            if self._state_changes.get(primary) == dbid:
                del self._state_changes[primary]
        # The shadow copies it held of *our* messages went with its old database: make them again.
        await self.reprotect(primary)

    async def reprotect(self, peer: str) -> int:
        """``peer`` came back with a new queue database: our queued messages shadowed there have lost
        their shadow. Make a new one for each (found by `transportd chaos`: without this, a second
        failure, of this node, before delivery lost them; docs/reliability.md).

        One transaction forgets the lost copies and marks the messages ``reshadowing`` (visible to
        ``message list``, the metrics and the chaos nemesis); the new copies are made concurrently."""
        def claim(conn):
            rows = [dict(r) for r in conn.execute(
                select(messages).join(message_shadows, message_shadows.c.message_id == messages.c.id)
                .where(message_shadows.c.shadow_node == peer, messages.c.role == "primary",
                       messages.c.state == mq.QUEUED)).mappings()]
            ids = list({r["id"] for r in rows})
            if ids:
                conn.execute(delete(message_shadows).where(message_shadows.c.message_id.in_(ids),
                                                           message_shadows.c.shadow_node == peer))
                conn.execute(update(messages).where(messages.c.id.in_(ids)).values(redundancy="reshadowing"))
            return list({r["id"]: r for r in rows}.values())
        rows = await self.node.store.write(claim)
        made = await self._reshadow_all(rows, exclude=None)
        if rows:
            log.warning("%s has a new queue database: made %d of %d lost shadow(s) of our messages again",
                        peer, made, len(rows))
        return len(rows)

    async def protect_unprotected(self, now: float) -> int:
        """Retry a shadow for queued messages accepted (or left) without one, a batch per heartbeat
        round: a peer that was down or cut off when they arrived may be back."""
        if not self.enabled:
            return 0

        def claim(conn):
            rows = [dict(r) for r in conn.execute(
                select(messages).where(messages.c.role == "primary", messages.c.state == mq.QUEUED,
                                       messages.c.redundancy == "unprotected", messages.c.poisoned == 0)
                .order_by(messages.c.id).limit(REPROTECT_BATCH)).mappings()]
            if rows:
                conn.execute(update(messages).where(messages.c.id.in_([r["id"] for r in rows]))
                             .values(redundancy="reshadowing"))
            return rows
        rows = await self.node.store.write(claim)
        made = await self._reshadow_all(rows, exclude=None, track_failure=False)  # tracked when accepted
        if made:
            log.info("made %d unprotected message(s) redundant", made)
        return made

    def _spawn(self, coro: Any, what: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)  # held: the loop keeps only a weak reference to tasks
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or log.error(
            "%s failed: %r", what, t.exception()))
        return task

    async def _upsert_context(self, primary: str, **values: Any) -> None:
        def job(conn):
            exists = conn.execute(select(func.count()).select_from(shadow_contexts)
                                  .where(shadow_contexts.c.peer == primary)).scalar()
            if exists:
                conn.execute(update(shadow_contexts).where(shadow_contexts.c.peer == primary).values(**values))
            else:
                conn.execute(insert(shadow_contexts).values(peer=primary, consecutive_failures=0, **values))
        await self.node.store.write(job)

    async def store_shadow(self, envelope: Any, session: Any, request: Any, guid: str) -> tuple[int, str]:
        """Keep a shadow copy for ``request.primary_fqdn`` durably; returns (internal id, Message-ID)."""
        now = time.time()
        data = envelope.original_content or b""
        message_id, submit_time, subject = header_fields(data)
        smtputf8, body_type = received_as(envelope)
        network_id = _network_id_from(data) or new_network_message_id()
        msg = NewMessage(
            network_message_id=network_id, data=data,
            sender="" if envelope.mail_from in (None, "<>") else envelope.mail_from,
            recipients=bifurcate(envelope.rcpt_tos, self.cfg), received_at=now,
            expires_at=now + self.cfg.delivery.message_expiration_timeout,
            message_id=message_id, submit_time=submit_time,
            subject=subject, client_ip=str((session.peer or ("",))[0]),
            client_hostname=request.primary_fqdn, origin="shadow", role="shadow", redundancy="shadow",
            shadow_guid=guid, primary_node=request.primary_fqdn, primary_dbid=request.primary_dbid,
            smtputf8=smtputf8, body_type=body_type,
        )
        internal_id = await self.node.store.write(lambda c: mq.enqueue(c, msg))
        row = {"id": internal_id, "network_message_id": network_id, "message_id": msg.message_id,
               "sender": msg.sender, "subject": msg.subject, "size": len(data)}
        self.node.track("HARECEIVE", "SMTP", row, recipients=list(envelope.rcpt_tos), source_context=guid,
                        client_hostname=request.primary_fqdn, client_ip=msg.client_ip)
        return internal_id, msg.message_id

    @property
    def heartbeat_limit(self) -> float:
        """The longest one heartbeat exchange may take (connect, AUTH, XSHADOW, XQDISCARD)."""
        return min(30.0, max(1.0, self.sr.shadow_heartbeat_frequency / 2))

    async def _heartbeat_loop(self) -> None:
        freq = self.sr.shadow_heartbeat_frequency
        loop = asyncio.get_running_loop()
        next_round = loop.time() + freq
        while not self._stopping:
            # Rounds start every ``freq`` whatever the last one took (no drift past the span).
            await asyncio.sleep(max(0.0, next_round - loop.time()))
            next_round = max(next_round + freq, loop.time())
            try:
                await self.housekeeping(time.time())
                if self._sweep is None or self._sweep.done():
                    self._sweep = self._spawn(self.protect_unprotected(time.time()),
                                              "making unprotected messages redundant")
                # Every primary at once: one black-holed primary does not delay the others.
                results = await asyncio.gather(*(self.heartbeat(p) for p in await self.primaries_to_poll()),
                                               return_exceptions=True)
                for r in results:
                    if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                        log.error("a heartbeat failed unexpectedly: %r", r)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must survive
                log.exception("shadow heartbeat round failed")

    async def primaries_to_poll(self) -> list[str]:
        def q(conn):
            held = conn.execute(select(messages.c.primary_node).where(
                messages.c.role == "shadow", messages.c.state == mq.QUEUED).distinct()).scalars().all()
            forks = conn.execute(select(shadow_forks.c.primary_node).distinct()).scalars().all()
            asked = conn.execute(select(resubmit_requests.c.for_primary).where(
                resubmit_requests.c.done_at.is_(None)).distinct()).scalars().all()
            return sorted({p for p in list(held) + list(forks) + list(asked) if p})
        return await self.node.store.aread(q)

    async def heartbeat(self, primary: str) -> bool:
        """One XSHADOW + XQDISCARD exchange with ``primary``; returns True on success."""
        peer = self.by_name.get(primary)
        now = time.time()
        ctx = await self.node.store.aread(lambda c: c.execute(
            select(shadow_contexts).where(shadow_contexts.c.peer == primary)).mappings().first())
        recorded = ctx["queue_database_id"] if ctx else None
        failures = ctx["consecutive_failures"] if ctx else 0
        limit = self.heartbeat_limit
        answered: str | None = None
        discarded: list[tuple[str, str | None]] = []
        error = ""
        ok = False
        if peer is None:
            error = f"{primary} is not a configured peer"
        else:
            s: PeerSession | None = None
            try:
                async with asyncio.timeout(limit):  # a black-holed primary costs one limit, not 30 s a step
                    s = await self._session(peer, shadows=False)
                    resp = await s.client.execute_command(b"XSHADOW", encode_fqdn(self.node_name).encode("ascii"))
                    if resp.code != 250:
                        raise ProtocolError(f"XSHADOW answered {resp.code} {resp.message}")
                    answered = decode_dbid(resp.message.strip())
                    if recorded and answered != recorded:
                        ok = True  # the exchange worked; the state changed
                    else:
                        while True:
                            resp = await s.client.execute_command(b"XQDISCARD", str(DISCARD_BATCH).encode())
                            batch = parse_discard_entries(resp.code, resp.message.splitlines())
                            discarded.extend(batch)
                            if len(batch) < DISCARD_BATCH:
                                break
                        ok = True
                        if discarded:
                            await self.discard(primary, discarded, now)
                        await s.client.quit()  # acknowledges the discards we just applied
            except ProtocolError as exc:
                error = f"protocol violation: {exc}"
                log.error("heartbeat to %s: %s; keeping every shadow of it", primary, exc)
            except (aiosmtplib.SMTPException, OSError, asyncio.TimeoutError) as exc:
                if not ok:
                    error = str(exc) or exc.__class__.__name__
            finally:
                if s is not None:
                    s.close()  # heartbeat sessions are not reused for XSHADOWREQUEST
        failures = 0 if ok else failures + 1
        now = time.time()
        since = None if ok else unreachable_since(
            previous=ctx["unreachable_since"] if ctx else None, last_ok=ctx["last_heartbeat_at"] if ctx else None,
            now=now, heartbeat_frequency=self.sr.shadow_heartbeat_frequency, exchange_limit=limit)
        decision = after_heartbeat(ok=ok, unreachable_for=0.0 if since is None else now - since,
                                   recorded_dbid=recorded, answered_dbid=answered,
                                   resubmit_time_span=self.sr.shadow_resubmit_time_span)
        values: dict[str, Any] = {"consecutive_failures": failures, "last_error": error or None,
                                  "unreachable_since": since}
        state_change = decision.promote and decision.reason == "ShadowStateChange"
        if ok:
            values["last_heartbeat_at"] = now
            if answered and not state_change:  # a new ID is recorded once its promotion is done
                values["queue_database_id"] = answered
        await self._upsert_context(primary, **values)
        if not ok:
            self.node.metrics.heartbeat_failures.labels(primary).inc()
            log.warning("heartbeat to primary %s failed (%d in a row): %s", primary, failures, error)
            if since is not None and now - since >= self.cfg.safety_net.primary_safety_net_unreachable_time:
                await self.resubmit_requested(primary, now)
        if decision.promote:
            await self.promote(primary, decision.reason,
                               keep_dbid=answered if decision.reason == "ShadowStateChange" else None)
            if decision.reason == "ShadowHeartbeatFailure":  # a new span starts
                await self._upsert_context(primary, consecutive_failures=0, unreachable_since=time.time())
            else:
                await self._upsert_context(primary, queue_database_id=answered)
        return ok

    async def discard(self, primary: str, entries: list[tuple[str, str | None]], now: float) -> int:
        """Apply discard ids of ``primary``: processed copies go to the Shadow Safety Net; copies an
        operator removed there (reason DeletedByAdmin) are removed here too (never resubmitted)."""
        hold = self.cfg.safety_net.safety_net_hold_time
        reasons = {g: r for g, r in entries}
        guids = list(reasons)

        def job(conn):
            rows, failed = [], []
            for r in conn.execute(select(messages).where(
                    messages.c.role == "shadow", messages.c.primary_node == primary,
                    messages.c.state == mq.QUEUED, messages.c.shadow_guid.in_(guids))).mappings():
                try:  # one copy at a time: a failure leaves that copy a shadow, the others go on
                    faults.check("discard", r)
                    rows.append(dict(r))
                except Exception as exc:  # noqa: BLE001
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
        rows, failed = await self.node.store.write(job)
        for r in rows:
            why = reasons.get(r["shadow_guid"]) or "ExplicitlyDiscarded"
            self.node.track("HADISCARD", "SMTP", r, source_context=f"{why};{r['shadow_guid']}",
                            client_hostname=primary)
        for r, exc in failed:
            await self.node.message_failed(r, "discard", exc)

        def forks_job(conn):
            found = conn.execute(select(shadow_forks.c.message_id, shadow_forks.c.shadow_guid).where(
                shadow_forks.c.primary_node == primary, shadow_forks.c.shadow_guid.in_(guids))).all()
            if not found:
                return []
            conn.execute(delete(shadow_forks).where(shadow_forks.c.primary_node == primary,
                                                    shadow_forks.c.shadow_guid.in_(guids)))
            out = []
            for message_id, guid in found:
                mq.finish_if_done(conn, message_id, now, hold)
                row = mq.message_row(conn, message_id) or {"id": message_id}
                out.append((row, guid))
            return out
        released = await self.node.store.write(forks_job)
        for row, guid in released:
            self.node.track("HADISCARD", "SMTP", row,
                            source_context=f"{reasons.get(guid) or 'ExplicitlyDiscarded'};{guid}",
                            client_hostname=primary)
        return len(rows) + len(released)

    async def promote(self, primary: str, reason: str, keep_dbid: str | None = None) -> int:
        """Make the shadows of ``primary`` primary messages of ours and deliver them.

        ``keep_dbid`` (a state change): shadows made from that queue database, i.e. after the
        primary came back with it, are current and stay shadows; only older ones are promoted.
        The promoted copies are delivered at once (the promotion is the failover) while, in the
        background, each gets a new shadow on another peer (``reshadowing`` until it has one).
        """
        def older(column):
            return [] if keep_dbid is None else [or_(column.is_(None), column != keep_dbid)]

        def page(conn):
            rows = conn.execute(select(messages).where(
                messages.c.role == "shadow", messages.c.primary_node == primary,
                messages.c.state == mq.QUEUED, messages.c.poisoned == 0,
                *older(messages.c.primary_dbid)).order_by(messages.c.id).limit(PROMOTE_PAGE)).mappings().all()
            ids = [r["id"] for r in rows]
            if ids:
                conn.execute(update(messages).where(messages.c.id.in_(ids)).values(
                    role="primary", origin="promoted", redundancy="reshadowing"))
            return [dict(r) for r in rows]

        def forks_job(conn):
            # Forks we handed to that peer: deliver them again (the receiving store drops duplicates).
            found = conn.execute(select(shadow_forks.c.message_id, shadow_forks.c.queue_id).where(
                shadow_forks.c.primary_node == primary, *older(shadow_forks.c.primary_dbid))).all()
            for message_id, queue_id in found:
                conn.execute(update(recipients).where(
                    recipients.c.message_id == message_id, recipients.c.queue_id == queue_id,
                    recipients.c.status == mq.DELIVERED).values(status=mq.READY, next_retry_at=0.0,
                                                                 completed_at=None))
            conn.execute(delete(shadow_forks).where(shadow_forks.c.primary_node == primary,
                                                    *older(shadow_forks.c.primary_dbid)))
            return [mq.message_row(conn, m) or {"id": m} for m, _ in found]

        total, promoted_all = 0, []
        batch = await self.node.store.write(forks_job)
        while True:
            # One page at a time (bounded memory, a short commit each), the loop free in between.
            promoted = await self.node.store.write(page)
            rows, batch = batch + promoted, []
            failed: list[tuple[dict, Exception]] = []
            for r in rows:  # before delivery can take them: the scheduler only runs between awaits
                try:
                    faults.check("promote", r)
                    self.node.track("RESUBMIT", "REDUNDANCY", r, source_context=f"{primary} ({reason})",
                                    reference=str(r.get("primary_internal_id") or r.get("shadow_guid") or r.get("id")))
                except Exception as exc:  # noqa: BLE001 - promoted all the same; counted, the others go on
                    failed.append((r, exc))
            for r, exc in failed:
                await self.node.message_failed(r, "promote", exc)
            total += len(rows)
            promoted_all.extend({k: r[k] for k in _RESHADOW_FIELDS} for r in promoted)  # a slim copy each
            if rows and self.node.delivery is not None:
                self.node.delivery.wake()
            if len(promoted) < PROMOTE_PAGE:
                break
            await asyncio.sleep(0)
        if total:
            self.node.metrics.promotions.labels(primary, reason).inc(total)
            log.warning("promoted %d shadow(s) of %s (%s)", total, primary, reason)
        if promoted_all:
            self._spawn(self._reshadow_all(promoted_all, exclude=primary),
                        f"making the promoted copies of {primary} redundant")
        return total

    async def _reshadow_all(self, rows: list[dict], exclude: str | None, track_failure: bool = True) -> int:
        """Make each copy redundant again, RESHADOW_CONCURRENCY at a time (never a coroutine per
        message: a promotion may hold tens of thousands); returns how many got a shadow. A copy
        whose handling fails is left unprotected (retried every heartbeat round) and counted
        towards the Poison queue; the others go on."""
        made = 0
        for i in range(0, len(rows), RESHADOW_CONCURRENCY):
            done = await asyncio.gather(*(self._reshadow_isolated(r, exclude, track_failure)
                                          for r in rows[i:i + RESHADOW_CONCURRENCY]))
            made += sum(done)
        return made

    async def _reshadow_isolated(self, row: dict, exclude: str | None, track_failure: bool) -> bool:
        try:
            return await self._reshadow(row, exclude, track_failure)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one message never holds up the others
            mid = row["id"]
            try:
                await self.node.store.write(lambda c: c.execute(update(messages).where(
                    messages.c.id == mid, messages.c.redundancy == "reshadowing").values(redundancy="unprotected")))
            except Exception as err:  # noqa: BLE001 - a restart makes "reshadowing" unprotected too
                log.error("could not mark message %s unprotected: %s", mid, err)
            await self.node.message_failed(row, "reshadow", exc)
            return False

    async def _reshadow(self, row: dict, exclude: str | None, track_failure: bool = True) -> bool:
        """Make a promoted or unprotected copy redundant again on another peer (or mark it
        unprotected: the heartbeat loop retries it). Delivery may finish the message meanwhile."""
        async with self._reshadow_slots:
            faults.check("reshadow", row)
            now = time.time()
            mid = row["id"]
            body, addrs = await self.node.store.aread(lambda c: (mq.body(c, mid), list(c.execute(
                select(recipients.c.address).where(recipients.c.message_id == mid,
                                                   recipients.c.status.not_in(mq.TERMINAL))).scalars())))
            result = ShadowResult(None, "No suitable shadow servers")
            guid = str(uuid.uuid4())
            if self.enabled and body is not None and addrs:
                msg = NewMessage(network_message_id=row["network_message_id"], sender=row["sender"], data=body,
                                 recipients={}, received_at=now, expires_at=now, subject=row.get("subject") or "",
                                 smtputf8=bool(row.get("smtputf8")), body_type=row.get("body_type") or "")
                result = await self.make_shadow(msg, guid, addrs, exclude=exclude)

            def settle(conn):
                if result.uncertain:
                    discard_uncertain_job(result.uncertain, guid, now)(conn)
                state = conn.execute(select(messages.c.state).where(messages.c.id == mid)).scalar()
                if result.peer:
                    record_shadow_job(mid, result.peer, guid, now)(conn)
                    if state != mq.QUEUED:
                        # Delivered (or removed) while the copy was made: discard it at once.
                        conn.execute(insert(discard_events).values(shadow_node=result.peer, shadow_guid=guid,
                                                                   created_at=now))
                redundancy = "shadowed" if result.peer else ("unprotected" if addrs else "none")
                conn.execute(update(messages).where(messages.c.id == mid).values(redundancy=redundancy))
                return state
            state = await self.node.store.write(settle)
            if not addrs:
                return False
            if result.peer:
                self.node.track("HAREDIRECT", "SMTP", row, recipients=addrs,
                                source_context=f"{result.peer}={result.reply}")
            elif state == mq.QUEUED and track_failure:
                self.node.track("HAREDIRECTFAIL", "SMTP", row, recipients=addrs, source_context=result.reply)
            return bool(result.peer)

    async def resubmit_for(self, primary: str, destination: str, start: float, end: float) -> int:
        """Resubmit our Shadow Safety Net copies of ``primary`` for a destination and window."""
        from transportd.queue.safetynet import resubmit
        failures: list = []
        done = await self.node.store.write(lambda c: resubmit(
            c, self.cfg, destination=destination, start=start, end=end, sources=("shadow",),
            for_primary=primary, failures=failures))
        for row, exc in failures:
            await self.node.message_failed(row, "resubmit", exc)
        for r in done:
            self.node.track("RESUBMIT", "SAFETYNET", {"id": r.new_id, "network_message_id": r.network_message_id},
                            recipients=r.recipients, reference=str(r.original_id),
                            source_context=f"{destination};MessageResubmit")
        if done and self.node.delivery is not None:
            self.node.delivery.wake()
        log.info("resubmitted %d Shadow Safety Net copies of %s for %s", len(done), primary, destination)
        return len(done)

    async def resubmit_requested(self, primary: str, now: float) -> int:
        """``primary``'s Primary Safety Net has been unreachable for primary_safety_net_unreachable_time:
        the resubmit requests filed for it here become shadow resubmit requests, served from this
        node's Shadow Safety Net (as Exchange does after 12 hours). Returns how many were served."""
        hold = self.cfg.safety_net.safety_net_hold_time
        pending = await self.node.store.aread(lambda c: [dict(r) for r in c.execute(
            select(resubmit_requests).where(resubmit_requests.c.for_primary == primary,
                                            resubmit_requests.c.done_at.is_(None))).mappings()])
        for req in pending:
            if req["created_at"] < now - hold:
                result = "expired: the Safety Net no longer holds that window"
            else:
                n = await self.resubmit_for(primary, req["destination"], req["start_at"], req["end_at"])
                result = f"{n} message(s) resubmitted from the Shadow Safety Net"
                log.warning("%s unreachable for %s: resubmit request %d for %s served here: %s", primary,
                            self.cfg.safety_net.primary_safety_net_unreachable_time, req["id"],
                            req["destination"], result)
            await self.node.store.write(lambda c, rid=req["id"], result=result: c.execute(
                update(resubmit_requests).where(resubmit_requests.c.id == rid).values(done_at=now, result=result)))
        return len(pending)

    async def housekeeping(self, now: float) -> None:
        """Drop discard events nobody asked for; expire shadows never acknowledged."""
        auto = self.sr.shadow_message_auto_discard_interval
        limit = self.cfg.safety_net.safety_net_hold_time + self.cfg.delivery.message_expiration_timeout

        live = set(self.live_discard_tokens)

        hold = self.cfg.safety_net.safety_net_hold_time

        def job(conn):
            conn.execute(delete(discard_events).where(discard_events.c.created_at < now - auto))
            conn.execute(update(resubmit_requests).where(
                resubmit_requests.c.done_at.is_(None), resubmit_requests.c.created_at < now - hold)
                .values(done_at=now, result="expired: its primary answered throughout"))
            orphans = [t for t in conn.execute(select(discard_events.c.sent_token).where(
                discard_events.c.sent_token.is_not(None)).distinct()).scalars() if t not in live]
            if orphans:
                conn.execute(update(discard_events).where(discard_events.c.sent_token.in_(orphans))
                             .values(sent_token=None))
            rows = conn.execute(select(messages).where(
                messages.c.role == "shadow", messages.c.state == mq.QUEUED,
                messages.c.received_at < now - limit).limit(1000)).mappings().all()  # the rest next round
            ids = [r["id"] for r in rows]
            if ids:
                conn.execute(update(messages).where(messages.c.id.in_(ids)).values(
                    state=mq.MSG_REMOVED, completed_at=now))
            return [dict(r) for r in rows]
        for r in await self.node.store.write(job):
            self.node.track("HADISCARD", "SMTP", r, source_context="Expired")


def discard_uncertain_job(peers: tuple[str, ...], guid: str, now: float):
    """Discard events for copies a peer may hold that no message of ours refers to."""
    def job(conn):
        for peer in peers:
            conn.execute(insert(discard_events).values(shadow_node=peer, shadow_guid=guid, created_at=now))
    return job


_INSERT_MESSAGE_SHADOW = insert(message_shadows)  # built once: on the path of every 250


def record_shadow_job(message_id: int, shadow_node: str, guid: str, now: float):
    def job(conn):
        conn.execute(_INSERT_MESSAGE_SHADOW, {"message_id": message_id, "shadow_node": shadow_node,
                                              "shadow_guid": guid, "created_at": now})
    return job


def _network_id_from(data: bytes) -> str | None:
    """The primary's network-message-id, carried in its Received header ('with ESMTP id <guid>')."""
    import re
    m = re.search(rb"\) with ESMTPS? id ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12});",
                  data[:4096])
    return m.group(1).decode("ascii") if m else None
