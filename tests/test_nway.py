"""N-way shadow redundancy (docs/PROTOCOL.md section 9): ranks, XSHADOWADOPT and the promotion rules.

Pure tests: the wire text and the sans-I/O connections without sockets, the rank rule with an
injected clock, and the rules played out over three nodes' queue databases (real SQLite files,
no processes): whoever loses, exactly one copy of each message is promoted.
"""

from __future__ import annotations

import time
import uuid

import pytest
from sqlalchemy import select
from test_redundancy_connection import b64, b64_dbid, one, server, shadowing_client

from transportd.errors import NoShadowRequests, ProtocolError
from transportd.queue import messages as mq
from transportd.queue import shadows as sq
from transportd.queue.messages import NewMessage
from transportd.queue.routing import NextHop
from transportd.queue.store import QueueStore, discard_events, message_shadows
from transportd.redundancy.connection import (
    Adopted,
    AdoptRequested,
    ClientConnection,
    ClientState,
    CommandRefused,
    LocalProtocolError,
    MailWithShadow,
    Refusal,
    ServerConnection,
)
from transportd.redundancy.protocol import (
    MAX_ADOPT_BATCH,
    MAX_SHADOW_RANK,
    after_heartbeat,
    format_adopt_reply,
    format_xshadowadopt,
    parse_adopt_reply,
    parse_xshadowadopt,
    promotable_rank,
    split_shadow_params,
    split_xshadow_param,
    state_change_rank,
)

PRIMARY = "p.example"
SHADOW = "s.example"
LOST = "lost.example"
P_DBID = "6f1c2b1e-3d4a-4c5b-9e8f-0a1b2c3d4e5f"
S_DBID = "0e9d8c7b-6a59-4837-a261-5f4e3d2c1b0a"
G1 = "11111111-2222-4333-8444-555555555555"
G2 = "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
R501 = b"501 5.5.4 Invalid arguments\r\n"
R502 = b"502 5.3.3 Command not implemented\r\n"
R503 = b"503 5.5.1 Bad sequence of commands\r\n"
R550 = b"550 5.7.1 Not authorized\r\n"


# ============================================================================ wire text

def test_rank_travels_beside_xshadow() -> None:
    assert split_shadow_params(f"FROM:<a@x> XSHADOW={G1} XSHADOWRANK=2 SMTPUTF8") == \
        ("FROM:<a@x> SMTPUTF8", G1, 2)
    assert split_shadow_params(f"FROM:<a@x> xshadowrank=3 xshadow={G1.upper()}") == ("FROM:<a@x>", G1, 3)
    assert split_shadow_params(f"FROM:<a@x> XSHADOW={G1}") == ("FROM:<a@x>", G1, 1)  # rank 1 by default
    assert split_xshadow_param(f"FROM:<a@x> XSHADOW={G1} XSHADOWRANK=2") == ("FROM:<a@x>", G1)


@pytest.mark.parametrize("arg", [f"FROM:<a@x> XSHADOW={G1} XSHADOWRANK=0",
                                 f"FROM:<a@x> XSHADOW={G1} XSHADOWRANK={MAX_SHADOW_RANK + 1}",
                                 f"FROM:<a@x> XSHADOW={G1} XSHADOWRANK=two",
                                 f"FROM:<a@x> XSHADOW={G1} XSHADOWRANK=2 XSHADOWRANK=3",
                                 "FROM:<a@x> XSHADOWRANK=2"])
def test_bad_ranks_are_protocol_errors(arg: str) -> None:
    with pytest.raises(ProtocolError):
        split_shadow_params(arg)


def test_xshadowadopt_text() -> None:
    line = format_xshadowadopt(LOST, 2, [G1, G2.upper()])
    assert line == f"XSHADOWADOPT {b64(LOST)} 2 {G1} {G2}"
    assert parse_xshadowadopt(line.split(" ", 1)[1]) == (LOST, 2, [G1, G2])
    assert parse_xshadowadopt(f"{b64(LOST)} 1 {G1} {G1}") == (LOST, 1, [G1])  # named twice, adopted once
    assert format_adopt_reply([]) == ["251 OK, no shadow of those held here"]
    assert format_adopt_reply([(G1, 1), (G2, 2)]) == [f"250-{G1} 1", f"250 {G2} 2"]
    assert parse_adopt_reply(250, [f"{G1} 1", f"{G2} 2"], [G1, G2]) == [(G1, 1), (G2, 2)]
    assert parse_adopt_reply(251, ["OK, no shadow of those held here"], [G1]) == []


@pytest.mark.parametrize("arg", [None, "", b64(LOST), f"{b64(LOST)} 1", f"nope! 1 {G1}", f"{b64(LOST)} 1 not-a-guid",
                                 f"{b64(LOST)} 0 {G1}", f"{b64(LOST)} {G1}",
                                 " ".join([b64(LOST), "1"] + [G1] * (MAX_ADOPT_BATCH + 1))])
def test_malformed_xshadowadopt(arg) -> None:
    with pytest.raises(ProtocolError):
        parse_xshadowadopt(arg)


