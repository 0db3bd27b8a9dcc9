"""RFC 3461 DSN parameters, end to end: real daemons, smtplib as the client, smtp-sink as a next
hop that offers DSN (and, with -N, one that does not). The parameters' syntax is unit-tested here
too (transportd/smtp/dsnparams.py)."""

from __future__ import annotations

import email.utils
import smtplib
import time
import uuid

import pytest
from conftest import wait_for
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_delivery import dsn_parts, events, wait_events
from test_receive import ENHANCED, Raw, ehlo

from transportd.smtp import dsnparams


def send(port: int, sender: str, rcpts: dict[str, list[str]], subject: str,
         mail_options: tuple[str, ...] = ()) -> None:
    """One transaction with per-recipient RCPT parameters (smtplib's own low-level calls)."""
    with smtplib.SMTP("127.0.0.1", port, timeout=20) as s:
        s.ehlo("client.test")
        assert s.has_extn("dsn")
        code, resp = s.mail(sender, list(mail_options))
        assert code == 250, resp
        for rcpt, options in rcpts.items():
            code, resp = s.rcpt(rcpt, options)
            assert code == 250, (rcpt, resp)
        code, resp = s.data(f"Subject: {subject}\r\nMessage-ID: <{subject}@client.test>\r\n\r\nhello\r\n".encode())
        assert code == 250, resp


def sink_args(raw: bytes) -> tuple[str, list[str]]:
    """smtp-sink's record of MAIL's and each RCPT's whole argument (path and parameters)."""
    head = raw.split(b"\n\n", 1)[0].decode("utf-8", "replace").splitlines()
    mail = [line.split(":", 1)[1].strip() for line in head if line.startswith("X-Mail-Args:")]
    rcpts = [line.split(":", 1)[1].strip() for line in head if line.startswith("X-Rcpt-Args:")]
    return mail[0], rcpts


# --------------------------------------------------------------------------- the wire

def test_dsn_parameters_are_checked_at_mail_and_rcpt(make_node):
    node = make_node().start()
    c = Raw(node.port)
    assert "250-DSN" in ehlo(c)
    bad = "501 5.5.4 Syntax error in parameters:"  # followed by what was wrong
    steps = [
        (b"MAIL FROM:<a@remote.test> RET=PARTIAL", f"{bad} RET must be FULL or HDRS"),
        (b"MAIL FROM:<a@remote.test> ENVID=" + b"x" * 101, f"{bad} ENVID longer than 100 characters"),
        (b"MAIL FROM:<a@remote.test> ENVID=a+0Db", f"{bad} ENVID must be printable US-ASCII"),  # CR, once decoded
        (b"MAIL FROM:<a@remote.test> ENVID=a+C3+A9", f"{bad} ENVID must be printable US-ASCII"),  # RFC 3461 4.4
        (b"MAIL FROM:<a@remote.test> RET=FULL RET=HDRS", f"{bad} RET given twice"),
        (b"MAIL FROM:<a@remote.test> NOTIFY=NEVER", "555 5.5.4"),          # a RCPT parameter
        (b"MAIL FROM:<a@remote.test> BODY=7BITX", "501 5.5.4 BODY can only"),  # not ours: aiosmtpd's reply
        (b"MAIL FROM:<a@remote.test> RET=hdrs ENVID=Q+2B1 BODY=8BITMIME", "250 2.1.0"),
        (b"RCPT TO:<alice@example.test> NOTIFY=NEVER,SUCCESS",
         f"{bad} NOTIFY must be NEVER, or one or more of SUCCESS, FAILURE, DELAY"),
        (b"RCPT TO:<alice@example.test> NOTIFY=", "501 5.5.4 Syntax: RCPT TO:"),  # aiosmtpd refuses it first
        (b"RCPT TO:<alice@example.test> ORCPT=alice@example.test", f"{bad} ORCPT must be addr-type;xtext"),
        (b"RCPT TO:<alice@example.test> ORCPT=rfc822;a=b@example.test", f"{bad} ORCPT's address is not xtext"),
        (b"RCPT TO:<alice@example.test> FOO=1", "555 5.5.4"),              # unknown: aiosmtpd's reply as before
        (b"RCPT TO:<alice@example.test> NOTIFY=DELAY NOTIFY=DELAY", f"{bad} NOTIFY given twice"),
        (b"RCPT TO:<alice@example.test> RET=FULL", "555 5.5.4"),           # a MAIL parameter
        (b"RCPT TO:<alice@example.test> NOTIFY=success,Delay ORCPT=rfc822;Alice+2Btag@Example.test",
         "250 2.1.5"),
        (b"RCPT TO:<bob@example.test> NOTIFY=NEVER", "250 2.1.5"),
        (b"RSET", "250 2.0.0"),
    ]
    c.send(b"".join(line + b"\r\n" for line, _ in steps))
    for line, expected in steps:
        [reply] = c.reply()
        assert reply == expected or reply.startswith(expected + " "), (line, reply)
        assert ENHANCED.match(reply), reply
    assert node.alive


