"""The sans-I/O shadow redundancy connections (transportd/redundancy/connection.py), without sockets."""

from __future__ import annotations

import base64
import itertools
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transportd.errors import ProtocolError
from transportd.redundancy.connection import (
    MAX_LINE,
    ClientConnection,
    ClientState,
    CommandRefused,
    DiscardBatch,
    DiscardRequested,
    LocalProtocolError,
    MailWithShadow,
    OtherCommand,
    PrimaryIdentified,
    Refusal,
    ResubmitAnswered,
    ResubmitRequested,
    ServerConnection,
    ShadowAccepted,
    SendBody,
    TransactionReplies,
    ShadowRefused,
    ShadowRequestAccepted,
    ShadowRequestReceived,
    StatusAnswered,
    StatusRequested,
    XShadowReceived,
)
from transportd.redundancy.protocol import ShadowRequest

PRIMARY = "p.example"
SHADOW = "s.example"
P_DBID = "6f1c2b1e-3d4a-4c5b-9e8f-0a1b2c3d4e5f"
S_DBID = "0e9d8c7b-6a59-4837-a261-5f4e3d2c1b0a"
G1 = "11111111-2222-4333-8444-555555555555"
G2 = "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
G3 = "99999999-8888-4777-8666-555555555555"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def b64_dbid(dbid: str) -> str:
    return base64.b64encode(uuid.UUID(dbid).bytes).decode()


R550 = b"550 5.7.1 Not authorized\r\n"
R503 = b"503 5.5.1 Bad sequence of commands\r\n"
R501 = b"501 5.5.4 Invalid arguments\r\n"
R502 = b"502 5.3.3 Command not implemented\r\n"
R421 = b"421 4.3.2 Service not available\r\n"
XSHADOW_REPLY = f"250 {b64_dbid(S_DBID)}\r\n".encode()  # the shadow's answer in server tests


# ============================================================================ client

def shadowing_client() -> ClientConnection:
    """A client whose XSHADOWREQUEST the peer accepted."""
    c = ClientConnection(PRIMARY)
    c.send_shadow_request(P_DBID)
    c.receive_data(f"250 {b64(SHADOW)}\r\n".encode())
    return c


def identified_client() -> ClientConnection:
    """A client whose XSHADOW the primary answered."""
    c = ClientConnection(SHADOW)
    c.send_xshadow()
    c.receive_data(f"250 {b64_dbid(P_DBID)}\r\n".encode())
    return c


def test_shadow_request_accepted() -> None:
    c = ClientConnection(PRIMARY)
    assert c.state is ClientState.IDLE and not c.shadow_requested
    assert c.send_shadow_request(P_DBID) == f"XSHADOWREQUEST {PRIMARY} {b64_dbid(P_DBID)}\r\n".encode()
    assert c.state is ClientState.AWAITING_SHADOW_REQUEST
    assert c.receive_data(f"250 {b64('S.Example')}\r\n".encode()) == [ShadowRequestAccepted(SHADOW)]
    assert c.shadow_requested and c.peer_fqdn == SHADOW and c.state is ClientState.IDLE
    with pytest.raises(LocalProtocolError):
        c.send_shadow_request(P_DBID)  # once per session


def test_shadow_request_refused_may_be_tried_again() -> None:
    c = ClientConnection(PRIMARY)
    c.send_shadow_request(P_DBID)
    assert c.receive_reply(421, ["4.3.2 Service not available"]) == [
        CommandRefused("XSHADOWREQUEST", 421, "4.3.2 Service not available")]
    assert not c.shadow_requested and c.state is ClientState.IDLE
    c.send_shadow_request(P_DBID)
    assert c.receive_reply(250, [b64(SHADOW)]) == [ShadowRequestAccepted(SHADOW)]


def test_shadow_request_needs_a_queue_database_id() -> None:
    with pytest.raises(LocalProtocolError):
        ClientConnection(PRIMARY).send_shadow_request("not-a-guid")


def test_xshadow_identifies_the_primary() -> None:
    c = ClientConnection(SHADOW)
    assert c.send_xshadow() == f"XSHADOW {b64(SHADOW)}\r\n".encode()
    assert c.receive_reply(250, [b64_dbid(P_DBID)]) == [PrimaryIdentified(P_DBID)]
    assert c.peer_queue_database_id == P_DBID and not c.shadow_requested
    with pytest.raises(LocalProtocolError):
        c.send_xshadow()


def test_xshadow_refused() -> None:
    c = ClientConnection(SHADOW)
    c.send_xshadow()
    assert c.receive_data(R550) == [CommandRefused("XSHADOW", 550, "5.7.1 Not authorized")]
    assert c.peer_queue_database_id is None
    with pytest.raises(LocalProtocolError):
        c.send_discard()


@pytest.mark.parametrize("send, reply", [
    (lambda c: c.send_xshadow(), b"250 not-base64!\r\n"),
    (lambda c: c.send_xshadow(), f"250 {b64('short')}\r\n".encode()),  # not 16 bytes
    (lambda c: c.send_xshadow(), f"250-{b64_dbid(P_DBID)}\r\n250 more\r\n".encode()),
    (lambda c: c.send_shadow_request(P_DBID), b"250 %%%\r\n"),
    (lambda c: c.send_shadow_request(P_DBID), f"250 {b64('bad_name!')}\r\n".encode()),
    (lambda c: c.send_xshadow(), b"hello there\r\n"),  # not a reply line
    (lambda c: c.send_xshadow(), b"25\r\n"),
    (lambda c: c.send_xshadow(), b"250x\r\n"),
    (lambda c: c.send_xshadow(), b"250-a\r\n251 b\r\n"),  # code changed inside a multi-line reply
    (lambda c: c.send_xshadow(), b"2" * (MAX_LINE + 1)),  # no line end in sight
    (lambda c: c.send_xshadow(), b"250 " + b"A" * MAX_LINE + b"\r\n"),
])
def test_malformed_reply_puts_the_client_in_error(send, reply: bytes) -> None:
    c = ClientConnection(SHADOW)
    send(c)
    with pytest.raises(ProtocolError) as info:
        c.receive_data(reply)
    assert not isinstance(info.value, LocalProtocolError)
    assert c.state is ClientState.ERROR
    assert not c.discards_unapplied
    for call in (lambda: c.receive_data(b"250 x\r\n"), lambda: c.receive_reply(250, ["x"]), c.send_xshadow,
                 lambda: c.send_shadow_request(P_DBID), lambda: c.send_discard(),
                 lambda: c.send_resubmit("db", 1, 2), lambda: c.mail_parameter(G1), copy_of(c)):
        with pytest.raises(LocalProtocolError):
            call()
    assert c.state is ClientState.ERROR


