"""Delivery status notifications (RFC 3464 / RFC 3461 / RFC 6522).

This module owns *building* DSN messages: given the facts about a message that
failed or was delayed (reporting MTA, envelope sender, per-recipient outcome,
the original message bytes), :func:`build_dsn` returns a complete
``multipart/report; report-type=delivery-status`` message as CRLF bytes, ready to
be queued for delivery to the original envelope sender. It never sends anything
and never decides *whether* a DSN is due (NOTIFY=, RET=, ENVID= policy is the
caller's); in particular the caller must never queue a DSN for a message whose
envelope sender was the null sender ``<>``, and :func:`build_dsn` refuses to
build one (``ValueError``). Transfer-encoding choice: the DSN is always 7-bit
clean (no ``8bit`` parts, lines <= 998 octets), so it can be relayed to any
server, with or without 8BITMIME. Content that cannot be sent as 7bit is made
so as follows: the human-readable part is ``quoted-printable`` UTF-8 when it is
not pure ASCII; the returned header block (``text/rfc822-headers``) is
``quoted-printable`` when it holds 8-bit octets, NULs or over-long lines (its
bytes are thus kept exactly); and because ``message/rfc822`` may not be
base64/QP encoded (RFC 2046), a ``include_body=True`` request for an original
that is not 7-bit clean falls back to returning only its headers (the
notification text says so). Non-ASCII *recipient* addresses are written with
the RFC 6533 ``utf-8`` address type in its 7-bit ``\\x{HEX}`` form. The one
exception to 7-bit cleanliness is a non-ASCII (SMTPUTF8) envelope sender or
postmaster address, which appears as UTF-8 in the ``To:``/``From:`` header:
such a DSN can only be relayed with SMTPUTF8 anyway, because its envelope
recipient is non-ASCII too.

With ``utf8=True`` it builds an internationalized DSN instead (RFC 6533, for a
message that came with SMTPUTF8; :func:`dsn_needs_utf8` says when): the
delivery status is ``message/global-delivery-status`` with non-ASCII addresses
as raw UTF-8 (``utf-8; jörg@example.de``) and UTF-8 diagnostic text; the
original comes back as ``message/global-headers`` (its header block, bytes kept)
or, for RET=FULL, ``message/global`` (RFC 6532); the notification text and the
Subject are raw UTF-8. Such a DSN carries ``8bit`` parts and UTF-8 headers, so it
must travel with SMTPUTF8 (and BODY=8BITMIME); it never needs a 7-bit fallback
except for content that is not valid 8bit data either (NUL octets, lines over
998 octets): the returned headers are then quoted-printable (RFC 6533 allows
it) and a RET=FULL original falls back to its headers.

:func:`downgrade_dsn` turns such a DSN back into the classic 7-bit one, for a next
hop without SMTPUTF8 on the way back to an ASCII sender (the caller is
``envelope.plan_send``).
"""

import binascii
import email.header
import email.policy
import email.utils
import re
import secrets
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from transportd.smtp.headers import decoded_subject, rfc5322_date

__all__ = ["RecipientReport", "build_dsn", "downgrade_dsn", "dsn_needs_utf8", "status_from_reply"]

#: RFC 3464 action values. ``failed`` and ``delayed`` are the ones transportd emits;
#: the success-type values are accepted for NOTIFY=SUCCESS reports.
ACTIONS = frozenset({"failed", "delayed", "delivered", "relayed", "expanded"})

_STATUS_RE = re.compile(r"[245]\.[0-9]{1,3}\.[0-9]{1,3}", re.ASCII)
_REPLY_PREFIX_RE = re.compile(r"^[0-9]{3}(?:[ -]|$)", re.ASCII)
_EOL_RE = re.compile(rb"\r\n|\r|\n")
_NOT_7BIT_RE = re.compile(rb"[\x00\x80-\xff]")
_NUL_RE = re.compile(rb"\x00")
_SUBJECT_RE = re.compile(rb"subject[ \t]*:", re.IGNORECASE)

_MAX_LINE = 998  # RFC 5322 2.1.1, excluding CRLF
_FOLD_WIDTH = 78
_MAX_LINE = 998  # RFC 5322 2.1.1: octets of a line, CRLF not counted
_MAX_SUBJECT_CHARS = 200
_SMTP_POLICY = email.policy.SMTP  # utf8=False: RFC 2047-encodes non-ASCII, CRLF line ends


@dataclass(frozen=True)
class RecipientReport:
    """The outcome for one recipient, rendered as one per-recipient DSN block."""

    address: str  # final recipient (rfc822;addr); surrounding <> are tolerated
    action: str = "failed"  # "failed" or "delayed" (any RFC 3464 action is accepted)
    status: str = "5.0.0"  # enhanced status code, e.g. "5.1.1", "4.4.7"
    diagnostic: str = ""  # the remote reply, e.g. "550 5.1.1 <x@y>: user unknown"; "" if none
    remote_mta: str = ""  # host name of the next hop that answered, "" when none
    last_attempt: datetime | None = None
    # RFC 3461 ORCPT value, already xtext-decoded, as "type;address" (e.g. "rfc822;a@b");
    # None when the client gave no ORCPT. Rendered as Original-Recipient.
    original_recipient: str | None = None
    # when the MTA gives up (the message expires); rendered for "delayed" only (RFC 3464 2.3.8)
    will_retry_until: datetime | None = None


