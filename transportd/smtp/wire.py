"""The asyncio adapter under our pipelining SMTP client: one TCP (or STARTTLS) stream to a peer's
transport connector or to a next hop outside the boundary.

It owns the socket: connecting and reading the greeting, EHLO and the keywords the
server offers (HELO where a next hop does not know EHLO), STARTTLS (required to peers,
with the certificate checked against ``transport.tls_ca`` where set; used when offered
by a next hop, and then only opportunistic: a refusal goes on in plaintext, a failed
handshake raises ``TlsHandshakeFailed`` for a new session without it), AUTH PLAIN's
exchange, writing bytes a caller (a sans-I/O ``Transaction`` or ``ClientConnection``)
produced, and reading replies one at a time as they come, so a pipelined group's replies
are taken from the stream in order. It never
decides what to send or what a reply means for a message (smtp/transaction.py,
redundancy/connection.py and node/connectors.py do), and it holds no queue database.
(aiosmtplib, the client before it, reads one reply per command written, which pipelining
cannot use.)
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import ssl
from dataclasses import dataclass
from typing import Any

from transportd.errors import (
    GreetingRefused,
    PeerPermanentError,
    PeerTransientError,
    ProtocolError,
    TlsHandshakeFailed,
    TlsRequired,
)

log = logging.getLogger("transportd")

MAX_REPLY_LINES = 200
# What of a reply's text is no text (RFC 5321 4.2: HT, SP and printable characters; RFC 6531 adds
# UTF-8): C0 controls but HT, DEL and the C1 controls. Each becomes "?" here, where every reply of
# a next hop or a peer enters the node, so its words reach the DSN, the tracking log, the queue
# database's last error and the log as clean text (a NUL made the DSN impossible: the message went
# to Poison, its sender never told). Octets that are no UTF-8 are already U+FFFD ("replace").
_NOT_TEXT = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
QUIT_WAIT = 5.0  # seconds a QUIT's reply is awaited at most: the session is over either way


@dataclass(frozen=True)
class Reply:
    code: int
    message: str  # its lines joined with LF


def tls_context(options: dict[str, Any]) -> ssl.SSLContext:
    """The context for STARTTLS from the session's options (``validate_certs``, ``cert_bundle``)."""
    if options.get("validate_certs"):
        ctx = ssl.create_default_context(cafile=options.get("cert_bundle"))
        ctx.check_hostname = options.get("check_hostname", True)
        return ctx
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def tls_failure(exc: BaseException) -> str:
    """Why a TLS handshake (or the EHLO over it) failed, in OpenSSL's words without its source
    location: ``certificate verify failed: certificate has expired``, ``wrong version number``."""
    if isinstance(exc, ssl.SSLError):
        return re.sub(r"^\[SSL: [A-Z0-9_]+\] |\s*\(_ssl\.c:\d+\)$", "", str(exc)) or exc.__class__.__name__
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or exc.__class__.__name__
    return text.replace("\r", " ").replace("\n", " ")


