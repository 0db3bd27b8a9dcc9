"""A real Postfix MTA (Debian's package, ``transportd.devtools.postfix``) on both sides of a node.

Postfix's smtp client relays into the node (PIPELINING, DSN, 8BITMIME, SMTPUTF8 as Postfix sends
them, and what it does with the node's 452 for too many recipients); the node delivers to
Postfix's smtpd (its replies, its SIZE, its refusals and deferrals, as a next hop outside the
boundary really answers). smtp-sink stands behind both and records each transaction's MAIL and
RCPT arguments (``X-Mail-Args``, ``X-Rcpt-Args``), so what crossed both hops is seen.
"""

from __future__ import annotations

import re
import shutil
import smtplib
import tempfile
import time
from pathlib import Path

import pytest
from conftest import private_mtas, wait_for

from transportd.devtools.postfix import PostfixMTA

pytestmark = pytest.mark.skipif(PostfixMTA.available() is not None,
                                reason=f"{PostfixMTA.available()}")


@pytest.fixture
def postfix():
    """A factory of started Postfix instances (``postfix(relay_to, name, **main_cf)``)."""
    def build(folder: Path, relay_to: str, name: str = "postfix.test", **settings: str) -> PostfixMTA:
        return PostfixMTA(folder, relay_to, name=name,
                          settings={"smtputf8_enable": "yes", "minimal_backoff_time": "1s",
                                    "maximal_backoff_time": "2s", "queue_run_delay": "1s", **settings})
    yield from private_mtas("transportd-postfix-", build)


DSN_MAIL = ("BODY=8BITMIME", "RET=HDRS", "ENVID=ENV-7")
"""MAIL parameters of the relay tests: what an MTA in front of a node must pass on (RFC 3461)."""


def assert_relayed_with_dsn(message: bytes, rcpt_params: set[str]) -> None:
    """bob's message to carol (8-bit body, ``DSN_MAIL``) as smtp-sink got it behind two hops: the
    MAIL parameters and carol's ``rcpt_params`` crossed both, the body whole."""
    mail, rcpts = sink_args(message)
    assert mail.split()[0] == "<bob@remote.test>" and {"RET=HDRS", "ENVID=ENV-7"} <= set(mail.split()[1:]), mail
    assert len(rcpts) == 1 and rcpts[0].split()[0] == "<carol@foreign.test>", rcpts
    assert set(rcpts[0].split()[1:]) == rcpt_params, rcpts
    assert "caf\u00e9".encode() in message


def assert_utf8_arrived(usink) -> None:
    """The one message of the UTF-8 chains at the transportd sink, its envelope and body whole."""
    got = wait_for(usink.messages, timeout=30, what="the message at the sink")
    assert len(got) == 1
    head, body = got[0].split(b"\r\n\r\n", 1)
    assert "X-Sink-Mail-From: <jos\u00e9@remote.test>".encode() in head, head
    assert "X-Sink-Rcpt-To: <\u00f1and\u00fa@foreign.test>".encode() in head, head
    assert body == "gr\u00fc\u00df \u2713\r\n".encode()


def sink_args(message: bytes) -> tuple[str, list[str]]:
    """smtp-sink's record of a transaction: the MAIL arguments and each RCPT's."""
    head = message.split(b"\n\n", 1)[0].decode("utf-8", "replace")
    mail = re.search(r"^X-Mail-Args: (.*)$", head, re.MULTILINE)
    return (mail.group(1).strip() if mail else ""), [m.strip() for m in re.findall(r"^X-Rcpt-Args: (.*)$", head,
                                                                                     re.MULTILINE)]


def by_subject(sink, subject: str) -> list[bytes]:
    return [m for m in sink.messages() if f"Subject: {subject}".encode() in m]


def send(host: str, port: int, sender: str, rcpts: list[str], subject: str, body: str = "hello\r\n", *,
         mail_options: tuple[str, ...] = (), rcpt_options: tuple[str, ...] = ()) -> dict:
    msg = (f"From: {sender}\r\nTo: {', '.join(rcpts)}\r\nSubject: {subject}\r\n"
           f"Message-ID: <{subject.replace(' ', '-')}@client.test>\r\n\r\n{body}").encode()
    with smtplib.SMTP(host, port, timeout=20) as c:
        c.ehlo("client.test")
        return c.sendmail(sender, rcpts, msg, mail_options=list(mail_options), rcpt_options=list(rcpt_options))


