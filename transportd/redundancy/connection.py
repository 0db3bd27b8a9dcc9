"""Sans-I/O connection state machines for the shadow redundancy verbs (docs/PROTOCOL.md sections 2-5).

It owns, for one session between boundary peers, when XSHADOWREQUEST, XSHADOW, XQDISCARD,
XQSTATUS, XRESUBMIT, XSHADOWADOPT and MAIL ``XSHADOW=<guid>`` may be sent or answered, the exact replies, and the
matching of each reply to the command awaiting it: ``ClientConnection`` for the node that sends
them, ``ServerConnection`` for the transport connector that answers them. It never touches a
socket, asyncio, a clock or the queue database, and decides nothing about storage or promotion:
it is fed bytes (or replies and commands an SMTP library already split) and returns bytes and
events. The text of the verbs is protocol.py's.

Client: one X-verb at a time (the contract pipelines none); bytes read past the awaited reply are
kept and read after the next command is sent (``receive_data(b"")``). A malformed reply raises
``ProtocolError`` and leaves the connection in ``ClientState.ERROR``, where every call raises.

Server: ``receive_data`` stops after an event that needs the application's answer
(``ShadowRequestReceived``, ``DiscardRequested``, ``StatusRequested``, ``ResubmitRequested``, ``AdoptRequested``,
``MailWithShadow``, ``OtherCommand``), so pipelined commands are judged in the state the answer leaves; the
application answers, then calls ``receive_data(b"")`` (or with more bytes) to go on. A DATA body
is never fed here: after an ``OtherCommand`` for DATA the adapter reads the body itself.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from transportd.errors import ProtocolError
from transportd.redundancy.protocol import (
    DELAY_ARG,
    FAILED_ARG,
    MAX_SHADOW_RANK,
    NOTIFY_ARG,
    RCPT_ARG,
    ShadowRequest,
    decode_dbid,
    decode_fqdn,
    encode_dbid,
    encode_fqdn,
    format_adopt_reply,
    format_discard_reply,
    format_status_reply,
    format_xqstatus,
    format_xshadowadopt,
    format_xshadowrequest,
    has_xshadow_param,
    parse_adopt_reply,
    parse_discard_entries,
    parse_guid,
    parse_resubmit_arg,
    parse_status_reply,
    parse_xqdiscard_request,
    parse_xqstatus,
    parse_xshadow,
    parse_xshadowadopt,
    parse_xshadowrequest,
    redundancy_reply_dbid,
    split_shadow_params,
)
from transportd.smtp import replies
from transportd.smtp.dsnparams import DsnRequest
from transportd.smtp.transaction import Transaction

S501_INVALID_ARGUMENTS = "501 5.5.4 Invalid arguments"
S503_BAD_SEQUENCE = "503 5.5.1 Bad sequence of commands"
S421_NOT_AVAILABLE = "421 4.3.2 Service not available"

MAX_LINE = 4096  # octets of one command or reply line, line ending included
MAX_DISCARD_BATCH = 1000  # the most ids one XQDISCARD is answered with (parse_xqdiscard's cap)


class LocalProtocolError(ProtocolError):
    """This side broke the contract: a command out of turn, a bad argument, a call in ERROR state."""


# ----------------------------------------------------------------------------- events

class Event:
    """Base of everything the machines return."""


@dataclass(frozen=True)
class ShadowRequestAccepted(Event):
    peer_fqdn: str


@dataclass(frozen=True)
class PrimaryIdentified(Event):
    queue_database_id: str


@dataclass(frozen=True)
class DiscardBatch(Event):
    entries: tuple[tuple[str, str | None], ...]
    complete: bool  # fewer ids than asked: nothing more is pending


@dataclass(frozen=True)
class Adopted(Event):
    entries: tuple[tuple[str, int], ...]  # (guid, rank) of each copy the peer now holds as our shadow


@dataclass(frozen=True)
class StatusAnswered(Event):
    statuses: dict[str, str]  # GUID -> Held, Done or Unknown (XQSTATUS)


@dataclass(frozen=True)
class ResubmitAnswered(Event):
    code: int
    text: str


@dataclass(frozen=True)
class ShadowAccepted(Event):
    reply_text: str
    # The queue database that holds the copy, when the peer names it (``QueueDatabaseId=``).
    queue_database_id: str | None = None


@dataclass(frozen=True)
class ShadowRefused(Event):
    code: int
    text: str
    held: bool = field(default=False, compare=False)  # the peer stored the data all the same


@dataclass(frozen=True)
class TransactionReplies(Event):
    """Every reply of a relay transaction (``send_transaction``), in order."""
    mail: tuple[int, str]
    recipients: tuple[tuple[int, str], ...]
    data: tuple[int, str]  # the reply to BDAT LAST or to the end of DATA (or DATA's refusal)


@dataclass(frozen=True)
class SendBody(Event):
    """354 to a shadow copy's DATA: write ``data`` (the body, dot-stuffed and terminated) now."""
    data: bytes