@pytest.mark.parametrize("xtext,decoded", [
    ("Q+2B1", "Q+1"), ("plain", "plain"), ("a+3Db", "a=b"), (r"\x{E9}t\x{E9}", "été"), ("+C3+A9", "é"),
    ("+C3", "\ufffd"), (r"\x{D800}", "\ufffd"), (r"\x{2B}41", "+41"),
])
def test_xtext_decodes(xtext, decoded):
    """RFC 6533's utf-8-addr-xtext (ORCPT's utf-8 type) decodes ``\\x{HEX}`` too; RFC 3461's
    plain xtext (ENVID, an rfc822 ORCPT) keeps it as text: a backslash is an xtext character."""
    assert dsnparams.xtext_decode(xtext, utf8=True) == decoded
    assert dsnparams.xtext_decode(xtext) == (xtext.replace("+2B", "+") if "\\x" in xtext else decoded)


def test_an_envid_and_orcpt_come_back_as_the_sender_spelled_them():
    """RFC 3464 2.2.1: the envelope id is the sender's own (case and spaces kept); a backslash
    in plain xtext is text. An ENVID of only spaces is no identifier: no field."""
    from datetime import UTC, datetime

    from transportd.smtp.dsn import RecipientReport, build_dsn

    def notice(envid: str, orcpt: str) -> str:
        report = RecipientReport(address="bob@x.test", action="relayed", status="2.0.0",
                                 original_recipient=dsnparams.orcpt_of(f"ORCPT={orcpt}"))
        data = build_dsn(reporting_mta="n.test", original_sender="s@x.test", recipients=[report],
                         original_message=b"Subject: x\r\n\r\nhi\r\n", arrival_date=datetime.now(UTC),
                         now=datetime.now(UTC), original_envelope_id=dsnparams.envid_of(f"ENVID={envid}"))
        return data.decode("ascii")
    envid = "Q+20+20x\\x{41}" + "y" * 80  # two spaces, a backslash, 97 characters in all
    assert dsnparams.parse(f"ENVID={envid}", dsnparams.MAIL_KEYS)[1] is None
    text = notice(envid, 'rfc822;"a+20+20b"@x.test')
    assert "\r\nOriginal-Envelope-Id: Q  x\\x{41}" + "y" * 80 + "\r\n" in text  # one line, as spelled
    assert 'Original-Recipient: rfc822; "a  b"@x.test\r\n' in text
    assert "\\x{41}" not in notice("plain", r"utf-8;\x{E9}t\x{E9}@x.test").split("Original-Recipient")[1]
    assert "Original-Envelope-Id" not in notice("+20+20", "rfc822;a@x.test")


def test_notify_decides_who_is_told():
    assert dsnparams.wants("", dsnparams.FAILURE) and dsnparams.wants("", dsnparams.DELAY)
    assert not dsnparams.wants("", dsnparams.SUCCESS)
    assert not any(dsnparams.wants("NOTIFY=NEVER ORCPT=rfc822;a@b", k) for k in ("SUCCESS", "FAILURE", "DELAY"))
    assert dsnparams.wants("NOTIFY=SUCCESS", dsnparams.SUCCESS)
    assert not dsnparams.wants("NOTIFY=SUCCESS", dsnparams.FAILURE)
    assert dsnparams.orcpt_of("NOTIFY=SUCCESS ORCPT=rfc822;Bob+2Bx@Example.test") == "rfc822;Bob+x@Example.test"
    assert dsnparams.orcpt_of("NOTIFY=SUCCESS") is None
    assert dsnparams.envid_of("RET=HDRS ENVID=Q+2B1") == "Q+1" and dsnparams.returns_full("RET=FULL")


# --------------------------------------------------------------------------- passed on, or told

