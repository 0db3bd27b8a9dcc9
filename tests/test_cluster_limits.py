"""The frontend's limits and the boundary's: what a node acknowledged must fit inside the boundary.

A message the frontend takes at frontend.max_message_size or with frontend.max_hop_count
Received fields gains the headers of the nodes it passes (a Received field each, Message-ID and
Date where missing). Its shadow copy and its hop-by-hop relay to a peer must still be taken,
or the sender, who got a 250, gets an NDR (or, under RejectMessageOnShadowFailure, a 451 on
every try). Real node processes: a 2-node cluster (node1 holds MDB01, so node2 relays
alice@example.test to node1 hop by hop and shadows on node1).
"""

from __future__ import annotations

import re
import smtplib

from clusters import LOCAL, auth_plain, fqdn, one, reply, smtp
from conftest import wait_for

MAX_SIZE = 100_000
SENDER = "zed@example.test"  # an NDR would land in its mailbox on node1


def message_of(size: int, subject: str, head: bytes = b"") -> bytes:
    """A message of exactly ``size`` octets (CRLFs counted, as SIZE counts them), lines of 78."""
    text = head + f"From: {SENDER}\r\nSubject: {subject}\r\n\r\n".encode()
    lines, n = [], size - len(text)
    while n > 0:
        take = min(n, 80) if n - 80 >= 3 or n <= 80 else n - 3
        lines.append(b"y" * (take - 2) + b"\r\n")
        n -= take
    out = text + b"".join(lines)
    assert len(out) == size, len(out)
    return out


def send(node, data: bytes, size: int | None = None) -> tuple[int, str]:
    """One message to ``node``'s frontend from a trusted client (127.0.0.1): the reply to DATA."""
    with smtplib.SMTP(node.host, node.frontend_port, local_hostname="client.example", timeout=30) as s:
        s.ehlo("client.example")
        code, msg = s.mail(SENDER, [f"SIZE={size}"] if size is not None else [])
        assert code == 250, (code, msg)
        code, msg = s.rcpt(LOCAL)
        assert code == 250, (code, msg)
        code, msg = s.data(data)
        return code, msg.decode("utf-8", "replace")


def netid_of_reply(node, text: str) -> str:
    qid = re.search(r"queued as (\d+)", text).group(1)
    return one(node.tracking(event_id="RECEIVE", internal_message_id=qid), "RECEIVE")["network-message-id"]


def delivered_on_node1(node1, netid: str) -> bytes:
    wait_for(lambda: node1.tracking(event_id="DELIVER", network_message_id=netid), timeout=15,
             what="node1 to deliver the message relayed hop by hop")
    files = [p for p in node1.maildir(LOCAL) if f".{netid}." in p.name]
    assert len(files) == 1, files
    return files[0].read_bytes()


def assert_no_ndr(node1, node2, netid: str) -> None:
    for n in (node1, node2):
        assert not n.tracking(event_id="FAIL", network_message_id=netid), n.log()[-4000:]
        assert not n.tracking(event_id="HAREDIRECTFAIL", network_message_id=netid), n.log()[-4000:]
    assert not node1.maildir(SENDER), "an NDR went to the sender"


