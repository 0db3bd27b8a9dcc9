"""Internationalized mail end to end (RFC 6531/6532/6533) and 8BITMIME honesty (RFC 6152).

Real processes on loopback: Python's smtplib as the client (it speaks SMTPUTF8), a 3-node
cluster or a single node, and as next hops ``transportd sink`` (advertises SMTPUTF8 and
8BITMIME; records the envelope as it arrived) and Postfix's smtp-sink, a real server
without SMTPUTF8 (and, with ``-8``, without 8BITMIME).
"""

from __future__ import annotations

import email
import email.policy
import smtplib
import time
from pathlib import Path

import pytest
from clusters import HEARTBEAT, netid_of, one
from conftest import TransportdSink, wait_for, write_toml
from helpers import PerRecipientNextHop

from transportd.queue.mailbox import MailboxStore

SENDER = "jürgen@bücher.example"
FOREIGN = "δοκιμή@παράδειγμα.δοκιμή"   # routed to the smart host
LOCAL = "üser.ñame@example.test"        # a local mailbox (MDB01 on node1 in the cluster)


def utf8_message(subject: str = "Grüße aus Köln", to: str = FOREIGN, sender: str = SENDER,
                 extra: str = "") -> bytes:
    """RFC 6532: raw UTF-8 in From, To and Subject; an 8-bit UTF-8 body."""
    return (f"From: Jürgen Müller <{sender}>\r\nTo: <{to}>\r\nSubject: {subject}\r\n"
            f"Message-ID: <{time.time_ns()}.ü@bücher.example>\r\nDate: Wed, 25 Nov 2026 10:00:00 +0000\r\n"
            f"MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n"
            f"{extra}\r\nΚαλημέρα κόσμε, ünïcödé bödy ✓\r\nsecond line\r\n").encode("utf-8")


def send(host: str, port: int, sender: str, rcpts: list[str], data: bytes,
         options: tuple[str, ...] = ("SMTPUTF8", "BODY=8BITMIME")) -> int:
    with smtplib.SMTP(host, port, timeout=30) as s:
        s.ehlo("client.test")
        s.mail(sender, list(options))
        for r in rcpts:
            code, reply = s.rcpt(r)
            assert code == 250, (code, reply)
        code, reply = s.data(data)
        assert code == 250, (code, reply)
    return int(reply.decode().rsplit(" ", 1)[1])


def mailbox_files(cfg, address: str) -> list[Path]:
    return MailboxStore(cfg.mailbox_dir).list(address)


# --------------------------------------------------------------------------- through a cluster

def test_utf8_envelope_and_headers_through_a_cluster_to_the_next_hop(cluster, usink):
    """smtplib with SMTPUTF8 into node1: shadow made (HAREDIRECT/HARECEIVE), the sink gets the
    UTF-8 envelope and the message byte for byte, the shadow is discarded; the CLI finds it."""
    c = cluster(overrides={"routing": {"smart_host": usink.address}}).start()
    node1 = c["node1"]
    data = utf8_message()
    qid = send(node1.host, node1.frontend_port, SENDER, [FOREIGN], data)
    netid = netid_of(node1, qid)

    stored = one(wait_for(usink.messages, timeout=15, what="the sink to receive it"))
    head, _, rest = stored.partition(b"\r\n")
    assert head == f"X-Sink-Mail-From: <{SENDER}>".encode("utf-8")
    assert rest.startswith(f"X-Sink-Rcpt-To: <{FOREIGN}>\r\n".encode("utf-8"))
    assert stored.endswith(data), "headers or body changed on the way"
    assert f"with UTF8SMTP id {netid}".encode() in stored  # RFC 6531 3.7.3

    redirect = one(node1.tracking(event_id="HAREDIRECT", network_message_id=netid))
    holder = next(n for n in (c["node2"], c["node3"]) if redirect["source-context"].startswith(n.name))
    hareceive = one(holder.tracking(event_id="HARECEIVE", network_message_id=netid))
    assert hareceive["recipient-address"] == FOREIGN and hareceive["sender-address"] == SENDER
    assert not node1.tracking(event_id="HAREDIRECTFAIL", network_message_id=netid)
    wait_for(lambda: holder.tracking(event_id="HADISCARD", network_message_id=netid), timeout=HEARTBEAT + 8,
             what="the shadow to be discarded")
    sent = one(node1.tracking(event_id="SENDEXTERNAL", network_message_id=netid))
    assert sent["recipient-address"] == FOREIGN and sent["message-subject"] == "Grüße aus Köln"

    # The CLI shows and searches UTF-8 addresses (case-insensitively, as Get-MessageTrackingLog).
    found = node1.tracking(sender=SENDER.upper(), event_id="RECEIVE")
    assert [r["network-message-id"] for r in found] == [netid]
    assert [r["network-message-id"] for r in node1.tracking(recipient=FOREIGN, event_id="RECEIVE")] == [netid]
    listed = one([m for m in node1.messages() if m["network_message_id"] == netid])
    assert listed["from"] == SENDER and listed["subject"] == "Grüße aus Köln"


