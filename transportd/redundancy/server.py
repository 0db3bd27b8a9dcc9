"""The transport receive connector: where boundary peers speak the shadow redundancy verbs.

It owns peer authentication (AUTH PLAIN with the node's FQDN as user and the
cluster secret as password; over STARTTLS when the connector has a
certificate), and the server side of XSHADOWREQUEST, XSHADOW, XQDISCARD and
MAIL ``XSHADOW=`` (PROTOCOL.md sections 2-4). Every X-verb from a session that
has not proven membership gets ``550 5.7.1 Not authorized``. It decides nothing
about promotion or storage itself: it calls the node's shadow manager.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from typing import Any, Callable

from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session, syntax

from transportd.smtp import replies
from transportd.redundancy.protocol import (ProtocolError, encode_dbid, encode_fqdn, format_discard_reply, parse_xqdiscard,
                       parse_xshadow, parse_xshadowrequest, redundancy_reply, split_xshadow_param)
from transportd.smtp.server import FrontendHandler, LimitedSMTP, MessageRejected

log = logging.getLogger("transportd.redundancy.server")

S501_INVALID_ARGUMENTS = "501 5.5.4 Invalid arguments"
S503_BAD_SEQUENCE = "503 5.5.1 Bad sequence of commands"
S421_NOT_AVAILABLE = "421 4.3.2 Service not available"


def peer_name(session: Session) -> str | None:
    """The authenticated boundary peer of a session, or None."""
    if getattr(session, "authenticated", False) and isinstance(getattr(session, "auth_data", None), str):
        return session.auth_data
    return None


def make_peer_authenticator(peers: set[str], secret: str) -> Callable[..., AuthResult]:
    def authenticator(server: SMTP, session: Session, envelope: Envelope, mechanism: str,
                      auth_data: Any) -> AuthResult:
        if isinstance(auth_data, LoginPassword) and secret:
            user = auth_data.login.decode("utf-8", "replace").lower()
            if user in peers and hmac.compare_digest(auth_data.password, secret.encode("utf-8")):
                log.info("peer %s authenticated from %s", user, session.peer)
                return AuthResult(success=True, auth_data=user)
        log.warning("peer authentication failed from %s (%s)", session.peer, mechanism)
        return AuthResult(success=False, handled=False)
    return authenticator


class TransportSMTP(LimitedSMTP):
    """LimitedSMTP plus the X-verbs, for the transport connector."""

    def __init__(self, handler: "TransportHandler", **kwargs: Any):
        super().__init__(handler, **kwargs)
        self.manager = handler.manager
        self._discard_token = uuid.uuid4().hex
        # Discard ids may be handed out on this session and not yet acknowledged. Set before the
        # ids are taken, so a session that breaks while they are being taken hands them back too.
        self._discards_out = False
        self.manager.live_discard_tokens.add(self._discard_token)

    async def smtp_QUIT(self, arg: str | None) -> None:
        if self._discards_out:
            # A clean QUIT after XQDISCARD: the shadow has applied the ids; forget them (shielded:
            # a client that hangs up right after its QUIT must not leave them handed out).
            self._discards_out = False
            try:
                await asyncio.shield(self.manager.settle_discard_events(self._discard_token, acknowledged=True))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the housekeeping sweep hands them out again
                log.error("settling discard ids acknowledged by %s failed: %s", self.session.peer, exc)
        await super().smtp_QUIT(arg)

    def connection_lost(self, error: Exception | None) -> None:
        if self._discards_out:
            # The session broke: hand those ids out again on the shadow's next exchange.
            self._discards_out = False
            task = asyncio.ensure_future(
                self.manager.settle_discard_events(self._discard_token, acknowledged=False))
            task.add_done_callback(_log_settle_failure)
        self.manager.live_discard_tokens.discard(self._discard_token)
        super().connection_lost(error)

    # -- helpers --------------------------------------------------------------------

    async def _authorized(self) -> str | None:
        name = peer_name(self.session)
        if name is None:
            log.warning("X-verb from unauthenticated session %s refused", self.session.peer)
            await self.push(replies.S550_NOT_AUTHORIZED)
        return name

    async def _push_raw(self, line: str) -> None:
        """A reply exactly as PROTOCOL.md writes it (no enhanced status code added)."""
        self._writer.write(line.encode("ascii") + b"\r\n")
        await self._writer.drain()

    # -- verbs ----------------------------------------------------------------------

    async def _outside_transaction(self) -> str | None:
        """The authenticated peer, when the verb may run here (a member, no mail transaction open)."""
        name = await self._authorized()
        if name is not None and self.envelope.mail_from is not None:
            await self.push(S503_BAD_SEQUENCE)
            return None
        return name

    @syntax("XSHADOWREQUEST fqdn base64-queue-database-id")
    async def smtp_XSHADOWREQUEST(self, arg: str | None) -> None:
        if await self._outside_transaction() is None:
            return
        if not self.manager.sr.shadow_redundancy_enabled:
            await self.push(replies.S502_NOT_IMPLEMENTED)  # a member, but this node stores no shadows
            return
        try:
            request = parse_xshadowrequest(arg)
        except ProtocolError as exc:
            log.warning("XSHADOWREQUEST from %s: %s", self.session.peer, exc)
            await self.push(S501_INVALID_ARGUMENTS)
            return
        if not self.manager.accepting:
            await self.push(S421_NOT_AVAILABLE)
            return
        if request.primary_fqdn != peer_name(self.session):
            log.warning("XSHADOWREQUEST: peer %s claims to be %s", peer_name(self.session), request.primary_fqdn)
            await self.push(replies.S550_NOT_AUTHORIZED)
            return
        await self.manager.primary_seen(request.primary_fqdn, request.primary_dbid)
        self.session.shadow_request = request
        await self._push_raw(f"250 {encode_fqdn(self.manager.node_name)}")

    @syntax("XSHADOW base64-fqdn")
    async def smtp_XSHADOW(self, arg: str | None) -> None:
        name = await self._outside_transaction()
        if name is None:
            return
        try:
            fqdn = parse_xshadow(arg)
        except ProtocolError as exc:
            log.warning("XSHADOW from %s: %s", self.session.peer, exc)
            await self.push(S501_INVALID_ARGUMENTS)
            return
        if fqdn != name:
            log.warning("XSHADOW: peer %s claims to be %s", name, fqdn)
            await self.push(replies.S550_NOT_AUTHORIZED)
            return
        self.session.xshadow_peer = fqdn
        await self._push_raw(f"250 {encode_dbid(self.manager.queue_database_id)}")

    @syntax("XQDISCARD max-count")
    async def smtp_XQDISCARD(self, arg: str | None) -> None:
        if await self._authorized() is None:
            return
        peer = getattr(self.session, "xshadow_peer", None)
        if peer is None:
            await self.push(S503_BAD_SEQUENCE)
            return
        try:
            n = parse_xqdiscard(arg)
        except ProtocolError:
            await self.push(S501_INVALID_ARGUMENTS)
            return
        self._discards_out = True
        guids = await self.manager.take_discard_events(peer, n, self._discard_token)
        for line in format_discard_reply(guids):
            self._writer.write(line.encode("ascii") + b"\r\n")
        await self._writer.drain()

    @syntax("XRESUBMIT destination start-epoch end-epoch")
    async def smtp_XRESUBMIT(self, arg: str | None) -> None:
        """Safety Net: the asking primary could not cover a window; resubmit our shadow copies of it."""
        name = await self._outside_transaction()
        if name is None:
            return
        from transportd.queue.safetynet import parse_resubmit_arg
        try:
            destination, start, end = parse_resubmit_arg(arg)
        except ValueError:
            await self.push(S501_INVALID_ARGUMENTS)
            return
        n = await self.manager.resubmit_for(name, destination, start, end)
        await self.push(f"250 2.0.0 {n} message(s) resubmitted from the Shadow Safety Net")

    async def smtp_MAIL(self, arg: str | None) -> None:
        if arg and "XSHADOW=" in arg.upper():
            if await self._authorized() is None:
                return
            if not (getattr(self.session, "shadow_request", None) or getattr(self.session, "xshadow_peer", None)):
                await self.push(S503_BAD_SEQUENCE)
                return
            try:
                rest, guid = split_xshadow_param(arg)
            except ProtocolError:
                await self.push(S501_INVALID_ARGUMENTS)
                return
            await super().smtp_MAIL(rest)
            if self.envelope.mail_from is not None:
                self.envelope.xshadow_guid = guid
            return
        await super().smtp_MAIL(arg)


def _log_settle_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("handing discard ids of a broken session out again failed: %s (the housekeeping sweep "
                  "will)", task.exception())


class TransportHandler(FrontendHandler):
    """DATA on the transport connector: a shadow copy, a hop-by-hop primary, or plain submission."""

    def __init__(self, cfg: Any, accept: Any, manager: Any):
        super().__init__(cfg, accept, "transport")
        self.manager = manager

    async def handle_EHLO(self, server: SMTP, session: Session, envelope: Envelope, hostname: str,
                          responses: list[str]) -> list[str]:
        out = await super().handle_EHLO(server, session, envelope, hostname, responses)
        if not self.manager.sr.shadow_redundancy_enabled:
            return out  # disabled: never advertised (the 2010 seed), so peers make no shadows here
        return out[:-1] + ["250-XSHADOWREQUEST", out[-1]]

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope, address: str,
                          rcpt_options: list[str]) -> str:
        if peer_name(session) is not None:
            # A boundary peer relays for the whole boundary: no relay check, no recipient limit
            # beyond its own (the primary already applied them).
            from transportd.queue.routing import valid_address
            if not valid_address(address):
                return replies.S501_BAD_ADDRESS
            envelope.rcpt_tos.append(address)
            envelope.rcpt_options.extend(rcpt_options)
            return replies.S250_RECIPIENT_OK
        return await super().handle_RCPT(server, session, envelope, address, rcpt_options)

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        guid = getattr(envelope, "xshadow_guid", None)
        request = getattr(session, "shadow_request", None)
        if guid and request is not None:
            import asyncio
            task = asyncio.ensure_future(self.manager.store_shadow(envelope, session, request, guid))
            try:
                internal_id, message_id = await asyncio.shield(task)
            except MessageRejected as exc:
                return exc.reply
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                from transportd.redundancy.manager import _network_id_from
                log.exception("storing a shadow copy for %s failed", request.primary_fqdn,
                              extra={"internal_message_id": None,
                                     "network_message_id": _network_id_from(envelope.original_content or b"")})
                return replies.S451_INTERNAL
            return redundancy_reply(message_id, internal_id, self.manager.node_name)
        return await super().handle_DATA(server, session, envelope)
