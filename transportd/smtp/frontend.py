"""The frontend receive connector's rules: relay control, recipients, and DATA into the accept path.

It owns what a client may send through the frontend (well-formed addresses,
recipients in accepted domains or relay for trusted networks and authenticated
users, the recipient limit), the headers a received message gets (Received,
Message-ID and Date when missing), and the mapping of every internal error to
``451 4.3.0``. It never writes the queue itself: ``handle_DATA`` hands the
envelope to the node's ``accept`` coroutine, shielded so a client that
disconnects cannot cancel a commit half-way, and answers 250 only when that returns.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiosmtpd.smtp import SMTP, Envelope, Session

from transportd.errors import MessageRejected, StoreError
from transportd.smtp import replies
from transportd.smtp.addresses import (
    address_literal_of,
    domain_of,
    is_accepted,
    postmaster_address,
    relay_allowed,
    valid_address,
)
from transportd.smtp.headers import header_fields, rfc5322_date
from transportd.smtp.server import fixed_hook_signatures

log = logging.getLogger("transportd.smtp.frontend")


@dataclass
class PreparedMessage:
    data: bytes
    message_id: str
    submit_time: str
    subject: str
    author: str = ""  # the Sender (else From) address: MSGTRK's sender-address


def add_recipient(server: Any, envelope: Envelope, address: str, rcpt_options: list[str]) -> None:
    """A recipient taken: in the envelope, with its RFC 3461 parameters (NOTIFY=, ORCPT=, as the
    session checked them) in ``envelope.dsn_rcpt`` by address, the first RCPT's for a repeated one."""
    envelope.rcpt_tos.append(address)
    envelope.rcpt_options.extend(rcpt_options)
    params = getattr(server, "dsn_params", "")
    if params:
        if not hasattr(envelope, "dsn_rcpt"):
            envelope.dsn_rcpt = {}
        envelope.dsn_rcpt.setdefault(address.lower(), params)


def received_as(envelope: Envelope) -> tuple[bool, str]:
    """How the client sent it: (SMTPUTF8 given, BODY= value upper-cased or "")."""
    body = ""
    for option in getattr(envelope, "mail_options", None) or ():
        if option.upper().startswith("BODY="):
            body = option[5:].upper()
    return bool(getattr(envelope, "smtp_utf8", False)), body


def received_protocol(*, extended: bool, tls: bool, authenticated: bool, smtputf8: bool) -> str:
    """The ``with`` of a Received field: SMTP after HELO, ESMTP after EHLO, S with TLS and A with
    AUTH (RFC 3848); UTF8SMTP, with the same S and A, for an SMTPUTF8 transaction (RFC 6531 3.7.3;
    SMTPUTF8 needs EHLO, so it has no HELO form)."""
    if smtputf8:
        return "UTF8SMTP" + ("S" if tls else "") + ("A" if authenticated else "")
    return ("ESMTP" if extended else "SMTP") + ("S" if tls else "") + ("A" if authenticated else "")


def prepare_message(data: bytes, *, node_name: str, client_ip: str, helo: str, network_message_id: str,
                    now: float, connector: str = "frontend", tls: bool = False, extended: bool = True,
                    authenticated: bool = False, smtputf8: bool = False) -> PreparedMessage:
    """Add Received (always), Message-ID and Date (when missing); read Subject. Pure."""
    message_id, submit_time, subject, author = header_fields(data)
    extra: list[str] = []
    date_text = rfc5322_date(now)
    helo_safe = re.sub(r"[^\x21-\x7e]", "?", helo or "unknown")[:255]
    proto = received_protocol(extended=extended, tls=tls, authenticated=authenticated, smtputf8=smtputf8)
    extra.append(f"Received: from {helo_safe} ([{address_literal_of(client_ip)}])\r\n\tby {node_name} ({connector}) with {proto}"
                 f" id {network_message_id};\r\n\t{date_text}")
    if not message_id:
        message_id = f"<{network_message_id}@{node_name}>"
        extra.append(f"Message-ID: {message_id}")
    if not submit_time:
        submit_time = date_text
        extra.append(f"Date: {date_text}")
    prefix = ("\r\n".join(extra) + "\r\n").encode("ascii", "replace")
    if data and not _FIELD_START.match(data):
        # No header section (a body typed straight after DATA, or a first line that would fold
        # into our Date): the blank line makes it the body, as Postfix's cleanup does. The
        # client's octets are kept as they came.
        prefix += b"\r\n"
    return PreparedMessage(prefix + data, message_id[:998], submit_time[:200], subject, author)


_FIELD_START = re.compile(rb"[!-9;-~]+[ \t]*:|\r?\n")
"""What a message's first line starts with when it has a header section (a field name and its
colon, RFC 5322 2.2, blanks before the colon as its obsolete syntax allows), or an empty header
section (the blank line itself)."""


