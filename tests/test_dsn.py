"""Tests for transportd.smtp.dsn: DSN construction (RFC 3464 / RFC 6522)."""

import binascii
import email
import email.policy
import email.utils
import re
from datetime import UTC, datetime

import pytest

from transportd.smtp.dsn import (
    RecipientReport,
    build_dsn,
    downgrade_dsn,
    dsn_needs_utf8,
    status_from_reply,
)

ARRIVAL = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
NOW = datetime(2024, 5, 1, 12, 30, 0, tzinfo=UTC)
LAST = datetime(2024, 5, 1, 12, 29, 0, tzinfo=UTC)

ORIGINAL = (
    b"From: Alice <alice@example.org>\r\n"
    b"To: bob@example.net, carol@example.com\r\n"
    b"Subject: Quarterly report\r\n"
    b"Message-ID: <orig-1@example.org>\r\n"
    b"Date: Wed, 01 May 2024 11:59:00 +0000\r\n"
    b"\r\n"
    b"Hello Bob,\r\n"
    b"the numbers are attached.\r\n"
)

TWO_RECIPIENTS = [
    RecipientReport(
        address="bob@example.net",
        action="failed",
        status="5.1.1",
        diagnostic="550 5.1.1 <bob@example.net>: user unknown",
        remote_mta="mx1.example.net",
        last_attempt=LAST,
    ),
    RecipientReport(
        address="carol@example.com",
        action="failed",
        status="5.2.2",
        diagnostic="552 5.2.2 mailbox full",
        remote_mta="mx.example.com",
    ),
]


def _build(**overrides) -> bytes:
    kwargs = {
        "reporting_mta": "mta1.example.org",
        "original_sender": "alice@example.org",
        "original_message": ORIGINAL,
        "recipients": TWO_RECIPIENTS,
        "arrival_date": ARRIVAL,
        "now": NOW,
    }
    kwargs.update(overrides)
    return build_dsn(**kwargs)


def _parse(raw: bytes) -> email.message.EmailMessage:
    return email.message_from_bytes(raw, policy=email.policy.default)


def _assert_wire_safe(raw: bytes, *, seven_bit: bool = True) -> None:
    assert re.search(rb"(?<!\r)\n", raw) is None, "bare LF in output"
    assert re.search(rb"\r(?!\n)", raw) is None, "bare CR in output"
    assert raw.endswith(b"\r\n")
    assert all(len(line) <= 998 for line in raw.split(b"\r\n"))
    if seven_bit:
        assert re.search(rb"[\x00\x80-\xff]", raw) is None, "output is not 7-bit clean"


def _status_blocks(msg: email.message.EmailMessage) -> list:
    report = msg.get_payload()[1]
    assert report.get_content_type() == "message/delivery-status"
    return report.get_payload()


def test_structure_and_top_level_headers() -> None:
    raw = _build()
    _assert_wire_safe(raw)
    msg = _parse(raw)

    assert msg.get_content_type() == "multipart/report"
    assert msg.get_param("report-type") == "delivery-status"
    assert b"\r\nTo: <alice@example.org>\r\n" in raw
    assert msg["To"].addresses[0].addr_spec == "alice@example.org"
    assert msg["From"].addresses[0].addr_spec == "MAILER-DAEMON@mta1.example.org"
    assert msg["Subject"] == "Undeliverable: Quarterly report"
    assert msg["Auto-Submitted"] == "auto-replied"
    assert msg["MIME-Version"] == "1.0"
    assert msg["Date"].datetime == NOW
    assert re.fullmatch(r"<[^<>@\s]+@mta1\.example\.org>", msg["Message-ID"])
    assert not msg.defects

    parts = msg.get_payload()
    assert [p.get_content_type() for p in parts] == [
        "text/plain",
        "message/delivery-status",
        "text/rfc822-headers",
    ]
    text = parts[0].get_content()
    assert "bob@example.net" in text and "user unknown" in text
    assert "carol@example.com" in text and "mailbox full" in text


def test_delivery_status_fields_per_recipient() -> None:
    msg = _parse(_build(original_envelope_id="ENV-42"))
    blocks = _status_blocks(msg)
    assert len(blocks) == 3  # per-message block + one per recipient

    per_message = blocks[0]
    assert per_message["Reporting-MTA"] == "dns; mta1.example.org"
    assert per_message["Original-Envelope-Id"] == "ENV-42"
    assert email.utils.parsedate_to_datetime(per_message["Arrival-Date"]) == ARRIVAL

    bob, carol = blocks[1], blocks[2]
    assert bob["Final-Recipient"] == "rfc822; bob@example.net"
    assert bob["Action"] == "failed"
    assert bob["Status"] == "5.1.1"
    assert bob["Remote-MTA"] == "dns; mx1.example.net"
    assert bob["Diagnostic-Code"] == "smtp; 550 5.1.1 <bob@example.net>: user unknown"
    assert email.utils.parsedate_to_datetime(bob["Last-Attempt-Date"]) == LAST

    assert carol["Final-Recipient"] == "rfc822; carol@example.com"
    assert carol["Action"] == "failed"
    assert carol["Status"] == "5.2.2"
    assert carol["Remote-MTA"] == "dns; mx.example.com"
    assert carol["Diagnostic-Code"] == "smtp; 552 5.2.2 mailbox full"
    assert carol["Last-Attempt-Date"] is None


