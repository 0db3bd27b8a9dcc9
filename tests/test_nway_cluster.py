"""N-way shadow redundancy on a real 3-node cluster (docs/PROTOCOL.md section 9).

``shadow_copies = 2``: node1's message gets shadows on node3 (rank 1: the remote site first,
PreferRemote) and node2 (rank 2) before its 250. Each test kills nodes with -9 and checks, from
the tracking logs and the smtp-sink, that exactly one shadow takes ownership and the message is
delivered once:

1. node1 and node3 (the primary and the rank-1 shadow) die together: node2 promotes after the
   span plus one rank delay, not before, and delivers once;
2. node1 dies alone: node3 promotes after the span and node2 adopts (its copy becomes node3's
   shadow, never promoted); once node3 delivers, node2's copy is discarded;
3. node1 comes back with an empty queue database: node3 (rank 1) promotes at once, node2 is
   adopted and never promotes;
4. node2 is down when the message comes: accepted with one shadow (partial), the second made
   once node2 is back.

shadow_copies changed with mail queued: lowered to 1, the rank-1 holder still adopts the rank-2
copy and that copy still waits its rank delay; raised from 1 to 2, the queued mail gets its second
shadow.

Two faults on a 4-node cluster (node1's copies on node3 and node4, the remote site; node2 beside
node1): the node that took over is lost too, and a shadow holder back after the takeover.
"""

from __future__ import annotations

import time
import tomllib
from pathlib import Path

import pytest
from clusters import LocalCluster, send, sink_copies
from conftest import wait_for

from transportd.devtools import cluster as cluster_mod

SPAN, RANK_DELAY = 3.0, 4.0


def nway_cluster(procs, sink, tmp_path, nodes: int = 3, copies: int = 2, span: float = SPAN) -> LocalCluster:
    c = LocalCluster(procs, sink, tmp_path, {"shadow_redundancy": {
        "shadow_heartbeat_frequency": 0.5, "shadow_resubmit_time_span": span,
        "shadow_copies": copies, "shadow_rank_delay": RANK_DELAY}}, nodes=nodes)
    c.start()
    return c


def restart_with_copies(copies: int, *nodes) -> None:
    """A rolling restart of ``nodes`` with ``shadow_copies`` = ``copies`` (the queues kept). A
    primary's restart outlasts SPAN: its shadows would promote meanwhile."""
    for node in nodes:
        raw = tomllib.loads(Path(node.spec.config).read_text())
        peers = raw.pop("peers", [])
        raw["shadow_redundancy"]["shadow_copies"] = copies
        Path(node.spec.config).write_text(cluster_mod.render_toml(raw, peers))
        assert node.stop() == 0
        node.start()


def accepted_with_two_shadows(c: LocalCluster, internal_id: int) -> str:
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]
    rows = [r for r in n1.wait_event("HAREDIRECT", n=2) if r["internal-message-id"] == str(internal_id)]
    assert sorted(r["source-context"].split("=")[0] for r in rows) == sorted([n2.name, n3.name]), rows
    netid = rows[0]["network-message-id"]
    n2.wait_event("HARECEIVE", netid)
    n3.wait_event("HARECEIVE", netid)
    return netid


def rank_2_delivers_once_when_the_others_die(n1, n2, n3, sink, netid: str) -> None:
    """The primary node1 and the rank-1 holder node3 are killed together, the sink comes up:
    node2 promotes its rank-2 copy only after the span plus one rank delay, and it arrives once."""
    n1.kill9()
    n3.kill9()
    killed = time.monotonic()
    sink.start()
    n2.wait_event("RESUBMIT", netid, timeout=40)
    after = time.monotonic() - killed
    # Counted from node1's last answer, which may come a round (0.5 s) and a slow exchange before
    # the kill (6.0 s seen under load); without the rank delay it would be SPAN, 4 s earlier.
    assert after >= SPAN + RANK_DELAY - 1.5, f"rank 2 promoted {after:.1f}s after the loss"
    wait_for(lambda: sink_copies(sink, netid), timeout=20, what="the promoted copy at the sink")
    time.sleep(1.5)  # waiting for absence: nothing else may arrive
    assert len(sink_copies(sink, netid)) == 1


def ranks(node, primary) -> dict[str, int]:
    return {r["network_message_id"]: r["shadow_rank"] for r in node.cli_json("shadow", "show", primary.name)}


