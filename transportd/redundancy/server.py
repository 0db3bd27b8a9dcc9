"""The transport receive connector: where boundary peers speak the shadow redundancy verbs.

It owns peer authentication (AUTH PLAIN with the node's FQDN as user and the
cluster secret as password; over STARTTLS when the connector has a
certificate), and the server side of XSHADOWREQUEST, XSHADOW, XQDISCARD, XQSTATUS and
MAIL ``XSHADOW=`` (docs/PROTOCOL.md sections 2-4). Every X-verb from a session that
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

from transportd.errors import MessageRejected
from transportd.redundancy.connection import (
    AdoptRequested,
    DiscardRequested,
    Event,
    MailWithShadow,
    Refusal,
    ResubmitRequested,
    ServerConnection,
    ShadowRequestReceived,
    StatusRequested,
    XShadowReceived,
)
from transportd.redundancy.protocol import (
    DELAY_DISCARDS_KEYWORD,
    FAILED_DISCARDS_KEYWORD,
    NOTIFY_DISCARDS_KEYWORD,
    RCPT_DISCARDS_KEYWORD,
    STATUS_KEYWORD,
    has_xshadow_param,
    redundancy_reply,
)
from transportd.smtp import replies
from transportd.smtp.addresses import valid_address
from transportd.smtp.frontend import FrontendHandler, add_recipient, log_failure, undeclared_utf8
from transportd.smtp.headers import network_id_from
from transportd.smtp.server import LimitedSMTP, fixed_hook_signatures

log = logging.getLogger("transportd.redundancy.server")

def peer_name(session: Session) -> str | None:
    """The authenticated boundary peer of a session, or None."""
    if getattr(session, "authenticated", False) and isinstance(getattr(session, "auth_data", None), str):
        return session.auth_data
    return None


# What a former peer (taken out of [[peers]] while it holds shadows of our messages) may still do:
# its heartbeats, so that it learns what we delivered and never promotes a message we hold.
HEARTBEAT_VERBS = frozenset({"XSHADOW", "XQDISCARD", "XQUERYDISCARD", "XQSTATUS"})


PEER_SIZE_ALLOWANCE = 64 * 1024
"""Octets an authenticated peer's message may have over frontend.max_message_size: the headers
the boundary's nodes add (a Received field each, Message-ID and Date where missing; a few hundred
octets a node). Exchange measures a hop inside the organization against the message's original
size (X-MS-Exchange-Organization-OriginalSize) for the same reason: a message the frontend took
at the limit must not be refused as a shadow copy or a hop-by-hop relay."""


def make_peer_authenticator(peers: set[str], secret: str) -> Callable[..., AuthResult]:
    """AUTH PLAIN for ``peers`` (the configured ones and the former ones that hold shadows of our
    messages: ``ShadowManager.former_peers``, held to HEARTBEAT_VERBS) with the cluster secret."""
    def authenticator(server: SMTP, session: Session, envelope: Envelope, mechanism: str,
                      auth_data: Any) -> AuthResult:
        if isinstance(auth_data, LoginPassword) and secret:
            user = peer_user_name(auth_data.login)
            if user in peers and hmac.compare_digest(auth_data.password, secret.encode("utf-8")):
                log.info("peer %s authenticated from %s", user, session.peer)
                return AuthResult(success=True, auth_data=user)
        log.warning("peer authentication failed from %s (%s)", session.peer, mechanism)
        return AuthResult(success=False, handled=False)
    authenticator.user_name = peer_user_name  # type: ignore[attr-defined]  # how PLAIN compares its authzid
    return authenticator


def peer_user_name(login: bytes) -> str:
    """A peer's name in AUTH: its FQDN, in any case."""
    return login.decode("utf-8", "replace").lower()