@dataclass(frozen=True)
class CommandRefused(Event):
    verb: str
    code: int
    text: str


@dataclass(frozen=True)
class ShadowRequestReceived(Event):
    primary_fqdn: str
    primary_queue_database_id: str


@dataclass(frozen=True)
class XShadowReceived(Event):
    fqdn: str
    reply: bytes


@dataclass(frozen=True)
class DiscardRequested(Event):
    peer_fqdn: str
    max_count: int
    recipients: bool = False  # ``XQDISCARD n RCPT``: per-recipient entries wanted too
    failed: bool = False  # ``XQDISCARD n RCPT FAILED``: ``Failed=`` ones as well
    notify: bool = False  # ``XQDISCARD n RCPT FAILED NOTIFY``: ``NotifyDelivered=``/``NotifyRelayed=`` too
    delay: bool = False  # ``XQDISCARD n RCPT FAILED NOTIFY DELAY``: ``DelayNotified`` too


@dataclass(frozen=True)
class StatusRequested(Event):
    peer_fqdn: str  # the shadow asking (after XSHADOW)
    guids: tuple[str, ...]


@dataclass(frozen=True)
class ResubmitRequested(Event):
    peer_fqdn: str
    destination: str
    start: float
    end: float


@dataclass(frozen=True)
class AdoptRequested(Event):
    peer_fqdn: str  # the new primary (it promoted the copies)
    old_primary: str
    rank: int  # the rank its own copies had: adopted ranks are lowered by that much
    guids: tuple[str, ...]


@dataclass(frozen=True)
class MailWithShadow(Event):
    guid: str
    rest_of_arg: str
    rank: int = 1  # XSHADOWRANK= (N-way): when this shadow may take ownership


@dataclass(frozen=True)
class Refusal(Event):
    reply: bytes
    why: str = field(default="", compare=False)  # for the operational log; never on the wire


@dataclass(frozen=True)
class OtherCommand(Event):
    line: bytes  # without its line ending


# ----------------------------------------------------------------------------- lines

_TOO_LONG = b""  # what _Lines.pop gives for a line over MAX_LINE (a real line is never empty)