def test_optional_fields_omitted_when_unknown() -> None:
    msg = _parse(_build(recipients=[RecipientReport(address="<dave@example.net>")]))
    blocks = _status_blocks(msg)
    assert blocks[0]["Original-Envelope-Id"] is None
    rcpt = blocks[1]
    assert rcpt["Final-Recipient"] == "rfc822; dave@example.net"
    assert (rcpt["Action"], rcpt["Status"]) == ("failed", "5.0.0")
    for absent in ("Remote-MTA", "Diagnostic-Code", "Last-Attempt-Date", "Original-Recipient"):
        assert rcpt[absent] is None


def test_original_headers_returned_in_part_three() -> None:
    part3 = _parse(_build()).get_payload()[2]
    headers = part3.get_content()
    assert "Subject: Quarterly report" in headers
    assert "Message-ID: <orig-1@example.org>" in headers
    assert "From: Alice <alice@example.org>" in headers
    assert "the numbers are attached" not in headers


def test_include_body_returns_whole_message() -> None:
    raw = _build(include_body=True)
    _assert_wire_safe(raw)
    part3 = _parse(raw).get_payload()[2]
    assert part3.get_content_type() == "message/rfc822"
    inner = part3.get_content()
    assert inner["Subject"] == "Quarterly report"
    assert "the numbers are attached." in inner.get_content()


@pytest.mark.parametrize("sender", ["", "<>", "  <>  ", " "])
def test_null_sender_is_refused(sender: str) -> None:
    with pytest.raises(ValueError):
        _build(original_sender=sender)


def test_empty_recipients_is_refused() -> None:
    with pytest.raises(ValueError):
        _build(recipients=[])


@pytest.mark.parametrize(
    "bad",
    [
        RecipientReport(address="x@example.net", action="bounced"),
        RecipientReport(address="x@example.net", status="550"),
        RecipientReport(address="x@example.net\r\nBcc: victim@example.com"),
        RecipientReport(address=""),
    ],
)
def test_invalid_recipient_is_refused(bad: RecipientReport) -> None:
    with pytest.raises(ValueError):
        _build(recipients=[bad])


def test_header_injection_via_sender_is_refused() -> None:
    with pytest.raises(ValueError):
        _build(original_sender="alice@example.org\r\nBcc: victim@example.com")


def test_sender_with_angle_brackets() -> None:
    raw = _build(original_sender=" <alice@example.org> ")
    assert b"\r\nTo: <alice@example.org>\r\n" in raw
    assert _parse(raw)["To"].addresses[0].addr_spec == "alice@example.org"


MALFORMED_ORIGINALS = [
    b"",
    b"\r\n\r\nbody only",
    b"no header block at all, just text with no blank line",
    b"Subject: caf\xe9 latin-1\nX-Bin: \x00\x01\xff\xfe\n\nbody \xff\r\n",
    b"Subject: =?utf-8?q?broken\r\nFrom \xff\xff\r\n: \r\n\r\n",
    b"Subject: " + b"A" * 5000 + b"\r\nX: " + b"\xc3\xa9" * 3000 + b"\r\n\r\nbody",
    b"Subject: =?x-unknown-charset?q?foo?=\r\n\r\n",
    b"Subject: =?utf-8?b?!!!not-base64!!!?=\r\n\r\n",
    b"\xff\xfe\x00garbage\rmixed\nline\r\nendings\n\r\n\r\n",
    b'Content-Type: multipart/mixed; boundary="=_dsn_"\r\n\r\n--=_dsn_\r\n',
]


@pytest.mark.parametrize("original", MALFORMED_ORIGINALS)
@pytest.mark.parametrize("include_body", [False, True])
def test_malformed_original_does_not_raise(original: bytes, include_body: bool) -> None:
    raw = _build(original_message=original, include_body=include_body)
    _assert_wire_safe(raw)
    msg = _parse(raw)
    assert msg.get_content_type() == "multipart/report"
    parts = msg.get_payload()
    assert len(parts) == 3
    assert parts[2].get_content_type() in ("text/rfc822-headers", "message/rfc822")
    assert _status_blocks(msg)[1]["Final-Recipient"] == "rfc822; bob@example.net"
    parts[0].get_content()
    parts[2].get_content()


