"""smtp/transaction.py, one mail transaction sans I/O: the bytes of a pipelined group or of one
command at a time, what follows each reply, and the same outcome either way (RFC 2920)."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from transportd.errors import ProtocolError
from transportd.smtp.transaction import Replies, Transaction, dot_stuff

BODY = b"Subject: t\r\n\r\n.dot line\r\nend"


def test_a_pipelined_group_with_data_is_one_write_and_the_body_follows_354() -> None:
    tx = Transaction("a@x.test", ["SIZE=30"], ["b@y.test", "c@y.test"], BODY, chunking=False)
    assert tx.start() == (b"MAIL FROM:<a@x.test> SIZE=30\r\nRCPT TO:<b@y.test>\r\nRCPT TO:<c@y.test>\r\n"
                          b"DATA\r\n")
    assert tx.answer(250, "2.1.0 ok") == b""
    assert tx.answer(550, "5.1.1 no such user") == b""
    assert tx.answer(250, "2.1.5 ok") == b""
    assert tx.answer(354, "go on") == b"Subject: t\r\n\r\n..dot line\r\nend\r\n.\r\n"
    assert tx.replies is None
    assert tx.answer(250, "2.0.0 queued") == b""
    assert tx.replies == Replies((250, "2.1.0 ok"), ((550, "5.1.1 no such user"), (250, "2.1.5 ok")),
                                 (250, "2.0.0 queued"))
    assert tx.replies.refusal == (550, "5.1.1 no such user")
    with pytest.raises(ProtocolError):
        tx.answer(250, "one reply too many")


def test_bdat_last_carries_the_body_in_the_group() -> None:
    tx = Transaction("", [], ["b@y.test"], b"abc\r\n", chunking=True)
    assert tx.start() == b"MAIL FROM:<>\r\nRCPT TO:<b@y.test>\r\nBDAT 5 LAST\r\nabc\r\n"
    for code in (250, 250, 250):
        assert tx.answer(code, "ok") == b""
    assert tx.replies == Replies((250, "ok"), ((250, "ok"),), (250, "ok"))
    assert tx.replies.refusal is None


def test_354_after_every_recipient_was_refused_gets_a_lone_dot() -> None:
    """RFC 2920 3.1: the client reads DATA's reply; if it is 354 anyway, it sends only the dot."""
    tx = Transaction("a@x.test", [], ["b@y.test"], BODY, chunking=False)
    tx.start()
    tx.answer(250, "ok")
    tx.answer(550, "no")
    assert tx.answer(354, "go on") == b".\r\n"
    tx.answer(554, "no valid recipients")
    assert tx.replies is not None and tx.replies.refusal == (550, "no")


def test_one_command_at_a_time_without_pipelining() -> None:
    tx = Transaction("a@x.test", [], ["b@y.test", "c@y.test"], BODY, chunking=False, pipelining=False)
    assert tx.start() == b"MAIL FROM:<a@x.test>\r\n"
    assert tx.answer(250, "ok") == b"RCPT TO:<b@y.test>\r\n"
    assert tx.answer(450, "later") == b"RCPT TO:<c@y.test>\r\n"
    assert tx.answer(250, "ok") == b"DATA\r\n"
    assert tx.answer(354, "go") == b"Subject: t\r\n\r\n..dot line\r\nend\r\n.\r\n"
    assert tx.answer(250, "queued") == b""
    assert tx.replies == Replies((250, "ok"), ((450, "later"), (250, "ok")), (250, "queued"))


def test_without_pipelining_a_refused_mail_or_every_rcpt_refused_ends_it_early() -> None:
    tx = Transaction("a@x.test", [], ["b@y.test", "c@y.test"], BODY, chunking=True, pipelining=False)
    tx.start()
    assert tx.answer(452, "too busy") == b""
    assert tx.replies == Replies((452, "too busy"), ((452, "too busy"), (452, "too busy")), (452, "too busy"))

    tx = Transaction("a@x.test", [], ["b@y.test", "c@y.test"], BODY, chunking=True, pipelining=False)
    tx.start()
    tx.answer(250, "ok")
    assert tx.answer(550, "no b") == b"RCPT TO:<c@y.test>\r\n"
    assert tx.answer(551, "no c") == b""  # no BDAT: nobody would get it
    assert tx.replies == Replies((250, "ok"), ((550, "no b"), (551, "no c")), (551, "no c"))