class SmtpWire:
    """One session's stream. Every reply is awaited at most ``timeout``; a closed stream raises
    PeerTransientError, a reply that is no SMTP reply ProtocolError. ``start_tls``: True
    requires STARTTLS, None uses it when the server offers it, False
    never; ``helo_fallback``: HELO after an EHLO answered with any 5xx (RFC 5321 4.1.1.1, 4.1.4)."""

    def __init__(self, hostname: str, port: int, *, local_hostname: str, timeout: float,
                 start_tls: bool | None = False, helo_fallback: bool = False, address: str | None = None,
                 **tls: Any):
        self.hostname = hostname
        self.address = address  # connected to where the host's address was looked up (smtp/mx.py)
        self.port = port
        self.local_hostname = local_hostname
        self.timeout = timeout
        self.start_tls = start_tls
        self.helo_fallback = helo_fallback
        self.tls = tls
        self.extensions: dict[str, str] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._deadline: float | None = None  # while a reply is awaited (read_reply)
        self._watch: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ the session

    async def connect(self, timeout: float | None = None) -> Reply:
        """Open the connection (within ``timeout``: the TCP connect only) and read the greeting as
        every reply, within the session's ``timeout`` (220; a 554 gets its QUIT before the close)."""
        self._reader, self._writer = await asyncio.wait_for(
            asyncio.open_connection(self.address or self.hostname, self.port, limit=1 << 20), timeout or self.timeout)
        greeting = await self.read_reply()
        if greeting.code != 220:
            await self._quit_refused(greeting)
            self.close()
            error = GreetingRefused if 400 <= greeting.code < 500 else PeerTransientError
            raise error(f"greeting {greeting.code} {greeting.message}")
        return greeting

    @property
    def where(self) -> str:
        """The server as a reply or a log names it: ``host:port``, ``host[address]:port`` where
        the host's address was looked up (an MX host)."""
        host = f"{self.hostname}[{self.address}]" if self.address and self.address != self.hostname else self.hostname
        return f"{host}:{self.port}"

    async def ehlo(self) -> Reply:
        """EHLO, with STARTTLS first where required or offered and wanted (then EHLO again, as
        RFC 3207 asks). Where TLS is required and cannot be had, ``TlsRequired`` says why, naming
        the server once: the enhanced status code X.7.10 ("Encryption Needed", RFC 5248's
        registry) where it offers or starts no TLS, X.7.5 ("Cryptographic failure", RFC 3463)
        where the handshake or the certificate's check failed (Postfix's "encrypt" level defers
        the same cases, with 4.7.4 and 4.7.5: RFC 3463 has X.7.4 for permanent errors only)."""
        reply = await self._ehlo()
        offered = self.supports_extension("starttls")
        if self.start_tls is True and not offered:
            raise TlsRequired(f"{self.where} does not offer STARTTLS", "4.7.10")
        if self.start_tls is True or (self.start_tls is None and offered):
            answer = await self.execute_command(b"STARTTLS")
            if answer.code != 220:
                if self.start_tls is None:
                    # Opportunistic (RFC 3207 4.1: the client decides whether to go on): the
                    # session is as it was before STARTTLS, as Postfix's "may" goes on.
                    log.warning("%s:%d answered STARTTLS %d %s: going on without TLS", self.hostname, self.port,
                                answer.code, answer.message.replace("\n", " "))
                    return reply
                said = answer.message.replace("\n", " ")
                raise TlsRequired(f"{self.where} answered STARTTLS {answer.code} {said}", "4.7.10")
            assert self._writer is not None and self._reader is not None
            if self._reader._buffer:
                # Plaintext after the 220 (the client side of CVE-2011-0411's class, as Postfix's
                # client does): never read as if it came over TLS.
                log.warning("%s:%d sent %d octet(s) in plaintext after its STARTTLS 220: discarded",
                            self.hostname, self.port, len(self._reader._buffer))
                self._reader._buffer.clear()
            try:
                await asyncio.wait_for(self._writer.start_tls(tls_context(self.tls), server_hostname=self.hostname),
                                       self.timeout)
                reply = await self._ehlo()
            except (OSError, TimeoutError, PeerTransientError, ProtocolError) as exc:
                self.close()
                if self.start_tls is True:
                    raise TlsRequired(f"TLS with {self.where} failed: {tls_failure(exc)}", "4.7.5") from exc
                raise TlsHandshakeFailed(f"STARTTLS with {self.hostname}:{self.port} failed: "
                                         f"{exc.__class__.__name__}: {exc}") from exc
        return reply

    async def _ehlo(self) -> Reply:
        self.extensions = {}
        reply = await self.execute_command(b"EHLO", self.local_hostname.encode("ascii"))
        if 500 <= reply.code < 600 and self.helo_fallback:
            # Any refusal of EHLO, not only 500 / 502 (RFC 5321 4.1.4 names 501 and 550 too; a
            # server may refuse ESMTP with a 554 and take HELO): HELO next, as Postfix's client does.
            reply = await self.execute_command(b"HELO", self.local_hostname.encode("ascii"))
            if reply.code != 250:
                await self._quit_refused(reply)
                raise PeerPermanentError(f"HELO answered {reply.code} {reply.message}")
            return reply
        if reply.code != 250:
            await self._quit_refused(reply)
            raise PeerPermanentError(f"EHLO answered {reply.code} {reply.message}")
        for line in reply.message.split("\n")[1:]:
            keyword, _, rest = line.strip().partition(" ")
            self.extensions[keyword.lower()] = rest
        return reply

    async def _quit_refused(self, reply: Reply) -> None:
        """A session refused with a 5xx (a 554 greeting, EHLO or HELO refused) ends with QUIT and
        its reply, awaited at most QUIT_WAIT (RFC 5321 3.1, 4.1.4: the server may wait for it
        before it closes); a 4xx (421) is the server closing: nothing is sent then."""
        if reply.code < 500:
            return
        try:
            await asyncio.wait_for(self.quit(), min(self.timeout, QUIT_WAIT))
        except Exception:  # noqa: BLE001 - the session is over either way
            self.close()

    def supports_extension(self, name: str) -> bool:
        return name.lower() in self.extensions

    async def auth_plain(self, username: str, password: str) -> Reply:
        token = base64.b64encode(b"\0" + username.encode("utf-8") + b"\0" + password.encode("utf-8"))
        reply = await self.execute_command(b"AUTH", b"PLAIN", token)
        if reply.code != 235:
            raise PeerPermanentError(f"AUTH PLAIN answered {reply.code} {reply.message}")
        return reply

    @property
    def is_connected(self) -> bool:
        """Open, and the peer has not closed its side (an idle pooled session it dropped is not reused)."""
        return (self._writer is not None and not self._writer.is_closing()
                and not (self._reader is not None and self._reader.at_eof()))

    @property
    def idle(self) -> bool:
        """Connected, and nothing from the peer waits unread (a 421 before its close, say)."""
        return self.is_connected and not (self._reader is not None and self._reader._buffer)

    # ------------------------------------------------------------------ bytes and replies

    def write(self, data: bytes) -> None:
        if not self.is_connected:
            raise PeerTransientError(f"the session to {self.hostname}:{self.port} is closed")
        assert self._writer is not None
        self._writer.write(data)

    async def execute_command(self, *words: bytes) -> Reply:
        """One command line, one reply."""
        self.write(b" ".join(words) + b"\r\n")
        return await self.read_reply()

    async def read_reply(self) -> Reply:
        """The next reply from the stream (multi-line replies joined), within ``timeout``. One timer
        per session, its deadline pushed back at each reply (an ``asyncio.timeout`` per reply cost
        ~12 us of CPU here, a few per message): a reply not there by the deadline fails the read
        with TimeoutError and closes the session (it is out of step: never used again)."""
        loop = asyncio.get_running_loop()
        self._deadline = deadline = loop.time() + self.timeout
        if self._watch is None or self._watch.when() > deadline:  # (a timer set for later: set it again)
            if self._watch is not None:
                self._watch.cancel()
            self._watch = loop.call_at(deadline, self._check_deadline)
        try:
            return await self._read_reply()
        finally:
            self._deadline = None

    def _check_deadline(self) -> None:
        self._watch = None
        if self._deadline is None:
            return  # no reply awaited now: the next read sets the timer again
        loop = asyncio.get_running_loop()
        if self._deadline > loop.time():  # a later reply's deadline: look again then
            self._watch = loop.call_at(self._deadline, self._check_deadline)
            return
        if self._reader is not None:
            self._reader.set_exception(TimeoutError(
                f"no reply from {self.hostname}:{self.port} within {self.timeout:g} s"))
        self.close()

    async def _read_reply(self) -> Reply:
        lines: list[str] = []
        while True:
            line = await self._read_line()
            text = _NOT_TEXT.sub("?", line.rstrip(b"\r\n").decode("utf-8", "replace"))
            code = text[:3]
            if not (len(code) == 3 and code.isdigit()) or text[3:4] not in ("", " ", "-"):
                raise ProtocolError(f"not an SMTP reply line from {self.hostname}: {text[:60]!r}")
            lines.append(text[4:])
            if text[3:4] != "-":
                return Reply(int(code), "\n".join(lines))
            if len(lines) > MAX_REPLY_LINES:
                raise ProtocolError(f"a reply of more than {MAX_REPLY_LINES} lines from {self.hostname}")

    async def _read_line(self) -> bytes:
        if self._reader is None:
            raise PeerTransientError("not connected")
        try:
            line = await self._reader.readuntil(b"\n")
        except asyncio.IncompleteReadError:
            self.close()
            raise PeerTransientError(f"{self.hostname}:{self.port} closed the connection") from None
        except asyncio.LimitOverrunError:
            self.close()
            raise ProtocolError(f"a reply line too long from {self.hostname}") from None
        return line

    async def rset(self) -> Reply:
        return await self.execute_command(b"RSET")

    async def quit(self) -> None:
        try:
            await self.execute_command(b"QUIT")
        finally:
            self.close()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - closing a broken stream
                pass
