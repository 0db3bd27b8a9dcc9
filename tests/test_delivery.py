"""Delivery end to end: real transportd processes, swaks/smtplib clients, smtp-sink smart host.

Covers local mailbox delivery, smart-host delivery, crash recovery (kill -9) on both
paths, 5xx -> DSN (and never a DSN to <>), expiry, duplicate detection and its
window, 4xx -> Retry + `queue retry`, and bifurcation.
"""

from __future__ import annotations

import asyncio
import email
import email.policy
import json
import re
import smtplib
import threading
import time
import uuid
from pathlib import Path

import pytest
from clusters import one
from conftest import Sink, free_port, queued_id, read_db, swaks, wait_for, write_toml
from helpers import PerRecipientNextHop
from test_receive import tls_files  # noqa: F401 - fixture

GUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.IGNORECASE)
FIXED_DATE = "Sat, 21 Nov 2026 10:00:00 +0000"


# --------------------------------------------------------------------------- local helpers

def events(node, event_id: str, **filters: str) -> list[dict]:
    """Tracking rows of one event type, read in-process (polling through the CLI is slow).

    An empty list while no log file exists yet. Tests that check the CLI's own output use
    node.tracking() (``transportd tracking search --json``) instead.
    """
    from transportd.tracking import search
    directory = node.data_dir / "msgtrk"
    if not directory.is_dir():
        return []
    return list(search(directory, event_id=event_id, **filters))


def wait_events(node, event_id: str, n: int = 1, timeout: float = 15.0,
                **filters: str) -> list[dict]:
    def enough():
        rows = events(node, event_id, **filters)
        return rows if len(rows) >= n else None
    return wait_for(enough, timeout=timeout, what=f"{n} {event_id} event(s) {filters or ''}")


def parse(path: Path) -> email.message.Message:
    return email.message_from_bytes(path.read_bytes(), policy=email.policy.compat32)


def header_of(raw: bytes, name: str) -> str | None:
    return email.message_from_bytes(raw, policy=email.policy.compat32).get(name)


def smtp_send(port: int, sender: str, rcpts: list[str], data: bytes | str,
              client: smtplib.SMTP | None = None) -> int:
    """One mail transaction; returns the queue id from the 250 reply (asserts on anything else)."""
    own = client is None
    s = client or smtplib.SMTP("127.0.0.1", port, timeout=20)
    try:
        if own:
            s.ehlo("client.test")
        code, resp = s.mail(sender)
        assert code == 250, (code, resp)
        for r in rcpts:
            code, resp = s.rcpt(r)
            assert code == 250, (code, resp)
        if isinstance(data, str):
            data = data.encode()
        code, resp = s.data(data)
        assert code == 250, (code, resp)
        m = re.search(rb"queued as (\d+)", resp)
        assert m, resp
        return int(m.group(1))
    finally:
        if own:
            try:
                s.quit()
            except smtplib.SMTPException:
                s.close()


def message(subject: str, msgid: str | None = None, date: str | None = None,
            frm: str = "bob@example.test", to: str = "alice@example.test") -> bytes:
    lines = [f"From: <{frm}>", f"To: <{to}>", f"Subject: {subject}"]
    if msgid:
        lines.append(f"Message-ID: {msgid}")
    if date:
        lines.append(f"Date: {date}")
    lines += ["", f"Body of {subject}.", ""]
    return "\r\n".join(lines).encode()


def dsn_parts(path: Path) -> tuple[email.message.Message, list[dict[str, str]]]:
    """The DSN message and its per-recipient delivery-status blocks (as dicts)."""
    msg = email.message_from_bytes(path.read_bytes(), policy=email.policy.default)
    assert msg.get_content_type() == "multipart/report", msg.get_content_type()
    assert msg.get_param("report-type") == "delivery-status"
    status_parts = [p for p in msg.walk() if p.get_content_type() == "message/delivery-status"]
    assert len(status_parts) == 1
    # message/delivery-status payload: a list of header blocks (per-message, then per-recipient).
    blocks = status_parts[0].get_payload()
    per_rcpt = [dict(b.items()) for b in blocks[1:]]
    assert per_rcpt, "no per-recipient block in the DSN"
    return msg, per_rcpt


def sink_envelope(raw: bytes) -> tuple[str, list[str]]:
    """(MAIL FROM argument, RCPT TO arguments) as smtp-sink's dump file recorded them."""
    head = raw.split(b"\n\n", 1)[0].decode("utf-8", "replace").splitlines()
    mail = [line.split(":", 1)[1].strip() for line in head if line.startswith("X-Mail-Args:")]
    rcpts = [line.split(":", 1)[1].strip() for line in head if line.startswith("X-Rcpt-Args:")]
    assert len(mail) == 1, head
    return _path(mail[0]), [_path(r) for r in rcpts]


def _path(args: str) -> str:
    """The path of a MAIL/RCPT argument, before its parameters; a quoted local part may hold blanks."""
    return args[:args.rindex(">") + 1] if args.startswith("<") else args.split()[0]


def mailbox_root(node) -> Path:
    return node.data_dir / "mailboxes"


def all_mailbox_files(node) -> list[Path]:
    root = mailbox_root(node)
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def node_for_stopped_sink(make_node, sink, **kw):
    """A node whose smart host is a sink that is not listening yet.

    conftest's free_port() only probes a port: with the sink not bound, the node may be
    handed the very same port, and would then relay to itself in a loop. Pick again then.
    """
    for i in range(10):
        node = make_node(f"node{i + 1}", smart_host=sink.address, **kw)
        if node.port != sink.port:
            return node
    raise AssertionError("could not find a node port distinct from the sink's")


def smarthost_queue(node, sink) -> str:
    return f"smarthost:{sink.address}"


# --------------------------------------------------------------------------- 1. basic delivery

def test_local_mailbox_delivery_is_stored_and_tracked(make_node, sink):
    sink.start()
    node = make_node(smart_host=sink.address).start()
    tag = uuid.uuid4().hex[:12]
    msgid = f"<local-{tag}@client.test>"
    r = swaks(node.port, "--to", "alice@example.test", "--from", "bob@remote.test",
              "--header", f"Subject: local {tag}", "--header", f"Message-Id: {msgid}")
    qid = queued_id(r)

    wait_for(lambda: node.maildir_files("alice@example.test"), what="maildir file")
    wait_events(node, "DELIVER")
    time.sleep(0.5)  # waiting for absence: anything extra (a second copy) would show up by now
    files = node.maildir_files("alice@example.test")
    assert len(files) == 1, files
    stored = parse(files[0])
    assert stored["Subject"] == f"local {tag}"
    assert stored["Message-Id"] == msgid
    assert files[0].parent.name == "new"

    deliver = node.tracking(event_id="DELIVER")  # transportd tracking search --json
    assert len(deliver) == 1, deliver
    d = deliver[0]
    assert d["internal-message-id"] == str(qid)
    assert GUID.match(d["network-message-id"]), d["network-message-id"]
    assert d["recipient-address"].lower() == "alice@example.test"
    assert d["message-id"] == msgid
    # The same GUID identifies the message at receive time and names the Maildir file.
    receive = [e for e in events(node, "RECEIVE") if e["internal-message-id"] == str(qid)]
    assert len(receive) == 1 and receive[0]["network-message-id"] == d["network-message-id"]
    assert d["network-message-id"] in files[0].name
    # message-info of a DELIVER row: the message's origination date-time (UTC), here its receipt
    assert _origination_matches(d, receive[0])
    # Received header added by the node; Return-Path by the final delivery (RFC 5321 4.4), first.
    assert node.name in stored["Received"]
    assert files[0].read_bytes().startswith(b"Return-Path: <bob@remote.test>\r\nReceived: ")
    assert not sink.messages()


def _origination_matches(row: dict, receive: dict) -> bool:
    """The row's message-info is a UTC date-time within a second of the message's RECEIVE row
    (the node's clock read twice in the same accept)."""
    from transportd.tracking import parse_datetime
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", row["message-info"]), row
    return abs((parse_datetime(row["message-info"]) - parse_datetime(receive["date-time"])).total_seconds()) < 1


def test_sender_address_is_the_author_and_return_path_the_envelope(make_node, sink):
    """As Exchange writes them: sender-address is the Sender (else From) field's address,
    return-path the MAIL FROM (a list's bounce address here); `tracking search --sender` finds
    the rows by either."""
    sink.start()
    node = make_node(smart_host=sink.address).start()
    qid = str(queued_id(swaks(node.port, "--to", "carol@foreign.test", "--from", "bounces@lists.remote.test",
                              "--header", 'From: "Doe, \\"JJ\\" John" <John@Remote.test>')))
    wait_events(node, "SENDEXTERNAL", internal_message_id=qid)
    rows = [r for r in events(node, "RECEIVE") + events(node, "SENDEXTERNAL") if r["internal-message-id"] == qid]
    assert [(r["event-id"], r["sender-address"], r["return-path"]) for r in rows] == [
        ("RECEIVE", "John@Remote.test", "bounces@lists.remote.test"),
        ("SENDEXTERNAL", "John@Remote.test", "bounces@lists.remote.test")]
    for who in ("john@remote.test", "bounces@lists.remote.test"):
        assert {r["event-id"] for r in node.tracking(sender=who)} == {"RECEIVE", "SENDEXTERNAL"}, who


