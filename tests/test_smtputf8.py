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
from conftest import TransportdSink, wait_for

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
    deliver = one(node1.tracking(event_id="DELIVER", network_message_id=netid))
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
