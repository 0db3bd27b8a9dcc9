"""The shadow redundancy wire protocol (docs/PROTOCOL.md) as pure functions: parse, format, decide.

It owns the list of the verbs (``VERBS``), the text of XSHADOWREQUEST, XSHADOW, XQDISCARD,
XSHADOWADOPT and MAIL ``XSHADOW=`` / ``XSHADOWRANK=``, the encodings of queue database IDs and FQDNs,
shadow placement (*ShadowMessagePreferenceSetting* with its retry counts), and
the heartbeat rules that decide promotion, rank by rank when a message has
several shadows (N-way). No sockets, no clock: callers pass ``now``.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from transportd.errors import ProtocolError  # noqa: F401 - raised by every parser here
from transportd.smtp.dsnparams import XTEXT, xtext_decode, xtext_encode
from transportd.smtp.replies import SHADOW_REDUNDANCY_VERBS

# ------------------------------------------------------------------------- encodings

def encode_dbid(dbid: str) -> str:
    """Base64 of the 16 bytes of a queue database ID GUID (24 characters)."""
    return base64.b64encode(uuid.UUID(dbid).bytes).decode("ascii")


def decode_dbid(text: str) -> str:
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"not base64: {text!r}") from None
    if len(raw) != 16:
        raise ProtocolError(f"a queue database ID has 16 bytes, got {len(raw)}")
    return str(uuid.UUID(bytes=raw))


_FQDN = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*$")


def encode_fqdn(fqdn: str) -> str:
    return base64.b64encode(fqdn.encode("ascii")).decode("ascii")


def decode_fqdn(text: str) -> str:
    try:
        name = base64.b64decode(text.strip(), validate=True).decode("ascii")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise ProtocolError(f"not a base64 host name: {text!r}") from None
    if not name or len(name) > 255 or not _FQDN.match(name):
        raise ProtocolError(f"not a host name: {name!r}")
    return name.lower()


def parse_guid(text: str) -> str:
    """A canonical 8-4-4-4-12 GUID (lower case), else ProtocolError."""
    t = text.strip()
    if not re.fullmatch(r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}", t):
        raise ProtocolError(f"not a GUID: {text!r}")
    return t.lower()


# ------------------------------------------------------------------------- verbs

VERBS = SHADOW_REDUNDANCY_VERBS
"""Every verb of this protocol, the one list (kept in smtp/replies.py, below this layer, so that the
frontend answers each ``502 5.3.3``): the transport connector serves exactly these
(tests/test_receive.py checks redundancy/server.py and connection.py against it)."""

@dataclass(frozen=True)
class ShadowRequest:
    primary_fqdn: str
    primary_dbid: str


def parse_xshadowrequest(arg: str | None) -> ShadowRequest:
    """``XSHADOWREQUEST <fqdn> <b64 dbid>``."""
    parts = (arg or "").split()
    if len(parts) != 2:
        raise ProtocolError("XSHADOWREQUEST needs <fqdn> <base64 queue database ID>")
    fqdn = parts[0].lower()
    if not _FQDN.match(fqdn):
        raise ProtocolError(f"not a host name: {parts[0]!r}")
    return ShadowRequest(fqdn, decode_dbid(parts[1]))


def format_xshadowrequest(fqdn: str, dbid: str) -> str:
    return f"XSHADOWREQUEST {fqdn} {encode_dbid(dbid)}"


def parse_xshadow(arg: str | None) -> str:
    """``XSHADOW <b64 fqdn>`` -> the peer's FQDN."""
    parts = (arg or "").split()
    if len(parts) != 1:
        raise ProtocolError("XSHADOW needs <base64 of the sender's FQDN>")
    return decode_fqdn(parts[0])


def parse_xqdiscard(arg: str | None, maximum: int = 1000) -> int:
    return parse_xqdiscard_request(arg, maximum)[0]