def test_malformed_parsed_reply_puts_the_client_in_error() -> None:
    c = ClientConnection(SHADOW)
    c.send_xshadow()
    with pytest.raises(ProtocolError):
        c.receive_reply(250, ["garbage"])
    assert c.state is ClientState.ERROR


def test_discard_loop_until_a_short_batch() -> None:
    c = identified_client()
    assert c.send_discard(2) == b"XQDISCARD 2\r\n"
    assert c.discards_unapplied  # a QUIT now would acknowledge ids never read
    events = c.receive_data(f"250-{G1}\r\n250 {G2.upper()} DeletedByAdmin\r\n".encode())
    assert events == [DiscardBatch(((G1, None), (G2, "DeletedByAdmin")), complete=False)]
    assert not c.discards_unapplied
    assert c.send_discard(2) == b"XQDISCARD 2\r\n"
    assert c.receive_data(f"250 {G3}\r\n".encode()) == [DiscardBatch(((G3, None),), complete=True)]
    c.send_discard()
    assert c.receive_data(b"251 OK, no discard events\r\n") == [DiscardBatch((), complete=True)]
    assert c.send_discard() == b"XQDISCARD 50\r\n"
    assert c.receive_reply(250, [G1, G2]) == [DiscardBatch(((G1, None), (G2, None)), complete=True)]
    assert not c.discards_unapplied and c.state is ClientState.IDLE


def test_per_recipient_discards_only_where_asked() -> None:
    """``XQDISCARD n RCPT`` (asked only of a primary that offers XQDISCARDRCPT): ``Delivered=``
    entries read; asked without it, such an entry is a contract violation (never applied)."""
    from transportd.redundancy.protocol import delivered_address, delivered_reason
    reason = delivered_reason("jörg x+y@example.test")
    c = identified_client()
    assert c.send_discard(2, recipients=True) == b"XQDISCARD 2 RCPT\r\n"
    assert c.receive_data(f"250-{G1} {reason}\r\n250 {G2}\r\n".encode()) == [
        DiscardBatch(((G1, reason), (G2, None)), complete=False)]
    assert delivered_address(reason) == "jörg x+y@example.test"
    c = identified_client()
    c.send_discard(2)
    with pytest.raises(ProtocolError):
        c.receive_data(f"250 {G1} {reason}\r\n".encode())
    s = server()
    assert isinstance(one(s, XSHADOW), XShadowReceived)
    assert one(s, "XQDISCARD 10 rcpt") == DiscardRequested(PRIMARY, 10, recipients=True)
    assert one(s, "XQDISCARD 10") == DiscardRequested(PRIMARY, 10, recipients=False)
    assert one(s, "XQDISCARD 10 FOO") == Refusal(R501)


def test_failed_recipient_discards_only_where_asked() -> None:
    """``XQDISCARD n RCPT FAILED`` (asked only of a primary that offers XQDISCARDFAILED too):
    ``Failed=`` entries read; a shadow that asked ``RCPT`` alone (an older node) takes such an
    entry as a contract violation, so a primary never hands it one."""
    from transportd.redundancy.protocol import failed_reason, recipient_done
    reason = failed_reason("perm x+y@example.test")
    c = identified_client()
    assert c.send_discard(2, recipients=True, failed=True) == b"XQDISCARD 2 RCPT FAILED\r\n"
    assert c.receive_data(f"250-{G1} {reason}\r\n250 {G2}\r\n".encode()) == [
        DiscardBatch(((G1, reason), (G2, None)), complete=False)]
    assert recipient_done(reason) == ("Failed=", "perm x+y@example.test")
    c = identified_client()
    c.send_discard(2, recipients=True)
    with pytest.raises(ProtocolError):
        c.receive_data(f"250 {G1} {reason}\r\n".encode())
    with pytest.raises(ProtocolError):
        identified_client().send_discard(2, failed=True)  # Failed= only with the per-recipient entries
    s = server()
    assert isinstance(one(s, XSHADOW), XShadowReceived)
    assert one(s, "XQDISCARD 10 rcpt failed") == DiscardRequested(PRIMARY, 10, recipients=True, failed=True)
    assert one(s, "XQDISCARD 10 RCPT") == DiscardRequested(PRIMARY, 10, recipients=True, failed=False)
    assert one(s, "XQDISCARD 10 FAILED") == Refusal(R501)


def test_success_notice_discards_only_where_asked() -> None:
    """``XQDISCARD n RCPT FAILED NOTIFY`` (asked only of a primary that offers XQDISCARDNOTIFY too):
    ``NotifyDelivered=``/``NotifyRelayed=`` entries read; a shadow that asked ``RCPT FAILED``
    alone (an older node) takes such an entry as a contract violation, so a primary never hands
    it one (it gets ``Delivered=``)."""
    from transportd.redundancy.protocol import notice_reason, recipient_done
    relayed, delivered = notice_reason("ok x+y@example.test", "relayed"), notice_reason("a@example.test", "delivered")
    c = identified_client()
    assert c.send_discard(2, recipients=True, failed=True, notify=True) == b"XQDISCARD 2 RCPT FAILED NOTIFY\r\n"
    assert c.receive_data(f"250-{G1} {relayed}\r\n250 {G2} {delivered}\r\n".encode()) == [
        DiscardBatch(((G1, relayed), (G2, delivered)), complete=False)]
    assert recipient_done(relayed) == ("NotifyRelayed=", "ok x+y@example.test")
    assert recipient_done(delivered) == ("NotifyDelivered=", "a@example.test")
    c = identified_client()
    c.send_discard(2, recipients=True, failed=True)
    with pytest.raises(ProtocolError):
        c.receive_data(f"250 {G1} {relayed}\r\n".encode())
    with pytest.raises(ProtocolError):
        identified_client().send_discard(2, recipients=True, notify=True)  # only with Failed= too
    s = server()
    assert isinstance(one(s, XSHADOW), XShadowReceived)
    assert one(s, "XQDISCARD 10 rcpt failed notify") == DiscardRequested(PRIMARY, 10, recipients=True, failed=True,
                                                                       notify=True)
    assert one(s, "XQDISCARD 10 RCPT FAILED") == DiscardRequested(PRIMARY, 10, recipients=True, failed=True)
    assert one(s, "XQDISCARD 10 RCPT NOTIFY") == Refusal(R501)


