"""A real OpenSMTPD (Debian's opensmtpd, ``transportd.devtools.opensmtpd``) on both sides of a node.

OpenSMTPD is the plain-spoken peer: as a server it offers neither PIPELINING nor CHUNKING nor
SMTPUTF8 (8BITMIME, SIZE, DSN only), as a client it sends with DATA one command at a time, and
it relays to a smart host over STARTTLS with AUTH when told to. smtp-sink stands behind both and
records what crossed both hops.
"""

from __future__ import annotations

import re
import smtplib
import time

import pytest
from conftest import private_mtas_of, tls_relay_overrides, wait_for
from test_postfix_peer import DSN_MAIL, assert_relayed_with_dsn, by_subject, send, sink_args

from transportd.devtools.opensmtpd import OpenSMTPD

pytestmark = pytest.mark.skipif(OpenSMTPD.available() is not None, reason=f"{OpenSMTPD.available()}")


@pytest.fixture
def opensmtpd():
    """A factory of started OpenSMTPD daemons (``opensmtpd(relay_to, name, relay=, listen=, extra=)``)."""
    yield from private_mtas_of(OpenSMTPD, "transportd-opensmtpd-", "opensmtpd.test")


def exactly(n: int, rows):
    """A wait_for predicate: ``rows()`` once it holds ``n`` items."""
    def ready():
        got = rows()
        return got if len(got) == n else None
    return ready


def through_the_next_hop(node, sink, subject: str, n: int) -> list[dict]:
    """``n`` messages to dan and erin, each with RET=FULL, ENVID=ENV-i and NOTIFY=SUCCESS, sent to
    ``node``, whose next hop relays to ``sink``: each arrives with its DSN parameters. Returns the
    node's ``n`` SENDEXTERNAL rows."""
    for i in range(n):
        send("127.0.0.1", node.port, "bob@remote.test", ["dan@foreign.test", "erin@foreign.test"], f"{subject} {i}",
             mail_options=("RET=FULL", f"ENVID=ENV-{i}"), rcpt_options=("NOTIFY=SUCCESS",))
    got = wait_for(exactly(n, lambda: by_subject(sink, subject)), timeout=30, what=f"the {n} messages at the sink")
    for m in got:
        mail, rcpts = sink_args(m)
        i = re.search(rb"Subject: " + subject.encode() + rb" (\d+)", m).group(1).decode()
        assert {"RET=FULL", f"ENVID=ENV-{i}"} <= set(mail.split()), mail
        assert sorted(r.split()[0] for r in rcpts) == ["<dan@foreign.test>", "<erin@foreign.test>"], rcpts
        assert all("NOTIFY=SUCCESS" in r.split() for r in rcpts), rcpts
    return wait_for(exactly(n, lambda: node.tracking(event_id="SENDEXTERNAL")), timeout=10,
                    what=f"{n} SENDEXTERNAL rows")


def relayed(mta: OpenSMTPD) -> list[str]:
    """OpenSMTPD's lines for a message it relayed (one per recipient, the next hop's reply in ``stat``)."""
    return [line for line in mta.log().splitlines() if " mta delivery " in line and 'result="Ok"' in line]


def test_opensmtpd_relays_into_the_node_with_data_and_the_dsn_parameters_cross(make_node, sink, opensmtpd):
    """client -> OpenSMTPD -> node -> smtp-sink: OpenSMTPD sends with DATA (one command at a time),
    gets the node's 250 and relays the message once; RET, ENVID, NOTIFY and ORCPT arrive at the
    sink as the client gave them, the 8-bit body whole."""
    sink.start()
    node = make_node(smart_host=sink.address).start()
    mta = opensmtpd(f"127.0.0.1:{node.port}")
    assert send(mta.host, mta.port, "bob@remote.test", ["carol@foreign.test"], "osd relays", "caf\u00e9\r\n",
                mail_options=DSN_MAIL,
                rcpt_options=("NOTIFY=FAILURE,DELAY", "ORCPT=rfc822;carol@foreign.test")) == {}
    got = wait_for(lambda: by_subject(sink, "osd relays"), timeout=30, what="the message at the sink")
    lines = wait_for(lambda: relayed(mta), timeout=10, what="OpenSMTPD's relay line")
    received = node.tracking(event_id="RECEIVE")
    assert len(got) == 1 and len(lines) == 1 and len(received) == 1, (got, lines, received)
    assert "queued as " + received[0]["internal-message-id"] in lines[0], lines[0]
    assert_relayed_with_dsn(got[0], {"ORCPT=rfc822;carol@foreign.test", "NOTIFY=FAILURE,DELAY"})
    assert [r["client-hostname"] for r in received] == ["opensmtpd.test"]


