"""Tests for transportd.smtp.mime7bit: 8-bit to 7-bit conversion (RFC 6152 / RFC 2045 / RFC 2046).

The yardstick is Python's email package (policy.default): every part decodes
(``get_payload(decode=True)``) to the same bytes before and after the conversion,
the output is ASCII with lines of at most 998 octets when the headers are ASCII,
and headers are kept byte for byte except Content-Transfer-Encoding.
"""

from __future__ import annotations

import base64
import binascii
import email
import email.parser
import email.policy
import quopri
import re

import pytest
from helpers import folded
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from transportd.smtp import mime7bit
from transportd.smtp.mime7bit import is_7bit, needs_smtputf8_headers, to_7bit

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _parse(raw: bytes) -> email.message.EmailMessage:
    return email.message_from_bytes(raw, policy=email.policy.default)


def _leaves(raw: bytes) -> list[tuple[str, bytes | None]]:
    """(content type, decoded payload) of every leaf, in walk order."""
    return [
        (part.get_content_type(), part.get_payload(decode=True))
        for part in _parse(raw).walk()
        if not part.is_multipart()
    ]


def _head(raw: bytes) -> bytes:
    return raw.split(b"\r\n\r\n", 1)[0]


def _body(raw: bytes) -> bytes:
    return raw.split(b"\r\n\r\n", 1)[1]


def _assert_wire_safe(raw: bytes) -> None:
    assert is_7bit(raw), "output is not 7-bit"
    assert all(len(line) <= 998 for line in raw.split(b"\r\n")), "line over 998 octets"


def _assert_same_content(original: bytes, converted: bytes) -> None:
    assert _leaves(converted) == _leaves(original)


def _qp_lines_ok(body: bytes) -> None:
    for line in body.split(b"\r\n"):
        assert len(line) <= 76, line
        assert not line.endswith((b" ", b"\t")), line
        assert re.fullmatch(rb"(?:[\x21-\x3c\x3e-\x7e \t]|=[0-9A-F]{2})*=?", line), line


# --------------------------------------------------------------------------- helpers


def test_is_7bit() -> None:
    assert is_7bit(b"")
    assert is_7bit(b"Subject: x\r\n\r\n" + b"a" * 5000 + b"\r\n")  # long lines are not its business
    assert not is_7bit(b"caf\xc3\xa9")
    assert not is_7bit(b"nul \x00 here")
    assert not is_7bit(b"\x80")


def test_needs_smtputf8_headers() -> None:
    assert not needs_smtputf8_headers(b"Subject: hi\r\n\r\nGr\xc3\xbc\xc3\x9fe\r\n")
    assert needs_smtputf8_headers("Subject: Grüße\r\n\r\nbody\r\n".encode())
    assert needs_smtputf8_headers("From: jörg@example.de\r\n".encode())  # no body at all
    assert not needs_smtputf8_headers(b"Subject: x\n\nbody \xff\n")  # bare LF line ends
    assert not needs_smtputf8_headers(b"\r\nbody \xff")  # empty header block
    assert not needs_smtputf8_headers(b"")


# --------------------------------------------------------------------------- simple messages


def test_clean_message_is_returned_unchanged() -> None:
    raw = (
        b"Subject: hi\r\nMIME-Version: 1.0\r\nContent-Type: text/plain\r\n"
        b"Content-Transfer-Encoding: 8bit\r\n\r\nplain ascii\r\n"
    )
    assert to_7bit(raw) == raw
    assert to_7bit(b"") == b""
    assert to_7bit(b"Subject: only headers\r\n") == b"Subject: only headers\r\n"


def test_non_mime_utf8_body_gets_mime_headers_and_quoted_printable() -> None:
    raw = "Subject: hi\r\nFrom: a@example.org\r\n\r\nGrüße aus Köln\r\nzweite Zeile\r\n".encode()
    out = to_7bit(raw)
    _assert_wire_safe(out)
    assert out.startswith(b"Subject: hi\r\nFrom: a@example.org\r\n")  # kept, in order
    assert _head(out).split(b"\r\n")[2:] == [
        b"MIME-Version: 1.0",
        b"Content-Type: text/plain; charset=utf-8",
        b"Content-Transfer-Encoding: quoted-printable",
    ]
    # Text line breaks stay real CRLF line breaks.
    assert _body(out) == b"Gr=C3=BC=C3=9Fe aus K=C3=B6ln\r\nzweite Zeile\r\n"
    msg = _parse(out)
    assert msg.get_content() == "Grüße aus Köln\r\nzweite Zeile\r\n"
    _assert_same_content(raw, out)