def test_adopt_batches_are_bounded() -> None:
    with pytest.raises(ValueError):
        format_xshadowadopt(LOST, 1, [])
    with pytest.raises(ValueError):
        format_xshadowadopt(LOST, 1, [G1] * (MAX_ADOPT_BATCH + 1))
    with pytest.raises(ProtocolError):
        format_xshadowadopt(LOST, 0, [G1])
    assert len(format_xshadowadopt("x" * 60 + ".example", 9, [G1] * MAX_ADOPT_BATCH)) < 1000


@pytest.mark.parametrize("code, lines", [(250, ["not-a-guid 1"]), (250, [f"{G2} 1"]), (250, [G1]),
                                         (250, [f"{G1} 0"]), (500, ["no"])])
def test_malformed_adopt_replies(code: int, lines: list[str]) -> None:
    with pytest.raises(ProtocolError):
        parse_adopt_reply(code, lines, [G1])


# ============================================================================ rank rule

SPAN, DELAY = 10.0, 5.0


@pytest.mark.parametrize("unreachable_for, rank", [
    (0.0, 0), (9.99, 0), (10.0, 1), (14.99, 1), (15.0, 2), (19.99, 2), (20.0, 3), (10_000.0, MAX_SHADOW_RANK)])
def test_rank_k_waits_k_minus_one_delays_after_the_span(unreachable_for: float, rank: int) -> None:
    assert promotable_rank(unreachable_for=unreachable_for, resubmit_time_span=SPAN, rank_delay=DELAY) == rank


@pytest.mark.parametrize("failures, rank", [(0, 0), (2, 0), (3, 1), (5, 1), (6, 2), (9, 3)])
def test_2010_rank_k_waits_k_times_the_retry_count(failures: int, rank: int) -> None:
    assert promotable_rank(unreachable_for=0.0, resubmit_time_span=SPAN, rank_delay=DELAY,
                           failures=failures, retry_count=3) == rank


def test_heartbeat_decisions_carry_the_rank() -> None:
    decide = dict(recorded_dbid=P_DBID, answered_dbid=None, resubmit_time_span=SPAN, rank_delay=DELAY)
    assert not after_heartbeat(ok=False, unreachable_for=9.0, **decide).promote
    first = after_heartbeat(ok=False, unreachable_for=11.0, **decide)
    assert (first.promote, first.reason, first.rank) == (True, "ShadowHeartbeatFailure", 1)
    assert after_heartbeat(ok=False, unreachable_for=16.0, **decide).rank == 2
    # A primary back with a new queue database lost its copies: every rank at once.
    change = after_heartbeat(ok=True, unreachable_for=0.0, recorded_dbid=P_DBID, answered_dbid=S_DBID,
                             resubmit_time_span=SPAN, rank_delay=DELAY)
    assert (change.reason, change.rank) == ("ShadowStateChange", 1)  # rank 1 at once, the others later
    assert not after_heartbeat(ok=True, unreachable_for=0.0, **decide).promote


@pytest.mark.parametrize("since, rank", [(0.0, 1), (4.99, 1), (5.0, 2), (12.0, 3), (-1.0, 1), (1e6, MAX_SHADOW_RANK)])
def test_after_a_state_change_rank_k_waits_k_minus_one_delays(since: float, rank: int) -> None:
    assert state_change_rank(since_change=since, rank_delay=DELAY) == rank
    assert state_change_rank(since_change=since, rank_delay=0) == MAX_SHADOW_RANK


# ============================================================================ connections

def test_copy_carries_its_rank_and_rank_1_is_not_written() -> None:
    c = shadowing_client()
    assert c.mail_parameter(G1) == f"XSHADOW={G1}"
    assert c.mail_parameter(G1, 3) == f"XSHADOW={G1} XSHADOWRANK=3"
    group = c.send_shadow_copy("a@x", [], ["b@y"], b"body\r\n", G1, chunking=True, rank=2)
    assert group.startswith(f"MAIL FROM:<a@x> XSHADOW={G1} XSHADOWRANK=2\r\n".encode())


@pytest.mark.parametrize("rank", [0, MAX_SHADOW_RANK + 1, True, "2"])
def test_a_bad_rank_is_a_local_error(rank) -> None:
    with pytest.raises(LocalProtocolError):
        shadowing_client().mail_parameter(G1, rank)


def test_client_adopt() -> None:
    c = shadowing_client()
    assert c.send_adopt(LOST, 1, [G1, G2]) == f"XSHADOWADOPT {b64(LOST)} 1 {G1} {G2}\r\n".encode()
    assert c.state is ClientState.AWAITING_ADOPT
    assert c.receive_data(f"250-{G1} 1\r\n250 {G2} 2\r\n".encode()) == [Adopted(((G1, 1), (G2, 2)))]
    c.send_adopt(LOST, 1, [G1])
    assert c.receive_data(b"251 OK, no shadow of those held here\r\n") == [Adopted(())]
    c.send_adopt(LOST, 1, [G1])
    assert c.receive_reply(500, ["5.5.2 Error: command not recognized"]) == [
        CommandRefused("XSHADOWADOPT", 500, "5.5.2 Error: command not recognized")]  # an older peer
    assert c.state is ClientState.IDLE