def test_primary_and_rank_1_shadow_die_together_rank_2_delivers_once(procs, sink, tmp_path):
    c = nway_cluster(procs, sink, tmp_path)
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]
    netid = accepted_with_two_shadows(c, send(n1, "carol@foreign.test"))
    n1.wait_event("DEFER", netid)  # the sink is down: queued on node1
    assert ranks(n3, n1) == {netid: 1} and ranks(n2, n1) == {netid: 2}

    rank_2_delivers_once_when_the_others_die(n1, n2, n3, sink, netid)
    assert [r["source-context"] for r in n2.events("RESUBMIT", netid)] == [f"{n1.name} (ShadowHeartbeatFailure)"]


def test_primary_dies_rank_1_promotes_and_rank_2_is_adopted(procs, sink, tmp_path):
    c = nway_cluster(procs, sink, tmp_path)
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]
    netid = accepted_with_two_shadows(c, send(n1, "carol@foreign.test"))
    n1.wait_event("DEFER", netid)

    n1.kill9()
    killed = time.monotonic()
    n3.wait_event("RESUBMIT", netid, timeout=30)
    assert time.monotonic() - killed >= SPAN - 1.0
    # node2's copy is node3's shadow now (rank 1 under it): it is never promoted itself.
    adopted = n2.wait_event("HARECEIVE", netid, n=2)
    assert adopted[-1]["source-context"].endswith(f"AdoptedFrom={n1.name}"), adopted
    assert ranks(n2, n3) == {netid: 1}
    sink.start()
    wait_for(lambda: sink_copies(sink, netid), timeout=20, what="the promoted copy at the sink")
    # Delivered by node3: its discard reaches node2's adopted copy.
    n2.wait_event("HADISCARD", netid, timeout=20)
    time.sleep(SPAN + RANK_DELAY)  # past the time rank 2 would have promoted
    assert not n2.events("RESUBMIT", netid)
    assert len(sink_copies(sink, netid)) == 1
    # Neither holds a shadow of node1 now, nor polls it: `shadow list` shows no failures of the
    # polls before the promotion (they once stayed, "[Errno 111] Connection refused", for good).
    for n in (n2, n3):
        row = n.shadow_list()[n1.name]
        assert (row["shadows"], row["consecutive_failures"], row["last_error"]) == \
            (0, 0, "not polled: no shadows held"), (n.name, row)


def test_primary_back_with_an_empty_database_one_shadow_promotes(procs, sink, tmp_path):
    """A kill-wipe of the primary (ShadowStateChange): rank 1 promotes at once and adopts rank 2;
    with every rank promoting at once, both would deliver."""
    c = nway_cluster(procs, sink, tmp_path)
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]
    netid = accepted_with_two_shadows(c, send(n1, "carol@foreign.test"))
    n1.wait_event("DEFER", netid)
    n1.kill9()
    for f in Path(n1.spec.data_dir).glob("queue.db*"):
        f.unlink()
    n1.start()
    sink.start()
    promoted = n3.wait_event("RESUBMIT", netid, timeout=30)
    assert promoted[0]["source-context"] == f"{n1.name} (ShadowStateChange)"
    wait_for(lambda: sink_copies(sink, netid), timeout=20, what="the promoted copy at the sink")
    n2.wait_event("HADISCARD", netid, timeout=20)  # adopted by node3, discarded once it delivered
    time.sleep(RANK_DELAY + 1)
    assert not n2.events("RESUBMIT", netid)
    assert len(sink_copies(sink, netid)) == 1


def test_a_message_accepted_with_one_of_two_shadows_gets_the_other_when_the_peer_is_back(procs, sink, tmp_path):
    """min_shadow_copies 1: with node2 down the 250 comes with one shadow (partial), the second
    is made by a heartbeat round once node2 is back, with rank 2."""
    c = nway_cluster(procs, sink, tmp_path)
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]
    n2.stop()
    mid = send(n1, "carol@foreign.test")
    redirect = [r for r in n1.wait_event("HAREDIRECT") if r["internal-message-id"] == str(mid)]
    assert [r["source-context"].split("=")[0] for r in redirect] == [n3.name], redirect
    netid = redirect[0]["network-message-id"]

    def redundancy() -> str:
        return n1.cli_json("message", "show", str(mid))[0]["redundancy"]
    assert redundancy() == "partial"
    assert "1 of 2 shadow copies" in n1.log()
    n2.start()
    n2.wait_event("HARECEIVE", netid, timeout=20)
    wait_for(lambda: redundancy() == "shadowed", timeout=20, what="the second shadow recorded")
    assert ranks(n2, n1) == {netid: 2} and ranks(n3, n1) == {netid: 1}
    # The log says what the message was: it had a shadow all along, it was never unprotected.
    wait_for(lambda: "made new shadow copies of" in n1.log(), timeout=10, what="the heartbeat round's log line")
    assert "1 message(s) that had fewer than shadow_copies (partial)" in n1.log(), n1.log()[-3000:]
    assert "unprotected message(s) redundant" not in n1.log() and "that had none" not in n1.log()