def parse_xqdiscard_request(arg: str | None, maximum: int = 1000) -> tuple[int, bool, bool, bool, bool]:
    """``XQDISCARD <count> [RCPT [FAILED [NOTIFY [DELAY]]]]``: the batch size (capped at
    ``maximum``), whether the shadow takes per-recipient entries (``RCPT``, asked only of a primary
    that offers ``XQDISCARDRCPT``), whether ``Failed=`` ones too (``FAILED``, asked only of a
    primary that offers ``XQDISCARDFAILED``), whether ``NotifyDelivered=``/``NotifyRelayed=`` ones
    too (``NOTIFY``, asked only of a primary that offers ``XQDISCARDNOTIFY``) and whether
    ``DelayNotified`` ones too (``DELAY``, asked only of a primary that offers ``XQDISCARDDELAY``)."""
    words = (arg or "").split()
    extra = [w.upper() for w in words[1:]]
    chain = [RCPT_ARG, FAILED_ARG, NOTIFY_ARG, DELAY_ARG]
    if not words or extra != chain[:len(extra)]:
        raise ProtocolError("XQDISCARD needs a batch size > 0 (and RCPT, RCPT FAILED, RCPT FAILED NOTIFY, "
                            "RCPT FAILED NOTIFY DELAY, or nothing, after it)")
    if not words[0].isdigit() or int(words[0]) <= 0:
        raise ProtocolError("XQDISCARD needs a batch size > 0")
    return min(int(words[0]), maximum), bool(extra), FAILED_ARG in extra, NOTIFY_ARG in extra, DELAY_ARG in extra


# Reasons a discard id may carry after it (``250-<guid> DeletedByAdmin``): the message was not
# processed but removed by an operator. A plain id means processed (ExplicitlyDiscarded).
DISCARD_REASONS = ("DeletedByAdmin",)

# transportd: per-recipient discards. A primary that offers them says ``XQDISCARDRCPT`` in its
# EHLO reply; a shadow that takes them asks ``XQDISCARD <n> RCPT``, and entries
# ``<guid> Delivered=<xtext of a recipient's address>`` then tell it that the primary delivered
# that recipient while others of the message wait: a promotion of the copy delivers only the others
# (Exchange keeps a shadow queue per next hop of the primary message for the same end).
RCPT_DISCARDS_KEYWORD = "XQDISCARDRCPT"
RCPT_ARG = "RCPT"
DELIVERED = "Delivered="
# ... and the recipients it failed: a primary that offers them says ``XQDISCARDFAILED`` too; a
# shadow that takes them asks ``XQDISCARD <n> RCPT FAILED``, and entries ``<guid> Failed=<xtext>``
# then tell it that the primary failed that recipient (its DSN, if one was due, is out): a promotion
# neither tries it again nor makes a second DSN. Kept apart from ``Delivered=`` so that no shadow
# counts a failed recipient as delivered, and never handed to a shadow that did not ask (an older
# one reads an unknown reason as a contract violation).
FAILED_DISCARDS_KEYWORD = "XQDISCARDFAILED"
FAILED_ARG = "FAILED"
FAILED = "Failed="
# ... and the recipients it delivered whose success notice (NOTIFY=SUCCESS, RFC 3461) is still in
# its queue: a primary that offers them says ``XQDISCARDNOTIFY`` too; a shadow that takes them asks
# ``XQDISCARD <n> RCPT FAILED NOTIFY``, and entries ``<guid> NotifyDelivered=<xtext>`` (stored in a
# mailbox) or ``NotifyRelayed=<xtext>`` (sent on to a next hop that does not offer DSN) then tell
# it that the primary delivered that recipient and owes the sender that notice: a promotion does
# not deliver it again but sends the notice (RFC 3464 action ``delivered`` or ``relayed``). Once
# the notice is out of the primary's queue, a ``Delivered=`` entry (or the message's discard)
# follows. A shadow that did not ask is handed ``Delivered=`` instead, at once, as before.
NOTIFY_DISCARDS_KEYWORD = "XQDISCARDNOTIFY"
NOTIFY_ARG = "NOTIFY"
NOTIFY_DELIVERED = "NotifyDelivered="
NOTIFY_RELAYED = "NotifyRelayed="
# The RFC 3464 action of the notice each of them owes.
NOTICE_ACTIONS = {NOTIFY_DELIVERED: "delivered", NOTIFY_RELAYED: "relayed"}
# ... and that the delay notice of a message (RFC 3464 action ``delayed``, one per message after
# DelayNotificationTimeout) went to its sender: a primary that offers them says ``XQDISCARDDELAY``
# too; a shadow that takes them asks ``XQDISCARD <n> RCPT FAILED NOTIFY DELAY``, and an entry
# ``<guid> DelayNotified`` then tells it so. Not a discard: the shadow keeps its copy and notes the
# notice on it, so a promotion sends no second one. Never handed to a shadow that did not ask (an
# older one reads an unknown reason as a contract violation and applies none of the batch).
DELAY_DISCARDS_KEYWORD = "XQDISCARDDELAY"
DELAY_ARG = "DELAY"
DELAY_NOTIFIED = "DelayNotified"