def test_client_adopt_needs_a_shadow_request_and_guids() -> None:
    with pytest.raises(LocalProtocolError):
        ClientConnection(PRIMARY).send_adopt(LOST, 1, [G1])
    with pytest.raises(LocalProtocolError):
        shadowing_client().send_adopt(LOST, 1, [])
    with pytest.raises(LocalProtocolError):
        shadowing_client().send_adopt(LOST, 0, [G1])
    c = shadowing_client()
    c.send_adopt(LOST, 1, [G1])
    with pytest.raises(ProtocolError):
        c.receive_data(f"250 {G2} 1\r\n".encode())  # a GUID not asked
    assert c.state is ClientState.ERROR


def requested(s: ServerConnection) -> ServerConnection:
    one(s, f"XSHADOWREQUEST {PRIMARY} {b64_dbid(P_DBID)}")
    s.accept_shadow_request()
    return s


def test_server_adopt() -> None:
    s = requested(server())
    event = one(s, f"XSHADOWADOPT {b64(LOST)} 2 {G1} {G2}")
    assert event == AdoptRequested(PRIMARY, LOST, 2, (G1, G2))
    assert s.adopt_reply([(G2, 1)]) == f"250 {G2} 1\r\n".encode()
    one(s, f"XSHADOWADOPT {b64(LOST)} 1 {G1}")
    with pytest.raises(LocalProtocolError):
        s.adopt_reply([(G2, 1)])  # not asked
    assert s.adopt_reply([]) == b"251 OK, no shadow of those held here\r\n"
    with pytest.raises(LocalProtocolError):
        s.adopt_reply([])  # nothing awaits an answer


@pytest.mark.parametrize("prepare, line, reply", [
    (lambda s: s, f"XSHADOWADOPT {b64(LOST)} 1 {G1}", R503),  # no XSHADOWREQUEST
    (requested, f"XSHADOWADOPT {b64(LOST)} 1", R501),
    (requested, f"XSHADOWADOPT {b64(LOST)} {G1}", R501),  # no rank
    (requested, f"XSHADOWADOPT {b64(PRIMARY)} 1 {G1}", R501),  # its own shadows
    (lambda s: (requested(s), s.transaction_started())[0], f"XSHADOWADOPT {b64(LOST)} 1 {G1}", R503),
])
def test_server_adopt_refusals(prepare, line: str, reply: bytes) -> None:
    s = server()
    prepare(s)
    assert one(s, line) == Refusal(reply)


def test_adopt_needs_an_authenticated_peer_with_shadow_redundancy_on() -> None:
    assert one(ServerConnection(SHADOW, S_DBID), f"XSHADOWADOPT {b64(LOST)} 1 {G1}") == Refusal(R550)
    assert one(server(shadow_redundancy_enabled=False), f"XSHADOWADOPT {b64(LOST)} 1 {G1}") == Refusal(R502)


def test_server_reads_the_rank_of_a_copy() -> None:
    s = requested(server())
    assert one(s, f"MAIL FROM:<a@x> XSHADOW={G1} XSHADOWRANK=2") == MailWithShadow(G1, "FROM:<a@x>", 2)
    s.transaction_started()
    assert (s.shadow_guid, s.shadow_rank) == (G1, 2)
    s.transaction_ended()
    assert s.shadow_rank == 1
    assert one(s, f"MAIL FROM:<a@x> XSHADOW={G1} XSHADOWRANK=0") == Refusal(R501)


# ============================================================================ the rules played out

NODES = ("n1", "n2", "n3", "n4")