def test_delay_notices_are_asked_only_after_the_notify_ones() -> None:
    """``XQDISCARD n RCPT FAILED NOTIFY DELAY`` (asked only of a primary that offers XQDISCARDDELAY
    too): ``DelayNotified`` entries read; a shadow that asked without ``DELAY`` (an older node) takes
    one as a contract violation."""
    c = identified_client()
    assert c.send_discard(2, recipients=True, failed=True, notify=True, delay=True) == \
        b"XQDISCARD 2 RCPT FAILED NOTIFY DELAY\r\n"
    assert c.receive_data(f"250 {G1} DelayNotified\r\n".encode()) == [
        DiscardBatch(((G1, "DelayNotified"),), complete=True)]
    c = identified_client()
    c.send_discard(2, recipients=True, failed=True, notify=True)
    with pytest.raises(ProtocolError):
        c.receive_data(f"250 {G1} DelayNotified\r\n".encode())
    with pytest.raises(ProtocolError):
        identified_client().send_discard(2, recipients=True, failed=True, delay=True)  # only with Notify too
    s = server()
    assert isinstance(one(s, XSHADOW), XShadowReceived)
    assert one(s, "XQDISCARD 10 rcpt failed notify delay") == DiscardRequested(
        PRIMARY, 10, recipients=True, failed=True, notify=True, delay=True)
    assert one(s, "XQDISCARD 10 RCPT FAILED DELAY") == Refusal(R501)


@pytest.mark.parametrize("reply", [
    f"250-{G1}\r\n250 not-a-guid\r\n".encode(),
    f"250 {G1} Eaten\r\n".encode(),  # an unknown reason
    b"250-\r\n250 12345\r\n",
])
def test_malformed_discard_reply_keeps_every_shadow(reply: bytes) -> None:
    c = identified_client()
    c.send_discard(5)
    with pytest.raises(ProtocolError):
        c.receive_data(reply)
    assert c.state is ClientState.ERROR and c.discards_unapplied


def test_discard_refused_means_close_without_quit() -> None:
    c = identified_client()
    c.send_discard()
    c.receive_data(f"250 {G1}\r\n".encode())
    c.send_discard()
    assert c.receive_data(R503) == [CommandRefused("XQDISCARD", 503, "5.5.1 Bad sequence of commands")]
    assert c.discards_unapplied and c.state is ClientState.IDLE


@pytest.mark.parametrize("count", [0, -1, 1001, True, "5", 2.0])
def test_discard_batch_size_is_checked(count: object) -> None:
    with pytest.raises(LocalProtocolError):
        identified_client().send_discard(count)  # type: ignore[arg-type]


def test_resubmit() -> None:
    c = ClientConnection(PRIMARY)
    assert c.send_resubmit("db1", 100, 200.5) == b"XRESUBMIT db1 100.000 200.500\r\n"
    text = "2.0.0 3 message(s) resubmitted from the Safety Net"
    assert c.receive_data(f"250 {text}\r\n".encode()) == [ResubmitAnswered(250, text)]
    c.send_resubmit("db1", 1, 1)
    assert c.receive_data(R501) == [CommandRefused("XRESUBMIT", 501, "5.5.4 Invalid arguments")]
    assert not c.discards_unapplied


@pytest.mark.parametrize("destination, start, end", [
    ("", 1, 2), ("two words", 1, 2), ("db\r\nQUIT", 1, 2), ("db", 2, 1), ("db", float("nan"), 2),
    ("db", 1, float("inf")), ("db", "1", 2), ("db", None, 2),
])
def test_resubmit_argument_errors(destination: str, start: object, end: object) -> None:
    c = ClientConnection(PRIMARY)
    with pytest.raises(LocalProtocolError):
        c.send_resubmit(destination, start, end)  # type: ignore[arg-type]
    assert c.state is ClientState.IDLE


def test_mail_parameter_needs_an_accepted_x_verb() -> None:
    with pytest.raises(LocalProtocolError):
        ClientConnection(PRIMARY).mail_parameter(G1)
    assert shadowing_client().mail_parameter(G1.upper()) == f"XSHADOW={G1}"
    assert identified_client().mail_parameter(G2) == f"XSHADOW={G2}"
    with pytest.raises(LocalProtocolError):
        shadowing_client().mail_parameter("not-a-guid")
    c = ClientConnection(PRIMARY)
    c.send_shadow_request(P_DBID)
    with pytest.raises(LocalProtocolError):
        c.mail_parameter(G1)  # the XSHADOWREQUEST reply is still awaited


def copy_of(c: ClientConnection, chunking: bool = True, recipients: tuple[str, ...] = ("a@x.test",)):
    return lambda: c.send_shadow_copy("s@y.test", ["BODY=8BITMIME"], list(recipients), BODY, G1, chunking=chunking)


BODY = b"Subject: s\r\n\r\n.starts with a dot\r\nmid\r\n.\r\nend\r\n"


def test_shadow_copy_is_one_pipelined_group_with_bdat() -> None:
    c = shadowing_client()
    wire = copy_of(c, recipients=("a@x.test", "ü@exämple.test"))()
    assert wire == (b"MAIL FROM:<s@y.test> BODY=8BITMIME XSHADOW=" + G1.encode() + b"\r\n"
                    b"RCPT TO:<a@x.test>\r\nRCPT TO:<" + "ü@exämple.test".encode() + b">\r\n"
                    + f"BDAT {len(BODY)} LAST\r\n".encode() + BODY)
    assert c.state is ClientState.AWAITING_COPY
    replies = b"250 2.1.0 Ok\r\n250 2.1.5 Ok\r\n250 2.1.5 Ok\r\n250 2.6.0 <m@x> Queued mail for redundancy\r\n"
    events = [e for i in range(len(replies)) for e in c.receive_data(replies[i:i + 1])]  # split at every byte
    assert events == [ShadowAccepted("2.6.0 <m@x> Queued mail for redundancy")]
    assert c.state is ClientState.IDLE