def test_foreign_domain_goes_to_smart_host(make_node, sink):
    sink.start()
    node = make_node(smart_host=sink.address).start()
    tag = uuid.uuid4().hex[:12]
    r = swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test",
              "--header", f"Subject: remote {tag}")
    qid = queued_id(r)

    wait_for(sink.messages, what="message at the sink")
    wait_events(node, "SENDEXTERNAL")
    time.sleep(0.5)  # waiting for absence: a second copy would show up by now
    msgs = sink.messages()
    assert len(msgs) == 1
    assert f"remote {tag}".encode() in msgs[0]
    assert sink_envelope(msgs[0]) == ("<bob@example.test>", ["<carol@foreign.test>"])
    sent = node.tracking(event_id="SENDEXTERNAL")  # transportd tracking search --json
    assert len(sent) == 1
    s = sent[0]
    assert s["internal-message-id"] == str(qid)
    assert s["recipient-address"].lower() == "carol@foreign.test"
    # The remote reply (smtp-sink's answer to the end of DATA) is what is logged.
    # smtp-sink answers "250 2.0.0 Ok" (its RCPT reply would be "250 2.1.5 Ok").
    assert s["recipient-status"] == "250 2.0.0 Ok", s["recipient-status"]
    assert s["source-context"] == s["recipient-status"]
    assert s["connector-id"] == smarthost_queue(node, sink)
    assert s["server-ip"] == "127.0.0.1"
    assert _origination_matches(s, events(node, "RECEIVE", internal_message_id=str(qid))[0])
    assert GUID.match(s["network-message-id"])
    assert not all_mailbox_files(node)
    assert not events(node, "DEFER")


def test_quoted_local_parts_and_address_literals_are_relayed_as_received(make_node, sink):
    """RFC 5321 4.1.2 and 4.1.3: a Quoted-string local part and an address literal are valid paths.
    Both were refused at RCPT (501 5.1.3), and with no smart host an address literal went to an MX
    lookup of "[127.0.0.1]"; now the envelope goes on byte for byte, and mail for an address
    literal goes to that address with no lookup (RFC 5321 5.1): here the sink, on mx_port."""
    sink.start()
    node = make_node(overrides={"delivery": {"mx_port": sink.port}}).start()  # no smart host: MX routing
    tag = uuid.uuid4().hex[:12]
    rcpts = ['"john q. public"@[127.0.0.1]', "carol@[127.0.0.1]", '"a;b"@[127.0.0.1]']
    r = swaks(node.port, "--to", ",".join(rcpts), "--from", '"bob smith"@example.test',
              "--header", f"Subject: literal {tag}")
    queued_id(r)
    wait_for(sink.messages, what="message at the sink")
    wait_events(node, "SENDEXTERNAL")
    msgs = sink.messages()
    assert len(msgs) == 1
    assert sink_envelope(msgs[0]) == ('<"bob smith"@example.test>', [f"<{a}>" for a in rcpts])
    sent = node.tracking(event_id="SENDEXTERNAL")
    assert sent and all(s["server-ip"] == "127.0.0.1" for s in sent)
    assert not events(node, "DEFER") and not events(node, "FAIL")


def test_several_smart_hosts_share_the_load_and_one_down_is_passed_over(make_node, sink, procs):
    """routing.smart_host as a list (Exchange's SmartHosts): each session starts at one of them at
    random and goes on to the next where one does not answer. One of three is down (nothing
    listens): every message arrives once, at one of the two others, both get some, and none is
    deferred. (One message per session and no kept sessions, so each message is a new choice.)"""
    other = Sink(procs).start()
    try:
        down = f"127.0.0.1:{free_port()}"
        sink.start()
        node = make_node(smart_host=[down, sink.address, other.address], overrides={"delivery": {
            "max_messages_per_connection": 1, "connection_cache_time": 0}}).start()
        assert node.cli("config", "show").stdout.count(f"{down},{sink.address},{other.address}") == 1
        for i in range(20):
            queued_id(swaks(node.port, "--to", f"rcpt{i}@foreign.test", "--from", "bob@example.test",
                            "--header", f"Subject: spread {i}"))
        wait_for(lambda: len(sink.messages()) + len(other.messages()) == 20, timeout=30, what="20 messages")
        got = [sink_envelope(m)[1][0] for m in sink.messages()], [sink_envelope(m)[1][0] for m in other.messages()]
        assert sorted(got[0] + got[1]) == sorted(f"<rcpt{i}@foreign.test>" for i in range(20))
        assert got[0] and got[1], got
        assert not events(node, "DEFER")
        assert {r["server-ip"] for r in wait_events(node, "SENDEXTERNAL", n=20)} == {"127.0.0.1"}
    finally:
        other.stop()
        other.cleanup()


def test_a_send_connector_takes_its_address_spaces_elsewhere(make_node, sink, procs):
    """[[send_connectors]] (Exchange's send connectors with address spaces): mail for partner.test
    and its subdomains goes to the partner's relay, the rest to routing.smart_host; the queue and
    the SENDEXTERNAL row name the relay each went to."""
    partner = Sink(procs).start()
    try:
        sink.start()
        node = make_node(smart_host=sink.address)
        node.sections["send_connectors"] = [{"name": "partner", "address_spaces": ["partner.test", "*.partner.test"],
                                             "smart_hosts": [partner.address]}]
        write_toml(node.config_path, node.sections)
        node.start()
        queued_id(swaks(node.port, "--to", "a@partner.test,b@eu.partner.test,c@foreign.test", "--from",
                        "bob@example.test"))
        wait_for(lambda: partner.messages() and sink.messages(), timeout=15, what="the message at both relays")
        assert sorted(sink_envelope(partner.messages()[0])[1]) == ["<a@partner.test>", "<b@eu.partner.test>"]
        assert sink_envelope(sink.messages()[0])[1] == ["<c@foreign.test>"]
        sent = {r["connector-id"] for r in wait_events(node, "SENDEXTERNAL", n=2)}
        assert sent == {f"smarthost:{partner.address}", f"smarthost:{sink.address}"}
    finally:
        partner.stop()
        partner.cleanup()


def test_queued_mail_follows_a_smart_host_changed_while_the_node_was_stopped(make_node, sink):
    """A routing change applies to the mail already queued (as Postfix resolves a deferred
    message's next hop again, and Exchange's Retry-Queue -Resubmit routes it again): messages
    deferred for a smart host that is gone go to the new one as soon as the node starts with it,
    not to the old one until they expire. The retry interval is long: only the move makes them due."""
    old = f"127.0.0.1:{free_port()}"  # nothing listens there
    sink.start()
    node = make_node(smart_host=old, overrides={"delivery": {
        "transient_failure_retry_interval": 600, "outbound_connection_failure_retry_interval": 600}}).start()
    for i in range(2):
        queued_id(swaks(node.port, "--to", f"carol{i}@foreign.test,dave{i}@example.test", "--from", "bob@example.test",
                        "--header", f"Subject: moved {i}"))
    wait_events(node, "DEFER")  # the first; the second waits for the queue's retry
    wait_events(node, "DELIVER", n=2)  # the local recipients are not the routing change's
    assert node.stop() == 0
    node.sections["routing"]["smart_host"] = sink.address
    write_toml(node.config_path, node.sections)
    node.start()
    wait_for(lambda: len(sink.messages()) == 2, timeout=20, what="both messages at the new smart host")
    assert sorted(sink_envelope(m)[1][0] for m in sink.messages()) == ["<carol0@foreign.test>", "<carol1@foreign.test>"]
    sent = wait_events(node, "SENDEXTERNAL", n=2)
    assert {r["connector-id"] for r in sent} == {f"smarthost:{sink.address}"}
    assert f"2 queued recipient(s) of queue smarthost:{old} now go to queue smarthost:{sink.address}" in node.log()
    counts = {q["identity"]: q["message_count"] for q in node.cli_json("queue", "list")}
    assert counts[f"smarthost:{old}"] == 0 and counts[f"smarthost:{sink.address}"] == 0
    assert len(events(node, "DELIVER")) == 2  # nothing delivered twice


def test_a_send_connector_that_requires_tls_validates_its_next_hop_or_defers(make_node, sink, tls_files):  # noqa: F811
    """A send connector's TLS policy (Exchange's RequireTLS and TlsAuthLevel): STARTTLS required of
    its next hops; DomainValidation checks the certificate against tls_ca and the host name the
    connector names, CertificateValidation the chain only. A next hop that offers no STARTTLS (smtp-sink),
    or whose certificate does not name the host, gets nothing: the message is deferred (DEFER,
    the queue in Retry), never sent in plaintext. The next hop here is another node with a
    certificate for node1.transportd.test and 127.0.0.1, listening on 127.0.0.1 and 127.0.0.3."""
    sink.start()
    receiver = make_node("node1", overrides={
        "frontend": {"tls_certificate": tls_files["cert"], "tls_key": tls_files["key"]},
        "routing": {"accepted_domains": ["named.test", "chain.test", "mismatch.test"]}})
    port = receiver.port
    receiver.sections["frontend"]["listen"] = [f"127.0.0.1:{port}", f"127.0.0.3:{port}"]
    write_toml(receiver.config_path, receiver.sections)
    receiver.start()
    required = {"require_tls": True, "tls_ca": tls_files["ca"]}
    sender = make_node("node2", smart_host=sink.address, overrides={"delivery": {"transient_failure_retry_interval": 600}})
    sender.sections["send_connectors"] = [
        {"name": "named", "address_spaces": ["named.test"], "smart_hosts": f"127.0.0.1:{port}",
         "tls_auth_level": "DomainValidation", **required},
        {"name": "mismatch", "address_spaces": ["mismatch.test"], "smart_hosts": f"127.0.0.3:{port}",
         "tls_auth_level": "DomainValidation", **required},
        {"name": "chain", "address_spaces": ["chain.test"], "smart_hosts": f"localhost:{port}",
         "tls_auth_level": "CertificateValidation", **required},
        {"name": "plain", "address_spaces": ["plain.test"], "smart_hosts": sink.address, "require_tls": True},
    ]
    write_toml(sender.config_path, sender.sections)
    sender.start()
    ids = {rcpt: queued_id(swaks(sender.port, "--to", rcpt, "--from", "bob@example.test"))
           for rcpt in ("a@named.test", "b@chain.test", "c@mismatch.test", "d@plain.test")}
    for rcpt in ("a@named.test", "b@chain.test"):
        [stored] = wait_for(lambda r=rcpt: receiver.maildir_files(r), timeout=20, what=f"{rcpt} delivered over TLS")
        assert re.search(rb"from node2\.transportd\.test \(\[127\.0\.0\.1\]\)\s+by node1\.transportd\.test "
                         rb"\(frontend\) with ESMTPS", stored.read_bytes()), stored.read_bytes()[:500]
    [mismatch] = wait_events(sender, "DEFER", internal_message_id=str(ids["c@mismatch.test"]))
    assert "certificate verify failed" in mismatch["recipient-status"], mismatch
    [plain] = wait_events(sender, "DEFER", internal_message_id=str(ids["d@plain.test"]))
    assert "does not offer STARTTLS" in plain["recipient-status"], plain
    time.sleep(1)
    assert not receiver.maildir_files("c@mismatch.test") and not sink.messages()