def status_from_reply(code: int, text: str) -> str:
    """Return the enhanced status code (RFC 3463) for an SMTP reply.

    ``text`` is the reply text, with or without the leading reply code on each
    line (``"5.1.1 user unknown"``, ``"550-5.1.1 user unknown"``). The first
    whitespace-separated token matching ``^[245]\\.\\d{1,3}\\.\\d{1,3}$`` wins;
    if its class disagrees with the basic reply code (e.g. ``450`` with
    ``"5.2.2"``) the reply code's class is kept (``"4.2.2"``), since the basic code
    is what the client acts on. Without an enhanced code the class is derived
    from ``code``: 5xx -> ``"5.0.0"``, 2xx -> ``"2.0.0"``, anything else
    (4xx, or a code outside 2xx/4xx/5xx such as 0 for "no reply") -> ``"4.0.0"``.
    """
    klass = code // 100 if 100 <= code <= 599 else 0
    for line in text.splitlines():
        line = _REPLY_PREFIX_RE.sub("", line.strip(), count=1)
        for token in line.split():
            if _STATUS_RE.fullmatch(token):
                if klass in (2, 4, 5) and int(token[0]) != klass:
                    return f"{klass}{token[1:]}"
                return token
    if klass == 5:
        return "5.0.0"
    if klass == 2:
        return "2.0.0"
    return "4.0.0"


def dsn_needs_utf8(
    original_sender: str,
    recipients: Sequence[RecipientReport],
    original_message: bytes,
    received_smtputf8: bool,
) -> bool:
    """True when the DSN for this message should be an RFC 6533 internationalized one.

    That is when the original was received with the SMTPUTF8 MAIL parameter (so the
    sender's side speaks SMTPUTF8 and can take the DSN back) and it holds UTF-8: a
    non-ASCII envelope sender, recipient address (or ORCPT), or non-ASCII octets in
    its header block. The daemon uses it to choose between ``build_dsn(utf8=True)``
    (the DSN then travels with SMTPUTF8 and BODY=8BITMIME) and the classic 7-bit DSN.
    Pure; never raises on a malformed original.
    """
    if not received_smtputf8:
        return False
    addresses = [original_sender]
    for rcpt in recipients:
        addresses.append(rcpt.address)
        addresses.append(rcpt.original_recipient or "")
    if not all(address.isascii() for address in addresses):
        return True
    headers_lf = _header_block(_EOL_RE.sub(b"\n", bytes(original_message)))
    return not headers_lf.isascii()