def test_eight_bit_headers_are_kept_exactly_via_quoted_printable() -> None:
    original = b"Subject: caf\xc3\xa9\r\nX-Raw: \xff\xfe\r\n\r\nbody \xff\r\n"
    raw = _build(original_message=original, include_body=True)
    _assert_wire_safe(raw)
    part3 = _parse(raw).get_payload()[2]
    # message/rfc822 cannot be encoded, so an 8-bit original falls back to headers.
    assert part3.get_content_type() == "text/rfc822-headers"
    assert part3["Content-Transfer-Encoding"] == "quoted-printable"
    assert part3.get_payload(decode=True) == b"Subject: caf\xc3\xa9\r\nX-Raw: \xff\xfe\r\n"
    assert "not 7-bit clean" in _parse(raw).get_payload()[0].get_content()


def test_bare_lf_original_is_normalised() -> None:
    original = ORIGINAL.replace(b"\r\n", b"\n")
    for include_body in (False, True):
        raw = _build(original_message=original, include_body=include_body)
        _assert_wire_safe(raw)
    part3 = _parse(_build(original_message=original)).get_payload()[2]
    assert "Subject: Quarterly report" in part3.get_content()


@pytest.mark.parametrize(
    ("original", "expected"),
    [
        (b"Subject: =?utf-8?q?R=C3=A9sum=C3=A9?=\r\n\r\n", "Undeliverable: Résumé"),
        (b"Subject: =?iso-8859-1?b?Y2Fm6Q==?=\r\n\r\n", "Undeliverable: café"),
        (b"Subject:\r\n\r\nbody", "Undeliverable: (no subject)"),
        (b"Subject: \r\n\r\n", "Undeliverable: (no subject)"),
        (b"From: a@b\r\n\r\nno subject", "Undeliverable: (no subject)"),
        (b"Subject: raw utf-8 \xc3\xa9t\xc3\xa9\r\n\r\n", "Undeliverable: raw utf-8 été"),
        (b"Subject: folded\r\n  over two lines\r\n\r\n", "Undeliverable: folded over two lines"),
    ],
)
def test_subject_survives_encoded_empty_missing(original: bytes, expected: str) -> None:
    raw = _build(original_message=original)
    _assert_wire_safe(raw)
    assert _parse(raw)["Subject"] == expected


def test_long_subject_is_folded_and_truncated() -> None:
    original = b"Subject: " + b"word " * 400 + b"\r\n\r\n"
    raw = _build(original_message=original)
    _assert_wire_safe(raw)
    subject = _parse(raw)["Subject"]
    assert subject.startswith("Undeliverable: word word")
    assert len(subject) < 250


def test_delayed_subject_only_when_every_recipient_is_delayed() -> None:
    until = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    delayed = RecipientReport(
        address="bob@example.net",
        action="delayed",
        status="4.4.7",
        diagnostic="451 4.4.7 try later",
        will_retry_until=until,
    )
    msg = _parse(_build(recipients=[delayed]))
    assert msg["Subject"] == "Delivery delayed: Quarterly report"
    blocks = _status_blocks(msg)
    assert (blocks[1]["Action"], blocks[1]["Status"]) == ("delayed", "4.4.7")
    # RFC 3464 2.3.8: when the MTA gives up, for a delayed recipient only
    assert email.utils.parsedate_to_datetime(blocks[1]["Will-Retry-Until"]) == until
    failed = _status_blocks(_parse(_build(recipients=[RecipientReport(
        address="bob@example.net", action="failed", status="5.1.1", will_retry_until=until)])))
    assert failed[1]["Will-Retry-Until"] is None
    assert "delayed" in msg.get_payload()[0].get_content()

    mixed = _parse(_build(recipients=[delayed, TWO_RECIPIENTS[1]]))
    assert mixed["Subject"] == "Undeliverable: Quarterly report"


def test_postmaster_and_message_id_domain() -> None:
    msg = _parse(_build(postmaster="postmaster@example.org", message_id_domain="ids.example.org"))
    assert msg["From"].addresses[0].addr_spec == "postmaster@example.org"
    assert msg["From"].addresses[0].display_name == "Mail Delivery System"
    assert msg["Message-ID"].endswith("@ids.example.org>")


def test_message_ids_are_unique() -> None:
    assert _parse(_build())["Message-ID"] != _parse(_build())["Message-ID"]


def test_multiline_and_long_diagnostic_is_unfolded_and_wrapped() -> None:
    diagnostic = "550-5.7.1 first line\r\n550 5.7.1 " + "policy " * 60 + "end"
    raw = _build(recipients=[RecipientReport(address="bob@example.net", diagnostic=diagnostic)])
    _assert_wire_safe(raw)
    code = _status_blocks(_parse(raw))[1]["Diagnostic-Code"]
    assert code.startswith("smtp; 550-5.7.1 first line 550 5.7.1 policy policy")
    assert code.endswith("policy end")


