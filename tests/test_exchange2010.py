"""Shadow redundancy version 2010 (``shadow_redundancy.version = "2010"``) with real processes.

The 2010 seed (shared/reference/shadow-redundancy-exchange-2010.txt): the transport connector
advertises XSHADOW, not XSHADOWREQUEST; a sender that cannot keep a shadow (any frontend client)
gets its 250 only once the message reached its next hops (delayed acknowledgement), at
*MaxAcknowledgementDelay* at the latest, or at once where the seed bypasses it (target queue in
Retry); a primary is declared failed after *ShadowHeartbeatRetryCount* heartbeat time-outs of
*ShadowHeartbeatTimeoutInterval*; 2013-mode nodes in the same cluster place their shadows on
2013 peers only. Postfix's smtp-sink is the next hop outside the boundary.
"""

from __future__ import annotations

import base64
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
from clusters import FOREIGN, LOCAL, auth_plain, invoke, netid_of, one, reply, smtp
from conftest import free_port, queued_id, swaks, wait_for
from helpers import backlog, scrape, value

from transportd.queue.routing import SMART_HOST, NextHop

V2010 = {"shadow_redundancy": {"version": "2010"}}


def node2010(make_node, smart_host: str, **frontend):
    port = free_port()
    return make_node(smart_host=smart_host, overrides={
        "shadow_redundancy": {"shadow_redundancy_enabled": True, "version": "2010"},
        "frontend": frontend, "metrics": {"listen": f"127.0.0.1:{port}"},
        "delivery": {"send_connect_timeout": 30}}), port