def build_dsn(
    *,
    reporting_mta: str,
    original_sender: str,
    original_message: bytes,
    recipients: Sequence[RecipientReport],
    arrival_date: datetime,
    now: datetime,
    original_envelope_id: str | None = None,
    postmaster: str | None = None,
    include_body: bool = False,
    message_id_domain: str | None = None,
    utf8: bool = False,
) -> bytes:
    """Build a complete DSN message (RFC 5322 bytes, CRLF line endings).

    ``original_sender`` is the envelope sender (``MAIL FROM``) of the message
    being reported on, with or without angle brackets; the DSN goes to it.
    ``original_message`` is the message as queued; it may be malformed or
    8-bit and is never a reason to raise. ``original_envelope_id`` is the
    ENVID, already xtext-decoded. ``include_body`` is RET=FULL (see the module
    docstring for the 7-bit fallback). Naive datetimes are taken as UTC.
    ``utf8`` builds an RFC 6533 internationalized DSN (see the module docstring;
    :func:`dsn_needs_utf8` decides); ``False`` builds the classic 7-bit one.

    Raises ``ValueError`` for the null sender (``""``/``"<>"``), for an empty
    ``recipients``, for an unknown action or malformed status code, and for
    CR/LF/NUL in any value that ends up in a header or DSN field (the
    diagnostic text may be multi-line; it is unfolded).
    """
    sender = _bare_address(original_sender, "original_sender")
    if not sender:
        raise ValueError("refusing to build a DSN for the null sender <>")
    if not recipients:
        raise ValueError("a DSN needs at least one recipient")
    mta = _hostname(reporting_mta, "reporting_mta")
    for rcpt in recipients:
        _validate_recipient(rcpt)

    from_addr = f"MAILER-DAEMON@{mta}"
    if postmaster is not None:
        pm = _single_line(postmaster, "postmaster").strip()
        if "<" in pm:  # "Name <addr>" form: keep only the address
            pm = email.utils.parseaddr(pm)[1]
        pm = _bare_address(pm, "postmaster")
        if pm:
            from_addr = pm
    msgid_domain = mta
    if message_id_domain is not None and message_id_domain.strip():
        msgid_domain = _hostname(message_id_domain, "message_id_domain")
    envid = None
    if original_envelope_id is not None:
        # The sender's own identifier, spelled as sent (RFC 3464 2.2.1: case and spaces kept).
        envid = _field_text(_single_line(original_envelope_id, "original_envelope_id"), collapse=False)

    full_lf = _EOL_RE.sub(b"\n", bytes(original_message))
    headers_lf = _header_block(full_lf)
    subject = _original_subject(headers_lf)

    actions = {r.action for r in recipients}
    if actions == {"delayed"}:
        subject_prefix = "Delivery delayed: "
    elif "failed" in actions:
        subject_prefix = "Undeliverable: "
    else:
        subject_prefix = "Delivery status notification: "

    if utf8:
        return_full = include_body and _valid_8bit(full_lf)
    else:
        return_full = include_body and not _needs_encoding(full_lf)
    body_dropped = include_body and not return_full

    # Part 1: human-readable explanation.
    text = _human_text(mta, recipients, subject, arrival_date, return_full, body_dropped, utf8)
    if utf8:
        text_ct, text_cte, text_body = _encode_text_part_utf8(text.encode("utf-8"))
    else:
        text_ct, text_cte, text_body = _encode_text_part(text.encode("utf-8"))
    part1 = (
        f"Content-Type: {text_ct}\r\n"
        f"Content-Transfer-Encoding: {text_cte}\r\n"
        "Content-Description: Notification\r\n"
    ).encode("ascii")

    # Part 2: machine-readable delivery status.
    status_lines = [f"Reporting-MTA: dns; {_field_text(mta)}\r\n"]
    if envid and envid.strip():
        status_lines.append(_fold_field("Original-Envelope-Id", envid, fold=False))
    status_lines.append(f"Arrival-Date: {rfc5322_date(arrival_date)}\r\n")
    for rcpt in recipients:
        status_lines.append("\r\n")
        status_lines.extend(_recipient_block(rcpt, utf8))
    if utf8:
        status_body = "".join(status_lines).encode("utf-8")
        part2 = (
            "Content-Type: message/global-delivery-status\r\n"
            f"Content-Transfer-Encoding: {_cte_8bit(status_body)}\r\n"
            "Content-Description: Delivery report\r\n"
        ).encode("ascii")
    else:
        part2 = (
            "Content-Type: message/delivery-status\r\n"
            "Content-Transfer-Encoding: 7bit\r\n"
            "Content-Description: Delivery report\r\n"
        ).encode("ascii")
        status_body = "".join(status_lines).encode("ascii")

    # Part 3: the original (headers, or the whole message for RET=FULL).
    if utf8:
        part3, original_body = _original_part_utf8(full_lf, headers_lf, return_full)
    elif return_full:
        part3 = (
            "Content-Type: message/rfc822\r\n"
            "Content-Transfer-Encoding: 7bit\r\n"
            "Content-Description: Undelivered message\r\n"
        ).encode("ascii")
        original_body = full_lf.replace(b"\n", b"\r\n")
    else:
        if _needs_encoding(headers_lf):
            charset = "; charset=utf-8" if _is_utf8(headers_lf) else ""
            cte = "quoted-printable"
            original_body = _qp_crlf(headers_lf)
        else:
            charset = ""
            cte = "7bit"
            original_body = headers_lf.replace(b"\n", b"\r\n")
        part3 = (
            f"Content-Type: text/rfc822-headers{charset}\r\n"
            f"Content-Transfer-Encoding: {cte}\r\n"
            "Content-Description: Undelivered message headers\r\n"
        ).encode("ascii")

    parts = [(part1, text_body), (part2, status_body), (part3, original_body)]
    boundary = _pick_boundary([body for _, body in parts])
    full_subject = subject_prefix + (subject or "(no subject)")
    if utf8 and not full_subject.isascii():
        subject_header = _fold_field("Subject", full_subject).encode("utf-8")
    else:
        subject_header = _subject_header(full_subject)
    top_cte = b""
    if utf8 and any(b"Content-Transfer-Encoding: 8bit\r\n" in h for h, _ in parts):
        top_cte = b"Content-Transfer-Encoding: 8bit\r\n"

    head = b"".join(
        [
            _address_header("From", "Mail Delivery System", from_addr),
            _address_header("To", None, sender),
            subject_header,
            f"Date: {rfc5322_date(now)}\r\n".encode("ascii"),
            f"Message-ID: <{_date_utc(now):%Y%m%d%H%M%S}.{secrets.token_hex(8)}"
            f"@{msgid_domain}>\r\n".encode("ascii"),
            b"Auto-Submitted: auto-replied\r\n",
            b"MIME-Version: 1.0\r\n",
            f"Content-Type: multipart/report; report-type=delivery-status;\r\n"
            f' boundary="{boundary}"\r\n'.encode("ascii"),
            top_cte,
            b"\r\n",
            b"This is a MIME-encapsulated delivery status notification.\r\n",
        ]
    )
    out = [head]
    delimiter = f"\r\n--{boundary}\r\n".encode("ascii")
    for part_head, part_body in parts:
        out.append(delimiter)
        out.append(part_head)
        out.append(b"\r\n")
        out.append(part_body)
    out.append(f"\r\n--{boundary}--\r\n".encode("ascii"))
    return b"".join(out)