def test_dsn_and_8bitmime_cross_postfix_the_node_and_postfix(make_node, sink, postfix):
    """client -> Postfix -> node -> Postfix -> smtp-sink: RFC 3461's parameters (RET, ENVID,
    NOTIFY, ORCPT) and BODY=8BITMIME arrive as the client gave them; each MTA logs the next one's
    reply naming the id that one gave the message (the node's internal-message-id in the first
    Postfix's log, the second Postfix's queue id in the node's SENDEXTERNAL row)."""
    sink.start()
    out = postfix(sink.address, name="relay-out.test")
    node = make_node(smart_host=out.address).start()
    into = postfix(f"127.0.0.1:{node.port}", name="relay-in.test")
    assert send(into.host, into.port, "bob@remote.test", ["carol@foreign.test"], "dsn chain", "caf\u00e9\r\n",
                mail_options=("BODY=8BITMIME", "RET=HDRS", "ENVID=ENV-42"),
                rcpt_options=("NOTIFY=FAILURE,DELAY", "ORCPT=rfc822;carol@foreign.test")) == {}
    got = wait_for(lambda: by_subject(sink, "dsn chain"), timeout=30, what="the message at the sink")
    mail, rcpts = sink_args(got[0])
    assert mail.split()[0] == "<bob@remote.test>" and set(mail.split()[1:]) == {
        "BODY=8BITMIME", "ENVID=ENV-42", "RET=HDRS"}, mail
    assert rcpts == ["<carol@foreign.test> ORCPT=rfc822;carol@foreign.test NOTIFY=FAILURE,DELAY"], rcpts
    assert "caf\u00e9".encode() in got[0]
    received = node.tracking(event_id="RECEIVE")
    assert [r["client-hostname"] for r in received] == ["relay-in.test"], received
    sent_in = wait_for(lambda: re.findall(r"status=sent \(250 2\.0\.0 Ok: queued as (\d+)\)", into.maillog()),
                       timeout=10, what="the first Postfix's status=sent line")
    assert sent_in == [received[0]["internal-message-id"]], (sent_in, received)
    rows = wait_for(lambda: node.tracking(event_id="SENDEXTERNAL"), timeout=10, what="the SENDEXTERNAL row")
    out_ids = re.findall(r"postfix/smtpd\[\d+\]: ([0-9A-F]{6,}): client=", out.maillog())
    m = re.search(r"250 2\.0\.0 Ok: queued as ([0-9A-F]+)", rows[0]["recipient-status"])
    assert len(rows) == 1 and m and [m.group(1)] == out_ids, (rows, out_ids)


def test_smtputf8_crosses_postfix_the_node_and_postfix(make_node, usink, postfix):
    """RFC 6531 through real Postfix on both sides: client -> Postfix -> node -> Postfix ->
    transportd sink (smtp-sink does not offer SMTPUTF8); the UTF-8 envelope and body arrive whole."""
    out = postfix(usink.address, name="relay-out.test")
    node = make_node(smart_host=out.address).start()
    into = postfix(f"127.0.0.1:{node.port}", name="relay-in.test")
    assert send(into.host, into.port, "jos\u00e9@remote.test", ["\u00f1and\u00fa@foreign.test"], "utf8 chain",
                "gr\u00fc\u00df \u2713\r\n", mail_options=("SMTPUTF8", "BODY=8BITMIME")) == {}
    assert_utf8_arrived(usink)
    assert not node.tracking(event_id="FAIL") and "status=bounced" not in into.maillog() + out.maillog()


