"""Cluster membership changes with real node processes: a peer taken out of ``[[peers]]``, a
node renamed, a node started on a copy of another node's data dir.

1. A peer taken out of a shadow holder's ``[[peers]]`` while it still runs keeps its shadows
   there unpromoted: the holder polls it at its last configured transport address (its
   heartbeats succeed); once it is really gone they are promoted as for any unreachable primary.
   The other way round, a peer taken out while it holds our shadows may still heartbeat here.
2. A node whose node.name changed, or a node started on a copy of another's data dir, refuses to
   start (exit 2, one line) while its queue database holds mail under the other name; a node
   renamed once it holds nothing starts and records its new name.

The ``cluster`` fixture's timers: heartbeat 0.5 s, shadow_resubmit_time_span 3 s.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from clusters import (
    FOREIGN,
    Cluster,
    ClusterNode,
    auth_plain,
    b64,
    b64_dbid,
    fqdn,
    reply,
    smtp,
    write_node_config,
)
from conftest import queued_id, read_db, wait_for


def shadows_of(node: ClusterNode, primary: str) -> int:
    return read_db(node.cfg.db_path, "SELECT count(*) FROM messages WHERE role = 'shadow' AND state = 'Queued' "
                   "AND primary_node = ?", (primary,))[0][0]


def rewrite(node: ClusterNode, *, name: str | None = None, drop: str | None = None,
            rename: tuple[str, str] | None = None) -> None:
    """Change ``node``'s config as an operator would: its node.name, a peer (and the mailbox
    database it owns) taken out, or a peer's name changed."""
    sections, peers = node.load_toml()
    if name is not None:
        sections["node"]["name"] = name
    if drop is not None:
        peers = [p for p in peers if p["name"] != drop]
        sections["mailbox_databases"] = {db: n for db, n in sections["mailbox_databases"].items() if n != drop}
    if rename is not None:
        old, new = rename
        peers = [{**p, "name": new} if p["name"] == old else p for p in peers]
        sections["mailbox_databases"] = {db: new if n == old else n for db, n in sections["mailbox_databases"].items()}
    write_node_config(Path(node.config), sections, peers)


def restarted_without(node: ClusterNode, peer: str) -> None:
    """``node`` stopped, ``peer`` taken out of its configuration, started again."""
    assert node.stop() == 0
    rewrite(node, drop=peer)
    node.spawn()
    node.wait_listening()


def refused_start(node: ClusterNode) -> str:
    """Start ``node``, which must refuse: exit 2; the one error line it logs."""
    node.spawn()
    assert node.proc is not None
    assert node.proc.wait(timeout=30) == 2, node.log()[-3000:]
    errors = [line for line in node.log().splitlines() if "cannot start" in line]
    assert len(errors) == 1, node.log()[-3000:]
    return errors[0]


# ------------------------------------------------------------------------------ 1

def test_peer_taken_out_of_peers_while_running_keeps_its_shadows_until_really_gone(cluster, sink):
    c: Cluster = cluster().start()
    n3 = c["node3"]
    mid = queued_id(n3.swaks(FOREIGN))  # the smart host (the sink) is down: node3 keeps it queued
    # node3 is alone in site-b: its shadow is on node1 or node2 (PreferRemote).
    holder = wait_for(lambda: next((n for n in (c["node1"], c["node2"]) if shadows_of(n, n3.name)), None),
                      timeout=15, what=f"a shadow of node3's message {mid}")
    holder.wait_heartbeats(n3.name, 1)

    # The operator takes node3 out of the holder's configuration; node3 keeps running.
    restarted_without(holder, n3.name)
    # Heartbeats to node3 still succeed, for longer than shadow_resubmit_time_span: no promotion
    # (node3 holds the message and will deliver it; a promoted copy would be a second delivery).
    holder.wait_heartbeats(n3.name, 8)
    assert not holder.tracking(event_id="RESUBMIT")
    assert shadows_of(holder, n3.name) == 1
    log = holder.log()
    assert log.count(f"shadows are held for {n3.name}, which is no longer a configured peer") == 1, log[-3000:]
    assert "is not a configured peer" not in log

    # node3 is gone for good: its shadow is promoted as for any unreachable primary, and the
    # message is delivered once.
    n3.proc.kill()
    n3.proc.wait(timeout=10)
    sink.start()
    wait_for(lambda: holder.tracking(event_id="RESUBMIT"), timeout=20, what="the promotion of node3's shadow")
    [resubmit] = holder.tracking(event_id="RESUBMIT")
    assert resubmit["source-context"] == f"{n3.name} (ShadowHeartbeatFailure)", resubmit
    wait_for(lambda: sink.messages(), timeout=20, what="the promoted copy at the sink")
    time.sleep(1.0)  # nothing else may arrive
    assert len(sink.messages()) == 1