class Cluster:
    """Each node's queue database (real SQLite), and the rules of PROTOCOL.md section 9 applied
    by hand at injected times: what the heartbeat loop and the promotion do, without sockets."""

    def __init__(self, tmp_path):
        self.db = {n: QueueStore.open(tmp_path / f"{n}.db") for n in NODES}
        self.delivered: list[tuple[str, str]] = []  # (node, network id) of every promoted copy

    def close(self) -> None:
        for s in self.db.values():
            s.close()

    def tx(self, node: str, fn):
        with self.db[node].write_engine.begin() as conn:
            return fn(conn)

    def accept(self, primary: str, shadows: list[str], netid: str, now: float,
               databases: dict[str, str] | None = None) -> str:
        """``primary`` takes a message; ``shadows`` hold copies, ranked in that order (each in the
        queue database ``databases`` names for it, when it named one)."""
        guid = str(uuid.uuid4())
        msg = NewMessage(network_message_id=netid, sender="a@x", data=b"Subject: t\r\n\r\nbody\r\n",
                         recipients={NextHop("sink.example", "DnsConnectorDelivery", "sink.example"): ["b@sink.example"]},
                         received_at=now, expires_at=now + 3600, redundancy="shadowed")

        def commit(c):  # as the accept path commits it: the message and its ranked shadows at once
            mid = mq.enqueue(c, msg)
            for rank, node in enumerate(shadows, 1):
                sq.record_shadow(c, mid, node, guid, now, rank, (databases or {}).get(node))
        self.tx(primary, commit)
        for rank, node in enumerate(shadows, 1):
            copy = NewMessage(network_message_id=netid, sender="a@x", data=msg.data,
                              recipients=msg.recipients, received_at=now, expires_at=now + 3600,
                              role="shadow", redundancy="shadow", shadow_guid=guid, primary_node=primary,
                              primary_dbid=P_DBID, shadow_rank=rank)
            self.tx(node, lambda c, m=copy: mq.enqueue(c, m))
        return guid

    def heartbeat(self, node: str, primary: str, unreachable_for: float) -> list[dict]:
        """One failed heartbeat of ``node`` to ``primary``: what it promotes."""
        decision = after_heartbeat(ok=False, unreachable_for=unreachable_for, recorded_dbid=P_DBID,
                                   answered_dbid=None, resubmit_time_span=SPAN, rank_delay=DELAY)
        if not decision.promote:
            return []
        rows = self.tx(node, lambda c: sq.promote_page(c, primary, None, 500, decision.rank))
        self.delivered += [(node, r["network_message_id"]) for r in rows]
        return rows

    def adopt(self, node: str, lost: str, rows: list[dict], alive: set[str]) -> None:
        """``node`` promoted ``rows``: every live peer adopts the copies it holds (XSHADOWADOPT)."""
        by_guid = {r["shadow_guid"]: r["id"] for r in rows}
        for peer in NODES:
            if peer in (node, lost) or peer not in alive:
                continue
            for row in rows:
                adopted = self.tx(peer, lambda c, r=row: sq.adopt_shadows(c, lost, node, P_DBID, r["shadow_rank"],
                                                                          [r["shadow_guid"]]))
                self.tx(node, lambda c, p=peer, a=adopted: sq.record_adopted(
                    c, p, [(by_guid[r["shadow_guid"]], r["shadow_guid"], r["shadow_rank"]) for r in a],
                    time.time()))

    def state_change(self, node: str, primary: str, since_change: float, new_dbid: str) -> list[dict]:
        """A heartbeat of ``node`` finds ``primary`` back with ``new_dbid``, ``since_change`` after
        the change was first seen: what it promotes (the copies made from the old database)."""
        rank = state_change_rank(since_change=since_change, rank_delay=DELAY)
        rows = self.tx(node, lambda c: sq.promote_page(c, primary, new_dbid, 500, rank))
        self.delivered += [(node, r["network_message_id"]) for r in rows]
        return rows

    def shadows_of(self, node: str, primary: str) -> list[dict]:
        return [dict(r) for r in self.db[node].read(lambda c: c.exec_driver_sql(
            "SELECT shadow_guid, shadow_rank FROM messages WHERE role='shadow' AND state='Queued' "
            "AND primary_node=?", (primary,)).mappings().all())]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def run(cluster: Cluster, lost: str, alive: set[str], until: float, step: float = 1.0) -> None:
    """Every live node polls ``lost`` each ``step`` seconds of injected time, as the loop does."""
    t = 0.0
    while t <= until:
        for node in sorted(alive):
            rows = cluster.heartbeat(node, lost, t)
            if rows:
                cluster.adopt(node, lost, rows, alive)
        t += step


def test_primary_lost_rank_1_promotes_once_and_adopts_rank_2(cluster) -> None:
    guid = cluster.accept("n1", ["n2", "n3"], "m1", 0.0)
    assert cluster.heartbeat("n2", "n1", SPAN - 0.1) == []  # not before the span
    run(cluster, "n1", {"n2", "n3", "n4"}, until=SPAN + 3 * DELAY)
    assert cluster.delivered == [("n2", "m1")]  # one promotion, by rank 1
    # n3's copy is n2's shadow now, rank 1 under it, and the promoted message knows it.
    assert cluster.shadows_of("n3", "n2") == [{"shadow_guid": guid, "shadow_rank": 1}]
    assert cluster.shadows_of("n3", "n1") == []
    holders = cluster.db["n2"].read(lambda c: sq.reshadow_inputs(c, 1))[2]
    assert holders == [("n3", 1)]


def test_primary_and_rank_1_lost_together_rank_2_promotes_once(cluster) -> None:
    cluster.accept("n1", ["n2", "n3"], "m1", 0.0)
    run(cluster, "n1", {"n3", "n4"}, until=SPAN + DELAY - 0.5)
    assert cluster.delivered == []  # rank 2 waits one delay more than rank 1 would have
    run(cluster, "n1", {"n3", "n4"}, until=SPAN + 3 * DELAY)
    assert cluster.delivered == [("n3", "m1")]


def test_each_message_promoted_by_its_own_rank_1(cluster) -> None:
    cluster.accept("n1", ["n2", "n3"], "a", 0.0)
    cluster.accept("n1", ["n3", "n4"], "b", 0.0)
    cluster.accept("n1", ["n4", "n2"], "c", 0.0)
    run(cluster, "n1", {"n2", "n3", "n4"}, until=SPAN + 4 * DELAY)
    assert sorted(cluster.delivered) == [("n2", "a"), ("n3", "b"), ("n4", "c")]