class StartTlsNextHop:
    """A next hop (aiosmtpd in a thread of this process) that offers STARTTLS with ``cert`` (a
    trustme LeafCert): one that has expired, or names another host."""

    def __init__(self, cert) -> None:
        import ssl

        from aiosmtpd.controller import Controller

        class Handler:
            async def handle_DATA(self, server, session, envelope):
                return "250 2.0.0 queued"

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert.configure_cert(ctx)
        self.port = free_port()
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port, tls_context=ctx)
        self.controller.start()


def column_text(output: str, header: str, column: str, *needles: str) -> str:
    """The whole value of ``column`` in the row holding every needle of the text table under the
    ``header`` line (or the first table): its first line and the lines it was wrapped onto."""
    lines = output.splitlines()
    start = lines.index(header) + 1 if header else 0
    heads = next(i for i in range(start, len(lines)) if column in lines[i])
    at = lines[heads].index(column)
    end = at + len(lines[heads + 1][at:].split(" ")[0])  # its dashes
    row = next(i for i in range(heads + 2, len(lines)) if all(n in lines[i] for n in needles))
    parts = [lines[row][at:end].rstrip()]
    for line in lines[row + 1:]:
        if not line.strip() or line[:at].strip():
            break
        parts.append(line[at:end].rstrip())
    return " ".join(p for p in parts if p)


def test_a_required_tls_that_fails_is_a_tls_deferral_named_once_and_shown_whole(make_node, sink, tmp_path):
    """A send connector that requires TLS (RequireTLS) and cannot have it: the recipient's last
    error, the DEFER row, the queue's last error and the delay DSN's Diagnostic-Code say TLS
    failed and why, naming the next hop once: ``451 4.7.10`` where it offers no STARTTLS
    (smtp-sink), ``451 4.7.5`` where the handshake fails (a certificate that has expired,
    CertificateValidation; one for another name, DomainValidation). Still a 451: the message waits
    and is never sent in plaintext. A next hop that refuses the connection stays "Unable to
    connect", named once. ``message show``, ``queue list`` and ``tracking search`` show each whole
    (the cause is at the end, once cut at 70 characters), wrapped under its column."""
    import datetime

    import trustme
    sink.start()  # smtp-sink: no STARTTLS
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
    expired = StartTlsNextHop(ca.issue_cert("127.0.0.1", not_before=long_ago - datetime.timedelta(days=1),
                                            not_after=long_ago))
    elsewhere = StartTlsNextHop(ca.issue_cert("other.transportd.test"))
    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    sender = make_node("node2", overrides={"delivery": {"transient_failure_retry_interval": 600,
                                                        "outbound_connection_failure_retry_interval": 600,
                                                        "delay_notification_timeout": 2}})
    required = {"require_tls": True, "tls_ca": str(tmp_path / "ca.pem")}
    sender.sections["send_connectors"] = [
        {"name": "plain", "address_spaces": ["plain.test"], "smart_hosts": sink.address, "require_tls": True},
        {"name": "expired", "address_spaces": ["expired.test"], "smart_hosts": f"127.0.0.1:{expired.port}",
         "tls_auth_level": "CertificateValidation", **required},
        {"name": "mismatch", "address_spaces": ["mismatch.test"], "smart_hosts": f"127.0.0.1:{elsewhere.port}",
         "tls_auth_level": "DomainValidation", **required},
        {"name": "down", "address_spaces": ["down.test"], "smart_hosts": down},
    ]
    write_toml(sender.config_path, sender.sections)
    sender.start()
    ids = {}
    for rcpt in ("a@plain.test", "b@expired.test", "c@mismatch.test", "d@down.test"):
        with smtplib.SMTP("127.0.0.1", sender.port, timeout=20) as s:
            s.ehlo("client.test")
            s.mail("bob@example.test")
            assert s.rcpt(rcpt, ["NOTIFY=DELAY,FAILURE"])[0] == 250
            ids[rcpt] = int(s.data(b"Subject: tls\r\n\r\nbody\r\n")[1].decode().rsplit(" ", 1)[1])
    expected = {
        "a@plain.test": f"451 4.7.10 TLS required but not available: {sink.address} does not offer STARTTLS",
        "b@expired.test": f"451 4.7.5 TLS required but not available: TLS with 127.0.0.1:{expired.port} failed: "
                          "certificate verify failed: certificate has expired",
        "c@mismatch.test": f"451 4.7.5 TLS required but not available: TLS with 127.0.0.1:{elsewhere.port} failed: "
                           "certificate verify failed: IP address mismatch, certificate is not valid for '127.0.0.1'.",
        "d@down.test": f"451 4.4.0 Unable to connect to {down}: Connection refused",
    }
    for rcpt, reply in expected.items():
        [row] = wait_events(sender, "DEFER", internal_message_id=str(ids[rcpt]))
        assert row["recipient-status"] == reply, row
        [r] = sender.cli_json("message", "show", str(ids[rcpt]))[0]["recipients"]
        assert r["last_error"] == reply, r
        shown = sender.cli("message", "show", str(ids[rcpt])).stdout
        assert column_text(shown, "Recipients:", "last error", rcpt) == reply, shown
        assert column_text(shown, "Tracking events:", "status / context", "DEFER") == reply, shown
        identity = f"smarthost:{row['connector-id'].removeprefix('smarthost:')}"
        assert column_text(sender.cli("queue", "list").stdout, "", "last error", identity) == reply
        listed = sender.cli("tracking", "search", "--event-id", "DEFER", "--internal-message-id",
                            str(ids[rcpt])).stdout
        assert column_text(listed, "", "status / context", "DEFER") == reply, listed
    notices = wait_for(lambda: len(sender.maildir_files("bob@example.test")) >= 4 and
                       sender.maildir_files("bob@example.test"), timeout=20, what="the four delay notices")
    diagnostics = {}
    for path in notices:
        text = path.read_bytes().decode()
        rcpt = re.search(r"Final-Recipient: rfc822; *(\S+)", text).group(1)
        folded = re.search(r"Diagnostic-Code: smtp; ([^\r\n]*(?:\r\n[ \t][^\r\n]*)*)", text).group(1)
        diagnostics[rcpt] = folded.replace("\r\n", "")  # unfolded (RFC 5322 2.2.3)
        assert f"Status: {expected[rcpt][4:].split(' ')[0]}\r\n" in text, text
    assert diagnostics == expected
    time.sleep(0.5)
    assert not sink.messages()  # never in plaintext


@pytest.fixture
def dns_server():
    from dnsserver import TestDnsServer
    with TestDnsServer() as server:
        yield server


def test_mail_goes_to_the_mx_hosts_the_node_looks_up_and_a_backup_mx_never_to_itself(make_node, sink, dns_server):
    """No smart host: MX records and host addresses come from the servers of
    delivery.external_dns_servers (here a DNS server on loopback). The best MX that refuses the
    connection is passed over for the next; the tracking row names the host and the address that
    took the message. A node listed as a backup MX (RFC 5321 5.1) holds mail for the better hosts
    and never tries itself or the worse ones; one listed as the best MX bounces the message (a
    loop, 5.4.6) instead of sending it to itself."""
    sink.start()
    node = make_node(overrides={"delivery": {"mx_port": sink.port, "external_dns_servers": [dns_server.address],
                                             "transient_failure_retry_interval": 600}})
    dns_server.records = {
        "far.test": {"MX": ["10 down.far.test.", "20 up.far.test."]},
        "down.far.test": {"A": ["127.0.0.9"]},  # nothing listens there: connection refused
        "up.far.test": {"A": ["127.0.0.1"]},
        "backup.test": {"MX": ["10 down.far.test.", f"20 {node.name}.", "30 up.far.test."]},
        "loop.test": {"MX": [f"10 {node.name}.", "20 up.far.test."]},
        node.name: {"A": ["127.0.0.1"]},
    }
    node.start()
    tag = uuid.uuid4().hex[:12]
    queued_id(swaks(node.port, "--to", "carol@far.test", "--from", "bob@example.test", "--header", f"Subject: mx {tag}"))
    wait_for(sink.messages, what="message at the sink")
    [sent] = wait_events(node, "SENDEXTERNAL")
    assert (sent["server-hostname"], sent["server-ip"]) == ("up.far.test", "127.0.0.1")
    assert sink_envelope(sink.messages()[0])[1] == ["<carol@far.test>"]

    held = queued_id(swaks(node.port, "--to", "dave@backup.test", "--from", "bob@example.test"))
    [defer] = wait_events(node, "DEFER", internal_message_id=str(held))
    assert "down.far.test[127.0.0.9]" in defer["recipient-status"], defer
    looped = queued_id(swaks(node.port, "--to", "erin@loop.test", "--from", "bob@example.test"))
    [fail] = wait_events(node, "FAIL", internal_message_id=str(looped))
    assert fail["recipient-status"].startswith("554 5.4.6"), fail
    files = wait_for(lambda: node.maildir_files("bob@example.test"), what="DSN in bob's Maildir")
    _, [block] = dsn_parts(files[0])
    assert (block["Final-Recipient"].lower(), block["Status"]) == ("rfc822; erin@loop.test", "5.4.6")
    assert len(sink.messages()) == 1  # neither went to a worse MX host (up.far.test) or to the node
    assert [q for q in node.cli_json("queue", "list") if q["state"] == "Retry"], "backup.test's queue in Retry"