def downgrade_dsn(data: bytes) -> bytes | None:
    """The classic 7-bit DSN (RFC 3464) that says what the RFC 6533 DSN ``data`` says, or None.

    For a DSN to an ASCII address whose next hop does not offer SMTPUTF8: it may not be sent
    there as it is (RFC 6531 3.4), and a DSN that fails is reported to no one, so it goes as the
    DSN :func:`build_dsn` writes with ``utf8=False`` (RFC 6533 3: the 7-bit ``utf-8`` address
    form): ``message/global-delivery-status`` becomes ``message/delivery-status`` (non-ASCII
    addresses as ``utf-8; <utf-8-addr-xtext>``, other non-ASCII text as ``\\x{HEX}``),
    ``message/global-headers`` becomes ``text/rfc822-headers`` (quoted-printable where it holds
    8-bit octets, its bytes thus kept), ``message/global`` becomes ``message/rfc822`` where it is
    7-bit clean and else only its header block, the notification text saying so; a UTF-8 text
    part is quoted-printable, and a UTF-8 Subject RFC 2047-encoded. The Message-ID, the Date,
    the boundary and every ASCII line stay as they are. Built from the same facts, the result
    is the one :func:`build_dsn` would have built with ``utf8=False``, byte for byte.

    None when ``data`` is not a ``multipart/report; report-type=delivery-status`` with a
    ``message/global-delivery-status`` part, or holds UTF-8 that cannot be made 7-bit (a
    non-ASCII address in a header other than Subject, a part of another type that is not
    7-bit clean): the caller then treats it as any message the next hop cannot take. Pure;
    never raises.
    """
    try:
        return _downgrade_dsn(_EOL_RE.sub(b"\n", bytes(data)))
    except (ValueError, UnicodeError, binascii.Error):
        return None


def _downgrade_dsn(full_lf: bytes) -> bytes | None:
    head, sep, body = full_lf.partition(b"\n\n")
    if not sep:
        return None
    fields = _raw_fields(head + b"\n")
    content_type = next((f for f in fields if _field_name(f) == b"content-type"), b"").replace(b"\n", b"")
    boundary = _BOUNDARY_RE.search(content_type)
    if not (content_type.lower().startswith(b"content-type: multipart/report")
            and _REPORT_TYPE_RE.search(content_type.lower()) and boundary):
        return None
    marker = b"\n--" + (boundary.group(1) or boundary.group(2))
    split = _split_multipart(body, marker)
    if split is None:
        return None
    preamble, raw_parts, epilogue = split
    parts = []  # (content type, fields, decoded body)
    for raw in raw_parts:
        part_head, _, part_body = (b"", b"", raw[1:]) if raw.startswith(b"\n") else raw.partition(b"\n\n")
        part_fields = _raw_fields(part_head + b"\n" if part_head else b"")
        ctype = _field_value(part_fields, b"content-type").split(";")[0].strip().lower()
        parts.append((ctype, part_fields, part_body))
    if "message/global-delivery-status" not in [ctype for ctype, _, _ in parts]:
        return None
    # A returned message that is not 7-bit clean stays behind (only its headers come back), as
    # build_dsn does for RET=FULL without utf8; the notification text, the first part, says so.
    headers_only = any(ctype == "message/global" and _needs_encoding(_decoded(f, b)) for ctype, f, b in parts)
    out = []
    for index, (ctype, part_fields, part_body) in enumerate(parts):
        new = _downgraded_part(ctype, part_fields, part_body, note=headers_only and index == 0)
        if new is None:
            return None
        out.append(marker + b"\n" + b"".join(new[0]) + b"\n" + new[1])
    top = []
    for field in fields:
        name = _field_name(field)
        if name == b"content-transfer-encoding":
            continue  # every part is 7bit now, and so is the multipart (the default: no field)
        if not field.isascii():
            if name != b"subject":
                return None  # e.g. a UTF-8 address in To: (needs SMTPUTF8 whatever the body)
            text = field.split(b":", 1)[1].replace(b"\n", b"").decode("utf-8").strip()
            field = _subject_header(text).replace(b"\r\n", b"\n")
        top.append(field)
    dsn = b"".join(top) + b"\n" + preamble + b"".join(out) + marker + b"--" + epilogue
    if _needs_encoding(dsn):
        return None
    return dsn.replace(b"\n", b"\r\n")


_BOUNDARY_RE = re.compile(rb'boundary\s*=\s*(?:"([^"\n]+)"|([^\s;"]+))', re.IGNORECASE)
_REPORT_TYPE_RE = re.compile(rb'report-type\s*=\s*"?delivery-status"?(?:[\s;]|$)')
_HEX_ESCAPE_RE = re.compile(r"\\x\{([0-9A-Fa-f]{1,6})\}")


def _raw_fields(head_lf: bytes) -> list[bytes]:
    """A header block (LF line ends) as its fields, each with its continuation lines and LFs."""
    fields: list[bytes] = []
    for line in head_lf.splitlines(keepends=True):
        if line[:1] in (b" ", b"\t") and fields:
            fields[-1] += line
        else:
            fields.append(line)
    return fields


def _field_name(field: bytes) -> bytes:
    return field.split(b":", 1)[0].strip().lower()


def _field_value(fields: list[bytes], name: bytes) -> str:
    field = next((f for f in fields if _field_name(f) == name), b":")
    return field.split(b":", 1)[1].replace(b"\n", b"").decode("ascii", "replace").strip()