def test_rank_3_after_two_losses_among_three_shadows(cluster) -> None:
    cluster.accept("n1", ["n2", "n3", "n4"], "m1", 0.0)
    run(cluster, "n1", {"n4"}, until=SPAN + 3 * DELAY)
    assert cluster.delivered == [("n4", "m1")]


def test_ranks_close_up_under_the_new_primary(cluster) -> None:
    guid = cluster.accept("n1", ["n2", "n3", "n4"], "m1", 0.0)
    run(cluster, "n1", {"n3", "n4"}, until=SPAN + 3 * DELAY)  # the primary and rank 1 lost
    assert cluster.delivered == [("n3", "m1")]
    # n4 was rank 3 under n1; under n3 (which promoted a rank-2 copy) it is rank 1.
    assert cluster.shadows_of("n4", "n3") == [{"shadow_guid": guid, "shadow_rank": 1}]
    assert cluster.db["n3"].read(lambda c: sq.reshadow_inputs(c, 1))[2] == [("n4", 1)]


def run_state_change(cluster: Cluster, primary: str, alive: set[str], until: float) -> None:
    t = 0.0
    while t <= until:
        for node in sorted(alive):
            rows = cluster.state_change(node, primary, t, S_DBID)
            if rows:
                cluster.adopt(node, primary, rows, alive)
        t += 1.0


def test_primary_back_empty_rank_1_promotes_at_once_and_adopts_the_others(cluster) -> None:
    guid = cluster.accept("n1", ["n2", "n3"], "m1", 0.0)
    run_state_change(cluster, "n1", {"n2", "n3", "n4"}, until=3 * DELAY)
    assert cluster.delivered == [("n2", "m1")]
    assert cluster.shadows_of("n3", "n2") == [{"shadow_guid": guid, "shadow_rank": 1}]


def test_primary_back_empty_and_rank_1_lost_rank_2_promotes_after_its_delay(cluster) -> None:
    cluster.accept("n1", ["n2", "n3"], "m1", 0.0)
    run_state_change(cluster, "n1", {"n3", "n4"}, until=DELAY - 1)
    assert cluster.delivered == []
    run_state_change(cluster, "n1", {"n3", "n4"}, until=3 * DELAY)
    assert cluster.delivered == [("n3", "m1")]


def test_adoption_skips_a_copy_already_promoted(cluster) -> None:
    guid = cluster.accept("n1", ["n2", "n3"], "m1", 0.0)
    cluster.heartbeat("n3", "n1", SPAN + DELAY)  # rank 2 went first (rank 1 was slow)
    adopted = cluster.tx("n3", lambda c: sq.adopt_shadows(c, "n1", "n2", P_DBID, 1, [guid]))
    assert adopted == []  # the other side learns it and keeps its own copy as primary


def test_a_shadow_made_on_a_peers_new_database_is_not_forgotten_with_the_old_ones(cluster) -> None:
    """A peer back with a new queue database lost the shadows it held of our messages
    (``claim_lost_shadows``), but not the copies made on the new database after it was first
    seen: forgetting one (seen in a chaos run: the very session that announced the new ID carried
    a re-shadow) left it held there with no discard ever sent, and the peer promoted it when we
    failed later: a second delivery."""
    old = cluster.accept("n1", ["n2"], "old-netid", now=100.0)
    new = cluster.accept("n1", ["n2"], "new-netid", now=205.0)  # on n2's new database, seen at 200
    both = cluster.accept("n1", ["n2", "n3"], "both-netid", now=150.0)
    rows = cluster.tx("n1", lambda c: sq.claim_lost_shadows(c, "n2", 200.0, 210.0))
    assert sorted(r["network_message_id"] for r in rows) == ["both-netid", "old-netid"]
    kept = cluster.tx("n1", lambda c: c.execute(select(message_shadows.c.shadow_guid, message_shadows.c.shadow_node))
                      .all())
    assert sorted(kept) == sorted([(new, "n2"), (both, "n3")]), (old, kept)
    # each forgotten copy gets a discard event all the same: one made on the new database before
    # the change was seen would otherwise be held there for good
    events = cluster.tx("n1", lambda c: c.execute(select(discard_events.c.shadow_node, discard_events.c.shadow_guid))
                        .all())
    assert sorted(events) == sorted([("n2", old), ("n2", both)]), events


def test_a_shadow_in_another_database_of_its_holder_is_lost_whenever_it_was_made(cluster) -> None:
    """A holder names, in its reply to a copy, the queue database that took it (docs/PROTOCOL.md
    section 2). Once it names another one, a copy recorded in an older one is lost, even when no
    change was ever seen (the first ID we hear of it: no ``before``); a copy in the database it
    names now is current however old; one recorded without a database (a peer that does not say)
    is judged as before, by time, and only on a change seen."""
    old_db, new_db = str(uuid.uuid4()), str(uuid.uuid4())
    gone = cluster.accept("n1", ["n2"], "gone", now=100.0, databases={"n2": old_db})
    current = cluster.accept("n1", ["n2"], "current", now=100.0, databases={"n2": new_db})
    unnamed = cluster.accept("n1", ["n2"], "unnamed", now=100.0)
    rows = cluster.tx("n1", lambda c: sq.claim_lost_shadows(c, "n2", None, 210.0, dbid=new_db))
    assert [r["network_message_id"] for r in rows] == ["gone"]
    rows = cluster.tx("n1", lambda c: sq.claim_lost_shadows(c, "n2", 200.0, 220.0, dbid=new_db))
    assert [r["network_message_id"] for r in rows] == ["unnamed"]
    kept = cluster.tx("n1", lambda c: c.execute(select(
        message_shadows.c.shadow_guid, message_shadows.c.shadow_dbid)).all())
    assert kept == [(current, new_db)]
    events = cluster.tx("n1", lambda c: c.execute(select(discard_events.c.shadow_guid)).scalars().all())
    assert sorted(events) == sorted([gone, unnamed])