def test_postfix_sends_the_recipients_past_the_nodes_limit_again(make_node, sink, postfix):
    """The node takes 2 recipients per message (452 4.5.3 for the rest, RFC 5321 4.5.3.1.10):
    Postfix delivers the others in further transactions, and every recipient arrives once."""
    sink.start()
    node = make_node(smart_host=sink.address, overrides={"frontend": {"max_recipients_per_message": 2}}).start()
    mta = postfix(f"127.0.0.1:{node.port}")
    rcpts = [f"r{i}@foreign.test" for i in range(5)]
    assert send(mta.host, mta.port, "bob@remote.test", rcpts, "five recipients") == {}
    flushed = [time.monotonic()]

    def arrived() -> bool:
        if sum(len(sink_args(m)[1]) for m in by_subject(sink, "five recipients")) >= 5:
            return True
        # Postfix retries the deferred recipients at its next queue run; now and then (about one
        # run in six here) its queue manager finds the file still being delivered and leaves it
        # for longer than the test waits. `postfix flush`, as an operator would, asks for the
        # run at once: the further transactions are still Postfix's own.
        if time.monotonic() - flushed[0] > 5:
            mta.postfix("flush")
            flushed[0] = time.monotonic()
        return False
    try:
        wait_for(arrived, timeout=40, what="all five recipients at the sink")
    except AssertionError as exc:  # which side held them: Postfix's log and the node's say
        raise AssertionError(f"{exc}\n--- Postfix:\n{mta.maillog()[-4000:]}\n--- node:\n{node.log()[-4000:]}") from None
    got = sorted(r.split()[0] for m in by_subject(sink, "five recipients") for r in sink_args(m)[1])
    assert got == sorted(f"<{r}>" for r in rcpts), got
    received = node.tracking(event_id="RECEIVE")  # three messages: 2 + 2 + 1 recipients
    assert sorted(len(r["recipient-address"].split(";")) for r in received) == [1, 2, 2], received
    assert "452 4.5.3" in mta.maillog()


def test_postfix_refusals_and_deferrals_at_the_node(make_node, sink, postfix):
    """Postfix refuses one recipient (550 from an access map), defers another (450), and refuses a
    message over its SIZE: the node delivers what was taken, returns NDRs naming Postfix's own
    reply for the refusals, keeps the deferred recipient and delivers it once Postfix takes it."""
    sink.start()
    access = ("inline:{ { nobody@foreign.test = 550 5.1.1 no such user here }, "
              "{ later@foreign.test = 450 4.2.1 try again later } }")
    mta = postfix(sink.address, smtpd_recipient_restrictions=f"check_recipient_access {access}",
                  message_size_limit="40000")
    node = make_node(smart_host=mta.address).start()
    send("127.0.0.1", node.port, "bob@example.test", ["carol@foreign.test", "nobody@foreign.test",
                                                      "later@foreign.test"], "three fates")
    send("127.0.0.1", node.port, "bob@example.test", ["carol@foreign.test"], "too big", ("y" * 76 + "\r\n") * 700)
    wait_for(lambda: by_subject(sink, "three fates"), timeout=30, what="carol's copy at the sink")
    # two NDRs in bob's mailbox: nobody's (Postfix's 550 text) and the whole of "too big" (552)
    ndrs = wait_for(lambda: len(node.maildir_files("bob@example.test")) == 2 and node.maildir_files("bob@example.test"),
                    timeout=30, what="two NDRs to bob")
    texts = [p.read_bytes().decode("utf-8", "replace") for p in ndrs]
    refused = [t for t in texts if "nobody@foreign.test" in t]
    assert len(refused) == 1 and "550 5.1.1" in refused[0] and "no such user here" in refused[0], texts
    # the NDR names the refused recipient only (not the deferred one, still queued)
    assert re.findall(r"Final-Recipient: rfc822; ?(\S+)", refused[0]) == ["nobody@foreign.test"], refused[0]
    big = [t for t in texts if "too big" in t]
    assert len(big) == 1 and re.search(r"552 5\.3\.4", big[0]), texts
    defers = wait_for(lambda: node.tracking(event_id="DEFER", recipient="later@foreign.test"), timeout=15,
                      what="the DEFER row of later@")
    assert "450 4.2.1" in defers[0]["recipient-status"], defers[0]
    assert not [m for m in by_subject(sink, "three fates") if b"<later@foreign.test>" in m]
    # Postfix takes later@ once its map no longer defers it; the node's next retry delivers it.
    # (Restarted, not reloaded: an smtpd process already running keeps the old map for a while.)
    mta.stop()
    cf = mta.dir / "etc" / "main.cf"
    cf.write_text(cf.read_text().replace("{ later@foreign.test = 450 4.2.1 try again later } ", ""))
    mta.start()
    wait_for(lambda: any(b"<later@foreign.test>" in m for m in by_subject(sink, "three fates")), timeout=40,
             what="later@ delivered on a retry")
    delivered = [r.split()[0] for m in by_subject(sink, "three fates") for r in sink_args(m)[1]]
    assert sorted(delivered) == ["<carol@foreign.test>", "<later@foreign.test>"], delivered
    assert len(node.maildir_files("bob@example.test")) == 2  # no NDR for later@, no second one for nobody@


