"""SMTP reply wording (replies.py) and the pure part of receive (prepare_message)."""

from __future__ import annotations

import email.utils
import re

import pytest

from transportd.smtp import replies
from transportd.smtp.frontend import prepare_message, received_protocol
from transportd.smtp.headers import network_id_from, split_headers
from transportd.smtp.replies import enhance, is_permanent, is_transient, translate

ENHANCED = re.compile(r"^(\d)\d\d ([245])\.(\d{1,3})\.(\d{1,3}) \S")

# --------------------------------------------------------------------------- the constants

CONSTANTS = sorted((name, value) for name, value in vars(replies).items()
                   if re.fullmatch(r"S\d{3}_[A-Z0-9_]+", name))


def test_there_are_constants() -> None:
    assert len(CONSTANTS) >= 25


@pytest.mark.parametrize("name, value", CONSTANTS, ids=[n for n, _ in CONSTANTS])
def test_constant_is_well_formed(name, value) -> None:
    code = name[1:4]
    assert value.startswith(code + " "), "the name's code and the reply's code agree"
    assert "\r" not in value and "\n" not in value
    if name == "S220_GREETING" or code == "354":  # RFC 2034 exempts the greeting (and 354 has no status)
        assert not ENHANCED.match(value)
        return
    m = ENHANCED.match(value)
    assert m, f"{name} lacks an enhanced status code: {value!r}"
    assert m.group(1) == m.group(2), f"{name}: class digit {m.group(2)} does not match reply code {code}"
    # RFC 3463 subjects are 0-7
    assert 0 <= int(m.group(3)) <= 7
    # our own wording is left alone by translate() and enhance()
    assert translate(value) == value
    assert enhance(value) == value


def test_formatted_constants_keep_their_codes() -> None:
    assert replies.S250_QUEUED.format(id=42) == "250 2.0.0 Ok: queued as 42"
    assert replies.S421_TIMEOUT.format(host="n1.test").startswith("421 4.4.2 n1.test ")
    assert replies.S500_UNRECOGNIZED.format(command="FOO") == '500 5.5.1 Command unrecognized: "FOO"'


# --------------------------------------------------------------------------- translate