def test_two_copies_on_one_peer_count_as_one_peers_protection(cluster) -> None:
    """A promoted copy that got a new shadow on a peer which also held the lost primary's copy
    (adopted later) has two copies there: that is one peer, so with two shadows wanted it is
    ``partial``, not ``shadowed`` (the peer's loss would take both)."""
    guid = cluster.accept("n1", ["n2"], "m1", 0.0)
    mid = cluster.tx("n1", lambda c: c.execute(select(message_shadows.c.message_id)).scalar())
    cluster.tx("n1", lambda c: sq.record_adopted(c, "n2", [(mid, str(uuid.uuid4()), 1)], 1.0))
    cluster.tx("n1", lambda c: sq.settle_reshadow(c, mid, [], guid, [], True, 2.0, wanted=2))
    assert cluster.db["n1"].read(lambda c: c.execute(select(mq.messages.c.redundancy)).scalar()) == mq.PARTIAL
    cluster.tx("n1", lambda c: sq.settle_reshadow(c, mid, [("n3", 2)], guid, [], True, 3.0, wanted=2))
    assert cluster.db["n1"].read(lambda c: c.execute(select(mq.messages.c.redundancy)).scalar()) == "shadowed"


def test_a_copy_adopted_at_a_rank_another_peer_holds_is_surplus(cluster) -> None:
    """A peer that answers an XSHADOWADOPT late (after the promoted message got a new shadow at
    rank 1 elsewhere) closes up to rank 1 too: both would take ownership together. Its copy is not
    recorded but discarded there, and it gets no new copy of the message while that discard waits
    (it would discard the new copy too); a free rank is recorded as before."""
    guid = cluster.accept("n1", ["n2"], "m1", 0.0)
    mid = cluster.tx("n1", lambda c: c.execute(select(message_shadows.c.message_id)).scalar())
    assert cluster.tx("n1", lambda c: sq.record_adopted(c, "n3", [(mid, guid, 1)], 1.0)) == [(mid, guid, 1)]
    assert cluster.db["n1"].read(lambda c: sq.reshadow_inputs(c, mid))[2] == [("n2", 1)]
    events = cluster.tx("n1", lambda c: c.execute(select(discard_events.c.shadow_node, discard_events.c.shadow_guid))
                        .all())
    assert events == [("n3", guid)]
    assert cluster.db["n1"].read(lambda c: sq.message_guid(c, mid, None)) == (guid, {"n3"})
    assert cluster.tx("n1", lambda c: sq.record_adopted(c, "n4", [(mid, guid, 2)], 2.0)) == []
    assert sorted(cluster.db["n1"].read(lambda c: sq.reshadow_inputs(c, mid))[2]) == [("n2", 1), ("n4", 2)]


def test_every_new_shadow_of_a_message_carries_its_guid(cluster) -> None:
    """A new shadow of a message (missing, lost, or of a promoted copy) carries the GUID its other
    copies carry, the promoted copy's first: whoever promotes it next names them all at once."""
    guid = cluster.accept("n1", ["n2"], "m1", 0.0)
    mid = cluster.tx("n1", lambda c: c.execute(select(message_shadows.c.message_id)).scalar())
    assert cluster.db["n1"].read(lambda c: sq.message_guid(c, mid, None)) == (guid, set())
    assert cluster.db["n1"].read(lambda c: sq.message_guid(c, mid, G1)) == (G1, set())
    cluster.tx("n1", lambda c: c.execute(message_shadows.delete()))
    assert cluster.db["n1"].read(lambda c: sq.message_guid(c, mid, None)) == (None, set())