def test_the_node_delivers_to_a_postfix_that_offers_no_extensions(make_node, sink, postfix):
    """A next hop without PIPELINING, DSN, 8BITMIME, CHUNKING or SIZE (Postfix told to discard
    them from its EHLO, ``smtpd_discard_ehlo_keywords``): the node sends no DSN parameter (RFC
    3461 4.1: a "relayed" DSN to the sender, who asked for SUCCESS) and converts the 8-bit body to
    quoted-printable (RFC 6152); Postfix refuses nothing."""
    sink.start()
    mta = postfix(sink.address, smtpd_discard_ehlo_keywords="pipelining, dsn, 8bitmime, chunking, size")
    node = make_node(smart_host=mta.address).start()
    assert send("127.0.0.1", node.port, "bob@example.test", ["carol@foreign.test"], "plain next hop",
                "caf\u00e9 cr\u00e8me\r\n", mail_options=("BODY=8BITMIME", "ENVID=E9"),
                rcpt_options=("NOTIFY=SUCCESS,FAILURE",)) == {}
    got = wait_for(lambda: by_subject(sink, "plain next hop"), timeout=30, what="the message at the sink")
    assert len(got) == 1
    mail, rcpts = sink_args(got[0])
    # (Postfix still takes DSN parameters it does not announce and passes them on: none arrived,
    # so the node sent none. It adds an ORCPT of its own, as it always does.)
    assert mail.split() == ["<bob@example.test>"], mail
    assert len(rcpts) == 1 and rcpts[0].split()[0] == "<carol@foreign.test>" and "NOTIFY=" not in rcpts[0], rcpts
    assert b"Content-Transfer-Encoding: quoted-printable" in got[0] and b"caf=C3=A9 cr=C3=A8me" in got[0], got[0]
    log = mta.maillog()
    assert "reject" not in log and "status=sent" in log, log
    relayed = wait_for(lambda: node.maildir_files("bob@example.test"), timeout=15, what="the relayed DSN to bob")
    text = relayed[0].read_bytes().decode("utf-8", "replace")
    assert re.search(r"^Action: relayed", text, re.MULTILINE) and "Original-Envelope-Id: E9" in text, text
    assert re.search(r"Final-Recipient: rfc822; ?carol@foreign.test", text), text