def test_non_utf8_body_is_unknown_8bit() -> None:
    raw = b"Subject: latin-1\r\n\r\ncaf\xe9 cr\xe8me\r\n"
    out = to_7bit(raw)
    _assert_wire_safe(out)
    assert b"\r\nContent-Type: text/plain; charset=unknown-8bit\r\n" in out
    assert _parse(out).get_payload(decode=True) == b"caf\xe9 cr\xe8me\r\n"


def test_mime_version_present_content_type_missing() -> None:
    raw = b"MIME-Version: 1.0\r\nSubject: x\r\n\r\n\xc3\xa9\r\n"
    out = to_7bit(raw)
    assert out.count(b"MIME-Version") == 1
    assert b"Content-Type: text/plain; charset=utf-8\r\n" in out
    _assert_same_content(raw, out)


def test_only_the_content_transfer_encoding_header_changes() -> None:
    head = (
        b"Received: from a by b;\r\n\tWed, 01 May 2024 12:00:00 +0000\r\n"
        b"Subject: =?utf-8?q?Gr=C3=BC=C3=9Fe?=\r\n"
        b"MIME-Version: 1.0\r\n"
        b"Content-Type: text/plain;\r\n charset=\"utf-8\"\r\n"
        b"Content-Transfer-Encoding:\r\n 8bit\r\n"
        b"X-Odd:   spacing   kept  \r\n"
        b"Content-Transfer-Encoding: binary\r\n"
    )
    raw = head + b"\r\n" + "ü".encode() * 10 + b"\r\n"
    out = to_7bit(raw)
    _assert_wire_safe(out)
    expected_head = (
        b"Received: from a by b;\r\n\tWed, 01 May 2024 12:00:00 +0000\r\n"
        b"Subject: =?utf-8?q?Gr=C3=BC=C3=9Fe?=\r\n"
        b"MIME-Version: 1.0\r\n"
        b"Content-Type: text/plain;\r\n charset=\"utf-8\"\r\n"
        b"Content-Transfer-Encoding: quoted-printable\r\n"
        b"X-Odd:   spacing   kept  \r\n"
    )
    assert _head(out) + b"\r\n" == expected_head
    _assert_same_content(raw, out)


def test_eight_bit_headers_are_kept_for_the_caller() -> None:
    raw = "Subject: Grüße\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nKöln\r\n".encode()
    out = to_7bit(raw)
    assert out.startswith("Subject: Grüße\r\n".encode())
    assert needs_smtputf8_headers(out)
    assert _body(out).isascii()
    _assert_same_content(raw, out)


def test_long_7bit_lines_are_converted() -> None:
    raw = b"Subject: x\r\nContent-Type: text/plain\r\n\r\n" + b"a" * 3000 + b"\r\n"
    out = to_7bit(raw)
    _assert_wire_safe(out)
    assert b"Content-Transfer-Encoding: quoted-printable" in out
    _qp_lines_ok(_body(out))
    _assert_same_content(raw, out)


# --------------------------------------------------------------------------- quoted-printable


def test_quoted_printable_details() -> None:
    body = (
        b"a=b \xc3\xa9 trailing space \r\n"
        b"tab at end\t\r\n"
        b"bare\rcr and bare\nlf\r\n"
        + b"x" * 70 + b"\xc3\xa9" * 40 + b"\r\n"
        + b"y" * 75 + b"--boundary-like continuation\r\n"
        + b"-- \r\n"  # a signature separator keeps its dashes
        + b"last line without break \xe2\x82\xac "
    )
    raw = b"Content-Type: text/plain; charset=utf-8\r\n\r\n" + body
    out = to_7bit(raw)
    _assert_wire_safe(out)
    encoded = _body(out)
    _qp_lines_ok(encoded)
    lines = encoded.split(b"\r\n")
    assert lines[0] == b"a=3Db =C3=A9 trailing space=20"
    assert lines[1] == b"tab at end=09"
    assert lines[2] == b"bare=0Dcr and bare=0Alf"
    assert b"-- =20" not in encoded and b"\r\n-- \r\n" not in encoded
    assert b"\r\n--=20\r\n" in encoded
    # A soft-break continuation never starts with "-" (it could look like a boundary).
    for prev, line in zip(lines, lines[1:]):
        if prev.endswith(b"="):
            assert not line.startswith(b"-")
    assert b"=2D-boundary-like" in encoded
    assert lines[-1].endswith(b"=E2=82=AC=20")
    assert binascii.a2b_qp(encoded) == body
    assert quopri.decodestring(encoded) == body
    _assert_same_content(raw, out)