def test_promotion_while_the_other_shadow_holder_is_down_still_reprotects(procs, sink, tmp_path):
    """node1 dies while node2 (its rank-2 shadow holder) is down: node3 promotes, cannot ask node2
    to adopt its copy, and still makes the promoted copy redundant: unprotected at first (no peer
    left), node2's copy adopted as its shadow once node2 is back. (A failed adoption once stopped
    there: the copy stayed "reshadowing", which no heartbeat round retries.)"""
    c = nway_cluster(procs, sink, tmp_path)
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]
    netid = accepted_with_two_shadows(c, send(n1, "carol@foreign.test"))
    n1.wait_event("DEFER", netid)  # the sink is down all along: nothing is delivered
    assert n2.stop() == 0
    n1.kill9()
    promoted = n3.wait_event("RESUBMIT", netid, timeout=30)
    mid = promoted[0]["internal-message-id"]

    def redundancy() -> str:
        return n3.cli_json("message", "show", mid)[0]["redundancy"]
    wait_for(lambda: redundancy() == "unprotected", timeout=15, what="the promoted copy marked unprotected")
    assert f"XSHADOWADOPT to {n2.name}" in n3.log()
    assert "redundant failed" not in n3.log() and "Traceback" not in n3.log()
    n2.start()
    wait_for(lambda: redundancy() == "partial", timeout=30, what="a shadow of the promoted copy on node2")
    # node2's own copy, adopted once node2 answers (asked again each round), not a second one
    adopted = [r["source-context"] for r in n2.events("HARECEIVE", netid) if "AdoptedFrom" in r["source-context"]]
    assert adopted and adopted[0].endswith(f"AdoptedFrom={n1.name}"), n2.events("HARECEIVE", netid)
    assert not n3.events("HAREDIRECT", netid)


@pytest.mark.parametrize("delivered_first", [False, True], ids=["queued", "delivered-meanwhile"])
def test_a_shadow_holder_that_missed_the_adoption_is_asked_again_and_never_promotes(procs, sink, tmp_path,
                                                                                     delivered_first):
    """node2 (rank 2) is down when node1 dies and node3 promotes: node3 cannot ask it to adopt.
    When node2 is back it still holds node1's copy and, node1 being gone, would promote it after
    its rank's delay: a second delivery. node3 asks again once node2 answers, so node2's copy
    becomes node3's shadow (discarded at once when node3 has delivered meanwhile); the message
    is delivered once, and node2's copy goes to its Shadow Safety Net."""
    c = nway_cluster(procs, sink, tmp_path)
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]
    netid = accepted_with_two_shadows(c, send(n1, "carol@foreign.test"))
    n1.wait_event("DEFER", netid)  # the sink is down: nothing is delivered yet
    assert n2.stop() == 0
    n1.kill9()
    n3.wait_event("RESUBMIT", netid, timeout=30)
    if delivered_first:
        sink.start()
        wait_for(lambda: sink_copies(sink, netid), timeout=20, what="node3's delivery")
    n2.start()
    adopted = wait_for(lambda: [r for r in n2.events("HARECEIVE", netid) if "AdoptedFrom" in r["source-context"]],
                       timeout=20, what="node2 adopting its copy as node3's shadow")
    assert adopted[0]["source-context"].endswith(f"AdoptedFrom={n1.name}")
    time.sleep(SPAN + 2 * RANK_DELAY + 1)  # past the delay after which node2 would have promoted
    assert not n2.events("RESUBMIT", netid), "node2 promoted a copy node3 had already promoted"
    if not delivered_first:
        sink.start()
        wait_for(lambda: sink_copies(sink, netid), timeout=20, what="the copy at the sink")
    n2.wait_event("HADISCARD", netid, timeout=20)
    assert not ranks(n2, n1) and not ranks(n2, n3), "node2 still holds a shadow of the message"
    time.sleep(1.5)  # waiting for absence: nothing else may arrive
    assert len(sink_copies(sink, netid)) == 1


# ============================================================================ shadow_copies changed with mail queued

