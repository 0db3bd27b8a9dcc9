"""A development sink: an SMTP server outside the boundary that stores what it receives.

It stands in for "the internet" in local clusters and demos: every message is
written durably as a Maildir file under ``DIR/new`` with ``X-Sink-Mail-From``
and ``X-Sink-Rcpt-To`` lines prepended, and answered 250. It has no relay
rules, queues nothing and delivers nothing; never expose it beyond loopback.
For fault injection (``transportd chaos``), SIGUSR1 makes it answer every
DATA with ``451 4.3.2`` (storing nothing) until SIGUSR2 makes it accept again.
Started with ``smtputf8=False`` / ``eightbitmime=False`` it stands for an older
server: SMTPUTF8 / 8BITMIME are not advertised, and a MAIL that uses one anyway, or
8-bit octets sent without BODY=8BITMIME, are refused (so a client that sends them
unannounced is caught).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import uuid
from pathlib import Path

from aiosmtpd.smtp import SMTP, Envelope, Session

from transportd.smtp.server import HalfClose


class SinkHandler:
    def __init__(self, directory: Path, smtputf8: bool = True, eightbitmime: bool = True):
        self.directory = directory
        self.smtputf8 = smtputf8
        self.eightbitmime = eightbitmime
        for sub in ("tmp", "new", "cur"):
            (directory / sub).mkdir(parents=True, exist_ok=True)
        self.count = 0
        self.refusing = False

    async def handle_EHLO(self, server: SMTP, session: Session, envelope: Envelope, hostname: str,
                          responses: list[str]) -> list[str]:
        session.host_name = hostname
        hidden = ([] if self.smtputf8 else ["250-SMTPUTF8"]) + ([] if self.eightbitmime else ["250-8BITMIME"])
        return [r for r in responses if r not in hidden]

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope, address: str,
                          mail_options: list[str]) -> str:
        if not self.eightbitmime and any(o.upper().startswith("BODY=8BITMIME") for o in mail_options):
            return "555 5.5.4 BODY=8BITMIME not supported here"
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        if self.refusing:
            return "451 4.3.2 Sink refusing mail for now"
        if not self.eightbitmime and not (envelope.original_content or b"").isascii():
            return "554 5.6.1 8-bit data sent without BODY=8BITMIME"
        head = (f"X-Sink-Mail-From: <{envelope.mail_from}>\r\n"
                f"X-Sink-Rcpt-To: {', '.join('<' + r + '>' for r in envelope.rcpt_tos)}\r\n")
        data = head.encode("utf-8", "surrogateescape") + (envelope.original_content or b"")
        name = f"{int(time.time())}.{uuid.uuid4().hex}.{socket.gethostname()}"
        await asyncio.to_thread(_store, self.directory, name, data)
        self.count += 1
        return "250 2.0.0 Ok: stored"


def _store(directory: Path, name: str, data: bytes) -> None:
    tmp = directory / "tmp" / name
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, directory / "new" / name)


class SinkSMTP(HalfClose, SMTP):
    """aiosmtpd's session, serving a client that half-closes after its pipelined QUIT (Exim)."""


async def run_sink(host: str, port: int, directory: Path, *, smtputf8: bool = True,
                   eightbitmime: bool = True) -> None:
    handler = SinkHandler(directory, smtputf8=smtputf8, eightbitmime=eightbitmime)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: SinkSMTP(handler, hostname="sink.transportd.test", ident="transportd sink",
                     enable_SMTPUTF8=smtputf8, decode_data=False), host=host, port=port, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(handler, "refusing", True))
    loop.add_signal_handler(signal.SIGUSR2, lambda: setattr(handler, "refusing", False))
    print(f"transportd sink: listening on {host}:{port}, storing mail in {directory}/new", flush=True)
    await stop.wait()
    server.close()
    await server.wait_closed()