def test_a_long_word_is_cut_only_where_no_line_could_hold_it() -> None:
    """A 950-octet word (a token in a next hop's reply) gets a line of its own, whole; a word of
    1,500 octets is cut into pieces that fit. No line passes 998 octets either way."""
    for size, pieces in ((950, 1), (1500, 2)):
        word = "x" * size
        raw = _build(recipients=[RecipientReport(address="bob@example.net", diagnostic=f"550 5.7.1 {word} end")])
        _assert_wire_safe(raw)
        code = _status_blocks(_parse(raw))[1]["Diagnostic-Code"]
        assert code.split()[:3] == ["smtp;", "550", "5.7.1"] and code.split()[-1] == "end"
        assert len(code.split()[3:-1]) == pieces and "".join(code.split()[3:-1]) == word


def test_original_recipient_and_utf8_final_recipient() -> None:
    rcpt = RecipientReport(
        address="jörg+x@example.de",
        original_recipient="rfc822;Jorg@Example.DE",
    )
    raw = _build(recipients=[rcpt])
    _assert_wire_safe(raw)
    block = _status_blocks(_parse(raw))[1]
    assert block["Original-Recipient"] == "rfc822; Jorg@Example.DE"
    assert block["Final-Recipient"] == "utf-8; j\\x{F6}rg\\x{2B}x@example.de"
    assert "jörg+x@example.de" in _parse(raw).get_payload()[0].get_content()


def test_naive_datetimes_are_utc() -> None:
    msg = _parse(_build(now=NOW.replace(tzinfo=None), arrival_date=ARRIVAL.replace(tzinfo=None)))
    assert msg["Date"].datetime == NOW


@pytest.mark.parametrize(
    ("code", "text", "expected"),
    [
        (550, "5.1.1 user unknown", "5.1.1"),
        (550, "<x@y>: Recipient address rejected: 5.1.1 nope", "5.1.1"),
        (550, "550-5.7.1 policy\r\n550 5.7.1 more", "5.7.1"),
        (452, "4.2.2 mailbox full", "4.2.2"),
        (250, "2.0.0 Ok: queued as ABC", "2.0.0"),
        (550, "user unknown", "5.0.0"),
        (554, "", "5.0.0"),
        (421, "service not available", "4.0.0"),
        (451, "5.4.7 class disagrees with the reply code", "4.4.7"),
        (550, "5.1.1000 too many digits", "5.0.0"),
        (550, "5.1.1: trailing punctuation", "5.0.0"),
        (550, "6.1.1 not a class", "5.0.0"),
        (550, "x 5.123.456", "5.123.456"),
        (0, "no reply", "4.0.0"),
    ],
)
def test_status_from_reply(code: int, text: str, expected: str) -> None:
    assert status_from_reply(code, text) == expected


# --------------------------------------------------------------------------- RFC 6533 (utf8=True)

UTF8_SENDER = "jörg@bücher.example"
UTF8_RCPT = "δοκιμή@παράδειγμα.δοκιμή"
UTF8_HEADERS = (
    "From: Jörg <jörg@bücher.example>\r\n"
    f"To: {UTF8_RCPT}, bob@example.net\r\n"
    "Subject: Grüße aus Köln\r\n"
    "Message-ID: <orig-2@bücher.example>\r\n"
).encode() + b"X-Raw: not utf-8 \xff\xfe\r\n"
UTF8_ORIGINAL = UTF8_HEADERS + b"\r\n" + "Hallo Bob, schöne Grüße.\r\n".encode()
UTF8_RECIPIENTS = [
    RecipientReport(
        address=UTF8_RCPT,
        status="5.1.1",
        diagnostic="550 5.1.1 <δοκιμή@παράδειγμα.δοκιμή>: Empfänger unbekannt",
        remote_mta="mx.example.net",
        original_recipient=f"utf-8;{UTF8_RCPT}",
        last_attempt=LAST,
    ),
    RecipientReport(address="bob@example.net", status="5.2.2", diagnostic="552 5.2.2 mailbox full"),
]


def _build_utf8(**overrides) -> bytes:
    kwargs = {
        "original_sender": UTF8_SENDER,
        "original_message": UTF8_ORIGINAL,
        "recipients": UTF8_RECIPIENTS,
        "utf8": True,
    }
    kwargs.update(overrides)
    return _build(**kwargs)


def _raw_part(raw: bytes, index: int) -> tuple[bytes, bytes]:
    """(header block, body) of MIME part ``index`` of a DSN, as bytes on the wire."""
    boundary = _parse(raw).get_boundary().encode("ascii")
    chunks = raw.split(b"\r\n--" + boundary)
    part = chunks[index + 1]
    assert part.startswith(b"\r\n")
    head, body = part[2:].split(b"\r\n\r\n", 1)
    return head + b"\r\n", body