def _split_multipart(body: bytes, marker: bytes) -> tuple[bytes, list[bytes], bytes] | None:
    """(preamble, parts, epilogue) of a multipart body (LF line ends) whose delimiter lines start
    with ``marker`` (LF, ``--``, the boundary); None without a close delimiter."""
    pieces = (b"\n" + body).split(marker)
    parts = []
    for piece in pieces[1:]:
        if piece.startswith(b"--"):
            return pieces[0][1:], parts, piece[2:]
        rest, newline, content = piece.partition(b"\n")
        if rest.strip(b" \t") or not newline:
            return None  # the boundary as the start of a longer line: not a DSN build_dsn wrote
        parts.append(content)
    return None


def _decoded(fields: list[bytes], body: bytes) -> bytes:
    cte = _field_value(fields, b"content-transfer-encoding").lower()
    if cte == "quoted-printable":
        return _EOL_RE.sub(b"\n", binascii.a2b_qp(body))
    if cte == "base64":
        return _EOL_RE.sub(b"\n", binascii.a2b_base64(body))
    return body


def _with_fields(fields: list[bytes], content_type: str, cte: str,
                 description: str | None = None) -> list[bytes]:
    """``fields`` with new Content-Type and Content-Transfer-Encoding values (and Content-Description,
    if given), in their places."""
    new = {b"content-type": content_type, b"content-transfer-encoding": cte, b"content-description": description}
    out = []
    for field in fields:
        value = new.get(_field_name(field))
        if value is None:
            out.append(field)
        else:
            out.append(f"{field.split(b':', 1)[0].decode('ascii')}: {value}\n".encode("ascii"))
    return out


def _downgraded_part(ctype: str, fields: list[bytes], body: bytes, note: bool) -> tuple[list[bytes], bytes] | None:
    """(fields, body) of one part made 7-bit; ``note``: the notification text gets the note that
    the original's body is not returned."""
    if ctype == "text/plain":
        text = _decoded(fields, body)
        if note:
            text = _note_body_not_returned(text)
        text_ct, cte, encoded = _encode_text_part(text)
        return _with_fields(fields, text_ct, cte), encoded.replace(b"\r\n", b"\n")
    if ctype == "message/global-delivery-status":
        status = _status_7bit(_decoded(fields, body).decode("utf-8", "replace"))
        return _with_fields(fields, "message/delivery-status", "7bit"), status
    if ctype == "message/global-headers":
        return _headers_part(fields, _decoded(fields, body), None)
    if ctype == "message/global":
        original = _decoded(fields, body)
        if not _needs_encoding(original):
            return _with_fields(fields, "message/rfc822", "7bit"), original
        return _headers_part(fields, _header_block(original), "Undelivered message headers")
    if _needs_encoding(b"".join(fields) + body):
        return None  # a part of a type this does not know, and not 7-bit clean
    return fields, body


def _headers_part(fields: list[bytes], headers_lf: bytes, description: str | None) -> tuple[list[bytes], bytes]:
    """``text/rfc822-headers`` as build_dsn writes it without ``utf8``."""
    if _needs_encoding(headers_lf):
        charset = "; charset=utf-8" if _is_utf8(headers_lf) else ""
        return (_with_fields(fields, f"text/rfc822-headers{charset}", "quoted-printable", description),
                _qp_crlf(headers_lf).replace(b"\r\n", b"\n"))
    return _with_fields(fields, "text/rfc822-headers", "7bit", description), headers_lf


def _status_7bit(status: str) -> bytes:
    """The fields of a message/global-delivery-status as message/delivery-status writes them:
    a ``utf-8`` address in its xtext form, other non-ASCII text as ``\\x{HEX}``; ASCII fields
    as they are."""
    out = []
    for field in _raw_fields(status.encode("utf-8", "surrogatepass")):
        if field.isascii():
            out.append(field.decode("ascii"))
            continue
        text = field.decode("utf-8", "replace").replace("\n", "")
        name, _, value = text.partition(":")
        addr_type, sep, address = value.partition(";")
        if sep and addr_type.strip().lower() == "utf-8" and name.strip().lower().endswith("-recipient"):
            value = f"utf-8; {_utf8_xtext(_HEX_ESCAPE_RE.sub(_unescape, address.strip()))}"
        else:
            value = _field_text(value.strip())
        out.append(_fold_field(name.strip(), value).replace("\r\n", "\n"))
    return "".join(out).encode("ascii")


def _unescape(match: re.Match) -> str:
    code = int(match.group(1), 16)
    return chr(code) if code <= 0x10FFFF else match.group(0)


def _note_body_not_returned(text_lf: bytes) -> bytes:
    """The notification text, saying that only the headers of the original came back."""
    text = text_lf.decode("utf-8", "replace")
    full = _ATTACHED_FULL + "\n"
    if full in text:
        return text.replace(full, f"{_ATTACHED_HEADERS}\n{_BODY_NOT_7BIT}\n", 1).encode("utf-8")
    return (text.rstrip("\n") + f"\n{_BODY_NOT_7BIT}\n").encode("utf-8")


# --------------------------------------------------------------------------- helpers


def _single_line(value: str, what: str) -> str:
    if any(c in value for c in "\r\n\0"):
        raise ValueError(f"{what} must not contain CR, LF or NUL: {value!r}")
    return value