@pytest.mark.parametrize("pipelining", [True, False], ids=["pipelining", "one-command-at-a-time"])
def test_a_batch_goes_out_on_one_session_with_or_without_pipelining(make_node, sink, pipelining):
    """Several messages, two recipients each, held while the smart host is down, then sent together
    (one batch, one session) after ``queue retry``: as one pipelined group each where smtp-sink offers PIPELINING,
    one command at a time where it does not (-p). Each arrives once with both recipients."""
    slow = {"transient_failure_retry_interval": 600, "outbound_connection_failure_retry_interval": 600}
    node = make_node(smart_host=sink.address, overrides={"delivery": slow}).start()
    tag = uuid.uuid4().hex[:12]
    qids = [queued_id(swaks(node.port, "--to", "carol@foreign.test,dave@foreign.test", "--from", "bob@example.test",
                            "--header", f"Subject: batch {tag} {i}")) for i in range(6)]
    identity = smarthost_queue(node, sink)
    wait_for(lambda: [q for q in node.cli_json("queue", "list") if q["identity"] == identity
                      and q["state"] == "Retry" and q["message_count"] == 6],
             timeout=15, what=f"queue {identity} in Retry with 6 messages")
    sink.start(extra_args=() if pipelining else ("-p",))
    node.cli("queue", "retry", identity)
    sent = wait_events(node, "SENDEXTERNAL", n=6)
    time.sleep(0.5)  # waiting for absence: a second copy would show up by now
    assert sorted(int(e["internal-message-id"]) for e in sent) == sorted(qids)
    assert all(e["recipient-address"].lower() == "carol@foreign.test;dave@foreign.test" for e in sent)
    assert all(e["recipient-status"] == "250 2.0.0 Ok;250 2.0.0 Ok" for e in sent)
    msgs = sink.messages()
    assert len(msgs) == 6
    assert sorted(int(m.split(f"batch {tag} ".encode())[1][:1]) for m in msgs) == list(range(6))
    assert all(sink_envelope(m) == ("<bob@example.test>", ["<carol@foreign.test>", "<dave@foreign.test>"])
               for m in msgs)
    assert len(events(node, "SENDEXTERNAL")) == 6 and not events(node, "FAIL")


# ------------------------------------------------------------------ 2. crash, smart host down

def test_kill9_after_ack_with_smart_host_down_delivers_exactly_once(make_node, sink):
    # The sink is not started: nothing listens on sink.address yet.
    node = node_for_stopped_sink(make_node, sink).start()
    tag = uuid.uuid4().hex[:12]
    r = swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test",
              "--header", f"Subject: crash {tag}")
    qid = queued_id(r)
    node.kill9()

    node.start()
    defer = wait_events(node, "DEFER", internal_message_id=str(qid))
    assert defer[0]["recipient-address"].lower() == "carol@foreign.test"
    assert defer[0]["recipient-status"].startswith("451 4.4.0"), defer[0]["recipient-status"]
    assert not sink.messages()

    sink.start()
    wait_for(sink.messages, timeout=20, what="message at the sink after restart")
    wait_events(node, "SENDEXTERNAL", internal_message_id=str(qid))
    # Waiting for absence: a second copy (a retry after the restart) would show up by now.
    time.sleep(2.5)
    msgs = sink.messages()
    assert len(msgs) == 1, f"{len(msgs)} copies at the sink"
    assert f"crash {tag}".encode() in msgs[0]
    assert len(events(node, "SENDEXTERNAL", internal_message_id=str(qid))) == 1
    assert len(events(node, "RECEIVE", internal_message_id=str(qid))) == 1


@pytest.mark.parametrize("where", ["external", "mailbox"])
def test_kill9_right_after_the_delivery_commit_keeps_the_delivery_tracked(make_node, sink, where):
    """A delivery is a fact once the next hop answered 250 (or the mailbox holds the message).
    Its SENDEXTERNAL or DELIVER row (and its log line) was written only after the queue commit
    that records it, so a kill -9 between the two left a message at the sink and in the Safety
    Net with a RECEIVE row only: tracking showed it never delivered. The test-only fault hook
    blocks the node right after that commit; kill -9 there, start again: the row and the line
    are there, once, and the message went out once."""
    sink.start()
    node = make_node(smart_host=sink.address)
    node.env["TRANSPORTD_TEST_FAULTS"] = json.dumps({"match": "KILLED", "steps": ["recorded"], "action": "spin"})
    node.start()
    rcpt, event = ("carol@foreign.test", "SENDEXTERNAL") if where == "external" else ("alice@example.test", "DELIVER")
    qid = queued_id(swaks(node.port, "--to", rcpt, "--from", "bob@example.test",
                          "--header", f"Subject: KILLED {uuid.uuid4().hex[:12]}"))

    def recorded() -> bool:
        return read_db(node.data_dir / "queue.db", "SELECT state FROM messages WHERE id = ?", (qid,)) == [("SafetyNet",)]
    wait_for(recorded, timeout=20, what="the delivery committed (the message in the Safety Net)")
    node.kill9()  # the node spins right after that commit: nothing after it ran
    del node.env["TRANSPORTD_TEST_FAULTS"]
    node.start()

    delivered = sink.messages() if where == "external" else node.maildir_files(rcpt)
    assert len(delivered) == 1
    rows = wait_events(node, event, internal_message_id=str(qid), timeout=5)
    assert [r["recipient-address"].lower() for r in rows] == [rcpt]
    assert f"{event} message {qid} " in node.log()
    time.sleep(1)  # waiting for absence: a second delivery after the restart would show up by now
    assert len(sink.messages() if where == "external" else node.maildir_files(rcpt)) == 1
    assert len(events(node, event, internal_message_id=str(qid))) == 1


# --------------------------------------------------------------------------- 3. 5xx -> DSN

@pytest.mark.parametrize("stage", ["RCPT", "."])
def test_permanent_failure_sends_dsn_to_local_sender(make_node, sink, stage):
    sink.start(extra_args=("-f", stage))
    node = make_node(smart_host=sink.address).start()
    tag = uuid.uuid4().hex[:12]
    r = swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test",
              "--header", f"Subject: bounce {tag}")
    qid = queued_id(r)

    fail = wait_events(node, "FAIL", internal_message_id=str(qid))
    assert fail[0]["recipient-address"].lower() == "carol@foreign.test"
    assert fail[0]["recipient-status"].startswith("5"), fail[0]["recipient-status"]
    dsn_ev = wait_events(node, "DSN")
    assert dsn_ev[0]["recipient-address"].lower() == "bob@example.test"
    # Exchange fills related-recipient-address on EXPAND, REDIRECT and RESOLVE only; a DSN row names
    # the notice's recipient (the sender) and, in reference, the original's Message-Id
    assert dsn_ev[0]["related-recipient-address"] == ""
    assert dsn_ev[0]["reference"] and dsn_ev[0]["reference"] == fail[0]["message-id"]

    files = wait_for(lambda: node.maildir_files("bob@example.test"), what="DSN in bob's Maildir")
    time.sleep(0.5)  # waiting for absence: a second DSN would show up by now
    files = node.maildir_files("bob@example.test")
    assert len(files) == 1, files
    msg, rcpts = dsn_parts(files[0])
    assert msg["Return-Path"] == "<>"  # a DSN's reverse-path is null
    assert len(rcpts) == 1
    block = rcpts[0]
    assert block["Final-Recipient"].lower() == "rfc822; carol@foreign.test"
    assert block["Action"] == "failed"
    assert re.fullmatch(r"5\.\d{1,3}\.\d{1,3}", block["Status"]), block["Status"]
    assert block.get("Diagnostic-Code", "").startswith("smtp; 5"), block
    assert [a.addr_spec for a in msg["To"].addresses] == ["bob@example.test"]
    assert f"bounce {tag}" in str(msg["Subject"])
    # The DSN is a new message from the null sender, delivered (and tracked) locally.
    dsn_deliver = wait_events(node, "DELIVER", recipient="bob@example.test")
    assert dsn_deliver[0]["internal-message-id"] == dsn_ev[0]["internal-message-id"]
    # MSGTRK's return-path "is never empty": the null sender is written <>; sender-address is the
    # DSN's author (its From: field), as Exchange's NDR rows name the MicrosoftExchange... sender.
    assert dsn_deliver[0]["return-path"] == dsn_ev[0]["return-path"] == "<>"
    assert dsn_deliver[0]["sender-address"] == dsn_ev[0]["sender-address"] == msg["From"].addresses[0].addr_spec
    assert msg["From"].addresses[0].addr_spec.startswith("MAILER-DAEMON@")
    if stage == "RCPT":
        assert not sink.messages()  # (smtp-sink -f . still dumps the rejected message)
    assert not events(node, "SENDEXTERNAL")
    # One attempt: a 5xx is final, no retries.
    assert len(events(node, "FAIL")) == 1
    assert not events(node, "DEFER")


def test_permanent_failure_for_null_sender_sends_no_dsn(make_node, sink):
    sink.start(extra_args=("-f", "RCPT"))
    node = make_node(smart_host=sink.address).start()
    r = swaks(node.port, "--to", "carol@foreign.test", "--from", "<>",
              "--header", "Subject: bounce of a bounce")
    qid = queued_id(r)
    rec = wait_events(node, "RECEIVE", internal_message_id=str(qid))
    assert rec[0]["return-path"] == "<>"
    assert rec[0]["sender-address"] == ""  # swaks's From: <> names no author either
    # the operator finds the null sender's rows as `--sender '<>'`
    assert [r["event-id"] for r in node.tracking(sender="<>", event_id="RECEIVE")] == ["RECEIVE"]

    fail = wait_events(node, "FAIL", internal_message_id=str(qid))
    assert fail[0]["recipient-status"].startswith("5")
    # Waiting for absence: a DSN would be queued in the same commit and delivered within a pass or two.
    node.wait_passes(3)
    assert not events(node, "DSN")
    assert not events(node, "DELIVER")
    assert not all_mailbox_files(node)
    assert not sink.messages()


# --------------------------------------------------------------------------- 4. expiry