def test_parameters_go_on_to_a_next_hop_that_offers_dsn_and_it_tells_the_sender(make_node, sink):
    """RFC 3461 5.2: a next hop that offers DSN gets RET, ENVID, NOTIFY and ORCPT as sent (case
    kept); the success notice is then its to send, not ours."""
    sink.start()
    node = make_node(smart_host=sink.address).start()
    tag = uuid.uuid4().hex[:12]
    send(node.port, "bob@example.test", {
        "carol@foreign.test": ["NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;Carol+2Bx@Foreign.test"],
        "dave@foreign.test": [],
    }, f"passed-{tag}", mail_options=("RET=HDRS", "ENVID=Env+2B1"))
    wait_for(sink.messages, what="message at the sink")
    mail, rcpts = sink_args(sink.messages()[0])
    assert mail.split()[0] == "<bob@example.test>"
    assert "RET=HDRS" in mail.split() and "ENVID=Env+2B1" in mail.split()
    assert rcpts == ["<carol@foreign.test> NOTIFY=SUCCESS,FAILURE ORCPT=rfc822;Carol+2Bx@Foreign.test",
                     "<dave@foreign.test>"]
    wait_events(node, "SENDEXTERNAL")
    time.sleep(1.0)  # waiting for absence: a notice of ours would be on its way by now
    assert not events(node, "DSN")


def test_a_next_hop_without_dsn_gets_none_and_the_sender_is_told_it_was_relayed(make_node, sink):
    """smtp-sink -N does not offer DSN: no parameter goes to it, and NOTIFY=SUCCESS gets a
    "relayed" notice from us (RFC 3461 4.1, RFC 3464 2.3.3), with the ENVID and ORCPT."""
    sink.start(extra_args=("-N",))
    node = make_node(smart_host=sink.address).start()
    tag = uuid.uuid4().hex[:12]
    send(node.port, "bob@example.test", {
        "carol@foreign.test": ["NOTIFY=SUCCESS", "ORCPT=rfc822;carol@foreign.test"],
        "dave@foreign.test": ["NOTIFY=FAILURE"],
    }, f"relayed-{tag}", mail_options=("RET=FULL", "ENVID=E42"))
    wait_for(sink.messages, what="message at the sink")
    mail, rcpts = sink_args(sink.messages()[0])
    assert "RET=" not in mail and "ENVID=" not in mail and not any("NOTIFY" in r for r in rcpts)
    files = wait_for(lambda: node.maildir_files("bob@example.test"), what="notice in bob's Maildir")
    time.sleep(0.5)
    files = node.maildir_files("bob@example.test")
    assert len(files) == 1, files  # dave asked for failures only
    msg, blocks = dsn_parts(files[0])
    assert [b["Final-Recipient"].lower() for b in blocks] == ["rfc822; carol@foreign.test"]
    assert blocks[0]["Action"] == "relayed" and blocks[0]["Status"].startswith("2.")
    assert blocks[0]["Original-Recipient"].lower() == "rfc822; carol@foreign.test"
    status = next(p for p in msg.walk() if p.get_content_type() == "message/delivery-status")
    assert "Original-Envelope-Id: E42" in status.as_string()
    # RET=FULL is for failures: a success notice returns the headers only (RFC 3461 4.3).
    assert not any(p.get_content_type() == "message/rfc822" for p in msg.walk())
    assert f"relayed-{tag}" in str(msg["Subject"])


def test_notify_decides_failure_and_delivery_notices(make_node, sink):
    """A 5xx for NOTIFY=NEVER tells nobody; for NOTIFY=FAILURE with RET=FULL the failure notice
    returns the whole message; a local mailbox delivery with NOTIFY=SUCCESS is "delivered"."""
    sink.start(extra_args=("-f", "RCPT"))
    node = make_node(smart_host=sink.address).start()
    tag = uuid.uuid4().hex[:12]
    send(node.port, "bob@example.test", {"never@foreign.test": ["NOTIFY=NEVER"]}, f"never-{tag}")
    wait_events(node, "FAIL")
    send(node.port, "bob@example.test", {"full@foreign.test": ["NOTIFY=FAILURE"],
                                         "alice@example.test": ["NOTIFY=SUCCESS"]},
         f"full-{tag}", mail_options=("RET=FULL",))
    files = wait_for(lambda: [f for f in node.maildir_files("bob@example.test")] if
                     len(node.maildir_files("bob@example.test")) >= 2 else [], what="two notices for bob")
    time.sleep(1.0)  # waiting for absence: a notice for the NOTIFY=NEVER failure would be here by now
    files = node.maildir_files("bob@example.test")
    assert len(files) == 2, files
    parts = [dsn_parts(f) for f in files]
    actions = sorted((b["Action"], b["Final-Recipient"].lower()) for _, blocks in parts for b in blocks)
    assert actions == [("delivered", "rfc822; alice@example.test"), ("failed", "rfc822; full@foreign.test")]
    failed = next(m for m, blocks in parts if blocks[0]["Action"] == "failed")
    returned = [p for p in failed.walk() if p.get_content_type() == "message/rfc822"]
    assert returned and f"full-{tag}" in returned[0].as_string() and "hello" in returned[0].as_string()
    assert all(f"never-{tag}" not in f.read_text(errors="replace") for f in files)
    assert len(events(node, "FAIL")) == 2


