"""Header fields of a message as received: the one parser every layer reads a header with.

It owns splitting the header block from the body, reading Message-ID, Date and
Subject (raw, so UTF-8 survives), the network message id a primary wrote into
its Received field, and the hop count (Received fields of the header block only:
a forwarded message's own Received lines are body). It never changes a message.
"""

from __future__ import annotations

import re
from email.parser import BytesHeaderParser
from email.policy import compat32

_HEADER_END = re.compile(rb"\r?\n\r?\n")


_FOLD = re.compile(r"\r?\n(?=[ \t])")


def split_headers(data: bytes) -> tuple[bytes, bytes]:
    m = _HEADER_END.search(data)
    if not m:
        return data, b""
    return data[:m.end()], data[m.end():]


def _header_text(value: object) -> str:
    """A header value as text: raw UTF-8 (RFC 6532) decoded, undecodable octets replaced.

    The compat32 parser keeps 8-bit octets as surrogate escapes, which no database or log
    line can store; they are turned back into the UTF-8 the sender wrote."""
    text = str(value or "").strip()
    if not text.isascii():
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return text


def header_fields(data: bytes) -> tuple[str, str, str]:
    """(Message-ID, Date, Subject) of a message, as text ("" when absent; the first of each). Pure."""
    parsed = BytesHeaderParser(policy=compat32).parsebytes(split_headers(data)[0])
    found: dict[str, str] = {}
    for name, value in parsed.raw_items():  # raw: get() would turn 8-bit octets into U+FFFD
        found.setdefault(name.lower(), value)
    return tuple(_header_text(_FOLD.sub("", found.get(k, "")))  # unfolded (RFC 5322 2.2.3)
                 for k in ("message-id", "date", "subject"))  # type: ignore[return-value]


_NETWORK_ID = re.compile(rb"\) with ESMTPS? id ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12});")


def network_id_from(data: bytes) -> str | None:
    """The network-message-id a transportd node wrote in its Received field ('with ESMTP id <guid>')."""
    m = _NETWORK_ID.search(split_headers(data[:65536])[0][:4096])
    return m.group(1).decode("ascii") if m else None


_RECEIVED = re.compile(rb"^received:", re.IGNORECASE | re.MULTILINE)


def hop_count(data: bytes) -> int:
    """How many Received fields the header block holds (RFC 5321 6.3 loop detection)."""
    return len(_RECEIVED.findall(split_headers(data)[0]))


def field_value(data: bytes, name: str) -> str:
    """The first ``name`` field of the header block, unfolded, as text ("" when absent)."""
    parsed = BytesHeaderParser(policy=compat32).parsebytes(split_headers(data)[0])
    for key, value in parsed.raw_items():
        if key.lower() == name.lower():
            return _header_text(_FOLD.sub("", value))
    return ""