def test_expiry_fails_the_message_and_notifies_the_sender(make_node, sink):
    # Sink never started: every attempt is a connection failure, until the message expires.
    node = node_for_stopped_sink(make_node, sink,
                                 overrides={"delivery": {"message_expiration_timeout": 3}}).start()
    tag = uuid.uuid4().hex[:12]
    r = swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test",
              "--header", f"Subject: expire {tag}")
    qid = queued_id(r)
    wait_events(node, "DEFER", internal_message_id=str(qid))

    fail = wait_events(node, "FAIL", internal_message_id=str(qid), timeout=15)
    assert len(fail) == 1
    f = fail[0]
    assert f["source-context"] == "MessageExpired"
    assert "4.4.7" in f["recipient-status"] and "expired" in f["recipient-status"].lower(), f
    rec = events(node, "RECEIVE", internal_message_id=str(qid))[0]
    from transportd.tracking import parse_datetime
    waited = (parse_datetime(f["date-time"]) - parse_datetime(rec["date-time"])).total_seconds()
    assert 2.9 <= waited <= 8, waited

    files = wait_for(lambda: node.maildir_files("bob@example.test"),
                     what="expiry DSN in bob's Maildir")
    _, rcpts = dsn_parts(files[0])
    assert rcpts[0]["Final-Recipient"].lower() == "rfc822; carol@foreign.test"
    assert rcpts[0]["Action"] == "failed"
    assert rcpts[0]["Status"] == "4.4.7"
    assert len(wait_events(node, "DSN")) == 1
    # Expired means done: no further attempts (retry interval 1 s), one DSN only.
    n_defer = len(events(node, "DEFER", internal_message_id=str(qid)))
    time.sleep(1.5)  # waiting for absence: past a retry interval, no new attempt
    assert len(events(node, "DEFER", internal_message_id=str(qid))) == n_defer
    assert len(node.maildir_files("bob@example.test")) == 1
    assert len(events(node, "FAIL", internal_message_id=str(qid))) == 1
    queued = node.cli_json("message", "list")
    assert all(m["id"] != qid for m in queued), queued


# --------------------------------------------------------------------------- 5. duplicate detection

def test_duplicate_within_window_is_stored_once(make_node):
    node = make_node().start()
    tag = uuid.uuid4().hex[:12]
    data = message(f"dup {tag}", msgid=f"<dup-{tag}@test>", date=FIXED_DATE)
    first = smtp_send(node.port, "bob@remote.test", ["alice@example.test"], data)
    wait_events(node, "DELIVER", internal_message_id=str(first))
    second = smtp_send(node.port, "bob@remote.test", ["alice@example.test"], data)
    assert second != first
    dup = wait_events(node, "DUPLICATEDELIVER", internal_message_id=str(second))
    time.sleep(0.5)  # waiting for absence: a second stored copy would show up by now

    files = node.maildir_files("alice@example.test")
    assert len(files) == 1, files
    assert parse(files[0])["Message-ID"] == f"<dup-{tag}@test>"
    assert len(events(node, "DUPLICATEDELIVER")) == 1
    assert len(events(node, "DELIVER")) == 1
    assert dup[0]["recipient-address"].lower() == "alice@example.test"
    # The stored copy is the first one.
    assert events(node, "DELIVER")[0]["network-message-id"] in files[0].name


def test_rapid_duplicates_are_stored_once(make_node):
    """Copies of one message back to back: each is claimed by its own concurrent delivery batch."""
    node = make_node().start()
    tag = uuid.uuid4().hex[:12]
    data = message(f"dup-burst {tag}", msgid=f"<dup-burst-{tag}@test>", date=FIXED_DATE)
    n = 12
    s = smtplib.SMTP("127.0.0.1", node.port, timeout=20)
    s.ehlo("client.test")
    ids = [smtp_send(node.port, "bob@remote.test", ["alice@example.test"], data, client=s)
           for _ in range(n)]
    s.quit()
    assert len(set(ids)) == n
    wait_for(lambda: len(events(node, "DELIVER")) + len(events(node, "DUPLICATEDELIVER")) >= n,
             what="every copy processed")
    time.sleep(0.3)  # waiting for absence: an extra DELIVER or file would show up by now
    files = node.maildir_files("alice@example.test")
    assert len(files) == 1, f"{len(files)} copies stored"
    assert len(events(node, "DELIVER")) == 1
    assert len(events(node, "DUPLICATEDELIVER")) == n - 1


def test_duplicate_after_window_is_stored(make_node):
    node = make_node(overrides={"mailbox": {"duplicate_detection_window": 1}}).start()
    tag = uuid.uuid4().hex[:12]
    data = message(f"win {tag}", msgid=f"<win-{tag}@test>", date=FIXED_DATE)
    first = smtp_send(node.port, "bob@remote.test", ["alice@example.test"], data)
    wait_events(node, "DELIVER", internal_message_id=str(first))
    time.sleep(2)  # part of the scenario: the 1 s duplicate detection window passes (a clock)
    second = smtp_send(node.port, "bob@remote.test", ["alice@example.test"], data)
    wait_events(node, "DELIVER", internal_message_id=str(second))
    time.sleep(0.5)  # waiting for absence: a DUPLICATEDELIVER or third file would show up by now
    files = node.maildir_files("alice@example.test")
    assert len(files) == 2, files
    assert all(parse(f)["Message-ID"] == f"<win-{tag}@test>" for f in files)
    assert not events(node, "DUPLICATEDELIVER")
    assert len(events(node, "DELIVER")) == 2


def test_duplicate_after_the_queue_database_was_wiped_is_stored_once(make_node):
    """A kill -9 and a deleted queue database between a message's delivery and a client's retry of it
    (new network id, same Message-ID and Date: the client never saw the 250): DeliveredTo lives with
    the mailbox store (issue 18), so the retry is still dropped as a duplicate."""
    node = make_node().start()
    tag = uuid.uuid4().hex[:12]
    data = message(f"wiped {tag}", msgid=f"<wiped-{tag}@test>", date=FIXED_DATE)
    first = smtp_send(node.port, "bob@remote.test", ["alice@example.test"], data)
    wait_events(node, "DELIVER", internal_message_id=str(first))
    node.kill9()
    for suffix in ("", "-wal", "-shm", "-journal"):
        (node.data_dir / f"queue.db{suffix}").unlink(missing_ok=True)
    node.start()
    second = smtp_send(node.port, "bob@remote.test", ["alice@example.test"], data)
    dup = wait_events(node, "DUPLICATEDELIVER")
    time.sleep(0.5)  # waiting for absence: a second stored copy would show up by now
    files = node.maildir_files("alice@example.test")
    assert len(files) == 1, files
    assert len(events(node, "DELIVER")) == 1 and len(dup) == 1
    assert dup[0]["internal-message-id"] == str(second)
    assert dup[0]["network-message-id"] not in files[0].name  # the retry: another network id
    assert events(node, "DELIVER")[0]["network-message-id"] in files[0].name


def test_delivered_to_rows_of_an_older_queue_database_are_moved_beside_the_mailboxes(make_node):
    """A queue database from before issue 18 holds DeliveredTo rows: the node moves them to the
    mailbox store's records at start, and a copy they describe is still dropped."""
    from sqlalchemy import insert

    from transportd.queue.delivered import DeliveredLog
    from transportd.queue.store import QueueStore, delivered_to
    node = make_node()
    tag = uuid.uuid4().hex[:12]
    store = QueueStore.open(node.data_dir / "queue.db", create=True, node_name=node.name)
    try:
        store.transaction(lambda c: c.execute(insert(delivered_to).values(
            recipient="alice@example.test", message_id=f"<old-{tag}@test>", submit_time=FIXED_DATE,
            delivered_at=time.time() - 60)))
    finally:
        store.close()
    node.start()
    data = message(f"old {tag}", msgid=f"<old-{tag}@test>", date=FIXED_DATE)
    second = smtp_send(node.port, "bob@remote.test", ["alice@example.test"], data)
    dup = wait_events(node, "DUPLICATEDELIVER", internal_message_id=str(second))
    assert dup[0]["recipient-address"].lower() == "alice@example.test"
    assert not node.maildir_files("alice@example.test")
    assert "1 DeliveredTo record(s) moved from the queue database" in node.log()
    assert node.stop() == 0
    from conftest import read_db
    assert read_db(node.data_dir / "queue.db", "SELECT count(*) FROM delivered_to") == [(0,)]
    log = DeliveredLog(node.data_dir / "mailboxes")
    assert log.seen("alice@example.test", f"<old-{tag}@test>", FIXED_DATE, time.time(), 3600)
    log.close()


# ------------------------------------------------------------------ 6. 4xx -> Retry, queue retry

def test_soft_reject_defers_then_queue_retry_delivers(make_node, sink):
    sink.start(extra_args=("-r", "RCPT"))
    # A long retry interval: the message must sit in Retry until the operator retries its queue.
    slow = {"transient_failure_retry_interval": 600,
            "outbound_connection_failure_retry_interval": 600}
    node = make_node(smart_host=sink.address, overrides={"delivery": slow}).start()
    tag = uuid.uuid4().hex[:12]
    r = swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test",
              "--header", f"Subject: soft {tag}")
    qid = queued_id(r)
    identity = smarthost_queue(node, sink)

    defer = wait_events(node, "DEFER", internal_message_id=str(qid))
    assert defer[0]["recipient-status"].startswith("4"), defer[0]["recipient-status"]
    assert defer[0]["recipient-address"].lower() == "carol@foreign.test"

    # The 4xx was the recipient's (RCPT), not the session's: the message waits in Retry, the
    # queue itself does not (test_a_recipients_4xx_defers_that_recipient_not_the_next_hops_queue).
    q = next(q for q in node.cli_json("queue", "list") if q["identity"] == identity)
    assert q["message_count"] == 1 and q["state"] != "Retry", q
    # (the DEFER row is written just before the commit that records the deferral)
    wait_for(lambda: [(m["status"], m["last_error"][:1]) for m in node.cli_json("message", "list")
                      if m["id"] == qid] == [("Retry", "4")], timeout=10, what="the message in Retry")
    assert not sink.messages()
    time.sleep(1.5)  # waiting for absence: no retry before the 600 s interval
    assert len(events(node, "DEFER", internal_message_id=str(qid))) == 1, "retried before its time"

    sink.stop()
    sink.start(extra_args=())
    node.cli("queue", "retry", identity)
    wait_for(sink.messages, timeout=10, what="delivery after queue retry")
    sent = wait_events(node, "SENDEXTERNAL", internal_message_id=str(qid))
    assert sent[0]["recipient-status"].startswith("250")
    time.sleep(0.5)  # waiting for absence: a second copy would show up by now
    assert len(sink.messages()) == 1
    assert f"soft {tag}".encode() in sink.messages()[0]
    q = next(q for q in node.cli_json("queue", "list") if q["identity"] == identity)
    assert q["message_count"] == 0
    assert q["state"] != "Retry" and not q["last_error"], q
    assert not events(node, "FAIL")