def test_shadow_copy_reply_naming_the_queue_database_that_holds_it() -> None:
    """docs/PROTOCOL.md section 2 (*transportd*): the shadow's 2.6.0 may name its queue database;
    the copy counts either way, and the ID comes with it."""
    c = shadowing_client()
    copy_of(c)()
    c.receive_reply(250, ["2.1.0 Ok"]), c.receive_reply(250, ["2.1.5 Ok"])
    text = f"2.6.0 <m@x> [InternalId=7, Hostname={SHADOW}, QueueDatabaseId={b64_dbid(S_DBID)}] Queued mail for redundancy"
    assert c.receive_reply(250, [text]) == [ShadowAccepted(text, S_DBID)]


def test_shadow_copy_with_data_where_the_peer_offers_no_chunking() -> None:
    c = shadowing_client()
    assert copy_of(c, chunking=False)().endswith(b"RCPT TO:<a@x.test>\r\nDATA\r\n")
    assert c.receive_reply(250, ["2.1.0 Ok"]) == []
    assert c.receive_reply(250, ["2.1.5 Ok"]) == []
    [go] = c.receive_reply(354, ["End data with <CR><LF>.<CR><LF>"])
    assert isinstance(go, SendBody)
    assert go.data == b"Subject: s\r\n\r\n..starts with a dot\r\nmid\r\n..\r\nend\r\n.\r\n"
    assert c.receive_reply(250, ["2.6.0 <m@x> queued"]) == [ShadowAccepted("2.6.0 <m@x> queued")]
    c2 = shadowing_client()
    c2.send_shadow_copy("s@y.test", [], ["a@x.test"], b".first line, no line end", G1, chunking=False)
    c2.receive_reply(250, ["ok"]), c2.receive_reply(250, ["ok"])
    assert c2.receive_reply(354, ["go"]) == [SendBody(b"..first line, no line end\r\n.\r\n")]


@pytest.mark.parametrize("code, lines, accepted", [
    (250, [f"2.6.0 <m@x> [InternalId=7, Hostname={SHADOW}] Queued mail for redundancy"], True),
    (250, ["2.6.0 <m@x>", "Queued mail for redundancy"], True),
    (250, ["2.0.0 Ok: queued as 12"], False),  # a plain delivery is no shadow copy
    (451, ["4.4.0 2.6.0 lookalike"], False),
    (554, ["5.5.1 No valid recipients"], False),
])
def test_shadow_counts_only_with_250_and_2_6_0(code: int, lines: list[str], accepted: bool) -> None:
    text = "\n".join(lines)
    expected = ShadowAccepted(text) if accepted else ShadowRefused(code, text)
    c = shadowing_client()
    copy_of(c)()
    c.receive_reply(250, ["2.1.0 Ok"]), c.receive_reply(250, ["2.1.5 Ok"])
    assert c.receive_reply(code, lines) == [expected]
    wire = "".join(f"{code}{'-' if i < len(lines) - 1 else ' '}{t}\r\n" for i, t in enumerate(lines))
    copy_of(c)()
    assert c.receive_data(b"250 2.1.0 Ok\r\n250 2.1.5 Ok\r\n" + wire.encode()) == [expected]
    assert c.state is ClientState.IDLE


@pytest.mark.parametrize("mail, rcpt, last, refused, held", [
    ((550, "5.7.1 no"), (503, "5.5.1 need MAIL"), (503, "5.5.1 need MAIL and RCPT"), (550, "5.7.1 no"), False),
    ((250, "ok"), (501, "5.1.3 bad address"), (503, "5.5.1 need MAIL and RCPT"), (501, "5.1.3 bad address"), False),
    ((250, "ok"), (501, "5.1.3 bad address"), (250, "2.6.0 <m@x> queued"), (501, "5.1.3 bad address"), True),
    ((250, "ok"), (250, "ok"), (452, "4.3.1 full"), (452, "4.3.1 full"), False),
])
def test_a_refused_step_refuses_the_copy_with_the_first_refusal(mail, rcpt, last, refused, held) -> None:
    c = shadowing_client()
    copy_of(c)()
    assert c.receive_reply(*mail[:1], [mail[1]]) == [] and c.receive_reply(rcpt[0], [rcpt[1]]) == []
    [event] = c.receive_reply(last[0], [last[1]])
    assert event == ShadowRefused(*refused)
    assert event.held is held  # stored all the same: the primary sends it a discard event
    assert c.state is ClientState.IDLE


def test_relay_transaction_hop_by_hop_reports_every_reply() -> None:
    c = identified_client()  # after XSHADOW: hop by hop, MAIL carries XSHADOW=
    wire = c.send_transaction("s@y.test", ["SIZE=5"], ["a@x.test", "b@x.test"], b"hi\r\n", chunking=True, guid=G1)
    assert wire == (b"MAIL FROM:<s@y.test> SIZE=5 XSHADOW=" + G1.encode() + b"\r\nRCPT TO:<a@x.test>\r\n"
                    b"RCPT TO:<b@x.test>\r\nBDAT 4 LAST\r\nhi\r\n")
    events = c.receive_data(b"250 2.1.0 ok\r\n550 5.1.1 no such user\r\n250 2.1.5 ok\r\n250 2.0.0 queued as 9\r\n")
    assert events == [TransactionReplies((250, "2.1.0 ok"), ((550, "5.1.1 no such user"), (250, "2.1.5 ok")),
                                         (250, "2.0.0 queued as 9"))]
    assert c.state is ClientState.IDLE


def test_relay_transaction_without_chunking_or_xshadow() -> None:
    c = ClientConnection(SHADOW)  # a plain authenticated relay: no X-verb on this session
    assert c.send_transaction("", [], ["a@x.test"], b".x\r\n", chunking=False) == (
        b"MAIL FROM:<>\r\nRCPT TO:<a@x.test>\r\nDATA\r\n")
    assert c.receive_reply(250, ["ok"]) == [] and c.receive_reply(250, ["ok"]) == []
    assert c.receive_reply(354, ["go"]) == [SendBody(b"..x\r\n.\r\n")]
    assert c.receive_reply(451, ["4.3.0 try later"]) == [
        TransactionReplies((250, "ok"), ((250, "ok"),), (451, "4.3.0 try later"))]
    with pytest.raises(LocalProtocolError):
        ClientConnection(SHADOW).send_transaction("", [], ["a@x.test"], b"", chunking=True, guid=G1)  # no XSHADOW


def test_shadow_copy_needs_a_shadow_request_and_recipients() -> None:
    with pytest.raises(LocalProtocolError):
        copy_of(identified_client())()
    with pytest.raises(LocalProtocolError):
        copy_of(shadowing_client(), recipients=())()


