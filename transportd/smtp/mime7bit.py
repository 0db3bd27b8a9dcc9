"""Downgrading a message to 7 bit for a next hop without 8BITMIME (RFC 6152, RFC 2045/2046).

This module owns the body conversion an MTA must make before it relays a message
with 8-bit content to a server that did not advertise 8BITMIME, the way Postfix
does it: :func:`to_7bit` walks the MIME structure (``multipart/*`` recursively,
``message/rfc822`` encapsulations included) and re-encodes every leaf part whose
content is not valid 7bit data (an octet >= 0x80, a NUL, or a line over 998
octets). It also answers two questions about raw messages: :func:`is_7bit` and
:func:`needs_smtputf8_headers` (RFC 6531/6532: UTF-8 in the header block).

What a conversion changes, and nothing else:

- a converted ``text/*`` leaf becomes ``quoted-printable``: lines of at most 76
  characters with soft breaks, ``=`` escaped, whitespace before a line break
  encoded, the text's CRLF line breaks kept as real line breaks (bare CR and LF,
  which are data, become ``=0D``/``=0A``);
- a converted leaf of any other type (``application/*``, ``image/*``, unknown
  types) becomes ``base64``: binary data is not text, and base64 is compact and
  exact for it;
- the RFC 6532/6533 types that may carry an encoding (``message/global``,
  ``message/global-headers``, ``message/global-delivery-status``, and an
  8-bit ``message/delivery-status``) are leaves converted as text;
- ``message/rfc822`` (and any other ``message/*``) may not be encoded (RFC 2046
  5.2.1), so the encapsulated message is converted part by part and the
  entity's ``8bit``/``binary`` Content-Transfer-Encoding becomes ``7bit``; the
  same holds for a ``multipart/*`` entity labelled ``8bit``/``binary``;
- only the Content-Transfer-Encoding field of a converted entity is rewritten
  (a second one is dropped); the message itself gets ``MIME-Version: 1.0`` if
  it had none and, when its body is a converted text without a Content-Type,
  ``Content-Type: text/plain; charset=utf-8`` (``charset=unknown-8bit``, RFC
  1428 style, when the body is not UTF-8);
- a multipart preamble or epilogue (content that MIME readers ignore, RFC 2046
  5.1.1) keeps its bytes unless they hold 8-bit octets, NULs or over-long
  lines: those octets become ``?`` and such lines are broken.

Everything else is kept byte for byte: every header (no refolding, no
re-encoding, order kept), every boundary line, and every part that is already
7-bit clean, ``base64`` or ``quoted-printable``. A part labelled ``base64`` or
``quoted-printable`` that nevertheless holds 8-bit octets (malformed) is decoded
the way Python's email package decodes it and encoded again. The structure is
read the way Python's email package reads it (``policy.default``), so each
part's decoded content (``get_payload(decode=True)``) is exactly the same
before and after the conversion; in time linear in the message: the email
package's header parser, whose time grows with the square of a field, is given
at most 4 KB a field and 32 KB a message (``_head_info``), and a multipart whose
fields it is not given is encoded as one text part (nothing of it is lost).

Pure functions on bytes, no I/O. It never raises on malformed input (worst
case the body is encoded as one text part), never touches an address, and
never changes 8-bit octets in a header: a message with a UTF-8 header block
needs SMTPUTF8 (RFC 6532), which is the caller's decision
(:func:`transportd.smtp.envelope.plan_send`). Nesting deeper than 50 levels is
encoded as one text part.
"""

from __future__ import annotations

import base64
import binascii
import email.message
import email.parser
import email.policy
import re

__all__ = ["is_7bit", "needs_smtputf8_headers", "to_7bit"]

_MAX_LINE = 998  # RFC 5322 2.1.1 / RFC 2045 2.7, excluding CRLF
_QP_LINE = 76  # RFC 2045 6.7 (5)
_MAX_DEPTH = 50