def test_utf8_local_part_mailbox_on_the_node_and_hop_by_hop(cluster, usink):
    """A UTF-8 local part: stored in a Maildir whose folder name is safe, duplicate detection
    drops a second copy, and node3 hands the same kind of message to node1 hop by hop."""
    c = cluster(overrides={"routing": {"smart_host": usink.address}}).start()
    node1, node3 = c["node1"], c["node3"]
    cfg1 = node1.cfg
    data = utf8_message(to=LOCAL)
    qid = send(node1.host, node1.frontend_port, SENDER, [LOCAL], data)
    netid = netid_of(node1, qid)
    files = wait_for(lambda: mailbox_files(cfg1, LOCAL), timeout=10, what="the mailbox delivery")
    assert files[0].read_bytes().endswith(data)
    folder = files[0].parent.parent.name
    assert folder.isascii() and "/" not in folder, folder
    # the file is written before the DELIVER row: wait for the row, not only the file
    deliver = one(wait_for(lambda: node1.tracking(event_id="DELIVER", network_message_id=netid), timeout=10,
                           what="the DELIVER row"))
    assert deliver["recipient-address"] == LOCAL

    # The same message again (same Message-ID and Date): a duplicate, dropped.
    qid2 = send(node1.host, node1.frontend_port, SENDER, [LOCAL], data)
    netid2 = netid_of(node1, qid2)
    wait_for(lambda: node1.tracking(event_id="DUPLICATEDELIVER", network_message_id=netid2), timeout=10,
             what="DUPLICATEDELIVER")
    assert len(mailbox_files(cfg1, LOCAL)) == 1

    # Hop by hop: node3 (site-b) sends it to node1, which holds MDB01.
    other = "ñandú@example.test"
    data3 = utf8_message(subject="hop by hop ✓", to=other)
    qid3 = send(node3.host, node3.frontend_port, SENDER, [other], data3)
    netid3 = netid_of(node3, qid3)
    files3 = wait_for(lambda: mailbox_files(cfg1, other), timeout=15, what="node1 to store node3's message")
    assert files3[0].read_bytes().endswith(data3)
    sent3 = wait_for(lambda: node3.tracking(event_id="SEND", network_message_id=netid3), timeout=10,
                     what="node3's SEND row (written once node1's reply is read)")
    assert one(sent3)["recipient-address"] == other
    wait_for(lambda: node3.tracking(event_id="HADISCARD", network_message_id=netid3), timeout=HEARTBEAT + 8,
             what="node3 to release its copy after node1's discard")


# --------------------------------------------------------------------------- next hops without the extensions

@pytest.mark.parametrize("next_hop", ["postfix smtp-sink", "transportd sink --no-smtputf8"])
def test_next_hop_without_smtputf8_fails_the_recipient_with_5_6_7_and_a_utf8_dsn(make_node, sink, procs, next_hop):
    """RFC 6531 3.4: no attempt at all; the recipient fails with 5.6.7 and the sender (a local
    mailbox here) gets an RFC 6533 DSN."""
    if next_hop.startswith("postfix"):
        sink.start()
        address, received = sink.address, sink.messages
    else:
        old = TransportdSink(procs, "--no-smtputf8")
        address, received = old.address, old.messages
    node = make_node(smart_host=address).start()
    sender = "jürgen@example.test"
    qid = send("127.0.0.1", node.port, sender, [FOREIGN], utf8_message(sender=sender))
    fail = one(wait_for(lambda: node.tracking(event_id="FAIL"), timeout=10, what="FAIL"))
    assert fail["recipient-address"] == FOREIGN and " 5.6.7 " in fail["recipient-status"], fail
    assert fail["internal-message-id"] == str(qid)
    dsn_file = one(wait_for(lambda: node.maildir_files(sender), timeout=10, what="the DSN in the sender's mailbox"))
    dsn = email.message_from_bytes(dsn_file.read_bytes(), policy=email.policy.default)
    assert dsn.get_content_type() == "multipart/report"
    types = [p.get_content_type() for p in dsn.walk()]
    assert "message/global-delivery-status" in types, types
    status = dsn_file.read_bytes().decode("utf-8")
    assert "Status: 5.6.7" in status and FOREIGN in status
    # RFC 3464 2.3.5: Remote-MTA names the server that gave the Diagnostic-Code; none did here
    assert "Remote-MTA" not in status, status
    assert not received(), "the next hop got an attempt it cannot take"