def test_no_pipelining_of_x_verbs() -> None:
    c = identified_client()
    c.send_discard()
    for call in (c.send_xshadow, lambda: c.send_discard(), lambda: c.send_resubmit("db", 1, 2),
                 lambda: c.send_shadow_request(P_DBID), copy_of(c)):
        with pytest.raises(LocalProtocolError):
            call()
    assert c.state is ClientState.AWAITING_DISCARD


def test_a_parsed_reply_with_nothing_awaited_is_refused() -> None:
    c = ClientConnection(PRIMARY)
    with pytest.raises(LocalProtocolError):
        c.receive_reply(250, ["x"])
    assert c.state is ClientState.IDLE


def test_bytes_past_the_awaited_reply_wait_for_the_next_command() -> None:
    c = ClientConnection(SHADOW)
    assert c.receive_data(b"250 early\r\n") == []  # nothing asked yet: kept
    c.send_resubmit("db", 1, 2)
    assert c.receive_data(b"") == [ResubmitAnswered(250, "early")]


# A heartbeat on one session: XSHADOW, then XQDISCARD 2 until a batch is short.
CLIENT_REPLIES = (f"250 {b64_dbid(P_DBID)}\r\n"
                  f"250-{G1}\r\n250 {G2} DeletedByAdmin\r\n"
                  f"250-{G3}\r\n250 {G1}\r\n"
                  "251 OK, no discard events\r\n").encode()
CLIENT_SENT = [f"XSHADOW {b64(SHADOW)}\r\n".encode()] + [b"XQDISCARD 2\r\n"] * 3
CLIENT_EVENTS = [PrimaryIdentified(P_DBID),
                 DiscardBatch(((G1, None), (G2, "DeletedByAdmin")), False),
                 DiscardBatch(((G3, None), (G1, None)), False),
                 DiscardBatch((), True)]


def run_client(chunks: list[bytes]) -> tuple[list[bytes], list[object]]:
    """Drive a heartbeat: the next command goes out as soon as the last reply is in."""
    c = ClientConnection(SHADOW)
    sent = [c.send_xshadow()]
    events: list[object] = []
    for chunk in chunks:
        events += c.receive_data(chunk)
        while c.state is ClientState.IDLE and not (events and events[-1] == DiscardBatch((), True)):
            sent.append(c.send_discard(2))
            events += c.receive_data(b"")
    assert c.state is ClientState.IDLE
    return sent, events


def test_client_replies_at_once() -> None:
    assert run_client([CLIENT_REPLIES]) == (CLIENT_SENT, CLIENT_EVENTS)


def test_client_replies_split_at_every_byte() -> None:
    for i in range(len(CLIENT_REPLIES) + 1):
        assert run_client([CLIENT_REPLIES[:i], CLIENT_REPLIES[i:]]) == (CLIENT_SENT, CLIENT_EVENTS), i
    one_by_one = [CLIENT_REPLIES[i:i + 1] for i in range(len(CLIENT_REPLIES))]
    assert run_client(one_by_one) == (CLIENT_SENT, CLIENT_EVENTS)
    assert run_client([CLIENT_REPLIES.replace(b"\r\n", b"\n")]) == (CLIENT_SENT, CLIENT_EVENTS)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(CLIENT_REPLIES)), max_size=12))
def test_client_replies_in_any_chunks(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(CLIENT_REPLIES)]
    chunks = [CLIENT_REPLIES[a:b] for a, b in itertools.pairwise(points)]
    assert run_client(chunks) == (CLIENT_SENT, CLIENT_EVENTS)


# ============================================================================ server

def server(**kwargs: object) -> ServerConnection:
    s = ServerConnection(SHADOW, S_DBID, **kwargs)  # type: ignore[arg-type]
    s.authenticated(PRIMARY.upper())
    return s


def one(s: ServerConnection, line: str) -> object:
    events = s.receive_data(line.encode() + b"\r\n")
    assert len(events) == 1, events
    return events[0]


SHADOW_REQUEST = f"XSHADOWREQUEST {PRIMARY} {b64_dbid(P_DBID)}"
XSHADOW = f"XSHADOW {b64(PRIMARY)}"


@pytest.mark.parametrize("line", [SHADOW_REQUEST, XSHADOW, "XQDISCARD 50", "XRESUBMIT db 1 2",
                                  f"MAIL FROM:<a@x> XSHADOW={G1}", "xshadow " + b64(PRIMARY)])
def test_x_verbs_need_an_authenticated_peer(line: str) -> None:
    s = ServerConnection(SHADOW, S_DBID)
    refusal = one(s, line)
    assert refusal == Refusal(R550)
    assert refusal.why == "X-verb from unauthenticated session"  # what the operational log says
    assert s.peer_fqdn is None and s.shadow_request is None and s.xshadow_peer is None


def test_shadow_request_accepted_by_the_application() -> None:
    s = server()
    assert s.peer_fqdn == PRIMARY
    assert one(s, SHADOW_REQUEST) == ShadowRequestReceived(PRIMARY, P_DBID)
    assert s.shadow_request is None  # not before the application recorded the primary
    assert s.accept_shadow_request() == f"250 {b64(SHADOW)}\r\n".encode()
    assert s.shadow_request == ShadowRequest(PRIMARY, P_DBID)
    with pytest.raises(LocalProtocolError):
        s.accept_shadow_request()


@pytest.mark.parametrize("setup, line, reply", [
    (lambda s: s.transaction_started(), SHADOW_REQUEST, R503),
    (lambda s: None, "XSHADOWREQUEST", R501),
    (lambda s: None, f"XSHADOWREQUEST {PRIMARY}", R501),
    (lambda s: None, f"XSHADOWREQUEST {PRIMARY} nope", R501),
    (lambda s: None, f"XSHADOWREQUEST bad_name! {b64_dbid(P_DBID)}", R501),
    (lambda s: setattr(s, "accepting", False), SHADOW_REQUEST, R421),
    (lambda s: setattr(s, "accepting", False), "XSHADOWREQUEST", R501),
    (lambda s: None, f"XSHADOWREQUEST other.example {b64_dbid(P_DBID)}", R550),
])
def test_shadow_request_refusals(setup, line: str, reply: bytes) -> None:
    s = server()
    setup(s)
    assert one(s, line) == Refusal(reply)
    assert s.shadow_request is None
    with pytest.raises(LocalProtocolError):
        s.accept_shadow_request()