def test_the_node_delivers_to_opensmtpd_without_pipelining(make_node, sink, opensmtpd):
    """node -> OpenSMTPD -> smtp-sink: a next hop that offers no PIPELINING and no CHUNKING gets
    one command at a time and DATA; the DSN parameters are passed on, each SENDEXTERNAL row names
    OpenSMTPD's reply (its message id)."""
    sink.start()
    mta = opensmtpd(sink.address)
    node = make_node(smart_host=mta.address).start()
    rows = through_the_next_hop(node, sink, "to osd", 5)
    assert all(re.search(r"250 2\.0\.0 \S+ Message accepted for delivery", r["recipient-status"]) for r in rows), rows
    assert not node.tracking(event_id="DEFER") and not node.tracking(event_id="FAIL")


def test_opensmtpd_relays_through_the_node_with_starttls_and_auth(make_node, sink, opensmtpd, relay_tls):
    """A smart-host setup as operators write it for OpenSMTPD: ``relay host smtp+tls://label@node
    auth <secrets> ca NAME``, the node's certificate checked against the CA, and the node relays
    only for authenticated clients (no trusted network, ``require_tls``)."""
    secrets = relay_tls / "secrets"
    secrets.write_text("node osd:s3cret\n")
    secrets.chmod(0o644)
    sink.start()
    node = make_node(smart_host=sink.address, overrides=tls_relay_overrides(relay_tls, "osd", "s3cret")).start()
    mta = opensmtpd(None, relay=f"host smtp+tls://node@127.0.0.1:{node.port} auth <secrets> ca node",
                    extra=f'table secrets file:{secrets}\nca node cert "{relay_tls / "ca.pem"}"')
    assert send(mta.host, mta.port, "bob@remote.test", ["carol@foreign.test"], "osd with auth") == {}
    got = wait_for(lambda: by_subject(sink, "osd with auth"), timeout=30, what="the message at the sink")
    assert len(got) == 1
    lines = wait_for(lambda: relayed(mta), timeout=10, what="OpenSMTPD's relay line")
    assert len(lines) == 1 and "queued as " in lines[0], lines
    log = mta.log()
    assert " mta tls ciphers=TLSv1." in log and ' mta server-cert-check result="success"' in log, log[-3000:]
    assert not node.tracking(event_id="FAIL")


def test_a_utf8_message_is_not_sent_to_opensmtpd_which_offers_no_smtputf8(make_node, sink, opensmtpd):
    """RFC 6531 3.2: OpenSMTPD offers no SMTPUTF8, so the node does not send it a message whose
    envelope needs it: the recipient fails with 5.6.7 (a DSN to the sender), OpenSMTPD never sees
    the transaction; an ASCII message beside it is delivered."""
    sink.start()
    mta = opensmtpd(sink.address)
    node = make_node(smart_host=mta.address).start()
    with smtplib.SMTP("127.0.0.1", node.port, timeout=20) as c:
        c.ehlo("client.test")
        c.sendmail("jos\u00e9@remote.test", ["\u00f1and\u00fa@foreign.test"],
                   "From: x@remote.test\r\nSubject: utf8 to osd\r\n\r\ngr\u00fc\u00df\r\n".encode(),
                   mail_options=["SMTPUTF8", "BODY=8BITMIME"])
    send("127.0.0.1", node.port, "bob@remote.test", ["dan@foreign.test"], "ascii to osd")
    fail = wait_for(exactly(2, lambda: node.tracking(event_id="FAIL")), timeout=30,
                    what="two FAIL rows")
    assert fail[0]["recipient-address"] == "\u00f1and\u00fa@foreign.test", fail
    assert fail[0]["recipient-status"].startswith("550 5.6.7 "), fail
    # its DSN, to a UTF-8 sender through the same next hop, fails the same way (and makes no DSN)
    dsn = wait_for(lambda: node.tracking(event_id="DSN"), timeout=10, what="the DSN row")
    assert [(r["internal-message-id"], r["recipient-address"]) for r in fail[1:]] == [
        (dsn[0]["internal-message-id"], "jos\u00e9@remote.test")], fail
    wait_for(lambda: by_subject(sink, "ascii to osd"), timeout=30, what="the ASCII message at the sink")
    assert not by_subject(sink, "utf8 to osd")
    assert "\u00f1and\u00fa" not in mta.log()