def _status_fields(raw: bytes) -> list[dict[str, str]]:
    """The blocks of part 2, each a dict of field name -> value (unfolded)."""
    _, body = _raw_part(raw, 1)
    blocks = []
    for block in body.decode("utf-8").strip("\r\n").split("\r\n\r\n"):
        fields: dict[str, str] = {}
        name = ""
        for line in block.split("\r\n"):
            if line[:1] in (" ", "\t"):
                fields[name] += line
                continue
            name, _, value = line.partition(":")
            fields[name] = value.strip()
        blocks.append(fields)
    return blocks


def test_utf8_dsn_structure_and_content_types() -> None:
    raw = _build_utf8()
    _assert_wire_safe(raw, seven_bit=False)
    msg = _parse(raw)
    assert msg.get_content_type() == "multipart/report"
    assert msg.get_param("report-type") == "delivery-status"
    assert msg["Content-Transfer-Encoding"] == "8bit"
    assert not msg.defects
    parts = msg.get_payload()
    assert [p.get_content_type() for p in parts] == [
        "text/plain",
        "message/global-delivery-status",
        "message/global-headers",
    ]
    assert parts[0].get_content_charset() == "utf-8"
    assert parts[0]["Content-Transfer-Encoding"] == "8bit"
    text = parts[0].get_content()
    assert f"<{UTF8_RCPT}>" in text and "Empfänger unbekannt" in text
    assert "Original subject: Grüße aus Köln" in text
    assert parts[1]["Content-Transfer-Encoding"] == "8bit"
    assert parts[2]["Content-Transfer-Encoding"] == "8bit"


def test_utf8_dsn_headers_are_raw_utf8() -> None:
    raw = _build_utf8()
    head = raw.split(b"\r\n\r\n", 1)[0] + b"\r\n"
    assert f"\r\nTo: <{UTF8_SENDER}>\r\n".encode() in head
    assert "\r\nSubject: Undeliverable: Grüße aus Köln\r\n".encode() in head
    assert b"=?" not in head
    msg = _parse(raw)
    assert str(msg["To"]) == UTF8_SENDER  # addr_spec keeps the raw octets as surrogates
    assert msg["Subject"] == "Undeliverable: Grüße aus Köln"
    assert msg["From"].addresses[0].addr_spec == "MAILER-DAEMON@mta1.example.org"


def test_utf8_dsn_addresses_are_raw_utf8_in_global_delivery_status() -> None:
    raw = _build_utf8(original_envelope_id="ENV-7")
    _, status = _raw_part(raw, 1)
    assert f"\r\nFinal-Recipient: utf-8; {UTF8_RCPT}\r\n".encode() in status
    assert f"\r\nOriginal-Recipient: utf-8; {UTF8_RCPT}\r\n".encode() in status
    assert b"\\x{" not in status
    per_message, rcpt, bob = _status_fields(raw)
    assert per_message["Reporting-MTA"] == "dns; mta1.example.org"
    assert per_message["Original-Envelope-Id"] == "ENV-7"
    assert rcpt["Final-Recipient"] == f"utf-8; {UTF8_RCPT}"
    assert rcpt["Diagnostic-Code"] == f"smtp; 550 5.1.1 <{UTF8_RCPT}>: Empfänger unbekannt"
    assert (rcpt["Action"], rcpt["Status"]) == ("failed", "5.1.1")
    assert rcpt["Remote-MTA"] == "dns; mx.example.net"
    assert email.utils.parsedate_to_datetime(rcpt["Last-Attempt-Date"]) == LAST
    assert bob["Final-Recipient"] == "rfc822; bob@example.net"  # ASCII stays rfc822
    assert bob["Diagnostic-Code"] == "smtp; 552 5.2.2 mailbox full"


def test_utf8_dsn_original_recipient_forms() -> None:
    rcpts = [
        RecipientReport(address=UTF8_RCPT, original_recipient=f"rfc822;{UTF8_RCPT}"),
        RecipientReport(address="a@example.net", original_recipient="rfc822;A@Example.NET"),
        RecipientReport(address="b@example.net", original_recipient="utf-8;j\\x{F6}rg@example.de"),
    ]
    _, first, second, third = _status_fields(_build_utf8(recipients=rcpts))
    assert first["Original-Recipient"] == f"utf-8; {UTF8_RCPT}"
    assert second["Original-Recipient"] == "rfc822; A@Example.NET"
    assert third["Original-Recipient"] == "utf-8; j\\x{F6}rg@example.de"  # 7-bit form kept


def test_utf8_dsn_returns_the_header_block_byte_exact() -> None:
    raw = _build_utf8()
    head, body = _raw_part(raw, 2)
    assert head == (
        b"Content-Type: message/global-headers\r\n"
        b"Content-Transfer-Encoding: 8bit\r\n"
        b"Content-Description: Undelivered message headers\r\n"
    )
    assert body == UTF8_HEADERS  # raw UTF-8 and even the invalid \xff\xfe octets, unchanged
    assert "schöne".encode() not in raw