def test_a_message_at_the_size_limit_is_shadowed_and_relayed_inside_the_boundary(cluster):
    """frontend.max_message_size = 100000; a client declares SIZE=99950 and sends 99,950 octets to
    node2 for a mailbox on node1. node2's Received, Message-ID and Date make it larger than the
    limit: node1's transport connector takes it from an authenticated peer all the same (64 KiB
    allowance), as the shadow copy (HAREDIRECT, under RejectMessageOnShadowFailure: a refused copy
    would be a 451) and as the hop-by-hop relay (delivered, no NDR). A client on the transport
    connector that is no peer is held to the limit exactly; a peer's EHLO after AUTH shows its own."""
    c = cluster(nodes=2, sites=2, overrides={
        "frontend": {"max_message_size": MAX_SIZE},
        "shadow_redundancy": {"reject_message_on_shadow_failure": True}}).start()
    node1, node2 = c["node1"], c["node2"]
    size = MAX_SIZE - 50
    code, text = send(node2, message_of(size, "at the limit"), size)
    assert code == 250, (code, text)
    netid = netid_of_reply(node2, text)
    redirect = one(node2.tracking(event_id="HAREDIRECT", network_message_id=netid), "HAREDIRECT on node2")
    assert redirect["source-context"].startswith(f"{node1.name}=250 2.6.0"), redirect
    body = delivered_on_node1(node1, netid)
    assert len(body) > MAX_SIZE and b"Subject: at the limit" in body
    assert_no_ndr(node1, node2, netid)
    # One octet over at the frontend is still refused, SIZE= or not.
    with smtplib.SMTP(node2.host, node2.frontend_port, timeout=10) as s:
        s.ehlo("client.example")
        assert s.esmtp_features["size"] == str(MAX_SIZE)
        assert s.mail(SENDER, [f"SIZE={MAX_SIZE + 1}"])[0] == 552
    code, text = send(node2, message_of(MAX_SIZE + 1, "over"))
    assert code == 552, (code, text)

    # The transport connector: a client that is no peer gets the frontend's limit exactly.
    s = smtp(node1.transport_host, node1.transport_port)
    assert s.esmtp_features["size"] == str(MAX_SIZE)
    assert reply(s, f"MAIL FROM:<{SENDER}> SIZE={MAX_SIZE + 1}")[0] == 552
    assert reply(s, "RSET")[0] == 250
    assert auth_plain(s, fqdn("node2"), c.secret)[0] == 235
    assert reply(s, f"MAIL FROM:<{SENDER}> SIZE={MAX_SIZE + 1000}")[0] == 250
    assert reply(s, "RSET")[0] == 250
    assert reply(s, f"MAIL FROM:<{SENDER}> SIZE={MAX_SIZE + 64 * 1024 + 1}")[0] == 552
    s.ehlo("node2.again")
    assert s.esmtp_features["size"] == str(MAX_SIZE + 64 * 1024)
    s.quit()


def received_fields(n: int) -> bytes:
    return b"".join(b"Received: from hop%d.remote.test by relay%d.remote.test; Sat, 28 Nov 2026 12:00:00 +0000\r\n"
                    % (i, i) for i in range(n))


def test_a_message_with_max_hop_count_received_fields_is_relayed_inside_the_boundary(cluster):
    """frontend.max_hop_count (60): a message that comes with 60 Received fields is taken by
    node2's frontend; with node2's own field it has 61 when node2 relays it to node1 hop by hop
    and shadows it there. node1 takes both from its authenticated peer (one more field per node
    of the boundary) and delivers: no 554 5.4.14, no NDR. 61 at the frontend is still a loop."""
    c = cluster(nodes=2, sites=2).start()
    node1, node2 = c["node1"], c["node2"]
    code, text = send(node2, received_fields(60) + b"Subject: sixty hops\r\n\r\nhi\r\n")
    assert code == 250, (code, text)
    netid = netid_of_reply(node2, text)
    one(node2.tracking(event_id="HAREDIRECT", network_message_id=netid), "HAREDIRECT on node2")
    body = delivered_on_node1(node1, netid)
    assert body.count(b"Received:") == 62  # the client's 60, node2's, node1's
    assert_no_ndr(node1, node2, netid)
    code, text = send(node2, received_fields(61) + b"Subject: sixty-one hops\r\n\r\nhi\r\n")
    assert (code, text) == (554, "5.4.14 Hop count exceeded - possible mail loop"), (code, text)


def test_a_routing_loop_between_peers_is_still_stopped(cluster):
    """Each node takes the other for MDB01's: alice's message goes back and forth hop by hop,
    one Received field more each time. The peers' allowance (one field per node of the
    boundary) is finite: past max_hop_count (3 here) + 2 a node refuses it, 554 5.4.14, and the
    loop ends (the sender, inside the boundary, gets an NDR)."""
    c = cluster(nodes=2, sites=2, overrides={"frontend": {"max_hop_count": 3}})
    c["node1"].set("mailbox_databases", "MDB01", fqdn("node2"))
    c.start()
    node1, node2 = c["node1"], c["node2"]
    code, text = send(node2, b"Subject: looping\r\n\r\nround and round\r\n")
    assert code == 250, (code, text)
    netid = netid_of_reply(node2, text)

    def refused() -> list[dict]:
        return [r for n in (node1, node2) for r in n.tracking(event_id="FAIL", network_message_id=netid)]
    fail = one(wait_for(refused, timeout=30, what="the loop to be refused"), "FAIL")
    assert "5.4.14" in fail["recipient-status"], fail
    looped = [n for n in (node1, node2) if "looped (6 Received headers)" in n.log()]
    assert looped, "the refusal names the hop count past max_hop_count + 2 nodes"