def test_a_peer_claiming_another_name_is_refused_with_both_names() -> None:
    for line in (f"XSHADOWREQUEST other.example {b64_dbid(P_DBID)}", f"XSHADOW {b64('other.example')}"):
        refusal = one(server(), line)
        assert refusal == Refusal(R550)
        assert refusal.why == f"peer {PRIMARY} claims to be other.example"


def test_shadow_request_when_shadow_redundancy_is_disabled() -> None:
    s = server(shadow_redundancy_enabled=False)
    assert one(s, SHADOW_REQUEST) == Refusal(R502)
    assert one(s, "XSHADOWREQUEST") == Refusal(R502)
    s.transaction_started()
    assert one(s, SHADOW_REQUEST) == Refusal(R503)
    s.transaction_ended()
    # It still answers XSHADOW and XQDISCARD for the copies peers hold of its earlier mail.
    assert isinstance(one(s, XSHADOW), XShadowReceived)
    assert one(s, "XQDISCARD 10") == DiscardRequested(PRIMARY, 10)


def test_version_2010_takes_no_shadow_request_and_answers_xquerydiscard() -> None:
    """The 2010 seed: XSHADOW only (hop-by-hop shadows and discard polling, under either name)."""
    s = server(version="2010")
    refusal = one(s, SHADOW_REQUEST)
    assert refusal == Refusal(R502) and "version 2010" in refusal.why
    assert s.shadow_request is None
    assert isinstance(one(s, XSHADOW), XShadowReceived)
    assert one(s, "XQUERYDISCARD 10") == DiscardRequested(PRIMARY, 10)
    assert s.discard_reply([]) == b"251 OK, no discard events\r\n"
    assert one(server(), "XQUERYDISCARD 5") == Refusal(R503)  # as XQDISCARD: after XSHADOW only


def test_xshadow() -> None:
    s = server()
    assert one(s, f"XSHADOW {b64(PRIMARY.upper())}") == XShadowReceived(PRIMARY, XSHADOW_REPLY)
    assert s.xshadow_peer == PRIMARY


@pytest.mark.parametrize("setup, line, reply", [
    (lambda s: s.transaction_started(), XSHADOW, R503),
    (lambda s: None, "XSHADOW", R501),
    (lambda s: None, "XSHADOW !!!", R501),
    (lambda s: None, f"XSHADOW {b64(PRIMARY)} extra", R501),
    (lambda s: None, f"XSHADOW {b64('other.example')}", R550),
])
def test_xshadow_refusals(setup, line: str, reply: bytes) -> None:
    s = server()
    setup(s)
    assert one(s, line) == Refusal(reply)
    assert s.xshadow_peer is None


def test_xqdiscard() -> None:
    s = server()
    assert one(s, "XQDISCARD 50") == Refusal(R503)  # before XSHADOW
    assert not s.discards_out
    one(s, XSHADOW)
    for arg in ("", " 0", " -1", " x"):
        assert one(s, "XQDISCARD" + arg) == Refusal(R501)
    assert not s.discards_out
    assert one(s, "XQDISCARD 3") == DiscardRequested(PRIMARY, 3)
    assert s.discards_out
    with pytest.raises(LocalProtocolError):
        s.discard_reply([G1, G2, G3, G1])  # more than asked
    assert s.discard_reply([G1, (G2, "DeletedByAdmin"), (G3, None)]) == (
        f"250-{G1}\r\n250-{G2} DeletedByAdmin\r\n250 {G3}\r\n".encode())
    with pytest.raises(LocalProtocolError):
        s.discard_reply([])
    assert one(s, "XQDISCARD 99999") == DiscardRequested(PRIMARY, 1000)
    assert s.discard_reply([]) == b"251 OK, no discard events\r\n"
    s.transaction_started()
    assert one(s, "XQDISCARD 1") == DiscardRequested(PRIMARY, 1)  # allowed inside a transaction


def test_xresubmit() -> None:
    s = server()
    assert one(s, "XRESUBMIT db1 100.000 200.500") == ResubmitRequested(PRIMARY, "db1", 100.0, 200.5)
    assert s.resubmit_reply(3) == b"250 2.0.0 3 message(s) resubmitted from the Safety Net\r\n"
    with pytest.raises(LocalProtocolError):
        s.resubmit_reply(0)


@pytest.mark.parametrize("arg", ["", " db", " db 1", " db 1 2 3", " db x 2", " db 5 1", " db nan 2", " db 1 inf"])
def test_xresubmit_argument_errors(arg: str) -> None:
    assert one(server(), "XRESUBMIT" + arg) == Refusal(R501)


def test_xresubmit_inside_a_transaction() -> None:
    s = server()
    s.transaction_started()
    assert one(s, "XRESUBMIT db 1 2") == Refusal(R503)


def test_mail_with_xshadow_after_shadow_request() -> None:
    s = server()
    assert one(s, f"MAIL FROM:<a@x> XSHADOW={G1}") == Refusal(R503)  # no XSHADOWREQUEST yet
    one(s, SHADOW_REQUEST)
    assert one(s, f"MAIL FROM:<a@x> XSHADOW={G1}") == Refusal(R503)  # asked, never accepted
    one(s, SHADOW_REQUEST)
    s.accept_shadow_request()
    event = one(s, f"MAIL FROM:<a@x> BODY=8BITMIME xshadow={G1.upper()} SMTPUTF8")
    assert event == MailWithShadow(G1, "FROM:<a@x> BODY=8BITMIME SMTPUTF8")
    assert s.shadow_guid is None  # not before the MAIL was accepted
    s.transaction_started()
    assert s.shadow_guid == G1
    assert one(s, "RCPT TO:<b@y>") == OtherCommand(b"RCPT TO:<b@y>")
    assert s.shadow_guid == G1
    s.transaction_ended()
    assert s.shadow_guid is None
    # A MAIL the normal handling refused leaves no guid behind for the next transaction.
    one(s, f"MAIL FROM:<bad XSHADOW={G2}")
    assert one(s, "MAIL FROM:<a@x>") == OtherCommand(b"MAIL FROM:<a@x>")
    s.transaction_started()
    assert s.shadow_guid is None


def test_mail_with_xshadow_after_xshadow() -> None:
    s = server()
    one(s, XSHADOW)
    assert one(s, f"MAIL FROM:<a@x> XSHADOW={G2}") == MailWithShadow(G2, "FROM:<a@x>")