def test_raising_shadow_copies_makes_the_queued_mail_with_fewer_shadows_partial(cluster) -> None:
    """At start under shadow_copies = N: queued messages of ours ``shadowed`` by fewer than N peers
    become ``partial`` (the heartbeat rounds make the rest); a message with N, one delivered, one
    already partial or unprotected, or one taken hop by hop (its one shadow is the peer that handed
    it to us, its client) stay as they are. Nothing to do under N = 1."""
    for netid, shadows in (("one", ["n2"]), ("two", ["n2", "n3"]), ("done", ["n2"]), ("hop", ["n4"])):
        cluster.accept("n1", shadows, netid, 0.0)

    def redundancy() -> dict[str, str]:
        return dict(cluster.db["n1"].read(lambda c: c.execute(select(
            mq.messages.c.network_message_id, mq.messages.c.redundancy)).all()))
    cluster.tx("n1", lambda c: c.execute(mq.messages.update().where(mq.messages.c.network_message_id == "done")
                                         .values(state=mq.SAFETY_NET)))
    cluster.tx("n1", lambda c: c.execute(mq.messages.update().where(mq.messages.c.network_message_id == "hop")
                                         .values(client_hostname="N4")))
    assert cluster.tx("n1", lambda c: sq.want_shadow_copies(c, 1)) == 0
    assert cluster.tx("n1", lambda c: sq.want_shadow_copies(c, 2)) == 1
    assert redundancy() == {"one": mq.PARTIAL, "two": "shadowed", "done": "shadowed", "hop": "shadowed"}
    assert cluster.tx("n1", lambda c: sq.want_shadow_copies(c, 3)) == 1
    assert redundancy()["two"] == mq.PARTIAL
    assert [r["network_message_id"] for r in cluster.tx("n1", lambda c: sq.claim_unprotected(c, 10))] == \
        ["one", "two"]


class _Session:
    def __init__(self, answer: list[tuple[str, int]] | None, asked: list[list[str]]):
        self.answer = answer
        self.asked = asked
        self.peer = type("P", (), {"name": "n2"})()

    async def shadow_request(self, dbid: str) -> None:
        pass

    async def adopt(self, old_primary: str, rank: int, guids: list[str]) -> list[tuple[str, int]] | None:
        self.asked.append(list(guids))
        return None if self.answer is None else [a for a in self.answer if a[0] in guids]


class _Pool:
    """A peer pool whose sessions fail (the peer down, or one that takes no shadow requests) or
    adopt what they are asked (``answer`` None: the verb refused for good)."""

    def __init__(self):
        self.up = False
        self.error: Exception = ConnectionRefusedError(111, "Connection refused")
        self.answer: list[tuple[str, int]] | None = []
        self.asked: list[list[str]] = []  # the GUIDs of each XSHADOWADOPT line

    def takes_shadows(self, peer) -> bool:
        return True

    async def session(self, peer):
        if not self.up:
            raise self.error
        return _Session(self.answer, self.asked)

    def release(self, s, ok: bool) -> None:
        pass


async def test_a_peer_still_to_adopt_gets_no_new_shadow_of_the_message(tmp_path) -> None:
    """A peer that missed the adoption (down when we promoted) holds a copy of the message already:
    until it has answered, no new shadow of it goes there. (A new shadow placed on it in the
    moment it came back, between the round's adoption retry and its re-shadow, and its own copy
    adopted a round later, left two copies on one peer, counted as two shadows.)"""
    from test_node_parts import RecordingTracking

    from transportd.config import load_dict
    from transportd.node.events import NodeEvents
    from transportd.node.metrics import NodeMetrics
    from transportd.redundancy.copies import ShadowResult
    from transportd.redundancy.manager import ShadowManager

    cfg = load_dict({"node": {"name": "n3", "data_dir": str(tmp_path / "n3")}, "cluster": {"secret": "s3cret-unit"},
                     "frontend": {"listen": "127.0.0.1:2525"}, "transport": {"listen": "127.0.0.1:2526"},
                     "shadow_redundancy": {"shadow_copies": 2},
                     "peers": [{"name": "n1", "site": "site-a", "transport": "127.0.0.1:9"},
                               {"name": "n2", "site": "site-a", "transport": "127.0.0.1:10"}]})
    store = QueueStore.open(tmp_path / "n3.db")
    store.start_writer()
    try:
        manager = ShadowManager(cfg, store, NodeEvents(cfg, NodeMetrics("n3"), store, RecordingTracking()))
        pool = _Pool()
        manager.adoptions.pool = pool
        excluded: list[set[str]] = []

        async def no_peer_answers(msg, guid, recipients, exclude=(), copies=None, first_rank=1):
            excluded.append(set(exclude))
            return ShadowResult(None, "No suitable shadow servers")
        manager.make_shadow = no_peer_answers

        msg = NewMessage(network_message_id="m1", sender="a@x", data=b"Subject: t\r\n\r\nbody\r\n",
                         recipients={NextHop("sink.example", "DnsConnectorDelivery", "sink.example"): ["b@x"]},
                         received_at=0.0, expires_at=3600.0, redundancy="unprotected")
        mid = await store.write(lambda c: mq.enqueue(c, msg))
        row = store.read(lambda c: dict(c.execute(select(mq.messages).where(mq.messages.c.id == mid)).mappings().one()))
        rows = [{**row, "shadow_guid": "g-old", "shadow_rank": 1}]
        assert await manager.adoptions.ask_all(rows, "n1") == 0
        assert manager.adoptions.pending_peers(mid) == {"n2"}  # down: asked again each round
        assert await manager.adoptions.ask_again() == 0
        # n2 back between the retry and the re-shadow: it is not offered a new copy
        assert not await manager._reshadow(row, None, False)
        assert "n2" in excluded[-1]
        pool.up, pool.answer = True, [("g-old", 1)]
        assert await manager.adoptions.ask_again() == 1
        assert manager.adoptions.pending_peers(mid) == set()
        await manager._reshadow(row, None, False)  # no new copy: n1 is gone, n2 holds its own
        assert "n2" in excluded[-1]  # now as a holder
        held = store.read(lambda c: c.execute(select(message_shadows.c.shadow_node, message_shadows.c.shadow_guid))
                          .all())
        assert held == [("n2", "g-old")]
        assert store.read(lambda c: c.execute(select(mq.messages.c.redundancy)).scalar()) == mq.PARTIAL
    finally:
        store.close()