def test_misuse_is_refused() -> None:
    with pytest.raises(ProtocolError):
        Transaction("a@x.test", [], [], BODY, chunking=False)
    tx = Transaction("a@x.test", [], ["b@y.test"], BODY, chunking=False)
    with pytest.raises(ProtocolError):
        tx.answer(250, "nothing was sent")
    tx.start()
    with pytest.raises(ProtocolError):
        tx.start()


def _server(tx: Transaction, mail: int, rcpts: list[int], final: int, *, rfc_data: bool) -> list[bytes]:
    """A server that answers MAIL with ``mail``, each RCPT with its code, DATA or BDAT as RFC 5321
    says (refused without a valid recipient; with ``rfc_data`` False it says 354 regardless), and
    the end of the data with ``final``; it drives ``tx`` to its end and returns what it was sent."""
    written = [tx.start()]
    state = {"mail": False, "rcpts": 0, "valid": 0}
    while tx.replies is None:
        pending = b"".join(written)
        written.clear()
        for line in pending.split(b"\r\n"):
            if line.startswith(b"MAIL"):
                state["mail"] = mail == 250
                more = tx.answer(mail, "mail")
            elif line.startswith(b"RCPT"):
                code = rcpts[state["rcpts"]] if state["mail"] else 503
                state["rcpts"] += 1
                state["valid"] += code in (250, 251)
                more = tx.answer(code, "rcpt")
            elif line == b"DATA":
                ok = state["mail"] and state["valid"]
                more = tx.answer(354 if ok or not rfc_data else 554, "data")
            elif line.startswith(b"BDAT"):
                more = tx.answer(final if state["mail"] and state["valid"] else 554, "bdat")
                break  # the chunk follows the command: the rest of this write is data
            elif line == b".":
                more = tx.answer(final if state["mail"] and state["valid"] else 554, "end")
                break
            else:
                continue
            if more:
                written.append(more)
        if not written and tx.replies is None:
            raise AssertionError("the transaction waits for a reply the server will not send")
    return written


def _outcomes(r: Replies) -> list[int]:
    """What the connectors make of it (node/connectors.py): MAIL's refusal, else the RCPT's, else
    the end of the data's reply."""
    return [r.mail[0] if r.mail[0] != 250 else rc if rc not in (250, 251) else r.data[0]
            for rc, _ in r.recipients]


codes = st.sampled_from([250, 251, 450, 452, 550, 553])


@settings(max_examples=300, deadline=None)
@given(mail=st.sampled_from([250, 451, 550]), rcpts=st.lists(codes, min_size=1, max_size=5),
       final=st.sampled_from([250, 451, 554]), chunking=st.booleans(), rfc_data=st.booleans())
@example(mail=250, rcpts=[550], final=250, chunking=False, rfc_data=False)
def test_pipelined_and_one_at_a_time_give_every_recipient_the_same_outcome(mail, rcpts, final, chunking,
                                                                           rfc_data) -> None:
    outcomes = []
    for pipelining in (True, False):
        tx = Transaction("a@x.test", [], [f"r{i}@y.test" for i in range(len(rcpts))], BODY,
                         chunking=chunking, pipelining=pipelining)
        _server(tx, mail, list(rcpts), final, rfc_data=rfc_data)
        assert tx.replies is not None and len(tx.replies.recipients) == len(rcpts)
        outcomes.append(_outcomes(tx.replies))
    assert outcomes[0] == outcomes[1]
    # A recipient is delivered only when MAIL, its RCPT and the data were all accepted.
    expect = [final if mail == 250 and rc in (250, 251) else (mail if mail != 250 else rc) for rc in rcpts]
    assert outcomes[0] == expect