def test_utf8_dsn_ret_full_returns_message_global() -> None:
    raw = _build_utf8(include_body=True)
    _assert_wire_safe(raw, seven_bit=False)
    parts = _parse(raw).get_payload()
    assert parts[2].get_content_type() == "message/global"
    head, body = _raw_part(raw, 2)
    assert b"Content-Transfer-Encoding: 8bit\r\n" in head
    assert body == UTF8_ORIGINAL
    inner = parts[2].get_payload()[0]
    assert inner["Subject"] == "Grüße aus Köln"
    assert "attached" in parts[0].get_content()
    assert "not returned" not in parts[0].get_content()


def test_utf8_dsn_ret_full_of_an_original_that_is_not_valid_8bit_falls_back() -> None:
    original = "Subject: Grüße\r\nX-Nul: a\x00b\r\n\r\n".encode() + b"x" * 1200 + b"\r\n"
    raw = _build_utf8(original_message=original, include_body=True)
    _assert_wire_safe(raw, seven_bit=False)
    parts = _parse(raw).get_payload()
    assert parts[2].get_content_type() == "message/global-headers"
    head, body = _raw_part(raw, 2)
    # A NUL may not travel as 8bit either: quoted-printable, which RFC 6533 allows.
    assert b"Content-Transfer-Encoding: quoted-printable\r\n" in head
    assert binascii.a2b_qp(body) == "Subject: Grüße\r\nX-Nul: a\x00b\r\n".encode()
    assert "NUL octets or lines over 998 octets" in parts[0].get_content()


def test_utf8_dsn_all_ascii_is_7bit() -> None:
    raw = _build(utf8=True)
    _assert_wire_safe(raw)
    msg = _parse(raw)
    assert msg["Content-Transfer-Encoding"] is None
    parts = msg.get_payload()
    assert [p.get_content_type() for p in parts] == [
        "text/plain",
        "message/global-delivery-status",
        "message/global-headers",
    ]
    assert all(p["Content-Transfer-Encoding"] == "7bit" for p in parts)
    assert msg["Subject"] == "Undeliverable: Quarterly report"


def test_utf8_dsn_long_utf8_diagnostic_is_folded_within_998_octets() -> None:
    rcpt = RecipientReport(address=UTF8_RCPT, diagnostic="550 " + "ü" * 2000 + " " + "grüße " * 300)
    raw = _build_utf8(recipients=[rcpt])
    _assert_wire_safe(raw, seven_bit=False)
    _, status = _raw_part(raw, 1)
    lines = status.split(b"\r\n")
    assert max(len(line) for line in lines) <= 998
    assert all(line.decode("utf-8") for line in lines if line)  # never cut inside a character
    code = _status_fields(raw)[1]["Diagnostic-Code"]
    assert code.replace(" ", "").startswith("smtp;550" + "ü" * 2000)


@pytest.mark.parametrize("original", MALFORMED_ORIGINALS)
@pytest.mark.parametrize("include_body", [False, True])
def test_utf8_dsn_malformed_original_does_not_raise(original: bytes, include_body: bool) -> None:
    raw = _build_utf8(original_message=original, include_body=include_body)
    _assert_wire_safe(raw, seven_bit=False)
    msg = _parse(raw)
    parts = msg.get_payload()
    assert len(parts) == 3
    assert parts[2].get_content_type() in ("message/global-headers", "message/global")
    parts[0].get_content()


def test_utf8_dsn_undecodable_address_falls_back_to_xtext() -> None:
    bad = "caf\udce9@example.org"  # surrogateescape-decoded Latin-1 octet: not Unicode
    raw = _build_utf8(recipients=[RecipientReport(address=bad)])
    _, status = _raw_part(raw, 1)
    assert b"Final-Recipient: utf-8; caf\\x{DCE9}@example.org\r\n" in status


