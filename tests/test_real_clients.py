"""Clients people script mail with, other than swaks, against a real node: curl's SMTP client
(monitoring and CI scripts: no PIPELINING, its own dot-stuffing, STARTTLS with --ssl-reqd,
AUTH and the AUTH= parameter, SMTPUTF8 where the addresses need it) and msmtp (laptops and cron
jobs: GnuTLS, AUTH, pipelining, DSN options)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import wait_for
from test_receive import messages, stored_bodies, tls_files, tls_node  # noqa: F401 - fixtures

CURL = shutil.which("curl")
pytestmark = pytest.mark.skipif(CURL is None, reason="no curl")


def curl(port: int, *args: str, message: bytes) -> subprocess.CompletedProcess:
    """curl sending ``message`` to the node at ``port`` (``-v``: the dialogue on stderr)."""
    cmd = [CURL, "-sS", "-v", "--max-time", "30", f"smtp://127.0.0.1:{port}/client.test", *args, "-T", "-"]
    return subprocess.run(cmd, input=message, capture_output=True, timeout=60, check=False)


def dialogue(res: subprocess.CompletedProcess) -> list[str]:
    """What curl sent (``> ``) and got (``< ``), in order."""
    return [ln[2:] for ln in res.stderr.decode("utf-8", "replace").splitlines() if ln[:2] in ("> ", "< ")]


def queued(res: subprocess.CompletedProcess) -> int:
    ok = [ln for ln in dialogue(res) if ln.startswith("250 2.0.0 Ok: queued as ")]
    assert res.returncode == 0 and len(ok) == 1, res.stderr.decode("utf-8", "replace")[-3000:]
    return int(ok[0].rsplit(" ", 1)[1])


def test_curl_sends_to_the_node_and_its_dot_stuffing_is_undone(make_node):
    """curl's plain session: EHLO, MAIL (no SIZE: the message comes from stdin), two RCPTs, DATA;
    lines that begin with a dot (curl stuffs them) and a last line without CRLF (curl ends it)
    arrive as written, for both recipients."""
    node = make_node().start()
    body = b"Subject: curl plain\r\n\r\n.a line with a dot\r\n..two dots\r\n.\r\nno newline at the end"
    res = curl(node.port, "--mail-from", "bob@remote.test", "--mail-rcpt", "alice@example.test",
               "--mail-rcpt", "carol@example.test", message=body)
    qid = queued(res)
    sent = dialogue(res)
    assert [ln for ln in sent if ln.startswith("MAIL ")] == ["MAIL FROM:<bob@remote.test>"], sent  # stdin: no SIZE
    (m,) = [m for m in messages(node) if m["id"] == qid]
    assert m["subject"] == "curl plain" and m["recipient_count"] == 2, m
    (row,) = node.tracking(event_id="RECEIVE", internal_message_id=str(qid))
    assert row["recipient-address"] == "alice@example.test;carol@example.test", row
    assert stored_bodies(node)[qid].endswith(b"\r\n\r\n.a line with a dot\r\n..two dots\r\n.\r\nno newline at the end\r\n")


def test_curl_relays_with_starttls_auth_and_the_auth_parameter(make_node, sink, tls_files):  # noqa: F811
    """curl as a smart-host client: ``--ssl-reqd`` (STARTTLS, the node's certificate checked
    against the CA), ``--user`` (AUTH PLAIN) and ``--mail-auth`` (MAIL's AUTH= parameter, RFC
    4954); relayed to the sink. A wrong password gets 535 and nothing is queued."""
    sink.start()
    node = tls_node(make_node, tls_files, sink)
    ca = tls_files["ca"]
    good = curl(node.port, "--ssl-reqd", "--cacert", ca, "--user", "alice:s3cret", "--mail-auth", "alice@remote.test",
                "--mail-from", "alice@remote.test", "--mail-rcpt", "carol@foreign.test",
                message=b"Subject: curl relayed\r\n\r\nhi\r\n")
    queued(good)
    said = dialogue(good)
    assert "STARTTLS" in said and any(ln.startswith("AUTH PLAIN") for ln in said), said
    assert any(ln.startswith("MAIL FROM:<alice@remote.test> AUTH=<alice@remote.test>") for ln in said), said
    wait_for(lambda: any(b"Subject: curl relayed" in m for m in sink.messages()), timeout=15, what="the relayed message")
    bad = curl(node.port, "--ssl-reqd", "--cacert", ca, "--user", "alice:wrong", "--mail-from", "alice@remote.test",
               "--mail-rcpt", "carol@foreign.test", message=b"Subject: curl refused\r\n\r\nhi\r\n")
    assert bad.returncode != 0 and any(ln.startswith("535 5.7.8 ") for ln in dialogue(bad)), dialogue(bad)
    assert [m["subject"] for m in messages(node)] == ["curl relayed"]


def test_curl_sends_smtputf8_when_the_addresses_need_it(make_node):
    """curl asks for SMTPUTF8 in MAIL when an address is not ASCII and the node offers it; the
    envelope is stored as sent."""
    node = make_node().start()
    res = curl(node.port, "--mail-from", "jos\u00e9@remote.test", "--mail-rcpt", "\u00f1and\u00fa@example.test",
               message="Subject: curl utf8\r\n\r\ngr\u00fc\u00df\r\n".encode())
    qid = queued(res)
    assert [ln for ln in dialogue(res) if ln.startswith("MAIL ")] == ["MAIL FROM:<jos\u00e9@remote.test> SMTPUTF8"]
    (m,) = [m for m in messages(node) if m["id"] == qid]
    assert m["from"] == "jos\u00e9@remote.test", m
    (row,) = node.tracking(event_id="RECEIVE", internal_message_id=str(qid))
    assert row["recipient-address"] == "\u00f1and\u00fa@example.test", row


MSMTP = shutil.which("msmtp")


@pytest.mark.skipif(MSMTP is None, reason="no msmtp (apt-get install msmtp)")
def test_msmtp_submits_with_starttls_auth_pipelining_and_dsn(make_node, sink, tls_files, tmp_path):  # noqa: F811
    """msmtp (GnuTLS, libgsasl), as a laptop or a cron job submits: STARTTLS with the node's
    certificate checked, AUTH, MAIL and the RCPTs pipelined, the recipients read from the
    headers (``-t``, Bcc removed), DSN options; relayed to the sink with them."""
    sink.start()
    node = tls_node(make_node, tls_files, sink)
    log = tmp_path / "msmtp.log"
    msg = (b"From: alice@remote.test\r\nTo: carol@foreign.test\r\nBcc: dave@foreign.test\r\n"
           b"Subject: msmtp submitted\r\n\r\nhi\r\n")
    res = subprocess.run(
        [MSMTP, "--debug", "--host=127.0.0.1", f"--port={node.port}", "--tls=on", "--tls-starttls=on",
         f"--tls-trust-file={tls_files['ca']}", "--auth=on", "--user=alice", "--passwordeval=echo s3cret",
         "--from=alice@remote.test", "--dsn-notify=failure,delay", "--dsn-return=headers", f"--logfile={log}",
         "--domain=laptop.test", "-t"],
        input=msg, capture_output=True, timeout=60, check=False)
    out = res.stdout.decode("utf-8", "replace") + res.stderr.decode("utf-8", "replace")
    assert res.returncode == 0, out[-3000:]
    assert "smtpstatus=250" in log.read_text() and "tls=on auth=on" in log.read_text(), log.read_text()
    sent = [ln[4:] for ln in out.splitlines() if ln.startswith("--> ")]
    assert any(ln.startswith("AUTH ") for ln in sent) and "STARTTLS" in sent, sent
    got = wait_for(lambda: [m for m in sink.messages() if b"Subject: msmtp submitted" in m], timeout=15,
                   what="the relayed message")
    assert len(got) == 1 and b"Bcc:" not in got[0], got
    head = got[0].split(b"\n\n", 1)[0].decode()
    assert "X-Mail-Args: <alice@remote.test> RET=HDRS" in head, head
    rcpts = sorted(ln.split(": ", 1)[1] for ln in head.splitlines() if ln.startswith("X-Rcpt-Args: "))
    assert rcpts == ["<carol@foreign.test> NOTIFY=FAILURE,DELAY", "<dave@foreign.test> NOTIFY=FAILURE,DELAY"], head
    # pipelined (RFC 2920): MAIL, both RCPTs and DATA written before their replies were read
    lines = [ln for ln in out.splitlines() if ln.startswith(("--> ", "<-- "))]
    mail = next(i for i, ln in enumerate(lines) if ln.startswith("--> MAIL FROM:"))
    assert [ln[:9] for ln in lines[mail:mail + 5]] == ["--> MAIL ", "--> RCPT ", "--> RCPT ", "--> DATA", "<-- 250 2"], \
        lines