_XTEXTISH = st.sampled_from([chr(c) for c in range(33, 127)] + ["+0D", "+0A", "+00", "+7F", "+2B", "+3D", "+C3",
                                                                  "\\", '"', "<", ">", "(", ";"])
"""Printable ASCII and xtext escapes, control characters' among them (those must be refused)."""


@settings(max_examples=300, deadline=None)
@given(orcpt=st.lists(_XTEXTISH, min_size=1, max_size=30).map("".join),
       envid=st.lists(_XTEXTISH, min_size=1, max_size=30).map("".join), utf8=st.booleans())
def test_any_parameters_taken_make_a_notice_that_builds(orcpt, envid, utf8):
    """Whatever ORCPT and ENVID the receive side takes, the notice carrying them builds: a notice
    that cannot be built would hold its message in Retry as an internal failure."""
    from datetime import UTC, datetime

    from transportd.smtp.dsn import RecipientReport, build_dsn

    rcpt, error = dsnparams.parse(f"NOTIFY=SUCCESS ORCPT=rfc822;{orcpt}", dsnparams.RCPT_KEYS)
    mail, mail_error = dsnparams.parse(f"ENVID={envid}", dsnparams.MAIL_KEYS)
    assume(not error and not mail_error)
    report = RecipientReport(address="bob@x.test", action="relayed", status="2.0.0",
                             original_recipient=dsnparams.orcpt_of(rcpt))
    data = build_dsn(reporting_mta="n.test", original_sender="s@x.test", original_message=b"Subject: x\r\n\r\nhi\r\n",
                     recipients=[report], arrival_date=datetime.now(UTC), now=datetime.now(UTC), utf8=utf8,
                     original_envelope_id=dsnparams.envid_of(mail))
    assert b"Original-Recipient: " in data


def test_delay_notices_follow_notify(make_node, sink):
    """DelayNotificationTimeout with NOTIFY: a recipient whose NOTIFY leaves DELAY out gets no delay
    notice; one with NOTIFY=DELAY gets it, with its ORCPT and the ENVID."""
    node = make_node(smart_host=sink.address, overrides={"delivery": {"delay_notification_timeout": 2}})
    node.start()  # the sink is not started: both wait
    tag = uuid.uuid4().hex[:12]
    send(node.port, "bob@example.test", {"carol@elsewhere.test": ["NOTIFY=FAILURE"]}, f"quiet-{tag}")
    send(node.port, "bob@example.test", {"dave@elsewhere.test": ["NOTIFY=DELAY,FAILURE", "ORCPT=rfc822;Dave@x.test"]},
         f"told-{tag}", mail_options=("ENVID=D1",))
    wait_for(lambda: node.maildir_files("bob@example.test"), timeout=10, what="the delay notice")
    time.sleep(2.5)  # waiting for absence: the quiet one's notice would be here by now
    files = node.maildir_files("bob@example.test")
    assert len(files) == 1, files
    msg, blocks = dsn_parts(files[0])
    assert [(b["Action"], b["Final-Recipient"].lower(), b["Original-Recipient"]) for b in blocks] == [
        ("delayed", "rfc822; dave@elsewhere.test", "rfc822; Dave@x.test")]
    assert f"told-{tag}" in str(msg["Subject"]) and "Original-Envelope-Id: D1" in msg.as_string()
    # when it was last tried and until when it will be (the message's expiry: 2 days by default)
    tried = email.utils.parsedate_to_datetime(blocks[0]["Last-Attempt-Date"]).timestamp()
    until = email.utils.parsedate_to_datetime(blocks[0]["Will-Retry-Until"]).timestamp()
    assert time.time() - 60 < tried <= time.time() + 1, blocks[0]
    assert abs(until - (tried + 2 * 86400)) < 120, blocks[0]
