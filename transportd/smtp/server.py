"""The receive side of SMTP: aiosmtpd at the edge, with our limits inside.

It owns the SMTP session rules every receive connector shares: EHLO keywords,
limits (size, line length, commands per second, connections per connector and
per source, absolute and inactivity timeouts), reading DATA in chunks, BDAT
(CHUNKING, RFC 3030: every chunk read, also a refused one), reply
wording with enhanced status codes, AUTH for configured users, and the factory
that builds a session. It never decides relay or storage: a handler does
(smtp/frontend.py, redundancy/server.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import inspect
import logging
import re
import socket
import weakref
from typing import Any, Awaitable, Callable

from aiosmtpd.smtp import (
    MISSING,
    SMTP,
    AuthResult,
    Envelope,
    LoginPassword,
    Session,
    TLSSetupException,
    syntax,
)

from transportd.smtp import dsnparams, replies
from transportd.smtp.tls import ServerTLS

log = logging.getLogger("transportd.smtp.server")


DATA_TOO_LONG, DATA_TOO_MUCH = "too long", "too much"
_HELD_LINES = 64  # a multiline reply longer than this goes out in more than one write


async def read_data(reader: asyncio.StreamReader, size_limit: int | None,
                    line_limit: int) -> tuple[bytes, str | None]:
    """Read a DATA body up to its lone-dot line: (content, error), dots unstuffed (RFC 5321 4.5.2).

    The same content and errors as reading line by line (aiosmtpd's way, ~0.7 ms of CPU per
    10 KiB message), in chunks as large as the stream's limit: the separator searched is a line
    feed followed by a dot, so only lines that start with a dot take a step of their own. Never
    reads past the terminating line, so pipelined commands stay in ``reader``.
    ``error``: None, DATA_TOO_LONG (a line, its line end included and its stuffing dot not, over
    ``line_limit``; a bare CR or LF ends a line too, see ``_lines_fit``) or DATA_TOO_MUCH
    (more than ``size_limit`` octets); after an error the content is dropped but the message is
    still read to its end. ``size_limit`` counts the message's octets, CRLFs included, stuffing
    dots not (RFC 1870 section 4, as SIZE declares it).
    """
    parts: list[bytes] = []
    size = 0
    error: str | None = None

    def add(piece: bytes) -> None:
        nonlocal size, error
        size += len(piece)
        if error is None and size_limit and size > size_limit:
            error = DATA_TOO_MUCH
        if error is None:
            parts.append(piece)
        else:
            parts.clear()  # the reply is an error: keep no memory for the rest

    line_start, dot = True, False  # dot: a line's first octet was a dot, just consumed
    last = b""  # the last octet read in the middle of a line
    while True:
        if dot:
            dot = False
            rest = await _rest_of_line(reader)
            if rest == b"\r\n":
                break  # the lone dot: end of data
            # the stuffing dot: dropped from the content, and counted neither in the size (RFC
            # 1870 section 4: a message's size excludes "any doubled quoting dots") nor in the
            # line's length (RFC 5321 4.5.3.1.6: the limit is on the text, "not counting the
            # leading dot duplicated for transparency"; BDAT's lines have no such dot either)
            if _first_line_length(rest) + 2 > line_limit:
                error = error or DATA_TOO_LONG
            add(rest)
            line_start = True
        elif line_start:
            last = await reader.readexactly(1)
            if last == b".":
                dot = True
            else:
                add(last)
                line_start = False
        else:
            try:
                piece = await reader.readuntil(b"\n.")
            except asyncio.LimitOverrunError as exc:
                # No separator within the stream's limit: take what was scanned and go on.
                piece = await reader.readexactly(exc.consumed)
                add(piece)
                last = piece[-1:]
                continue
            # A line starts after CRLF only (a bare LF does not end a line); the CR may have
            # come in the previous piece.
            if (piece[-3:-2] if len(piece) >= 3 else last) == b"\r":
                add(piece[:-1])
                dot = True
            else:
                add(piece)
                last = b"."
    if error is not None:
        return b"", error
    data = b"".join(parts)
    # Lines read in chunks were not measured one by one: measure them now (a line after a
    # stuffing dot was measured above, without that dot).
    if data and not _lines_fit(data, line_limit):
        return b"", DATA_TOO_LONG
    return data, None


_LINE_END = re.compile(rb"\r\n|[\r\n]")
"""Where a line of a message ends as it is sent on: a CRLF, or a bare CR or LF, which
smtp/transaction.py's dot_stuff makes a CRLF."""


def _lines_fit(data: bytes, line_limit: int) -> bool:
    """Every line of ``data``, its CRLF included, is at most ``line_limit`` octets, lines measured
    as the message is sent on: a bare CR or LF ends a line too (a message of short bare-LF lines
    is no long line, whatever its size). Most messages fit even counted from CRLF to CRLF, which
    is the quicker look."""
    if max(map(len, data.split(b"\r\n"))) + 2 <= line_limit:
        return True
    return max(map(len, _LINE_END.split(data))) + 2 <= line_limit


def _first_line_length(data: bytes) -> int:
    """Octets of ``data``'s first line, its line end (_LINE_END) not included."""
    end = _LINE_END.search(data)
    return len(data) if end is None else end.start()


def _bdat_arg(arg: str | None) -> tuple[int, bool] | None:
    """(chunk size, LAST) of ``BDAT <size> [LAST]`` (RFC 3030), or None when malformed."""
    parts = (arg or "").split()
    if not 1 <= len(parts) <= 2 or not (parts[0].isascii() and parts[0].isdigit()) or len(parts[0]) > 12:
        return None
    if len(parts) == 2 and parts[1].upper() != "LAST":
        return None
    return int(parts[0]), len(parts) == 2


class _Chunks:
    """The BDAT chunks of one transaction, and the reply that refused them, if one did."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.error: str | None = None

    def add(self, data: bytes) -> None:
        self.parts.append(data)
        self.size += len(data)

    def clear(self) -> None:
        self.parts.clear()

    def content(self) -> bytes:
        return b"".join(self.parts)


async def _rest_of_line(reader: asyncio.StreamReader) -> bytes:
    """The rest of the current line, up to its CRLF and with it (bare LFs on the way included:
    only CRLF ends a line for the dots of RFC 5321 4.5.2), over the stream's limit or not."""
    parts: list[bytes] = []
    while True:
        try:
            parts.append(await reader.readuntil(b"\r\n"))
            return b"".join(parts)
        except asyncio.LimitOverrunError as exc:
            parts.append(await reader.readexactly(exc.consumed))