def test_opensmtpd_queues_while_the_node_is_down_and_delivers_once_after(make_node, sink, opensmtpd):
    """OpenSMTPD keeps its session to the node open after a message (``hanging on``); the node's
    stop answers it 421 and closes. A message OpenSMTPD takes while the node is down stays in its
    queue; once the node is back, OpenSMTPD's next try delivers it, once."""
    sink.start()
    node = make_node(smart_host=sink.address).start()
    mta = opensmtpd(f"127.0.0.1:{node.port}")
    assert send(mta.host, mta.port, "bob@remote.test", ["carol@foreign.test"], "before the stop") == {}
    wait_for(lambda: by_subject(sink, "before the stop"), timeout=30, what="the first message at the sink")
    assert node.stop() == 0
    assert send(mta.host, mta.port, "bob@remote.test", ["carol@foreign.test"], "while down") == {}
    deferred = wait_for(lambda: [ln for ln in mta.log().splitlines() if 'result="TempFail"' in ln], timeout=30,
                        what="OpenSMTPD's deferral")
    # the 421 the stop wrote on the session OpenSMTPD kept, read when it tries that session again
    # (or, past its ten seconds of hanging on, a refused connection)
    assert 'stat="421 4.3.2 ' in deferred[0] or "Network error" in deferred[0], deferred
    node.start()
    mta.schedule_all()
    got = wait_for(lambda: by_subject(sink, "while down"), timeout=30, what="the second message at the sink")
    time.sleep(1)  # waiting for absence: no second copy
    assert len(by_subject(sink, "while down")) == len(got) == 1
    assert len(by_subject(sink, "before the stop")) == 1
    assert len(relayed(mta)) == 2, relayed(mta)


def test_a_message_over_opensmtpds_size_limit_fails_at_once_with_a_dsn(make_node, sink, opensmtpd):
    """OpenSMTPD (``smtp max-message-size``) announces its limit with SIZE and refuses a message
    over it with 554 5.3.4: the recipient fails at once, with a DSN to the sender, and a small
    message beside it is delivered."""
    sink.start()
    mta = opensmtpd(sink.address, extra="smtp max-message-size 20K")
    node = make_node(smart_host=mta.address).start()
    send("127.0.0.1", node.port, "bob@remote.test", ["dan@foreign.test"], "small for osd")
    send("127.0.0.1", node.port, "bob@remote.test", ["dan@foreign.test"], "big for osd", ("y" * 76 + "\r\n") * 400)
    wait_for(lambda: by_subject(sink, "small for osd"), timeout=30, what="the small message at the sink")
    fail = wait_for(lambda: node.tracking(event_id="FAIL"), timeout=30, what="the FAIL row")
    assert fail[0]["message-subject"] == "big for osd" and fail[0]["recipient-status"][:10] in (
        "552 5.3.4 ", "554 5.3.4 "), fail
    assert node.tracking(event_id="DSN"), "no DSN to the sender"
    # the only copy at the sink is the DSN, from <> through OpenSMTPD, with the message's headers
    dsn = wait_for(lambda: by_subject(sink, "big for osd"), timeout=30, what="the DSN at the sink")
    assert len(dsn) == 1 and sink_args(dsn[0])[0] == "<>" and b"multipart/report" in dsn[0], dsn


def test_opensmtpds_limits_per_session_and_per_message_cost_no_deferral(make_node, sink, opensmtpd):
    """OpenSMTPD's ``smtp limit max-rcpt`` answers the recipients past it ``451 4.5.3 Too many
    recipients`` (RFC 3463's X.5.3: split the message) and ``max-mails`` ends a session after so
    many transactions: the node sends the other recipients in further transactions and the other
    messages on further sessions, at once: every recipient at the sink once, no DEFER row."""
    sink.start()
    mta = opensmtpd(sink.address, extra="smtp limit max-mails 3\nsmtp limit max-rcpt 2")
    node = make_node(smart_host=mta.address).start()
    rcpts = [f"r{i}@foreign.test" for i in range(5)]
    with smtplib.SMTP("127.0.0.1", node.port, timeout=20) as c:
        for i in range(6):
            c.sendmail("bob@remote.test", rcpts, f"From: bob@remote.test\r\nSubject: limits {i}\r\n\r\nx\r\n".encode())

    def arrived() -> list[tuple[str, str]] | None:
        got = sorted((re.search(rb"Subject: (limits \d)", m).group(1).decode(), r.split()[0])
                     for m in by_subject(sink, "limits") for r in sink_args(m)[1])
        return got if len(got) >= 30 else None
    got = wait_for(arrived, timeout=30, what="30 recipients at the sink")
    assert got == sorted((f"limits {i}", f"<{r}>") for i in range(6) for r in rcpts), got
    assert "451 4.5.3 Too many recipients" in mta.log()
    assert "452 4.5.3 Too many recipients: Too many messages sent" in mta.log()  # max-mails, at MAIL
    assert "deferred a further transaction on the session" in node.log()  # QUIT, and a new session
    assert not node.tracking(event_id="DEFER"), node.tracking(event_id="DEFER")[:2]
    assert not node.tracking(event_id="FAIL")