@pytest.mark.parametrize("aiosmtpd, ours", [
    ("552 Error: Too much mail data", "552 5.3.4 Message size exceeds fixed maximum message size"),
    ("552 Error: message size exceeds fixed maximum message size",
     "552 5.3.4 Message size exceeds fixed maximum message size"),
    ("500 Line too long (see RFC5321 4.5.3.1.6)", "500 5.5.2 Line too long (RFC 5321 4.5.3.1.6)"),
    ("500 Command line too long", "500 5.5.2 Command line too long"),
    ("500 Error: bad syntax", "500 5.5.2 Syntax error"),
    ("503 Error: need RCPT command", "503 5.5.1 Bad sequence of commands: need RCPT"),
    ("530 Must issue a STARTTLS command first", "530 5.7.0 Must issue a STARTTLS command first"),
    ("221 Bye", "221 2.0.0 Bye"),
    ("250 OK", "250 2.0.0 OK"),
    ('500 Error: command "FOO" not recognized', '500 5.5.1 Command unrecognized: "FOO"'),
    ('500 Error: command "A\rB\x00C" not recognized', '500 5.5.1 Command unrecognized: "A?B?C"'),
    ('500 Error: command "' + "X" * 100 + '" not recognized', '500 5.5.1 Command unrecognized: "' + "X" * 40 + '"'),
    # not in the table: enhanced generically
    ("503 Error: need MAIL command", "503 5.5.1 need MAIL command"),
    ("503 Error: nested MAIL command", "503 5.5.1 nested MAIL command"),
    ("501 Syntax: MAIL FROM: <address>", "501 5.5.4 Syntax: MAIL FROM: <address>"),
    ("501 Syntax: EHLO hostname", "501 5.5.4 Syntax: EHLO hostname"),
    ("503 Error: send HELO first", "503 5.5.1 send HELO first"),
    ("502 EXPN not implemented", "502 5.5.1 EXPN not implemented"),
    ("454 TLS not available", "454 4.0.0 TLS not available"),
    ("555 MAIL FROM parameters not recognized or not implemented",
     "555 5.5.4 MAIL FROM parameters not recognized or not implemented"),
    ("252 Cannot VRFY user, but will accept message and attempt delivery",
     "252 2.0.0 Cannot VRFY user, but will accept message and attempt delivery"),
    ("250 node1.transportd.test", "250 2.0.0 node1.transportd.test"),
    ("553 5.1.3 Error: malformed address", "553 5.1.3 Malformed address"),
    # codes RFC 5321 asks for: HELP's 214 (and 504 for a topic that is no command), a malformed
    # VRFY argument is a malformed address (502 would say VRFY is not implemented), a session
    # closed for its errors 421 (3.8), STARTTLS's 220 enhanced (RFC 2034 exempts only the greeting)
    ("250 Supported commands: DATA EHLO", "214 2.0.0 Supported commands: DATA EHLO"),
    ("250 Syntax: BDAT chunk-size [LAST]", "214 2.0.0 Syntax: BDAT chunk-size [LAST]"),
    ("501 Supported commands: DATA EHLO", "504 5.5.1 HELP topic not known; supported commands: DATA EHLO"),
    ("502 Could not VRFY a@", "553 5.1.3 Malformed address: could not VRFY a@"),
    ("502 5.5.1 Too many unrecognized commands, goodbye.", "421 4.7.0 Closing connection: too many errors"),
    ("220 Ready to start TLS", "220 2.0.0 Ready to start TLS"),
    # already enhanced, or not a final reply: unchanged
    ("538 5.7.11 Encryption required for requested authentication mechanism",
     "538 5.7.11 Encryption required for requested authentication mechanism"),
    ("235 2.7.0 Authentication successful", "235 2.7.0 Authentication successful"),
    ("220 node1.transportd.test ESMTP transportd ready", "220 node1.transportd.test ESMTP transportd ready"),
    ("354 End data with <CR><LF>.<CR><LF>", "354 End data with <CR><LF>.<CR><LF>"),
    ("334 VXNlcm5hbWU6", "334 VXNlcm5hbWU6"),
])
def test_translate(aiosmtpd, ours) -> None:
    assert translate(aiosmtpd) == ours


def test_translate_table_targets_are_enhanced() -> None:
    for source, target in replies._AIOSMTPD.items():
        assert source[:3] == target[:3]
        m = ENHANCED.match(target)
        assert m and m.group(1) == m.group(2), target


# --------------------------------------------------------------------------- enhance

@pytest.mark.parametrize("reply", [
    "220 node1 ESMTP transportd ready", "354 Start mail input", "334 ", "334 VXNlcm5hbWU6",
    "250-node1.transportd.test", "250-SIZE 37748736", "250-8BITMIME", "250-PIPELINING",
    "250 2.0.0 OK", "421 4.3.2 Service shutting down", "550 5.7.1 Relaying denied",
    "", "25", "250", "2500 x", "abc def", "250\tOK", "399 odd", "612 nonsense",
])
def test_enhance_leaves_alone(reply) -> None:
    assert enhance(reply) == reply


@pytest.mark.parametrize("reply, expected", [
    ("250 Hello", "250 2.0.0 Hello"),
    ("221 Bye", "221 2.0.0 Bye"),
    ("421 Too busy", "421 4.0.0 Too busy"),
    ("451 Error: try later", "451 4.0.0 try later"),
    ("500 Error: odd", "500 5.5.2 odd"),
    ("501 bad args", "501 5.5.4 bad args"),
    ("502 nope", "502 5.5.1 nope"),
    ("503 order", "503 5.5.1 order"),
    ("504 param", "504 5.5.4 param"),
    ("550 no such user", "550 5.5.0 no such user"),
    ("554 Transaction failed", "554 5.5.0 Transaction failed"),
    ("250 ", "250 2.0.0 "),
])
def test_enhance_adds_a_code_of_the_right_class(reply, expected) -> None:
    out = enhance(reply)
    assert out == expected
    assert out[4] == out[0]
    assert enhance(out) == out  # idempotent


def test_permanent_and_transient() -> None:
    assert is_permanent(550) and is_permanent(599) and not is_permanent(450) and not is_permanent(600)
    assert is_transient(421) and is_transient(499) and not is_transient(500) and not is_transient(250)


