"""smtp/wire.py, the stream under our pipelining client (peer sessions and next hops), against small
scripted servers on loopback."""

from __future__ import annotations

import asyncio
import socket
import ssl

import pytest

from transportd.errors import PeerPermanentError, PeerTransientError, ProtocolError, TlsRequired
from transportd.smtp.client import SmtpTarget, connect, rset_ok
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


async def next_hop_session(port: int, start_tls: bool | None = None):
    """A session as the node opens one to a next hop outside (STARTTLS where offered, unchecked)."""
    session, _ = await connect([SmtpTarget("127.0.0.1", port)], local_hostname="me.test", timeout=5,
                               connect_timeout=5, tls={"start_tls": start_tls, "validate_certs": False})
    return session


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
    ([(None, b"220 ok\r\n"), (b"EHLO", b"250 peer\r\n")], TlsRequired),  # STARTTLS asked, not offered
    ([(None, b"220 ok\r\n"), (b"EHLO", b"250-peer\r\n250 STARTTLS\r\n"),
      (b"STARTTLS", b"454 4.7.0 TLS not available\r\n")], TlsRequired),  # asked, refused
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


async def test_a_replys_text_comes_in_clean() -> None:
    """Controls in a reply's text (NUL, a CR inside a line, ESC, DEL, C1) become "?", octets that
    are no UTF-8 U+FFFD, a tab and UTF-8 text stay: every consumer of a next hop's words (DSN,
    tracking log, queue database, log) gets text."""
    server, port = await scripted([
        (None, b"220 ok\r\n"), (b"EHLO", b"250 peer\r\n"),
        (b"RCPT", b"550-5.1.1 a\x00b\rc\x1b[31md\x7f\r\n550 5.1.1 \xc2\x9b\tj\xc3\xb6rg \xff\xfe\r\n"),
    ])
    async with server:
        wire = SmtpWire("127.0.0.1", port, local_hostname="me.test", timeout=5)
        await wire.connect()
        await wire.ehlo()
        reply = await wire.execute_command(b"RCPT", b"TO:<x@y>")
        assert (reply.code, reply.message) == (550, "5.1.1 a?b?c?[31md?\n5.1.1 ?\tj\u00f6rg \ufffd\ufffd")
        wire.close()


