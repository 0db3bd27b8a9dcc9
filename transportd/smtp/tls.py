"""A receive connector's TLS certificate, taken again when its files change.

It owns the server side's TLS context: built from ``tls_certificate`` and ``tls_key`` at start
(a file that cannot be loaded stops the node there), and, at the start of a connection at most
once per ``node.tls_certificate_check_interval``, rebuilt when either file changed (a renewal by
certbot or a mounted secret's update), so no restart is needed. A renewed pair that does not load
(a key that does not match the certificate, a file half written) leaves the context in use as it
was, says so once per change (a file gone missing included), and is tried again when the files
change again; files back as they were are taken again. Sessions already open keep the
certificate they started with. It never reads a file on a connection's path more often than that.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable

log = logging.getLogger("transportd")

Stamp = tuple[tuple[int, int, int], ...]
MISSING = (-1, -1, -1)
"""The stamp of a file that cannot be looked at."""


def _context(certificate: str, key: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certificate, key)
    return context


class ServerTLS:
    """The current TLS context of a receive connector (``context()``); see the module."""

    def __init__(self, certificate: str, key: str, check_interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.paths = (certificate, key) if key else (certificate,)
        self.check_interval = check_interval
        self._clock = clock
        self._stamp = self._files()
        self._context = _context(*self.paths)  # at start, a file that does not load is an error
        self._next_check = clock() + check_interval
        self._refused: Stamp | None = None  # the files' state a reload failed on (said once)
        self.reloads = 0

    def implicit_context(self) -> ssl.SSLContext:
        """A context for a listener that speaks TLS from the first byte (RFC 8314): at each
        handshake it hands the connection to ``context()``, so a renewed certificate is taken
        there as it is at STARTTLS (the callback runs whether or not the client sends SNI)."""
        front = _context(*self.paths)

        def current(conn: ssl.SSLObject, server_name: str | None, _ctx: ssl.SSLContext) -> None:
            conn.context = self.context()
        front.sni_callback = current
        return front

    def _files(self) -> Stamp:
        """Each file's (modification time, size, inode); a file that cannot be looked at (gone
        missing) has a stamp of its own, so that state too is said once."""
        stamps = []
        for path in self.paths:
            try:
                st = os.stat(path)
            except OSError:
                stamps.append(MISSING)
            else:
                stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stamps)

    def context(self) -> ssl.SSLContext:
        """The context for a new connection: rebuilt first if a check is due and the files changed."""
        if self.check_interval and self._clock() >= self._next_check:
            self._next_check = self._clock() + self.check_interval
            self._reload_if_changed()
        return self._context

    def _reload_if_changed(self) -> None:
        """Load the files when they changed since the last look, each state they pass through said
        once: one that does not load (a file missing, a key that does not match) is remembered
        and not tried again until it changes; files back as they were in use are taken again."""
        stamp = self._files()
        if stamp == self._refused or (stamp == self._stamp and self._refused is None):
            return
        try:
            context = _context(*self.paths)
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._refused = stamp
            log.error("TLS certificate %s changed and does not load (%s): the one in use stays", self.paths[0],
                      exc)
            return
        self._context, self._stamp, self._refused = context, stamp, None
        self.reloads += 1
        log.info("TLS certificate %s changed: new sessions use it", self.paths[0])


def server_tls(certificate: str, key: str, check_interval: float = 60.0, section: str = "") -> ServerTLS | None:
    """A receive connector's TLS certificate, or None without one. One that does not load raises
    OSError naming the config keys (``section``.tls_certificate and tls_key) and the files."""
    if not certificate:
        return None
    try:
        return ServerTLS(certificate, key, check_interval)
    except (ssl.SSLError, ValueError) as exc:
        where = f"{section}.tls_certificate and {section}.tls_key" if section else "tls_certificate and tls_key"
        raise OSError(f"{where} ({certificate}, {key}) do not load as a certificate and its private key: "
                      f"{getattr(exc, 'reason', None) or exc}") from None
