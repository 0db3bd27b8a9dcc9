"""smtp/headers.plain_fields reads a header block in its common form as the email package does.

The email package's compat32 parser was the only reader of Message-ID, Date and Subject; it
costs ~10 times a split of the lines, twice per shadowed message. ``plain_fields`` answers only
for blocks in the common form and leaves every other one to the email package; here both are
compared on a fixed list and on Hypothesis-made blocks, odd lines, line ends and octets included.
"""

from __future__ import annotations

from email.parser import BytesHeaderParser
from email.policy import compat32

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transportd.smtp.headers import (
    _FOLD,
    _header_text,
    author_address,
    field_value,
    header_fields,
    plain_fields,
    split_headers,
)


def _email_items(block: bytes) -> list[tuple[str, str]]:
    return list(BytesHeaderParser(policy=compat32).parsebytes(block).raw_items())


def _email_header_fields(data: bytes) -> tuple[str, str, str, str]:
    """header_fields as it was, with the email package only (the author from its Sender/From)."""
    found: dict[str, str] = {}
    for name, value in _email_items(split_headers(data)[0]):
        found.setdefault(name.lower(), value)
    message_id, date, subject, sender, from_ = (_header_text(_FOLD.sub("", found.get(k, "")))
                                                for k in ("message-id", "date", "subject", "sender", "from"))
    return message_id, date, subject, author_address(sender, from_)


FIXED = [
    b"Subject: hi  \r\nMessage-ID: <a@b.test>\r\nDate: Thu, 26 Nov 2026 08:00:00 +0000\r\n\r\nbody\r\n",
    b"Message-ID:\r\n <folded@b.test>\r\nSubject: one\r\n\ttwo\r\n three\r\n\r\n",
    b"Subject: Gr\xc3\xbc\xc3\x9fe\r\nX-8bit: \xff\xfe\r\n\r\n\xff",
    b"Subject:\t\t tabs first\r\nsubject: second ignored\r\n\r\n",
    b"Date:\r\n\r\n",
    b"X-Empty:\r\nSubject: after empty\r\n\r\n",
    # other forms: the email package decides
    b"From someone Thu Nov 26\r\nSubject: mbox\r\n\r\n",
    b" continuation first\r\nSubject: x\r\n\r\n",
    b"Subject : blank before colon\r\nMessage-ID: <m@x>\r\n\r\n",
    b":no name\r\nSubject: x\r\n\r\n",
    b"not a header line\r\nSubject: x\r\n\r\n",
    b"Subject: bare lf\nMessage-ID: <m@x>\n\nbody",
    b"Subject: bare\rcr\r\n\r\n",
    b"Subject: no body separator\r\n",
    b"",
]


@pytest.mark.parametrize("data", FIXED)
def test_fixed_blocks_read_as_the_email_package_reads_them(data: bytes) -> None:
    block = split_headers(data)[0]
    fast = plain_fields(block)
    if fast is not None:
        assert fast == _email_items(block)
    assert header_fields(data) == _email_header_fields(data)
    assert field_value(data, "Message-ID") == _email_header_fields(data)[0]


def test_the_common_form_is_read_without_the_email_package() -> None:
    """Not vacuous: the blocks a client sends are answered by the fast path."""
    for data in FIXED[:6]:
        assert plain_fields(split_headers(data)[0]) is not None, data
    for data in FIXED[6:]:
        assert plain_fields(split_headers(data)[0]) is None, data


_NAMES = st.sampled_from([b"Subject", b"subject", b"Message-ID", b"Date", b"X-A", b"Received", b"a!#$%&'*+-.^_`|~",
                          b"Sub ject", b"", b"From", b"X;y", b"X=1"])
_VALUE = st.binary(max_size=30).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_BLANKS = st.sampled_from([b"", b" ", b"  ", b"\t", b" \t "])
_FIELD = st.builds(lambda n, sep, blanks, v: n + sep + blanks + v, _NAMES, st.sampled_from([b":", b" :", b""]),
                   _BLANKS, _VALUE)
_CONTINUATION = st.builds(lambda b, v: b + v, st.sampled_from([b" ", b"\t", b"  "]), _VALUE)
_ODD = st.sampled_from([b"From x@y Thu Nov 26 2026", b"no colon here", b":", b"\xff\xfe: x"])
_LINE = st.one_of(_FIELD, _FIELD, _FIELD, _CONTINUATION, _ODD)
_END = st.sampled_from([b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r"])


@settings(max_examples=2500, deadline=None, suppress_health_check=list(HealthCheck))
@given(lines=st.lists(st.tuples(_LINE, _END), max_size=8), sep=st.sampled_from([b"\r\n", b"\n", b""]),
       body=st.binary(max_size=20))
def test_any_block_reads_as_the_email_package_reads_it(lines, sep, body) -> None:
    data = b"".join(line + end for line, end in lines) + sep + body
    block = split_headers(data)[0]
    fast = plain_fields(block)
    if fast is not None:
        assert fast == _email_items(block)
    assert header_fields(data) == _email_header_fields(data)


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=st.lists(st.tuples(st.sampled_from([b"Subject", b"Message-ID", b"Date", b"X-Mailer"]), _BLANKS, _VALUE,
                                 st.lists(_CONTINUATION, max_size=2)), min_size=1, max_size=6))
def test_well_formed_blocks_take_the_fast_path(fields) -> None:
    block = b"".join(n + b":" + blanks + v + b"\r\n" + b"".join(c + b"\r\n" for c in conts)
                     for n, blanks, v, conts in fields) + b"\r\n"
    fast = plain_fields(block)
    assert fast is not None and fast == _email_items(block)


@pytest.mark.parametrize(("sender", "from_", "author"), [
    ("", '"Doe, \\"JJ\\" John" <john@remote.test>', "john@remote.test"),  # a quoted display name with a comma
    ("owner-list@lists.test", "Ann <ann@a.test>", "owner-list@lists.test"),  # Sender: first (RFC 5322 3.6.2)
    ("", "ann@a.test, bob@b.test", "ann@a.test"),  # several authors: the first
    ("", "Jürgen <jürgen@müller.test>", "jürgen@müller.test"),  # RFC 6532
    ("", "<>", ""),
    ("", "undisclosed-recipients:;", ""),
    ("no address here", "", ""),
    ("", "", ""),
])
def test_the_author_is_the_sender_field_else_the_first_from(sender, from_, author) -> None:
    """MSGTRK's sender-address: "the Sender header field, or the From header field if Sender
    isn't present" (Exchange); the return-path keeps the envelope's MAIL FROM."""
    assert author_address(sender, from_) == author
    data = "".join(f"{name}: {value}\r\n" for name, value in (("Sender", sender), ("From", from_)) if value)
    assert header_fields((data + "Subject: s\r\n\r\nbody").encode())[3] == author
