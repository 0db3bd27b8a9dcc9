"""smtp/wire.py, the stream under a peer session, against small scripted servers on loopback."""

from __future__ import annotations

import asyncio

import pytest

from transportd.errors import PeerPermanentError, PeerTransientError, ProtocolError
from transportd.smtp.wire import SmtpWire


async def scripted(script: list[tuple[bytes | None, bytes | None]]):
    """A server that, per connection, waits for each expected line (None: nothing) and answers
    (None: it never answers, and holds the connection open for a while)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for expected, answer in script:
            if expected is not None:
                line = await reader.readuntil(b"\n")
                assert line.startswith(expected), (line, expected)
            if answer is None:
                await asyncio.sleep(3)
                break
            writer.write(answer)
            await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_greeting_ehlo_keywords_auth_and_a_pipelined_group() -> None:
    server, port = await scripted([
        (None, b"220 peer.test ESMTP\r\n"),
        (b"EHLO me.test", b"250-peer.test\r\n250-PIPELINING\r\n250-CHUNKING\r\n250 SIZE 1000\r\n"),
        (b"AUTH PLAIN ", b"235 2.7.0 ok\r\n"),
        (b"MAIL FROM:<a@x>", b""), (b"RCPT TO:<b@y>", b""), (b"BDAT 3 LAST", b"250 2.1.0 ok\r\n250 2.1.5 ok\r\n"),
        (b"hi!", b"250 2.0.0 queued\r\n"),
    ])
    async with server:
        wire = SmtpWire("127.0.0.1", port, local_hostname="me.test", timeout=5)
        assert (await wire.connect()).code == 220
        await wire.ehlo()
        assert wire.supports_extension("chunking") and wire.supports_extension("SIZE")
        assert not wire.supports_extension("starttls")
        await wire.auth_plain("me.test", "secret")
        wire.write(b"MAIL FROM:<a@x>\r\nRCPT TO:<b@y>\r\nBDAT 3 LAST\r\nhi!\r\n")
        replies = [await wire.read_reply() for _ in range(3)]
        assert [r.code for r in replies] == [250, 250, 250] and replies[2].message == "2.0.0 queued"
        # The server closes: the session is no longer usable, and a read says why.
        with pytest.raises(PeerTransientError):
            await wire.read_reply()
        assert not wire.is_connected
        wire.close()


@pytest.mark.parametrize("script, error", [
    ([(None, b"554 go away\r\n")], PeerTransientError),  # no 220 greeting
    ([(None, b"220 ok\r\n"), (b"EHLO", b"500 what\r\n")], PeerPermanentError),
    ([(None, b"220 ok\r\n"), (b"EHLO", b"hello there\r\n")], ProtocolError),  # not a reply line
    ([(None, b"220 ok\r\n"), (b"EHLO", b"250 peer\r\n")], PeerPermanentError),  # STARTTLS asked, not offered
])
async def test_a_peer_that_breaks_the_session_start_is_an_error(script, error) -> None:
    server, port = await scripted(script)
    async with server:
        wire = SmtpWire("127.0.0.1", port, local_hostname="me.test", timeout=5, start_tls=True)
        with pytest.raises(error):
            await wire.connect()
            await wire.ehlo()
        wire.close()


async def test_auth_refused_and_a_silent_peer() -> None:
    server, port = await scripted([(None, b"220 ok\r\n"), (b"EHLO", b"250 peer\r\n"),
                                   (b"AUTH", b"535 5.7.8 no\r\n"), (b"NOOP", None)])
    async with server:
        wire = SmtpWire("127.0.0.1", port, local_hostname="me.test", timeout=0.5)
        await wire.connect()
        await wire.ehlo()
        with pytest.raises(PeerPermanentError, match="535"):
            await wire.auth_plain("me.test", "wrong")
        with pytest.raises(asyncio.TimeoutError):
            await wire.execute_command(b"NOOP")  # never answered: bounded by the timeout
        wire.close()