class _Lines:
    """Lines ending in LF (CRLF included) from bytes in any split; an over-long line is dropped
    whole and reported once."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> None:
        self._buf += data

    def pop(self) -> bytes | None:
        while True:
            end = self._buf.find(b"\n")
            if self._skipping:
                if end < 0:
                    self._buf.clear()
                    return None
                del self._buf[:end + 1]
                self._skipping = False
                continue
            if end < 0:
                if len(self._buf) > MAX_LINE:
                    self._buf.clear()
                    self._skipping = True
                    return _TOO_LONG
                return None
            line = bytes(self._buf[:end + 1])
            del self._buf[:end + 1]
            return _TOO_LONG if len(line) > MAX_LINE else line


def _wire(reply: str) -> bytes:
    return reply.encode("ascii") + b"\r\n"


def _reply_line(line: bytes) -> tuple[int, bool, str]:
    """(code, more lines follow, text) of one reply line."""
    text = line.rstrip(b"\r\n").decode("utf-8", "replace")
    code = text[:3]
    if not (len(code) == 3 and code.isascii() and code.isdigit()) or text[3:4] not in ("", " ", "-"):
        raise ProtocolError(f"not an SMTP reply line: {text[:60]!r}")
    return int(code), text[3:4] == "-", text[4:]


# ----------------------------------------------------------------------------- client

class ClientState(enum.Enum):
    IDLE = "idle"  # no X-verb awaits its reply
    AWAITING_SHADOW_REQUEST = "XSHADOWREQUEST"
    AWAITING_XSHADOW = "XSHADOW"
    AWAITING_DISCARD = "XQDISCARD"
    AWAITING_RESUBMIT = "XRESUBMIT"
    AWAITING_ADOPT = "XSHADOWADOPT"
    AWAITING_STATUS = "XQSTATUS"
    AWAITING_COPY = "transaction"  # the replies of a pipelined MAIL, RCPTs and BDAT or DATA
    ERROR = "error"


class ClientConnection:
    """The sending side: XSHADOWREQUEST, XSHADOW, XQDISCARD, XRESUBMIT, MAIL ``XSHADOW=``."""

    def __init__(self, local_fqdn: str):
        self.local_fqdn = local_fqdn
        self.state = ClientState.IDLE
        self.shadow_requested = False  # the peer accepted XSHADOWREQUEST: it takes shadow copies
        self.peer_fqdn: str | None = None  # from the XSHADOWREQUEST reply
        self.peer_queue_database_id: str | None = None  # from the XSHADOW reply
        self._discards_failed = False
        self._asked = 0
        self._asked_kinds: tuple[bool, ...] = ()  # (recipients, failed, notify, delay) of the XQDISCARD awaited
        self._lines = _Lines()
        self._partial: list[str] = []
        self._partial_code = 0
        self._copy: _Copy | None = None
        self._adopt_asked: tuple[str, ...] = ()  # the GUIDs of the XSHADOWADOPT or XQSTATUS awaited

    @property
    def discards_unapplied(self) -> bool:
        """A QUIT would acknowledge discard ids this side never got to apply (an XQDISCARD reply
        malformed, refused or still awaited): the adapter must close without QUIT."""
        return self._discards_failed or self.state is ClientState.AWAITING_DISCARD

    # -- commands -----------------------------------------------------------------

    def _ready(self, what: str) -> None:
        if self.state is ClientState.ERROR:
            raise LocalProtocolError("the connection is in ERROR state after a protocol violation")
        if self.state is not ClientState.IDLE:
            raise LocalProtocolError(f"{what} while the reply to {self.state.value} is awaited")

    def _send(self, state: ClientState, line: str) -> bytes:
        self.state = state
        return line.encode("utf-8") + b"\r\n"

    def send_shadow_request(self, queue_database_id: str) -> bytes:
        self._ready("XSHADOWREQUEST")
        if self.shadow_requested:
            raise LocalProtocolError("XSHADOWREQUEST was already accepted on this session")
        try:
            line = format_xshadowrequest(self.local_fqdn, queue_database_id)
        except ValueError:
            raise LocalProtocolError(f"not a queue database ID: {queue_database_id!r}") from None
        return self._send(ClientState.AWAITING_SHADOW_REQUEST, line)

    def send_xshadow(self) -> bytes:
        self._ready("XSHADOW")
        if self.peer_queue_database_id is not None:
            raise LocalProtocolError("XSHADOW was already answered on this session")
        return self._send(ClientState.AWAITING_XSHADOW, f"XSHADOW {encode_fqdn(self.local_fqdn)}")

    def send_discard(self, max_count: int = 50, recipients: bool = False, failed: bool = False,
                     notify: bool = False, delay: bool = False) -> bytes:
        """XQDISCARD; ``recipients``: ask for per-recipient entries too (only of a primary whose
        EHLO reply offers XQDISCARDRCPT: another answers the argument with 501); ``failed``: for
        ``Failed=`` ones as well (only of a primary that also offers XQDISCARDFAILED); ``notify``:
        for ``NotifyDelivered=``/``NotifyRelayed=`` ones as well (only of a primary that also
        offers XQDISCARDNOTIFY); ``delay``: for ``DelayNotified`` ones as well (only of a primary
        that also offers XQDISCARDDELAY)."""
        self._ready("XQDISCARD")
        if self.peer_queue_database_id is None:
            raise LocalProtocolError("XQDISCARD before XSHADOW identified the primary")
        if isinstance(max_count, bool) or not isinstance(max_count, int) or not 0 < max_count <= MAX_DISCARD_BATCH:
            raise LocalProtocolError(f"XQDISCARD asks 1 to {MAX_DISCARD_BATCH} ids, not {max_count!r}")
        if failed and not recipients:
            raise LocalProtocolError("XQDISCARD asks for Failed= entries only with the per-recipient ones (RCPT)")
        if notify and not failed:
            raise LocalProtocolError("XQDISCARD asks for Notify entries only with the Failed= ones (RCPT FAILED)")
        if delay and not notify:
            raise LocalProtocolError("XQDISCARD asks for DelayNotified only with the Notify ones (RCPT FAILED NOTIFY)")
        self._asked, self._asked_kinds = max_count, (recipients, failed, notify, delay)
        words = [RCPT_ARG] * recipients + [FAILED_ARG] * failed + [NOTIFY_ARG] * notify + [DELAY_ARG] * delay
        return self._send(ClientState.AWAITING_DISCARD, " ".join(["XQDISCARD", str(max_count), *words]))

    def send_status(self, guids: Sequence[str]) -> bytes:
        """XQSTATUS: which of these messages the primary still knows (only of a primary whose
        EHLO reply offers XQSTATUS; ``StatusAnswered``)."""
        self._ready("XQSTATUS")
        if self.peer_queue_database_id is None:
            raise LocalProtocolError("XQSTATUS before XSHADOW identified the primary")
        try:
            line = format_xqstatus(guids)
        except (ValueError, ProtocolError) as exc:
            raise LocalProtocolError(str(exc)) from None
        self._adopt_asked = tuple(g.lower() for g in guids)
        return self._send(ClientState.AWAITING_STATUS, line)

    def send_resubmit(self, destination: str, start: float, end: float) -> bytes:
        self._ready("XRESUBMIT")
        if not destination or destination.split() != [destination]:
            raise LocalProtocolError(f"not a resubmit destination: {destination!r}")
        try:
            arg = f"{destination} {start:.3f} {end:.3f}"
            parse_resubmit_arg(arg)
        except (TypeError, ValueError):
            raise LocalProtocolError(f"not a time window: {start!r} .. {end!r}") from None
        return self._send(ClientState.AWAITING_RESUBMIT, f"XRESUBMIT {arg}")

    def send_adopt(self, old_primary: str, rank: int, guids: Sequence[str]) -> bytes:
        """XSHADOWADOPT: we promoted these shadows of ``old_primary``; the peer's copies of them
        become our shadows (``Adopted`` names those it held)."""
        self._ready("XSHADOWADOPT")
        if not self.shadow_requested:
            raise LocalProtocolError("XSHADOWADOPT before an accepted XSHADOWREQUEST")
        try:
            line = format_xshadowadopt(old_primary, rank, guids)
        except (ValueError, ProtocolError) as exc:
            raise LocalProtocolError(str(exc)) from None
        self._adopt_asked = tuple(g.lower() for g in guids)
        return self._send(ClientState.AWAITING_ADOPT, line)

    def mail_parameter(self, guid: str, rank: int = 1) -> str:
        """``XSHADOW=<guid>`` for MAIL FROM, on a session that carries shadows or hop-by-hop copies."""
        self._ready("MAIL")
        if not (self.shadow_requested or self.peer_queue_database_id):
            raise LocalProtocolError("MAIL XSHADOW= before an accepted XSHADOWREQUEST or XSHADOW")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_SHADOW_RANK:
            raise LocalProtocolError(f"a shadow rank is 1 to {MAX_SHADOW_RANK}, not {rank!r}")
        try:
            # Rank 1 is the default: a two-copy cluster's wire carries no rank (Exchange's protocol).
            return f"XSHADOW={parse_guid(guid)}" + (f" XSHADOWRANK={rank}" if rank > 1 else "")
        except ProtocolError:
            raise LocalProtocolError(f"not a GUID: {guid!r}") from None

    def send_shadow_copy(self, sender: str, params: Sequence[str], recipients: Sequence[str], data: bytes,
                         guid: str, *, chunking: bool, rank: int = 1, dsn: DsnRequest | None = None) -> bytes:
        """One shadow copy as one pipelined group (RFC 2920): MAIL ``XSHADOW=<guid>``, a RCPT per
        recipient, then ``BDAT <size> LAST`` and the body (CHUNKING, RFC 3030) or DATA, whose
        body follows its 354 (``SendBody``). The copy counts only when MAIL and every RCPT got
        250 and the last reply is 250 with 2.6.0 (``ShadowAccepted``)."""
        self._ready("MAIL")
        if not self.shadow_requested:
            raise LocalProtocolError("a shadow copy before an accepted XSHADOWREQUEST")
        return self._group(sender, [*params, self.mail_parameter(guid, rank)], recipients, data, chunking,
                           shadow=True, dsn=dsn)

    def send_transaction(self, sender: str, params: Sequence[str], recipients: Sequence[str], data: bytes, *,
                         chunking: bool, guid: str | None = None, dsn: DsnRequest | None = None) -> bytes:
        """A relay to the peer as one pipelined group, as ``send_shadow_copy``; with ``guid`` (hop by
        hop, after XSHADOW) MAIL carries ``XSHADOW=<guid>``. It ends with ``TransactionReplies``:
        the outcome of each recipient is the caller's to read."""
        self._ready("MAIL")
        extra = [self.mail_parameter(guid)] if guid is not None else []
        return self._group(sender, [*params, *extra], recipients, data, chunking, shadow=False, dsn=dsn)

    def _group(self, sender: str, params: Sequence[str], recipients: Sequence[str], data: bytes, chunking: bool,
               *, shadow: bool, dsn: DsnRequest | None = None) -> bytes:
        if not recipients:
            raise LocalProtocolError("a transaction without recipients")
        self._copy = _Copy(Transaction(sender, params, recipients, data, chunking=chunking, dsn=dsn), shadow)
        self.state = ClientState.AWAITING_COPY
        return self._copy.transaction.start()

    # -- replies --------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """Replies from bytes in any split; each complete one answers the command awaiting it."""
        if self.state is ClientState.ERROR:
            self._ready("data received")
        self._lines.feed(data)
        events: list[Event] = []
        with self._violations():
            while self.state is not ClientState.IDLE:
                reply = self._next_reply()
                if reply is None:
                    break
                events += self._answer(*reply)
        return events

    def receive_reply(self, code: int, lines: Sequence[str]) -> list[Event]:
        """A reply an SMTP library already parsed (``lines``: its text, one item per line)."""
        if self.state is ClientState.ERROR:
            self._ready("a reply")
        if self.state is ClientState.IDLE:
            raise LocalProtocolError(f"a {code} reply with no command awaiting one")
        with self._violations():
            return self._answer(code, list(lines))

    @contextlib.contextmanager
    def _violations(self) -> Iterator[None]:
        """A ProtocolError from the peer's bytes puts the connection in ERROR (and marks the
        discards unapplied when it came while an XQDISCARD reply was awaited)."""
        try:
            yield
        except ProtocolError:
            self._discards_failed |= self.state is ClientState.AWAITING_DISCARD
            self.state = ClientState.ERROR
            raise

    def _next_reply(self) -> tuple[int, list[str]] | None:
        while (line := self._lines.pop()) is not None:
            if line == _TOO_LONG:
                raise ProtocolError(f"a reply line over {MAX_LINE} octets")
            code, more, text = _reply_line(line)
            if self._partial and code != self._partial_code:
                raise ProtocolError(f"a multi-line reply changed its code from {self._partial_code} to {code}")
            self._partial_code = code
            self._partial.append(text)
            if not more:
                lines, self._partial = self._partial, []
                return code, lines
        return None

    def _answer(self, code: int, lines: list[str]) -> list[Event]:
        awaiting = self.state
        text = "\n".join(lines)
        if awaiting is ClientState.AWAITING_COPY:
            return self._copy_reply(code, text)
        event: Event
        if awaiting is ClientState.AWAITING_DISCARD and code in (250, 251):
            entries = tuple(parse_discard_entries(code, lines, *self._asked_kinds))
            event = DiscardBatch(entries, len(entries) < self._asked)
        elif awaiting is ClientState.AWAITING_ADOPT and code in (250, 251):
            event = Adopted(tuple(parse_adopt_reply(code, lines, self._adopt_asked)))
        elif awaiting is ClientState.AWAITING_STATUS and code == 250:
            event = StatusAnswered(parse_status_reply(code, lines, self._adopt_asked))
        elif code != 250:
            self._discards_failed |= awaiting is ClientState.AWAITING_DISCARD
            event = CommandRefused(awaiting.value, code, text)
        elif awaiting is ClientState.AWAITING_SHADOW_REQUEST:
            self.peer_fqdn = decode_fqdn(text)
            self.shadow_requested = True
            event = ShadowRequestAccepted(self.peer_fqdn)
        elif awaiting is ClientState.AWAITING_XSHADOW:
            self.peer_queue_database_id = decode_dbid(text)
            event = PrimaryIdentified(self.peer_queue_database_id)
        else:
            event = ResubmitAnswered(code, text)
        self.state = ClientState.IDLE
        return [event]

    def _copy_reply(self, code: int, text: str) -> list[Event]:
        copy = self._copy
        assert copy is not None
        write = copy.transaction.answer(code, text)
        replies = copy.transaction.replies
        if replies is None:
            return [SendBody(write)] if write else []
        self.state, self._copy = ClientState.IDLE, None
        if not copy.shadow:
            return [TransactionReplies(replies.mail, replies.recipients, replies.data)]
        if replies.refusal is None and code == 250 and "2.6.0" in text:
            return [ShadowAccepted(text, redundancy_reply_dbid(text))]
        refused = replies.refusal or (code, text)
        return [ShadowRefused(refused[0], refused[1], held=code == 250)]