# Lines as Python's email parser cracks them: CRLF, CR or LF ends a line.
_LINE_RE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)?")
# email.feedparser.headerRE: a header, an mbox "From " line or a continuation.
_HEADER_LINE_RE = re.compile(rb"From |[\x21-\x39\x3b-\x7e]*:|[\t ]")
_BLANK_LINES = (b"\r\n", b"\n", b"\r")
_FIRST_BLANK_LINE_RE = re.compile(rb"(?:\A|\n)\r?\n")
_NOT_7BIT_RE = re.compile(rb"[\x00\x80-\xff]")
# A line end, kept by split: text, line end, text, ... Lines are measured by splitting, never by a
# search for 999 non-line-end octets, which tries every position of a line (time ~ length x 999:
# seconds per MB of long lines, all of it in one C call that holds the GIL, so the node's event
# loop stood still meanwhile although the conversion runs in a worker thread).
_EOL_SPLIT_RE = re.compile(rb"(\r\n|\r|\n)")
_SOFT_BREAK_RE = re.compile(rb"=\r?\n")
_HARD_BREAK = b"=0D=0A"  # CRLF as binascii.b2a_qp(istext=False) writes it

# message/* types that RFC 6532/6533 let carry quoted-printable/base64 (and an 8-bit
# delivery-status, which RFC 3464 never allowed): converted as text leaves.
_ENCODABLE_MESSAGE = frozenset(
    {
        "message/global",
        "message/global-headers",
        "message/global-delivery-status",
        "message/delivery-status",
    }
)
_DECODED_CTES = frozenset({"quoted-printable", "base64", "x-uuencode", "uuencode", "uue", "x-uue"})
_HEAD_POLICY = email.policy.default
# What of a message's Content-Type and Content-Transfer-Encoding fields the email package's header
# parser reads (_ParseBudget), in octets: the longest field, and all of them together. A real
# one that is not read without it (a multipart's, one with comments) is some 100 octets.
_MAX_PARSED_FIELD = 4096
_PARSE_BUDGET = 32768
_TOKEN = r"[!#$%&'*+\-.^_`{|}~0-9A-Za-z]+"  # RFC 2045 token: no tspecials, no encoded-word
_TOKEN_RE = re.compile(_TOKEN)
_PLAIN_TYPE_RE = re.compile(rf"[ \t]*({_TOKEN}/{_TOKEN})[ \t]*(?:;|\Z)")
_BREAK_RE = re.compile(r"[\r\n]")


def is_7bit(data: bytes) -> bool:
    """True when ``data`` has no octet >= 0x80 and no NUL (line length is not checked)."""
    return data.isascii() and b"\0" not in data


def needs_smtputf8_headers(data: bytes) -> bool:
    """True when the header block (up to the first empty line; all of ``data`` when it
    has none) holds an octet >= 0x80: such a message can only be relayed with SMTPUTF8
    (RFC 6532), or not at all."""
    match = _FIRST_BLANK_LINE_RE.search(data)
    head = data if match is None else data[: match.start()]
    return not head.isascii()


def to_7bit(data: bytes) -> bytes:
    """Return ``data`` (RFC 5322 bytes, CRLF line ends) with every part that is not 7-bit
    clean re-encoded as described in the module docstring.

    A message that needs no conversion is returned unchanged. The result's lines are at
    most 998 octets (a header line is kept as it is) and it is pure ASCII unless a header
    holds 8-bit octets. Never raises.
    """
    data = bytes(data)
    try:
        return _entity(
            data, "text/plain", at_eof=True, in_multipart=False, depth=0, top=True,
            budget=_ParseBudget(),
        )
    except Exception:  # noqa: BLE001 - never raise: fall back to one text part
        try:
            return _flat(data)
        except Exception:  # noqa: BLE001
            return data


# --------------------------------------------------------------------------- structure