# The DSN's way back lacks SMTPUTF8: a DSN for a message received with SMTPUTF8 is an RFC 6533 one,
# which may not go to a next hop without SMTPUTF8 (RFC 6531 3.4), and a DSN that fails is told to no one.

REFUSED = "perm-δοκιμή@refusing.test"  # a non-ASCII local part, refused (550 5.1.1) by a next hop with SMTPUTF8


def dsn_route_node(make_node, back_address: str):
    """A node whose mail for refusing.test goes to a next hop with SMTPUTF8 that refuses perm-*
    (send connector), and everything else, the DSN's way back, to ``back_address``."""
    refusing = PerRecipientNextHop(smtputf8=True)
    node = make_node(smart_host=back_address)
    node.sections["send_connectors"] = [{"name": "refusing", "address_spaces": ["refusing.test"],
                                         "smart_hosts": f"127.0.0.1:{refusing.port}"}]
    write_toml(node.config_path, node.sections)
    return node.start(), refusing


@pytest.mark.parametrize("back", ["aiosmtpd without SMTPUTF8", "postfix smtp-sink -8"])
def test_a_utf8_dsn_to_an_ascii_sender_goes_as_a_7bit_dsn_where_the_way_back_lacks_smtputf8(make_node, sink, back):
    """RFC 6533 3 (as Postfix and Exchange do): the sender is ASCII, so the DSN goes to a next hop
    without SMTPUTF8 (nor, for smtp-sink -8, 8BITMIME) as the classic 7-bit DSN: multipart/report
    with message/delivery-status naming the recipient in the utf-8 xtext form, the original's UTF-8
    headers quoted-printable in text/rfc822-headers, a Subject in RFC 2047 encoded-words. Before,
    it failed with 5.6.9 and was lost without a word."""
    hop = PerRecipientNextHop(smtputf8=False) if back.startswith("aiosmtpd") else None
    if hop is None:
        sink.start(("-8",))
    node, refusing = dsn_route_node(make_node, f"127.0.0.1:{hop.port}" if hop else sink.address)
    try:
        sender = "bob@sender.test"
        qid = send("127.0.0.1", node.port, sender, [REFUSED], utf8_message(sender=sender, to=REFUSED))
        fail = one(wait_for(lambda: node.tracking(event_id="FAIL"), timeout=15, what="the refusal"))
        assert fail["internal-message-id"] == str(qid) and " 5.1.1 " in fail["recipient-status"], fail
        dsn_row = one(wait_for(lambda: node.tracking(event_id="DSN"), timeout=10, what="the DSN"))
        sent = one(wait_for(lambda: node.tracking(event_id="SENDEXTERNAL"), timeout=15, what="the DSN sent back"))
        assert sent["network-message-id"] == dsn_row["network-message-id"], (sent, dsn_row)
        assert sent["recipient-address"] == sender and sent["recipient-status"].startswith("250"), sent
        assert sent["connector-id"] == f"smarthost:{node.sections['routing']['smart_host']}", sent
        if hop:
            [(options, raw)] = hop.messages
            assert "SMTPUTF8" not in options and raw.isascii(), options
        else:
            raw = one(sink.messages())
            assert raw.isascii() and b"SMTPUTF8" not in raw.split(b"\nReceived:", 1)[0]  # smtp-sink's X-Mail-Args
        assert all(len(line) <= 998 for line in raw.splitlines())
        dsn = email.message_from_bytes(raw, policy=email.policy.default)
        assert not dsn.defects
        assert dsn.get_content_type() == "multipart/report" and dsn.get_param("report-type") == "delivery-status"
        assert dsn["To"].addresses[0].addr_spec == sender and dsn["Subject"] == "Undeliverable: Grüße aus Köln"
        text, status, headers = dsn.get_payload()
        assert [text.get_content_type(), status.get_content_type(), headers.get_content_type()] == [
            "text/plain", "message/delivery-status", "text/rfc822-headers"]
        assert f"<{REFUSED}>" in text.get_content() and "550 5.1.1 No such user" in text.get_content()
        _, block = status.get_payload()
        xtext = "".join(c if c.isascii() else f"\\x{{{ord(c):X}}}" for c in REFUSED)
        assert block["Final-Recipient"] == f"utf-8; {xtext}", block["Final-Recipient"]
        assert (block["Action"], block["Status"]) == ("failed", "5.1.1")
        assert block["Diagnostic-Code"] == "smtp; 550 5.1.1 No such user"
        assert headers["Content-Transfer-Encoding"] == "quoted-printable"
        assert "Subject: Grüße aus Köln" in headers.get_payload(decode=True).decode("utf-8")
        assert "Undelivered" in headers["Content-Description"]
        assert "sent as a classic 7-bit DSN (RFC 3464)" in node.log()
        assert not node.tracking(event_id="FAIL", network_message_id=dsn_row["network-message-id"])
    finally:
        refusing.controller.stop()
        if hop:
            hop.controller.stop()


