"""Outbound SMTP sessions to next hops outside the boundary: connecting, transactions.

It owns opening a session to the first of a next hop's targets that answers (smtp/mx.py finds
them; EHLO, HELO where EHLO is unknown, STARTTLS where offered), and running a transaction on it
with our pipelining client (smtp/wire.py under smtp/transaction.py): MAIL, RCPT and DATA in one
write where the next hop offers PIPELINING, one command at a time where it does not; the envelope
goes out byte for byte (the address exactly as received, UTF-8, in angle brackets). It never reads
the queue or decides an outcome (node/connectors.py does); deciding *whether* SMTPUTF8 may be used
is ``envelope.plan_send``'s job.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from typing import Any

from transportd.errors import (
    PEER_FAILURES,
    GreetingRefused,
    NextHopUnavailable,
    TlsHandshakeFailed,
    TlsRequired,
)
from transportd.smtp.dsnparams import DsnRequest
from transportd.smtp.mx import SmtpTarget
from transportd.smtp.transaction import Replies, Transaction
from transportd.smtp.wire import QUIT_WAIT, SmtpWire

log = logging.getLogger("transportd")


async def connect(targets: list[SmtpTarget], *, local_hostname: str, timeout: float, connect_timeout: float,
                  tls: dict[str, Any]) -> tuple[NextHopSession, SmtpTarget]:
    """A session (EHLO done) to the first target that answers; NextHopUnavailable when none does,
    naming each target once with what happened there (``tls_status`` where every one was reached
    and TLS, required, could not be had)."""
    failed: list[tuple[str, str, str | None]] = []  # (host:port, what happened, TlsRequired's status)
    busy = bool(targets)  # every host up and turning this session away (a 4xx greeting)
    for t in targets:
        options = tls
        for _attempt in range(2):
            wire = SmtpWire(t.host, t.port, address=t.address, local_hostname=local_hostname, timeout=timeout,
                            helo_fallback=True, **options)
            try:
                await wire.connect(connect_timeout)
                await wire.ehlo()
                return NextHopSession(wire), t
            except TlsHandshakeFailed as exc:  # raised only where TLS was opportunistic (SmtpWire.ehlo)
                wire.close()
                # Opportunistic TLS that failed after the server's 220 (a TLS version or cipher
                # in common with none, a broken certificate chain on its side): at once again on
                # a new connection without STARTTLS, rather than a deferral that would meet the
                # same failure at every retry until the message expired.
                log.warning("%s; sending on a new session without TLS", exc)
                options = {**tls, "start_tls": False}
            except PEER_FAILURES as exc:
                required = exc.status if isinstance(exc, TlsRequired) else None
                failed.append((wire.where, describe(exc) if required else failure(exc), required))
                busy = busy and isinstance(exc, GreetingRefused)
                wire.close()
                break
    # A TlsRequired's text names its host itself ("127.0.0.1:25 does not offer STARTTLS").
    text = "; ".join(what if status else f"{where}: {what}" for where, what, status in failed)
    tls_failed = bool(failed) and all(status for _, _, status in failed)
    only = failed[0][0] if len(failed) == 1 and not tls_failed else None
    raise NextHopUnavailable(text or "no hosts for next hop", busy=busy,
                             tls_status=failed[0][2] if tls_failed else None,
                             only=only, reason=failed[0][1] if only else None)


class NextHopSession:
    """One session to a next hop: transactions on it, then QUIT (or a while in a ``SessionCache``)."""

    def __init__(self, wire: SmtpWire):
        self.wire = wire
        self.target = SmtpTarget(wire.hostname, wire.port)
        self.transactions = 0  # started on this session
        self.reused = False  # taken from a SessionCache: the next hop may have closed it meanwhile
        self.mail_deferred = False  # the last transaction's MAIL got a 4xx (nothing of it was taken)
        self._transaction: Transaction | None = None  # the last one started

    @property
    def nothing_taken(self) -> bool:
        """The last transaction's MAIL was never accepted (the session found closed at it, a 421 or
        a refusal), so none of its data went out: the next hop holds nothing of that message,
        however the transaction ended, and sending it again cannot duplicate it."""
        return self._transaction is None or not self._transaction.mail_accepted

    @property
    def awaiting(self) -> str | None:
        """The command of the last transaction whose reply was awaited when it stopped (a session
        that broke), or None."""
        return self._transaction.awaiting if self._transaction is not None else None

    @property
    def idle(self) -> bool:
        """Connected with nothing unread: no 421 or close from the next hop since the last reply."""
        return self.wire.idle

    def supports_extension(self, name: str) -> bool:
        return self.wire.supports_extension(name)

    @property
    def is_connected(self) -> bool:
        return self.wire.is_connected

    async def transact(self, sender: str, params: list[str], recipients: list[str], data: bytes,
                       dsn: DsnRequest | None = None) -> Replies:
        """One transaction; the replies of a pipelined group are read as they come. DATA, not BDAT:
        BDAT to next hops outside was not measured (smtp-sink offers no CHUNKING). ``dsn`` goes on
        where the next hop offers DSN (RFC 3461 5.2)."""
        tx = Transaction(sender, params, recipients, data, chunking=False,
                         pipelining=self.wire.supports_extension("pipelining"),
                         dsn=dsn if self.wire.supports_extension("dsn") else None)
        self.transactions += 1
        self._transaction = tx
        self.wire.write(tx.start())
        while tx.replies is None:
            reply = await self.wire.read_reply()
            if reply.code == 421:
                # The next hop ends the session (RFC 5321 3.8) and closes it: every command of a
                # pipelined group still awaiting its reply has this one (its words, not "closed
                # the connection"), and the session is over.
                tx.closed(reply.code, reply.message)
                self.wire.close()
                break
            more = tx.answer(reply.code, reply.message)
            if more:
                self.wire.write(more)
        self.mail_deferred = 400 <= tx.replies.mail[0] < 500
        return tx.replies

    async def rset(self) -> Any:
        return await self.wire.rset()

    async def quit(self) -> None:
        try:
            await asyncio.wait_for(self.wire.quit(), QUIT_WAIT)
        except Exception:  # noqa: BLE001 - the session is over either way
            self.wire.close()

    def close(self) -> None:
        self.wire.close()


class SessionCache:
    """Idle sessions to next hops kept a short while for the next batch to the same next hop, as
    Postfix's connection cache does: with pipelined transactions, a small batch's connect,
    greeting, EHLO and QUIT cost more than the batch itself.

    A session is kept only when ``idle`` (connected, nothing unread) and given out only when it
    still is and the batch fits in ``max_transactions`` for the session in all
    (MaxMessagesPerConnection); one unused for ``idle_time`` seconds gets its QUIT, as does every
    session still kept at ``close``. At most ``per_key`` are kept per next hop."""

    def __init__(self, idle_time: float, max_transactions: int, per_key: int):
        self.idle_time = idle_time
        self.max_transactions = max_transactions
        self.per_key = per_key
        self._idle: dict[Any, list[tuple[NextHopSession, asyncio.TimerHandle]]] = {}
        self._quitting: set[asyncio.Future] = set()

    def take(self, key: Any, transactions: int) -> NextHopSession | None:
        """A kept session for ``key`` that can carry ``transactions`` more, or None."""
        kept = self._idle.get(key)
        while kept:
            session, handle = kept.pop()
            handle.cancel()
            if session.idle and session.transactions + transactions <= self.max_transactions:
                if not kept:
                    del self._idle[key]
                session.reused = True
                return session
            self._quit(session)
        self._idle.pop(key, None)
        return None

    def kept(self, key: Any) -> int:
        """Sessions kept for ``key`` now (connections the next hop still counts)."""
        return len(self._idle.get(key, ()))

    def keep(self, key: Any, session: NextHopSession) -> bool:
        """Keep ``session`` for the next batch to ``key``; False: not kept (the caller QUITs it)."""
        if self.idle_time <= 0 or not session.idle or session.transactions >= self.max_transactions:
            return False
        kept = self._idle.setdefault(key, [])
        if len(kept) >= self.per_key:
            return False
        handle = asyncio.get_running_loop().call_later(self.idle_time, self._expire, key, session)
        kept.append((session, handle))
        return True

    def _expire(self, key: Any, session: NextHopSession) -> None:
        kept = self._idle.get(key, [])
        self._idle[key] = [(s, h) for s, h in kept if s is not session]
        if not self._idle[key]:
            del self._idle[key]
        self._quit(session)

    def _quit(self, session: NextHopSession) -> None:
        task = asyncio.ensure_future(session.quit())
        self._quitting.add(task)
        task.add_done_callback(self._quitting.discard)

    async def close(self) -> None:
        """QUIT every kept session (a node's clean stop)."""
        for kept in self._idle.values():
            for session, handle in kept:
                handle.cancel()
                self._quit(session)
        self._idle.clear()
        if self._quitting:
            await asyncio.gather(*self._quitting, return_exceptions=True)


async def rset_ok(session: Any) -> bool:
    """RSET after a failure in the middle of a transaction (a next hop's or a peer's session):
    True when the session can go on."""
    if not session.is_connected:
        return False
    try:
        return (await asyncio.wait_for(session.rset(), 10)).code == 250
    except Exception:  # noqa: BLE001
        return False


def describe(exc: BaseException) -> str:
    """An exception as one short line for a reply or a log."""
    text = str(exc) or exc.__class__.__name__
    return text.replace("\r", " ").replace("\n", " ")[:300]


def failure(exc: BaseException) -> str:
    """Why a session to a host could not be had, for a reply that names the host already: a
    system error in the system's words (``Connection refused``; asyncio's own text, ``Connect
    call failed ('127.0.0.1', 25)``, would name it again), a timeout as such, else ``describe``."""
    if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError) and exc.errno and exc.errno > 0:
        return os.strerror(exc.errno)
    if isinstance(exc, TimeoutError):
        return "timed out"
    return describe(exc)