def delivered_reason(address: str) -> str:
    return DELIVERED + xtext_encode(address)


def failed_reason(address: str) -> str:
    return FAILED + xtext_encode(address)


def delivered_address(reason: str | None) -> str | None:
    """The address of a ``Delivered=`` reason, or None for any other reason."""
    if not reason or not reason.startswith(DELIVERED):
        return None
    return xtext_decode(reason[len(DELIVERED):])


def notice_reason(address: str, action: str) -> str:
    """The reason for a recipient delivered whose success notice (``action``: ``delivered`` or
    ``relayed``) is still queued: ``NotifyDelivered=`` or ``NotifyRelayed=<xtext>``."""
    kind = NOTIFY_DELIVERED if action == "delivered" else NOTIFY_RELAYED
    return kind + xtext_encode(address)


def recipient_done(reason: str | None) -> tuple[str, str] | None:
    """(``Delivered=``, ``Failed=``, ``NotifyDelivered=`` or ``NotifyRelayed=``, the address) of a
    per-recipient reason; None for another."""
    for kind in (DELIVERED, FAILED, NOTIFY_DELIVERED, NOTIFY_RELAYED):
        if reason and reason.startswith(kind):
            return kind, xtext_decode(reason[len(kind):])
    return None


def format_discard_reply(entries: Sequence[str | tuple[str, str | None]]) -> list[str]:
    """The reply lines for XQDISCARD (without CRLF): ``250-<guid>[ <reason>]`` ... or 251."""
    if not entries:
        return ["251 OK, no discard events"]
    texts = [e if isinstance(e, str) else (f"{e[0]} {e[1]}" if e[1] else e[0]) for e in entries]
    return [f"250-{t}" for t in texts[:-1]] + [f"250 {texts[-1]}"]


def parse_discard_entries(code: int, lines: Sequence[str], recipients: bool = False, failed: bool = False,
                          notify: bool = False, delay: bool = False) -> list[tuple[str, str | None]]:
    """(GUID, reason or None) from an XQDISCARD reply; ProtocolError on any malformed line (keep
    every shadow then). ``recipients``: the shadow asked for per-recipient entries (``Delivered=``);
    ``failed``: for ``Failed=`` ones too; ``notify``: for ``NotifyDelivered=``/``NotifyRelayed=``
    ones as well; ``delay``: for ``DelayNotified`` ones as well."""
    if code == 251:
        return []
    if code != 250:
        raise ProtocolError(f"XQDISCARD answered {code}")
    kinds = (DELIVERED,) * recipients + (FAILED,) * (recipients and failed) \
        + (NOTIFY_DELIVERED, NOTIFY_RELAYED) * (recipients and failed and notify)
    out: list[tuple[str, str | None]] = []
    for line in lines:
        if not line.strip():
            continue
        guid, _, reason = line.strip().partition(" ")
        per_recipient = any(reason.startswith(k) and XTEXT.fullmatch(reason[len(k):]) for k in kinds)
        delay_told = reason == DELAY_NOTIFIED and recipients and failed and notify and delay
        if reason and reason not in DISCARD_REASONS and not per_recipient and not delay_told:
            raise ProtocolError(f"unknown discard reason {reason[:40]!r}")
        out.append((parse_guid(guid), reason or None))
    return out