def unit_manager(tmp_path, copies: int):
    """A ShadowManager of node n3 (peers n1 and n2) on a real queue database, its adoption pool
    a ``_Pool`` and its new shadows never made (the peers made for them recorded)."""
    from test_node_parts import RecordingTracking

    from transportd.config import load_dict
    from transportd.node.events import NodeEvents
    from transportd.node.metrics import NodeMetrics
    from transportd.redundancy.copies import ShadowResult
    from transportd.redundancy.manager import ShadowManager

    cfg = load_dict({"node": {"name": "n3", "data_dir": str(tmp_path / "n3")}, "cluster": {"secret": "s3cret-unit"},
                     "frontend": {"listen": "127.0.0.1:2525"}, "transport": {"listen": "127.0.0.1:2526"},
                     "shadow_redundancy": {"shadow_copies": copies},
                     "peers": [{"name": "n1", "site": "site-a", "transport": "127.0.0.1:9"},
                               {"name": "n2", "site": "site-a", "transport": "127.0.0.1:10"}]})
    store = QueueStore.open(tmp_path / "n3.db")
    store.start_writer()
    manager = ShadowManager(cfg, store, NodeEvents(cfg, NodeMetrics("n3"), store, RecordingTracking()))
    manager.adoptions.pool = _Pool()
    manager.made = []

    async def no_peer_answers(msg, guid, recipients, exclude=(), copies=None, first_rank=1):
        manager.made.append(copies)
        return ShadowResult(None, "No suitable shadow servers")
    manager.make_shadow = no_peer_answers
    return manager, store


async def promoted_rows(store, n: int) -> list[dict]:
    """``n`` queued copies, as promoted from n1: their rows as the promotion hands them on."""
    rows = []
    for i in range(n):
        msg = NewMessage(network_message_id=f"m{i}", sender="a@x", data=b"Subject: t\r\n\r\nbody\r\n",
                         recipients={NextHop("sink.example", "DnsConnectorDelivery", "sink.example"): ["b@x"]},
                         received_at=0.0, expires_at=3600.0, redundancy="reshadowing")
        mid = await store.write(lambda c, m=msg: mq.enqueue(c, m))
        row = store.read(lambda c, m=mid: dict(c.execute(select(mq.messages).where(mq.messages.c.id == m))
                                               .mappings().one()))
        rows.append({**row, "shadow_guid": str(uuid.UUID(int=i + 1)), "shadow_rank": 1})
    return rows


async def test_a_promotion_asks_for_adoption_whatever_this_nodes_shadow_copies(tmp_path) -> None:
    """Copies keep the rank they were made with: under shadow_copies = 1 (restarted with it since
    the copies were made under 2) a rank-1 promoter still asks the other peers to adopt, and the
    copy n2 adopted is the shadow the message needs. It once asked only with shadow_copies > 1:
    n2 promoted its rank-2 copy one rank delay later, a second delivery."""
    manager, store = unit_manager(tmp_path, copies=1)
    try:
        pool = manager.adoptions.pool
        pool.up = True
        rows = await promoted_rows(store, 1)
        pool.answer = [(rows[0]["shadow_guid"], 1)]
        await manager._after_promotion(rows, "n1")
        assert pool.asked == [[rows[0]["shadow_guid"]]]
        assert manager.made == []  # n2's adopted copy is the one shadow wanted
        assert store.read(lambda c: c.execute(select(mq.messages.c.redundancy)).scalar()) == "shadowed"
    finally:
        store.close()


async def test_a_peer_that_refuses_xshadowadopt_is_asked_once(tmp_path) -> None:
    """An older peer answers XSHADOWADOPT 500 (aiosmtpd ends the session after five): it adopts
    nothing, is asked no further line, and counts as answered (not asked again each round, and
    not kept from new shadows). A peer that takes no shadow requests (2010 mode, shadow redundancy
    off) likewise."""
    manager, store = unit_manager(tmp_path, copies=1)
    try:
        pool = manager.adoptions.pool
        pool.up, pool.answer = True, None
        rows = await promoted_rows(store, MAX_ADOPT_BATCH + 1)
        assert await manager.adoptions.ask_all(rows, "n1") == 0
        assert len(pool.asked) == 1
        assert manager.adoptions.pending_peers(rows[0]["id"]) == set()
        pool.up, pool.error = False, NoShadowRequests("n2 does not advertise XSHADOWREQUEST")
        assert await manager.adoptions.ask_all(rows, "n1") == 0
        assert manager.adoptions.pending_peers(rows[0]["id"]) == set()
    finally:
        store.close()