# --------------------------------------------------------------------------- multipart


def _multipart_message() -> bytes:
    png = bytes(range(256))
    return (
        b"From: a@example.org\r\n"
        b"MIME-Version: 1.0\r\n"
        b'Content-Type: multipart/mixed; boundary="=_outer"\r\n'
        b"Content-Transfer-Encoding: 8bit\r\n"
        b"\r\n"
        b"This is a multi-part message in MIME format.\r\n"
        b"--=_outer\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\n"
        b"Content-Transfer-Encoding: 8bit\r\n"
        b"\r\n"
        + "Grüße\r\nzweite Zeile\r\n".encode()
        + b"\r\n--=_outer\r\n"
        b"Content-Type: text/plain; charset=us-ascii\r\n"
        b"\r\n"
        b"seven bit part\r\n"
        b"--=_outer\r\n"
        b"Content-Type: text/html; charset=utf-8\r\n"
        b"Content-Transfer-Encoding: quoted-printable\r\n"
        b"\r\n"
        b"<p>Gr=C3=BC=C3=9Fe</p>=\r\n"
        b"--=_outer\r\n"
        b"Content-Type: image/png\r\n"
        b"Content-Transfer-Encoding: base64\r\n"
        b"\r\n"
        + base64.encodebytes(png).replace(b"\n", b"\r\n")
        + b"--=_outer\r\n"
        b"Content-Type: application/octet-stream\r\n"
        b"Content-Transfer-Encoding: binary\r\n"
        b"\r\n"
        + png
        + b"\r\n--=_outer\r\n"
        b'Content-Type: multipart/alternative; boundary="=_inner"\r\n'
        b"\r\n"
        b"--=_inner\r\n"
        b"Content-Type: text/plain; charset=iso-8859-1\r\n"
        b"\r\n"
        b"caf\xe9\r\n"
        b"--=_inner--\r\n"
        b"\r\n--=_outer--\r\n"
        b"epilogue\r\n"
    )


def test_multipart_converts_only_8bit_leaves() -> None:
    raw = _multipart_message()
    out = to_7bit(raw)
    _assert_wire_safe(out)
    _assert_same_content(raw, out)
    msg = _parse(out)
    assert not msg.defects
    assert msg.preamble == "This is a multi-part message in MIME format."
    assert msg.epilogue == "epilogue\r\n"
    # The multipart's own 8bit label is now a lie: 7bit.
    assert _head(out).endswith(b"Content-Transfer-Encoding: 7bit")
    parts = msg.get_payload()
    assert parts[0]["Content-Transfer-Encoding"] == "quoted-printable"
    assert parts[0].get_content() == "Grüße\r\nzweite Zeile\r\n"
    assert parts[4]["Content-Transfer-Encoding"] == "base64"  # non-text 8-bit: base64
    assert parts[4].get_payload(decode=True) == bytes(range(256))
    inner = parts[5].get_payload()[0]
    assert inner["Content-Transfer-Encoding"] == "quoted-printable"
    assert inner.get_content() == "café"
    # 7-bit, quoted-printable and base64 parts are kept byte for byte, as are boundaries.
    for kept in (
        b"--=_outer\r\nContent-Type: text/plain; charset=us-ascii\r\n\r\nseven bit part\r\n",
        b"\r\n\r\n<p>Gr=C3=BC=C3=9Fe</p>=\r\n--=_outer\r\n",
        base64.encodebytes(bytes(range(256))).replace(b"\n", b"\r\n"),
        b'Content-Type: multipart/alternative; boundary="=_inner"\r\n\r\n--=_inner\r\n',
        b"\r\n--=_inner--\r\n\r\n--=_outer--\r\nepilogue\r\n",
    ):
        assert kept in out