@pytest.mark.parametrize("arg", ["FROM:<xshadow=bob@b.test>", "FROM:<XSHADOW=b@x> SIZE=10",
                                 'FROM:<"a XSHADOW=b"@x>', 'FROM:<"a> XSHADOW=b"@x> BODY=8BITMIME'])
@pytest.mark.parametrize("state", ["anyone", "peer", "after XSHADOW"])
def test_a_local_part_that_reads_xshadow_is_a_plain_mail(arg: str, state: str) -> None:
    """Only an ESMTP parameter after the path is XSHADOW=: ``xshadow=bob`` is a legal local part."""
    s = ServerConnection(SHADOW, S_DBID)
    if state != "anyone":
        s.authenticated(PRIMARY)
    if state == "after XSHADOW":
        one(s, XSHADOW)
    assert s.receive_command("MAIL", arg) == [OtherCommand(f"MAIL {arg}".encode())]
    s.transaction_started()
    assert s.shadow_guid is None


def test_xshadow_is_split_off_the_parameters_only() -> None:
    s = server()
    one(s, XSHADOW)
    assert one(s, f'MAIL FROM:<"a> XSHADOW=b"@x> XSHADOW={G1} SIZE=9') == MailWithShadow(G1, 'FROM:<"a> XSHADOW=b"@x> SIZE=9')
    s.transaction_ended()
    assert one(s, f"MAIL FROM:<xshadow={G2}@x> XSHADOW={G1}") == MailWithShadow(G1, f"FROM:<xshadow={G2}@x>")
    s.transaction_ended()
    assert one(s, f"MAIL FROM:<xshadow=bob@x>XSHADOW={G1}") == MailWithShadow(G1, "FROM:<xshadow=bob@x>")


@pytest.mark.parametrize("arg", ["FROM:<a@x> XSHADOW=nope", f"FROM:<a@x> XSHADOW={G1} XSHADOW={G2}",
                                 "FROM:<a@x> XSHADOW="])
def test_mail_with_a_bad_xshadow_parameter(arg: str) -> None:
    s = server()
    one(s, XSHADOW)
    assert s.receive_command("MAIL", arg) == [Refusal(R501)]
    s.transaction_started()
    assert s.shadow_guid is None


def test_receive_command_for_an_adapter_that_split_the_line() -> None:
    s = server()
    assert s.receive_command("xshadow", b64(PRIMARY)) == [XShadowReceived(PRIMARY, XSHADOW_REPLY)]
    assert s.receive_command("XQDISCARD", None) == [Refusal(R501)]
    assert s.receive_command("NOOP", None) == [OtherCommand(b"NOOP")]
    assert s.receive_command("MAIL", "FROM:<\u00e9@x>") == [OtherCommand("MAIL FROM:<\u00e9@x>".encode())]
    assert s.receive_command("MAIL", f"FROM:<a@x> XSHADOW={G1}") == [MailWithShadow(G1, "FROM:<a@x>")]


def test_an_unanswered_event_lapses_with_the_next_command() -> None:
    s = server()
    one(s, SHADOW_REQUEST)
    one(s, "NOOP")
    with pytest.raises(LocalProtocolError):
        s.accept_shadow_request()
    one(s, "XRESUBMIT db 1 2")
    with pytest.raises(LocalProtocolError):
        s.discard_reply([])


def test_receive_data_stops_where_the_application_must_answer() -> None:
    s = server()
    data = f"XQDISCARD 1\r\n{XSHADOW}\r\n{SHADOW_REQUEST}\r\nMAIL FROM:<a@x> XSHADOW={G1}\r\nRCPT TO:<b@y>\r\n"
    # A refusal and XSHADOW's ready reply need nothing from the application: no stop.
    assert s.receive_data(data.encode()) == [Refusal(R503), XShadowReceived(PRIMARY, XSHADOW_REPLY),
                                             ShadowRequestReceived(PRIMARY, P_DBID)]
    s.accept_shadow_request()
    assert s.receive_data(b"") == [MailWithShadow(G1, "FROM:<a@x>")]
    s.transaction_started()
    assert s.receive_data(b"") == [OtherCommand(b"RCPT TO:<b@y>")]
    assert s.receive_data(b"") == []


def test_an_over_long_command_line_is_refused_and_skipped() -> None:
    s = server()
    assert s.receive_data(b"X" * (MAX_LINE + 10)) == [Refusal(b"500 5.5.2 Command line too long\r\n")]
    assert s.receive_data(b"still the same line\r\nNOOP\r\n") == [OtherCommand(b"NOOP")]
    assert s.receive_data(b"Y" * MAX_LINE + b"\r\nQUIT\r\n") == [
        Refusal(b"500 5.5.2 Command line too long\r\n"), OtherCommand(b"QUIT")]


def test_server_queue_database_id_is_checked() -> None:
    with pytest.raises(ValueError):
        ServerConnection(SHADOW, "not-a-guid")


# A primary's session to its shadow, and a shadow's heartbeat, pipelined the same way.
SERVER_INPUT = (f"NOOP\r\n{SHADOW_REQUEST}\r\nMAIL FROM:<a@x> XSHADOW={G1}\r\nRCPT TO:<b@y>\r\nDATA\r\n"
                f"XQDISCARD 5\r\n{XSHADOW}\r\nXQDISCARD 5\r\nXRESUBMIT db 1 2\r\nXRESUBMIT db\r\n"
                + "Z" * (MAX_LINE + 5) + "\r\nQUIT\r\n").encode()
SERVER_EVENTS = [OtherCommand(b"NOOP"), ShadowRequestReceived(PRIMARY, P_DBID), MailWithShadow(G1, "FROM:<a@x>"),
                 OtherCommand(b"RCPT TO:<b@y>"), OtherCommand(b"DATA"), Refusal(R503),
                 XShadowReceived(PRIMARY, XSHADOW_REPLY), DiscardRequested(PRIMARY, 5),
                 ResubmitRequested(PRIMARY, "db", 1.0, 2.0), Refusal(R501),
                 Refusal(b"500 5.5.2 Command line too long\r\n"), OtherCommand(b"QUIT")]
SERVER_OUTPUT = [f"250 {b64(SHADOW)}\r\n".encode(), f"250 {G1}\r\n".encode(),
                 b"250 2.0.0 0 message(s) resubmitted from the Safety Net\r\n"]