def _entity(
    data: bytes, default_type: str, *, at_eof: bool, in_multipart: bool, depth: int, top: bool,
    budget: _ParseBudget,
) -> bytes:
    """Convert one entity (header block + body).

    ``at_eof``: the entity runs to the end of the whole message (it was not cut before a
    boundary line); ``in_multipart``: it lies inside a multipart. Python's parser takes one
    line end off the last leaf of a multipart that runs to the end of the message; the
    conversion must keep that line end out of the encoded content.
    """
    head, sep, body = _split_head(data)
    if not _needs_work(body):
        return data
    ctype, boundary, cte = _head_info(head, default_type, budget)
    if depth < _MAX_DEPTH:
        if ctype.startswith("multipart/"):
            result = None
            if boundary is not None:
                result = _multipart(body, boundary, ctype, at_eof=at_eof, depth=depth, budget=budget)
                if isinstance(result, bytes):
                    return _container(head, sep, body, result, cte, top=top)
            # No boundary, or no start boundary: the parser keeps the body as one payload,
            # up to a close delimiter (what follows that is ignored).
            return _leaf(
                head, sep, body, cte, text=True, strip=False, at_eof=at_eof, top=top,
                close_at=result,
            )
        if ctype.startswith("message/") and ctype not in _ENCODABLE_MESSAGE:
            inner = _entity(  # an encapsulated message is a message: top=True
                body, "text/plain", at_eof=at_eof, in_multipart=in_multipart, depth=depth + 1,
                top=True, budget=budget,
            )
            return _container(head, sep, body, inner, cte, top=top)
    text = (
        ctype.startswith("text/")
        or ctype in _ENCODABLE_MESSAGE
        or ctype.startswith(("multipart/", "message/"))  # only past _MAX_DEPTH
    )
    return _leaf(
        head, sep, body, cte, text=text, strip=at_eof and in_multipart, at_eof=at_eof, top=top
    )


def _multipart(
    body: bytes, boundary: str, ctype: str, *, at_eof: bool, depth: int, budget: _ParseBudget
) -> bytes | int | None:
    """The converted body of a multipart. When the parser would find no start boundary
    (the body is then one payload): None, or the offset of the close delimiter that ends
    that payload when there is one. Mirrors email.feedparser: repeated boundary lines
    make no empty parts, a close delimiter ends the parts, the line end before a
    boundary line belongs to the boundary."""
    if not boundary.isascii():
        return None  # a decoded non-ASCII boundary never matches a line
    delimiter = re.compile(
        rb"(?<![^\r\n])" + re.escape(b"--" + boundary.encode("ascii"))
        + rb"(--)?[ \t]*(?:\r\n|\r|\n|\Z)"
    )
    marks = list(delimiter.finditer(body))
    if not marks:
        return None
    if marks[0].group(1):
        return marks[0].start()
    default_type = "message/rfc822" if ctype == "multipart/digest" else "text/plain"
    out = [_sanitize_ignored(body[: marks[0].start()])]
    i = 0
    while True:
        j = i
        while j + 1 < len(marks) and marks[j + 1].start() == marks[j].end():
            j += 1
        out.append(body[marks[i].start() : marks[j].end()])
        start = marks[j].end()
        if j + 1 == len(marks):  # no close delimiter: the last part runs to the end
            out.append(
                _entity(
                    body[start:], default_type, at_eof=at_eof, in_multipart=True,
                    depth=depth + 1, top=False, budget=budget,
                )
            )
            return b"".join(out)
        nxt = marks[j + 1]
        chunk = body[start : nxt.start()]
        n = _eol_len(chunk)
        part, eol = (chunk[:-n], chunk[-n:]) if n else (chunk, b"")
        out.append(
            _entity(
                part, default_type, at_eof=False, in_multipart=True, depth=depth + 1, top=False,
                budget=budget,
            )
        )
        out.append(eol)
        if nxt.group(1):
            out.append(body[nxt.start() : nxt.end()])
            out.append(_sanitize_ignored(body[nxt.end() :]))
            return b"".join(out)
        i = j + 1


def _container(
    head: bytes, sep: bytes, body: bytes, new_body: bytes, cte: str, *, top: bool
) -> bytes:
    """A multipart or message/* entity around converted content: an 8bit/binary label
    becomes 7bit when the content now is 7-bit."""
    if new_body == body:
        return head + sep + body
    if cte.strip() in ("8bit", "binary") and is_7bit(new_body):
        head = _set_cte(head, b"7bit")
    if top and not _has_field(head, b"mime-version"):
        head = _append_field(head, b"MIME-Version: 1.0")
    return head + (sep or b"\r\n") + new_body


