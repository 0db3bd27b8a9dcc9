"""Which messages an operator's bulk command acts on: ``--filter`` terms, parsed, and their SQL.

It owns the filter language of ``message list|remove|suspend|resume`` (``field OP value``
terms combined with AND, like Exchange's ``-Filter`` and Postfix's ``postsuper ... ALL
deferred``), parsing a term into a ``Term`` with a clear error naming it, and turning a
``Selection`` (terms, optional ids) into one SQLAlchemy condition on ``messages``. It never
changes a row, never formats output and never decides what an action does (``admin`` does).

Fields (Exchange names accepted as aliases):

- ``sender`` (``from``, ``fromaddress``), ``recipient`` (``to``, ``recipients``: any recipient of
  the message), ``subject``: ``=`` / ``!=`` a pattern, case-insensitive, ``*`` any text, ``?``
  one character; ``sender=<>`` is the null sender;
- ``queue``: a queue identity pattern (``dns:*``), a queue number or ``Poison``: the message has a
  recipient pending in it;
- ``state`` (``status``): Ready, Retry (``deferred``), Active, Suspended (``hold``), Poison, and
  with ``--all`` SafetyNet and Removed, as ``message list`` shows them (a recipient waiting for
  its queue's next retry is Retry);
- ``age`` (since it was received) with a duration (``age>1h``): ``>``, ``>=``, ``<``, ``<=``;
  ``received`` (``datereceived``, as Exchange's ``DateReceived -gt``) with an ISO 8601 time
  (``received>2026-11-28T10:00Z``: received after it), the same operators; ``size`` with a size
  (``size>=1MB``): those and ``=``, ``!=``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, exists, func, not_, or_, select
from sqlalchemy.sql.elements import ColumnElement

from transportd.config import ConfigError, parse_duration, parse_size
from transportd.errors import FilterError
from transportd.queue import messages as mq
from transportd.queue.store import messages, queues, recipients
from transportd.tracking import parse_datetime

FIELDS = ("sender", "recipient", "subject", "queue", "state", "age", "received", "size")
ALIASES = {"from": "sender", "fromaddress": "sender", "to": "recipient", "recipients": "recipient",
           "status": "state", "datereceived": "received"}
TEXT_OPS = ("=", "!=")
NUMBER_OPS = (">=", "<=", "!=", "=", ">", "<")
ORDER_OPS = (">=", "<=", ">", "<")  # a time or an age: equality would never hold
# Message states a filter can name, with the names a Postfix or Exchange operator may use.
STATES = {"ready": mq.READY, "retry": mq.RETRY, "deferred": mq.RETRY, "active": mq.ACTIVE,
          "suspended": "Suspended", "hold": "Suspended", "poison": mq.POISON,
          "safetynet": mq.SAFETY_NET, "removed": mq.MSG_REMOVED}
_TERM = re.compile(r"^\s*([A-Za-z_]+)\s*(!=|>=|<=|=|>|<)\s*(.*?)\s*$", re.DOTALL)


@dataclass(frozen=True)
class Term:
    field: str
    op: str
    value: Any
    text: str  # as the operator wrote it, for messages

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Selection:
    """Terms (all must hold) and, when given, the message ids the selection is limited to."""
    terms: tuple[Term, ...] = ()
    ids: tuple[int, ...] | None = None
    everything: bool = False  # ``ALL``: no id limit and no term needed

    @property
    def empty(self) -> bool:
        return not self.terms and self.ids is None and not self.everything

    def describe(self) -> str:
        parts = [str(t) for t in self.terms]
        if self.ids is not None:
            parts.insert(0, f"{len(self.ids)} id(s)")
        return " and ".join(parts) or "ALL"


def parse_term(text: str) -> Term:
    """One ``field OP value`` term; FilterError naming the term when it is not one."""
    m = _TERM.match(text)
    if not m:
        raise FilterError(f"--filter {text!r}: expected FIELD=VALUE, FIELD!=VALUE or FIELD>VALUE "
                          f"(fields: {', '.join(FIELDS)})")
    name, op, raw = m.group(1).lower(), m.group(2), m.group(3)
    name = ALIASES.get(name, name)
    if name not in FIELDS:
        raise FilterError(f"--filter {text!r}: unknown field {m.group(1)!r} (fields: {', '.join(FIELDS)})")
    if name in ("age", "received", "size"):
        ops = NUMBER_OPS if name == "size" else ORDER_OPS
        if op not in ops:
            raise FilterError(f"--filter {text!r}: {name} takes {', '.join(ops)}")
        try:
            if name == "received":
                value: Any = parse_datetime(raw).timestamp()
            else:
                value = parse_duration(raw) if name == "age" else parse_size(raw)
        except (ConfigError, ValueError) as exc:
            what = "expected an ISO 8601 time like 2026-11-28T10:00:00Z" if name == "received" else exc
            raise FilterError(f"--filter {text!r}: {what}") from None
        return Term(name, op, value, text.strip())
    if op not in TEXT_OPS:
        raise FilterError(f"--filter {text!r}: {name} takes = or != (a pattern with * and ?)")
    if name == "state":
        state = STATES.get(raw.lower())
        if state is None:
            raise FilterError(f"--filter {text!r}: unknown state {raw!r} "
                              f"(states: Ready, Retry, Active, Suspended, Poison, SafetyNet, Removed)")
        return Term(name, op, state, text.strip())
    if raw == "":
        hint = " (sender=<> is the null sender)" if name == "sender" else ""
        raise FilterError(f"--filter {text!r}: empty {name} pattern{hint}")
    return Term(name, op, raw, text.strip())


def parse_terms(texts: Sequence[str]) -> tuple[Term, ...]:
    return tuple(parse_term(t) for t in texts)


# --------------------------------------------------------------------------- SQL

def like_pattern(glob: str) -> str:
    """A ``*``/``?`` pattern as a LIKE pattern (escape ``\\``), lower-cased."""
    out = []
    for ch in glob.lower():
        if ch in "\\%_":
            out.append("\\" + ch)
        elif ch == "*":
            out.append("%")
        elif ch == "?":
            out.append("_")
        else:
            out.append(ch)
    return "".join(out)


def _text_match(column: Any, pattern: str) -> ColumnElement:
    return func.lower(column).like(like_pattern(pattern), escape="\\")


def _pending_in(status: str, now: float) -> ColumnElement:
    """A recipient of the message is ``status`` as the views show it: a Ready one waiting for its
    queue's next retry is Retry (``mq.waits_for_queue_retry``), so ``state=deferred`` takes every
    message for a next hop that is down, as Postfix's deferred queue does, not only the one tried."""
    in_retry_queue = recipients.c.queue_id.in_(
        select(queues.c.id).where(queues.c.suspended == 0, queues.c.next_retry_at > now))
    if status == mq.RETRY:
        shown = or_(recipients.c.status == mq.RETRY, and_(recipients.c.status == mq.READY, in_retry_queue))
    elif status == mq.READY:
        shown = and_(recipients.c.status == mq.READY, not_(in_retry_queue))
    else:
        shown = recipients.c.status == status
    return exists().where(recipients.c.message_id == messages.c.id, shown)