def test_eight_bit_preamble_and_epilogue_are_made_7bit() -> None:
    raw = (
        b'Content-Type: multipart/mixed; boundary="b"\r\n\r\n'
        b"pr\xe9ambule\r\n--b\r\n\r\nbody\r\n--b--\r\n\xff epilogue " + b"e" * 2000 + b"\r\n"
    )
    out = to_7bit(raw)
    _assert_wire_safe(out)
    assert b"pr?ambule\r\n--b\r\n\r\nbody\r\n--b--\r\n? epilogue " in out
    _assert_same_content(raw, out)


def test_message_rfc822_is_converted_inside_and_labelled_7bit() -> None:
    inner = (
        b"Subject: inner\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Transfer-Encoding: 8bit\r\n\r\nK\xc3\xb6ln\r\n"
    )
    raw = (
        b"MIME-Version: 1.0\r\n"
        b'Content-Type: multipart/mixed; boundary="b"\r\n\r\n'
        b"--b\r\nContent-Type: text/plain\r\n\r\nsee attached\r\n"
        b"--b\r\nContent-Type: message/rfc822\r\nContent-Transfer-Encoding: 8bit\r\n\r\n"
        + inner
        + b"--b--\r\n"
    )
    out = to_7bit(raw)
    _assert_wire_safe(out)
    _assert_same_content(raw, out)
    attached = _parse(out).get_payload()[1]
    assert attached.get_content_type() == "message/rfc822"
    assert attached["Content-Transfer-Encoding"] == "7bit"
    message = attached.get_content()
    assert message["Subject"] == "inner"
    assert message["Content-Transfer-Encoding"] == "quoted-printable"
    assert message.get_content() == "Köln"  # the CRLF before "--b--" is the boundary's


def test_top_level_message_rfc822_without_mime_headers_inside() -> None:
    raw = b"Content-Type: message/rfc822\r\n\r\nSubject: inner\r\n\r\nbody \xe9\r\n"
    out = to_7bit(raw)
    _assert_wire_safe(out)
    _assert_same_content(raw, out)
    assert b"\r\n\r\nSubject: inner\r\nMIME-Version: 1.0\r\n" in out
    assert b"Content-Type: text/plain; charset=unknown-8bit\r\n" in out


def test_multipart_digest_parts_default_to_message_rfc822() -> None:
    raw = (
        b'Content-Type: multipart/digest; boundary="d"\r\n\r\n'
        b"--d\r\n\r\nSubject: one\r\n\r\nGr\xc3\xbc\xc3\x9fe\r\n"
        b"--d--\r\n"
    )
    out = to_7bit(raw)
    _assert_wire_safe(out)
    _assert_same_content(raw, out)
    part = _parse(out).get_payload()[0]
    assert part.get_content_type() == "message/rfc822"
    assert part.get_content().get_content() == "Grüße"


def test_message_global_is_encoded_as_a_whole() -> None:
    # RFC 6532 3.5: message/global may be quoted-printable/base64 for a 7-bit path.
    inner = "Subject: Grüße\r\nFrom: jörg@example.de\r\n\r\nKöln\r\n".encode()
    raw = (
        b'Content-Type: multipart/report; report-type=delivery-status; boundary="r"\r\n\r\n'
        b"--r\r\nContent-Type: text/plain\r\n\r\nreport\r\n"
        b"--r\r\nContent-Type: message/global\r\nContent-Transfer-Encoding: 8bit\r\n\r\n"
        + inner
        + b"--r--\r\n"
    )
    out = to_7bit(raw)
    _assert_wire_safe(out)
    encoded = out.split(b"Content-Type: message/global\r\n", 1)[1]
    assert encoded.startswith(b"Content-Transfer-Encoding: quoted-printable\r\n\r\n")
    qp = encoded.split(b"\r\n\r\n", 1)[1].split(b"\r\n--r--", 1)[0]
    assert binascii.a2b_qp(qp) == inner.removesuffix(b"\r\n")