def _leaf(
    head: bytes, sep: bytes, body: bytes, cte: str, *, text: bool, strip: bool, at_eof: bool,
    top: bool, close_at: int | None = None,
) -> bytes:
    """Encode one payload. ``strip``: the parser takes the body's last line end off the
    payload. ``close_at``: the payload ends at this close delimiter, which must stay at
    the start of a line (what follows it is ignored content)."""
    ignored = b""
    if close_at is not None:
        body, ignored = body[:close_at], _sanitize_ignored(body[close_at:])
    n = _eol_len(body) if strip or close_at is not None else 0
    content, eol = (body[:-n], body[-n:]) if n else (body, b"")
    if not _needs_work(content):
        return head + sep + body + ignored
    if strip:
        decoded = _decode(cte, content)
    else:  # the line end is part of the payload but is kept as a real line end
        decoded = _decode(cte, body)
        if eol and decoded.endswith(eol):
            decoded = decoded[:-n]
        elif eol:
            eol = b"\r\n"  # a decoded payload without that line end: best effort
    if text:
        encoded, new_cte = _qp_text(decoded), b"quoted-printable"
    else:
        encoded, new_cte = _base64(decoded), b"base64"
        if at_eof and not eol:
            encoded += b"\r\n"
    if top:
        if not _has_field(head, b"mime-version"):
            head = _append_field(head, b"MIME-Version: 1.0")
        if text and not _has_field(head, b"content-type"):
            head = _append_field(head, b"Content-Type: text/plain; charset=" + _charset(decoded))
    head = _set_cte(head, new_cte)
    return head + (sep or b"\r\n") + encoded + eol + ignored


def _flat(data: bytes) -> bytes:
    """The last resort: the whole body as one quoted-printable text."""
    head, sep, body = _split_head(data)
    if not _needs_work(body):
        return data
    if not _has_field(head, b"mime-version"):
        head = _append_field(head, b"MIME-Version: 1.0")
    if not _has_field(head, b"content-type"):
        head = _append_field(head, b"Content-Type: text/plain; charset=" + _charset(body))
    head = _set_cte(head, b"quoted-printable")
    return head + (sep or b"\r\n") + _qp_text(body)


# --------------------------------------------------------------------------- headers


