"""Regression (found by `transportd chaos`, docs/reliability.md): a shadow node that loses its
queue database takes our messages' shadow copies with it; the primary must make them again.

Seen in the long chaos run: node2 held two messages behind a refusing sink, shadowed on node3;
node3 was wiped (a new queue database) and came back; 11 s later node2 was wiped before it had
delivered them, and nothing held a copy any more. Now, when node3 announces its new queue
database ID (XSHADOWREQUEST), node2 re-makes the shadows it had there; the later loss of node2
is survived through the new shadow (promoted on node2's ShadowStateChange).
"""

from __future__ import annotations

import shutil

from conftest import wait_for
from test_cluster_failover import accepted_with_shadow, make_cluster, send, sink_copies  # noqa: F401

LOCAL = "alice@example.test"  # MDB01 on node1: delivered, so nothing stays queued on node3


def test_primary_remakes_shadows_lost_with_a_wiped_shadow_node(make_cluster, sink):  # noqa: F811
    c = make_cluster(heartbeat=0.5, resubmit=60)  # only a state change may promote here
    c.start()
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]

    def n3_dbid_known_to_n2() -> str | None:
        return n2.shadow_list().get(n3.name, {}).get("queue_database_id")

    # node3 announces its queue database ID to node2 when it shadows its own mail there.
    for _ in range(6):
        send(n3, LOCAL)
        if n3_dbid_known_to_n2():
            break
    old = wait_for(n3_dbid_known_to_n2, timeout=10, what="node2 to record node3's queue database ID")

    # A message queued on node2 (the sink is down), shadowed on node3 (the only remote-site peer).
    mid = send(n2, "carol@foreign.test")
    netid = accepted_with_shadow(n2, n3, mid)
    n2.wait_event("DEFER", netid)

    # node3 loses its queue database, and with it the shadow.
    n3.kill9()
    shutil.rmtree(n3.spec.data_dir)
    n3.start()
    for _ in range(10):
        send(n3, LOCAL)
        if (n3_dbid_known_to_n2() or old) != old:
            break
    wait_for(lambda: n3_dbid_known_to_n2() != old, timeout=10, what="node2 to see node3's new database")
    redirects = n2.wait_event("HAREDIRECT", netid, n=2, timeout=15)
    assert redirects[-1]["source-context"].startswith(f"{n3.name}=250 2.6.0 "), redirects[-1]
    assert "made 1 lost shadow(s)" in n2.log()
    wait_for(lambda: n3.shadow_list().get(n2.name, {}).get("shadows") == 1, timeout=10,
             what="the new shadow on node3")

    # Now node2 is wiped before delivering: the new shadow is promoted and delivered.
    n2.kill9()
    shutil.rmtree(n2.spec.data_dir)
    n2.start()
    sink.start()
    wait_for(lambda: sink_copies(sink, netid), timeout=30, what="the message at the sink after both wipes")
    assert n3.events("RESUBMIT", netid), "node3 promoted the re-made shadow"
    assert n1.proc.poll() is None