async def test_the_timeout_is_per_reply_and_a_late_reply_ends_the_session() -> None:
    """Each reply has ``timeout`` of its own (three replies 0.3 s apart all count under a 0.5 s
    timeout, 0.9 s in all); one that does not come in time fails with TimeoutError and the session
    is closed, never reused out of step."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 slow\r\n")
        for delay in (0.3, 0.3, 0.3, 2.0):
            await reader.readuntil(b"\n")
            await asyncio.sleep(delay)
            writer.write(b"250 ok\r\n")
        await asyncio.sleep(1)
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        wire = SmtpWire("127.0.0.1", port, local_hostname="me.test", timeout=0.5)
        await wire.connect()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for _ in range(3):
            assert (await wire.execute_command(b"NOOP")).code == 250
        assert loop.time() - t0 >= 0.85
        t1 = loop.time()
        with pytest.raises(asyncio.TimeoutError, match="within 0.5 s"):
            await wire.execute_command(b"NOOP")
        assert 0.45 <= loop.time() - t1 < 1.5
        assert not wire.is_connected and not wire.idle
        with pytest.raises(PeerTransientError):
            wire.write(b"NOOP\r\n")
        wire.close()


# ------------------------------------------------------------------ sessions to next hops outside

async def test_a_next_hop_without_ehlo_gets_helo_and_one_command_at_a_time() -> None:
    server, port = await scripted([
        (None, b"220 old.test SMTP\r\n"),
        (b"EHLO me.test", b"502 5.5.2 what?\r\n"), (b"HELO me.test", b"250 old.test\r\n"),
        (b"MAIL FROM:<a@x.test>\r", b"250 ok\r\n"), (b"RCPT TO:<b@y.test>\r", b"550 5.1.1 no b\r\n"),
        (b"RCPT TO:<c@y.test>\r", b"250 ok\r\n"), (b"DATA\r", b"354 go\r\n"),
        (b"hello", b""), (b".\r", b"250 2.0.0 queued\r\n"), (b"QUIT", b"221 bye\r\n"),
    ])
    async with server:
        session = await next_hop_session(port)
        assert not session.supports_extension("pipelining")
        replies = await session.transact("a@x.test", [], ["b@y.test", "c@y.test"], b"hello\r\n")
        assert replies.recipients == ((550, "5.1.1 no b"), (250, "ok")) and replies.data == (250, "2.0.0 queued")
        await session.quit()


async def test_a_pipelining_next_hop_gets_one_group_and_a_lone_dot_when_it_says_354_to_nobody() -> None:
    server, port = await scripted([
        (None, b"220 mx.test ESMTP\r\n"),
        (b"EHLO me.test", b"250-mx.test\r\n250 PIPELINING\r\n"),
        (b"MAIL FROM:<a@x.test>\r", b""), (b"RCPT TO:<b@y.test>\r", b""),
        (b"DATA\r", b"250 ok\r\n550 5.1.1 no b\r\n354 go anyway\r\n"),
        (b".\r\n", b"554 5.5.1 no valid recipients\r\n"),  # the lone dot, not the body
        (b"RSET", b"250 ok\r\n"),
    ])
    async with server:
        session = await next_hop_session(port)
        replies = await session.transact("a@x.test", [], ["b@y.test"], b"secret body\r\n")
        assert replies.refusal == (550, "5.1.1 no b") and replies.data[0] == 554
        assert await rset_ok(session)
        session.close()


async def test_starttls_is_used_when_a_next_hop_offers_it(tmp_path) -> None:
    """start_tls None (the SMTP connector's): STARTTLS when offered, then EHLO again over TLS."""

    import trustme
    from aiosmtpd.controller import Controller
    from aiosmtpd.smtp import SMTP as AioSMTP

    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    seen: list[tuple[bool, bytes]] = []

    class Handler:
        async def handle_DATA(self, server, session, envelope):
            seen.append((session.ssl is not None, envelope.content))
            return "250 2.0.0 queued"

    class Factory(Controller):
        def factory(self):
            return AioSMTP(self.handler, tls_context=context, require_starttls=False)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    controller = Factory(Handler(), hostname="127.0.0.1", port=port)
    controller.start()
    try:
        session = await next_hop_session(port)
        assert not session.supports_extension("starttls")  # the EHLO after STARTTLS offers it no more
        replies = await session.transact("a@x.test", [], ["b@y.test"], b"Subject: tls\r\n\r\nover tls\r\n")
        assert replies.data[0] == 250
        await session.quit()
    finally:
        controller.stop()
    assert seen == [(True, b"Subject: tls\r\n\r\nover tls\r\n")]


async def test_plaintext_after_the_starttls_220_is_discarded(caplog) -> None:
    """A next hop (or a man in the middle) that sends a reply in plaintext right after its 220 to
    STARTTLS: that reply is never taken for the answer to the EHLO sent over TLS (the client side
    of CVE-2011-0411's class)."""

    import trustme

    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 mx.test ESMTP\r\n")
        await reader.readuntil(b"\n")
        writer.write(b"250-mx.test\r\n250 STARTTLS\r\n")
        assert (await reader.readuntil(b"\n")).startswith(b"STARTTLS")
        writer.write(b"220 go ahead\r\n250-injected.test\r\n250-SMTPUTF8\r\n250 PIPELINING\r\n")
        await writer.drain()
        await writer.start_tls(context)
        assert (await reader.readuntil(b"\n")).startswith(b"EHLO")
        writer.write(b"250-mx.test\r\n250 8BITMIME\r\n")
        assert (await reader.readuntil(b"\n")).startswith(b"NOOP")
        writer.write(b"250 2.0.0 ok over tls\r\n")
        await reader.readuntil(b"\n")
        writer.write(b"221 bye\r\n")
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        session = await next_hop_session(port)
        assert session.supports_extension("8bitmime")
        assert not session.supports_extension("smtputf8") and not session.supports_extension("pipelining")
        assert (await session.wire.execute_command(b"NOOP")).message == "2.0.0 ok over tls"
        await session.quit()
    assert "in plaintext after its STARTTLS 220: discarded" in caplog.text


@pytest.mark.parametrize("start", [
    [(b"EHLO me.test", b"250-mx.test\r\n250 PIPELINING\r\n")],
    [(b"EHLO me.test", b"250-mx.test\r\n250-STARTTLS\r\n250 PIPELINING\r\n"),
     (b"STARTTLS", b"454 4.7.0 TLS not available due to local problem\r\n")],
], ids=["not offered", "refused"])
async def test_a_next_hop_without_starttls_or_refusing_it_gets_the_message_in_plaintext(start, caplog) -> None:
    """No STARTTLS where a next hop does not offer it; opportunistic TLS (RFC 3207 4.1): STARTTLS
    answered 454 (a Postfix without its certificate) leaves the session as it was, and the
    transaction goes on without TLS."""
    server, port = await scripted([
        (None, b"220 mx.test ESMTP\r\n"), *start,
        (b"MAIL FROM:<a@x.test>", b""), (b"RCPT", b""), (b"DATA", b"250 ok\r\n250 ok\r\n354 go\r\n"),
        (b"x", b""), (b".", b"250 queued\r\n"), (b"QUIT", b"221 bye\r\n"),
    ])
    async with server:
        session = await next_hop_session(port)
        assert (await session.transact("a@x.test", [], ["b@y.test"], b"x\r\n")).data == (250, "queued")
        await session.quit()
    refused = "answered STARTTLS 454 4.7.0 TLS not available due to local problem: going on without TLS"
    assert (refused in caplog.text) == (len(start) == 2)


async def test_a_failed_tls_handshake_with_a_next_hop_is_followed_by_a_session_without_tls(caplog) -> None:
    """STARTTLS answered 220, then no TLS (here: plaintext where the handshake should be): the
    connection is lost, and at once a new one goes without STARTTLS, where a deferral would have
    met the same failure at every retry. To a peer (TLS required) it stays a failure."""
    sessions: list[list[bytes]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen: list[bytes] = []
        sessions.append(seen)
        writer.write(b"220 mx.test ESMTP\r\n")
        try:
            while line := await reader.readuntil(b"\n"):
                seen.append(line.split()[0] if line.strip() else line)
                if line.startswith(b"EHLO"):
                    writer.write(b"250-mx.test\r\n250 STARTTLS\r\n")
                elif line.startswith(b"STARTTLS"):
                    writer.write(b"220 go ahead\r\nthis is no TLS server hello at all\r\n" * 20)
                    await writer.drain()
                    await asyncio.sleep(0.2)
                    break
                elif line.startswith(b"QUIT"):
                    writer.write(b"221 bye\r\n")
                    break
                else:
                    writer.write(b"250 ok\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        session = await next_hop_session(port)
        assert (await session.wire.execute_command(b"NOOP")).code == 250
        await session.quit()
        assert sessions[0] == [b"EHLO", b"STARTTLS"] and sessions[1] == [b"EHLO", b"NOOP", b"QUIT"], sessions
        assert "sending on a new session without TLS" in caplog.text
        wire = SmtpWire("127.0.0.1", port, local_hostname="me.test", timeout=5, start_tls=True)
        await wire.connect()
        with pytest.raises(TlsRequired, match=f"^TLS with 127.0.0.1:{port} failed: ") as failed:
            await wire.ehlo()  # a peer's session, TLS required: a TLS failure, saying why (SSL or reset)
        assert failed.value.status == "4.7.5" and isinstance(failed.value.__cause__, OSError)
        wire.close()
        assert len(sessions) == 3  # and no second try without TLS


async def test_a_session_with_anything_unread_is_not_idle_and_is_not_kept() -> None:
    """SessionCache keeps and gives out only idle sessions: connected, nothing from the next hop
    unread. A next hop that says 421 (or closes) after a reply leaves the session not idle."""
    from transportd.smtp.client import SessionCache

    server, port = await scripted([
        (None, b"220 mx.test ESMTP\r\n"), (b"EHLO me.test", b"250-mx.test\r\n250 PIPELINING\r\n"),
        (b"NOOP", b"250 ok\r\n"), (b"NOOP", b"250 ok\r\n421 4.4.2 mx.test idle too long\r\n"), (None, None),
    ])
    async with server:
        session = await next_hop_session(port, start_tls=False)
        cache = SessionCache(idle_time=5, max_transactions=3, per_key=2)
        assert (await session.wire.execute_command(b"NOOP")).code == 250 and session.idle
        assert cache.keep("hop", session) and cache.take("hop", 1) is session and session.reused
        assert cache.take("hop", 1) is None  # given out: no longer kept
        assert (await session.wire.execute_command(b"NOOP")).code == 250
        await asyncio.sleep(0.2)
        assert not session.idle and not cache.keep("hop", session)  # the 421 waits unread
        session.close()
        await cache.close()


async def test_a_next_hop_whose_hosts_all_fail_tls_is_a_tls_failure_each_host_named_once() -> None:
    """TLS required of a next hop with several hosts (``client.connect``): every host reached and
    none with TLS is a TLS failure (``tls_status``, the first host's code), each host named once
    in the text; a host refused among them makes it a failure to connect, naming each host once."""
    from conftest import free_port

    from transportd.errors import NextHopUnavailable
    no_tls = [(None, b"220 ok\r\n"), (b"EHLO", b"250 mx\r\n")]
    refused = [(None, b"220 ok\r\n"), (b"EHLO", b"250-mx\r\n250 STARTTLS\r\n"),
               (b"STARTTLS", b"454 4.7.0 TLS not available due to local problem\r\n")]
    (a, pa), (b, pb) = await scripted(no_tls), await scripted(refused)
    down = free_port()
    required = {"start_tls": True, "validate_certs": False}
    async with a, b:
        with pytest.raises(NextHopUnavailable) as failed:
            await connect([SmtpTarget("127.0.0.1", pa), SmtpTarget("127.0.0.1", pb)], local_hostname="me.test",
                          timeout=5, connect_timeout=5, tls=required)
        assert failed.value.tls_status == "4.7.10" and failed.value.only is None
        assert str(failed.value) == (f"127.0.0.1:{pa} does not offer STARTTLS; 127.0.0.1:{pb} answered STARTTLS "
                                     f"454 4.7.0 TLS not available due to local problem")
        with pytest.raises(NextHopUnavailable) as failed:
            await connect([SmtpTarget("127.0.0.1", down), SmtpTarget("127.0.0.1", pa)], local_hostname="me.test",
                          timeout=5, connect_timeout=5, tls=required)
        assert failed.value.tls_status is None and failed.value.only is None
        assert str(failed.value) == f"127.0.0.1:{down}: Connection refused; 127.0.0.1:{pa} does not offer STARTTLS"
        with pytest.raises(NextHopUnavailable) as failed:
            await connect([SmtpTarget("127.0.0.1", down)], local_hostname="me.test", timeout=5, connect_timeout=5,
                          tls=required)
        assert (failed.value.only, failed.value.reason) == (f"127.0.0.1:{down}", "Connection refused")


async def test_a_421_in_a_pipelined_group_answers_the_whole_group_and_ends_the_session() -> None:
    """The next hop answers MAIL 421 and closes before the group's RCPT and DATA are answered
    (RFC 5321 3.8): the transaction's replies are all that 421, not "closed the connection"."""
    server, port = await scripted([
        (None, b"220 mx.test ESMTP\r\n"),
        (b"EHLO me.test", b"250-mx.test\r\n250 PIPELINING\r\n"),
        (b"MAIL FROM:<a@x.test>\r", b"421 4.7.0 too many messages in this connection\r\n"),
    ])
    async with server:
        session = await next_hop_session(port)
        replies = await session.transact("a@x.test", [], ["b@y.test", "c@y.test"], b"body\r\n")
        cut = (421, "4.7.0 too many messages in this connection")
        assert replies.mail == cut and replies.recipients == (cut, cut) and replies.data == cut
        assert not session.is_connected and session.awaiting is None


def test_a_broken_session_names_the_host_once_and_the_step_whose_reply_was_awaited() -> None:
    """The deferral of a session that broke (node/connectors.py ``_session_lost``): the host once,
    the command whose reply was awaited, and after the data that the next hop may hold the message;
    a reply no server gives to its command names the step itself (the out-of-step error)."""
    from transportd.node.connectors import _session_lost
    from transportd.queue.messages import WorkItem
    item = WorkItem(1, "smarthost:mx.test:25", "smtp", "mx.test:25", 7, [70], ["b@y.test"])
    target = SmtpTarget("mx.test", 25)

    def reply(exc, step):
        return _session_lost([item], target, exc, step).outcomes[7][0].reply
    timeout = TimeoutError("no reply from mx.test:25 within 600 s")
    assert reply(timeout, "end of data") == (
        "451 4.4.2 Connection to mx.test:25 lost awaiting the reply to end of data: no reply within 600 s; "
        "the next hop may hold the message, which may be sent more than once")
    assert reply(PeerTransientError("mx.test:25 closed the connection"), "MAIL") == (
        "451 4.4.2 Connection to mx.test:25 lost awaiting the reply to MAIL: closed the connection")
    assert reply(ProtocolError("not an SMTP reply line from mx.test: 'HTTP/1.1 400'"), "RCPT") == (
        "451 4.4.2 Session with mx.test:25 given up awaiting the reply to RCPT: not an SMTP reply line: 'HTTP/1.1 400'")
    assert reply(ProtocolError("DATA answered 250 2.0.0 Ok: the session is out of step"), "DATA") == (
        "451 4.4.2 Session with mx.test:25 given up: DATA answered 250 2.0.0 Ok: the session is out of step")