def test_malformed_quoted_printable_and_base64_parts_are_reencoded() -> None:
    raw = (
        b'Content-Type: multipart/mixed; boundary="b"\r\n\r\n'
        b"--b\r\nContent-Type: text/plain; charset=latin-1\r\n"
        b"Content-Transfer-Encoding: quoted-printable\r\n\r\n"
        b"raw \xe9 and =E9 and =\xff and =\r\nsoft\r\n"
        b"--b\r\nContent-Type: application/pdf\r\nContent-Transfer-Encoding: base64\r\n\r\n"
        b"AAEC\xffAwQF\r\n"
        b"--b--\r\n"
    )
    out = to_7bit(raw)
    _assert_wire_safe(out)
    _assert_same_content(raw, out)


def test_multipart_without_boundary_or_start_boundary_is_one_part() -> None:
    for raw in (
        b"Content-Type: multipart/mixed\r\n\r\nno boundary \xe9\r\n",
        b'Content-Type: multipart/mixed; boundary="zz"\r\n\r\nnever a boundary \xe9\r\n',
        b'Content-Type: multipart/mixed; boundary="zz"\r\n\r\n--zz--\r\nclose first \xe9\r\n',
    ):
        out = to_7bit(raw)
        _assert_wire_safe(out)
        _assert_same_content(raw, out)


def test_unterminated_multipart_keeps_each_parts_content() -> None:
    raw = (
        b'Content-Type: multipart/mixed; boundary="b"\r\n\r\n'
        b"--b\r\nContent-Type: text/plain; charset=utf-8\r\n\r\n\xc3\xa9 one\r\n"
        b"--b\r\nContent-Type: application/octet-stream\r\n\r\n\x00\xff two\n"
    )
    out = to_7bit(raw)
    _assert_wire_safe(out)
    _assert_same_content(raw, out)


MALFORMED = [
    b"",
    b"\xff\xfe\x00garbage\rmixed\nline\r\nendings\n\r\n\r\n\xff",
    b"no header block at all, just text \xe9\xe9",
    b"\r\n\r\nbody only \x80",
    b"Subject: x\r\n\r\n" + b"\xff" * 5000,
    b"Content-Type: multipart/mixed; boundary=\r\n\r\n--\r\n\xff\r\n----\r\n",
    b'Content-Type: multipart/mixed; boundary="\xff\xfe"\r\n\r\n--\xff\xfe\r\n\r\n\xe9\r\n',
    b"Content-Type: multipart/mixed; boundary=b\r\n\r\n--b\r\n--b\r\n--b--\r\n--b\r\n\xe9\r\n",
    b"Content-Type: text/plain; charset=\"\r\n\r\n\xe9",
    b"Content-Type: ;;;===\r\nContent-Transfer-Encoding: ((\r\n\r\n\xe9\r\n",
    b"Content-Type: message/rfc822\r\n\r\n",
    b"Content-Type: message/rfc822\r\n\r\nContent-Type: message/rfc822\r\n\r\n\xe9",
    b"Content-Transfer-Encoding: x-uuencode\r\n\r\nbegin 644 f\r\n\xff\r\nend\r\n",
    b"Content-Type: multipart/mixed; boundary=a\r\n\r\n"
    + b"--a\r\nContent-Type: multipart/mixed; boundary=a\r\n\r\n" * 80
    + b"\xe9\r\n",
    b"A: b\r\nFrom mbox line\r\n\r\nbody \xe9\r\n",
    b"From mbox line\r\nSubject: x\r\n\r\nbody \xe9\r\n",
    b":\r\n \xff\r\n\r\n\xff",
]


@pytest.mark.parametrize("raw", MALFORMED)
def test_malformed_input_never_raises(raw: bytes) -> None:
    out = to_7bit(raw)
    if not needs_smtputf8_headers(raw):
        _assert_wire_safe(out)
    _assert_same_content(raw, out)


# --------------------------------------------------------------------------- properties

_BOUNDARY_MARK = b"--=_"