def run_server(chunks: list[bytes]) -> tuple[list[object], list[bytes], str | None]:
    """Drive a server as an adapter would, answering each event before feeding more."""
    s = server()
    events: list[object] = []
    out: list[bytes] = []
    guid = None
    for chunk in chunks:
        new = s.receive_data(chunk)
        while new:
            events += new
            last = new[-1]
            if isinstance(last, ShadowRequestReceived):
                out.append(s.accept_shadow_request())
            elif isinstance(last, DiscardRequested):
                out.append(s.discard_reply([G1]))
            elif isinstance(last, ResubmitRequested):
                out.append(s.resubmit_reply(0))
            elif isinstance(last, MailWithShadow):
                s.transaction_started()
            elif last == OtherCommand(b"DATA"):
                guid = s.shadow_guid
                s.transaction_ended()
            new = s.receive_data(b"")
    return events, out, guid


def test_server_commands_at_once() -> None:
    assert run_server([SERVER_INPUT]) == (SERVER_EVENTS, SERVER_OUTPUT, G1)


def test_server_commands_split_at_every_byte() -> None:
    expected = (SERVER_EVENTS, SERVER_OUTPUT, G1)
    for i in range(len(SERVER_INPUT) + 1):
        assert run_server([SERVER_INPUT[:i], SERVER_INPUT[i:]]) == expected, i
    assert run_server([SERVER_INPUT[i:i + 1] for i in range(len(SERVER_INPUT))]) == expected
    assert run_server([SERVER_INPUT.replace(b"\r\n", b"\n")]) == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, len(SERVER_INPUT)), max_size=12))
def test_server_commands_in_any_chunks(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(SERVER_INPUT)]
    chunks = [SERVER_INPUT[a:b] for a, b in itertools.pairwise(points)]
    assert run_server(chunks) == (SERVER_EVENTS, SERVER_OUTPUT, G1)


# ============================================================================ both roles

def test_client_and_server_agree() -> None:
    """Each side's bytes fed to the other: shadow request, copy parameter, heartbeat, resubmit."""
    primary, shadow = ClientConnection(PRIMARY), server()
    [ev] = shadow.receive_data(primary.send_shadow_request(P_DBID))
    assert ev == ShadowRequestReceived(PRIMARY, P_DBID)
    assert primary.receive_data(shadow.accept_shadow_request()) == [ShadowRequestAccepted(SHADOW)]
    [ev] = shadow.receive_command("MAIL", f"FROM:<a@x> {primary.mail_parameter(G1)}")
    assert ev == MailWithShadow(G1, "FROM:<a@x>")
    watcher = ClientConnection(PRIMARY)  # the same name, as the session authenticated
    [ev] = shadow.receive_data(watcher.send_xshadow())
    assert isinstance(ev, XShadowReceived)
    assert watcher.receive_data(ev.reply) == [PrimaryIdentified(S_DBID)]
    [ev] = shadow.receive_data(watcher.send_discard(2))
    assert watcher.receive_data(shadow.discard_reply([G1, (G2, "DeletedByAdmin")])) == [
        DiscardBatch(((G1, None), (G2, "DeletedByAdmin")), False)]
    [ev] = shadow.receive_data(watcher.send_resubmit("db", 5, 6))
    assert ev == ResubmitRequested(PRIMARY, "db", 5.0, 6.0)
    assert watcher.receive_data(shadow.resubmit_reply(2)) == [
        ResubmitAnswered(250, "2.0.0 2 message(s) resubmitted from the Safety Net")]


# ------------------------------------------------------------------------------ XQSTATUS (transportd)

def test_xqstatus_asks_which_messages_the_primary_still_knows() -> None:
    """The shadow's side: one GUID a line back, in any order, each Held, Done or Unknown."""
    c = identified_client()
    assert c.send_status([G1, G2.upper(), G3]) == f"XQSTATUS {G1} {G2} {G3}\r\n".encode()
    [event] = c.receive_data(f"250-{G2} Held\r\n250-{G1} Unknown\r\n250 {G3} Done\r\n".encode())
    assert event == StatusAnswered({G1: "Unknown", G2: "Held", G3: "Done"})
    assert c.state is ClientState.IDLE and not c.discards_unapplied


@pytest.mark.parametrize("answer", [f"250 {G1} Held\r\n", f"250-{G1} Held\r\n250 {G2} Maybe\r\n",
                                    f"250-{G1} Held\r\n250-{G2} Held\r\n250 {G3} Held\r\n"])
def test_an_xqstatus_reply_that_does_not_answer_exactly_what_was_asked_is_a_violation(answer: str) -> None:
    c = identified_client()
    c.send_status([G1, G2])
    with pytest.raises(ProtocolError):
        c.receive_data(answer.encode())
    assert c.state is ClientState.ERROR and not c.discards_unapplied  # a QUIT still acknowledges the discards


def test_xqstatus_only_after_xshadow_and_with_one_to_fifty_guids() -> None:
    with pytest.raises(LocalProtocolError):
        ClientConnection(SHADOW).send_status([G1])
    for guids in ([], [str(uuid.uuid4()) for _ in range(51)], ["not-a-guid"]):
        with pytest.raises(LocalProtocolError):
            identified_client().send_status(guids)


def test_xqstatus_is_answered_for_the_shadow_that_identified_itself() -> None:
    s = server()
    assert one(s, f"XQSTATUS {G1}") == Refusal(R503)  # before XSHADOW
    assert one(s, XSHADOW) == XShadowReceived(PRIMARY, XSHADOW_REPLY)
    assert one(s, "XQSTATUS") == Refusal(R501)
    assert one(s, "XQSTATUS nope") == Refusal(R501)
    assert one(s, "XQSTATUS " + " ".join(str(uuid.uuid4()) for _ in range(51))) == Refusal(R501)
    assert one(s, f"XQSTATUS {G1} {G2.upper()} {G1}") == StatusRequested(PRIMARY, (G1, G2))
    assert s.status_reply({G2: "Unknown", G1: "Held"}) == f"250-{G1} Held\r\n250 {G2} Unknown\r\n".encode()
    with pytest.raises(LocalProtocolError):
        s.status_reply({G1: "Held"})
    assert ServerConnection(SHADOW, S_DBID).receive_data(f"XQSTATUS {G1}\r\n".encode()) == [Refusal(R550)]