def parse_discard_reply(code: int, lines: Sequence[str]) -> list[str]:
    """GUIDs from an XQDISCARD reply; ProtocolError on any malformed id (keep every shadow then)."""
    return [g for g, _ in parse_discard_entries(code, lines)]


MAX_SHADOW_RANK = 9  # the most shadows one message may have (shadow_redundancy.shadow_copies)


def parse_rank(text: str) -> int:
    """A shadow rank: 1 to MAX_SHADOW_RANK."""
    t = text.strip()
    if not t.isdigit() or not 1 <= int(t) <= MAX_SHADOW_RANK:
        raise ProtocolError(f"a shadow rank is 1 to {MAX_SHADOW_RANK}, not {text[:20]!r}")
    return int(t)


_MAIL_PATH = re.compile(r'[ \t]*(?:FROM:)?[ \t]*(?:<(?:"(?:[^"\\]|\\.)*"|[^>"])*>|\S*)', re.IGNORECASE)
"""The reverse-path at the start of a MAIL argument: ``<...>`` to its closing bracket (a quoted
local part, which may hold blanks, '>' or '=', read whole), or without brackets up to a blank."""


def _mail_parameters(arg: str) -> tuple[str, list[str]]:
    """(path, parameter tokens) of a MAIL FROM argument: the tokens are what follows the path,
    split at each space (the first is empty when a space follows the path)."""
    match = _MAIL_PATH.match(arg)
    end = match.end() if match else 0
    return arg[:end], arg[end:].split(" ")


def has_xshadow_param(arg: str) -> bool:
    """MAIL's argument carries ``XSHADOW=`` among its ESMTP parameters. The path does not count: a
    local part may begin ``xshadow=`` (RFC 5321 4.1.2's atext holds '='), a plain sender."""
    return any(token[:8].upper() == "XSHADOW=" for token in _mail_parameters(arg)[1])


def split_shadow_params(arg: str) -> tuple[str, str | None, int]:
    """Remove ``XSHADOW=<guid>`` and ``XSHADOWRANK=<k>`` from the parameters of a MAIL FROM
    argument (never from its path); returns (rest, guid or None, rank: 1 when not given)."""
    guid, rank = None, None
    path, tokens = _mail_parameters(arg)
    kept = []
    for token in tokens:
        name, _, value = token.partition("=")
        if name.upper() == "XSHADOW":
            if guid is not None:
                raise ProtocolError("XSHADOW= given twice")
            guid = parse_guid(value)
        elif name.upper() == "XSHADOWRANK":
            if rank is not None:
                raise ProtocolError("XSHADOWRANK= given twice")
            rank = parse_rank(value)
        else:
            kept.append(token)
    if rank is not None and guid is None:
        raise ProtocolError("XSHADOWRANK= without XSHADOW=")
    return path + " ".join(kept), guid, rank or 1


def split_xshadow_param(arg: str) -> tuple[str, str | None]:
    """Remove ``XSHADOW=<guid>`` (and ``XSHADOWRANK=``) from a MAIL FROM argument; returns (rest, guid or None)."""
    rest, guid, _ = split_shadow_params(arg)
    return rest, guid


MAX_ADOPT_BATCH = 20  # GUIDs per XSHADOWADOPT line (a line stays under 1,000 octets)


def format_xshadowadopt(old_primary: str, rank: int, guids: Sequence[str]) -> str:
    """``XSHADOWADOPT <base64 FQDN of the lost primary> <rank> <guid> ...``: the sender promoted
    these shadows of ``old_primary``, where its own copies had ``rank``; a copy of them held here
    becomes the sender's shadow, its rank lowered by that much."""
    if not guids or len(guids) > MAX_ADOPT_BATCH:
        raise ValueError(f"XSHADOWADOPT names 1 to {MAX_ADOPT_BATCH} GUIDs")
    return " ".join(["XSHADOWADOPT", encode_fqdn(old_primary), str(parse_rank(str(rank))),
                     *(parse_guid(g) for g in guids)])


