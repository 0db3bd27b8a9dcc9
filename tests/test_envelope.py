"""envelope.plan_send: which MAIL parameters a next hop gets, or why it gets no attempt (pure)."""

from __future__ import annotations

import email
import email.policy
from datetime import UTC, datetime

from transportd.smtp.dsn import RecipientReport, build_dsn
from transportd.smtp.envelope import (NO_CONVERSION, NO_SMTPUTF8_ADDRESS, NO_SMTPUTF8_HEADERS, message_parameters,
                                 needs_smtputf8, plan_send)

ASCII = b"Subject: hi\r\nContent-Type: text/plain\r\n\r\nplain body\r\n"
UTF8_HEADERS = "Subject: Grüße\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nplain body\r\n".encode()
EIGHT_BIT_BODY = "Subject: hi\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nGrüße aus Köln\r\n".encode()


def plan(sender="a@example.test", rcpts=("b@elsewhere.test",), data=ASCII, smtputf8=False, body_type="",
         utf8=True, eight=True):
    return plan_send(sender, rcpts, data, smtputf8=smtputf8, body_type=body_type,
                     next_hop_smtputf8=utf8, next_hop_8bitmime=eight)


def test_ascii_message_gets_no_parameters():
    p = plan()
    assert p.options == [] and p.data == ASCII and p.error is None


def test_utf8_address_sends_smtputf8_and_needs_it():
    assert plan(sender="jürgen@bücher.example").options == ["SMTPUTF8"]
    assert plan(rcpts=("δοκιμή@example.test",)).options == ["SMTPUTF8"]
    refused = plan(rcpts=("δοκιμή@example.test",), utf8=False)
    assert refused.error == NO_SMTPUTF8_ADDRESS and " 5.6.7 " in refused.error


def test_utf8_headers_need_smtputf8_only_when_received_so():
    assert plan(data=UTF8_HEADERS, smtputf8=True, body_type="8BITMIME").options == ["SMTPUTF8", "BODY=8BITMIME"]
    assert plan(data=UTF8_HEADERS, smtputf8=True, utf8=False).error == NO_SMTPUTF8_HEADERS
    # Received without SMTPUTF8 (legacy 8-bit headers): not an SMTPUTF8 message.
    assert "SMTPUTF8" not in plan(data=UTF8_HEADERS, smtputf8=False).options
    # SMTPUTF8 given for an all-ASCII message: not needed on the next hop (RFC 6531 3.4).
    assert plan(smtputf8=True).options == []
    assert needs_smtputf8("a@b", ["c@d"], ASCII, True) is False


def test_8bitmime_is_kept_when_received_so_even_for_7bit_content():
    assert plan(body_type="8BITMIME").options == ["BODY=8BITMIME"]
    assert plan(data=EIGHT_BIT_BODY).options == ["BODY=8BITMIME"]
    # Declared 8BITMIME but 7-bit content, next hop without 8BITMIME: sent as it is.
    p = plan(body_type="8BITMIME", eight=False)
    assert p.options == [] and p.data == ASCII and not p.converted


def test_8bit_body_to_a_7bit_next_hop_is_converted():
    p = plan(data=EIGHT_BIT_BODY, body_type="8BITMIME", eight=False)
    assert p.error is None and p.converted and p.data.isascii() and p.options == []
    got = email.message_from_bytes(p.data, policy=email.policy.default)
    want = email.message_from_bytes(EIGHT_BIT_BODY, policy=email.policy.default)
    assert got.get_content() == want.get_content() and "Grüße aus Köln" in got.get_content()


def test_a_nul_in_the_body_to_a_7bit_next_hop_is_converted():
    """RFC 2045 2.7: 7bit data holds no NUL, so a body with one and no 8-bit octet is converted for
    a next hop without 8BITMIME (mime7bit re-encodes the part), and decodes the same; a next hop
    with 8BITMIME gets it as it is, with no BODY= that the octets do not ask for."""
    data = b"Subject: nul\r\nContent-Type: application/octet-stream\r\n\r\nab\x00cd\r\n"
    p = plan(data=data, eight=False)
    assert p.error is None and p.converted and b"\0" not in p.data and p.options == []
    assert b"Content-Transfer-Encoding: base64" in p.data
    got = email.message_from_bytes(p.data, policy=email.policy.default)
    assert got.get_payload(decode=True) == b"ab\x00cd\r\n"
    text = plan(data=b"Subject: nul\r\n\r\nline \x00 one\r\n", eight=False)
    assert text.converted and b"line =00 one" in text.data and b"\0" not in text.data
    kept = plan(data=data)
    assert kept.data == data and kept.options == [] and not kept.converted
    # A NUL in a header is no body to convert: sent as it is, as before.
    head_nul = b"Subject: a\x00b\r\n\r\nbody\r\n"
    assert plan(data=head_nul, eight=False) == plan(data=head_nul) and not plan(data=head_nul, eight=False).converted


def test_8bit_headers_to_a_next_hop_without_either_extension_are_refused():
    # Legacy 8-bit headers (no SMTPUTF8 received): cannot be made 7-bit, never sent unannounced.
    p = plan(data=UTF8_HEADERS, eight=False, utf8=False)
    assert p.error == NO_CONVERSION and " 5.6.3 " in p.error


def test_message_parameters_for_peers():
    assert message_parameters("a@b", ["c@d"], ASCII, smtputf8=False, body_type="") == []
    assert message_parameters("ü@b", ["c@d"], EIGHT_BIT_BODY, smtputf8=True, body_type="") == \
        ["SMTPUTF8", "BODY=8BITMIME"]


def test_an_rfc6533_dsn_to_an_ascii_sender_goes_7bit_to_a_next_hop_without_smtputf8():
    """RFC 6533 3: a DSN (null sender) is sent as the classic 7-bit DSN rather than lost; any other
    message with UTF-8 headers still gets no attempt, and so does a DSN to a non-ASCII address."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    def dsn(sender):
        return build_dsn(reporting_mta="node.test", original_sender=sender, original_message=UTF8_HEADERS,
                         recipients=[RecipientReport(address="δοκιμή@elsewhere.test", status="5.1.1")],
                         arrival_date=now, now=now, utf8=True)
    utf8 = dsn("a@example.test")
    for eight in (True, False):
        p = plan(sender="", rcpts=("a@example.test",), data=utf8, smtputf8=True, body_type="8BITMIME", utf8=False,
                 eight=eight)
        assert p.error is None and p.downgraded and p.options == [] and p.data.isascii(), p
        assert b"message/delivery-status" in p.data and b"Final-Recipient: utf-8;" in p.data and b"\\x{3B4}" in p.data
    # With SMTPUTF8 on the next hop: as it is.
    p = plan(sender="", rcpts=("a@example.test",), data=utf8, smtputf8=True, body_type="8BITMIME")
    assert p.data == utf8 and not p.downgraded and p.options == ["SMTPUTF8", "BODY=8BITMIME"]
    assert plan(sender="x@example.test", rcpts=("a@example.test",), data=utf8, smtputf8=True,
                utf8=False).error == NO_SMTPUTF8_HEADERS
    assert plan(sender="", rcpts=("jürgen@example.test",), data=dsn("jürgen@example.test"), smtputf8=True,
                utf8=False).error == NO_SMTPUTF8_ADDRESS