# --------------------------------------------------------------------------- prepare_message

NOW = 1_700_000_000.0
DATE_NOW = "Tue, 14 Nov 2023 22:13:20 +0000"  # RFC 5322: a numeric zone, never "GMT"


def _prep(data: bytes, **kw):
    args = dict(node_name="node1.transportd.test", client_ip="127.0.0.1", helo="client.test",
                network_message_id="0b5a7c1e-0000-4000-8000-000000000001", now=NOW)
    args.update(kw)
    return prepare_message(data, **args)


def _headers(data: bytes) -> list[tuple[str, str]]:
    head, _ = split_headers(data)
    msg = email.message_from_bytes(head)
    return list(msg.items())


def test_bare_message_gets_received_message_id_and_date() -> None:
    body = b"Subject: hello there\r\n\r\nbody line\r\n"
    p = _prep(body)
    assert p.data.endswith(body)
    prefix = p.data[: -len(body)]
    assert prefix.startswith(b"Received: from client.test ([127.0.0.1])\r\n\tby node1.transportd.test (frontend)"
                             b" with ESMTP id 0b5a7c1e-0000-4000-8000-000000000001;\r\n\t"
                             + DATE_NOW.encode() + b"\r\n")
    assert p.message_id == "<0b5a7c1e-0000-4000-8000-000000000001@node1.transportd.test>"
    assert p.submit_time == DATE_NOW
    assert p.subject == "hello there"
    names = [k for k, _ in _headers(p.data)]
    assert names == ["Received", "Message-ID", "Date", "Subject"]
    assert dict(_headers(p.data))["Message-ID"] == p.message_id
    assert dict(_headers(p.data))["Date"] == DATE_NOW
    assert p.data.count(b"\r\n\r\n") == 1  # headers still end once, before the body


def test_existing_message_id_and_date_are_kept() -> None:
    body = (b"Message-ID: <orig-1@sender.test>\r\nDate: Mon, 06 Jan 2025 10:00:00 +0100\r\n"
            b"Subject: keep\r\nFrom: a@sender.test\r\n\r\nhi\r\n")
    p = _prep(body, tls=True, connector="peer")
    assert p.message_id == "<orig-1@sender.test>"
    assert p.submit_time == "Mon, 06 Jan 2025 10:00:00 +0100"
    assert p.subject == "keep"
    hdrs = _headers(p.data)
    assert [k for k, _ in hdrs].count("Message-ID") == 1
    assert [k for k, _ in hdrs].count("Date") == 1
    assert hdrs[0][0] == "Received"
    assert b"(peer) with ESMTPS id" in p.data
    assert p.data.endswith(body)


def test_only_the_missing_one_is_added() -> None:
    p = _prep(b"Message-ID: <m@x.test>\r\n\r\nbody\r\n")
    assert p.message_id == "<m@x.test>" and p.submit_time == DATE_NOW
    assert [k for k, _ in _headers(p.data)] == ["Received", "Date", "Message-ID"]
    p = _prep(b"Date: Tue, 07 Jan 2025 00:00:00 +0000\r\n\r\nbody\r\n")
    assert p.submit_time == "Tue, 07 Jan 2025 00:00:00 +0000"
    assert [k for k, _ in _headers(p.data)] == ["Received", "Message-ID", "Date"]
    assert p.subject == ""


@pytest.mark.parametrize("data", [b"hello world\r\n", b"\tfolded into nothing\r\nmore\r\n",
                                  b"From sender Mon Jan  6 10:00:00 2025\r\nhi\r\n", b"no line end"])
def test_a_message_without_a_header_section_keeps_its_text_as_the_body(data) -> None:
    """DATA straight into a body (telnet, scripts): our fields are the header section and the
    client's text the body, after the blank line (else its first line reads as a broken header
    field, or folds into our Date); the client's octets are kept as they came."""
    p = _prep(data)
    head, body = split_headers(p.data)
    assert body == data and head.endswith(b"\r\n\r\n")
    assert [k for k, _ in _headers(p.data)] == ["Received", "Message-ID", "Date"]
    assert dict(_headers(p.data))["Date"] == DATE_NOW
    assert email.message_from_bytes(p.data).get_payload() == data.decode()