# --------------------------------------------------------------------------- 7. bifurcation

def test_bifurcation_local_and_foreign(make_node, sink):
    sink.start()
    node = make_node(smart_host=sink.address).start()
    tag = uuid.uuid4().hex[:12]
    r = swaks(node.port, "--to", "alice@example.test,carol@foreign.test",
              "--from", "bob@remote.test",
              "--header", f"Subject: split {tag}")
    qid = queued_id(r)

    wait_for(lambda: node.maildir_files("alice@example.test"), what="local copy")
    wait_for(sink.messages, what="remote copy")
    wait_events(node, "DELIVER", internal_message_id=str(qid))
    wait_events(node, "SENDEXTERNAL", internal_message_id=str(qid))
    time.sleep(0.5)  # waiting for absence: a second copy on either side would show up by now
    assert len(node.maildir_files("alice@example.test")) == 1
    assert parse(node.maildir_files("alice@example.test")[0])["Subject"] == f"split {tag}"
    msgs = sink.messages()
    assert len(msgs) == 1 and f"split {tag}".encode() in msgs[0]
    # The sink's copy was sent for carol only (smtp-sink records the envelope as X-*-Args lines).
    assert sink_envelope(msgs[0]) == ("<bob@remote.test>", ["<carol@foreign.test>"])

    receive = events(node, "RECEIVE", internal_message_id=str(qid))
    assert len(receive) == 1
    assert set(receive[0]["recipient-address"].lower().split(";")) == {
        "alice@example.test", "carol@foreign.test"}
    deliver = events(node, "DELIVER", internal_message_id=str(qid))
    sent = events(node, "SENDEXTERNAL", internal_message_id=str(qid))
    assert [d["recipient-address"].lower() for d in deliver] == ["alice@example.test"]
    assert [s["recipient-address"].lower() for s in sent] == ["carol@foreign.test"]
    netid = receive[0]["network-message-id"]
    assert deliver[0]["network-message-id"] == sent[0]["network-message-id"] == netid

    shown = node.cli_json("message", "show", str(qid))
    assert len(shown) == 1
    rcpts = {r["address"].lower(): r for r in shown[0]["recipients"]}
    assert set(rcpts) == {"alice@example.test", "carol@foreign.test"}
    assert all(r["status"] == "Delivered" for r in rcpts.values()), rcpts
    assert rcpts["alice@example.test"]["queue"] == "mailbox:local"
    assert rcpts["carol@foreign.test"]["queue"] == smarthost_queue(node, sink)


# ------------------------------------------------------------------ 8. crash during a local burst

def test_kill9_during_local_burst_loses_and_duplicates_nothing(make_node):
    node = make_node().start()
    run = uuid.uuid4().hex[:8]
    total = 30
    acked: dict[str, int] = {}
    kill_after = 12
    enough = threading.Event()
    errors: list[BaseException] = []

    def burst():
        try:
            s = smtplib.SMTP("127.0.0.1", node.port, timeout=10)
            s.ehlo("client.test")
            for i in range(total):
                subject = f"burst {run} #{i:02d}"
                qid = smtp_send(node.port, "bob@remote.test", ["alice@example.test"],
                                message(subject, msgid=f"<burst-{run}-{i}@test>"), client=s)
                acked[subject] = qid
                if len(acked) >= kill_after:
                    enough.set()
        except (smtplib.SMTPException, OSError, AssertionError) as exc:
            errors.append(exc)  # expected once the node is killed
        finally:
            enough.set()

    t = threading.Thread(target=burst)
    t.start()
    assert enough.wait(30)
    node.kill9()
    t.join(30)
    assert not t.is_alive()
    assert errors, "the burst finished before the kill; the test proves nothing"
    assert kill_after <= len(acked) < total, len(acked)

    node.start()

    def subjects():
        out: dict[str, int] = {}
        for f in node.maildir_files("alice@example.test"):
            subj = parse(f)["Subject"]
            out[subj] = out.get(subj, 0) + 1
        return out

    wait_for(lambda: set(acked) <= set(subjects()), timeout=20,
             what="every acknowledged message stored")
    time.sleep(1.5)  # waiting for absence: a second copy of any of them would show up by now
    got = subjects()
    missing = set(acked) - set(got)
    assert not missing, f"acknowledged but lost: {sorted(missing)}"
    doubled = {s: n for s, n in got.items() if n != 1}
    assert not doubled, f"stored more than once: {doubled}"
    # Nothing that was not sent shows up; an unacknowledged in-flight message may be stored (once).
    assert set(got) <= {f"burst {run} #{i:02d}" for i in range(total)}
    assert len(got) - len(acked) <= 1
    # Every acknowledged id has exactly one DELIVER across both runs of the node.
    deliver_ids = [d["internal-message-id"] for d in events(node, "DELIVER")]
    for subject, qid in acked.items():
        assert deliver_ids.count(str(qid)) <= 1, (subject, qid)
    assert not node.cli_json("message", "list")


# --------------------------------------------------------------------------- 1b'. a next hop's recipient limit

class RecipientLimitedNextHop:
    """A next hop (aiosmtpd in a thread of this process) that takes at most ``limit`` recipients per
    transaction and refuses the others with ``refusal`` (452 4.5.3, or 552 as RFC 821 had it);
    it notes each transaction's recipients and each session."""

    def __init__(self, limit: int, refusal: str) -> None:
        import socket

        from aiosmtpd.controller import Controller

        self.transactions: list[list[str]] = []
        self.sessions = 0
        hop = self

        class Handler:
            async def handle_EHLO(self, server, session, envelope, hostname, responses):
                session.host_name = hostname
                hop.sessions += 1
                return responses

            async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
                if len(envelope.rcpt_tos) >= limit:
                    return refusal
                envelope.rcpt_tos.append(address)
                return "250 2.1.5 Ok"

            async def handle_DATA(self, server, session, envelope):
                hop.transactions.append(list(envelope.rcpt_tos))
                return "250 2.0.0 queued"

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)
        self.controller.start()
        self.sessions = 0  # the controller's own probe that the server is up


@pytest.mark.parametrize("refusal", ["452 4.5.3 Too many recipients", "552 5.5.3 Too many recipients"])
def test_recipients_over_the_next_hops_limit_go_at_once_in_the_next_transaction(make_node, refusal):
    """RFC 5321 4.5.3.1.10: a next hop that takes 2 recipients per message refuses the rest with 452
    (or 552, which a client should take as the same temporary refusal): they go in the next
    transactions of the same session at once, not after a retry interval, and none fails."""
    hop = RecipientLimitedNextHop(2, refusal)
    try:
        node = make_node(smart_host=f"127.0.0.1:{hop.port}",
                         overrides={"delivery": {"transient_failure_retry_interval": 600}}).start()
        rcpts = [f"r{i}@foreign.test" for i in range(5)]
        queued_id(swaks(node.port, "--from", "bob@example.test", "--to", ",".join(rcpts)))
        wait_for(lambda: sum(map(len, hop.transactions)) >= 5, timeout=15, what="the five recipients at the next hop")
        assert hop.transactions == [rcpts[:2], rcpts[2:4], rcpts[4:]] and hop.sessions == 1
        sent = events(node, "SENDEXTERNAL")
        assert sorted(r for e in sent for r in e["recipient-address"].split(";")) == rcpts
        assert not events(node, "DEFER") and not events(node, "FAIL")
    finally:
        hop.controller.stop()


def test_a_recipients_4xx_defers_that_recipient_not_the_next_hops_queue(make_node):
    """A 450 to one recipient's RCPT is about that recipient: the queue to the next hop does not
    go into Retry (Exchange's queue retry is for connection failures), so a message sent after it
    to another recipient goes at once, not after the retry interval."""
    hop = PerRecipientNextHop()  # 450 to temp-*, 250 to the others
    try:
        node = make_node(smart_host=f"127.0.0.1:{hop.port}",
                         overrides={"delivery": {"transient_failure_retry_interval": 600}}).start()
        queued_id(swaks(node.port, "--from", "bob@example.test", "--to", "temp-1@foreign.test"))
        wait_for(lambda: events(node, "DEFER"), timeout=10, what="the 450 recorded")
        queue = one([q for q in node.cli_json("queue", "list") if q["message_count"]])
        assert queue["state"] != "Retry", queue
        queued_id(swaks(node.port, "--from", "bob@example.test", "--to", "ok-2@foreign.test"))
        wait_for(lambda: ["ok-2@foreign.test"] in hop.transactions, timeout=10,
                 what="the second message delivered without waiting for a retry interval")
        retry = one(node.cli_json("message", "list"))
        assert retry["status"] == "Retry" and "450 4.2.1" in retry["last_error"], retry
    finally:
        hop.controller.stop()


# --------------------------------------------------------------------------- 1c. sessions kept for the next batch

