"""One mail transaction as a client sends it, sans I/O: MAIL, a RCPT per recipient, then DATA and
its body or ``BDAT <n> LAST`` with it (RFC 5321, CHUNKING RFC 3030).

It owns the commands' bytes, the order of the replies they await, and what follows each reply:
with PIPELINING (RFC 2920) the whole group goes out in one write and the replies are matched as
they come; without it, one command at a time (no RCPT after a refused MAIL, no DATA after every
RCPT was refused). The body follows DATA's 354, or a lone dot when every recipient was refused
(RFC 2920 3.1: the client must read DATA's reply, not assume its refusal). It never touches a
socket (smtp/wire.py and redundancy/peers.py write what it returns), and never decides what a
reply means for a message: the caller reads ``Replies``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from transportd.errors import ProtocolError
from transportd.smtp.dsnparams import DsnRequest


def envelope_path(address: str) -> bytes:
    """``<address>`` exactly as received, UTF-8 (RFC 6531), as MAIL and RCPT carry it."""
    return b"<" + address.encode("utf-8", "surrogateescape") + b">"


def _rcpt_params(params: str) -> bytes:
    """`` NOTIFY=... ORCPT=...`` (UTF-8 in an RFC 6533 utf-8 ORCPT), or nothing."""
    return b" " + params.encode("utf-8") if params else b""


_LINE_ENDS = re.compile(rb"\r\n|\n|\r(?!\n)")


def dot_stuff(data: bytes) -> bytes:
    """A DATA body (RFC 5321 4.5.2): every line ending CRLF (a bare CR or LF a body may hold
    becomes one: a next hop that takes a bare LF as a line end must not see a lone dot where we
    meant none, the "SMTP smuggling" confusion), a leading dot doubled on every line, CRLF at
    the end, then the lone-dot line."""
    crlf = data.count(b"\r\n")
    if data.count(b"\n") != crlf or data.count(b"\r") != crlf:
        data = _LINE_ENDS.sub(b"\r\n", data)
    if not data.endswith(b"\r\n"):
        data += b"\r\n"
    if data.startswith(b"."):
        data = b"." + data
    return data.replace(b"\r\n.", b"\r\n..") + b".\r\n"


_DATA_GOES_ON, _POSITIVE = (354,), range(200, 300)  # the accepting replies a step may get
OUT_OF_STEP = "the session is out of step"  # a reply no server gives to its command (Transaction.answer)


def accepted(step: str, code: int) -> bool:
    return code == 250 if step == "MAIL" else code in (250, 251)


@dataclass(frozen=True)
class Replies:
    """Every reply of a transaction, in order. A command never sent (one at a time, after a
    refused MAIL or with every RCPT refused) has the refusal that stopped the transaction."""
    mail: tuple[int, str]
    recipients: tuple[tuple[int, str], ...]
    data: tuple[int, str]  # the reply to BDAT LAST or to the end of DATA (or DATA's refusal)

    @property
    def refusal(self) -> tuple[int, str] | None:
        """The first refusal of MAIL or a RCPT, if any."""
        if not accepted("MAIL", self.mail[0]):
            return self.mail
        return next((r for r in self.recipients if not accepted("RCPT", r[0])), None)


class Transaction:
    """Feed it each reply (``answer``); write what it returns; ``replies`` is set once it is over."""

    def __init__(self, sender: str, params: Sequence[str], recipients: Sequence[str], data: bytes, *,
                 chunking: bool, pipelining: bool = True, dsn: DsnRequest | None = None):
        """``dsn``: the sender's RFC 3461 parameters, passed on (to a next hop that offers DSN)."""
        if not recipients:
            raise ProtocolError("a transaction without recipients")
        if dsn is not None:
            params = [*params, *dsn.mail_params()]
        words = [b"MAIL FROM:" + envelope_path(sender), *(p.encode("ascii") for p in params)]
        self._mail = b" ".join(words) + b"\r\n"
        if dsn is None:
            self._rcpts = [b"RCPT TO:" + envelope_path(r) + b"\r\n" for r in recipients]
        else:
            self._rcpts = [b"RCPT TO:" + envelope_path(r) + _rcpt_params(dsn.rcpt_params(r)) + b"\r\n"
                           for r in recipients]
        self._data = data
        self.chunking = chunking
        self.pipelining = pipelining
        self._awaiting: list[str] = []
        self._got: list[tuple[int, str]] = []  # MAIL's and the RCPTs' replies so far
        self.replies: Replies | None = None

    def start(self) -> bytes:
        """The first write: the whole group with PIPELINING, else MAIL alone."""
        if self._awaiting or self.replies is not None:
            raise ProtocolError("the transaction was already started")
        if not self.pipelining:
            self._awaiting = ["MAIL"]
            return self._mail
        self._awaiting = ["MAIL"] + ["RCPT"] * len(self._rcpts) + ["DATA"]
        return self._mail + b"".join(self._rcpts) + self._data_command()

    def _data_command(self) -> bytes:
        if self.chunking:
            return f"BDAT {len(self._data)} LAST\r\n".encode("ascii") + self._data
        return b"DATA\r\n"

    @property
    def mail_accepted(self) -> bool:
        """MAIL was answered 250: from here on the server may come to hold the message (no data
        goes out before it)."""
        return bool(self._got) and accepted("MAIL", self._got[0][0])

    @property
    def any_accepted(self) -> bool:
        return (len(self._got) > 1 and accepted("MAIL", self._got[0][0])
                and any(accepted("RCPT", code) for code, _ in self._got[1:]))

    @property
    def awaiting(self) -> str | None:
        """The step whose reply is awaited next (``MAIL``, ``RCPT``, ``DATA``, ``end of data``,
        ``BDAT LAST``), or None: the transaction is over or not started."""
        if not self._awaiting:
            return None
        return "BDAT LAST" if self._awaiting[0] == "DATA" and self.chunking else self._awaiting[0]

    def answer(self, code: int, text: str) -> bytes:
        """One reply, for the command that awaits it; returns what to write now (maybe nothing).

        A reply no server gives to that command says the session is out of step (a reply line too
        many or too few before it: a broken multi-line reply, an extra line after the data): a
        ProtocolError, never read as the command's answer. Above all DATA answered with anything but
        354 or a refusal (RFC 5321 4.3.2): taken as the data's 250, it would count the message
        delivered though no octet of it was sent."""
        if not self._awaiting:
            raise ProtocolError(f"a {code} reply with no command of the transaction awaiting one")
        step = self._awaiting[0]
        expected = _DATA_GOES_ON if step == "DATA" and not self.chunking else _POSITIVE
        if code not in expected and not 400 <= code < 600:
            raise ProtocolError(f"{self.awaiting} answered {code} {' '.join(text.split())[:80]}: {OUT_OF_STEP}")
        self._awaiting.pop(0)
        if step in ("MAIL", "RCPT"):
            self._got.append((code, text))
            if self.pipelining:
                return b""
            return self._next_alone(step, code, text)
        if step == "DATA" and not self.chunking and code == 354:
            self._awaiting.append("end of data")
            return dot_stuff(self._data) if self.any_accepted else b".\r\n"
        self._finish((code, text))
        return b""

    def closed(self, code: int, text: str) -> None:
        """The server ends the session with this reply (a 421, RFC 5321 3.8: it closes the
        connection): every command still awaiting a reply has this one, and nothing more is sent."""
        while self.replies is None and self._awaiting:
            self.answer(code, text)

    def _next_alone(self, step: str, code: int, text: str) -> bytes:
        """Without PIPELINING: the command after this reply, or the end of the transaction."""
        if step == "MAIL" and not accepted("MAIL", code):
            self._finish((code, text))
            return b""
        sent = len(self._got) - 1  # RCPTs answered so far
        if sent < len(self._rcpts):
            self._awaiting = ["RCPT"]
            return self._rcpts[sent]
        if not self.any_accepted:
            self._finish((code, text))
            return b""
        self._awaiting = ["DATA"]
        return self._data_command()

    def _finish(self, data: tuple[int, str]) -> None:
        mail = self._got[0] if self._got else data
        rcpts = list(self._got[1:])
        stop = mail if not accepted("MAIL", mail[0]) else data
        rcpts += [stop] * (len(self._rcpts) - len(rcpts))
        self.replies = Replies(mail, tuple(rcpts), data)
        self._awaiting = []