@st.composite
def _leaf_part(draw) -> bytes:
    """A leaf entity: headers + body, the body random bytes under an 8-bit label or
    properly encoded under quoted-printable/base64."""
    ctype = draw(
        st.sampled_from(
            [
                None,
                b"text/plain; charset=utf-8",
                b"text/html; charset=iso-8859-1",
                b"application/octet-stream",
                b"image/png",
            ]
        )
    )
    cte = draw(st.sampled_from([None, b"7bit", b"8bit", b"binary", b"quoted-printable", b"base64"]))
    payload = draw(
        st.one_of(
            st.binary(max_size=300),
            st.text(max_size=200).map(lambda t: t.replace("\n", "\r\n").encode("utf-8")),
            st.binary(min_size=900, max_size=2500),
        )
    )
    if cte == b"quoted-printable":
        payload = binascii.b2a_qp(payload).replace(b"\n", b"\r\n")
    elif cte == b"base64":
        payload = base64.encodebytes(payload).replace(b"\n", b"\r\n")
    assume(_BOUNDARY_MARK not in payload)
    head = b""
    if ctype is not None:
        head += b"Content-Type: " + ctype + b"\r\n"
    if cte is not None:
        head += b"Content-Transfer-Encoding: " + cte + b"\r\n"
    return head + b"\r\n" + payload


@st.composite
def _entity(draw, depth: int = 0) -> bytes:
    kinds = ["leaf", "leaf", "multipart", "message"] if depth < 3 else ["leaf"]
    kind = draw(st.sampled_from(kinds))
    if kind == "leaf":
        return draw(_leaf_part())
    if kind == "message":
        inner = draw(_entity(depth + 1))
        cte = draw(st.sampled_from([b"", b"Content-Transfer-Encoding: 8bit\r\n"]))
        return b"Content-Type: message/rfc822\r\n" + cte + b"\r\nSubject: inner\r\n" + inner
    boundary = b"=_b%d_%s" % (depth, draw(st.sampled_from([b"x", b"yy", b"z'z"])))
    parts = draw(st.lists(_entity(depth + 1), min_size=1, max_size=4))
    preamble = draw(st.sampled_from([b"", b"preamble\r\n", b"pr\xe9amble\r\n"]))
    closed = draw(st.booleans())
    epilogue = draw(st.sampled_from([b"", b"epilogue\r\n", b"\xffepilogue"])) if closed else b""
    body = preamble
    for part in parts:
        body += b"--" + boundary + b"\r\n" + part + b"\r\n"
    if closed:
        body += b"--" + boundary + b"--\r\n" + epilogue
    subtype = draw(st.sampled_from([b"mixed", b"alternative", b"related"]))
    return (
        b"Content-Type: multipart/" + subtype + b'; boundary="' + boundary + b'"\r\n'
        b"\r\n" + body
    )


@PROPERTY
@given(st.binary(max_size=3000), st.booleans())
def test_property_random_body_of_a_plain_message(body: bytes, mime: bool) -> None:
    head = b"From: a@example.org\r\nSubject: random\r\n"
    if mime:
        head += b"MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\n"
    raw = head + b"\r\n" + body
    out = to_7bit(raw)
    _assert_wire_safe(out)
    assert out.startswith(head)
    _assert_same_content(raw, out)
    if _body(out) and b"quoted-printable" in _head(out):
        _qp_lines_ok(_body(out))


@PROPERTY
@given(_entity())
def test_property_structured_mime(entity: bytes) -> None:
    raw = b"From: a@example.org\r\nMIME-Version: 1.0\r\n" + entity
    out = to_7bit(raw)
    _assert_wire_safe(out)
    _assert_same_content(raw, out)
    if is_7bit(raw) and not re.search(rb"[^\r\n]{999}", raw):
        assert out == raw


@PROPERTY
@given(st.binary(max_size=2000))
def test_property_garbage_never_raises(raw: bytes) -> None:
    out = to_7bit(raw)
    assert isinstance(out, bytes)
    if not needs_smtputf8_headers(raw) and b":" not in raw:
        # No header at all: the whole input is one text body.
        _assert_wire_safe(out)
        _assert_same_content(raw, out)


# --------------------------------------------------------------------------- hostile headers
# The email package's header parser takes time that grows with the square of a field's length
# (encoded-words, RFC 2231 sections, many parameters): the converter gives it only what it must
# (tests/test_poison.py: such a message does not hold up the others on a node).


def _reference_head_info(head: bytes, default_type: str) -> tuple[str, str | None, str]:
    """What the email package (policy.default) reads in a whole header block: the yardstick."""
    try:
        msg = email.parser.BytesHeaderParser(policy=email.policy.default).parsebytes(head)
        msg.set_default_type(default_type)
        ctype = msg.get_content_type()
        cte = str(msg.get("content-transfer-encoding", "")).lower()
        boundary = msg.get_boundary() if ctype.startswith("multipart/") else None
    except Exception:  # noqa: BLE001
        return default_type, None, ""
    return ctype, boundary, cte