def test_peer_taken_out_of_peers_while_it_holds_our_shadows_may_still_heartbeat(cluster, sink):
    """The other way round: node1 takes node2 out of its [[peers]] while node2, still running,
    holds a shadow of node1's message. node2's heartbeats to node1 still authenticate (so it never
    promotes what node1 delivers); nothing else does: no new shadow, no mail. A long resubmit
    span: node2 must not promote while node1 restarts; a heartbeat that succeeds is what counts."""
    c: Cluster = cluster(nodes=2, overrides={"shadow_redundancy": {"shadow_resubmit_time_span": 120}}).start()
    n1, n2 = c["node1"], c["node2"]
    queued_id(n1.swaks(FOREIGN))  # queued on node1 (the sink is down), its shadow on node2
    wait_for(lambda: shadows_of(n2, n1.name), timeout=15, what="node2's shadow of node1's message")

    restarted_without(n1, n2.name)
    n2.wait_heartbeats(n1.name, 3)
    assert not n2.tracking(event_id="RESUBMIT")
    assert f"{n2.name}, no longer a configured peer, holds shadows" in n1.log()

    s = smtp(n1.transport_host, n1.transport_port, helo=n2.name)
    assert auth_plain(s, n2.name, c.secret)[0] == 235
    assert reply(s, f"XSHADOW {b64(n2.name)}")[0] == 250
    assert reply(s, f"XSHADOWREQUEST {n2.name} {b64_dbid(n2.queue_database_id())}")[0] == 550
    assert reply(s, "MAIL FROM:<a@example.test>")[0] == 451
    s.quit()

    sink.start()  # node1 delivers; node2 learns it on its next heartbeat and discards its shadow
    wait_for(lambda: not shadows_of(n2, n1.name), timeout=15, what="node2 to discard its shadow")
    time.sleep(1.0)
    assert len(sink.messages()) == 1
    assert not n2.tracking(event_id="RESUBMIT")


def test_a_former_peer_may_heartbeat_only_until_it_has_fetched_the_discards_of_what_it_held(cluster, sink):
    """node2 holds a shadow of node1's message and is down while node1 delivers it: node1 keeps a
    discard event for it. Taken out of node1's [[peers]] then, node2 may still authenticate to
    fetch it (XQDISCARD; the start WARNING says so). Once fetched, node2 holds nothing of node1's
    (its copy is in its Shadow Safety Net): at node1's next start it is no former peer any more,
    though node1's Safety Net copy still records where its shadow was."""
    c: Cluster = cluster(nodes=2, overrides={"shadow_redundancy": {"shadow_resubmit_time_span": 120}}).start()
    n1, n2 = c["node1"], c["node2"]
    queued_id(n1.swaks(FOREIGN))  # queued on node1 (the sink is down), its shadow on node2
    wait_for(lambda: shadows_of(n2, n1.name), timeout=15, what="node2's shadow of node1's message")
    assert n2.stop() == 0
    sink.start()
    wait_for(lambda: sink.messages(), timeout=30, what="node1's delivery")
    wait_for(lambda: read_db(n1.cfg.db_path, "SELECT count(*) FROM discard_events")[0][0] == 1, timeout=10,
             what="node1's discard event for node2")

    warning = f"{n2.name}, no longer a configured peer, holds shadows of this node's messages"
    restarted_without(n1, n2.name)
    assert n1.log().count(warning) == 1, n1.log()[-3000:]
    n2.spawn()  # node1 is still its peer: it heartbeats and fetches the discard
    n2.wait_listening()
    wait_for(lambda: not shadows_of(n2, n1.name), timeout=20, what="node2 to discard its shadow")
    wait_for(lambda: read_db(n1.cfg.db_path, "SELECT count(*) FROM discard_events")[0][0] == 0, timeout=10,
             what="node2's fetch of the discard acknowledged")
    assert read_db(n1.cfg.db_path, "SELECT count(*) FROM message_shadows")[0][0] == 1  # the Safety Net copy's

    assert n1.stop() == 0
    n1.spawn()
    n1.wait_listening()
    assert n1.log().count(warning) == 1, n1.log()[-3000:]
    s = smtp(n1.transport_host, n1.transport_port, helo=n2.name)
    assert auth_plain(s, n2.name, c.secret)[0] == 535
    s.quit()
    assert len(sink.messages()) == 1
    assert not n2.tracking(event_id="RESUBMIT")


