"""Shadow redundancy failover on a real 3-node, 2-site cluster (docs/PROTOCOL.md sections 2-4).

node1 and node2 are in site-a, node3 in site-b, so with PreferRemote every shadow made by node1
or node2 lands on node3. Each test kills or restarts a primary at a chosen moment and checks, from
the tracking logs (``transportd tracking search --json``), the smtp-sink's files and the Maildirs,
what the shadow does about it:

1. primary killed (-9) with the message queued: promotion after ShadowResubmitTimeSpan
   (ShadowHeartbeatFailure) and exactly one delivery;
2. primary restarted with a fresh queue database: promotion at once (ShadowStateChange);
3. primary comes back with its database after the shadow was promoted: the mailbox store drops
   the second copy (DUPLICATEDELIVER), one file in the Maildir;
4. discard events are persisted: a primary restarted after delivery still answers XQDISCARD;
5. primary killed after delivering but before the shadow heard of it: the promoted copy is sent
   again (at-least-once, as Exchange documents).

Where a test needs the shadow not to poll the primary during some window, it stops the shadow
node (its shadow state lives in its queue database) instead of relying on heartbeat timing.

The harness (``LocalCluster``, ``FailoverNode``, ``send`` ...) is in clusters.py, the
``make_cluster`` fixture in conftest.py.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import sqlite3
import time
from pathlib import Path

from clusters import (
    FOREIGN,
    ClusterNode,
    FailoverNode,
    LocalCluster,
    accepted_with_shadow,
    netid_of,
    send,
    sink_copies,
)
from conftest import queued_id, wait_for
from helpers import PerRecipientNextHop

# LocalCluster, accepted_with_shadow and send are also imported from this module by
# test_metrics.py (not ours to edit): kept importable here until it imports them from clusters.
__all__ = ["LocalCluster", "accepted_with_shadow", "send"]


def shadow_guid(shadow: FailoverNode, primary: FailoverNode, netid: str) -> str:
    rows = [r for r in shadow.cli_json("shadow", "show", primary.name, "--all") if r["network_message_id"] == netid]
    assert len(rows) == 1, rows
    return rows[0]["shadow_guid"]


# ------------------------------------------------------------------------------ 1

def test_primary_killed_with_message_queued_shadow_promotes_after_resubmit_span(make_cluster, sink):
    c = make_cluster(heartbeat=0.5, resubmit=3)  # ceil(3 / 0.5) = 6 failed heartbeats
    c.start()
    n1, n3 = c["node1"], c["node3"]
    mid = send(n1, "carol@foreign.test")
    netid = accepted_with_shadow(n1, n3, mid)
    # The smart host (sink) is down: node1 keeps the message queued.
    n1.wait_event("DEFER", netid)
    assert n3.shadow_list()[n1.name]["shadows"] == 1

    n1.kill9()
    killed = time.monotonic()
    sink.start()
    n3.wait_event("RESUBMIT", netid, timeout=20)
    promoted_after = time.monotonic() - killed
    # Six failures in a row 0.5 s apart: not at the first failed heartbeat.
    assert promoted_after >= 2.0, f"promoted {promoted_after:.1f}s after the primary died"

    wait_for(lambda: sink_copies(sink, netid), timeout=20, what="promoted copy at the sink")
    rows = n3.tracking(event_id="RESUBMIT", network_message_id=netid)
    assert len(rows) == 1, rows
    assert rows[0]["source"] == "REDUNDANCY"
    assert rows[0]["source-context"] == f"{n1.name} (ShadowHeartbeatFailure)"
    # As Exchange: the shadow copy is discarded as resubmitted, and the RESUBMIT row's reference
    # is the internal id of the copy it was made from (node3's HARECEIVE).
    received = n3.tracking(event_id="HARECEIVE", network_message_id=netid)
    assert len(received) == 1, received
    assert rows[0]["reference"] == received[0]["internal-message-id"]
    discarded = n3.tracking(event_id="HADISCARD", network_message_id=netid)
    assert [d["source-context"].split(";")[0] for d in discarded] == ["Resubmitted"], discarded
    assert discarded[0]["internal-message-id"] == received[0]["internal-message-id"]
    assert discarded[0]["source-context"] == f"Resubmitted;{received[0]['source-context']}"
    original = n1.tracking(event_id="HAREDIRECT", network_message_id=netid)
    assert len(original) == 1 and original[0]["network-message-id"] == rows[0]["network-message-id"]
    sent = n3.tracking(event_id="SENDEXTERNAL", network_message_id=netid)
    assert len(sent) == 1 and sent[0]["recipient-address"] == "carol@foreign.test", sent
    # As Exchange writes a send row: the sending server in client-hostname, the next hop in server-hostname.
    assert sent[0]["client-hostname"] == n3.name and sent[0]["server-hostname"] == sent[0]["server-ip"] != "", sent
    assert not n1.tracking(event_id="SENDEXTERNAL", network_message_id=netid)
    assert n3.shadow_list()[n1.name]["shadows"] == 0

    # Waiting for absence (nothing to observe): node1 stays dead, nothing else may arrive.
    time.sleep(1.5)
    assert len(sink_copies(sink, netid)) == 1
    assert len(sink.messages()) == 1


# ------------------------------------------------------------------------------ 2

def test_primary_restarted_with_new_database_promotes_at_once(make_cluster, sink):
    # A resubmit span of 60 s: only a changed queue database ID can explain a promotion.
    c = make_cluster(heartbeat=0.5, resubmit=60)
    c.start()
    n1, n3 = c["node1"], c["node3"]
    mid = send(n1, "carol@foreign.test")
    netid = accepted_with_shadow(n1, n3, mid)
    n1.wait_event("DEFER", netid)
    old_dbid = wait_for(lambda: n3.shadow_list().get(n1.name, {}).get("queue_database_id"),
                        what="node3 recorded node1's queue database ID")

    n1.kill9()
    shutil.rmtree(n1.spec.data_dir)
    n1.start()
    restarted = time.monotonic()
    n3.wait_event("RESUBMIT", netid, timeout=15)
    assert time.monotonic() - restarted < 15

    rows = n3.tracking(event_id="RESUBMIT", network_message_id=netid)
    assert len(rows) == 1, rows
    assert rows[0]["source"] == "REDUNDANCY"
    assert rows[0]["source-context"] == f"{n1.name} (ShadowStateChange)"
    discarded = n3.tracking(event_id="HADISCARD", network_message_id=netid)
    assert [d["source-context"].split(";")[0] for d in discarded] == ["Resubmitted"], discarded
    ctx = wait_for(lambda: (c := n3.shadow_list()[n1.name])["queue_database_id"] not in (None, old_dbid) and c,
                   timeout=5, what="node3 to record node1's new queue database ID")
    assert ctx["shadows"] == 0
    # The promoted copy, queued (the sink is down), is made redundant again on another peer.
    again = n3.wait_event("HAREDIRECT", netid, timeout=10)
    assert again[0]["source-context"].split("=")[0] in (n1.name, c["node2"].name), again
    assert "failed unexpectedly" not in n3.log()

    sink.start()
    wait_for(lambda: sink_copies(sink, netid), timeout=20, what="promoted copy at the sink")
    # the SENDEXTERNAL row is written once the sink's reply is read, after the sink has the copy
    sent = wait_for(lambda: n3.tracking(event_id="SENDEXTERNAL", network_message_id=netid), timeout=10,
                    what="node3's SENDEXTERNAL row")
    assert len(sent) == 1, sent
    # Waiting for absence (nothing to observe): no second copy, the new node1 knows nothing of it.
    time.sleep(1.5)
    assert len(sink_copies(sink, netid)) == 1  # the new node1 knows nothing of it
    assert not n1.tracking(network_message_id=netid)


# ------------------------------------------------------------------------------ 3

def test_primary_back_with_same_database_after_promotion_mailbox_keeps_one_copy(make_cluster):
    c = make_cluster(heartbeat=0.5, resubmit=3)
    c.start()
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]
    queue = f"peer:{n1.name}"

    # Warm-up: creates node2's queue to node1 (a queue exists only once a message used it), and
    # lets the whole hop-by-hop chain settle so only alice's message is in flight later.
    warm = accepted_with_shadow(n2, n3, send(n2, "bob@example.test"))
    n1.wait_event("DELIVER", warm)
    n3.wait_event("HADISCARD", warm)
    n2.cli("queue", "suspend", queue)

    mid = send(n2, "alice@example.test")
    netid = accepted_with_shadow(n2, n3, mid)
    q = wait_for(lambda: [r for r in n2.cli_json("queue", "list") if r["identity"] == queue
                          and r["message_count"] >= 1], what="alice's message in node2's suspended queue")
    assert "suspend" in q[0]["state"].lower(), q
    # Waiting for absence (nothing to observe): the suspended queue sends nothing to node1.
    time.sleep(0.5)
    assert not n1.events("DELIVER", netid) and not n1.maildir("alice@example.test")

    n2.kill9()
    rows = n3.wait_event("RESUBMIT", netid, timeout=20)
    assert rows[0]["source-context"] == f"{n2.name} (ShadowHeartbeatFailure)"
    delivered = n1.wait_event("DELIVER", netid, timeout=20)
    assert delivered[0]["recipient-address"] == "alice@example.test"
    assert len(n1.maildir("alice@example.test")) == 1

    n2.start()  # same queue database: the queue is still suspended
    n2.cli("queue", "resume", queue)
    n1.wait_event("DUPLICATEDELIVER", netid, timeout=20)
    n2.wait_event("SEND", netid, timeout=10)

    dup = n1.tracking(event_id="DUPLICATEDELIVER", network_message_id=netid)
    assert len(dup) == 1 and dup[0]["recipient-address"] == "alice@example.test", dup
    assert len(n1.tracking(event_id="DELIVER", network_message_id=netid)) == 1
    resubmit = n3.tracking(event_id="RESUBMIT", network_message_id=netid)
    assert len(resubmit) == 1 and resubmit[0]["source"] == "REDUNDANCY", resubmit
    files = n1.maildir("alice@example.test")
    assert len(files) == 1, files
    assert netid in files[0].name


# ------------------------------------------------------------------------------ 4

def test_discard_events_survive_a_primary_restart(make_cluster, sink):
    c = make_cluster(heartbeat=0.5, resubmit=60)
    c.start()
    n1, n3 = c["node1"], c["node3"]
    mid = send(n1, "carol@foreign.test")
    netid = accepted_with_shadow(n1, n3, mid)
    guid = shadow_guid(n3, n1, netid)
    n1.wait_event("DEFER", netid)

    # node3 is down while node1 delivers and restarts: only the restarted node1 can tell it.
    assert n3.stop() == 0
    sink.start()
    n1.wait_event("SENDEXTERNAL", netid, timeout=15)
    assert n1.stop() == 0
    n1.start()
    n3.start()

    n3.wait_event("HADISCARD", netid, timeout=15)
    rows = n3.tracking(event_id="HADISCARD", network_message_id=netid)
    assert len(rows) == 1, rows
    assert rows[0]["source-context"] == f"ExplicitlyDiscarded;{guid}"
    assert not n3.tracking(event_id="RESUBMIT", network_message_id=netid)
    ctx = n3.shadow_list()[n1.name]
    assert ctx["shadows"] == 0 and ctx["shadow_safety_net"] == 1, ctx
    # Waiting for absence (nothing to observe): no second copy at the sink.
    time.sleep(1.0)
    assert len(sink_copies(sink, netid)) == 1


# ------------------------------------------------------------------------------ 5

def test_primary_killed_after_delivery_before_discard_is_delivered_again(make_cluster, sink):
    """At-least-once: the shadow cannot know the primary delivered; a foreign recipient gets two copies."""
    c = make_cluster(heartbeat=0.5, resubmit=2)
    c.start()
    n1, n3 = c["node1"], c["node3"]
    mid = send(n1, "carol@foreign.test")
    netid = accepted_with_shadow(n1, n3, mid)
    n1.wait_event("DEFER", netid)

    assert n3.stop() == 0  # it must not fetch the discard before node1 dies
    sink.start()
    n1.wait_event("SENDEXTERNAL", netid, timeout=15)
    n1.kill9()
    n3.start()

    rows = n3.wait_event("RESUBMIT", netid, timeout=20)
    assert rows[0]["source-context"] == f"{n1.name} (ShadowHeartbeatFailure)"
    wait_for(lambda: len(sink_copies(sink, netid)) == 2, timeout=20, what="second copy at the sink")
    first = wait_for(lambda: n1.tracking(event_id="SENDEXTERNAL", network_message_id=netid), timeout=10,
                     what="node1's SENDEXTERNAL row")
    second = wait_for(lambda: n3.tracking(event_id="SENDEXTERNAL", network_message_id=netid), timeout=10,
                      what="node3's SENDEXTERNAL row")
    assert len(first) == 1 and len(second) == 1, (first, second)
    assert first[0]["network-message-id"] == second[0]["network-message-id"] == netid
    # Never discarded as processed: only as resubmitted, by the promotion.
    discarded = n3.tracking(event_id="HADISCARD", network_message_id=netid)
    assert [d["source-context"].split(";")[0] for d in discarded] == ["Resubmitted"], discarded


def test_a_peer_without_chunking_gets_shadow_copies_with_data_and_promotes_them(make_cluster, sink):
    """Mixed peers: node3 offers no CHUNKING (transport.chunking_enabled = false), so node1's shadow
    copies reach it with DATA, while node3's own copies go to site-a with BDAT; node3 promotes a
    copy it got with DATA when node1 dies."""
    import smtplib

    c = make_cluster(heartbeat=0.5, resubmit=3)
    n1, n3 = c["node1"], c["node3"]
    config = Path(n3.spec.config)
    config.write_text(config.read_text().replace("[transport]\n", "[transport]\nchunking_enabled = false\n", 1))
    c.start()
    for node, offered in ((n1, True), (n3, False)):
        host, _, port = node.cfg.transport.listen.rpartition(":")
        with smtplib.SMTP(host, int(port), timeout=10) as s:
            s.ehlo("probe.test")
            assert s.has_extn("chunking") is offered and s.has_extn("pipelining")

    back = send(n3, "dave@foreign.test")  # node3 -> site-a, with BDAT
    redirect = [r for r in n3.wait_event("HAREDIRECT") if r["internal-message-id"] == str(back)]
    assert redirect and " 250 2.6.0 " in " " + redirect[0]["source-context"].split("=", 1)[1], redirect

    mid = send(n1, "carol@foreign.test")  # node1 -> node3 (the other site), with DATA
    netid = accepted_with_shadow(n1, n3, mid)
    n1.wait_event("DEFER", netid)
    n1.kill9()
    sink.start()
    n3.wait_event("RESUBMIT", netid, timeout=20)
    wait_for(lambda: sink_copies(sink, netid), timeout=20, what="the copy made with DATA, promoted, at the sink")
    assert "Traceback" not in n3.log()


# ------------------------------------------------------------------------------ per-recipient discards

def test_a_promoted_copy_delivers_only_the_recipients_the_primary_had_not(make_cluster, sink):
    """node1 delivers one recipient (a mailbox of its own) while the other waits (the smart host
    is down): node3, holding the shadow, hears of that recipient at its next heartbeat
    (``XQDISCARD n RCPT``, a ``Delivered=`` entry). node1 is killed; node3's promotion delivers
    the waiting recipient only: the delivered one is not sent to node1 a second time."""
    from conftest import read_db

    c = make_cluster(heartbeat=0.5, resubmit=3)
    c.start()
    n1, n3 = c["node1"], c["node3"]
    mid = send(n1, "alice@example.test,carol@foreign.test")
    netid = accepted_with_shadow(n1, n3, mid)
    wait_for(lambda: n1.maildir("alice@example.test"), timeout=10, what="alice's delivery on node1")
    n1.wait_event("DEFER", netid)

    def shadow_recipients() -> dict[str, str]:
        return dict(read_db(n3.cfg.db_path, "SELECT r.address, r.status FROM recipients r JOIN messages m "
                                            "ON m.id = r.message_id WHERE m.network_message_id = ?", (netid,)))
    wait_for(lambda: shadow_recipients().get("alice@example.test") == "Delivered", timeout=10,
             what="node3 to hear that node1 delivered alice (a per-recipient discard)")
    assert shadow_recipients()["carol@foreign.test"] != "Delivered"
    assert n3.shadow_list()[n1.name]["shadows"] == 1  # still a shadow: carol waits

    n1.kill9()
    sink.start()
    n3.wait_event("RESUBMIT", netid, timeout=20)
    wait_for(lambda: sink_copies(sink, netid), timeout=20, what="carol's copy at the sink")
    wait_for(lambda: set(shadow_recipients().values()) == {"Delivered"}, timeout=10, what="node3 done")
    assert [r["recipient-address"] for r in n3.tracking(event_id="SENDEXTERNAL", network_message_id=netid)] \
        == ["carol@foreign.test"]
    assert not n3.tracking(event_id="SEND", network_message_id=netid)  # nothing for alice towards node1
    # The RESUBMIT names what the promoted copy takes (the analytics job reads it as the copy's take).
    assert [r["recipient-address"] for r in n3.tracking(event_id="RESUBMIT", network_message_id=netid)] \
        == ["carol@foreign.test"]


def test_a_promoted_copy_neither_tries_again_nor_reports_again_a_recipient_the_primary_failed(cluster):
    """node2 (primary) fails perm-p1 (550, its DSN goes to carol's mailbox on node1, hop by hop),
    delivers ok-p3 and defers temp-p2 (450). node1, the shadow, hears of both finished recipients
    at its heartbeat (``Delivered=``, and ``Failed=`` once the DSN is out: ``XQDISCARD n RCPT
    FAILED``). node2 is killed: node1's promotion delivers temp-p2 only. perm-p1 was sent RCPT
    again and a second DSN made before: the shadow learned only of delivered recipients."""
    from clusters import netid_of
    from conftest import queued_id, read_db

    hop = PerRecipientNextHop()
    try:
        c = cluster(overrides={"routing": {"smart_host": f"127.0.0.1:{hop.port}"}}, nodes=2, sites=1).start()
        n1, n2 = c["node1"], c["node2"]
        perm, temp, ok = "perm-p1@foreign.test", "temp-p2@foreign.test", "ok-p3@foreign.test"
        netid = netid_of(n2, queued_id(n2.swaks(f"{perm},{temp},{ok}")))
        wait_for(lambda: "HAREDIRECT" in n2.events(netid), timeout=10, what="node2's shadow on node1")
        wait_for(lambda: n1.maildir("carol@example.test"), timeout=20, what="node2's DSN for perm-p1 in carol's mailbox")

        def shadow_recipients() -> dict[str, str]:
            return dict(read_db(n1.cfg.db_path, "SELECT r.address, r.status FROM recipients r JOIN messages m "
                                                "ON m.id = r.message_id WHERE m.network_message_id = ?", (netid,)))
        wait_for(lambda: shadow_recipients().get(ok) == "Delivered", timeout=20,
                 what="node1 to hear that node2 delivered ok-p3")
        # The DSN is out of node2's queue (node1 took it hop by hop and discarded the fork), then
        # two heartbeats of node1's: what node2 had to tell of perm-p1 has reached node1.
        wait_for(lambda: read_db(n2.cfg.db_path, "SELECT count(*) FROM messages WHERE dsn_of IS NOT NULL "
                                                 "AND state != 'Queued'")[0][0] == 1, timeout=20,
                 what="node2's DSN processed")
        n1.wait_heartbeats(n2.name, 2)
        told = shadow_recipients()
        assert n1.shadow_list()[n2.name]["shadows"] == 1  # still a shadow: temp-p2 waits
        assert hop.rcpts.count(perm) == 1 and [ok] in hop.transactions

        assert n2.proc is not None
        n2.proc.send_signal(signal.SIGKILL)
        n2.proc.wait(timeout=10)
        hop.greylisting = False
        wait_for(lambda: "RESUBMIT" in n1.events(netid), timeout=30, what="node1's promotion of the shadow")
        wait_for(lambda: [temp] in hop.transactions, timeout=20, what="temp-p2 delivered by the promoted copy")
        wait_for(lambda: "SENDEXTERNAL" in n1.events(netid), timeout=10, what="node1's SENDEXTERNAL")

        assert hop.rcpts.count(perm) == 1, hop.rcpts  # not tried again
        assert sum(ok in t for t in hop.transactions) == 1, hop.transactions  # not sent twice
        assert "FAIL" not in n1.events(netid)
        # One DSN in all: node2's. node1 made none (its DSN row is committed with the outcome,
        # before the SENDEXTERNAL row).
        assert read_db(n1.cfg.db_path, "SELECT count(*) FROM messages WHERE dsn_of IS NOT NULL")[0][0] == 0
        assert len(n1.maildir("carol@example.test")) == 1
        assert [r["recipient-address"] for r in n1.tracking(event_id="SENDEXTERNAL", network_message_id=netid)] \
            == [temp]
        # What node1's copy knew before the promotion: perm-p1 failed (not delivered), ok-p3 delivered.
        assert told[perm] == "Failed" and told[ok] == "Delivered" and told[temp] not in ("Failed", "Delivered"), told
    finally:
        hop.controller.stop()


def test_a_recipient_delivered_while_the_messages_dsn_waits_is_not_sent_again_by_a_promotion(cluster):
    """node2 (primary) delivers ok-q1 and fails perm-q2 in one transaction: the message is done, but
    its DSN (to temp-sender@foreign.test, whom the next hop greylists) is not out, so node1 keeps
    its shadow to protect the DSN. It also hears that ok-q1 was delivered (``Delivered=``): it
    heard nothing, and node2's death before the DSN left sent ok-q1 a second copy from node1's
    promoted copy, for as long as the DSN waited (up to the expiration time). perm-q2 is failed
    again by the promotion and its DSN made again: the sender gets exactly one."""
    from clusters import netid_of
    from conftest import queued_id, read_db, swaks

    hop = PerRecipientNextHop()
    try:
        c = cluster(overrides={"routing": {"smart_host": f"127.0.0.1:{hop.port}"}}, nodes=2, sites=1).start()
        n1, n2 = c["node1"], c["node2"]
        sender, ok, perm = "temp-sender@foreign.test", "ok-q1@foreign.test", "perm-q2@foreign.test"
        netid = netid_of(n2, queued_id(swaks(n2.frontend_port, "--from", sender, "--to", f"{ok},{perm}",
                                             server=n2.host)))
        wait_for(lambda: [ok] in hop.transactions, timeout=20, what="node2 to deliver ok-q1")
        wait_for(lambda: hop.rcpts.count(sender) >= 1, timeout=20, what="node2's DSN deferred by the next hop")

        def shadow_recipients() -> dict[str, str]:
            return dict(read_db(n1.cfg.db_path, "SELECT r.address, r.status FROM recipients r JOIN messages m "
                                                "ON m.id = r.message_id WHERE m.network_message_id = ?", (netid,)))
        wait_for(lambda: shadow_recipients().get(ok) == "Delivered", timeout=20,
                 what="node1 to hear that node2 delivered ok-q1")
        assert shadow_recipients()[perm] != "Failed"  # the DSN is not out: node1 protects it
        assert n1.shadow_list()[n2.name]["shadows"] == 1

        assert n2.proc is not None
        n2.proc.send_signal(signal.SIGKILL)
        n2.proc.wait(timeout=10)
        hop.greylisting = False
        wait_for(lambda: "RESUBMIT" in n1.events(netid), timeout=30, what="node1's promotion of the shadow")
        wait_for(lambda: [sender] in hop.transactions, timeout=30, what="the DSN, made again by node1, delivered")
        time.sleep(1.5)  # waiting for absence: a second copy of ok-q1 would have gone by now
        assert sum(ok in t for t in hop.transactions) == 1, hop.transactions
        assert hop.transactions.count([sender]) == 1, hop.transactions
    finally:
        hop.controller.stop()


def test_a_promoted_copy_sends_the_success_notice_the_primary_owed_without_delivering_again(cluster):
    """node2 (primary) delivers ok-s1 (NOTIFY=SUCCESS) to a next hop that offers no DSN, so it owes
    the sender a "relayed" notice; that notice waits (the next hop greylists temp-sender). node1,
    the shadow, hears at its heartbeat that ok-s1 was delivered with the notice still owed
    (``NotifyRelayed=``, ``XQDISCARD n RCPT FAILED NOTIFY``). node2 is killed: node1's promotion
    sends the notice (once) and not ok-s1 a second copy. node1 heard ``Delivered=`` before, which
    emptied its copy: the promotion had nothing to send, and the notice the sender asked for was
    lost with node2."""
    import smtplib

    from clusters import netid_of
    from conftest import read_db

    hop = PerRecipientNextHop()
    try:
        c = cluster(overrides={"routing": {"smart_host": f"127.0.0.1:{hop.port}"}}, nodes=2, sites=1).start()
        n1, n2 = c["node1"], c["node2"]
        sender, ok = "temp-sender@foreign.test", "ok-s1@foreign.test"
        with smtplib.SMTP(n2.host, n2.frontend_port, timeout=20) as s:
            s.ehlo("client.example")
            assert s.mail(sender)[0] == 250
            assert s.rcpt(ok, ["NOTIFY=SUCCESS"])[0] == 250
            code, text = s.data(b"Subject: notify-success\r\n\r\nhello\r\n")
        assert code == 250, text
        netid = netid_of(n2, int(text.decode().rsplit(" ", 1)[-1]))
        wait_for(lambda: [ok] in hop.transactions, timeout=20, what="node2 to deliver ok-s1")
        wait_for(lambda: hop.rcpts.count(sender) >= 1, timeout=20, what="node2's success notice deferred")
        assert read_db(n2.cfg.db_path, "SELECT count(*) FROM messages WHERE dsn_of IS NOT NULL "
                                       "AND state = 'Queued'")[0][0] == 1

        def shadow_recipients() -> dict[str, str]:
            return dict(read_db(n1.cfg.db_path, "SELECT r.address, r.status FROM recipients r JOIN messages m "
                                                "ON m.id = r.message_id WHERE m.network_message_id = ?", (netid,)))
        wait_for(lambda: shadow_recipients().get(ok) == "Delivered", timeout=20,
                 what="node1 to hear that node2 delivered ok-s1")

        assert n2.proc is not None
        n2.proc.send_signal(signal.SIGKILL)
        n2.proc.wait(timeout=10)
        hop.greylisting = False
        wait_for(lambda: [sender] in hop.transactions, timeout=30, what="the notice, sent by node1, delivered")
        time.sleep(1.5)  # waiting for absence: a second copy of ok-s1, or a second notice, would have gone by now
        assert sum(ok in t for t in hop.transactions) == 1, hop.transactions
        assert hop.transactions.count([sender]) == 1, hop.transactions
        assert "RESUBMIT" in n1.events(netid) and "SENDEXTERNAL" not in n1.events(netid)
        [(data,)] = read_db(n1.cfg.db_path, "SELECT b.data FROM message_bodies b JOIN messages m "
                                            "ON m.id = b.message_id WHERE m.dsn_of IS NOT NULL")
        text = data.decode(errors="replace")
        assert "Action: relayed" in text and f"rfc822; {ok}" in text.lower() and "Status: 2.0.0" in text, text
        assert n1.tracking(event_id="DSN")  # tracked as node1's DSN
    finally:
        hop.controller.stop()


def _delay_notices(hop: PerRecipientNextHop, sender: str) -> list[bytes]:
    """The delay DSNs (RFC 3464 action delayed) the next hop took for ``sender``."""
    return [data for (_, data), rcpts in zip(hop.messages, hop.transactions)
            if rcpts == [sender] and b"Action: delayed" in data]


@contextlib.contextmanager
def _pair_behind_one_next_hop(cluster, delay_notification_timeout: float):
    """node1 and node2, one site, their smart host a next hop that greylists ``temp-*``: (hop,
    node1, node2); the next hop is stopped at the end."""
    hop = PerRecipientNextHop()
    try:
        c = cluster(overrides={"routing": {"smart_host": f"127.0.0.1:{hop.port}"},
                               "delivery": {"delay_notification_timeout": delay_notification_timeout}},
                    nodes=2, sites=1).start()
        yield hop, c["node1"], c["node2"]
    finally:
        hop.controller.stop()


def test_a_promoted_copy_sends_no_second_delay_notice_for_what_the_primary_reported(cluster):
    """node2 (primary) cannot deliver temp-d1 (the next hop greylists it) and, after
    delay_notification_timeout, sends the sender its delay DSN (action delayed). node1, the shadow,
    hears of it at its heartbeat (``DelayNotified``, ``XQDISCARD n RCPT FAILED NOTIFY DELAY``) and
    notes it on its copy, which it keeps. node2 is killed: node1's promotion delivers temp-d1 once
    it is let through, and sends no second delay DSN. Its copy's empty ``delay_dsn_at`` made the
    promoted message due at once before: the sender had two for one message and recipient."""
    from conftest import read_db

    with _pair_behind_one_next_hop(cluster, 1) as (hop, n1, n2):
        sender, temp = "watcher-d@foreign.test", "temp-d1@foreign.test"
        netid = _send_from(n2, sender, temp, b"Subject: slow-d\r\n\r\nhello\r\n")
        wait_for(lambda: _delay_notices(hop, sender), timeout=20, what="node2's delay DSN at the sender's next hop")
        # node1 polls twice after node2's commit of its delay DSN: whatever node2 had to tell it (the
        # delay notice; the DSN's own discard, were it shadowed) has reached it.
        n1.wait_heartbeats(n2.name, 2)
        [(role, told)] = read_db(n1.cfg.db_path, "SELECT role, delay_dsn_at FROM messages "
                                                 "WHERE network_message_id = ?", (netid,))
        assert role == "shadow" and n1.shadow_list()[n2.name]["shadows"] == 1  # kept: temp-d1 waits

        assert n2.proc is not None
        n2.proc.send_signal(signal.SIGKILL)
        n2.proc.wait(timeout=10)
        tried = hop.rcpts.count(temp)
        wait_for(lambda: "RESUBMIT" in n1.events(netid), timeout=30, what="node1's promotion of the shadow")
        wait_for(lambda: hop.rcpts.count(temp) > tried, timeout=20, what="node1 to try temp-d1 (deferred)")
        # Waiting for absence: node1's maintenance (every 2 s here) would have sent a second notice by now.
        time.sleep(3)
        assert len(_delay_notices(hop, sender)) == 1, "a second delay DSN for the same message and recipient"
        hop.greylisting = False
        wait_for(lambda: [temp] in hop.transactions, timeout=20, what="temp-d1 delivered by the promoted copy")
        time.sleep(1)
        assert len(_delay_notices(hop, sender)) == 1
        assert hop.transactions.count([temp]) == 1, hop.transactions
        assert told is not None  # node1's copy noted node2's notice before the promotion


def test_a_promoted_copy_sends_the_delay_notice_the_lost_primary_had_not_sent(cluster):
    """node2 (primary) is killed before delay_notification_timeout has passed for a message it
    cannot deliver: node1's promoted copy, which heard of no delay notice, sends the one the sender
    is owed (once), past the timeout counted from when the message came."""
    with _pair_behind_one_next_hop(cluster, 6) as (hop, n1, n2):
        sender, temp = "watcher-e@foreign.test", "temp-e1@foreign.test"
        sent_at = time.time()
        netid = _send_from(n2, sender, temp, b"Subject: slow-e\r\n\r\nhello\r\n")
        assert n1.shadow_list()[n2.name]["shadows"] == 1
        assert n2.proc is not None
        n2.proc.send_signal(signal.SIGKILL)
        n2.proc.wait(timeout=10)
        assert not _delay_notices(hop, sender)
        wait_for(lambda: "RESUBMIT" in n1.events(netid), timeout=30, what="node1's promotion of the shadow")
        wait_for(lambda: _delay_notices(hop, sender), timeout=20, what="node1's delay DSN")
        assert time.time() - sent_at >= 6
        time.sleep(3)  # waiting for absence: a second notice
        assert len(_delay_notices(hop, sender)) == 1


def _send_from(node: ClusterNode, sender: str, rcpt: str, data: bytes) -> str:
    """Submit one message to ``node``'s frontend; returns its network message id."""
    import smtplib

    with smtplib.SMTP(node.host, node.frontend_port, timeout=20) as s:
        s.ehlo("client.example")
        assert s.mail(sender)[0] == 250
        assert s.rcpt(rcpt)[0] == 250
        code, text = s.data(data)
    assert code == 250, text
    return netid_of(node, int(text.decode().rsplit(" ", 1)[-1]))


def test_messages_a_live_primary_lost_without_a_new_database_are_promoted_by_its_shadow(cluster, sink):
    """node1 acknowledged six messages (the sink is down: they wait in its queue, node2 holding
    their shadows), was killed, and came back with a queue database that lost three of them
    without a new queue database ID (SQLite drops the frames of a damaged write-ahead log after
    a crash): node2 sees the same ID, so no ShadowStateChange, and no discard for those three
    ever comes. node2 asks node1 (XQSTATUS) about the copies it has held past the resubmit span,
    and promotes the three node1 does not know: every acknowledged message is delivered, the
    other three by node1 alone."""
    # A span node1's restart fits in: only XQSTATUS can promote (not ShadowHeartbeatFailure).
    c = cluster(nodes=2, sites=1, overrides={"shadow_redundancy": {"shadow_resubmit_time_span": 10}})
    node1, node2 = c["node1"], c["node2"]
    c.start()
    ids = [queued_id(node1.swaks(FOREIGN)) for _ in range(6)]
    netids = {i: netid_of(node1, i) for i in ids}
    wait_for(lambda: node2.shadow_row(node1.name)["shadows"] == 6, timeout=15, what="node2 holding six shadows")
    dbid = node1.queue_database_id()

    node1.proc.kill()  # kill -9
    node1.proc.wait(timeout=10)
    lost = ids[:3]
    marks = ",".join("?" * len(lost))
    con = sqlite3.connect(node1.cfg.db_path)
    with con:  # the transactions that committed them are gone; the database (and its ID) is not
        for table, column in (("message_shadows", "message_id"), ("recipients", "message_id"),
                              ("message_bodies", "message_id"), ("messages", "id")):
            con.execute(f"DELETE FROM {table} WHERE {column} IN ({marks})", lost)
    con.close()
    node1.spawn()
    node1.wait_listening()
    assert node1.queue_database_id() == dbid
    sink.start()

    span = node2.cfg.shadow_redundancy.shadow_resubmit_time_span
    wait_for(lambda: all(sink_copies(sink, n) for n in netids.values()), timeout=span + 20,
             what="every acknowledged message at the sink")
    resubmitted = {r["network-message-id"]: r for r in node2.tracking(event_id="RESUBMIT")}
    assert set(resubmitted) == {netids[i] for i in lost}, resubmitted
    assert {r["source"] for r in resubmitted.values()} == {"REDUNDANCY"}
    assert {r["source-context"] for r in resubmitted.values()} == {f"{node1.name} (ShadowUnknownToPrimary)"}
    # (one round may find all three past the span, or one at a time: node1's restart takes its time)
    assert re.search(rf"primary {re.escape(node1.name)} does not know [123] message\(s\) we hold shadows of",
                     node2.log())
    wait_for(lambda: node2.shadow_row(node1.name)["shadows"] == 0, timeout=15, what="node1's discards of the others")
    assert all(len(sink_copies(sink, netids[i])) == 1 for i in ids[3:])