@pytest.fixture
def parsed_octets(monkeypatch) -> list[int]:
    """The length of each text the email package's header parser is given."""
    seen: list[int] = []
    real = email.parser.BytesHeaderParser.parsebytes

    def parsebytes(self, text, headersonly=True):
        seen.append(len(text))
        return real(self, text, headersonly)

    monkeypatch.setattr(email.parser.BytesHeaderParser, "parsebytes", parsebytes)
    return seen


def test_a_huge_content_type_of_a_plain_type_is_never_parsed(parsed_octets: list[int]) -> None:
    """The audit's message: one part's Content-Type with 20,000 encoded-words in its name
    (280 KB, folded), an 8-bit body. Its type is read from the field's start; the email
    package's parser sees only the small multipart header (it took 40 s of the whole node
    before, growing with the square of the field)."""
    field = folded(b'Content-Type: text/plain; name="' + b"=?utf-8?q?a?= " * 20_000 + b'"')
    raw = (b"Subject: big\r\nMIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary=\"b\"\r\n\r\n"
           b"--b\r\n" + field + b"\r\n\xe9\xe9 body\r\n--b--\r\n")
    assert len(raw) > 280_000
    out = to_7bit(raw)
    _assert_wire_safe(out)
    assert out.startswith(raw[: raw.index(b"\xe9")].removesuffix(b"\r\n")), "the headers are kept"
    assert out.endswith(b"Content-Transfer-Encoding: quoted-printable\r\n\r\n=E9=E9 body\r\n--b--\r\n")
    assert sum(parsed_octets) < 100, parsed_octets


@pytest.mark.parametrize("shape", ["parameters", "encoded-words", "rfc2231"])
def test_the_header_parser_reads_a_bounded_part_of_a_message(shape: str, parsed_octets: list[int]) -> None:
    """A message of many multiparts (over 250 KB), each with a hostile Content-Type of 4 KB (many
    parameters, encoded-words, RFC 2231 sections of its boundary) and one 8-bit leaf: the email
    package's parser is given at most _PARSE_BUDGET octets of it (a second or two, where every
    part's field took 20 s); the multiparts past that are encoded as one text each, 7-bit
    all the same."""
    def hostile(i: int) -> bytes:
        if shape == "parameters":
            return b"multipart/mixed; boundary=c%d; " % i + b"a=b; " * 800
        if shape == "encoded-words":
            return b'multipart/mixed; boundary=c%d; name="' % i + b"=?utf-8?q?a?= " * 280 + b'"'
        return b"multipart/mixed; boundary*0*=c; boundary*1*=%d; " % i + b" ".join(
            b"boundary*%d*=;" % k for k in range(2, 250))
    parts = [b"--b\r\n" + folded(b"Content-Type: " + hostile(i))
             + b"\r\n--c%d\r\nContent-Type: text/plain\r\n\r\n\xe9\r\n--c%d--\r\n" % (i, i) for i in range(70)]
    raw = b"MIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary=b\r\n\r\n" + b"".join(parts) + b"--b--\r\n"
    assert len(raw) > 250_000
    out = to_7bit(raw)
    _assert_wire_safe(out)
    assert sum(parsed_octets) <= mime7bit._PARSE_BUDGET, sum(parsed_octets)
    if shape != "rfc2231":  # (the email package reads that boundary as "1")
        # a part the parser read: its 8-bit leaf alone is encoded
        assert out.count(b"--c1\r\nContent-Type: text/plain\r\nContent-Transfer-Encoding: quoted-printable") == 1


_TYPES = ["text/plain", "TEXT/Plain", "multipart/mixed", "Multipart/Alternative", "message/rfc822",
          "multipart/digest", "image/png", "text / plain", "text/ plain", " text/plain", "text/plain (c)",
          "(c) multipart/mixed", "=?utf-8?q?multipart/mixed?=", "multipart", "a/b/c", "", "x-{a}/b.c",
          "multipart/mixed\xe9", "\xe9/plain", "text/plain\t", "multipart/mixed "]