class ConnectionCounter:
    def __init__(self, limit: int, per_source: int):
        self.limit = limit
        self.per_source = per_source
        self.total = 0
        self.by_source: dict[str, int] = {}

    def acquire(self, ip: str) -> str | None:
        """Count a new connection; returns the refusal reply if over a limit."""
        if self.total >= self.limit:
            return replies.S421_TOO_MANY_CONNECTIONS
        if self.by_source.get(ip, 0) >= self.per_source:
            return replies.S421_TOO_MANY_FROM_SOURCE
        self.total += 1
        self.by_source[ip] = self.by_source.get(ip, 0) + 1
        return None

    def release(self, ip: str) -> None:
        self.total -= 1
        n = self.by_source.get(ip, 1) - 1
        if n <= 0:
            self.by_source.pop(ip, None)
        else:
            self.by_source[ip] = n


class CommandRateLimiter:
    """Commands per second per source IP (a token bucket each, burst = 2 x rate). Pure: ``now`` is given."""

    def __init__(self, rate: float, burst: float | None = None, max_sources: int = 10_000):
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(2 * rate, 1))
        self.max_sources = max_sources
        self.buckets: dict[str, tuple[float, float]] = {}  # ip -> (tokens, last update)

    def allow(self, ip: str, now: float) -> bool:
        tokens, last = self.buckets.get(ip, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens < 1:
            self.buckets[ip] = (tokens, now)
            return False
        if ip not in self.buckets and len(self.buckets) >= self.max_sources:
            # Forget sources whose bucket has refilled: they are indistinguishable from new ones.
            full = [k for k, (t, at) in self.buckets.items() if t + (now - at) * self.rate >= self.burst]
            for k in full:
                del self.buckets[k]
        self.buckets[ip] = (tokens - 1, now)
        return True


def fixed_hook_signatures(cls: type) -> type:
    """Class decorator for an aiosmtpd handler: what aiosmtpd looks up in it on every connection,
    computed once.

    aiosmtpd's ``SMTP.__init__`` calls ``inspect.signature(handle_EHLO)`` (~0.1 ms) to tell its
    two hook forms apart, and reads every attribute of the handler (``dir()``,
    ``inspect.getmembers()``) to find its ``handle_*`` hooks and ``auth_*`` mechanisms. Each hook
    gets its ``__signature__``, and the handler's ``dir()`` lists only those names."""
    for name, value in vars(cls).items():
        if name.startswith("handle_") and inspect.isfunction(value):
            value.__signature__ = inspect.signature(value)
    cls.__dir__ = _hook_names
    return cls


_hook_names_of: dict[type, list[str]] = {}


def _hook_names(handler: Any) -> list[str]:
    """A handler's ``dir()``: its hooks and AUTH mechanisms (a subclass's own, too), once per class."""
    names = _hook_names_of.get(type(handler))
    if names is None:
        names = _hook_names_of[type(handler)] = sorted(
            n for n in dir(type(handler)) if n.startswith(("handle_", "auth_")))
    return names


_VERB_PREFIXES = ("smtp_", "auth_")
_verb_names: dict[type, list[str]] = {}


class _VerbsDir:
    """``dir()`` of a session object: the SMTP verbs and AUTH mechanisms of its class, listed once
    per class.

    aiosmtpd's ``__init__`` finds them with ``dir()`` and ``inspect.getmembers()`` on every new
    connection, which reads every attribute of the object (~0.2 ms a connection)."""

    def __dir__(self) -> list[str]:
        names = _verb_names.get(type(self))
        if names is None:
            names = _verb_names[type(self)] = sorted(
                n for n in object.__dir__(self) if n.startswith(_VERB_PREFIXES))
        return names


_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_PLAIN_PATH = re.compile(rf"<(({_ATOM}(?:\.{_ATOM})*)@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*)>")
"""A path in its common form: a dot-atom local part and a domain of letters, digits and hyphens."""


def plain_path(arg: str, local_part_limit: int) -> tuple[Any, Any] | None:
    """(address, rest) of a MAIL/RCPT argument in the common form, ``<dot-atom@host.name>`` then
    nothing, blanks or parameters, read with one regular expression (~2 us instead of the email
    package's ~100 us, twice per message and hop); None for any other form (quoted local parts,
    address literals, source routes, comments, ``<>``), which aiosmtpd's parser reads. The answer
    is aiosmtpd's for that form (tests/test_aiosmtpd_contract.py compares them)."""
    m = _PLAIN_PATH.match(arg)
    if m is None:
        return None
    rest = arg[m.end():].lstrip(" \t")
    if rest.startswith("("):
        return None
    if local_part_limit and len(m.group(2)) > local_part_limit:
        return None, None
    return m.group(1), rest


def _as_sent(arg: str, address: Any, rest: Any) -> tuple[Any, Any]:
    """aiosmtpd's reading of a path, held to what the client sent: the email package quotes a
    local part that needs quotes (``<bad address@x>`` becomes ``"bad address"@x``), which RFC 5321
    4.1.2 does not allow unquoted. A quoted local part counts only when the client quoted it;
    otherwise the address goes on unquoted, for the address check to refuse."""
    if not isinstance(address, str) or not address.startswith('"'):
        return address, rest
    path = arg.lstrip().removeprefix("<")
    if path.startswith("@"):  # a source route (RFC 5321 4.1.2's A-d-l), which is ignored
        path = path.partition(":")[2]
    return (address, rest) if path.startswith('"') else (address.replace('"', ""), rest)


def _parsed_path(arg: str, parse: Callable[[str], tuple[Any, Any]]) -> tuple[Any, Any]:
    """What aiosmtpd's parser (``parse``) reads in a path the fast path did not, held to what the
    client sent; (None, None) for a malformed one: the parser's own failure on it, or a path opened
    with ``<`` and never closed (the parser took ``<a@b`` as ``<a@b>``; Postfix refuses it)."""
    if arg.lstrip().startswith("<") and ">" not in arg:
        return None, None
    try:
        return _as_sent(arg, *parse(arg))
    except Exception:  # noqa: BLE001 - the parser's failure on bad input is that input's error
        return None, None


class _Replies:
    """How a session's replies go on the wire: in our wording, each reply in one write (aiosmtpd
    writes each line). LimitedSMTP sets ``_held`` and ``_plain_250``."""

    _held: list[bytes]
    _plain_250: bool
    _writer: asyncio.StreamWriter
    _replied: Callable[[], None]
    enable_SMTPUTF8: bool
    _param_error = ""  # what was wrong with MAIL's or RCPT's parameters (_DsnParameters)

    async def push(self, status: Any) -> None:
        """One reply line, in our wording. A line of a multiline reply (``250-...``, RFC 5321
        4.2.1) is held until the reply's last line, so a reply goes out in one write: aiosmtpd
        writes and drains each line, and an EHLO reply was ten writes (~16 us of CPU each here, idle).
        aiosmtpd's syntax reply to parameters we refused says what was wrong with them."""
        if isinstance(status, str):
            if self._param_error and status.startswith("501 Syntax: "):
                status, self._param_error = replies.S501_BAD_PARAMETER.format(error=self._param_error), ""
            if not (self._plain_250 and status.startswith("250")):
                status = replies.translate(status)
            status = replies.wire_safe(status).encode("utf-8" if self.enable_SMTPUTF8 else "ascii")
        line = status + b"\r\n"
        if status[3:4] == b"-" and len(self._held) < _HELD_LINES:
            self._held.append(line)
            return
        await self._send(line)

    async def _send(self, data: bytes) -> None:
        """Write ``data`` after any held reply lines, then drain (as aiosmtpd's push does)."""
        if self._held:
            self._held.append(data)
            data = b"".join(self._held)
            self._held.clear()
        self._writer.write(data)
        await self._writer.drain()
        self._replied()  # the client's turn (_ClientWait)


class _AuthParameter:
    """MAIL's ``AUTH=`` parameter (RFC 4954 section 5) wherever AUTH is offered: a server that offers
    AUTH must take it. Its value (xtext, or ``<>``) is checked, then set aside: a message we relay
    carries no AUTH parameter, which RFC 4954 allows (the submitter is unknown to the next hop, as
    with ``AUTH=<>``). Where AUTH is not offered it stays an unknown parameter (555 5.5.4)."""

    session: Session | None
    envelope: Envelope | None
    _auth_methods: dict
    _auth_require_tls: bool
    _tls_protocol: Any

    def _getparams(self, params: Any) -> dict[str, str | bool] | None:
        """aiosmtpd's parameters of MAIL or RCPT, less a valid ``AUTH=`` of MAIL (None: a syntax error)."""
        result = super()._getparams(params)  # type: ignore[misc]
        if result is None or "AUTH" not in result or (self.envelope and self.envelope.mail_from) \
                or not self._auth_offered():
            return result  # RCPT (a transaction is open) keeps aiosmtpd's answer
        value = result.pop("AUTH")
        return result if isinstance(value, str) and dsnparams.XTEXT.fullmatch(value) else None

    def _auth_offered(self) -> bool:
        """AUTH is in this session's EHLO reply (aiosmtpd's rule: after STARTTLS where TLS is
        required for it)."""
        return bool(self.session and self.session.extended_smtp and self._auth_methods
                    and (not self._auth_require_tls or self._tls_protocol))


class _DsnParameters:
    """RFC 3461's parameters (DSN is offered in every EHLO reply): MAIL's RET= and ENVID=, RCPT's
    NOTIFY= and ORCPT=, checked (501 when malformed) and kept in ``dsn_params`` with their case as
    sent (aiosmtpd upper-cases parameters; ENVID and ORCPT are the sender's text) for the
    handler's MAIL or RCPT hook; any other parameter is left to aiosmtpd. A keyword given twice
    (``SIZE=10 SIZE=99999``) is a syntax error (501 5.5.4), not the last one's value."""

    dsn = True
    dsn_params = ""
    _path_params = ""
    _param_error = ""
    session: Session | None
    envelope: Envelope | None

    def _getparams(self, params: Any) -> dict[str, str | bool] | None:
        result = super()._getparams(params)  # type: ignore[misc]
        self.dsn_params = self._param_error = ""
        if result is None or not (self.session and self.session.extended_smtp):
            return result
        keys = [p.partition("=")[0].upper() for p in params]
        if len(set(keys)) < len(keys):  # a keyword given twice: which value holds is anyone's guess
            self._param_error = f"{next(k for k in keys if keys.count(k) > 1)} given twice"
            return None
        keys = dsnparams.RCPT_KEYS if self.envelope and self.envelope.mail_from else dsnparams.MAIL_KEYS
        if not any(k in result for k in keys):
            return result
        text, error = dsnparams.parse(self._path_params, keys)
        if error:
            log.info("%s refused: %s", "RCPT" if keys is dsnparams.RCPT_KEYS else "MAIL", error)
            self._param_error = error  # the reply says it (_Replies.push)
            return None
        for k in keys:
            result.pop(k, None)
        self.dsn_params = text
        return result


class _Unoffered:
    """AUTH and STARTTLS where they cannot be used (no one to authenticate, no certificate): not
    in EHLO or HELP, and a permanent refusal, as Postfix gives, where aiosmtpd would answer 538
    or 454 ("try later")."""

    _auth_methods: dict
    _authenticator: Any
    tls_context: Any
    _handshake_awaited: bool  # _ClientWait's
    _tls_protocol: Any  # aiosmtpd's: set when its STARTTLS begins a handshake
    session: Session | None
    transport: Any
    push: Callable[[str], Awaitable[None]]  # aiosmtpd's, as our _Replies words it

    def _withdraw_unusable_auth(self) -> None:
        """No users (frontend.auth_users) and no cluster credential: aiosmtpd would still offer
        AUTH LOGIN PLAIN after STARTTLS, with a check that always fails. Offer none."""
        if self._authenticator is None:
            self._auth_methods = {}

    @syntax("AUTH <mechanism>", when="_auth_methods")  # HELP lists it where AUTH can succeed
    async def smtp_AUTH(self, arg: str) -> None:
        """aiosmtpd's AUTH where there is someone to authenticate; else refused as Postfix does
        (not offered in EHLO, so a client that tries it is told it never will be)."""
        if not self._auth_methods:
            await self.push(replies.S503_AUTH_NOT_ENABLED)
            return
        envelope = getattr(self, "envelope", None)
        if envelope is not None and envelope.mail_from is not None:
            # RFC 4954 section 4: AUTH during a mail transaction MUST be refused with 503 (the
            # transaction's relay rights were judged with the identity it began with).
            await self.push(replies.S503_AUTH_IN_TRANSACTION)
            return
        await super().smtp_AUTH(arg)  # type: ignore[misc]

    @syntax("STARTTLS", when="tls_context")
    async def smtp_STARTTLS(self, arg: str) -> None:
        """aiosmtpd's STARTTLS where a certificate is configured; without one it is not offered,
        and 502 (not implemented) tells a client so, where aiosmtpd's 454 would say "try later"."""
        if not self.tls_context:
            await self.push(replies.S502_NOT_IMPLEMENTED)
            return
        if getattr(self, "_tls_protocol", None) is not None:
            # RFC 3207 section 4.2: no STARTTLS once TLS is up (aiosmtpd would answer 220 and try
            # a handshake inside the first, which fails and drops the session).
            await self.push(replies.S503_TLS_ACTIVE)
            return
        self._handshake_awaited = True  # after the 220: the client's turn (_ClientWait)
        try:
            await super().smtp_STARTTLS(arg)  # type: ignore[misc]
        except TLSSetupException as exc:
            self._handshake_failed(exc.__cause__)
            return
        finally:
            self._handshake_awaited = False
        if self._tls_protocol is not None and self.session is not None and self.session.ssl is None:
            # The handshake was cut, not failed: our time-out closed the connection during it
            # (_ClientWait._time_out says so), and asyncio ends the wait without an error.
            self._end_without_tls(None)

    def _handshake_failed(self, error: BaseException | None) -> None:
        """The client's TLS handshake after our 220 failed: it hung up, spoke plaintext, offered
        no protocol or cipher we take, or refused our certificate. Routine on the Internet (a
        scanner, an old client, a peer whose CA is another), so one line, as for a session's end,
        and not the internal error (ERROR and a traceback) aiosmtpd's TLSSetupException would
        become; the implicit-TLS listener's failed handshakes are no errors either (asyncio
        closes them without a word)."""
        if isinstance(error, ConnectionResetError) and not str(error):
            reason = "the client closed the connection"
        else:
            reason = str(error) or type(error).__name__
        log.info("STARTTLS from %s failed: %s", self.session.peer if self.session else None, reason)
        self._end_without_tls(error if isinstance(error, Exception) else None)

    def _end_without_tls(self, error: Exception | None) -> None:
        """End a session whose TLS handshake did not complete, as aiosmtpd ends it: the TLS layer
        never had a connection to lose, so the session's end (its connection slot given back) is
        ours to call."""
        if self.transport is not None:
            self.transport.close()
            self.connection_lost(error)  # type: ignore[attr-defined]


def user_name(login: bytes) -> str:
    """A SASL identity (an authentication or authorization identity) as the frontend's users are
    named: its UTF-8 text, compared exactly. An authenticator that names users otherwise says so
    in its ``user_name`` attribute (redundancy/server.py: peers' names in any case)."""
    return login.decode("utf-8", "replace")


class _SaslExchange:
    """AUTH's exchanges as aiosmtpd runs them, held to two rules it misses: a response line after
    334 longer than the stream's limit is RFC 4954 section 4's ``500 5.5.6`` (the exchange failed,
    the line read to its end and dropped, the session going on; aiosmtpd's read raised, a 451 and a
    traceback, and the line's rest came in as commands), and PLAIN's authorization identity
    (RFC 4616 section 2), which aiosmtpd drops: no user here may act as another, so it must be
    empty or name the authenticating user."""

    session: Session | None
    _reader: asyncio.StreamReader
    _authenticator: Any
    line_length_limit: int  # the stream's limit on a line (LimitedSMTP)
    push: Callable[[Any], Awaitable[None]]
    _authenticate: Callable[[str, Any], AuthResult]  # aiosmtpd's: calls the authenticator

    async def challenge_auth(self, challenge: str | bytes, encode_to_b64: bool = True,
                             log_client_response: bool = False) -> Any:
        """aiosmtpd's: ``334 <challenge>``, then the client's response decoded (MISSING when the
        exchange failed, its reply sent), with the over-long line answered. The response is
        never logged (it holds credentials)."""
        challenge = challenge.encode() if isinstance(challenge, str) else challenge
        await self.push(b"334 " + (base64.b64encode(challenge) if encode_to_b64 else challenge))
        line = await self._response_line()
        if line is None:
            log.info("%r AUTH response line over %d octets: exchange failed", self.session and self.session.peer,
                     self.line_length_limit)
            await self.push(replies.S500_AUTH_LINE_TOO_LONG)
            return MISSING
        blob = line.strip()
        if blob == b"*":
            log.info("%r aborted AUTH with '*'", self.session and self.session.peer)
            await self.push("501 5.7.0 Auth aborted")
            return MISSING
        try:
            return base64.b64decode(blob, validate=True)
        except binascii.Error:
            await self.push("501 5.5.2 Can't decode base64")
            return MISSING

    async def _response_line(self) -> bytes | None:
        """The client's next line; None when it is longer than the stream's limit, then read to
        its end and dropped (as aiosmtpd drops an over-long command line)."""
        try:
            return await self._reader.readuntil(b"\n")
        except asyncio.LimitOverrunError as exc:
            await self._reader.read(exc.consumed)
        while True:
            try:
                await self._reader.readuntil(b"\n")
                return None
            except asyncio.LimitOverrunError as exc:
                await self._reader.read(exc.consumed)

    async def auth_PLAIN(self, _: Any, args: list[str]) -> AuthResult:
        """RFC 4616: ``authzid NUL authcid NUL password``, as an initial response or after a 334,
        decoded as aiosmtpd decodes it; an authorization identity other than the authenticating
        user's own name (compared as the authenticator names users) fails as bad credentials."""
        if len(args) == 1:
            message = await self.challenge_auth("")
            if message is MISSING:
                return AuthResult(success=False)  # its reply was sent
        else:
            try:
                message = base64.b64decode(args[1].encode(), validate=True)
            except (binascii.Error, UnicodeEncodeError):
                await self.push("501 5.5.2 Can't decode base64")
                return AuthResult(success=False, handled=True)
        parts = message.split(b"\0")
        if len(parts) != 3:
            await self.push("501 5.5.2 Can't split auth value")
            return AuthResult(success=False, handled=True)
        authzid, login, password = parts
        name = getattr(self._authenticator, "user_name", user_name)
        if authzid and name(authzid) != name(login):
            log.warning("authentication failed from %s (PLAIN): %r may not act as %r",
                        self.session and self.session.peer, name(login), name(authzid))
            return AuthResult(success=False, handled=False)  # 535 5.7.8, as for a wrong password
        return self._authenticate("PLAIN", LoginPassword(login, password))


_OPEN_SESSIONS: weakref.WeakSet = weakref.WeakSet()  # every connected session of this process


class _ShutdownNotice:
    """RFC 5321 3.8: a server shut down by outside means SHOULD send 421 before it closes. The
    sessions of this process are kept (weakly) so that a stop can say so (``say_shutting_down``)."""

    _reader: asyncio.StreamReader | None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _OPEN_SESSIONS.add(self)
        super().connection_made(transport)  # type: ignore[misc]

    def connection_lost(self, error: Exception | None) -> None:
        _OPEN_SESSIONS.discard(self)
        super().connection_lost(error)  # type: ignore[misc]

    def waiting_for_client(self) -> bool:
        """The session waits for bytes from its client (a command, or the rest of a message): no
        command of it is being carried out, so nothing it sent can be acknowledged any more.
        (asyncio's StreamReader holds a waiter exactly while a read is pending.)"""
        return getattr(self._reader, "_waiter", None) is not None


class _InactivityDeadline:
    """ConnectionInactivityTimeout as a deadline pushed back, not a timer re-armed: aiosmtpd
    cancels and re-creates its timer at every command, and LimitedSMTP counts every chunk a client
    sends as activity too (a dozen timers per message). Here activity only moves the deadline; the
    one timer, when it fires early, sets itself for the deadline; a shorter duration (aiosmtpd's
    PROXY time-out) re-arms it at once. Past the deadline ``_timeout_cb`` runs, unless a command is
    being carried out: then the client is not idle, and the reply moves the deadline (_ClientWait)."""

    loop: asyncio.AbstractEventLoop
    _timeout_duration: float
    _timeout_handle: asyncio.TimerHandle | None
    _inactive_at = 0.0

    def _reset_timeout(self, duration: float | None = None) -> None:
        delay = duration or self._timeout_duration
        self._inactive_at = deadline = self.loop.time() + delay
        handle = self._timeout_handle
        if handle is not None and not handle.cancelled() and handle.when() <= deadline:
            return  # it fires no later than the deadline, and looks again then
        if handle is not None:
            handle.cancel()
        self._timeout_handle = self.loop.call_later(delay, self._inactivity_check)

    def _inactivity_check(self) -> None:
        left = self._inactive_at - self.loop.time()
        if left <= 0 and self._serving_command():  # type: ignore[attr-defined]
            left = self._timeout_duration  # the client is not idle; the reply moves the deadline
        if left > 0:
            self._timeout_handle = self.loop.call_later(left, self._inactivity_check)
        else:
            self._timeout_cb()  # type: ignore[attr-defined]


class _ClientWait:
    """RFC 5321 4.5.3.2: a server's time-outs measure how long it waits for its client. While a
    command is carried out (a message made durable, its 250 held for a delayed acknowledgement or
    a shadow copy) the client waits for us: a 421 then would end a session whose message the node
    already holds, and the client would send it again (a duplicate). So neither time-out ends a
    session before the command's reply is out: the idle time counts from the reply, and the
    absolute limit (ConnectionTimeout), when it passed meanwhile, applies right after it."""

    loop: asyncio.AbstractEventLoop
    transport: Any
    session: Session | None
    hostname: str
    _connection_timeout: float
    _paused: bool  # asyncio's flow control: the client does not read what we write
    _absolute_handle: asyncio.TimerHandle | None = None
    _absolute_due = False  # the absolute limit passed while a command was carried out
    _handshake_awaited = False  # STARTTLS: the client's TLS handshake is awaited (set by _Unoffered)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.transport is None:  # not again after STARTTLS
            self._absolute_handle = self.loop.call_later(self._connection_timeout, self._absolute_timeout)
        super().connection_made(transport)  # type: ignore[misc]

    def connection_lost(self, error: Exception | None) -> None:
        if self._absolute_handle is not None:
            self._absolute_handle.cancel()
            self._absolute_handle = None
        super().connection_lost(error)  # type: ignore[misc]

    def _serving_command(self) -> bool:
        """A command is being carried out: the client waits for its reply. (A reply the client
        does not read, writes paused, and a TLS handshake after STARTTLS are the client's wait.)"""
        return (self.transport is not None and not self.waiting_for_client()  # type: ignore[attr-defined]
                and not self._paused and not self._handshake_awaited)

    def _replied(self) -> None:
        if self.transport is None:
            return
        self._reset_timeout()  # type: ignore[attr-defined]
        if self._absolute_due:
            self._time_out("connection timeout (absolute, after the reply to the command it came in)")

    def _timeout_cb(self) -> None:
        self._time_out("inactivity timeout")

    def _absolute_timeout(self) -> None:
        self._absolute_handle = None
        if self.transport is None:
            return
        if self._serving_command():
            self._absolute_due = True  # applied once the reply is out (_replied)
            return
        self._time_out("connection timeout (absolute)")

    def _time_out(self, what: str) -> None:
        """421 4.4.2 and close (aiosmtpd's time-out closes without a word). While the TLS
        handshake after STARTTLS is awaited, only a close: RFC 3207 section 4 allows nothing but
        the negotiation after the 220, and a plaintext 421 would land inside it."""
        self._absolute_due = False
        if self.transport is None:
            return
        peer = self.session.peer if self.session else None
        if self._handshake_awaited:
            log.info("%r %s during the TLS handshake: closed", peer, what)
        else:
            log.info("%r %s", peer, what)
            self._say_and_close(replies.S421_TIMEOUT.format(host=self.hostname))  # type: ignore[attr-defined]
        self.transport.close()


class EndOfInput(ConnectionResetError):
    """The client ended its sending side, and every whole command it sent before was served."""


class HalfClose:
    """A client may end its sending side once its last commands are out: Exim pipelines ``BDAT n
    LAST`` (or the final dot) with QUIT and then shuts its socket down for writing, waiting for
    the replies. aiosmtpd cancels the session at the end of input, so such a client never got its
    250 and tried again later, while the node had already made the message durable: a copy more
    at every try. Here the commands read before the end are carried out
    and answered as usual (TCP half-close); the session ends when the reader reaches the end
    (``EndOfInput``). Over TLS asyncio's transport has no half-close: aiosmtpd's way stays."""

    session: Session | None
    _reader: asyncio.StreamReader | None

    def _cb_client_connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super()._cb_client_connected(reader, writer)  # type: ignore[misc]
        read_until = reader.readuntil

        async def readuntil(separator: bytes = b"\n") -> bytes:
            try:
                return await read_until(separator)
            except asyncio.IncompleteReadError as exc:
                if reader.at_eof():
                    raise EndOfInput("end of input") from exc
                raise
        reader.readuntil = readuntil  # type: ignore[method-assign]

    async def _handle_client(self) -> None:
        try:
            await super()._handle_client()  # type: ignore[misc]
        except EndOfInput:
            pass  # every command before the client's end was answered; aiosmtpd closed the writer

    def eof_received(self) -> bool | None:
        session = self.session
        if session is None or session.ssl is not None or self._reader is None:
            return super().eof_received()  # type: ignore[misc]
        if self._reader._buffer:  # commands sent before the end wait (Exim's way); else a plain close
            log.info("%r end of input: serving the commands read before it", session.peer)
        # The stream sees its end (the session's next read ends it); the transport stays open for
        # the replies (StreamReaderProtocol's own answer to a half-close).
        return asyncio.StreamReaderProtocol.eof_received(self)  # type: ignore[arg-type]


def say_shutting_down() -> int:
    """421 4.3.2 to every session of this process that waits for its client, and close it; a
    session carrying out a command (a message being made durable) finishes it first, or is cut
    by the stop without a reply (its client retries). Returns how many were told."""
    told = 0
    for s in list(_OPEN_SESSIONS):
        transport = s.transport
        if transport is not None and not transport.is_closing() and s.waiting_for_client():
            s._say_and_close(replies.S421_SHUTTING_DOWN)
            transport.close()
            told += 1
    return told


class _ImplicitTLS:
    """A session on a listener of ``frontend.implicit_tls_listen`` (RFC 8314): the handshake is
    done before the session starts. aiosmtpd knows TLS only from its own STARTTLS: the session is
    marked as it would be after one, so AUTH is offered where it needs TLS, require_tls is met and
    the Received field says ESMTPS; STARTTLS itself is not offered (no context to start)."""

    transport: Any
    session: Session | None
    _tls_protocol: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        first = self.transport is None
        super().connection_made(transport)  # type: ignore[misc]
        if first and self.session is not None and transport.get_extra_info("ssl_object") is not None:
            self._tls_protocol = IMPLICIT_TLS
            self.session.ssl = {name: transport.get_extra_info(name)
                                for name in ("ssl_object", "peercert", "cipher", "sslcontext")}


IMPLICIT_TLS = object()
"""Where aiosmtpd keeps the TLS protocol its STARTTLS made: a session that began in TLS."""


def _verbs_answered_502(verbs: tuple[str, ...]) -> Callable[[Any], Any]:
    """A class decorator: ``smtp_<VERB>`` for each of ``verbs`` is ``_verb_not_served_here`` (502),
    so aiosmtpd finds each verb (no 500 "unrecognized", no count toward its cut-off for unknown
    commands) and HELP lists none (no syntax); a subclass that serves one defines its own."""
    def decorate(cls: Any) -> Any:
        for verb in verbs:
            setattr(cls, f"smtp_{verb}", cls._verb_not_served_here)
        return cls
    return decorate


@_verbs_answered_502(replies.SHADOW_REDUNDANCY_VERBS)  # TransportSMTP serves them (redundancy/server.py)
class LimitedSMTP(_VerbsDir, _Replies, _Unoffered, _SaslExchange, _ShutdownNotice, HalfClose, _ImplicitTLS,
                  _DsnParameters, _AuthParameter, _ClientWait, _InactivityDeadline, SMTP):
    """aiosmtpd's SMTP with connection limits, an absolute timeout and our reply wording."""

    def __init__(self, handler: Any, *, counter: ConnectionCounter, connection_timeout: float,
                 max_line_length: int, rate_limiter: CommandRateLimiter | None = None, chunking: bool = True,
                 **kwargs: Any):
        # The StreamReader's limit is set from line_length_limit inside SMTP.__init__.
        self.line_length_limit = max_line_length + 2
        super().__init__(handler, **kwargs)
        if rate_limiter is not None:
            self._rate_limiter = rate_limiter
            self._smtp_methods = {cmd: self._rate_limited(m) for cmd, m in self._smtp_methods.items()}
        self.command_size_limit = max(512, min(max_line_length, 4096))
        self.command_size_limits = _CommandLimits(self.command_size_limit)
        self._counter = counter
        self._connection_timeout = connection_timeout
        self._refusal: str | None = None
        self._counted_ip: str | None = None
        self._plain_250 = False  # HELO/EHLO replies carry no enhanced status code (RFC 2034)
        self._held: list[bytes] = []  # lines of a multiline reply not written yet (push)
        self.chunking = chunking  # CHUNKING offered (EHLO) and BDAT served
        self._withdraw_unusable_auth()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        first = self.transport is None
        if first:
            peer = transport.get_extra_info("peername") or ("", 0)
            ip = str(peer[0])
            self._refusal = self._counter.acquire(ip)
            if self._refusal is None:
                self._counted_ip = ip
        super().connection_made(transport)

    def connection_lost(self, error: Exception | None) -> None:
        self._release_slot()
        super().connection_lost(error)

    def _release_slot(self) -> None:
        if self._counted_ip is not None:
            self._counter.release(self._counted_ip)
            self._counted_ip = None

    @syntax("QUIT")
    async def smtp_QUIT(self, arg: str) -> None:
        if not arg:  # the session ends with this 221: a client that connects again at once (to another
            self._release_slot()  # receive worker) must not find its old session still counted
        await super().smtp_QUIT(arg)

    async def _handle_client(self) -> None:
        if self._refusal is not None:
            log.warning("refused connection from %s: %s", self.session.peer, self._refusal)
            await self.push(self._refusal)
            self.transport.close()
            return
        await super()._handle_client()

    def _rate_limited(self, method: Callable[[str | None], Awaitable[None]]) -> Callable[[str | None], Awaitable[None]]:
        async def limited(arg: str | None) -> None:
            ip = str(self.session.peer[0]) if self.session and self.session.peer else ""
            if not self.trusted_client() and not self._rate_limiter.allow(ip, self.loop.time()):
                log.warning("%s over frontend.max_command_rate: session closed", ip)
                await self.push(replies.S421_COMMAND_RATE)
                self.transport.close()
                return
            await method(arg)
        return functools.update_wrapper(limited, method)  # HELP reads the verb's syntax from it

    def trusted_client(self) -> bool:
        """The client is exempt from the per-source limits (TransportSMTP: an authenticated peer)."""
        return False

    def _say_and_close(self, reply: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            try:
                self._writer.write(b"".join(self._held) + reply.encode("ascii") + b"\r\n")
                self._held.clear()
            except Exception:  # noqa: BLE001 - the connection is going away anyway
                pass

    def data_received(self, data: bytes) -> None:
        # Any bytes from the client are activity, DATA lines included (aiosmtpd counts commands only).
        if self.transport is not None and self._timeout_handle is not None:
            self._reset_timeout()
        super().data_received(data)

    def _getaddr(self, arg: str) -> tuple[Any, Any]:
        """aiosmtpd's address parser, made total: the email package raises IndexError on some
        malformed input (a lone '"', 'a@'), AttributeError on others (an unclosed address literal,
        'a@[1'); any of these is a malformed address, not an internal error. The common form is
        read by ``plain_path`` first."""
        plain = plain_path(arg, self.local_part_limit)
        if plain is None:
            plain = _parsed_path(arg, super()._getaddr)
        self._path_params = plain[1] or ""  # the parameters as sent, for RFC 3461's (_DsnParameters)
        return plain

    @syntax("HELO hostname")  # listed by HELP as aiosmtpd's own (an override drops its text)
    async def smtp_HELO(self, hostname: str) -> None:
        self._plain_250 = True
        try:
            await super().smtp_HELO(hostname)
        finally:
            self._plain_250 = False

    @syntax("EHLO hostname")
    async def smtp_EHLO(self, hostname: str) -> None:
        self._plain_250 = True
        try:
            await super().smtp_EHLO(hostname)
        finally:
            self._plain_250 = False

    async def _smtp_data(self, arg: str) -> None:
        """aiosmtpd's DATA, with the message read in chunks (read_data) instead of line by line."""
        if self._decode_data:
            await super().smtp_DATA(arg)
            return
        if await self.check_helo_needed() or await self.check_auth_needed("DATA"):
            return
        assert self.envelope is not None
        if not self.envelope.rcpt_tos:
            await self.push("503 Error: need RCPT command")
            return
        if arg:
            await self.push("501 Syntax: DATA")
            return
        await self.push("354 End data with <CR><LF>.<CR><LF>")
        try:
            content, error = await read_data(self._reader, self.data_size_limit, self.line_length_limit)
        except asyncio.CancelledError:
            log.info("connection lost during DATA")
            self._writer.close()
            raise
        except asyncio.IncompleteReadError:
            self._writer.close()
            return
        if error is not None:
            await self.push("500 Line too long (see RFC5321 4.5.3.1.6)" if error == DATA_TOO_LONG
                            else "552 Error: Too much mail data")
            self._set_post_data_state()
            return
        self.envelope.content = self.envelope.original_content = content
        status = await self._call_handler_hook("DATA")
        self._set_post_data_state()
        await self.push("250 OK" if status is MISSING else status)

    @syntax("BDAT chunk-size [LAST]", when="chunking")
    async def smtp_BDAT(self, arg: str | None) -> None:
        """CHUNKING (RFC 3030): ``BDAT <size> [LAST]``, the chunk's octets right after the line.

        The chunk is always read, also when it is refused (a transaction not started, a size
        over the limit, DATA's checks), so the octets that follow are the client's next command
        and never the chunk's content. Chunks are kept on the envelope, so RSET and a new MAIL
        drop them; after LAST the message goes to the handler as after DATA."""
        if not self.chunking:
            await self.push(replies.S502_NOT_IMPLEMENTED)  # not offered: the octets after it are commands
            return
        parsed = _bdat_arg(arg)
        if parsed is None:
            await self.push(replies.S501_BDAT_SYNTAX)
            return
        size, last = parsed
        envelope = self.envelope
        assert envelope is not None
        refusal = self._bdat_refusal(envelope)  # no transaction to add to: nothing is kept
        chunks: _Chunks | None = getattr(envelope, "bdat", None)
        over = bool(self.data_size_limit and (chunks.size if chunks else 0) + size > self.data_size_limit)
        keep = refusal is None and not over and (chunks is None or chunks.error is None)
        try:
            data = await self._read_chunk(size, keep)
        except asyncio.CancelledError:
            log.info("connection lost during BDAT")
            self._writer.close()
            raise
        except asyncio.IncompleteReadError:
            self._writer.close()
            return
        if refusal is not None:
            await self.push(refusal)
            return
        if chunks is None:
            chunks = envelope.bdat = _Chunks()  # type: ignore[attr-defined]
        if over and chunks.error is None:
            chunks.error = replies.S552_MESSAGE_TOO_BIG  # the transaction failed; later chunks are read
            chunks.clear()
        if chunks.error is None:
            chunks.add(data)
        if not last:
            await self.push(chunks.error or f"250 2.0.0 {size} octets received")
            return
        error = chunks.error
        if error is None and chunks.size and not _lines_fit(chunks.content(), self.line_length_limit):
            error = "500 Line too long (see RFC5321 4.5.3.1.6)"
        if error is not None:
            self._set_post_data_state()
            await self.push(error)
            return
        envelope.content = envelope.original_content = chunks.content()
        chunks.clear()
        status = await self._call_handler_hook("DATA")
        self._set_post_data_state()
        await self.push("250 OK" if status is MISSING else status)

    def _bdat_refusal(self, envelope: Envelope) -> str | None:
        """Why a chunk cannot belong to a transaction now (None: it can)."""
        if self.session is None or not self.session.host_name:
            return replies.S503_HELO_FIRST
        if self._auth_required and not self.session.authenticated:
            return replies.S530_AUTH_REQUIRED
        if envelope.mail_from is None or not envelope.rcpt_tos:
            return replies.S503_NEED_MAIL_RCPT
        return None

    async def _read_chunk(self, size: int, keep: bool) -> bytes:
        """``size`` octets from the client; when not kept, read and dropped piece by piece."""
        if keep:
            return await self._reader.readexactly(size)
        left = size
        while left:
            left -= len(await self._reader.readexactly(min(left, 65536)))
        return b""

    @syntax("DATA")
    async def smtp_DATA(self, arg: str) -> None:
        if getattr(self.envelope, "bdat", None) is not None:
            await self.push(replies.S503_DATA_AFTER_BDAT)  # RFC 3030 2: no DATA once BDAT began
            return
        await self._smtp_data(arg)

    async def _verb_not_served_here(self, arg: str | None) -> None:
        """A shadow redundancy verb on a listener that does not serve them (the frontend): they exist
        only on the transport connector (docs/PROTOCOL.md section 1), so 502, not "unrecognized"."""
        await self.push(replies.S502_NOT_IMPLEMENTED)


class _CommandLimits(dict):
    """aiosmtpd's per-command size limits, per instance (the class-level dict is shared)."""

    def __init__(self, default: int):
        super().__init__()
        self.default = default

    def __missing__(self, key: str) -> int:
        # MAIL/RCPT carry ESMTP parameters (and XSHADOW= later): allow more than the base limit.
        return self.default + (512 if key in ("MAIL", "RCPT") else 0)


def make_authenticator(users: dict[str, str]) -> Callable[..., AuthResult]:
    def authenticator(server: SMTP, session: Session, envelope: Envelope, mechanism: str,
                      auth_data: Any) -> AuthResult:
        if isinstance(auth_data, LoginPassword):
            user = user_name(auth_data.login)
            password = auth_data.password.decode("utf-8", "replace")
            if user in users and _consteq(users[user], password):
                return AuthResult(success=True, auth_data=user)
        log.warning("authentication failed from %s (%s)", session.peer, mechanism)
        return AuthResult(success=False, handled=False)
    authenticator.user_name = user_name  # type: ignore[attr-defined]  # how PLAIN compares its authzid
    return authenticator


def _consteq(a: str, b: str) -> bool:
    import hmac
    return hmac.compare_digest(a.encode(), b.encode())


def smtp_factory(cfg: Any, handler: Any, counter: ConnectionCounter,
                 tls_context: Any = None, *, smtp_class: type = None, authenticator: Any = None,
                 auth_require_tls: bool = True, require_tls: bool | None = None,
                 chunking: bool | None = None) -> Callable[[], LimitedSMTP]:
    fe = cfg.frontend
    auth_kwargs: dict[str, Any] = {}
    if authenticator is None and fe.auth_users and smtp_class is None:
        authenticator = make_authenticator(fe.auth_users)
    if authenticator is not None:
        auth_kwargs = dict(authenticator=authenticator, auth_require_tls=auth_require_tls,
                           auth_exclude_mechanism=["CRAM-MD5"])
    else:
        auth_kwargs = dict(auth_require_tls=True)
    cls = smtp_class or LimitedSMTP
    starttls_required = fe.require_tls if require_tls is None else require_tls
    # The command-rate limit guards both connectors; an authenticated peer is not limited (trusted_client).
    rate_kwargs: dict[str, Any] = {}
    if fe.max_command_rate:
        rate_kwargs["rate_limiter"] = CommandRateLimiter(fe.max_command_rate)

    def factory() -> LimitedSMTP:
        return cls(
            handler, counter=counter, connection_timeout=fe.connection_timeout,
            max_line_length=fe.max_line_length,
            chunking=fe.chunking_enabled if chunking is None else chunking,
            hostname=cfg.node.name, ident="ESMTP transportd", data_size_limit=fe.max_message_size,
            enable_SMTPUTF8=True, decode_data=False, timeout=fe.connection_inactivity_timeout,
            tls_context=tls_context.context() if isinstance(tls_context, ServerTLS) else tls_context,
            require_starttls=starttls_required,
            command_call_limit={"*": 1_000_000, "EHLO": 20, "HELO": 20, "NOOP": 100, "VRFY": 20,
                                "EXPN": 20, "HELP": 20, "STARTTLS": 3, "AUTH": 10, "RSET": 10_000},
            **auth_kwargs, **rate_kwargs,
        )
    return factory



async def serve_binding(listen: str, factory: Callable[[], Any], *, reuse_port: bool | None = None,
                        **tls: Any) -> asyncio.Server:
    """A listening server for one ``host:port`` binding (``[::1]:25`` for IPv6)."""
    host, _, port = listen.rpartition(":")
    return await asyncio.get_running_loop().create_server(factory, host=host.strip("[]"), port=int(port),
                                                          reuse_address=True, reuse_port=reuse_port, **tls)


def check_unused(listen: str) -> None:
    """Raise OSError (EADDRINUSE) when a socket already listens on ``listen``. A listener bound with
    SO_REUSEPORT (a node with receive workers) would join another process's listener on the same
    address and take a share of its connections; a plain bind, as here, is refused instead."""
    host, _, port = listen.rpartition(":")
    for family, kind, proto, _, address in socket.getaddrinfo(host.strip("[]") or None, int(port),
                                                              type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listener will be
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)


def implicit_tls_bindings(cfg: Any, handler: Any, counter: ConnectionCounter,
                          tls: ServerTLS | None) -> list[tuple[str, Callable[[], LimitedSMTP], dict[str, Any]]]:
    """The frontend's bindings of ``frontend.implicit_tls_listen`` (RFC 8314), each with its
    session factory (no STARTTLS to offer) and the server options that do the TLS handshake
    before the session starts; empty without them."""
    fe = cfg.frontend
    if not fe.implicit_tls_listen or tls is None:
        return []
    factory = smtp_factory(cfg, handler, counter, None, require_tls=False)
    options = {"ssl": tls.implicit_context(), "ssl_handshake_timeout": fe.connection_inactivity_timeout}
    return [(listen, factory, options) for listen in fe.implicit_tls_listen]
