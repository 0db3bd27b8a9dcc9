"""The chunked DATA reader gives what reading line by line gives (RFC 5321 4.5.2), byte for byte.

The reference below reads one CRLF-terminated line at a time, as aiosmtpd does: a lone dot ends
the data, a leading dot is removed, a line (CRLF included) longer than the limit or more octets
than the size limit make an error; the length is that of the lines the message is sent on as,
less a stuffing dot (RFC 5321 4.5.3.1.6 does not count it), where a bare CR or LF ends a line too (smtp/transaction.py's dot_stuff makes each a CRLF). Hypothesis draws messages with dot lines, bare CRs and LFs,
long lines and pipelined commands after the end, fed to the stream in random pieces.
"""

from __future__ import annotations

import asyncio
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transportd.smtp.server import DATA_TOO_LONG, DATA_TOO_MUCH, read_data


def reference(stream: bytes, size_limit: int | None, line_limit: int) -> tuple[bytes, str | None, bytes]:
    pos, size, error, lines = 0, 0, None, []
    while True:
        end = stream.index(b"\r\n", pos) + 2
        line, pos = stream[pos:end], end
        if line == b".\r\n":
            break
        stored = line[1:] if line.startswith(b".") else line
        size += len(stored)  # RFC 1870 section 4: the size excludes the doubled quoting dots
        if error is None and size_limit and size > size_limit:
            error = DATA_TOO_MUCH
        # As sent on, less the stuffing dot (RFC 5321 4.5.3.1.6: not counted in a line's length)
        if error is None and max(map(len, re.split(rb"\r\n|\r|\n", stored[:-2]))) + 2 > line_limit:
            error = DATA_TOO_LONG
        lines.append(stored)
    return (b"" if error else b"".join(lines)), error, stream[pos:]


async def feed_and_read(stream: bytes, cuts: list[int], size_limit: int | None,
                        line_limit: int) -> tuple[bytes, str | None, bytes]:
    reader = asyncio.StreamReader(limit=line_limit)

    async def feed() -> None:
        last = 0
        for c in sorted({min(c, len(stream)) for c in cuts}) + [len(stream)]:
            reader.feed_data(stream[last:c])
            last = c
            await asyncio.sleep(0)
        reader.feed_eof()

    feeder = asyncio.ensure_future(feed())
    content, error = await read_data(reader, size_limit, line_limit)
    await feeder
    return content, error, await reader.read()


line_text = st.lists(st.sampled_from([b"a", b"b", b".", b"\r", b"\n", b" ", b"z" * 40]), max_size=30).map(b"".join)
lines = st.lists(line_text.filter(lambda t: b"\r\n" not in t), max_size=40)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=lines, cuts=st.lists(st.integers(0, 3000), max_size=8),
       line_limit=st.sampled_from([20, 64, 1002]), size_limit=st.sampled_from([None, 0, 200, 100000]),
       after=st.sampled_from([b"", b"QUIT\r\n", b"MAIL FROM:<a@b>\r\nRCPT TO:<c@d>\r\n"]))
def test_chunked_reader_matches_line_by_line(lines, cuts, line_limit, size_limit, after):
    # A client stuffs a lone-dot line; other leading dots come stuffed or not (the first goes).
    stream = b"".join((t if t != b"." else b"..") + b"\r\n" for t in lines) + b".\r\n" + after
    want = reference(stream, size_limit, line_limit)
    got = asyncio.run(feed_and_read(stream, cuts, size_limit, line_limit))
    assert got[2] == want[2] == after  # nothing past the terminating line is consumed
    if want[1] is None:
        assert got[:2] == want[:2]
    else:
        # Both errors present: which one wins may differ (the reply is 500 or 552 either way).
        assert got[0] == b"" and got[1] in (DATA_TOO_LONG, DATA_TOO_MUCH)
        if not size_limit:
            assert got[1] == DATA_TOO_LONG


def test_examples_dot_stuffing_and_empty_message():
    for stream, content in [
        (b".\r\n", b""),
        (b"..\r\n.\r\n", b".\r\n"),
        (b"a\r\n..b\r\n.\r\n", b"a\r\n.b\r\n"),
        (b"a.\r\n.\r\n", b"a.\r\n"),
        (b"x\r\n...\r\n..\r\n.\r\n", b"x\r\n..\r\n.\r\n"),
    ]:
        got = asyncio.run(feed_and_read(stream, [], None, 1002))
        assert got == (content, None, b""), stream


