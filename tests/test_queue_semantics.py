"""Semantics that follow the seeds (issue 14, point 7), checked on real node processes.

- ``shadow_redundancy_enabled = false`` (the 2010 seed): XSHADOWREQUEST is never advertised and
  never issued; mail to another node's mailbox database still travels there (authenticated),
  with no hop-by-hop shadow kept.
"""

from __future__ import annotations

import sqlite3
import time

from conftest import queued_id, wait_for
from test_cluster import (LOCAL, auth_plain, b64_dbid, cluster, fqdn, invoke, netid_of,  # noqa: F401
                          reply, smtp)

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
    assert discard[0]["source-context"].startswith("DeletedByAdmin;"), discard
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
    time.sleep(1)
    assert not any(b"removed by the admin" in m for m in sink.messages())
    assert kept