def test_copies_made_under_two_are_adopted_after_a_restart_with_one(procs, sink, tmp_path):
    """Copies keep the ranks they were made with: node3 (rank 1), restarted with shadow_copies = 1
    (node2 too; node1's setting plays no part), still asks node2 to adopt its rank-2 copy when
    node1 dies. It once asked only with shadow_copies > 1 of its own: node2 promoted one rank
    delay later, and the message was delivered twice."""
    c = nway_cluster(procs, sink, tmp_path)
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]
    netid = accepted_with_two_shadows(c, send(n1, "carol@foreign.test"))
    n1.wait_event("DEFER", netid)  # the sink is down: queued on node1
    restart_with_copies(1, n2, n3)
    assert ranks(n3, n1) == {netid: 1} and ranks(n2, n1) == {netid: 2}

    n1.kill9()
    n3.wait_event("RESUBMIT", netid, timeout=30)
    adopted = n2.wait_event("HARECEIVE", netid, n=2, timeout=SPAN + RANK_DELAY)
    assert adopted[-1]["source-context"].endswith(f"AdoptedFrom={n1.name}"), adopted
    sink.start()
    wait_for(lambda: sink_copies(sink, netid), timeout=20, what="the promoted copy at the sink")
    n2.wait_event("HADISCARD", netid, timeout=20)
    time.sleep(SPAN + RANK_DELAY)  # past the time rank 2 would have promoted
    assert not n2.events("RESUBMIT", netid), "node2 promoted the copy node3 had promoted"
    assert len(sink_copies(sink, netid)) == 1


def test_a_rank_2_copy_still_waits_its_rank_delay_after_a_restart_with_one(procs, sink, tmp_path):
    """The holder's side: node2, restarted with shadow_copies = 1, promotes its rank-2 copy of a
    message made under 2 only after the span plus one rank delay (node1 and node3, the rank-1
    holder, lost together), once."""
    c = nway_cluster(procs, sink, tmp_path)
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]
    netid = accepted_with_two_shadows(c, send(n1, "carol@foreign.test"))
    n1.wait_event("DEFER", netid)
    restart_with_copies(1, n2)
    rank_2_delivers_once_when_the_others_die(n1, n2, n3, sink, netid)


def test_raising_shadow_copies_tops_up_the_mail_already_queued(procs, sink, tmp_path):
    """Mail accepted under shadow_copies = 1 (one shadow, on node3) gets its second shadow (rank
    2, on node2) once node1 is restarted with 2; it once stayed with one for good."""
    c = nway_cluster(procs, sink, tmp_path, copies=1, span=60)  # node1's restart promotes nothing
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]
    mid = send(n1, "carol@foreign.test")
    redirect = [r for r in n1.wait_event("HAREDIRECT") if r["internal-message-id"] == str(mid)]
    assert [r["source-context"].split("=")[0] for r in redirect] == [n3.name], redirect
    netid = redirect[0]["network-message-id"]
    n1.wait_event("DEFER", netid)

    def redundancy() -> str:
        return n1.cli_json("message", "show", str(mid))[0]["redundancy"]
    assert redundancy() == "shadowed"
    restart_with_copies(2, n1)
    n2.wait_event("HARECEIVE", netid, timeout=15)
    wait_for(lambda: redundancy() == "shadowed", timeout=15, what="the second shadow recorded")
    assert ranks(n2, n1) == {netid: 2} and ranks(n3, n1) == {netid: 1}


# ============================================================================ two faults, four nodes

def accepted_on(primary, holders, internal_id: int) -> str:
    """The network-message-id of ``internal_id``, after checking its two HAREDIRECT rows name
    ``holders`` and each holder's HARECEIVE."""
    def rows() -> list[dict]:
        return [r for r in primary.events("HAREDIRECT") if r["internal-message-id"] == str(internal_id)]
    found = wait_for(lambda: len(rows()) == 2 and rows(), timeout=20, what=f"two shadows of {internal_id}")
    assert sorted(r["source-context"].split("=")[0] for r in found) == sorted(h.name for h in holders), found
    netid = found[0]["network-message-id"]
    for h in holders:
        h.wait_event("HARECEIVE", netid)
    return netid