def test_a_dsn_to_a_utf8_sender_without_smtputf8_on_the_way_back_fails_once_and_is_logged(make_node):
    """The DSN to a non-ASCII sender cannot go through a next hop without SMTPUTF8 at all (RFC 6531
    3.4): it fails at once with 5.6.7 (a FAIL row, no retries, no DSN about the DSN), and a warning
    says that it is dropped."""
    hop = PerRecipientNextHop(smtputf8=False)
    node, refusing = dsn_route_node(make_node, f"127.0.0.1:{hop.port}")
    try:
        sender = "jürgen@sender.test"
        send("127.0.0.1", node.port, sender, [REFUSED], utf8_message(sender=sender, to=REFUSED))
        dsn_row = one(wait_for(lambda: node.tracking(event_id="DSN"), timeout=15, what="the DSN"))
        netid = dsn_row["network-message-id"]
        fail = one(wait_for(lambda: node.tracking(event_id="FAIL", network_message_id=netid), timeout=10,
                            what="the DSN failed"))
        assert fail["recipient-address"] == sender and " 5.6.7 " in fail["recipient-status"], fail
        node.wait_passes(3)
        assert len(node.tracking(event_id="FAIL")) == 2  # the original's and the DSN's, once each
        assert not node.tracking(event_id="DEFER") and len(node.tracking(event_id="DSN")) == 1
        assert not hop.messages and not hop.rcpts
        assert f"to {sender} could not be delivered and is dropped: 550 5.6.7" in node.log()
        assert not [m for m in node.cli_json("message", "list") if m["network_message_id"] == netid]
    finally:
        refusing.controller.stop()
        hop.controller.stop()


def test_8bit_body_to_a_next_hop_without_8bitmime_arrives_7bit_and_decodes_the_same(make_node, sink):
    """RFC 6152: Postfix's smtp-sink -8 does not offer 8BITMIME: the body is converted to
    quoted-printable (never sent 8-bit unannounced) and decodes to the same text."""
    sink.start(("-8",))
    node = make_node(smart_host=sink.address).start()
    data = (b"From: Bob <bob@example.test>\r\nTo: <carol@elsewhere.test>\r\nSubject: plain ascii subject\r\n"
            b"MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n"
            b"\r\n" + "Grüße aus Köln, ünïcödé ✓ = not an escape\r\n".encode() * 3)
    send("127.0.0.1", node.port, "bob@example.test", ["carol@elsewhere.test"], data, options=("BODY=8BITMIME",))
    stored = one(wait_for(sink.messages, timeout=10, what="the sink to receive it"))
    assert stored.isascii(), "8-bit data reached a next hop without 8BITMIME"
    assert b"Content-Transfer-Encoding: quoted-printable" in stored
    assert b"BODY=8BITMIME" not in stored.split(b"\nReceived:", 1)[0]  # smtp-sink's X-Mail-Args
    got = email.message_from_bytes(stored, policy=email.policy.default)
    want = email.message_from_bytes(data, policy=email.policy.default)
    # smtp-sink -d stores lines with LF endings (and a blank line at the end): compare the lines.
    assert got.get_content().rstrip("\r\n").splitlines() == want.get_content().rstrip("\r\n").splitlines()
    assert "Grüße aus Köln, ünïcödé ✓ = not an escape" in got.get_content()
    assert got["Subject"] == "plain ascii subject"