def test_the_size_limit_counts_the_message_not_its_stuffing_dots():
    """RFC 1870 section 4: a message's size is its octets with CRLFs, "but not counting the SMTP
    DATA command's terminating dot or doubled quoting dots". A message of exactly the SIZE limit
    with dot lines fits, over DATA as over BDAT; one octet more does not."""
    message = b"a\r\n.x\r\n..\r\n" + b"z" * 20 + b"\r\n"  # two lines that begin with a dot
    stuffed = b"a\r\n..x\r\n...\r\n" + b"z" * 20 + b"\r\n.\r\n"
    assert asyncio.run(feed_and_read(stuffed, [], len(message), 1002)) == (message, None, b"")
    assert asyncio.run(feed_and_read(stuffed, [3, 9], len(message) - 1, 1002))[:2] == (b"", DATA_TOO_MUCH)


def test_long_message_in_one_piece_and_limits():
    body = b"".join(b"line %d of a long message\r\n" % i for i in range(5000))
    got = asyncio.run(feed_and_read(body + b".\r\n", [], None, 1002))
    assert got == (body, None, b"")
    assert asyncio.run(feed_and_read(body + b".\r\n", [], 1000, 1002))[:2] == (b"", DATA_TOO_MUCH)
    long_line = b"y" * 5000 + b"\r\n"
    assert asyncio.run(feed_and_read(b"ok\r\n" + long_line + b".\r\n", [7, 900], None, 1002))[:2] == \
        (b"", DATA_TOO_LONG)


def test_bare_line_ends_end_a_line_for_the_length_check():
    """A message of short lines ended by bare LFs (or CRs) is no long line, however long it is
    between two CRLFs, also after a stuffing dot; a line over the limit with no line end is."""
    short = b"".join(b"%02d " % i + b"x" * 50 + b"\n" for i in range(40))  # 54 octets a line
    for stream in (short + b"\r\n.\r\n", b".." + short + b"\r\n.\r\n", short.replace(b"\n", b"\r") + b"\r\n.\r\n"):
        content, error = asyncio.run(feed_and_read(stream, [5, 700], None, 102))[:2]
        assert error is None and content == (stream[1:] if stream.startswith(b"..") else stream)[:-3]
    assert asyncio.run(feed_and_read(b"y" * 101 + b"\n" + short + b"\r\n.\r\n", [], None, 102))[1] == DATA_TOO_LONG
    assert asyncio.run(feed_and_read(b"." + b"y" * 101 + b"\n\r\n.\r\n", [], None, 102))[1] == DATA_TOO_LONG
    assert asyncio.run(feed_and_read(b"." + b"y" * 100 + b"\n\r\n.\r\n", [], None, 102))[1] is None


def test_the_stuffing_dot_is_not_counted_in_a_lines_length():
    """RFC 5321 4.5.3.1.6: a text line is at most 1000 octets with its CRLF, "not counting the
    leading dot duplicated for transparency". A line of the limit that begins with a dot comes
    as ``..`` and the rest, one octet over the limit on the wire, and fits as the line without
    the dot does; one octet more does not, and a line of the limit never counts a dot it lacks."""
    text = b"." + b"y" * 997  # 998 octets of text: 1000 with the CRLF
    assert asyncio.run(feed_and_read(b"." + text + b"\r\n.\r\n", [], None, 1000)) == (text + b"\r\n", None, b"")
    assert asyncio.run(feed_and_read(b"." + text + b"\r\n.\r\n", [1, 2, 500], None, 1000))[:2] == \
        (text + b"\r\n", None)
    assert asyncio.run(feed_and_read(b"a\r\n." + text + b"\r\nb\r\n.\r\n", [4], None, 1000))[:2] == \
        (b"a\r\n" + text + b"\r\nb\r\n", None)
    assert asyncio.run(feed_and_read(b"." + text + b"y\r\n.\r\n", [], None, 1000))[:2] == (b"", DATA_TOO_LONG)
    plain = b"y" * 998
    assert asyncio.run(feed_and_read(plain + b"\r\n.\r\n", [], None, 1000)) == (plain + b"\r\n", None, b"")
    assert asyncio.run(feed_and_read(plain + b"y\r\n.\r\n", [], None, 1000))[:2] == (b"", DATA_TOO_LONG)