class TransportSMTP(LimitedSMTP):
    """LimitedSMTP plus the X-verbs: each is judged by this session's ``ServerConnection``."""

    def __init__(self, handler: "TransportHandler", **kwargs: Any):
        super().__init__(handler, **kwargs)
        self.manager = handler.manager
        self.conn = ServerConnection(self.manager.node_name, self.manager.queue_database_id,
                                     shadow_redundancy_enabled=self.manager.sr.shadow_redundancy_enabled,
                                     version=self.manager.sr.version)
        self._discard_token = uuid.uuid4().hex
        self.manager.live_discard_tokens.add(self._discard_token)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.session.redundancy = self.conn  # the handler reads the session's protocol state here

    def trusted_client(self) -> bool:
        """A boundary peer, once authenticated, is not held to the frontend's command rate: anyone
        else on this connector is (a peer's commands before its AUTH count, it is not known yet)."""
        return peer_name(self.session) is not None

    @property
    def data_size_limit(self) -> int | None:
        """The size limit of this session (aiosmtpd's, read by MAIL's SIZE=, DATA, BDAT and EHLO):
        frontend.max_message_size, plus PEER_SIZE_ALLOWANCE once the client authenticated as a
        boundary peer (an EHLO after AUTH advertises that figure); anyone else is held to the
        frontend's limit exactly."""
        limit = self._size_limit
        if limit and peer_name(getattr(self, "session", None)) is not None:
            return limit + PEER_SIZE_ALLOWANCE
        return limit

    @data_size_limit.setter
    def data_size_limit(self, limit: int | None) -> None:
        self._size_limit = limit

    @syntax("QUIT")
    async def smtp_QUIT(self, arg: str | None) -> None:
        if self.conn.discards_out:
            # A clean QUIT after XQDISCARD: the shadow has applied the ids; forget them (shielded:
            # a client that hangs up right after its QUIT must not leave them handed out).
            self.conn.discards_out = False
            try:
                await asyncio.shield(self.manager.settle_discard_events(self._discard_token, acknowledged=True))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the housekeeping sweep hands them out again
                log.error("settling discard ids acknowledged by %s failed: %s", self.session.peer, exc)
        await super().smtp_QUIT(arg)

    def connection_lost(self, error: Exception | None) -> None:
        if self.conn.discards_out:
            # The session broke: hand those ids out again on the shadow's next exchange.
            self.conn.discards_out = False
            task = asyncio.ensure_future(
                self.manager.settle_discard_events(self._discard_token, acknowledged=False))
            task.add_done_callback(_log_settle_failure)
        self.manager.live_discard_tokens.discard(self._discard_token)
        super().connection_lost(error)

    async def _write(self, data: bytes) -> None:
        """Replies exactly as the connection words them (docs/PROTOCOL.md; no enhanced code added)."""
        await self._send(data)

    async def _judge(self, verb: str, arg: str | None) -> Event:
        """The connection's verdict on one command; refusals are answered here."""
        name = peer_name(self.session)
        if name is not None and self.conn.peer_fqdn is None:
            self.conn.authenticated(name)
        if self.envelope.mail_from is None:
            self.conn.transaction_ended()
        self.conn.accepting = self.manager.accepting
        if name in self.manager.former_peers and verb not in HEARTBEAT_VERBS:
            event: Event = Refusal(f"{replies.S550_NOT_AUTHORIZED}\r\n".encode("ascii"),
                                   "no longer a configured peer: only its heartbeats are answered")
        else:
            [event] = self.conn.receive_command(verb, arg)
        if isinstance(event, Refusal):
            log.warning("%s: %s (from %s, %s); refused: %s", verb, event.why or "refused", self.session.peer,
                        name or "not a peer", event.reply.decode("ascii", "replace").strip())
            await self._write(event.reply)
        return event

    @syntax("XSHADOWREQUEST fqdn base64-queue-database-id")
    async def smtp_XSHADOWREQUEST(self, arg: str | None) -> None:
        event = await self._judge("XSHADOWREQUEST", arg)
        if isinstance(event, ShadowRequestReceived):
            await self.manager.heartbeat.primary_seen(event.primary_fqdn, event.primary_queue_database_id)
            await self._write(self.conn.accept_shadow_request())

    @syntax("XSHADOW base64-fqdn")
    async def smtp_XSHADOW(self, arg: str | None) -> None:
        event = await self._judge("XSHADOW", arg)
        if isinstance(event, XShadowReceived):
            await self._write(event.reply)

    @syntax("XQDISCARD max-count [RCPT [FAILED [NOTIFY [DELAY]]]]")
    async def smtp_XQDISCARD(self, arg: str | None) -> None:
        await self._discards("XQDISCARD", arg)

    @syntax("XQUERYDISCARD max-count [RCPT [FAILED [NOTIFY [DELAY]]]]")
    async def smtp_XQUERYDISCARD(self, arg: str | None) -> None:
        """Exchange 2010's name for XQDISCARD (the seed's XQUERYDISCARD): the same exchange."""
        await self._discards("XQUERYDISCARD", arg)

    async def _discards(self, verb: str, arg: str | None) -> None:
        event = await self._judge(verb, arg)
        if isinstance(event, DiscardRequested):
            entries = await self.manager.take_discard_events(event.peer_fqdn, event.max_count, self._discard_token,
                                                             recipients=event.recipients, failed=event.failed,
                                                             notify=event.notify, delay=event.delay)
            await self._write(self.conn.discard_reply(entries))

    @syntax("XQSTATUS guid ...")
    async def smtp_XQSTATUS(self, arg: str | None) -> None:
        """*transportd*: the shadow asks which of the messages it holds copies of we still know."""
        event = await self._judge("XQSTATUS", arg)
        if isinstance(event, StatusRequested):
            statuses = await self.manager.shadow_status(event.peer_fqdn, list(event.guids))
            await self._write(self.conn.status_reply(statuses))

    @syntax("XRESUBMIT destination start-epoch end-epoch")
    async def smtp_XRESUBMIT(self, arg: str | None) -> None:
        """Safety Net: the asking primary could not cover a window; resubmit our shadow copies of it."""
        event = await self._judge("XRESUBMIT", arg)
        if isinstance(event, ResubmitRequested):
            n = await self.manager.shadow_queues.resubmit_for(event.peer_fqdn, event.destination, event.start,
                                                              event.end)
            await self._write(self.conn.resubmit_reply(n))

    @syntax("XSHADOWADOPT base64-fqdn-of-lost-primary rank guid ...")
    async def smtp_XSHADOWADOPT(self, arg: str | None) -> None:
        """N-way: the peer promoted these shadows of a lost primary; ours become its shadows."""
        event = await self._judge("XSHADOWADOPT", arg)
        if isinstance(event, AdoptRequested):
            request = self.conn.shadow_request
            adopted = await asyncio.shield(self.manager.shadow_queues.adopt(
                event.old_primary, event.peer_fqdn, request.primary_dbid if request else None, event.rank,
                list(event.guids)))
            await self._write(self.conn.adopt_reply(adopted))

    @syntax("MAIL FROM: <address>", extended=" [SP <mail-parameters>]")  # aiosmtpd's, which an override drops
    async def smtp_MAIL(self, arg: str | None) -> None:
        """MAIL; with an ``XSHADOW=`` parameter (not a local part ``xshadow=...``, a plain sender)
        judged by the connection first, and taken off before aiosmtpd reads the rest."""
        if peer_name(self.session) in self.manager.former_peers:
            # Not one of ours any more: no new mail from it (a transient refusal, as its failed AUTH
            # was before: its mail waits for whatever the operator does about it).
            await self._write(f"{replies.S451_FORMER_PEER}\r\n".encode("ascii"))
            return
        if arg and has_xshadow_param(arg):
            event = await self._judge("MAIL", arg)
            if isinstance(event, Refusal):
                return  # answered
            if isinstance(event, MailWithShadow):
                arg = event.rest_of_arg
        await super().smtp_MAIL(arg)
        if self.envelope.mail_from is not None:
            self.conn.transaction_started()