def test_utf8_false_is_unchanged_for_a_utf8_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = iter(range(10**6))
    monkeypatch.setattr("secrets.token_hex", lambda n=16: f"{next(counter):0{2 * n}x}")
    kwargs = {"original_sender": UTF8_SENDER, "original_message": UTF8_ORIGINAL}
    default = _build(recipients=UTF8_RECIPIENTS, include_body=True, **kwargs)
    counter = iter(range(10**6))
    explicit = _build(recipients=UTF8_RECIPIENTS, include_body=True, utf8=False, **kwargs)
    assert default == explicit
    raw = default
    # The classic DSN: 7-bit except the To: header, message/delivery-status, xtext addresses,
    # RFC 2047 Subject, and an 8-bit original falls back to quoted-printable headers.
    assert f"\r\nTo: <{UTF8_SENDER}>\r\n".encode() in raw
    head, rest = raw.split(b"\r\n\r\n", 1)
    assert is_ascii_except(head, f"To: <{UTF8_SENDER}>".encode())
    assert rest.isascii()
    assert b"=?utf-8?" in head
    msg = _parse(raw)
    assert msg["Subject"] == "Undeliverable: Grüße aus Köln"
    parts = msg.get_payload()
    assert [p.get_content_type() for p in parts] == [
        "text/plain",
        "message/delivery-status",
        "text/rfc822-headers",
    ]
    assert parts[2]["Content-Transfer-Encoding"] == "quoted-printable"
    assert parts[2].get_payload(decode=True) == UTF8_HEADERS
    block = _status_blocks(msg)[1]
    assert block["Final-Recipient"] == (
        "utf-8; \\x{3B4}\\x{3BF}\\x{3BA}\\x{3B9}\\x{3BC}\\x{3AE}@"
        "\\x{3C0}\\x{3B1}\\x{3C1}\\x{3AC}\\x{3B4}\\x{3B5}\\x{3B9}\\x{3B3}\\x{3BC}\\x{3B1}."
        "\\x{3B4}\\x{3BF}\\x{3BA}\\x{3B9}\\x{3BC}\\x{3AE}"
    )
    assert "not 7-bit clean" in parts[0].get_content()


def is_ascii_except(data: bytes, allowed: bytes) -> bool:
    return data.replace(allowed, b"").isascii()


@pytest.mark.parametrize(
    ("sender", "recipients", "original", "smtputf8", "expected"),
    [
        ("alice@example.org", ["bob@example.net"], ORIGINAL, True, False),
        (UTF8_SENDER, ["bob@example.net"], ORIGINAL, True, True),
        ("alice@example.org", [UTF8_RCPT], ORIGINAL, True, True),
        ("alice@example.org", ["bob@example.net"], UTF8_ORIGINAL, True, True),
        # 8-bit octets only in the body: the classic DSN returns the headers fine.
        ("alice@example.org", ["bob@example.net"], b"Subject: x\r\n\r\n\xc3\xbc\r\n", True, False),
        # Without SMTPUTF8 on the way in, the sender's side may not speak it: classic DSN.
        (UTF8_SENDER, [UTF8_RCPT], UTF8_ORIGINAL, False, False),
        ("alice@example.org", ["bob@example.net"], b"Subject: caf\xe9\n\nbody", True, True),
        ("alice@example.org", ["bob@example.net"], b"", True, False),
    ],
)
def test_dsn_needs_utf8(
    sender: str, recipients: list[str], original: bytes, smtputf8: bool, expected: bool
) -> None:
    reports = [RecipientReport(address=addr) for addr in recipients]
    assert dsn_needs_utf8(sender, reports, original, smtputf8) is expected


def test_dsn_needs_utf8_counts_a_utf8_orcpt() -> None:
    reports = [RecipientReport(address="bob@example.net", original_recipient=f"utf-8;{UTF8_RCPT}")]
    assert dsn_needs_utf8("alice@example.org", reports, ORIGINAL, True)


def test_utf8_addresses_escape_plus_equals_and_backslash() -> None:
    """RFC 6533 3: utf-8-addr-unitext (and -xtext) leave out '+', '=' and '\\': a plus-address
    (common) is written with \\x{2B}, in both kinds of DSN."""
    plus = "jörg+news=x@bücher.example"
    report = RecipientReport(address=plus, action="failed", status="5.1.1", original_recipient=f"utf-8;{plus}")
    for utf8 in (True, False):
        raw = _build_utf8(recipients=[report], utf8=utf8)
        if utf8:
            _, rcpt = _status_fields(raw)
            assert rcpt["Final-Recipient"] == "utf-8; jörg\\x{2B}news\\x{3D}x@bücher.example", rcpt
            assert rcpt["Original-Recipient"] == rcpt["Final-Recipient"], rcpt
        else:
            _, status = _raw_part(raw, 1)
            assert b"Final-Recipient: utf-8; j\\x{F6}rg\\x{2B}news\\x{3D}x@b\\x{FC}cher.example\r\n" in status
            assert b"Original-Recipient: utf-8; j\\x{F6}rg\\x{2B}news\\x{3D}x@b\\x{FC}cher.example\r\n" in status


# --------------------------------------------------------------------------- downgrade_dsn (RFC 6533 -> RFC 3464)


