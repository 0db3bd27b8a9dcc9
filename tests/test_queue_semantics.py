"""Semantics that follow the seeds, checked on real node processes.

- ``shadow_redundancy_enabled = false`` (the 2010 seed): XSHADOWREQUEST is never advertised and
  never issued; mail to another node's mailbox database still travels there (authenticated),
  with no hop-by-hop shadow kept.
"""

from __future__ import annotations

import sqlite3
import time

from clusters import LOCAL, auth_plain, b64_dbid, fqdn, invoke, netid_of, reply, smtp
from conftest import queued_id, wait_for

DISABLED = {"shadow_redundancy": {"shadow_redundancy_enabled": False}}


def test_disabled_shadow_redundancy_advertises_and_issues_no_x_verb(cluster, sink):
    sink.start()
    c = cluster(overrides=DISABLED).start()
    node1, node3 = c["node1"], c["node3"]
    for node in (node1, node3):
        s = smtp(node.transport_host, node.transport_port)
        assert not any(k.startswith("x") for k in s.esmtp_features), s.esmtp_features
        assert auth_plain(s, fqdn("node2"), c.secret)[0] == 235
        code, msg = reply(s, f"XSHADOWREQUEST {fqdn('node2')} {b64_dbid(node.queue_database_id())}")
        assert code == 502, (code, msg)
        s.quit()
    # A message received by node3 for node1's mailbox database is handed over without XSHADOW.
    qid = queued_id(node3.swaks(LOCAL))
    netid = netid_of(node3, qid)
    wait_for(lambda: node1.tracking(event_id="DELIVER", network_message_id=netid), timeout=10,
             what="node1 to deliver node3's message")
    assert not node3.tracking(event_id="HAREDIRECT") and not node1.tracking(event_id="HARECEIVE")
    assert node3.tracking(event_id="SEND", network_message_id=netid)
    con = sqlite3.connect(f"file:{node3.cfg.db_path}?mode=ro", uri=True)
    try:
        assert con.execute("SELECT count(*) FROM shadow_forks").fetchone()[0] == 0
        state, = con.execute("SELECT state FROM messages WHERE network_message_id = ?", (netid,)).fetchone()
    finally:
        con.close()
    assert state == "SafetyNet"  # released at once: nobody else holds it as primary with a fork


def test_message_remove_tells_the_shadows_and_a_promotion_does_not_deliver_it(cluster, sink):
    """Remove-Message on the primary: its shadow is discarded (HADISCARD, DeletedByAdmin) and
    removed there too; when the primary dies later, the shadow node's promotion delivers the
    other message but not the removed one."""
    c = cluster().start()
    node1, node3 = c["node1"], c["node3"]
    removed = queued_id(node1.swaks("carol@elsewhere.test", "--header", "Subject: removed by the admin"))
    kept = queued_id(node1.swaks("dave@elsewhere.test", "--header", "Subject: kept"))
    netid = netid_of(node1, removed)
    invoke("message", "remove", str(removed), "--config", node1.config)
    discard = wait_for(lambda: node3.tracking(event_id="HADISCARD", network_message_id=netid), timeout=10,
                       what="node3 to discard the removed message's shadow")
    # Exchange's discard reason, with the shadow-message GUID of the copy (its HARECEIVE context).
    received = node3.tracking(event_id="HARECEIVE", network_message_id=netid)
    assert discard[0]["source-context"] == f"DeletedByAdmin;{received[0]['source-context']}", discard
    con = sqlite3.connect(f"file:{node3.cfg.db_path}?mode=ro", uri=True)
    try:
        (state, role), = con.execute("SELECT state, role FROM messages WHERE network_message_id = ?", (netid,))
    finally:
        con.close()
    assert (state, role) == ("Removed", "shadow")  # not in the Shadow Safety Net: never resubmitted

    node1.proc.kill()
    node1.proc.wait(10)
    sink.start()
    wait_for(lambda: any(b"Subject: kept" in m for m in sink.messages()), timeout=20,
             what="node3 to promote and deliver the kept message")
    # Waiting for absence (nothing to observe): the removed message must not follow the kept one.
    time.sleep(1)
    assert not any(b"removed by the admin" in m for m in sink.messages())
    assert kept


def test_dsn_reaches_the_sender_when_the_primary_dies_right_after_making_it(cluster, sink):
    """node1 fails a recipient (the next hop has no SMTPUTF8: 5.6.7) and queues the DSN, whose own
    delivery hangs (a test hook); node1 is killed. The original's shadow on node3 was kept for
    the DSN, so node3's promotion fails the recipient again and the NDR reaches the sender."""
    import json
    import smtplib
    sink.start()  # Postfix's smtp-sink: no SMTPUTF8
    c = cluster()
    node1, node3 = c["node1"], c["node3"]
    node1.env["TRANSPORTD_TEST_FAULTS"] = json.dumps({"match": "Undeliverable", "steps": ["deliver"],
                                                     "action": "hang"})
    c.start()
    with smtplib.SMTP(node1.host, node1.frontend_port, timeout=20) as s:
        s.ehlo("client.test")
        s.mail("bounce-me@sender.test", ["SMTPUTF8"])
        assert s.rcpt("δοκιμή@elsewhere.test")[0] == 250
        code, _ = s.data("Subject: will bounce\r\nMessage-ID: <bounce-1@sender.test>\r\n\r\nbody\r\n".encode())
        assert code == 250
    wait_for(lambda: node1.tracking(event_id="DSN"), timeout=10, what="node1 to make the DSN")
    # Several heartbeats (discard exchanges with node1, seen in node3's queue database): node3
    # would have dropped its shadow without the fix.
    node3.wait_heartbeats(node1.name, 4)
    assert not node3.tracking(event_id="HADISCARD")
    node1.proc.kill()
    node1.proc.wait(10)
    ndr = wait_for(lambda: [m for m in sink.messages() if b"bounce-1@sender.test" in m and b"5.6.7" in m],
                   timeout=20, what="the NDR, made again by node3, at the sender's next hop")
    assert len(ndr) == 1
    assert node3.tracking(event_id="RESUBMIT") and node3.tracking(event_id="DSN")


def test_one_delay_dsn_after_delay_notification_timeout(make_node, sink):
    """DelayNotificationTimeout: a message still waiting gets one delay DSN (action delayed); it
    is delivered when the next hop is back, with no second notice."""
    import smtplib
    node = make_node(smart_host=sink.address, overrides={"delivery": {"delay_notification_timeout": 2}})
    node.start()
    with smtplib.SMTP("127.0.0.1", node.port, timeout=20) as s:
        s.sendmail("bob@example.test", ["carol@elsewhere.test"], b"Subject: slow one\r\n\r\nbody\r\n")
    notice = wait_for(lambda: node.maildir_files("bob@example.test"), timeout=10, what="the delay DSN")
    text = notice[0].read_bytes()
    assert b"Action: delayed" in text and b"Subject: Delivery delayed: slow one" in text, text[:600]
    # Waiting for absence (nothing to observe): past another delay_notification_timeout, no
    # second notice.
    time.sleep(2.5)
    assert len(node.maildir_files("bob@example.test")) == 1, "a second delay notice"
    sink.start()
    node.cli("queue", "retry", f"smarthost:{sink.address}")
    wait_for(lambda: any(b"slow one" in m for m in sink.messages()), timeout=10, what="the delivery")
    assert len(node.maildir_files("bob@example.test")) == 1