def test_a_nul_in_a_7bit_body_to_a_next_hop_without_8bitmime_is_converted(make_node, sink):
    """RFC 2045 2.7: 7bit data holds no NUL. A body with NULs but no 8-bit octet, to smtp-sink -8,
    arrives converted (quoted-printable, ``=00``), no NUL on the wire, and decodes the same."""
    sink.start(("-8",))
    node = make_node(smart_host=sink.address).start()
    data = (b"From: Bob <bob@example.test>\r\nTo: <carol@elsewhere.test>\r\nSubject: nul body\r\n"
            b"MIME-Version: 1.0\r\nContent-Type: text/plain; charset=us-ascii\r\n"
            b"\r\nbefore \x00 after\r\n\x00\x00\r\n")
    send("127.0.0.1", node.port, "bob@example.test", ["carol@elsewhere.test"], data, options=())
    stored = one(wait_for(sink.messages, timeout=10, what="the sink to receive it"))
    assert b"\0" not in stored, "a NUL reached a next hop without 8BITMIME"
    assert b"Content-Transfer-Encoding: quoted-printable" in stored and b"before =00 after" in stored
    got = email.message_from_bytes(stored, policy=email.policy.default)
    want = email.message_from_bytes(data, policy=email.policy.default)
    assert got.get_content().rstrip("\r\n").splitlines() == want.get_content().rstrip("\r\n").splitlines()


def test_8bit_headers_without_smtputf8_are_never_sent_to_a_7bit_next_hop(make_node, sink):
    """Raw 8-bit headers in a message received without SMTPUTF8 cannot be made 7-bit: the
    recipient fails with 5.6.3 (and a DSN) rather than 8-bit data being sent unannounced."""
    sink.start(("-8",))
    node = make_node(smart_host=sink.address).start()
    data = utf8_message(sender="bob@example.test", to="carol@elsewhere.test")
    send("127.0.0.1", node.port, "bob@example.test", ["carol@elsewhere.test"], data, options=("BODY=8BITMIME",))
    fail = one(wait_for(lambda: node.tracking(event_id="FAIL"), timeout=10, what="FAIL"))
    assert " 5.6.3 " in fail["recipient-status"]
    wait_for(lambda: node.maildir_files("bob@example.test"), timeout=10, what="the DSN to bob")
    assert not sink.messages()


def test_an_encoded_word_subject_is_tracked_and_listed_as_its_text_and_delivered_as_sent(make_node):
    """RFC 2047: most non-ASCII subjects travel as encoded-words. The tracking log's
    message-subject and the queue's subject hold the text they stand for (as Exchange's logs do,
    so a search by subject finds it); the message itself keeps the field byte for byte."""
    node = make_node().start()
    field = b"Subject: =?UTF-8?B?R3LDvMOfZQ==?= =?ISO-8859-1?Q?aus_K=F6ln?=\r\n"
    data = b"From: <bob@remote.test>\r\nTo: <alice@example.test>\r\n" + field + b"\r\nhi\r\n"
    send("127.0.0.1", node.port, "bob@remote.test", ["alice@example.test"], data)
    receive = one(wait_for(lambda: node.tracking(event_id="RECEIVE"), what="RECEIVE"))
    assert receive["message-subject"] == "Grüßeaus Köln", receive  # blanks between encoded-words go (RFC 2047 6.2)
    deliver = one(wait_for(lambda: node.tracking(event_id="DELIVER"), what="DELIVER"))
    assert deliver["message-subject"] == receive["message-subject"]
    found = node.cli_json("tracking", "search", "--subject", "KÖLN")  # anywhere, in any case: -MessageSubject
    assert {r["event-id"] for r in found} >= {"RECEIVE", "DELIVER"}, found
    assert node.cli_json("tracking", "search", "--subject", "Köln!") == []
    [stored] = wait_for(lambda: node.maildir_files("alice@example.test"), what="the mailbox copy")
    assert field in stored.read_bytes()