class CountingNextHop:
    """A next hop (aiosmtpd in a thread of this process) that notes each session's messages and
    QUIT, and can make its open sessions stale: one closes, unanswered, on its next MAIL (as a
    next hop whose idle timeout ends a session the moment the client writes to it)."""

    def __init__(self) -> None:
        import socket

        from aiosmtpd.controller import Controller
        from aiosmtpd.smtp import SMTP as AioSMTP

        self.sessions: list[dict] = []
        hop = self

        class Session(AioSMTP):
            def connection_made(self, transport):
                super().connection_made(transport)
                self.noted = {"messages": 0, "quit": False, "stale": False}
                hop.sessions.append(self.noted)

            async def smtp_MAIL(self, arg):
                if self.noted["stale"]:
                    self.transport.close()
                    return
                await super().smtp_MAIL(arg)

            async def smtp_QUIT(self, arg):
                self.noted["quit"] = True
                await super().smtp_QUIT(arg)

        class Handler:
            async def handle_DATA(self, server, session, envelope):
                server.noted["messages"] += 1
                return "250 2.0.0 queued"

        class Factory(Controller):
            def factory(self):
                return Session(self.handler)

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.controller = Factory(Handler(), hostname="127.0.0.1", port=self.port)
        self.controller.start()
        self.sessions.clear()  # the controller's own probe that the server is up

    def messages(self) -> int:
        return sum(s["messages"] for s in self.sessions)

    def make_stale(self) -> None:
        for s in self.sessions:
            s["stale"] = True

    def stop(self) -> None:
        self.controller.stop()


@pytest.fixture
def counting_next_hop():
    hop = CountingNextHop()
    try:
        yield hop
    finally:
        hop.stop()


def test_a_session_is_kept_for_the_next_batch_and_quit_when_idle(make_node, counting_next_hop):
    """delivery.connection_cache_time: the next batch to the same next hop goes out on the session
    of the one before (no connect, greeting, EHLO, QUIT between them); a kept session the next
    hop closes as the next message goes out costs that message nothing (it goes on a new
    session, no DEFER); an idle kept session gets its QUIT; 0 keeps none."""
    hop = counting_next_hop

    def send(node, n: int) -> None:
        queued_id(swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test",
                        "--header", f"Subject: kept {n}"))
        wait_for(lambda: hop.messages() >= n, timeout=15, what=f"{n} messages at the next hop")

    node = make_node(smart_host=f"127.0.0.1:{hop.port}", overrides={"delivery": {"connection_cache_time": 60}}).start()
    for n in (1, 2, 3):
        send(node, n)
    assert [(s["messages"], s["quit"]) for s in hop.sessions] == [(3, False)]
    hop.make_stale()
    send(node, 4)
    assert [(s["messages"], s["quit"]) for s in hop.sessions] == [(3, False), (1, False)]
    # the next hop counts a message before its reply reaches the node, which then writes the row
    wait_for(lambda: len(events(node, "SENDEXTERNAL")) == 4, timeout=10, what="4 SENDEXTERNAL rows")
    assert not events(node, "DEFER")
    assert "closed by the next hop" in node.log()
    assert node.stop() == 0
    assert hop.sessions[-1]["quit"], "a clean stop QUITs the kept session"

    node = make_node("node2", smart_host=f"127.0.0.1:{hop.port}",
                     overrides={"delivery": {"connection_cache_time": 3}}).start()
    send(node, 5)
    assert not hop.sessions[-1]["quit"]  # kept, for now
    wait_for(lambda: hop.sessions[-1]["quit"], timeout=15, what="QUIT of the idle kept session")
    assert node.alive and [s["messages"] for s in hop.sessions] == [3, 1, 1]
    node.stop()

    node = make_node("node3", smart_host=f"127.0.0.1:{hop.port}",
                     overrides={"delivery": {"connection_cache_time": 0}}).start()
    for n in (6, 7):
        send(node, n)
    wait_for(lambda: hop.sessions[-1]["quit"], timeout=10, what="QUIT after the batch")
    assert [(s["messages"], s["quit"]) for s in hop.sessions[3:]] == [(1, True), (1, True)]


# --------------------------------------------------------------------------- 1d. what a next hop may already hold

CLOSE = "close the connection, unanswered"
REPLIES = {"EHLO": "250-hop.test\r\n250 PIPELINING", "QUIT": "221 2.0.0 bye", ".": "250 2.0.0 queued",
           "DATA": "554 5.5.1 no valid recipients"}


class ScriptedNextHop:
    """A next hop in asyncio (its own event loop, in a thread of this process) that speaks ESMTP
    with PIPELINING line by line and takes at most ``rcpt_limit`` recipients per transaction
    (452 4.5.3 for more). ``script(hop, session, line)`` may answer any line (``"connect"`` before
    the greeting, ``"."`` for a complete end of data) otherwise: a reply (text, or bytes sent as they
    are), ``(delay, reply)``, or CLOSE. It notes every session's lines (``sessions``), each message it took as (session,
    recipients) (``messages``, before its reply goes out) and when each end of data came (``dots``)."""

    def __init__(self, script=None, rcpt_limit: int = 100) -> None:
        self.script = script or (lambda hop, session, line: None)
        self.rcpt_limit = rcpt_limit
        self.sessions: list[list[str]] = []
        self.messages: list[tuple[int, list[str]]] = []
        self.dots: list[float] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def recipients(self) -> list[list[str]]:
        return [rcpts for _, rcpts in self.messages]

    async def _serve(self, reader, writer) -> None:
        session, lines, rcpts = len(self.sessions), [], []
        self.sessions.append(lines)

        async def say(line: str, default: str) -> bool:
            reply = self.script(self, session, line) or default
            if reply == CLOSE:
                writer.close()
                return False
            if isinstance(reply, tuple):
                await asyncio.sleep(reply[0])
                reply = reply[1]
            data = reply if isinstance(reply, bytes) else reply.encode()  # bytes: sent as they are
            writer.write(data + b"\r\n")
            await writer.drain()
            return not data.startswith(b"221")
        try:
            going = await say("connect", "220 hop.test ESMTP")
            while going:
                line = (await reader.readline()).decode("utf-8", "replace").rstrip("\r\n")
                if not line:
                    break
                lines.append(line)
                verb = line.split(":")[0].split(" ")[0].upper()
                if verb == "DATA" and rcpts:
                    if not await say(line, "354 go on"):
                        break
                    while await reader.readline() not in (b".\r\n", b""):
                        pass
                    lines.append(".")
                    self.messages.append((session, list(rcpts)))
                    self.dots.append(time.monotonic())
                    line, verb = ".", "."
                    rcpts.clear()
                elif verb in ("MAIL", "RSET"):
                    rcpts.clear()
                default = REPLIES.get(verb, "250 ok")
                if verb == "RCPT":
                    taken = len(rcpts) < self.rcpt_limit
                    if taken:
                        rcpts.append(line.split("<", 1)[1].split(">", 1)[0])
                    default = "250 2.1.5 ok" if taken else "452 4.5.3 Too many recipients"
                going = await say(line, default)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        async def close() -> None:
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def scripted_hop():
    """A factory of ``ScriptedNextHop``s, every one stopped at the end."""
    made: list[ScriptedNextHop] = []

    def factory(script=None, **kw) -> ScriptedNextHop:
        made.append(ScriptedNextHop(script, **kw))
        return made[-1]
    yield factory
    for hop in made:
        hop.stop()


def recipient_states(node) -> dict[str, str]:
    from conftest import read_db
    return dict(read_db(node.data_dir / "queue.db", "SELECT address, status FROM recipients"))


def late_reply_to_the_first_dot(hop, session, line):
    """The next hop answers the end of data of its first session 4 s after the dot."""
    return (4.0, "250 2.0.0 queued") if line == "." and session == 0 else None


