"""Header fields of a message as received: the one parser every layer reads a header with.

It owns splitting the header block from the body, reading Message-ID, Date and
Subject (raw, so UTF-8 survives; the Subject's encoded-words decoded), the network message id a primary wrote into
its Received field, and the hop count (Received fields of the header block only:
a forwarded message's own Received lines are body). It never changes a message.

A header section may be 256 KB (frontend.max_header_size) and one field all of it, and the email
package's readers cost far more than the field on hostile input (the Subject's header_factory ~6 KB
of memory an octet, getaddresses tens of microseconds a character, on the event loop): a Subject is
read from its first ``SUBJECT_LIMIT`` characters and an address field from its first
``ADDRESS_FIELD_LIMIT``, so no field costs more than a few milliseconds and megabytes.
"""

from __future__ import annotations

import email.policy
import email.utils
import re
import unicodedata
from datetime import UTC, datetime
from email.parser import BytesHeaderParser
from email.policy import compat32

_HEADER_END = re.compile(rb"\r?\n\r?\n")

SUBJECT_LIMIT = 4096
"""Characters of a Subject (unfolded) that are read: the rest is dropped before its encoded-words
are decoded. The queue keeps 500 of them and a DSN shows 200, so an ordinary Subject is whole."""

ADDRESS_FIELD_LIMIT = 2048
"""Characters of a Sender or From field (unfolded) the author is looked for in: an address is at
most 320 (RFC 5321 4.5.3.1), so the first mailbox of an ordinary field is in them."""


_FOLD = re.compile(r"\r?\n(?=[ \t])")


def split_headers(data: bytes) -> tuple[bytes, bytes]:
    m = _HEADER_END.search(data)
    if not m:
        return data, b""
    return data[:m.end()], data[m.end():]


def header_size(data: bytes) -> int:
    """Octets of the header section (up to and with the empty line that ends it; all of ``data``
    where no empty line ends it)."""
    m = _HEADER_END.search(data)
    return m.end() if m else len(data)


def _header_text(value: object) -> str:
    """A header value as text: raw UTF-8 (RFC 6532) decoded, undecodable octets replaced.

    The compat32 parser keeps 8-bit octets as surrogate escapes, which no database or log
    line can store; they are turned back into the UTF-8 the sender wrote."""
    text = str(value or "").strip()
    if not text.isascii():
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return text


_FIELD_NAME = re.compile(r"[!-9;-~]+:")
"""A field name as the email package's header lines start (printable, no colon, no blank), then ':'."""


def plain_fields(block: bytes) -> list[tuple[str, str]] | None:
    """(name, raw value) of every field of a header block in its common form, as the email
    package's compat32 ``raw_items()`` gives them, read without it (a fraction of its cost); None
    for any other form (no CRLF CRLF end, a bare CR or LF, a first line that is a continuation, a
    line that is not a field: a ``From `` line, a blank before the colon...), which the email
    package reads. tests/test_headers_contract.py compares both."""
    if not block.endswith(b"\r\n\r\n"):
        return None
    text = block[:-4].decode("ascii", "surrogateescape")
    lines = text.split("\r\n")
    if text.count("\r") != len(lines) - 1 or text.count("\n") != len(lines) - 1:
        return None  # a bare CR or LF: the email package splits lines there too
    fields: list[tuple[str, list[str]]] = []
    match = _FIELD_NAME.match
    for line in lines:
        if line[:1] in (" ", "\t"):
            if not fields:
                return None
            fields[-1][1].append(line)
        elif match(line):
            name, value = line.split(":", 1)
            fields.append((name, [value.lstrip(" \t")]))
        else:
            return None
    return [(name, "\r\n".join(parts).rstrip("\r\n")) for name, parts in fields]


def _raw_items(block: bytes) -> list[tuple[str, str]]:
    items = plain_fields(block)
    if items is None:  # raw: get() would turn 8-bit octets into U+FFFD
        items = BytesHeaderParser(policy=compat32).parsebytes(block).raw_items()
    return items


def header_fields(data: bytes) -> tuple[str, str, str, str]:
    """(Message-ID, Date, Subject, author) of a message, as text ("" when absent; the first of
    each); the Subject's RFC 2047 encoded-words decoded, as Exchange's tracking logs and queue
    viewer show it; the author is ``author_address`` of its Sender and From fields. Pure."""
    found: dict[str, str] = {}
    for name, value in _raw_items(split_headers(data)[0]):
        found.setdefault(name.lower(), value)
    message_id, date, subject, sender, from_ = (_header_text(_FOLD.sub("", found.get(k, "")))  # unfolded (RFC 5322 2.2.3)
                                                for k in ("message-id", "date", "subject", "sender", "from"))
    return message_id, date, decoded_subject(subject), author_address(sender, from_)