def _both(monkeypatch: pytest.MonkeyPatch, **overrides) -> tuple[bytes, bytes]:
    """The RFC 6533 DSN and the classic one built from the same facts (same Message-ID, boundary)."""
    built = []
    for utf8 in (True, False):
        counter = iter(range(10**6))
        monkeypatch.setattr("secrets.token_hex", lambda n=16, c=counter: f"{next(c):0{2 * n}x}")
        built.append(_build(**{"recipients": UTF8_RECIPIENTS, "original_message": UTF8_ORIGINAL, **overrides,
                               "utf8": utf8}))
    return built[0], built[1]


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # the original's UTF-8 headers: text/rfc822-headers, quoted-printable
        {"original_envelope_id": "ENV  7", "include_body": True},  # RET=FULL of an 8-bit original: headers only
        {"original_message": ORIGINAL, "include_body": True},  # RET=FULL, 7-bit clean: message/rfc822
        {"recipients": [RecipientReport(address="jörg+news=x@bücher.example", status="5.1.1",
                                        original_recipient="utf-8;jörg+news=x@bücher.example")]},
    ],
)
def test_downgrade_dsn_is_the_classic_dsn_of_the_same_facts(monkeypatch: pytest.MonkeyPatch, overrides) -> None:
    """For a DSN to an ASCII sender whose way back lacks SMTPUTF8: the 7-bit DSN build_dsn writes
    without utf8, byte for byte (utf-8 xtext addresses, RFC 2047 Subject, headers only when the
    original is not 7-bit clean, the notification saying so)."""
    utf8, classic = _both(monkeypatch, **overrides)
    assert b"message/global" in utf8 and not utf8.isascii()
    downgraded = downgrade_dsn(utf8)
    assert downgraded == classic
    _assert_wire_safe(downgraded)
    msg = _parse(downgraded)
    assert not msg.defects and msg.get_content_type() == "multipart/report"
    assert [p.get_content_type() for p in msg.get_payload()][:2] == ["text/plain", "message/delivery-status"]


def test_downgrade_dsn_keeps_the_message_id_and_says_what_the_utf8_dsn_says() -> None:
    utf8 = _build_utf8(original_sender="alice@example.org", include_body=True)
    downgraded = downgrade_dsn(utf8)
    assert downgraded is not None
    _assert_wire_safe(downgraded)
    before, after = _parse(utf8), _parse(downgraded)
    assert after["Message-ID"] == before["Message-ID"] and after["Date"] == before["Date"]
    assert after["Subject"] == "Undeliverable: Grüße aus Köln" and b"=?utf-8?" in downgraded
    text, status, headers = after.get_payload()
    assert f"<{UTF8_RCPT}>" in text.get_content() and "Empfänger unbekannt" in text.get_content()
    assert "not 7-bit clean" in text.get_content() and "and your original message are attached" not in text.get_content()
    _, rcpt, bob = status.get_payload()
    assert rcpt["Final-Recipient"].startswith("utf-8; \\x{3B4}\\x{3BF}")
    assert rcpt["Original-Recipient"] == rcpt["Final-Recipient"]
    assert rcpt["Diagnostic-Code"].endswith(": Empf\\x{E4}nger unbekannt")
    assert (rcpt["Action"], rcpt["Status"], rcpt["Remote-MTA"]) == ("failed", "5.1.1", "dns; mx.example.net")
    assert bob["Final-Recipient"] == "rfc822; bob@example.net"
    assert headers.get_content_type() == "text/rfc822-headers"
    assert headers.get_payload(decode=True) == UTF8_HEADERS  # even the invalid octets, kept


@pytest.mark.parametrize("original", MALFORMED_ORIGINALS)
@pytest.mark.parametrize("include_body", [False, True])
def test_downgrade_dsn_of_a_malformed_original_is_7bit(original: bytes, include_body: bool) -> None:
    downgraded = downgrade_dsn(_build_utf8(original_sender="alice@example.org", original_message=original,
                                           include_body=include_body))
    assert downgraded is not None
    _assert_wire_safe(downgraded)
    parts = _parse(downgraded).get_payload()
    assert [p.get_content_type() for p in parts][:2] == ["text/plain", "message/delivery-status"]
    assert parts[2].get_content_type() in ("text/rfc822-headers", "message/rfc822")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        ORIGINAL,  # not a DSN
        b"Subject: x\r\nContent-Type: multipart/report; report-type=delivery-status\r\n\r\nno boundary\r\n",
        "Subject: Grüße\r\n\r\nnot a DSN\r\n".encode(),
    ],
)
def test_downgrade_dsn_leaves_what_is_not_an_rfc6533_dsn(data: bytes) -> None:
    assert downgrade_dsn(data) is None


def test_downgrade_dsn_leaves_a_dsn_that_needs_smtputf8_anyway() -> None:
    """A UTF-8 To: (the DSN goes to a non-ASCII sender): no 7-bit form; the classic DSN is not an
    RFC 6533 one to downgrade, and a cut-off DSN has no close delimiter."""
    assert downgrade_dsn(_build_utf8()) is None
    assert downgrade_dsn(_build(original_sender="alice@example.org")) is None
    utf8 = _build_utf8(original_sender="alice@example.org")
    assert downgrade_dsn(utf8[: utf8.rindex(b"\r\n--")]) is None
