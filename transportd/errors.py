"""The exceptions transportd raises on purpose, in one tree.

It owns the names every layer raises and catches; it never holds logic. Anything
outside this tree that reaches a loop is an internal error: logged with the
message's ids, counted towards the Poison queue, answered ``451 4.3.0``.

    TransportdError                    anything transportd raises on purpose
    ├── ConfigError                    a bad config file or key (the message names the key)
    │   └── NodeNameMismatch           node.name is not the name the queue database holds mail under
    ├── FilterError                    an operator's --filter term that cannot be understood
    ├── StoreError                     the queue database cannot be used (receive answers 451 4.3.0)
    │   └── CorruptDatabase            the file is not a usable queue database (moved aside at start)
    ├── ProtocolError                  a malformed X-verb, argument or reply: a contract violation
    │                                  (also a ValueError: it is raised while parsing values)
    ├── PeerError                      a peer's transport connector could not do what we asked
    │   ├── PeerTransientError         no connection, timeout, 4xx, a broken session: try again later
    │   │   ├── TlsHandshakeFailed     STARTTLS accepted, then TLS failed (opportunistic: again in plaintext)
    │   │   └── TlsRequired            TLS required of it and not had: no STARTTLS, refused, handshake or
    │   │                              certificate failed (a deferral, never a session in plaintext)
    │   └── PeerPermanentError         a 5xx, or the peer does not offer what we need
    ├── NextHopError                   a delivery's next hop
    │   ├── NextHopUnavailable         no session to any of its hosts (DEFER the whole batch; ``tls_status``
    │   │                              where each host was reached and TLS, required, failed)
    │   └── NextHopPermanentError      it can never be reached (no such domain, null MX): FAIL + DSN
    └── MessageRejected                the reply to give an SMTP client for one message (4xx or 5xx)

``PEER_FAILURES`` is the tuple of library exceptions that mean "this session to a peer or next hop
failed" (network, SMTP, timeout, protocol); adapters catch exactly that and nothing wider.
"""

from __future__ import annotations

import asyncio


class TransportdError(Exception):
    """Base of every exception transportd raises on purpose."""


class ConfigError(TransportdError):
    """A configuration problem, with the key it concerns in the message."""


class NodeNameMismatch(ConfigError):
    """node.name is not the name the node's queue database was run under, and the database holds
    mail peers know under that name (or that another node on a copy of it would deliver again)."""


class FilterError(TransportdError, ValueError):
    """A ``--filter`` term of a bulk queue command that cannot be understood (names the term)."""


class StoreError(TransportdError):
    """The queue database cannot be used (the receive path answers 451 4.3.0)."""


class CorruptDatabase(StoreError):
    """The file is not a usable queue database."""


class ProtocolError(TransportdError, ValueError):
    """A malformed X-verb argument or reply (a contract violation)."""


class NoShadowRequests(ProtocolError):
    """The peer does not advertise XSHADOWREQUEST (disabled, or shadow redundancy version 2010)."""


class PeerError(TransportdError):
    """A peer's transport connector could not do what was asked."""


class PeerTransientError(PeerError):
    """Worth trying again: no connection, a timeout, a 4xx, a session that broke."""


class GreetingRefused(PeerTransientError):
    """The server answered the connection with a 4xx greeting (421: busy, too many connections)."""


class TlsHandshakeFailed(PeerTransientError):
    """STARTTLS was answered 220 and then the TLS session (or the EHLO over it) failed: the
    connection is unusable; where TLS was only opportunistic, a new one without it is."""


class TlsRequired(PeerTransientError):
    """TLS is required of the server (a peer's transport connector, a send connector's
    ``require_tls``) and could not be had: no STARTTLS offered, STARTTLS refused, the handshake or
    the certificate's check failed. The connection itself succeeded; the message names the server
    once and says why. ``status``: the enhanced status code of the deferral (node/connectors.py
    puts it in the reply): X.7.10 where the server offers no TLS, X.7.5 where TLS itself failed."""

    def __init__(self, message: str, status: str):
        super().__init__(message)
        self.status = status


class PeerPermanentError(PeerError):
    """Not worth trying again as is: a 5xx, or the peer does not offer what is needed."""


class NextHopError(TransportdError):
    """A delivery's next hop could not be used."""


class NextHopUnavailable(NextHopError):
    """No session could be opened to any host of a next hop (a DEFER for the whole batch).
    ``busy``: every host answered with a 4xx greeting (it is up, and turned this session away).
    ``tls_status``: every host was reached and TLS, required of it, failed (``TlsRequired``): the
    enhanced status code of the first; None where any host failed otherwise. ``only``: the host
    (``host:port``) the message is about where it is about one host alone, and ``reason`` what
    happened there, so a reply that names the next hop need not name that host twice."""

    def __init__(self, message: str, busy: bool = False, tls_status: str | None = None,
                 only: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.busy = busy
        self.tls_status = tls_status
        self.only = only
        self.reason = reason


class NextHopPermanentError(NextHopError):
    """The next hop can never be reached (no such domain, null MX): FAIL with this reply and a DSN."""

    def __init__(self, reply: str):
        super().__init__(reply)
        self.reply = reply


class MessageRejected(TransportdError):
    """Raised by the accept path with the SMTP reply to send (4xx or 5xx)."""

    def __init__(self, reply: str):
        super().__init__(reply)
        self.reply = reply


# A session to a peer or a next hop failed: the network, the SMTP exchange, a timeout, the contract.
PEER_FAILURES: tuple[type[BaseException], ...] = (OSError, asyncio.TimeoutError, ProtocolError, PeerError)