def _log_settle_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("handing discard ids of a broken session out again failed: %s (the housekeeping sweep "
                  "will)", task.exception())


@fixed_hook_signatures
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
        # 2013 takes shadow requests; 2010 advertises XSHADOW (hop-by-hop shadows, discard polling).
        if self.manager.sr.version == "2010":
            return out[:-1] + ["250-XSHADOW", out[-1]]
        return out[:-1] + ["250-XSHADOWREQUEST", f"250-{RCPT_DISCARDS_KEYWORD}", f"250-{FAILED_DISCARDS_KEYWORD}",
                           f"250-{NOTIFY_DISCARDS_KEYWORD}", f"250-{DELAY_DISCARDS_KEYWORD}", f"250-{STATUS_KEYWORD}",
                           out[-1]]

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope, address: str,
                          rcpt_options: list[str]) -> str:
        if peer_name(session) is not None:
            # A boundary peer relays for the whole boundary: no relay check, no recipient limit
            # beyond its own (the primary already applied them).
            if not valid_address(address):
                return replies.S501_BAD_ADDRESS
            if undeclared_utf8(envelope, address):
                return replies.S553_UNDECLARED_UTF8
            add_recipient(server, envelope, address, rcpt_options)
            return replies.S250_RECIPIENT_OK
        return await super().handle_RCPT(server, session, envelope, address, rcpt_options)

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        conn: ServerConnection | None = getattr(session, "redundancy", None)
        guid = conn.shadow_guid if conn is not None else None
        request = conn.shadow_request if conn is not None else None
        if guid and request is not None:
            task = asyncio.ensure_future(self.manager.shadow_queues.store_shadow(envelope, session, request, guid,
                                                                                 conn.shadow_rank))
            try:
                internal_id, message_id = await asyncio.shield(task)
            except MessageRejected as exc:
                return exc.reply
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                log_failure(log, exc, "storing a shadow copy for %s failed", request.primary_fqdn,
                            extra={"internal_message_id": None,
                                   "network_message_id": network_id_from(envelope.original_content or b"")})
                return replies.S451_INTERNAL
            # Naming the queue database that holds the copy: the primary re-makes it when we come
            # back with another one (docs/PROTOCOL.md section 2).
            return redundancy_reply(message_id, internal_id, self.manager.node_name,
                                    queue_database_id=self.manager.queue_database_id)
        return await super().handle_DATA(server, session, envelope)

    def accepted_reply(self, internal_id: int, session: Session) -> str:
        if self.cfg.transport.exchange_acceptance_reply:
            return redundancy_reply(getattr(session, "accepted_message_id", ""), internal_id, self.manager.node_name,
                                    what="delivery")
        return super().accepted_reply(internal_id, session)