def parse_xshadowadopt(arg: str | None) -> tuple[str, int, list[str]]:
    parts = (arg or "").split()
    if len(parts) < 3:
        raise ProtocolError("XSHADOWADOPT needs <base64 FQDN of the lost primary> <rank> <guid> ...")
    if len(parts) - 2 > MAX_ADOPT_BATCH:
        raise ProtocolError(f"XSHADOWADOPT names at most {MAX_ADOPT_BATCH} GUIDs")
    return decode_fqdn(parts[0]), parse_rank(parts[1]), list(dict.fromkeys(parse_guid(g) for g in parts[2:]))


def format_adopt_reply(adopted: Sequence[tuple[str, int]]) -> list[str]:
    """``250-<guid> <new rank>`` ... for the copies adopted, or ``251`` when none was held here."""
    if not adopted:
        return ["251 OK, no shadow of those held here"]
    texts = [f"{g} {r}" for g, r in adopted]
    return [f"250-{t}" for t in texts[:-1]] + [f"250 {texts[-1]}"]


def parse_adopt_reply(code: int, lines: Sequence[str], asked: Sequence[str]) -> list[tuple[str, int]]:
    """(GUID, its rank under us) for each copy the peer adopted, from an XSHADOWADOPT reply."""
    if code == 251:
        return []
    if code != 250:
        raise ProtocolError(f"XSHADOWADOPT answered {code}")
    out = []
    for line in lines:
        if line.strip():
            guid, _, rank = line.strip().partition(" ")
            out.append((parse_guid(guid), parse_rank(rank)))
    if not {g for g, _ in out} <= set(asked):
        raise ProtocolError("XSHADOWADOPT answered a GUID that was not asked")
    return out


# *transportd*: a shadow asks a live primary whether it still holds the messages of copies held
# long (docs/PROTOCOL.md section 4, XQSTATUS): a primary whose queue database lost committed
# transactions without a new ID (a damaged write-ahead log) would otherwise never discard them.
STATUS_KEYWORD = "XQSTATUS"
MAX_STATUS_BATCH = 50  # GUIDs per XQSTATUS line (a line stays under 2,000 octets)
HELD, DONE, UNKNOWN = "Held", "Done", "Unknown"


def format_xqstatus(guids: Sequence[str]) -> str:
    """``XQSTATUS <guid> ...``: which of these messages the primary still knows."""
    if not guids or len(guids) > MAX_STATUS_BATCH:
        raise ValueError(f"XQSTATUS names 1 to {MAX_STATUS_BATCH} GUIDs")
    return " ".join(["XQSTATUS", *(parse_guid(g) for g in guids)])


def parse_xqstatus(arg: str | None) -> list[str]:
    parts = (arg or "").split()
    if not parts:
        raise ProtocolError("XQSTATUS needs <guid> ...")
    if len(parts) > MAX_STATUS_BATCH:
        raise ProtocolError(f"XQSTATUS names at most {MAX_STATUS_BATCH} GUIDs")
    return list(dict.fromkeys(parse_guid(g) for g in parts))


def format_status_reply(entries: Sequence[tuple[str, str]]) -> list[str]:
    """``250-<guid> Held|Done|Unknown`` ..., one line per GUID asked, in the order asked."""
    texts = [f"{g} {status}" for g, status in entries]
    return [f"250-{t}" for t in texts[:-1]] + [f"250 {texts[-1]}"]


def parse_status_reply(code: int, lines: Sequence[str], asked: Sequence[str]) -> dict[str, str]:
    """GUID -> Held, Done or Unknown from an XQSTATUS reply: every GUID asked, no other."""
    if code != 250:
        raise ProtocolError(f"XQSTATUS answered {code}")
    out = {}
    for line in lines:
        guid, _, status = line.strip().partition(" ")
        if status not in (HELD, DONE, UNKNOWN):
            raise ProtocolError(f"XQSTATUS answered {line.strip()[:80]!r}")
        out[parse_guid(guid)] = status
    if set(out) != set(asked):
        raise ProtocolError("XQSTATUS did not answer exactly the GUIDs asked")
    return out