def _hostname(value: str, what: str) -> str:
    """A domain for our own headers: ASCII (IDNA-encoded if needed), no spaces."""
    host = _single_line(value, what).strip().rstrip(".")
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError as exc:
            raise ValueError(f"{what} is not a valid domain: {value!r}") from exc
    if not host or any(c in host for c in ' \t<>@()"\\,;') or not host.isprintable():
        raise ValueError(f"{what} is not a valid domain: {value!r}")
    return host


def _bare_address(value: str, what: str) -> str:
    addr = _single_line(value, what).strip()
    if addr.startswith("<") and addr.endswith(">"):
        addr = addr[1:-1].strip()
    return addr


def _validate_recipient(rcpt: RecipientReport) -> None:
    if not _bare_address(rcpt.address, "recipient address"):
        raise ValueError("recipient address must not be empty")
    if rcpt.action not in ACTIONS:
        raise ValueError(f"unknown DSN action {rcpt.action!r}; expected one of {sorted(ACTIONS)}")
    if not _STATUS_RE.fullmatch(rcpt.status):
        raise ValueError(f"malformed enhanced status code {rcpt.status!r}")
    _single_line(rcpt.remote_mta, "remote_mta")
    if rcpt.original_recipient is not None:
        _single_line(rcpt.original_recipient, "original_recipient")
    if "\0" in rcpt.diagnostic:
        raise ValueError("diagnostic must not contain NUL")


def _date_utc(dt: datetime) -> datetime:
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt


def _field_text(value: str, collapse: bool = True) -> str:
    """One line of printable ASCII: controls become spaces, whitespace runs collapse (unless
    ``collapse`` is false: an identifier the sender spelled), non-ASCII characters become RFC
    6533-style ``\\x{HEX}`` escapes."""
    out = []
    for ch in value:
        o = ord(ch)
        if o < 0x20 or o == 0x7F:
            out.append(" ")
        elif o > 0x7E:
            out.append(f"\\x{{{o:X}}}")
        else:
            out.append(ch)
    text = "".join(out)
    return " ".join(text.split()) if collapse else text


def _fold_field(name: str, value: str, fold: bool = True) -> str:
    """``name: value`` folded at spaces to ~78 columns (``fold`` false: only where a line would
    pass 998 octets), never a line over 998 octets; a word longer than a line is cut.
    Widths count UTF-8 octets (the same as characters for the ASCII of a classic DSN)."""
    words: list[str] = []
    for word in value.split(" "):
        words.extend(_octet_chunks(word, _MAX_LINE - 1) or [word])  # an empty word: a run of spaces kept
    lines: list[str] = []
    current = f"{name}:"
    width = _octets(current)
    has_word = False
    for word in words:
        size = _octets(word)
        if (has_word and fold and word and width + 1 + size > _FOLD_WIDTH) or width + 1 + size > _MAX_LINE:
            lines.append(current)
            current, width = " " + word, 1 + size
        else:
            current += " " + word
            width += 1 + size
        has_word = True
    lines.append(current)
    return "\r\n".join(lines) + "\r\n"