# ------------------------------------------------------------------------------ 2

def test_renamed_node_refuses_to_start_while_it_holds_mail_under_its_old_name(cluster, sink):
    # node2 must not promote node1's shadow while node1 is stopped: a long resubmit span.
    c: Cluster = cluster(nodes=2, overrides={"shadow_redundancy": {"shadow_resubmit_time_span": 120}}).start()
    n1, n2 = c["node1"], c["node2"]
    old, new = n1.name, fqdn("node1b")
    mid = queued_id(n1.swaks(FOREIGN))  # queued on node1 (the sink is down), its shadow on node2
    wait_for(lambda: shadows_of(n2, old), timeout=15, what=f"node2's shadow of node1's message {mid}")

    assert n1.stop() == 0
    rewrite(n1, name=new, rename=(old, new))  # its own mailbox database too
    line = refused_start(n1)
    assert f"node.name: {new}" in line and f"run as node {old}" in line and "1 queued message(s)" in line, line
    assert "transportd redirect" in line and "empty node.data_dir" in line, line
    assert read_db(n1.cfg.db_path, "SELECT value FROM meta WHERE key = 'node_name'") == [(old,)]

    # Back under its old name it delivers and its shadow is discarded; once it holds nothing
    # under that name, the rename is taken and recorded.
    rewrite(n1, name=old, rename=(new, old))
    sink.start()
    n1.spawn()
    n1.wait_listening()
    wait_for(lambda: sink.messages(), timeout=20, what="node1's delivery")
    wait_for(lambda: not shadows_of(n2, old), timeout=15, what="node2 to discard its shadow")
    wait_for(lambda: not read_db(n1.cfg.db_path, "SELECT count(*) FROM discard_events")[0][0], timeout=15,
             what="node2 to fetch node1's discard event")
    assert n1.stop() == 0
    rewrite(n1, name=new, rename=(old, new))
    rewrite(n2, rename=(old, new))
    n1.spawn()
    n1.wait_listening()
    assert f"node.name changed from {old} to {new}" in n1.log()
    assert read_db(n1.cfg.db_path, "SELECT value FROM meta WHERE key = 'node_name'") == [(new,)]
    assert len(sink.messages()) == 1


def test_node_started_on_a_copy_of_another_nodes_data_dir_refuses_to_start(cluster, sink):
    c: Cluster = cluster(nodes=2).start()
    n1, n2 = c["node1"], c["node2"]
    queued_id(n1.swaks(FOREIGN))  # queued on node1: the sink is down
    wait_for(lambda: shadows_of(n2, n1.name), timeout=15, what="node2's shadow of node1's message")
    assert n1.stop() == 0
    assert n2.stop() == 0
    data1, data2 = n1.cfg.data_dir, n2.cfg.data_dir
    shutil.rmtree(data2)
    shutil.copytree(data1, data2, symlinks=True)  # cp -a

    line = refused_start(n2)
    assert f"node.name: {n2.name}" in line and f"run as node {n1.name}" in line, line
    assert "1 queued message(s)" in line and "1 shadow(s) of peers' messages" not in line, line
    n1.spawn()  # the original still starts
    n1.wait_listening()