REPLY_DBID_KEY = "QueueDatabaseId"
_REPLY_DBID = re.compile(r"\[[^\]]*?\b" + REPLY_DBID_KEY + r"=([A-Za-z0-9+/=]+)\s*[,\]]")


def redundancy_reply(message_id: str, internal_id: int, fqdn: str, what: str = "redundancy",
                     queue_database_id: str | None = None) -> str:
    """Exchange's acceptance reply: ``... Queued mail for redundancy`` (a shadow copy) or, with
    ``what="delivery"``, the reply an Exchange transport server gives a message it took as primary.
    With ``queue_database_id`` (*transportd*, a shadow copy) the bracket also names the queue
    database that holds the copy: ``QueueDatabaseId=<base64>`` (``redundancy_reply_dbid``)."""
    mid = message_id if message_id else "<>"
    held_in = f", {REPLY_DBID_KEY}={encode_dbid(queue_database_id)}" if queue_database_id else ""
    return f"250 2.6.0 {mid} [InternalId={internal_id}, Hostname={fqdn}{held_in}] Queued mail for {what}"


def redundancy_reply_dbid(text: str) -> str | None:
    """The queue database ID a shadow copy's ``250 2.6.0`` names (``QueueDatabaseId=`` in its
    bracket), or None: a peer that does not say it (Exchange, an older transportd), or says it
    malformed, is treated as one that does not (the copy counts all the same)."""
    # The last bracket: the message-id before it is the sender's text, and may hold anything.
    found = _REPLY_DBID.findall(text)
    if not found:
        return None
    try:
        return decode_dbid(found[-1])
    except ProtocolError:
        return None


# ------------------------------------------------------------------------- placement

@dataclass(frozen=True)
class Peer:
    name: str
    site: str
    transport: str  # host:port of its transport connector


def shadow_attempts(peers: Sequence[Peer], my_site: str, preference: str,
                    remote_retries: int, local_retries: int, rotate: int = 0) -> list[Peer]:
    """The ordered list of shadow attempts (a peer may appear several times, as retries).

    PreferRemote: peers in other sites up to ``remote_retries`` attempts, then local-site peers up
    to ``local_retries``. With one site only the local-site count applies. LocalOnly / RemoteOnly
    keep to one kind, except RemoteOnly in a single-site cluster (no peer in another site), which
    Exchange ignores: PreferRemote. ``rotate`` spreads load over peers of equal standing.
    """
    local = [p for p in peers if p.site == my_site]
    remote = [p for p in peers if p.site != my_site]

    def cycle(group: list[Peer], n: int) -> list[Peer]:
        if not group or n <= 0:
            return []
        start = rotate % len(group)
        ordered = group[start:] + group[:start]
        return [ordered[i % len(ordered)] for i in range(n)]

    if preference == "LocalOnly":
        return cycle(local, local_retries)
    if preference == "RemoteOnly" and remote:
        return cycle(remote, remote_retries)
    # RemoteOnly in a single-site cluster: Exchange ignores the preference outside a multi-site
    # DAG, so it behaves as PreferRemote, where only the local-site count applies.
    return cycle(remote, remote_retries) + cycle(local, local_retries)


# ------------------------------------------------------------------------- heartbeat

@dataclass(frozen=True)
class HeartbeatDecision:
    promote: bool
    reason: str = ""  # "ShadowHeartbeatFailure" or "ShadowStateChange"
    # The highest shadow rank promoted now (N-way, docs/PROTOCOL.md section 9): a shadow of rank
    # k waits (k - 1) more rank delays (2010: k times the retry count) before it takes ownership.
    rank: int = MAX_SHADOW_RANK