def _octets(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _octet_chunks(word: str, limit: int) -> list[str]:
    """``word`` cut into pieces of at most ``limit`` UTF-8 octets, never inside a character."""
    if word.isascii():
        return [word[i : i + limit] for i in range(0, len(word), limit)]
    chunks, current, size = [], [], 0
    for ch in word:
        n = _octets(ch)
        if size + n > limit:
            chunks.append("".join(current))
            current, size = [], 0
        current.append(ch)
        size += n
    if current:
        chunks.append("".join(current))
    return chunks


def _address_field(value: str, utf8: bool = False) -> str:
    """``rfc822; addr`` for ASCII, RFC 6533 ``utf-8; <utf-8-addr-xtext>`` otherwise; with
    ``utf8`` (message/global-delivery-status) ``utf-8; <the address as raw UTF-8>``."""
    if value.isascii():
        return f"rfc822; {_field_text(value)}"
    if utf8 and _is_unicode(value):
        return f"utf-8; {_unitext(value)}"
    return f"utf-8; {_utf8_xtext(value)}"


_UTF8_XTEXT = re.compile(r"(?:[\x21-\x2A\x2C-\x3C\x3E-\x5B\x5D-\x7E]|\\x\{[0-9A-Fa-f]{1,6}\})+")


def _utf8_xtext(address: str) -> str:
    """An address as RFC 6533's utf-8-addr-xtext: printable ASCII but ``+``, ``=`` and ``\\``;
    everything else as ``\\x{HEX}``."""
    return "".join(ch if 0x21 <= ord(ch) <= 0x7E and ch not in "+=\\" else f"\\x{{{ord(ch):X}}}"
                   for ch in address)


def _unitext(address: str) -> str:
    """An address as RFC 6533's utf-8-addr-unitext: raw UTF-8 (controls as spaces), but ``\\``,
    ``+`` and ``=`` as ``\\x{HEX}`` (a plus-address is common)."""
    return _display_text(address).replace("\\", "\\x{5C}").replace("+", "\\x{2B}").replace("=", "\\x{3D}")


def _recipient_block(rcpt: RecipientReport, utf8: bool = False) -> list[str]:
    lines = []
    if rcpt.original_recipient:
        orcpt = rcpt.original_recipient.strip()
        addr_type, sep, addr = orcpt.partition(";")
        addr = addr.strip()
        if (
            utf8 and sep and addr and not addr.isascii() and _is_unicode(addr)
            and addr_type.strip().lower() in ("rfc822", "utf-8")
        ):
            value = f"utf-8; {_unitext(addr)}"
        elif sep and addr_type.strip().lower() == "utf-8" and addr and not _UTF8_XTEXT.fullmatch(addr):
            value = f"utf-8; {_utf8_xtext(addr)}"  # (one already in its 7-bit form is kept as it is)
        elif sep and addr_type.strip() and addr:
            value = f"{_field_text(addr_type)}; {_field_text(addr, collapse=False)}"  # as the sender spelled it
        else:
            value = _address_field(orcpt, utf8)
        lines.append(_fold_field("Original-Recipient", value))
    final = _address_field(_bare_address(rcpt.address, ""), utf8)
    lines.append(_fold_field("Final-Recipient", final))
    lines.append(f"Action: {rcpt.action}\r\n")
    lines.append(f"Status: {rcpt.status}\r\n")
    remote = _field_text(rcpt.remote_mta)
    if remote:
        lines.append(_fold_field("Remote-MTA", f"dns; {remote}"))
    # RFC 6533: the diagnostic text of message/global-delivery-status may be UTF-8.
    diagnostic = _display_text(rcpt.diagnostic) if utf8 else _field_text(rcpt.diagnostic)
    if diagnostic:
        lines.append(_fold_field("Diagnostic-Code", f"smtp; {diagnostic}"))
    if rcpt.last_attempt is not None:
        lines.append(f"Last-Attempt-Date: {rfc5322_date(rcpt.last_attempt)}\r\n")
    if rcpt.will_retry_until is not None and rcpt.action == "delayed":
        lines.append(f"Will-Retry-Until: {rfc5322_date(rcpt.will_retry_until)}\r\n")
    return lines


def _header_block(full_lf: bytes) -> bytes:
    """Everything up to the first blank line (LF line ends, terminated by LF);
    the whole input when there is no blank line."""
    if full_lf.startswith(b"\n"):
        return b""
    end = full_lf.find(b"\n\n")
    block = full_lf if end < 0 else full_lf[: end + 1]
    if block and not block.endswith(b"\n"):
        block += b"\n"
    return block


def _needs_encoding(data_lf: bytes) -> bool:
    """True unless ``data_lf`` is valid 7bit data (RFC 2045 2.7) as it stands."""
    if _NOT_7BIT_RE.search(data_lf):
        return True
    return any(len(line) > _MAX_LINE for line in data_lf.split(b"\n"))


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _qp_crlf(data_lf: bytes) -> bytes:
    encoded = binascii.b2a_qp(data_lf, istext=True)
    return encoded.replace(b"\n", b"\r\n")


def _encode_text_part(text_lf: bytes) -> tuple[str, str, bytes]:
    if not _needs_encoding(text_lf):
        return "text/plain; charset=us-ascii", "7bit", text_lf.replace(b"\n", b"\r\n")
    return "text/plain; charset=utf-8", "quoted-printable", _qp_crlf(text_lf)


def _valid_8bit(data_lf: bytes) -> bool:
    """True when ``data_lf`` is valid 8bit data (RFC 2045 2.8): no NUL, lines <= 998 octets."""
    if _NUL_RE.search(data_lf):
        return False
    return all(len(line) <= _MAX_LINE for line in data_lf.split(b"\n"))


def _cte_8bit(data: bytes) -> str:
    return "7bit" if data.isascii() else "8bit"


def _encode_text_part_utf8(text_lf: bytes) -> tuple[str, str, bytes]:
    if not _needs_encoding(text_lf):
        return "text/plain; charset=us-ascii", "7bit", text_lf.replace(b"\n", b"\r\n")
    if _valid_8bit(text_lf):
        return "text/plain; charset=utf-8", "8bit", text_lf.replace(b"\n", b"\r\n")
    return "text/plain; charset=utf-8", "quoted-printable", _qp_crlf(text_lf)


def _original_part_utf8(
    full_lf: bytes, headers_lf: bytes, return_full: bool
) -> tuple[bytes, bytes]:
    """Part 3 of an RFC 6533 DSN: ``message/global`` (RET=FULL, valid 8bit data) or
    ``message/global-headers``, both 8bit as they are; headers that are not valid 8bit
    data (NULs, over-long lines) are quoted-printable, which RFC 6533 allows."""
    if return_full:
        body = full_lf.replace(b"\n", b"\r\n")
        head = (
            "Content-Type: message/global\r\n"
            f"Content-Transfer-Encoding: {_cte_8bit(body)}\r\n"
            "Content-Description: Undelivered message\r\n"
        )
    else:
        if _valid_8bit(headers_lf):
            body = headers_lf.replace(b"\n", b"\r\n")
            cte = _cte_8bit(body)
        else:
            body = _qp_crlf(headers_lf)
            cte = "quoted-printable"
        head = (
            "Content-Type: message/global-headers\r\n"
            f"Content-Transfer-Encoding: {cte}\r\n"
            "Content-Description: Undelivered message headers\r\n"
        )
    return head.encode("ascii"), body


def _is_unicode(value: str) -> bool:
    """False for a str holding lone surrogates (undecodable bytes): not writable as UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _original_subject(headers_lf: bytes) -> str:
    """The decoded Subject of the original, cleaned to one line; "" when none/unusable."""
    lines = headers_lf.split(b"\n")
    raw: bytes | None = None
    for i, line in enumerate(lines):
        match = _SUBJECT_RE.match(line)
        if match:
            pieces = [line[match.end() :]]
            for cont in lines[i + 1 :]:
                if cont[:1] not in (b" ", b"\t"):
                    break
                pieces.append(cont)
            raw = b"".join(pieces)
            break
    if raw is None:
        return ""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    subject = _display_text(decoded_subject(text))
    if len(subject) > _MAX_SUBJECT_CHARS:
        subject = subject[:_MAX_SUBJECT_CHARS].rstrip() + "..."
    return subject


def _display_text(value: str) -> str:
    """One line of human-readable Unicode: controls become spaces, whitespace runs
    collapse, lone surrogates (from surrogateescape-decoded input) become U+FFFD."""
    cleaned = []
    for ch in value:
        if 0xD800 <= ord(ch) <= 0xDFFF:
            cleaned.append("\ufffd")
        elif unicodedata.category(ch) in ("Cc", "Zl", "Zp"):
            cleaned.append(" ")
        else:
            cleaned.append(ch)
    return " ".join("".join(cleaned).split())


def _subject_header(subject: str) -> bytes:
    """``Subject:`` line(s), RFC 2047-encoded where needed, 7-bit, CRLF-folded."""
    # The folder of the modern email API has had bugs on odd input; its output is
    # checked, and the compat32 encoder and finally an ASCII-escaped subject back it up.
    encoders = (
        lambda: _SMTP_POLICY.header_factory("Subject", subject).fold(policy=_SMTP_POLICY),
        lambda: (
            "Subject: "
            + email.header.Header(subject, "utf-8", header_name="Subject").encode(linesep="\r\n")
            + "\r\n"
        ),
    )
    for encode in encoders:
        try:
            folded = encode()
        except Exception:  # noqa: BLE001, S112 - try the next, more conservative encoder
            continue
        lines = folded.split("\r\n")
        if folded.isascii() and lines[-1] == "" and all(len(x) <= _MAX_LINE for x in lines):
            return folded.encode("ascii")
    return f"Subject: {_field_text(subject)[:900]}\r\n".encode("ascii")


def _address_header(name: str, display: str | None, addr: str) -> bytes:
    value = f"{display} <{addr}>" if display else f"<{addr}>"
    return f"{name}: {value}\r\n".encode("utf-8", "surrogateescape")


def _human_text(
    mta: str,
    recipients: Sequence[RecipientReport],
    subject: str,
    arrival_date: datetime,
    return_full: bool,
    body_dropped: bool,
    utf8: bool = False,
) -> str:
    groups = [
        (
            [r for r in recipients if r.action == "failed"],
            (
                "Your message could not be delivered to the following recipient(s).\n"
                "The mail system has given up; it will not try again."
            ),
        ),
        (
            [r for r in recipients if r.action == "delayed"],
            (
                "Delivery of your message to the following recipient(s) has been delayed.\n"
                "The mail system will keep trying; you do not need to send the message again."
            ),
        ),
        (
            [r for r in recipients if r.action not in ("failed", "delayed")],
            "Delivery status for the following recipient(s):",
        ),
    ]
    out = [f"This is the mail system at host {mta}.", ""]
    for members, intro in groups:
        if not members:
            continue
        out.append(intro)
        out.append("")
        for rcpt in members:
            out.append(f"  <{_display_text(_bare_address(rcpt.address, ''))}>")
            out.append(f"    Action: {rcpt.action}, status {rcpt.status}")
            remote = _display_text(rcpt.remote_mta)
            if remote:
                out.append(f"    Remote server: {remote}")
            diagnostic = _display_text(rcpt.diagnostic)
            if diagnostic:
                out.append(f"    Server reply: {diagnostic}")
            if rcpt.last_attempt is not None:
                out.append(f"    Last attempt: {rfc5322_date(rcpt.last_attempt)}")
            out.append("")
    out.append(f"Original message received: {rfc5322_date(arrival_date)}")
    out.append(f"Original subject: {subject or '(no subject)'}")
    out.append("")
    out.append(_ATTACHED_FULL if return_full else _ATTACHED_HEADERS)
    if body_dropped and utf8:
        out.append(
            "The message body is not returned because it holds NUL octets or lines over"
            " 998 octets and cannot be attached unaltered."
        )
    elif body_dropped:
        out.append(_BODY_NOT_7BIT)
    return "\n".join(out) + "\n"


_ATTACHED_FULL = "The delivery report and your original message are attached."
_ATTACHED_HEADERS = "The delivery report and the headers of your original message are attached."
_BODY_NOT_7BIT = (
    "The message body is not returned because it is not 7-bit clean and cannot be attached unaltered."
)


def _pick_boundary(bodies: Sequence[bytes]) -> str:
    # "=_" can never occur in quoted-printable output; we still check every body.
    while True:
        boundary = f"=_dsn_{secrets.token_hex(16)}"
        marker = b"--" + boundary.encode("ascii")
        if not any(marker in body for body in bodies):
            return boundary