def test_dot_stuffing_makes_every_line_end_crlf() -> None:
    assert dot_stuff(b"a\r\n.b\r\n") == b"a\r\n..b\r\n.\r\n"
    assert dot_stuff(b".") == b"..\r\n.\r\n"
    # A bare LF or CR before a dot: a next hop that ends lines at a bare LF must not read a lone
    # dot (the end of the data) in the middle of the body.
    assert dot_stuff(b"a\n.\nb") == b"a\r\n..\r\nb\r\n.\r\n"
    assert dot_stuff(b"a\r.\r\nb\r\n") == b"a\r\n..\r\nb\r\n.\r\n"


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=60).map(lambda b: bytes(b"a.\r\n"[x % 4] for x in b)))
def test_the_only_lone_dot_line_a_next_hop_can_see_is_the_end(body: bytes) -> None:
    wire = dot_stuff(body)
    assert wire.endswith(b"\r\n.\r\n") or wire == b".\r\n"
    content = wire[:-3]
    # No bare CR or LF: lines end the same way for a strict and a lenient reader.
    assert content.count(b"\r") == content.count(b"\n") == content.count(b"\r\n")
    lines = content.split(b"\r\n")[:-1]
    assert b"." not in lines
    # Un-stuffed, it is the body with its line ends made CRLF (and one at the end).
    unstuffed = b"".join((line[1:] if line.startswith(b".") else line) + b"\r\n" for line in lines)
    expect = re.sub(rb"\r\n|\n|\r", b"\r\n", body)
    assert unstuffed == (expect if expect.endswith(b"\r\n") else expect + b"\r\n")


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_reply_no_server_gives_to_its_command_is_the_session_out_of_step(pipelining) -> None:
    """DATA answered 250 (RFC 5321 4.3.2: 354 or a refusal) is a reply taken from elsewhere in a
    shifted stream: a ProtocolError, never the data's 250 (no octet of the body was sent). So is a
    354 to MAIL, RCPT, the end of the data or BDAT LAST."""
    tx = Transaction("a@x.test", [], ["b@y.test"], BODY, chunking=False, pipelining=pipelining)
    tx.start()
    tx.answer(250, "2.1.0 ok")
    tx.answer(250, "2.1.5 ok")
    with pytest.raises(ProtocolError, match="DATA answered 250 2.0.0 Ok: the session is out of step"):
        tx.answer(250, "2.0.0 Ok")
    assert tx.replies is None and tx.awaiting == "DATA"
    for steps in ([(354, "go")], [(250, "ok"), (354, "go")], [(250, "ok"), (250, "ok"), (354, "go"), (354, "go")]):
        tx = Transaction("a@x.test", [], ["b@y.test"], BODY, chunking=False, pipelining=pipelining)
        tx.start()
        with pytest.raises(ProtocolError, match="out of step"):
            for code, text in steps:
                tx.answer(code, text)
        assert tx.replies is None
    tx = Transaction("a@x.test", [], ["b@y.test"], BODY, chunking=True, pipelining=pipelining)
    tx.start()
    tx.answer(250, "ok")
    tx.answer(250, "ok")
    assert tx.awaiting == "BDAT LAST"
    with pytest.raises(ProtocolError, match="BDAT LAST answered 354"):
        tx.answer(354, "go")


def test_a_421_answers_every_command_still_awaiting_a_reply() -> None:
    """RFC 5321 3.8: a 421 ends the session; what a pipelined group (or the rest of a transaction
    one command at a time) still awaited has that reply, and nothing more is sent."""
    tx = Transaction("a@x.test", [], ["b@y.test", "c@y.test"], BODY, chunking=False)
    tx.start()
    tx.closed(421, "4.7.0 too many messages")
    cut = (421, "4.7.0 too many messages")
    assert tx.replies == Replies(cut, (cut, cut), cut) and tx.awaiting is None
    tx = Transaction("a@x.test", [], ["b@y.test", "c@y.test"], BODY, chunking=False, pipelining=False)
    tx.start()
    tx.answer(250, "ok")
    tx.answer(250, "ok")
    tx.closed(*cut)
    assert tx.replies == Replies((250, "ok"), ((250, "ok"), cut), cut)