@pytest.mark.parametrize("data", [b"Subject: s\r\n\r\nbody\r\n", b"\r\nbody after an empty header section\r\n",
                                  b"X-Odd!Name: v\r\n\r\nb\r\n", b"Subject : obsolete\r\n\r\nb\r\n", b""])
def test_a_header_section_as_sent_is_not_given_a_blank_line(data) -> None:
    p = _prep(data)
    assert p.data.endswith(data) and p.data.count(b"\r\n\r\n") == data.count(b"\r\n\r\n") \
        + (1 if data.startswith(b"\r\n") else 0)


def test_received_names_the_protocol_used() -> None:
    """RFC 3848 (SMTP after HELO, ESMTP after EHLO, S with TLS, A with AUTH) and RFC 6531 3.7.3
    (UTF8SMTP for an SMTPUTF8 transaction)."""
    cases = {(False, False, False, False): "SMTP", (True, False, False, False): "ESMTP",
             (True, True, False, False): "ESMTPS", (True, False, True, False): "ESMTPA",
             (True, True, True, False): "ESMTPSA", (True, False, False, True): "UTF8SMTP",
             (True, True, False, True): "UTF8SMTPS", (True, True, True, True): "UTF8SMTPSA",
             (True, False, True, True): "UTF8SMTPA"}
    for (extended, tls, auth, utf8), proto in cases.items():
        assert received_protocol(extended=extended, tls=tls, authenticated=auth, smtputf8=utf8) == proto
        p = _prep(b"Subject: x\r\n\r\nb\r\n", extended=extended, tls=tls, authenticated=auth, smtputf8=utf8)
        assert f") with {proto} id ".encode() in p.data.split(b"\r\n\r\n")[0]
        # the next node of the cluster reads the network-message-id back, whatever the protocol
        assert network_id_from(p.data) == "0b5a7c1e-0000-4000-8000-000000000001"


def test_received_is_added_every_time() -> None:
    first = _prep(b"Subject: s\r\n\r\nx\r\n")
    second = _prep(first.data, node_name="node2.transportd.test", network_message_id="second-id")
    received = [v for k, v in _headers(second.data) if k == "Received"]
    assert len(received) == 2
    assert "node2.transportd.test" in received[0] and "node1.transportd.test" in received[1]
    assert second.message_id == first.message_id  # Message-ID and Date are not added twice
    assert [k for k, _ in _headers(second.data)].count("Message-ID") == 1


@pytest.mark.parametrize("client_ip, literal", [
    ("127.0.0.1", "127.0.0.1"), ("::1", "IPv6:::1"), ("2001:DB8:0:0::1", "IPv6:2001:db8::1"),
    ("fe80::1%eth0", "IPv6:fe80::1"), ("::ffff:192.0.2.7", "192.0.2.7"), ("", "unknown"),
    ("not an [ip]", "not?an??ip?"),
])
def test_received_names_the_client_by_an_rfc5321_address_literal(client_ip, literal) -> None:
    """RFC 5321 4.4's TCP-info: an IPv6 client is ``[IPv6:...]``, never a bare ``[::1]``."""
    first_line = _prep(b"Subject: x\r\n\r\n", client_ip=client_ip).data.split(b"\r\n", 1)[0]
    assert first_line == f"Received: from client.test ([{literal}])".encode()


def test_helo_is_sanitised_and_lf_only_messages_work() -> None:
    p = _prep(b"Subject: lf only\n\nbody\n", helo="bad helo\x00\xff")
    first_line = p.data.split(b"\r\n", 1)[0]
    assert first_line == b"Received: from bad?helo?? ([127.0.0.1])"
    assert p.subject == "lf only"
    p = _prep(b"Subject: x\r\n\r\n", helo="")
    assert p.data.startswith(b"Received: from unknown ")


def test_headers_only_message_and_body_with_header_lookalikes() -> None:
    p = _prep(b"Subject: only headers\r\n")
    assert p.subject == "only headers"
    p = _prep(b"From: a@b.test\r\n\r\nMessage-ID: <not-a-header@x>\r\nDate: nope\r\n")
    assert p.message_id.endswith("@node1.transportd.test>")  # the body's lookalike is ignored
    assert p.submit_time == DATE_NOW