AcceptFn = Callable[[Envelope, Session, str], Awaitable[int]]


@fixed_hook_signatures
class FrontendHandler:
    """aiosmtpd handler hooks: relay policy, limits, and DATA into the node's accept path."""

    def __init__(self, cfg: Any, accept: AcceptFn, connector: str = "frontend"):
        self.cfg = cfg
        self.accept = accept
        self.connector = connector

    async def handle_EHLO(self, server: SMTP, session: Session, envelope: Envelope, hostname: str,
                          responses: list[str]) -> list[str]:
        session.host_name = hostname
        # aiosmtpd writes "250-AUTH" with no mechanism after it where none is offered: no line at all
        out = [r for r in responses if not r.startswith("250 HELP") and r.rstrip() != "250-AUTH"]
        out.append("250-PIPELINING")
        if getattr(server, "chunking", False):
            out.append("250-CHUNKING")
        if getattr(server, "dsn", False):
            out.append("250-DSN")
        out.append("250-ENHANCEDSTATUSCODES")
        out.append("250 HELP")
        return out

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope, address: str,
                          mail_options: list[str]) -> str:
        # aiosmtpd hands the null sender over as "<>" (and needs a non-empty mail_from for RCPT):
        # keep it as "<>" in the envelope; the accept path stores it as "".
        if address and address != "<>" and not valid_address(address):
            return replies.S501_BAD_SENDER
        if undeclared_utf8(envelope, address):
            return replies.S553_UNDECLARED_UTF8
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        envelope.dsn_mail = getattr(server, "dsn_params", "")  # RFC 3461: RET=, ENVID= (smtp/server.py)
        return replies.S250_SENDER_OK

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope, address: str,
                          rcpt_options: list[str]) -> str:
        if address.lower() == "postmaster":  # <Postmaster>, no domain
            address = postmaster_address(self.cfg.routing.accepted_domains) or ""
            if not address:
                return replies.S550_NO_POSTMASTER
        if not valid_address(address):
            return replies.S501_BAD_ADDRESS
        if undeclared_utf8(envelope, address):
            return replies.S553_UNDECLARED_UTF8
        if len(envelope.rcpt_tos) >= self.cfg.frontend.max_recipients_per_message:
            return replies.S452_TOO_MANY_RECIPIENTS
        if not is_accepted(domain_of(address), self.cfg.routing.accepted_domains):
            peer = session.peer[0] if session.peer else ""
            if not (session.authenticated or relay_allowed(str(peer), self.cfg.routing.trusted_networks)):
                log.info("relay denied: %s -> %s", peer, address)
                return replies.S550_RELAY_DENIED
        add_recipient(server, envelope, address, rcpt_options)
        return replies.S250_RECIPIENT_OK

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        task = asyncio.ensure_future(self.accept(envelope, session, self.connector))
        task.add_done_callback(_log_orphan_failure)
        try:
            internal_id = await asyncio.shield(task)
        except MessageRejected as exc:
            return exc.reply
        except asyncio.CancelledError:
            # The client went away; the shielded accept finishes on its own (the sender retries).
            raise
        except Exception as exc:  # noqa: BLE001 - never a 5xx for our own failure
            log_failure(log, exc, "accepting a message from %s failed", session.peer)
            return replies.S451_INTERNAL
        return self.accepted_reply(internal_id, session)

    def accepted_reply(self, internal_id: int, session: Session) -> str:
        """The 250 for a message made durable (the transport connector may word it as Exchange)."""
        return replies.S250_QUEUED.format(id=internal_id)

    async def handle_exception(self, error: Exception) -> str:
        log_failure(log, error, "SMTP session error")
        return replies.S451_INTERNAL


def log_failure(logger: logging.Logger, exc: BaseException, what: str, *args: Any, **kwargs: Any) -> None:
    """Log an internal failure answered 451: a StoreError (the queue database: a full disk...) in
    one line, anything else with its traceback (a bug to find)."""
    if isinstance(exc, StoreError):
        logger.error(what + ": %s", *args, exc, **kwargs)
    else:
        logger.error(what + ": %s", *args, exc, exc_info=exc, **kwargs)


def undeclared_utf8(envelope: Envelope, address: str) -> bool:
    """A non-ASCII address in a transaction whose MAIL did not give SMTPUTF8: RFC 6531 lets a
    client send one only with that parameter (a reply with 5.6.7, as Postfix's)."""
    return not address.isascii() and not getattr(envelope, "smtp_utf8", False)


def _log_orphan_failure(task: asyncio.Future) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, MessageRejected):
        log.debug("accept failed: %r", exc)


def new_network_message_id() -> str:
    return str(uuid.uuid4())