def promotable_rank(*, unreachable_for: float, resubmit_time_span: float, rank_delay: float,
                    failures: int = 0, retry_count: int | None = None) -> int:
    """The highest rank of shadows that may be promoted for a primary unreachable this long (0: none).

    Rank 1 after *ShadowResubmitTimeSpan* (2010: *ShadowHeartbeatRetryCount* failures in a row),
    rank k after the span plus (k - 1) rank delays (2010: k times the retry count), so the
    shadow that would promote first has that much time to promote and adopt the others."""
    if retry_count is not None:
        return min(MAX_SHADOW_RANK, failures // max(1, retry_count))
    if unreachable_for < resubmit_time_span:
        return 0
    if rank_delay <= 0:
        return MAX_SHADOW_RANK
    return min(MAX_SHADOW_RANK, 1 + int((unreachable_for - resubmit_time_span) // rank_delay))


def state_change_rank(*, since_change: float, rank_delay: float) -> int:
    """The highest rank of shadows made from a primary's old queue database that may be promoted
    ``since_change`` seconds after its new ID was first seen: rank 1 at once, rank k after k - 1
    rank delays (the lower rank has that long to promote and adopt them)."""
    if rank_delay <= 0:
        return MAX_SHADOW_RANK
    return min(MAX_SHADOW_RANK, 1 + int(max(0.0, since_change) // rank_delay))


def after_heartbeat(*, ok: bool, unreachable_for: float, recorded_dbid: str | None,
                    answered_dbid: str | None, resubmit_time_span: float, failures: int = 0,
                    retry_count: int | None = None, rank_delay: float = 0.0) -> HeartbeatDecision:
    """Decide promotion after one heartbeat exchange.

    2013 (``retry_count`` None): ``unreachable_for`` is the seconds since the primary was last
    known alive (its last successful exchange), when ``ok`` is False. Promotion is decided by
    elapsed time, not by a count of failures: a black-holed primary whose heartbeats each wait
    for a time-out is promoted after *ShadowResubmitTimeSpan* all the same.

    2010: the primary is declared failed after ``retry_count`` (*ShadowHeartbeatRetryCount*)
    time-outs in a row, ``failures`` counting this one (each poll comes one
    *ShadowHeartbeatTimeoutInterval* after the last).

    A state change (the primary is back with a new queue database) promotes rank 1 at once, the
    others by ``state_change_rank`` in the heartbeats that follow. A heartbeat failure promotes
    up to ``promotable_rank``.
    """
    if ok and recorded_dbid and answered_dbid and recorded_dbid != answered_dbid:
        return HeartbeatDecision(True, "ShadowStateChange", 1)
    if ok:
        return HeartbeatDecision(False)
    rank = promotable_rank(unreachable_for=unreachable_for, resubmit_time_span=resubmit_time_span,
                           rank_delay=rank_delay, failures=failures, retry_count=retry_count)
    if rank >= 1:
        return HeartbeatDecision(True, "ShadowHeartbeatFailure", rank)
    return HeartbeatDecision(False)


def heartbeat_period(sr: Any) -> float:
    """Seconds between two polls of a primary: *ShadowHeartbeatFrequency* (2013) or
    *ShadowHeartbeatTimeoutInterval* (2010)."""
    return sr.shadow_heartbeat_timeout_interval if sr.version == "2010" else sr.shadow_heartbeat_frequency


def unreachable_since(*, previous: float | None, last_ok: float | None, now: float,
                      heartbeat_frequency: float, exchange_limit: float) -> float:
    """When a primary that just failed a heartbeat was last known alive.

    Already failing: unchanged. A first failure counts from the last success when that was the
    previous round (the primary went quiet since then), else from now (no recent success to go by:
    the shadow was made by a primary seen only through XSHADOWREQUEST)."""
    if previous is not None:
        return previous
    if last_ok is not None and now - last_ok <= 2 * heartbeat_frequency + exchange_limit:
        return last_ok
    return now


def parse_resubmit_arg(arg: str | None) -> tuple[str, float, float]:
    """``XRESUBMIT <destination> <start epoch> <end epoch>`` arguments; ValueError when malformed."""
    parts = (arg or "").split()
    if len(parts) != 3:
        raise ValueError("XRESUBMIT needs <destination> <start> <end>")
    start, end = float(parts[1]), float(parts[2])
    if not (math.isfinite(start) and math.isfinite(end)) or end < start:
        raise ValueError("bad time window")
    return parts[0], start, end