_PARAMETERS = [' boundary="b1"', "boundary=b2", ' Boundary = "b 3" ', 'boundary*0="ab"', 'boundary*1="cd"',
               "boundary*=utf-8''%41b", "boundary*0*=us-ascii''x%41", 'name="=?utf-8?q?x=3B_boundary=3Dz?="',
               'name="a\\"b"', "a=b", "", "boundary", 'boundary=""', " (comment) ", "charset=utf-8", 'name="a;b"',
               'boundary="x\\\\"', "boundary=\xe9", 'boundary="  s p  "', "=?utf-8?q?boundary?==q", 'x="unclosed',
               "boundary=a b", "name=\"=?utf-8?b?IjsgYm91bmRhcnk9eQ==?=\""]
_ENCODINGS = ["base64", "Base64", "base64 ", "quoted-printable (x)", "=?utf-8?q?base64?=", "8bit", "", "x-uue",
              "BASE64\t", "7 bit", '"base64"', "base64\xe9"]


@st.composite
def _field_value_of(draw, values: list[str], joiner: str, extra: list[str] | None = None) -> bytes:
    items = [draw(st.sampled_from(values))]
    if extra is not None:
        items += draw(st.lists(st.sampled_from(extra), max_size=5))
    text = joiner.join(items) + draw(st.sampled_from(["", ";", " ", "; "]))
    if draw(st.booleans()):  # folded at a blank, or just before a parameter
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["\r\n ", "\r\n\t", "\n "])) + text[at:]
    return text.encode("latin-1")


@st.composite
def _header_block(draw) -> bytes:
    fields = []
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from([b"Content-Type", b"content-type", b"CONTENT-TYPE"]))
        fields.append(name + b":" + draw(st.sampled_from([b" ", b"", b"\t"]))
                      + draw(_field_value_of(_TYPES, ";", _PARAMETERS)))
    for _ in range(draw(st.integers(0, 2))):
        fields.append(b"Content-Transfer-Encoding: " + draw(_field_value_of(_ENCODINGS, "")))
    fields += draw(st.lists(st.sampled_from([b"Subject: x", b"From mbox", b": no name", b"X-A: b; c=d"]),
                            max_size=2))
    return b"".join(f + b"\r\n" for f in draw(st.permutations(fields)))


@PROPERTY
@given(_header_block(), st.sampled_from(["text/plain", "message/rfc822"]))
def test_property_fields_are_read_as_the_email_package_reads_them(head: bytes, default_type: str) -> None:
    head, _, _ = mime7bit._split_head(head + b"\r\n")
    assert mime7bit._head_info(head, default_type, mime7bit._ParseBudget()) == \
        _reference_head_info(head, default_type)


async def test_a_conversion_of_long_lines_is_linear_and_leaves_the_event_loop_running() -> None:
    """A part of 998-octet lines beside an 8-bit one: the conversion measures lines by splitting,
    in time linear in the message. (A search for 999 non-line-end octets tried every position of
    every line: ~3 s per MB, in one C call holding the GIL, so the node's event loop stood still
    though the conversion runs in a worker thread: 52 s for 10 MB, a cluster peer's heartbeats
    timed out and it promoted the message, a second delivery.)"""
    import asyncio
    import time

    lines = (b"a" * 998 + b"\r\n") * 3000  # 3 MB
    raw = (b"MIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary=\"BB\"\r\n\r\n"
           b"--BB\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nvoil\xc3\xa0\r\n"
           b"--BB\r\nContent-Type: text/plain\r\n\r\n" + lines + b"--BB\r\nContent-Type: text/plain\r\n\r\n"
           + b"b" * 5000 + b"\r\n--BB--\r\n" + b"c" * 3000 + b"\r\n")  # a long line in the epilogue too
    gaps: list[float] = []

    async def ticks() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
    ticker = asyncio.create_task(ticks())
    try:
        await asyncio.sleep(0.05)
        started = time.monotonic()
        out = await asyncio.to_thread(to_7bit, raw)
        took = time.monotonic() - started
    finally:
        ticker.cancel()
    assert out.isascii() and max(map(len, out.split(b"\r\n"))) <= 998
    assert out.count(b"a" * 998 + b"\r\n") == 3000  # the 7-bit part kept as it was
    assert took < 3.0, f"the conversion of 3 MB took {took:.1f} s"  # ~0.2 s; ~9 s before
    assert max(gaps) < 1.0, f"the event loop stood still {max(gaps):.1f} s during the conversion"