def _split_head(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(header block, blank separator line, body) as email.feedparser splits them: the
    header block ends at the first line that is not a header line; when that line is not
    blank it begins the body and the separator is b"". An mbox "From " line that is the
    last of several header lines begins the body, and the blank line after it is lost."""
    pos, n, last = 0, len(data), -1
    head, sep, body = data, b"", b""
    while pos < n:
        match = _LINE_RE.match(data, pos)
        line = match.group()
        if not _HEADER_LINE_RE.match(line):
            if line in _BLANK_LINES:
                head, sep, body = data[:pos], line, data[match.end() :]
            else:
                head, sep, body = data[:pos], b"", data[pos:]
            break
        last, pos = pos, match.end()
    if last > 0 and head.startswith(b"From ", last):
        return head[:last], b"", head[last:] + body
    return head, sep, body


def _fields(head: bytes) -> list[tuple[int, int, bytes]]:
    """(start, end, lower-case name) of each field of a header block, continuation lines
    included; mbox "From " lines and lines with no field name are not fields."""
    fields: list[tuple[int, int, bytes]] = []
    current: list | None = None
    pos, n = 0, len(head)
    while pos < n:
        match = _LINE_RE.match(head, pos)
        line, end = match.group(), match.end()
        if line[:1] in (b" ", b"\t"):
            if current is not None:
                current[1] = end
        else:
            if current is not None:
                fields.append((current[0], current[1], current[2]))
                current = None
            colon = line.find(b":")
            if colon > 0 and not line.startswith(b"From "):
                current = [pos, end, line[:colon].lower()]
        pos = end
    if current is not None:
        fields.append((current[0], current[1], current[2]))
    return fields


def _has_field(head: bytes, name: bytes) -> bool:
    return any(field_name == name for _, _, field_name in _fields(head))


def _append_field(head: bytes, field: bytes) -> bytes:
    if head and not head.endswith((b"\n", b"\r")):
        head += b"\r\n"
    return head + field + b"\r\n"


def _set_cte(head: bytes, value: bytes) -> bytes:
    """The header block with its (first) Content-Transfer-Encoding field replaced, any
    further one dropped, or one appended when there was none."""
    field = b"Content-Transfer-Encoding: " + value
    spans = [(s, e) for s, e, name in _fields(head) if name == b"content-transfer-encoding"]
    if not spans:
        return _append_field(head, field)
    out, prev = [], 0
    for k, (start, end) in enumerate(spans):
        out.append(head[prev:start])
        if k == 0:
            n = _eol_len(head[start:end])
            out.append(field + (head[end - n : end] if n else b"\r\n"))
        prev = end
    out.append(head[prev:])
    return b"".join(out)


class _ParseBudget:
    """The octets of header fields one conversion may still give the email package's header
    parser, whose time grows faster than the length it reads (a Content-Type of 8 KB with many
    parameters takes half a second, one of 30 KB of encoded-words one second): a message of
    many parts with such fields must not buy minutes of it."""

    def __init__(self, octets: int = _PARSE_BUDGET):
        self.left = octets

    def take(self, field: bytes) -> bool:
        """True (and the field's length spent) when ``field`` may be parsed."""
        if len(field) > min(self.left, _MAX_PARSED_FIELD):
            return False
        self.left -= len(field)
        return True


def _head_info(head: bytes, default_type: str, budget: _ParseBudget) -> tuple[str, str | None, str]:
    """(content type, boundary or None, lower-case Content-Transfer-Encoding) as the email
    package (policy.default) reads them.

    Only the two fields that say them are read (the first of each, as the email package does),
    in linear time where they are plain: a ``type/subtype`` token pair as it is (the
    parameters matter only to a multipart, for its boundary), a Content-Transfer-Encoding of
    one token as it is. Anything else goes through the email package's header parser if
    ``budget`` allows; a field it does not is not read: a multipart's parameters, or a
    Content-Type that is no plain type, make the entity one text payload, the worst case the
    module allows (what it holds is still there, encoded); a Content-Transfer-Encoding
    counts as none (the content is taken as it is)."""
    ctype_field = cte_field = None
    for start, end, name in _fields(head):
        if name == b"content-type" and ctype_field is None:
            ctype_field = head[start:end]
        elif name == b"content-transfer-encoding" and cte_field is None:
            cte_field = head[start:end]
    try:
        ctype, boundary = _content_type(ctype_field, default_type, budget)
        cte = "" if cte_field is None else _transfer_encoding(cte_field, budget)
    except Exception:  # noqa: BLE001 - the email package has crashed on hostile input
        return default_type, None, ""
    return ctype, boundary, cte


def _content_type(field: bytes | None, default_type: str, budget: _ParseBudget) -> tuple[str, str | None]:
    if field is None:
        return default_type, None
    plain = _PLAIN_TYPE_RE.match(_field_value(field))
    if plain is not None:
        ctype = plain.group(1).lower()
        if not ctype.startswith("multipart/") or not budget.take(field):
            return ctype, None
    elif not budget.take(field):
        return "text/plain", None
    # The value as policy.default makes it (encoded-words decoded, RFC 2231 sections joined),
    # read as the email package's Message reads a Content-Type value.
    msg = email.message.Message()
    msg.set_default_type(default_type)
    msg["Content-Type"] = str(_parsed_field(field, "content-type"))
    ctype = msg.get_content_type()
    return ctype, msg.get_boundary() if ctype.startswith("multipart/") else None


def _transfer_encoding(field: bytes, budget: _ParseBudget) -> str:
    value = _field_value(field)
    if _TOKEN_RE.fullmatch(value):
        return value.lower()
    if not budget.take(field):
        return ""
    return str(_parsed_field(field, "content-transfer-encoding")).lower()


def _field_value(field: bytes) -> str:
    """A field's value as the email package gives it to its header parser: octets as surrogate
    escapes, the blanks after the colon dropped, line breaks taken out (unfolded)."""
    value = field.decode("ascii", "surrogateescape").split(":", 1)[1]
    return _BREAK_RE.sub("", value.lstrip(" \t"))


def _parsed_field(field: bytes, name: str) -> object:
    """One field (its lines) parsed by the email package with policy.default."""
    return email.parser.BytesHeaderParser(policy=_HEAD_POLICY).parsebytes(field).get(name, "")


# --------------------------------------------------------------------------- encoding


def _has_long_line(data: bytes) -> bool:
    """A line over 998 octets (a CR, an LF or CRLF ends one), in time linear in ``data``."""
    return len(data) > _MAX_LINE and max(map(len, data.replace(b"\r", b"\n").split(b"\n"))) > _MAX_LINE


def _needs_work(data: bytes) -> bool:
    return not data.isascii() or b"\x00" in data or _has_long_line(data)


def _eol_len(data: bytes) -> int:
    if data.endswith(b"\r\n"):
        return 2
    return 1 if data.endswith((b"\r", b"\n")) else 0


def _charset(data: bytes) -> bytes:
    if data.isascii():
        return b"us-ascii"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return b"unknown-8bit"
    return b"utf-8"


def _decode(cte: str, content: bytes) -> bytes:
    """The content as Python's email package decodes it (get_payload(decode=True))."""
    if cte in _DECODED_CTES:
        try:
            msg = email.message.Message()
            msg["Content-Transfer-Encoding"] = cte
            msg.set_payload(content.decode("ascii", "surrogateescape"))
            decoded = msg.get_payload(decode=True)
            if isinstance(decoded, bytes):
                return decoded
        except Exception:  # noqa: BLE001, S110 - keep the raw bytes
            pass
    return content


def _qp_text(data: bytes) -> bytes:
    """RFC 2045 quoted-printable with CRLF line ends: CRLF in ``data`` stays a real line
    break, a bare CR or LF is data (``=0D``/``=0A``)."""
    encoded = binascii.b2a_qp(data, quotetabs=False, istext=False, header=False)
    encoded = _SOFT_BREAK_RE.sub(b"", encoded)  # every CR and LF of the data is escaped
    out: list[bytes] = []
    for line in encoded.split(_HARD_BREAK):
        if line.endswith(b" "):
            line = line[:-1] + b"=20"
        elif line.endswith(b"\t"):
            line = line[:-1] + b"=09"
        if len(line) <= _QP_LINE:
            out.append(line)
        else:
            _wrap(line, out)
    return b"\r\n".join(out)


def _wrap(line: bytes, out: list[bytes]) -> None:
    """Split one encoded line with soft breaks into lines of at most 76 characters, never
    inside an ``=XX`` escape. A continuation line never begins with ``-``, so it can never
    look like a boundary line."""
    pos, n, first = 0, len(line), True
    while True:
        prefix = b""
        if not first and line[pos : pos + 1] == b"-":
            prefix, pos = b"=2D", pos + 1
        room = _QP_LINE - len(prefix)
        if n - pos <= room:
            out.append(prefix + line[pos:])
            return
        end = pos + room - 1  # one column for the "=" of the soft break
        escape = line.rfind(b"=", end - 2, end)
        if escape != -1:
            end = escape
        out.append(prefix + line[pos:end] + b"=")
        pos, first = end, False


def _base64(data: bytes) -> bytes:
    return base64.encodebytes(data).replace(b"\n", b"\r\n").removesuffix(b"\r\n")


def _sanitize_ignored(data: bytes) -> bytes:
    """A preamble or epilogue made 7-bit: 8-bit octets and NULs become "?", lines over
    998 octets are broken (the continuation begins with a space, never a boundary)."""
    if not _needs_work(data):
        return data
    data = _NOT_7BIT_RE.sub(b"?", data)

    def _break(run: bytes) -> bytes:
        step = _MAX_LINE - 1
        pieces = [run[:_MAX_LINE]]
        pieces.extend(b" " + run[i : i + step] for i in range(_MAX_LINE, len(run), step))
        return b"\r\n".join(pieces)

    parts = _EOL_SPLIT_RE.split(data)  # a line's text at every even index, its line end after it
    return b"".join(_break(part) if i % 2 == 0 and len(part) > _MAX_LINE else part for i, part in enumerate(parts))