def settled(predicate, timeout: float):
    """``predicate()`` once true, or its last value after ``timeout`` (the test goes on either way:
    what follows shows what an unsettled state costs)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def delivered_once_each(sink, netids: list[str]) -> None:
    wait_for(lambda: all(sink_copies(sink, n) for n in netids), timeout=30, what="every message at the sink")
    time.sleep(1.5)  # waiting for absence: nothing else may arrive
    counts = {n: len(sink_copies(sink, n)) for n in netids}
    assert counts == dict.fromkeys(netids, 1), counts  # none lost, none twice


def test_the_node_that_took_over_is_lost_too_each_message_is_delivered_once(procs, sink, tmp_path):
    """node1 dies: node3 and node4 each promote the messages they hold at rank 1 and adopt the
    other's copies; each promoted message gets its missing shadow on node2 (rank 2). Then node4
    dies: node3, rank 1 under node4, promotes node4's messages and node2 adopts its copies. They
    once carried a new shadow GUID, which node3's XSHADOWADOPT (naming its own copy's) did not
    match: node2 promoted them too one rank delay later, every one of them delivered twice."""
    c = nway_cluster(procs, sink, tmp_path, nodes=4)
    n1, n2, n3, n4 = c["node1"], c["node2"], c["node3"], c["node4"]
    netids = [accepted_on(n1, [n3, n4], send(n1, f"carol{i}@foreign.test")) for i in range(4)]
    of4 = [n for n, r in ranks(n4, n1).items() if r == 1]
    assert of4 and len(of4) < len(netids), ranks(n4, n1)  # the ranks alternate between node3 and node4

    n1.kill9()
    for netid in netids:
        (n4 if netid in of4 else n3).wait_event("RESUBMIT", netid, timeout=30)
    # node4's messages: node3's copy adopted (rank 1), a new one on node2 (rank 2)
    wait_for(lambda: ranks(n3, n4) == dict.fromkeys(of4, 1) and ranks(n2, n4) == dict.fromkeys(of4, 2),
             timeout=30, what="node4's promoted messages shadowed on node3 (rank 1) and node2 (rank 2)")

    n4.kill9()
    killed = time.monotonic()
    for netid in of4:
        n3.wait_event("RESUBMIT", netid, timeout=30)

    def adopted_by_node2() -> list[str]:
        return [n for n in of4 if any(r["source-context"].endswith(f"AdoptedFrom={n4.name}")
                                      for r in n2.events("HARECEIVE", n))]
    settled(lambda: adopted_by_node2() == of4, timeout=10)
    time.sleep(max(0.0, SPAN + 2 * RANK_DELAY + 1 - (time.monotonic() - killed)))  # past node2's rank 2
    sink.start()
    delivered_once_each(sink, netids)
    assert not [n for n in of4 if n2.events("RESUBMIT", n)], "node2 promoted a message node3 had promoted"
    assert adopted_by_node2() == of4, "node2 kept its copies of node4's messages as node4's"


def test_a_shadow_holder_back_after_the_takeover_does_not_share_a_rank(procs, sink, tmp_path):
    """node1 and node3 die together: node4 promotes every message, cannot ask node3 to adopt its
    copies, and makes the missing shadows on node2 (rank 1). node3 comes back and adopts its copies
    when asked again; they once took rank 1 too, beside node2's, so that when node4 died as well
    node2 and node3 both promoted every message. A copy adopted at a rank another shadow holds is
    discarded there, and the shadow made anew ranks after node2's."""
    c = nway_cluster(procs, sink, tmp_path, nodes=4)
    n1, n2, n3, n4 = c["node1"], c["node2"], c["node3"], c["node4"]
    netids = [accepted_on(n1, [n3, n4], send(n1, f"dave{i}@foreign.test")) for i in range(3)]

    n1.kill9()
    n3.kill9()
    for netid in netids:
        n4.wait_event("RESUBMIT", netid, timeout=40)
    wait_for(lambda: ranks(n2, n4) == dict.fromkeys(netids, 1), timeout=30,
             what="the promoted messages shadowed on node2")
    n3.start()
    wait_for(lambda: all(any("AdoptedFrom" in r["source-context"] for r in n3.events("HARECEIVE", n))
                         for n in netids), timeout=30, what="node3 adopting its copies as node4's shadows")

    def distinct_ranks() -> bool:
        on2, on3 = ranks(n2, n4), ranks(n3, n4)
        return all(n in on2 and n in on3 and on2[n] != on3[n] for n in netids)
    settled(distinct_ranks, timeout=20)
    n4.kill9()
    killed = time.monotonic()
    n2.wait_event("RESUBMIT", netids[0], timeout=30)
    time.sleep(max(0.0, SPAN + 2 * RANK_DELAY + 1 - (time.monotonic() - killed)))  # past any rank 2
    sink.start()
    delivered_once_each(sink, netids)
    assert not [n for n in netids if n3.events("RESUBMIT", n)], "node3 promoted a message node2 had promoted"