def author_address(sender: str, from_: str) -> str:
    """The address MSGTRK's sender-address names: the ``Sender:`` field's mailbox, else the first
    of ``From:`` (RFC 5322 3.6.2), as an addr-spec; "" when neither holds one (a null ``<>``, a
    group with no member, text that is no address). At most 320 characters. Pure."""
    for value in (sender, from_):
        for _, address in _addresses(value):
            if "@" in address and len(address) <= 320 and not any(ch in address for ch in " \t\r\n<>,"):
                return address
    return ""


def _last_top_level_comma(text: str) -> int:
    """Where the last comma of ``text`` between two addresses is (outside a quoted string, a
    comment and angle brackets), or -1."""
    last, quoted, comments, angle, escaped = -1, False, 0, False, False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\" and (quoted or comments):
            escaped = True
        elif quoted:
            quoted = ch != '"'
        elif ch == '"':
            quoted = True
        elif ch == "(":
            comments += 1
        elif ch == ")" and comments:
            comments -= 1
        elif comments:
            continue
        elif ch in "<>":
            angle = ch == "<"
        elif ch == "," and not angle:
            last = i
    return last


def _addresses(value: str) -> list[tuple[str, str]]:
    """The mailboxes of an address field; of a field over ``ADDRESS_FIELD_LIMIT``, those wholly in
    its first ``ADDRESS_FIELD_LIMIT`` characters: cut at the last comma between two addresses there
    (a cut inside a quoted name or a comment would fail the whole parse), else where the limit
    falls, the last mailbox read then dropped (it may be cut)."""
    cut = len(value) > ADDRESS_FIELD_LIMIT
    value = value[:ADDRESS_FIELD_LIMIT]
    if cut and (comma := _last_top_level_comma(value)) > 0:
        value, cut = value[:comma], False
    if "@" not in value:
        return []
    try:
        found = email.utils.getaddresses([value])
    except Exception:  # noqa: BLE001 - the email package has failed on hostile input: none read
        return []
    return found[:-1] if cut else found


def _first_characters(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, at its last blank in them where there is one
    in their second half (so an encoded-word is not split)."""
    if len(text) <= limit:
        return text
    text = text[:limit]
    blank = max(text.rfind(" "), text.rfind("\t"))
    return (text[:blank] if blank > limit // 2 else text).rstrip()


def decoded_subject(text: str) -> str:
    """A Subject with encoded-words (``=?UTF-8?B?...?=``, RFC 2047) as the text they stand for, on
    one line (a control character an encoded-word carried becomes a space); as it is when it holds
    none, or when the email package cannot read them. Only its first ``SUBJECT_LIMIT`` characters
    are read (cut at a blank)."""
    text = _first_characters(text, SUBJECT_LIMIT)
    if "=?" not in text:
        return text
    try:
        decoded = str(email.policy.default.header_factory("Subject", text))
    except Exception:  # noqa: BLE001 - the email package has failed on hostile input: keep it as sent
        return text
    return "".join(" " if unicodedata.category(ch) in ("Cc", "Zl", "Zp") or 0xD800 <= ord(ch) <= 0xDFFF
                   else ch for ch in decoded).strip()


# any protocol of RFC 3848 / RFC 6531 (SMTP, ESMTPSA, UTF8SMTPS, ...)
_NETWORK_ID = re.compile(rb"\) with [A-Za-z0-9-]+ id ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12});")


def network_id_from(data: bytes) -> str | None:
    """The network-message-id a transportd node wrote in its Received field ('with ESMTP id <guid>',
    or any other protocol name)."""
    m = _NETWORK_ID.search(split_headers(data[:65536])[0][:4096])
    return m.group(1).decode("ascii") if m else None


_RECEIVED = re.compile(rb"^received:", re.IGNORECASE | re.MULTILINE)


def hop_count(data: bytes) -> int:
    """How many Received fields the header block holds (RFC 5321 6.3 loop detection)."""
    return len(_RECEIVED.findall(split_headers(data)[0]))


def field_value(data: bytes, name: str) -> str:
    """The first ``name`` field of the header block, unfolded, as text ("" when absent)."""
    for key, value in _raw_items(split_headers(data)[0]):
        if key.lower() == name.lower():
            return _header_text(_FOLD.sub("", value))
    return ""


def rfc5322_date(when: float | datetime) -> str:
    """A date-time for a header field, ``Thu, 26 Nov 2026 17:20:05 +0000``: a Unix time, or a
    datetime (naive means UTC). The zone is numeric (RFC 5322 3.3): "GMT" is the obsolete form a
    generator must not write (section 4)."""
    dt = datetime.fromtimestamp(when, UTC) if isinstance(when, (int, float)) else when
    return email.utils.format_datetime(dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt)