@dataclass
class _Copy:
    """A shadow copy or relay in flight: its transaction, and which of the two it is."""
    transaction: Transaction
    shadow: bool  # a shadow copy (ShadowAccepted / ShadowRefused), else a relay (TransactionReplies)


# ----------------------------------------------------------------------------- server

class ServerConnection:
    """The transport connector's side: judges each X-verb and MAIL ``XSHADOW=``, words the replies."""

    def __init__(self, local_fqdn: str, queue_database_id: str, *, shadow_redundancy_enabled: bool = True,
                 version: str = "2013"):
        self.local_fqdn = local_fqdn
        self.queue_database_id = queue_database_id
        self.shadow_redundancy_enabled = shadow_redundancy_enabled
        self.version = version  # "2010": XSHADOW only, no shadow requests (docs/PROTOCOL.md section 6)
        self.accepting = True  # False: the node refuses new work (XSHADOWREQUEST gets 421)
        self.peer_fqdn: str | None = None  # the boundary peer this session authenticated as
        self.shadow_request: ShadowRequest | None = None
        self.xshadow_peer: str | None = None
        # Discard ids may be out on this session: set when they are asked for, before the
        # application takes them, so a session that breaks meanwhile hands them back too.
        self.discards_out = False
        self.shadow_guid: str | None = None
        self.shadow_rank = 1  # the open transaction's XSHADOWRANK=
        self._xshadow_reply = _wire(f"250 {encode_dbid(queue_database_id)}")
        self._in_transaction = False
        self._mail_guid: str | None = None
        self._mail_rank = 1
        self._pending: Event | None = None
        self._lines = _Lines()

    # -- what the adapter tells -----------------------------------------------------

    def authenticated(self, peer_fqdn: str) -> None:
        self.peer_fqdn = peer_fqdn.lower()

    def transaction_started(self) -> None:
        """MAIL was accepted: a transaction is open (with the guid of a MAIL ``XSHADOW=``)."""
        self._in_transaction = True
        self.shadow_guid, self._mail_guid = self._mail_guid, None
        self.shadow_rank, self._mail_rank = self._mail_rank, 1

    def transaction_ended(self) -> None:
        self._in_transaction = False
        self.shadow_guid = self._mail_guid = None
        self.shadow_rank = self._mail_rank = 1

    # -- commands -------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        self._lines.feed(data)
        events: list[Event] = []
        while (line := self._lines.pop()) is not None:
            if line == _TOO_LONG:
                events.append(Refusal(_wire(replies.S500_COMMAND_TOO_LONG), "command line too long"))
                continue
            line = line.rstrip(b"\r\n")
            verb, _, arg = line.decode("utf-8", "surrogateescape").partition(" ")
            event = self._command(verb, arg.strip() or None, line)
            events.append(event)
            if not isinstance(event, (Refusal, XShadowReceived)):
                break  # the application answers before the next command is judged
        return events

    def receive_command(self, verb: str, arg: str | None) -> list[Event]:
        line = verb if arg is None else f"{verb} {arg}"
        return [self._command(verb, arg, line.encode("utf-8", "surrogateescape"))]

    def _command(self, verb: str, arg: str | None, line: bytes) -> Event:
        self._pending = self._mail_guid = None
        verb = verb.upper()
        if verb == "MAIL" and arg and has_xshadow_param(arg):  # never a local part ``xshadow=...``
            return self._mail(arg, line)
        handler = {"XSHADOWREQUEST": self._xshadowrequest, "XSHADOW": self._xshadow,
                   "XQDISCARD": self._xqdiscard, "XQUERYDISCARD": self._xqdiscard,
                   "XRESUBMIT": self._xresubmit, "XSHADOWADOPT": self._xshadowadopt,
                   "XQSTATUS": self._xqstatus}.get(verb)
        if handler is None:
            return OtherCommand(line)
        event = handler(arg)
        if not isinstance(event, (Refusal, XShadowReceived)):
            self._pending = event
        return event

    def _refusal(self, check_transaction: bool = True) -> Refusal | None:
        """550 to a session that is no boundary peer; 503 inside a mail transaction."""
        if self.peer_fqdn is None:
            return Refusal(_wire(replies.S550_NOT_AUTHORIZED), "X-verb from unauthenticated session")
        if check_transaction and self._in_transaction:
            return Refusal(_wire(S503_BAD_SEQUENCE), "inside a mail transaction")
        return None

    def _xshadowrequest(self, arg: str | None) -> Event:
        if refusal := self._refusal():
            return refusal
        if not self.shadow_redundancy_enabled:
            return Refusal(_wire(replies.S502_NOT_IMPLEMENTED), "shadow redundancy is disabled here")
        if self.version == "2010":
            return Refusal(_wire(replies.S502_NOT_IMPLEMENTED), "shadow redundancy version 2010 takes no "
                                                                "shadow requests (XSHADOW only)")
        try:
            request = parse_xshadowrequest(arg)
        except ProtocolError as exc:
            return Refusal(_wire(S501_INVALID_ARGUMENTS), str(exc))
        if not self.accepting:
            return Refusal(_wire(S421_NOT_AVAILABLE), "not accepting shadows (stopping)")
        if request.primary_fqdn != self.peer_fqdn:
            return Refusal(_wire(replies.S550_NOT_AUTHORIZED),
                           f"peer {self.peer_fqdn} claims to be {request.primary_fqdn}")
        return ShadowRequestReceived(request.primary_fqdn, request.primary_dbid)

    def _xshadow(self, arg: str | None) -> Event:
        if refusal := self._refusal():
            return refusal
        try:
            fqdn = parse_xshadow(arg)
        except ProtocolError as exc:
            return Refusal(_wire(S501_INVALID_ARGUMENTS), str(exc))
        if fqdn != self.peer_fqdn:
            return Refusal(_wire(replies.S550_NOT_AUTHORIZED), f"peer {self.peer_fqdn} claims to be {fqdn}")
        self.xshadow_peer = fqdn
        return XShadowReceived(fqdn, self._xshadow_reply)

    def _xqdiscard(self, arg: str | None) -> Event:
        if refusal := self._refusal(check_transaction=False):
            return refusal
        if self.xshadow_peer is None:
            return Refusal(_wire(S503_BAD_SEQUENCE), "XQDISCARD before XSHADOW")
        try:
            n, recipients, failed, notify, delay = parse_xqdiscard_request(arg, MAX_DISCARD_BATCH)
        except ProtocolError as exc:
            return Refusal(_wire(S501_INVALID_ARGUMENTS), str(exc))
        self.discards_out = True
        return DiscardRequested(self.xshadow_peer, n, recipients, failed, notify, delay)

    def _xqstatus(self, arg: str | None) -> Event:
        if refusal := self._refusal(check_transaction=False):
            return refusal
        if self.xshadow_peer is None:
            return Refusal(_wire(S503_BAD_SEQUENCE), "XQSTATUS before XSHADOW")
        try:
            guids = parse_xqstatus(arg)
        except ProtocolError as exc:
            return Refusal(_wire(S501_INVALID_ARGUMENTS), str(exc))
        return StatusRequested(self.xshadow_peer, tuple(guids))

    def _xresubmit(self, arg: str | None) -> Event:
        if refusal := self._refusal():
            return refusal
        try:
            destination, start, end = parse_resubmit_arg(arg)
        except ValueError as exc:
            return Refusal(_wire(S501_INVALID_ARGUMENTS), str(exc))
        assert self.peer_fqdn is not None
        return ResubmitRequested(self.peer_fqdn, destination, start, end)

    def _xshadowadopt(self, arg: str | None) -> Event:
        if refusal := self._refusal():
            return refusal
        if not self.shadow_redundancy_enabled:
            return Refusal(_wire(replies.S502_NOT_IMPLEMENTED), "shadow redundancy is disabled here")
        if self.shadow_request is None:
            return Refusal(_wire(S503_BAD_SEQUENCE), "XSHADOWADOPT before XSHADOWREQUEST")
        try:
            old_primary, rank, guids = parse_xshadowadopt(arg)
        except ProtocolError as exc:
            return Refusal(_wire(S501_INVALID_ARGUMENTS), str(exc))
        assert self.peer_fqdn is not None
        if old_primary == self.peer_fqdn:
            return Refusal(_wire(S501_INVALID_ARGUMENTS), "a node cannot adopt its own shadows")
        return AdoptRequested(self.peer_fqdn, old_primary, rank, tuple(guids))

    def _mail(self, arg: str, line: bytes) -> Event:
        if refusal := self._refusal(check_transaction=False):
            return refusal  # a MAIL inside a transaction is the normal MAIL handling's to refuse
        if not (self.shadow_request or self.xshadow_peer):
            return Refusal(_wire(S503_BAD_SEQUENCE), "MAIL XSHADOW= before XSHADOWREQUEST or XSHADOW")
        try:
            rest, guid, rank = split_shadow_params(arg)
        except ProtocolError as exc:
            return Refusal(_wire(S501_INVALID_ARGUMENTS), str(exc))
        if guid is None:
            return OtherCommand(line)  # no XSHADOW= parameter after all: a plain MAIL
        self._mail_guid, self._mail_rank = guid, rank
        return MailWithShadow(guid, rest, rank)

    # -- the application's answers ----------------------------------------------------

    def _take(self, kind: type, verb: str) -> Event:
        if not isinstance(self._pending, kind):
            raise LocalProtocolError(f"no {verb} awaits an answer")
        event, self._pending = self._pending, None
        return event

    def accept_shadow_request(self) -> bytes:
        """The primary is recorded: ``250 <base64 of this node's FQDN>``."""
        event = self._take(ShadowRequestReceived, "XSHADOWREQUEST")
        assert isinstance(event, ShadowRequestReceived)
        self.shadow_request = ShadowRequest(event.primary_fqdn, event.primary_queue_database_id)
        return _wire(f"250 {encode_fqdn(self.local_fqdn)}")

    def discard_reply(self, entries: Sequence[str | tuple[str, str | None]]) -> bytes:
        """The XQDISCARD reply for the ids taken (at most the count asked)."""
        pending = self._pending
        if isinstance(pending, DiscardRequested) and len(entries) > pending.max_count:
            raise LocalProtocolError(f"{len(entries)} discard ids for {pending.max_count} asked")
        self._take(DiscardRequested, "XQDISCARD")
        return b"".join(_wire(line) for line in format_discard_reply(list(entries)))

    def adopt_reply(self, adopted: Sequence[tuple[str, int]]) -> bytes:
        """The XSHADOWADOPT reply: (GUID, new rank) of the copies now held for the new primary."""
        pending = self._pending
        if isinstance(pending, AdoptRequested) and not {g for g, _ in adopted} <= set(pending.guids):
            raise LocalProtocolError("an adopted GUID that was not asked")
        self._take(AdoptRequested, "XSHADOWADOPT")
        return b"".join(_wire(line) for line in format_adopt_reply(list(adopted)))

    def status_reply(self, statuses: dict[str, str]) -> bytes:
        """The XQSTATUS reply: a line per GUID asked, in the order asked."""
        event = self._take(StatusRequested, "XQSTATUS")
        assert isinstance(event, StatusRequested)
        return b"".join(_wire(line) for line in format_status_reply([(g, statuses[g]) for g in event.guids]))

    def resubmit_reply(self, count: int) -> bytes:
        self._take(ResubmitRequested, "XRESUBMIT")
        return _wire(f"250 2.0.0 {int(count)} message(s) resubmitted from the Safety Net")