def test_a_clean_stop_lets_a_transaction_whose_data_went_out_finish(make_node, scripted_hop):
    """SIGTERM 1.2 s after the dot, while the next hop holds its 250 (4 s): the stop waits for the
    reply (within delivery.stop_grace_time), records the delivery, then QUITs; after the restart
    nothing is sent again. (The stop cancelled the transaction: QUIT read the late 250 as its own
    reply, the message stayed Active and went out a second time after the restart.)"""
    hop = scripted_hop(late_reply_to_the_first_dot)
    node = make_node(smart_host=hop.address).start()
    queued_id(swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test"))
    wait_for(lambda: hop.dots, timeout=15, what="the end of data at the next hop")
    time.sleep(max(0.0, hop.dots[0] + 1.2 - time.monotonic()))
    stopped = time.monotonic()
    assert node.stop() == 0
    took = time.monotonic() - stopped
    assert recipient_states(node) == {"carol@foreign.test": "Delivered"}
    assert 2.0 < took < 10, f"the stop took {took:.1f}s: it waits for the reply, 2.8 s, and no longer"
    assert hop.sessions[0][-2:] == [".", "QUIT"]
    assert len(events(node, "SENDEXTERNAL")) == 1 and not events(node, "DEFER")
    node.start()
    node.wait_passes(5)
    assert len(hop.messages) == 1


def test_a_stop_whose_grace_runs_out_leaves_the_message_for_retry(make_node, scripted_hop):
    """delivery.stop_grace_time bounds the wait: past it the transaction is cut (closed, no QUIT
    into it, the late 250 never read) and its recipient made Ready by the stop (it showed Active on
    the stopped node, and the next start called it a crash's), sent again after the restart (the
    next hop may then hold it twice, as after a crash)."""
    hop = scripted_hop(late_reply_to_the_first_dot)
    node = make_node(smart_host=hop.address, overrides={"delivery": {"stop_grace_time": 1}}).start()
    queued_id(swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test"))
    wait_for(lambda: hop.dots, timeout=15, what="the end of data at the next hop")
    stopped = time.monotonic()
    assert node.stop() == 0
    assert time.monotonic() - stopped < 3.5
    assert recipient_states(node) == {"carol@foreign.test": "Ready"}
    assert "1 recipient(s) whose delivery the stop cut are Ready again" in node.log()
    assert "QUIT" not in hop.sessions[0]
    node.start()
    wait_for(lambda: recipient_states(node) == {"carol@foreign.test": "Delivered"}, timeout=15,
             what="the delivery after the restart")
    assert len(hop.messages) == 2
    assert "crash recovery" not in node.log()


def test_recipients_a_next_hop_took_before_its_session_broke_are_not_sent_again(make_node, scripted_hop):
    """A next hop that takes 2 recipients per message gets a message for 3 in two transactions of
    one session, and the session breaks at the second one's MAIL. The two it took stay delivered
    (SENDEXTERNAL), only the third is deferred and goes on the retry. (All three were deferred and
    the first two sent again.)"""
    def script(hop, session, line):
        mails = sum(sent.startswith("MAIL") for sent in hop.sessions[session])
        return CLOSE if session == 0 and line.startswith("MAIL") and mails == 2 else None
    hop = scripted_hop(script, rcpt_limit=2)
    node = make_node(smart_host=hop.address).start()  # retried after 1 s
    rcpts = ["r0@foreign.test", "r1@foreign.test", "r2@foreign.test"]
    queued_id(swaks(node.port, "--from", "bob@example.test", "--to", ",".join(rcpts)))
    wait_for(lambda: len(hop.messages) >= 2 and recipient_states(node) == dict.fromkeys(rcpts, "Delivered"),
             timeout=20, what="every recipient delivered")
    assert hop.recipients() == [rcpts[:2], rcpts[2:]]
    assert [e["recipient-address"] for e in events(node, "DEFER")] == ["r2@foreign.test"]
    assert sorted(r for e in events(node, "SENDEXTERNAL") for r in e["recipient-address"].split(";")) == rcpts


def test_a_kept_session_that_breaks_after_the_end_of_data_is_a_deferral_not_a_resend(make_node, scripted_hop):
    """A session kept for the next batch (connection_cache_time) carries a second message; the next
    hop reads its data and dot and closes without a reply. It may hold the message: a DEFER and the
    retry interval (RFC 5321 4.5.4.1), not a new session at once (which sent it twice, 8 ms apart).
    Only a kept session found closed at MAIL is renewed at once (test_a_session_is_kept_...)."""
    hop = scripted_hop(lambda hop, session, line: CLOSE if line == "." and len(hop.messages) == 2 else None)
    node = make_node(smart_host=hop.address, overrides={
        "delivery": {"connection_cache_time": 10, "transient_failure_retry_interval": 30}}).start()
    queued_id(swaks(node.port, "--to", "a1@foreign.test", "--from", "bob@example.test"))
    wait_events(node, "SENDEXTERNAL")
    queued_id(swaks(node.port, "--to", "a2@foreign.test", "--from", "bob@example.test"))
    wait_for(lambda: events(node, "DEFER") or len(hop.messages) > 2, timeout=15,
             what="a DEFER (or a resend) of the second message")
    time.sleep(0.5)  # waiting for absence: a resend goes out within milliseconds
    assert len(hop.messages) == 2 and len(hop.sessions) == 1
    assert recipient_states(node) == {"a1@foreign.test": "Delivered", "a2@foreign.test": "Retry"}
    assert [e["recipient-address"] for e in events(node, "DEFER")] == ["a2@foreign.test"]


@pytest.mark.parametrize("refusal", [{"connect": "554 5.3.2 no service here"},
                                     {"EHLO": "550 5.7.1 go away", "HELO": "550 5.7.1 go away"},
                                     {"EHLO": "502 5.5.1 what", "HELO": "550 5.7.1 go away"}],
                         ids=["554 greeting", "5xx to EHLO and HELO", "5xx to HELO"])
def test_a_refused_session_start_gets_a_quit_and_the_message_is_deferred(make_node, scripted_hop, refusal):
    """RFC 5321 3.1 and 4.1.4: after a 554 greeting (or a 5xx to EHLO, then to HELO) the client
    sends QUIT and waits for its reply before it closes (it closed at once); the message is
    deferred, not bounced."""
    hop = scripted_hop(lambda hop, session, line: refusal.get(line.split(" ")[0]))
    node = make_node(smart_host=hop.address, overrides={
        "delivery": {"transient_failure_retry_interval": 600, "outbound_connection_failure_retry_interval": 600}}).start()
    queued_id(swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test"))
    wait_events(node, "DEFER")
    wait_for(lambda: hop.sessions and hop.sessions[0][-1:] == ["QUIT"], timeout=5, what="the QUIT")
    # (the DEFER row is written just before the commit that records it)
    wait_for(lambda: recipient_states(node) == {"carol@foreign.test": "Retry"}, timeout=10, what="Retry recorded")
    assert len(hop.sessions) == 1


def test_a_refusal_holding_control_characters_and_no_utf8_fails_with_a_clean_dsn(make_node, scripted_hop):
    """A next hop refuses the recipient with ``550 5.1.1 no such<NUL>user <FF><FE> here``: a 5xx,
    so FAIL at once and a DSN to the sender, the next hop's words cleaned where its reply enters
    the node (NUL as "?", octets that are no UTF-8 as U+FFFD) for the DSN, the tracking log and the
    queue database alike. Before, the NUL made the DSN impossible: 451 4.3.0 internal error in dsn,
    a retry, then the Poison queue, the sender never told."""
    refusal = b"550 5.1.1 no such\x00user \xff\xfe here"
    hop = scripted_hop(lambda hop, session, line: refusal if line.startswith("RCPT") else None)
    node = make_node(smart_host=hop.address).start()
    qid = queued_id(swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test",
                          "--header", "Subject: refused"))
    cleaned = "550 5.1.1 no such?user \ufffd\ufffd here"
    fail = wait_events(node, "FAIL", internal_message_id=str(qid))
    assert fail[0]["recipient-status"] == cleaned
    files = wait_for(lambda: node.maildir_files("bob@example.test"), what="the DSN in bob's Maildir")
    assert b"\x00" not in files[0].read_bytes()
    _, rcpts = dsn_parts(files[0])
    assert rcpts[0]["Action"] == "failed" and rcpts[0]["Status"] == "5.1.1"
    assert rcpts[0]["Diagnostic-Code"] == "smtp; 550 5.1.1 no such?user \\x{FFFD}\\x{FFFD} here"
    assert read_db(node.data_dir / "queue.db", "SELECT status, last_error FROM recipients WHERE message_id = ?",
                   (qid,)) == [("Failed", cleaned)]
    assert not events(node, "DEFER") and not events(node, "POISONMESSAGE")
    assert node.cli_json("message", "list", "--queue", "Poison") == []


def test_a_next_hop_that_refuses_ehlo_with_any_5xx_gets_helo(make_node, scripted_hop):
    """RFC 5321 4.1.4: EHLO may be refused with 501, 550 or 554 as well as 500 / 502; the client
    says HELO then, as Postfix's does (a 554 to EHLO left the message deferred until it expired,
    the next hop never asked in HELO), and sends one command at a time, no ESMTP parameter."""
    hop = scripted_hop(lambda hop, session, line: "554 5.7.1 no ESMTP for you" if line.startswith("EHLO") else
                       "250 hop.test" if line.startswith("HELO") else None)
    node = make_node(smart_host=hop.address).start()
    queued_id(swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test"))
    wait_events(node, "SENDEXTERNAL")
    assert [line.split(" ")[0] for line in hop.sessions[0][:3]] == ["EHLO", "HELO", "MAIL"]
    assert hop.sessions[0][2] == "MAIL FROM:<bob@example.test>" and not events(node, "DEFER")


def test_data_answered_250_is_out_of_step_and_never_a_delivery(make_node, scripted_hop):
    """RFC 5321 4.3.2: DATA is answered 354 (then the data, then the reply that counts) or refused.
    A next hop that answers it 250, as happens when the replies are shifted by a line (a broken
    multi-line reply, an extra line after the data), has not been sent a single octet of the
    message: the session is out of step, closed, the message deferred and sent again. (The 250 was
    taken as the data's: SENDEXTERNAL, the message in Safety Net, the next hop without it.)"""
    hop = scripted_hop(lambda hop, session, line: "250 2.0.0 Ok" if session == 0 and line == "DATA" else None)
    node = make_node(smart_host=hop.address).start()  # retried after 1 s
    queued_id(swaks(node.port, "--to", "carol@foreign.test", "--from", "bob@example.test",
                    "--header", "Subject: shifted"))
    sent = wait_events(node, "SENDEXTERNAL", timeout=20)
    [defer] = events(node, "DEFER")
    assert "DATA answered 250 2.0.0 Ok" in defer["recipient-status"] and "out of step" in defer["recipient-status"]
    assert len(sent) == 1 and len(hop.sessions) == 2
    assert hop.sessions[1][-2:] == ["DATA", "."]
    assert recipient_states(node) == {"carol@foreign.test": "Delivered"}


def test_a_pipelined_group_cut_by_a_421_is_the_next_hops_limit_not_a_deferral(make_node, scripted_hop):
    """A next hop that takes one message per connection answers the next MAIL of a pipelined group
    with 421 and closes (RFC 5321 3.8) before the group's RCPT and DATA are answered: every command
    awaiting a reply has the 421, so the batch goes on at once on a new session (its limit of
    messages per connection, as without PIPELINING), not deferred with "closed the connection"."""
    state = {"open": False}

    def script(hop, session, line):
        if line == "connect":
            return None if state["open"] else "421 4.3.2 not now"
        if "." in hop.sessions[session] and line.startswith("MAIL"):
            hop.cut = getattr(hop, "cut", set()) | {session}
            return "421 4.7.0 too many messages in this connection"
        return CLOSE if session in getattr(hop, "cut", set()) else None
    hop = scripted_hop(script)
    node = make_node(smart_host=hop.address, overrides={"delivery": {
        "transient_failure_retry_interval": 600, "outbound_connection_failure_retry_interval": 600}}).start()
    qids = [queued_id(swaks(node.port, "--to", f"r{i}@foreign.test", "--from", "bob@example.test")) for i in range(3)]
    wait_for(lambda: [q for q in node.cli_json("queue", "list") if q["identity"] == f"smarthost:{hop.address}"
                      and q["state"] == "Retry" and q["message_count"] == 3],
             timeout=15, what="the three messages waiting in Retry")
    deferrals = len(events(node, "DEFER"))
    state["open"] = True
    node.cli("queue", "retry", f"smarthost:{hop.address}")
    sent = wait_events(node, "SENDEXTERNAL", n=3, timeout=15)
    assert sorted(int(e["internal-message-id"]) for e in sent) == sorted(qids)
    assert len(events(node, "DEFER")) == deferrals
    assert "ended the session after 1 message(s) of this batch (421 4.7.0 too many messages" in node.log()