class SilentNextHop:
    """A listener that accepts TCP connections and never says a word (no SMTP greeting)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(50)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


def mid_of(node, qid: int) -> str:
    """The Message-ID of a message a node received (its RECEIVE row; 2010-format rows carry no
    network-message-id, so rows are found by internal id on the node and by Message-ID elsewhere)."""
    return one(node.tracking(event_id="RECEIVE", internal_message_id=str(qid)))["message-id"]


def timed_swaks(port: int, *args: str, server: str = "127.0.0.1") -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    res = swaks(port, "--from", "zed@example.test", *args, timeout=90, server=server)
    return res, time.monotonic() - t0


def test_2010_transport_connector_offers_xshadow_and_takes_no_shadow_request(cluster, sink):
    c = cluster(overrides=V2010, nodes=2, sites=1).start()
    node1, node2 = c["node1"], c["node2"]
    s = smtp(node1.transport_host, node1.transport_port, helo=node2.name)
    try:
        assert s.has_extn("xshadow") and not s.has_extn("xshadowrequest")
        assert auth_plain(s, node2.name, c.secret)[0] == 235
        code, text = reply(s, f"XSHADOWREQUEST {node2.name} bm90LWEtZGJpZA==")
        assert code == 502, text
        code, text = reply(s, "XSHADOW " + base64.b64encode(node2.name.encode()).decode())
        assert code == 250, text
        code, text = reply(s, "XQUERYDISCARD 10")  # Exchange 2010's name of XQDISCARD
        assert (code, text) == (251, "OK, no discard events")
    finally:
        s.close()


def test_a_local_part_that_begins_xshadow_is_a_plain_sender_on_the_transport_connector(cluster, sink):
    """``xshadow=bob`` is a legal local part (RFC 5321 4.1.2's atext holds '='): only an ``XSHADOW=``
    among MAIL's parameters is the shadow redundancy one. Such a sender was refused 550 5.7.1 to a
    client that is no peer, 503 to a peer before XSHADOW and 451 (an internal error) after it."""
    c = cluster(overrides=V2010, nodes=2, sites=1).start("node1")
    node1, node2 = c["node1"], c["node2"]
    guid = "11111111-2222-4333-8444-555555555555"
    s = smtp(node1.transport_host, node1.transport_port)
    try:
        assert reply(s, "MAIL FROM:<xshadow=bob@b.test>")[0] == 250
        assert reply(s, "RSET")[0] == 250
        assert reply(s, f"MAIL FROM:<bob@b.test> XSHADOW={guid}")[0] == 550  # the parameter: peers only
    finally:
        s.close()
    s = smtp(node1.transport_host, node1.transport_port, helo=node2.name)
    try:
        assert auth_plain(s, node2.name, c.secret)[0] == 235
        assert reply(s, "MAIL FROM:<xshadow=bob@b.test>")[0] == 250
        assert reply(s, "RSET")[0] == 250
        assert reply(s, "XSHADOW " + base64.b64encode(node2.name.encode()).decode())[0] == 250
        assert reply(s, 'MAIL FROM:<"xshadow=x XSHADOW=y"@b.test>')[0] == 250  # a quoted local part too
        assert reply(s, "RSET")[0] == 250
        assert reply(s, "MAIL FROM:<xshadow=bob@b.test>")[0] == 250
        assert reply(s, f"RCPT TO:<{LOCAL}>")[0] == 250
        code, text = s.data(b"Subject: xshadow local part\r\n\r\nhi\r\n")
        assert code == 250, text
    finally:
        s.close()
    row = one(node1.tracking(event_id="RECEIVE"))
    assert row["sender-address"] == "xshadow=bob@b.test", row
    assert "AssertionError" not in node1.log()


def test_delayed_ack_waits_for_the_next_hop_then_answers(make_node, sink):
    sink.start()
    node, mport = node2010(make_node, sink.address, max_acknowledgement_delay=20)
    node.start()
    res, took = timed_swaks(node.port, "--to", "carol@elsewhere.test", "--header", "Subject: held ack")
    queued_id(res)
    # The 250 came after the sink had it: it is there the moment swaks returns.
    assert [m for m in sink.messages() if b"Subject: held ack" in m]
    assert took < 20
    samples = scrape("127.0.0.1", mport)
    assert value(samples, "transportd_acknowledgement_delay_seconds_count", reason="Delivered") == 1
    assert "acknowledged after" in node.log_path.read_text()
    agentinfo = [line for f in (node.data_dir / "msgtrk").glob("MSGTRK*.LOG")
                 for line in f.read_text(encoding="utf-8-sig").splitlines() if ",AGENTINFO," in line]
    assert len(agentinfo) == 1 and "S:Reason=Delivered" in agentinfo[0] and "DelayedAcknowledgement" in agentinfo[0]
    # tracking.format auto: a 2010-mode node writes Exchange 2010's 26 fields (no network-message-id).
    from transportd.tracking import FIELDS_2010
    header = next((node.data_dir / "msgtrk").glob("MSGTRK*.LOG")).read_text(encoding="utf-8-sig")
    assert "#Fields: " + ",".join(FIELDS_2010) in header.splitlines()


def test_delayed_ack_with_a_silent_next_hop_answers_at_max_acknowledgement_delay(make_node, sink):
    silent = SilentNextHop()
    try:
        node, mport = node2010(make_node, silent.address, max_acknowledgement_delay=3)
        node.start()
        res, took = timed_swaks(node.port, "--to", "carol@elsewhere.test")
        queued_id(res)
        assert 3 <= took < 10, took
        samples = scrape("127.0.0.1", mport)
        assert value(samples, "transportd_acknowledgement_delay_seconds_count",
                     reason="MaxAcknowledgementDelay") == 1
    finally:
        silent.close()


def test_delayed_ack_is_bypassed_when_the_target_queue_is_in_retry(make_node):
    closed = free_port()  # nothing listens: the first attempt fails at once, the queue enters Retry
    node, mport = node2010(make_node, f"127.0.0.1:{closed}", max_acknowledgement_delay=30)
    node.start()
    res, took = timed_swaks(node.port, "--to", "carol@elsewhere.test")
    queued_id(res)
    assert took < 15, took
    samples = scrape("127.0.0.1", mport)
    assert value(samples, "transportd_acknowledgement_delay_seconds_count", reason="QueueRetry") == 1


def test_kill_before_the_held_250_the_sender_retries_elsewhere_and_the_message_arrives_once(make_node, sink):
    """The point of the design: a node that dies before its 250 leaves the sender holding the message."""
    sink.start()
    silent = SilentNextHop()
    try:
        doomed, _ = node2010(make_node, silent.address, max_acknowledgement_delay=30)
        doomed.start()
        proc = subprocess.Popen(["swaks", "--server", "127.0.0.1", "--port", str(doomed.port), "--from",
                                 "zed@example.test", "--to", "carol@elsewhere.test", "--header",
                                 "Subject: retried elsewhere"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        wait_for(lambda: ",RECEIVE," in "".join(p.read_text(encoding="utf-8-sig")
                                               for p in (doomed.data_dir / "msgtrk").glob("MSGTRK*.LOG")),
                 timeout=15, what="the message durable on the doomed node")
        doomed.kill9()
        out, _ = proc.communicate(timeout=30)
        assert not re.search(r"<- {1,2}250 2\.0\.0 Ok: queued", out), out  # no 250: the sender still has it
        assert proc.returncode != 0
    finally:
        silent.close()
    backup = make_node("node2", smart_host=sink.address, overrides={
        "shadow_redundancy": {"shadow_redundancy_enabled": True, "version": "2010"}}).start()
    queued_id(swaks(backup.port, "--from", "zed@example.test", "--to", "carol@elsewhere.test", "--header",
                    "Subject: retried elsewhere"))
    assert len([m for m in sink.messages() if b"Subject: retried elsewhere" in m]) == 1


def test_2010_heartbeat_declares_a_primary_failed_after_retry_count_time_outs(cluster, sink):
    """Interval 1 s, retry count 3: node3 keeps its hop-by-hop copy of a message node1 holds; node1
    dies; node3 promotes after three failed polls (~3 s after the last contact), not before."""
    sink.start()
    c = cluster(overrides={"shadow_redundancy": {"version": "2010", "shadow_heartbeat_timeout_interval": 1,
                                                 "shadow_heartbeat_retry_count": 3,
                                                 "shadow_resubmit_time_span": 3600}}).start()
    node1, node3 = c["node1"], c["node3"]
    queued_id(node1.swaks(LOCAL))  # creates node1's mailbox:MDB01 queue, then it is held
    wait_for(lambda: len(node1.maildir(LOCAL)) == 1, timeout=10, what="the first delivery on node1")
    invoke("queue", "suspend", "mailbox:MDB01", "--config", node1.config)
    mid = mid_of(node3, queued_id(node3.swaks(LOCAL, "--header", "Subject: held on node1")))
    wait_for(lambda: node1.tracking(event_id="RECEIVE", message_id=mid), timeout=10,
             what="node1 primary for node3's message")
    node3.wait_heartbeats(node1.name, 2, timeout=15)
    node1.proc.kill()
    node1.proc.wait(10)
    killed = time.time()
    last_ok = node3.last_heartbeat_at(node1.name)
    resubmit = one(wait_for(lambda: node3.tracking(event_id="RESUBMIT", message_id=mid), timeout=30,
                            what="node3 promotes its copy"))
    from transportd.tracking import parse_datetime
    promoted = parse_datetime(resubmit["date-time"]).timestamp()
    assert promoted - last_ok >= 3 * 1.0 - 0.3, (promoted - last_ok, promoted - killed)
    assert promoted - killed < 10
    assert "ShadowHeartbeatFailure" in resubmit["source-context"] or "3 in a row" in node3.log()


def test_mixed_cluster_2013_nodes_place_shadows_on_2013_peers_only(cluster, sink):
    sink.start()
    c = cluster()
    c["node1"].set("shadow_redundancy", "version", "2010")
    c.start()
    node1, node2, node3 = c["node1"], c["node2"], c["node3"]
    for i in range(6):
        netid = netid_of(node3, queued_id(node3.swaks(FOREIGN, "--header", f"Subject: mixed {i}")))
        row = one(wait_for(lambda n=netid: node3.tracking(event_id="HAREDIRECT", network_message_id=n),
                           timeout=10, what="node3's shadow"))
        assert row["source-context"].startswith(node2.name), row
    assert "XSHADOWREQUEST" not in node1.log()  # never asked: the 2013 nodes read its EHLO
    # The 2010 node's own frontend: delayed ack, then hop by hop to node1's mailbox is its own.
    res = node1.swaks(FOREIGN, "--header", "Subject: from the 2010 node")
    queued_id(res)
    assert [m for m in sink.messages() if b"Subject: from the 2010 node" in m]


def test_shadow_redundancy_promotion_relays_to_a_same_site_node_before_the_250(cluster, sink):
    """promotion_enabled (2010 SP1): node1's next hop is down (queue in Retry), so instead of
    acknowledging at once it relays the message to node2 (same site), which takes it as primary
    while node1 keeps the shadow; then the 250. node1 killed right after it: nothing is lost."""
    sink.start()
    c = cluster(overrides={"shadow_redundancy": {"version": "2010", "promotion_enabled": True}},
                nodes=2, sites=1)
    c["node1"].set("routing", "smart_host", f"127.0.0.1:{free_port()}")  # nothing listens there
    c.start()
    node1, node2 = c["node1"], c["node2"]
    qid = queued_id(node1.swaks(FOREIGN, "--header", "Subject: promoted"))
    node1.proc.kill()
    node1.proc.wait(10)
    promoted = one(node1.tracking(event_id="HAREDIRECT", internal_message_id=str(qid)))
    assert promoted["source-context"] == f"ShadowRedundancyPromotion;QueueRetry;{node2.name}"
    assert one(node2.tracking(event_id="RECEIVE", message_id=mid_of(node1, qid)))["source-context"] == "transport"
    wait_for(lambda: [m for m in sink.messages() if b"Subject: promoted" in m], timeout=20,
             what="node2 delivers the promoted message")
    assert len([m for m in sink.messages() if b"Subject: promoted" in m]) == 1


def test_exchange_acceptance_reply_on_the_transport_connector(cluster, sink):
    """transport.exchange_acceptance_reply: a message node1 takes as primary (hop by hop from node3)
    is answered as an Exchange transport server answers it; node3 logs that reply on its SEND."""
    sink.start()
    c = cluster(overrides={"transport": {"exchange_acceptance_reply": True}}).start()
    node1, node3 = c["node1"], c["node3"]
    netid = netid_of(node3, queued_id(node3.swaks(LOCAL, "--header", "Subject: exchange reply")))
    send = one(wait_for(lambda: node3.tracking(event_id="SEND", network_message_id=netid), timeout=10,
                        what="node3's SEND to node1"))
    received = one(node1.tracking(event_id="RECEIVE", network_message_id=netid))
    status = send["recipient-status"]
    assert re.fullmatch(rf"250 2\.6\.0 {re.escape(received['message-id'])} \[InternalId="
                        rf"{received['internal-message-id']}, Hostname={re.escape(node1.name)}\] "
                        r"Queued mail for delivery", status), status
    # The frontend keeps the classic reply.
    assert "250 2.0.0 Ok: queued as" in node1.swaks(FOREIGN).stdout


# ------------------------------------------------------------------------------ the seed's bypass table

@pytest.mark.parametrize("promotion", [False, True], ids=["skip", "promotion"])
@pytest.mark.parametrize("bypass", ["QueueSuspended", "QueueLength"])
def test_bypass_table_row_in_both_behaviours(cluster, sink, bypass, promotion):
    """A target queue suspended, or holding more than 100 messages: node1 (2010) does not hold the
    250. Skip (default): acknowledged at once, the message stays on node1. Promotion (SP1):
    relayed first to node2 (same site), which delivers it; node1 killed after the 250 loses nothing."""
    sink.start()
    c = cluster(overrides={"shadow_redundancy": {"version": "2010", "promotion_enabled": promotion},
                           "frontend": {"max_acknowledgement_delay": 60}}, nodes=2, sites=1)
    node1, node2 = c["node1"], c["node2"]
    if bypass == "QueueLength":
        silent = SilentNextHop()  # node1's smart host never answers: its queue only grows (closed at exit)
        node1.set("routing", "smart_host", silent.address)
        node1.set("delivery", "send_connect_timeout", 120)
        backlog(Path(node1.cfg.db_path), [NextHop(f"smarthost:{silent.address}", SMART_HOST, silent.address)], 101)
        c.start()
    else:
        c.start()
        queued_id(node1.swaks(FOREIGN, "--header", "Subject: first"))  # makes the queue; delivered
        wait_for(lambda: [m for m in sink.messages() if b"Subject: first" in m], timeout=15, what="the first")
        invoke("queue", "suspend", f"smarthost:{sink.address}", "--config", node1.config)
    res, took = timed_swaks(node1.frontend_port, "--to", FOREIGN, "--header", f"Subject: {bypass}",
                            server=node1.host)
    qid = queued_id(res)
    assert took < 30, took  # not held for MaxAcknowledgementDelay (60 s)
    agentinfo = one(node1.tracking(event_id="AGENTINFO", internal_message_id=str(qid)))
    if not promotion:
        assert agentinfo["custom-data"].endswith(f"S:Reason={bypass}"), agentinfo
        assert not node1.tracking(event_id="HAREDIRECT", internal_message_id=str(qid))
        assert not node2.tracking(event_id="RECEIVE", message_id=mid_of(node1, qid))
        return
    assert agentinfo["custom-data"].endswith("S:Reason=Promoted:Delivered"), agentinfo
    row = one(node1.tracking(event_id="HAREDIRECT", internal_message_id=str(qid)))
    assert row["source-context"] == f"ShadowRedundancyPromotion;{bypass};{node2.name}"
    node1.proc.kill()
    node1.proc.wait(10)
    wait_for(lambda: [m for m in sink.messages() if f"Subject: {bypass}".encode() in m], timeout=20,
             what="node2 delivers the promoted message")


def test_a_promoted_message_whose_target_dies_goes_to_its_own_next_hop(cluster, sink):
    """Shadow redundancy promotion (2010 SP1) relayed node1's message to node2 (node1's smart host
    queue in Retry: the sink is down); node2 dies before delivering it. After
    *ShadowHeartbeatRetryCount* failed polls node1 resubmits its hop-by-hop copy, routed again as a
    new message's: to the smart host, not to the dead node2 (the seed: "Resubmitted messages are
    delivered to another ... server")."""
    c = cluster(overrides={"shadow_redundancy": {"version": "2010", "promotion_enabled": True,
                                                 "shadow_heartbeat_timeout_interval": 1,
                                                 "shadow_heartbeat_retry_count": 3,
                                                 "shadow_resubmit_time_span": 3600},
                           "frontend": {"max_acknowledgement_delay": 60}}, nodes=2, sites=1).start()
    node1, node2 = c["node1"], c["node2"]
    qid = queued_id(node1.swaks(FOREIGN, "--header", "Subject: promoted, then lost"))
    mid = mid_of(node1, qid)
    row = one(node1.tracking(event_id="HAREDIRECT", internal_message_id=str(qid)))
    assert row["source-context"] == f"ShadowRedundancyPromotion;QueueRetry;{node2.name}"
    wait_for(lambda: node2.tracking(event_id="RECEIVE", message_id=mid), timeout=10, what="node2 primary")

    node2.proc.kill()
    node2.proc.wait(10)
    resubmit = one(wait_for(lambda: node1.tracking(event_id="RESUBMIT", message_id=mid), timeout=30,
                            what="node1 resubmits its copy"))
    assert resubmit["source-context"] == f"{node2.name} (ShadowHeartbeatFailure)", resubmit
    sink.start()
    wait_for(lambda: [m for m in sink.messages() if b"Subject: promoted, then lost" in m], timeout=20,
             what="node1 sends its resubmitted copy to the smart host")
    sent = one(wait_for(lambda: node1.tracking(event_id="SENDEXTERNAL", message_id=mid), timeout=10,
                        what="node1's SENDEXTERNAL row"))
    assert sent["recipient-address"] == FOREIGN, sent
    assert len([m for m in sink.messages() if b"Subject: promoted, then lost" in m]) == 1