def test_starttls_with_postfix_on_both_sides(make_node, sink, postfix):
    """TLS with OpenSSL's side as Postfix uses it: Postfix's smtp client must encrypt to the node
    (``smtp_tls_security_level = encrypt``; the node's frontend requires STARTTLS), and the node's
    delivery takes the STARTTLS a Postfix smtpd offers (``smtpd_tls_security_level = encrypt``
    there: a MAIL before STARTTLS would be refused)."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    certs = Path(tempfile.mkdtemp(prefix="transportd-tls-"))
    certs.chmod(0o755)
    try:
        for name, host in (("node", "node1.transportd.test"), ("out", "relay-out.test")):
            cert = ca.issue_cert(host, "127.0.0.1")
            cert.private_key_pem.write_to_path(str(certs / f"{name}.key"))
            cert.cert_chain_pems[0].write_to_path(str(certs / f"{name}.pem"))
        sink.start()
        out = postfix(sink.address, name="relay-out.test", smtpd_tls_security_level="encrypt", smtpd_tls_loglevel="1",
                      smtpd_tls_cert_file=str(certs / "out.pem"), smtpd_tls_key_file=str(certs / "out.key"))
        node = make_node(smart_host=out.address, overrides={"frontend": {
            "tls_certificate": str(certs / "node.pem"), "tls_key": str(certs / "node.key"),
            "require_tls": True}}).start()
        into = postfix(f"127.0.0.1:{node.port}", name="relay-in.test", smtp_tls_security_level="encrypt",
                       smtp_tls_loglevel="1")
        assert send(into.host, into.port, "bob@remote.test", ["carol@foreign.test"], "tls chain") == {}
        wait_for(lambda: by_subject(sink, "tls chain"), timeout=30, what="the message at the sink")
        assert re.search(r"TLS connection established to 127\.0\.0\.1\[127\.0\.0\.1\]:\d+: TLSv1\.[23]",
                         into.maillog()), into.maillog()
        assert re.search(r"TLS connection established from localhost\[127\.0\.0\.1\]: TLSv1\.[23]",
                         out.maillog()), out.maillog()
        assert "status=sent" in into.maillog()
        # the node's session to the second Postfix (logged when it ends: the node keeps it a while)
        wait_for(lambda: re.search(r"disconnect from .* ehlo=2 starttls=1 mail=1 ", out.maillog()), timeout=15,
                 what="the node's STARTTLS session in the second Postfix's log")
    finally:
        shutil.rmtree(certs, ignore_errors=True)


@pytest.mark.parametrize("broken", ["no certificate", "TLSv1 only"])
def test_a_next_hop_whose_starttls_fails_gets_the_message_in_plaintext(make_node, sink, postfix, broken):
    """Opportunistic TLS (RFC 3207; Postfix's ``may``, Exchange's default): a next hop that offers
    STARTTLS and then cannot do it is still a next hop. A Postfix whose certificate is missing
    answers STARTTLS ``454 4.7.0 TLS not available``: the node goes on in plaintext on the same
    session. A Postfix that speaks only TLS 1.0 fails the handshake (OpenSSL's defaults here refuse
    it): the node sends the message at once on a new session without STARTTLS. Either way it
    arrives once, without a deferral."""
    sink.start()
    if broken == "no certificate":
        tls = {"smtpd_tls_security_level": "may", "smtpd_tls_cert_file": "/nonexistent/cert.pem",
               "smtpd_tls_key_file": "/nonexistent/key.pem"}
    else:
        trustme = pytest.importorskip("trustme")
        certs = Path(tempfile.mkdtemp(prefix="transportd-tls-"))
        certs.chmod(0o755)
        cert = trustme.CA().issue_cert("relay-out.test")
        cert.private_key_pem.write_to_path(str(certs / "out.key"))
        cert.cert_chain_pems[0].write_to_path(str(certs / "out.pem"))
        tls = {"smtpd_tls_security_level": "may", "smtpd_tls_cert_file": str(certs / "out.pem"),
               "smtpd_tls_key_file": str(certs / "out.key"), "smtpd_tls_protocols": ">=TLSv1, <=TLSv1",
               "smtpd_tls_mandatory_protocols": ">=TLSv1, <=TLSv1", "tls_preempt_cipherlist": "no",
               "smtpd_tls_loglevel": "1"}
    out = postfix(sink.address, name="relay-out.test", **tls)
    node = make_node(smart_host=out.address).start()
    assert send("127.0.0.1", node.port, "bob@remote.test", ["carol@foreign.test"], f"tls {broken}") == {}
    got = wait_for(lambda: by_subject(sink, f"tls {broken}"), timeout=30, what="the message at the sink")
    assert len(got) == 1
    assert not node.tracking(event_id="DEFER"), node.tracking(event_id="DEFER")
    said = ("answered STARTTLS 454 4.7.0 TLS not available due to local problem: going on without TLS"
            if broken == "no certificate" else "failed: SSLError: ")
    assert said in node.log(), node.log()[-3000:]
    if broken != "no certificate":
        assert "sending on a new session without TLS" in node.log()
        shutil.rmtree(certs, ignore_errors=True)
