"""The total-queue checker: what the clients were told against what arrived.

Pure logic over two inputs, so it has unit tests of its own: the client history
(every attempt of every numbered message: acknowledged with the node and queue
id, rejected with the reply, or unknown after a timeout or reset) and the
deliveries found at the destinations (the sink's Maildir for external mail,
the mailbox database's Maildirs for local mail), each tagged with the message
number read from its ``X-Chaos-Id`` header. Like Jepsen's total-queue:

- lost: acknowledged messages with a recipient that never received it (must be 0)
- unexpected: deliveries of messages no client sent, or to a recipient it was not sent to (must be 0)
- duplicates: extra copies, split into mailbox (must be 0: duplicate detection) and external
- recovered: messages whose every attempt ended unknown or refused, yet which arrived
- internal errors: acknowledged messages still held at the end as primary with a recipient in
  Retry whose last error is an internal error (``451 4.3.0 ...``: ours, ``internal error in
  <step>``, a mailbox store error, or a peer's ``Internal error``), or in the Poison queue
  (must be 0: one bad message, or a bug, never strands acknowledged mail). The harness reads the
  nodes' queue databases (``HeldRow``); ``internal_errors`` judges the rows.
- code errors: lines of the nodes' logs naming an exception that only a bug raises
  (``UnboundLocalError``, ``KeyError``, ``TypeError``...; ``code_errors``). A fault never
  explains one: a background task that died of it may have left work undone that no other
  figure shows (must be 0).
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ACK, REJECTED, UNKNOWN, REFUSED = "ack", "rejected", "unknown", "refused"
# REFUSED: no transaction was possible (connection refused, 4xx before DATA): certainly not queued.

_CHAOS_ID = re.compile(rb"^X-Chaos-Id:[ \t]*([A-Za-z0-9]+)-(\d+)[ \t]*\r?$", re.MULTILINE | re.IGNORECASE)
_SINK_RCPT = re.compile(rb"^X-Sink-Rcpt-To:[ \t]*(.*?)\r?$", re.MULTILINE | re.IGNORECASE)


@dataclass
class Attempt:
    outcome: str            # ack | rejected | unknown | refused
    node: str = ""
    detail: str = ""        # the reply, or the exception
    at: float = 0.0


@dataclass
class Sent:
    number: int
    recipients: list[str]
    attempts: list[Attempt] = field(default_factory=list)
    utf8: bool = False  # internationalized (RFC 6531/6532): UTF-8 envelope and headers, SMTPUTF8

    @property
    def outcome(self) -> str:
        """ack if any attempt was acknowledged; else unknown if any may have been queued; else rejected."""
        kinds = {a.outcome for a in self.attempts}
        if ACK in kinds:
            return ACK
        if UNKNOWN in kinds:
            return UNKNOWN
        if REJECTED in kinds or REFUSED in kinds:
            return REJECTED
        return "never-sent"


@dataclass(frozen=True)
class Delivery:
    run: str
    number: int
    recipient: str
    where: str              # mailbox | external
    path: str = ""


def parse_delivery(data: bytes, *, where: str, recipient: str | None = None, path: str = "") -> list[Delivery]:
    """The deliveries one stored file stands for (one per recipient); [] if it carries no X-Chaos-Id."""
    head = data.split(b"\r\n\r\n", 1)[0].split(b"\n\n", 1)[0]
    run, number = chaos_id(head)
    if recipient is not None:
        rcpts = [recipient]
    else:
        r = _SINK_RCPT.search(head)
        rcpts = re.findall(r"<([^>]*)>", r.group(1).decode("utf-8", "replace")) if r else [""]
    return [Delivery(run, number, rc.lower(), where, path) for rc in rcpts]


def scan_maildir_tree(root: Path, where: str, per_recipient_folders: bool) -> list[Delivery]:
    """Deliveries under a Maildir (sink: ``root/new``) or a folder of Maildirs (mailboxes: ``root/<addr>/new``)."""
    out: list[Delivery] = []
    if per_recipient_folders:
        boxes = [(Path(e.path), _address_of(e.name)) for e in _scandir(root) if e.is_dir()]
    else:
        boxes = [(root, None)]
    for box, address in boxes:
        for sub in ("new", "cur"):
            for e in _scandir(box / sub):
                if not e.is_file():
                    continue
                try:
                    with open(e.path, "rb") as f:
                        data = f.read(16384)
                except FileNotFoundError:
                    continue
                out.extend(parse_delivery(data, where=where, recipient=address, path=e.path))
    return out


def _scandir(p: Path) -> list[os.DirEntry]:
    try:
        return list(os.scandir(p))
    except FileNotFoundError:
        return []


def _address_of(folder: str) -> str:
    """Undo mailbox.mailbox_name's %-encoding (of the address's UTF-8 octets)."""
    return urllib.parse.unquote(folder, encoding="utf-8", errors="replace")


# The reply every internal failure is recorded with (mailqueue.INTERNAL_ERROR is "451 4.3.0 internal
# error"; a peer that failed internally answers "451 4.3.0 Internal error ..."): never a transient
# network condition (those are 4.4.x), so a message still held with it has been stranded.
INTERNAL_ERROR_PREFIX = "451 4.3.0"

# Exceptions no fault explains (a disk, a peer or a kill raises OSError, timeouts, SQLite's
# errors, the peers' replies): only code that is wrong raises these.
_CODE_ERROR = re.compile(r"\b(?:UnboundLocalError|NameError|AttributeError|TypeError|KeyError|IndexError"
                         r"|AssertionError|ZeroDivisionError|RecursionError)\b")


def code_errors(lines: Iterable[str]) -> list[str]:
    """The log lines that name an exception only a bug raises (each line once, in order)."""
    return [line.rstrip("\r\n") for line in lines if _CODE_ERROR.search(line)]


@dataclass(frozen=True)
class HeldRow:
    """One recipient of a message still queued as primary on a node at the end of a run.

    A poisoned message with no recipient left pending has one row with ``status`` "".
    """
    node: str
    run: str
    number: int
    status: str
    last_error: str
    poisoned: bool
    message_id: int = 0     # the node's internal id (two copies of one chaos message are two messages)

    @property
    def internal_error(self) -> bool:
        return self.status == "Retry" and (self.last_error or "").startswith(INTERNAL_ERROR_PREFIX)


def internal_errors(rows: list[HeldRow], run: str, acknowledged: set[int] | None = None) -> list[HeldRow]:
    """The run's messages held in Retry with an internal error, or in the Poison queue.

    One row per message (node, internal id): the one that shows the internal error if there is
    one. ``acknowledged``: only these chaos numbers count (None: every number of the run).
    """
    found: dict[tuple[str, int, int], HeldRow] = {}
    for r in rows:
        if r.run != run or (acknowledged is not None and r.number not in acknowledged):
            continue
        if not (r.poisoned or r.internal_error):
            continue
        key = (r.node, r.message_id, r.number)
        if key not in found or (r.internal_error and not found[key].internal_error):
            found[key] = r
    return sorted(found.values(), key=lambda r: (r.number, r.node, r.message_id))


def chaos_id(data: bytes) -> tuple[str, int]:
    """(run, number) from a message's X-Chaos-Id header, ("", -1) without one.

    Only the message's own header block counts: a DSN quoting one of our messages is not it.
    """
    head = data.split(b"\r\n\r\n", 1)[0].split(b"\n\n", 1)[0]
    m = _CHAOS_ID.search(head)
    return (m.group(1).decode(), int(m.group(2))) if m else ("", -1)


@dataclass
class Verdict:
    run: str
    sent: int
    acknowledged: int
    rejected: int
    unknown: int
    lost: list[tuple[int, str]]
    unexpected: list[Delivery]
    duplicates_mailbox: int
    duplicates_external: int
    recovered: int
    delivered_after_reject: int
    attempts: int
    internal_errors: list[HeldRow] = field(default_factory=list)
    duplicated_external: list[int] = field(default_factory=list)
    """Numbers of the messages the external sink got more than once (``duplicates_external``
    counts the extra copies: a message that arrived three times adds two)."""

    @property
    def ok(self) -> bool:
        return not self.lost and not self.unexpected and self.duplicates_mailbox == 0 and not self.internal_errors

    def summary(self) -> dict:
        return {
            "run": self.run, "sent": self.sent, "attempts": self.attempts,
            "acknowledged": self.acknowledged, "rejected": self.rejected, "unknown": self.unknown,
            "lost": len(self.lost), "lost_examples": [f"#{n} -> {r}" for n, r in self.lost[:20]],
            "unexpected": len(self.unexpected),
            "unexpected_examples": [f"{d.run}-{d.number} -> {d.recipient} ({d.where})" for d in self.unexpected[:20]],
            "duplicates": {"mailbox": self.duplicates_mailbox, "external": self.duplicates_external,
                           "external_messages": self.duplicated_external},
            "recovered": self.recovered, "delivered_after_reject": self.delivered_after_reject,
            "internal_errors": len(self.internal_errors),
            "internal_error_examples": [_held_example(r) for r in self.internal_errors[:20]],
            "ok": self.ok,
        }


def _held_example(r: HeldRow) -> str:
    where = f"{r.node} #{r.number}" + (f" (id {r.message_id})" if r.message_id else "")
    if r.poisoned:
        return f"{where}: Poison" + (f" ({r.last_error})" if r.last_error else "")
    return f"{where}: {r.status} {r.last_error}"


def check(run: str, history: dict[int, Sent], deliveries: list[Delivery],
          held: list[HeldRow] | None = None) -> Verdict:
    """Compare the client history with what arrived (see the module docstring)."""
    copies: Counter[tuple[int, str, str]] = Counter()
    unexpected: list[Delivery] = []
    for d in deliveries:
        sent = history.get(d.number) if d.run == run else None
        if sent is None or d.recipient not in {r.lower() for r in sent.recipients}:
            unexpected.append(d)
            continue
        copies[(d.number, d.recipient, d.where)] += 1
    arrived: Counter[tuple[int, str]] = Counter()
    for (n, r, _), c in copies.items():
        arrived[(n, r)] += c
    lost, recovered, after_reject = [], 0, 0
    outcomes = Counter()
    for n, sent in history.items():
        outcome = sent.outcome
        outcomes[outcome] += 1
        got = [r for r in sent.recipients if arrived[(n, r.lower())]]
        if outcome == ACK:
            lost += [(n, r) for r in sent.recipients if not arrived[(n, r.lower())]]
        elif outcome == UNKNOWN and got:
            recovered += 1
        elif outcome == REJECTED and got:
            after_reject += 1
    dup_mailbox = sum(c - 1 for (_, _, w), c in copies.items() if w == "mailbox" and c > 1)
    dup_external = sum(c - 1 for (_, _, w), c in copies.items() if w == "external" and c > 1)
    return Verdict(run=run, sent=len(history), acknowledged=outcomes[ACK], rejected=outcomes[REJECTED],
                   unknown=outcomes[UNKNOWN], lost=sorted(lost), unexpected=unexpected,
                   duplicates_mailbox=dup_mailbox, duplicates_external=dup_external, recovered=recovered,
                   delivered_after_reject=after_reject,
                   duplicated_external=sorted({n for (n, _, w), c in copies.items() if w == "external" and c > 1}),
                   attempts=sum(len(s.attempts) for s in history.values()),
                   internal_errors=internal_errors(held or [], run,
                                                   {n for n, s in history.items() if s.outcome == ACK}))