def _state_condition(state: str, now: float) -> ColumnElement:
    """The status ``message list`` shows, as a condition (the order of ``mq.message_status``)."""
    if state in (mq.SAFETY_NET, mq.MSG_REMOVED):
        return messages.c.state == state
    queued = messages.c.state == mq.QUEUED
    if state == mq.POISON:
        return and_(queued, messages.c.poisoned == 1)
    held = or_(messages.c.poisoned == 1, messages.c.suspended == 1)
    if state == "Suspended":
        return and_(queued, messages.c.poisoned == 0, messages.c.suspended == 1)
    before = {mq.ACTIVE: (), mq.RETRY: (mq.ACTIVE,), mq.READY: (mq.ACTIVE, mq.RETRY)}[state]
    return and_(queued, not_(held), _pending_in(state, now), *[not_(_pending_in(s, now)) for s in before])


def _queue_condition(value: str) -> ColumnElement:
    if value.lower() == mq.POISON.lower():
        return messages.c.poisoned == 1
    match = _text_match(queues.c.identity, value)
    if value.isdigit():
        match = or_(match, queues.c.id == int(value))
    return exists().where(recipients.c.message_id == messages.c.id, recipients.c.status.not_in(mq.TERMINAL),
                          recipients.c.queue_id.in_(select(queues.c.id).where(match)))


def _number(column: Any, op: str, value: float) -> ColumnElement:
    return {">": column > value, ">=": column >= value, "<": column < value, "<=": column <= value,
            "=": column == value, "!=": column != value}[op]


def term_condition(term: Term, now: float) -> ColumnElement:
    if term.field == "age":  # age > X  <=>  received_at < now - X
        flipped = {">": "<", ">=": "<=", "<": ">", "<=": ">=", "=": "=", "!=": "!="}[term.op]
        return _number(messages.c.received_at, flipped, now - term.value)
    if term.field == "received":
        return _number(messages.c.received_at, term.op, term.value)
    if term.field == "size":
        return _number(messages.c.size, term.op, term.value)
    if term.field == "state":
        cond = _state_condition(term.value, now)
    elif term.field == "queue":
        cond = _queue_condition(term.value)
    elif term.field == "sender":
        cond = messages.c.sender == "" if term.value == "<>" else _text_match(messages.c.sender, term.value)
    elif term.field == "subject":
        cond = _text_match(messages.c.subject, term.value)
    else:  # recipient
        cond = exists().where(recipients.c.message_id == messages.c.id,
                              _text_match(recipients.c.address, term.value))
    return not_(cond) if term.op == "!=" else cond


def condition(selection: Selection, now: float, include_done: bool = False,
              among: Sequence[int] | None = None) -> ColumnElement:
    """The selection as a condition on ``messages``: primary messages and the Poison queue's
    (named ids too: a shadow copy is its primary's to deliver, remove or bounce, never an
    operator's here); queued ones unless ``include_done``; limited to ``among`` ids when given."""
    cond = [or_(messages.c.role == "primary", messages.c.poisoned == 1)]
    if not include_done:
        cond.append(messages.c.state == mq.QUEUED)
    if selection.ids is not None:
        cond.append(messages.c.id.in_(list(selection.ids)))
    if among is not None:
        cond.append(messages.c.id.in_(list(among)))
    cond += [term_condition(t, now) for t in selection.terms]
    return and_(*cond)
