"""The wire protocol's pure rules (docs/PROTOCOL.md): encodings, verb arguments, placement, promotion."""

from __future__ import annotations

import base64
import uuid

import pytest

from transportd.redundancy.protocol import (Peer, ProtocolError, after_heartbeat, heartbeat_period, decode_dbid, decode_fqdn, encode_dbid,
                                 encode_fqdn, format_discard_reply, parse_discard_entries, parse_discard_reply,
                                 parse_guid, parse_xqdiscard, parse_xshadow, parse_xshadowrequest,
                                 redundancy_reply, redundancy_reply_dbid, shadow_attempts, split_xshadow_param,
                                 unreachable_since)

DBID = "0f8fad5b-d9cb-469f-a165-70867728950e"


def test_dbid_is_base64_of_the_16_guid_bytes():
    text = encode_dbid(DBID)
    assert len(text) == 24
    assert base64.b64decode(text) == uuid.UUID(DBID).bytes
    assert decode_dbid(text) == DBID


@pytest.mark.parametrize("bad", ["", "not base64!", base64.b64encode(b"short").decode(), "AAAA" * 8])
def test_bad_dbid_is_a_protocol_error(bad):
    with pytest.raises(ProtocolError):
        decode_dbid(bad)


def test_fqdn_round_trip_and_rejects():
    assert decode_fqdn(encode_fqdn("Node1.Transportd.Test")) == "node1.transportd.test"
    for bad in [base64.b64encode(b"has space.test").decode(), base64.b64encode(b"").decode(), "@@@"]:
        with pytest.raises(ProtocolError):
            decode_fqdn(bad)


def test_xshadowrequest_arguments():
    req = parse_xshadowrequest(f"node1.transportd.test {encode_dbid(DBID)}")
    assert (req.primary_fqdn, req.primary_dbid) == ("node1.transportd.test", DBID)
    for bad in [None, "", "node1.transportd.test", f"bad_name! {encode_dbid(DBID)}", "a.test b.test c"]:
        with pytest.raises(ProtocolError):
            parse_xshadowrequest(bad)


def test_xshadow_and_xqdiscard_arguments():
    assert parse_xshadow(encode_fqdn("node2.t")) == "node2.t"
    with pytest.raises(ProtocolError):
        parse_xshadow(None)
    assert parse_xqdiscard("50") == 50
    assert parse_xqdiscard("100000") == 1000  # capped
    for bad in [None, "0", "-1", "ten", "5 6"]:
        with pytest.raises(ProtocolError):
            parse_xqdiscard(bad)


def test_discard_reply_format_and_parse():
    g1, g2 = str(uuid.uuid4()), str(uuid.uuid4())
    assert format_discard_reply([]) == ["251 OK, no discard events"]
    assert format_discard_reply([g1, g2]) == [f"250-{g1}", f"250 {g2}"]
    assert parse_discard_reply(250, [g1, g2]) == [g1, g2]
    assert parse_discard_reply(251, ["OK, no discard events"]) == []
    # An operator's removal travels with its reason; an unknown reason is a contract violation.
    assert format_discard_reply([(g1, None), (g2, "DeletedByAdmin")]) == [f"250-{g1}", f"250 {g2} DeletedByAdmin"]
    assert parse_discard_entries(250, [g1, f"{g2} DeletedByAdmin"]) == [(g1, None), (g2, "DeletedByAdmin")]
    with pytest.raises(ProtocolError):
        parse_discard_entries(250, [f"{g1} Whatever"])
    with pytest.raises(ProtocolError):
        parse_discard_reply(250, [g1, "not-a-guid"])  # one bad id: keep every shadow
    with pytest.raises(ProtocolError):
        parse_discard_reply(503, ["5.5.1 Bad sequence of commands"])


def test_delay_notified_entries_are_read_only_where_asked():
    """``XQDISCARD <n> RCPT FAILED NOTIFY DELAY`` (asked only of a primary that offers
    XQDISCARDDELAY): ``<guid> DelayNotified`` read then, a contract violation for a shadow that did
    not ask (an older node, which applies none of the batch: so a primary never hands it one)."""
    from transportd.redundancy.protocol import DELAY_NOTIFIED, parse_xqdiscard_request

    assert DELAY_NOTIFIED == "DelayNotified"
    assert parse_xqdiscard_request("7 rcpt failed notify delay") == (7, True, True, True, True)
    assert parse_xqdiscard_request("7 RCPT FAILED NOTIFY") == (7, True, True, True, False)
    assert parse_xqdiscard_request("7") == (7, False, False, False, False)
    for bad in ["7 DELAY", "7 RCPT DELAY", "7 RCPT FAILED DELAY", "7 RCPT FAILED NOTIFY DELAY DELAY",
                "7 RCPT FAILED DELAY NOTIFY"]:
        with pytest.raises(ProtocolError):
            parse_xqdiscard_request(bad)
    g1, g2 = str(uuid.uuid4()), str(uuid.uuid4())
    lines = [f"{g1} {DELAY_NOTIFIED}", f"{g2} Delivered=a@x.test"]
    assert parse_discard_entries(250, lines, True, True, True, True) == [(g1, DELAY_NOTIFIED), (g2, "Delivered=a@x.test")]
    for asked in [(), (True,), (True, True), (True, True, True), (False, False, False, True)]:
        with pytest.raises(ProtocolError):
            parse_discard_entries(250, lines, *asked)
    with pytest.raises(ProtocolError):  # no address or value after it
        parse_discard_entries(250, [f"{g1} {DELAY_NOTIFIED}=a@x.test"], True, True, True, True)


def test_mail_xshadow_parameter_is_split_off():
    g = str(uuid.uuid4())
    assert split_xshadow_param(f"FROM:<a@b.test> SIZE=10 XSHADOW={g.upper()}") == ("FROM:<a@b.test> SIZE=10", g)
    assert split_xshadow_param("FROM:<a@b.test>") == ("FROM:<a@b.test>", None)
    with pytest.raises(ProtocolError):
        split_xshadow_param("FROM:<a@b.test> XSHADOW=nope")
    with pytest.raises(ProtocolError):
        split_xshadow_param(f"FROM:<a@b.test> XSHADOW={g} XSHADOW={g}")
    with pytest.raises(ProtocolError):
        parse_guid("{" + g + "}")


def test_redundancy_reply_text():
    assert redundancy_reply("<m@x>", 7, "n3.t") == \
        "250 2.6.0 <m@x> [InternalId=7, Hostname=n3.t] Queued mail for redundancy"


def test_redundancy_reply_names_the_queue_database_that_holds_the_copy():
    dbid = "6f1c2b1e-3d4a-4c5b-9e8f-0a1b2c3d4e5f"
    text = redundancy_reply("<m@x>", 7, "n3.t", queue_database_id=dbid)
    assert text == f"250 2.6.0 <m@x> [InternalId=7, Hostname=n3.t, QueueDatabaseId={encode_dbid(dbid)}] " \
                   "Queued mail for redundancy"
    assert redundancy_reply_dbid(text[4:]) == dbid
    # a peer that does not say it (Exchange, an older transportd), or says it malformed: None
    assert redundancy_reply_dbid("2.6.0 <m@x> [InternalId=7, Hostname=n3.t] Queued mail for redundancy") is None
    assert redundancy_reply_dbid("2.6.0 <m@x> [InternalId=7, QueueDatabaseId=bm90LWFuLWlk] Queued") is None
    assert redundancy_reply_dbid(f"2.6.0 <m@x> QueueDatabaseId={encode_dbid(dbid)} Queued") is None  # not in the bracket
    # the message-id is the sender's text: the last bracket, the shadow's own, is read
    other = "0e9d8c7b-6a59-4837-a261-5f4e3d2c1b0a"
    forged = redundancy_reply(f"<x[QueueDatabaseId={encode_dbid(other)}]@y>", 7, "n3.t", queue_database_id=dbid)
    assert redundancy_reply_dbid(forged[4:]) == dbid


PEERS = [Peer("n2", "a", "h:2"), Peer("n3", "b", "h:3"), Peer("n4", "b", "h:4")]


def test_prefer_remote_tries_other_sites_first_then_local():
    order = [p.name for p in shadow_attempts(PEERS, "a", "PreferRemote", 4, 2)]
    assert order == ["n3", "n4", "n3", "n4", "n2", "n2"]


def test_local_only_and_remote_only():
    assert [p.name for p in shadow_attempts(PEERS, "a", "LocalOnly", 4, 2)] == ["n2", "n2"]
    assert [p.name for p in shadow_attempts(PEERS, "a", "RemoteOnly", 3, 2)] == ["n3", "n4", "n3"]
    # A single-site cluster: Exchange ignores RemoteOnly outside a multi-site DAG (PreferRemote).
    assert [p.name for p in shadow_attempts([Peer("n2", "a", "h:2")], "a", "RemoteOnly", 4, 2)] == ["n2", "n2"]


def test_single_site_uses_only_the_local_count():
    one_site = [Peer("n2", "a", "h:2"), Peer("n3", "a", "h:3")]
    assert [p.name for p in shadow_attempts(one_site, "a", "PreferRemote", 4, 2)] == ["n2", "n3"]


def test_rotation_spreads_equal_peers():
    firsts = {shadow_attempts(PEERS, "a", "PreferRemote", 4, 2, rotate=r)[0].name for r in range(4)}
    assert firsts == {"n3", "n4"}


def test_heartbeat_decisions():
    """Promotion by elapsed time since the primary was last known alive, not by failure count."""
    kw = dict(resubmit_time_span=3)
    assert not after_heartbeat(ok=False, unreachable_for=2.9, recorded_dbid=DBID, answered_dbid=None, **kw).promote
    d = after_heartbeat(ok=False, unreachable_for=3.0, recorded_dbid=DBID, answered_dbid=None, **kw)
    assert (d.promote, d.reason) == (True, "ShadowHeartbeatFailure")
    other = str(uuid.uuid4())
    d = after_heartbeat(ok=True, unreachable_for=0, recorded_dbid=DBID, answered_dbid=other, **kw)
    assert (d.promote, d.reason) == (True, "ShadowStateChange")
    assert not after_heartbeat(ok=True, unreachable_for=0, recorded_dbid=DBID, answered_dbid=DBID, **kw).promote
    assert not after_heartbeat(ok=True, unreachable_for=0, recorded_dbid=None, answered_dbid=other, **kw).promote


def test_heartbeat_decisions_2010_count_time_outs_in_a_row():
    """2010: the primary is declared failed after ShadowHeartbeatRetryCount time-outs in a row,
    however long ago it was last seen; a state change still promotes at once."""
    kw = dict(resubmit_time_span=3, retry_count=3)
    for failures in (1, 2):
        assert not after_heartbeat(ok=False, unreachable_for=99.0, recorded_dbid=DBID, answered_dbid=None,
                                   failures=failures, **kw).promote
    d = after_heartbeat(ok=False, unreachable_for=0.5, recorded_dbid=DBID, answered_dbid=None, failures=3, **kw)
    assert (d.promote, d.reason) == (True, "ShadowHeartbeatFailure")
    d = after_heartbeat(ok=True, unreachable_for=0, recorded_dbid=DBID, answered_dbid=str(uuid.uuid4()),
                        failures=0, **kw)
    assert (d.promote, d.reason) == (True, "ShadowStateChange")
    assert not after_heartbeat(ok=True, unreachable_for=0, recorded_dbid=DBID, answered_dbid=DBID, failures=5,
                               **kw).promote


def test_heartbeat_period_is_the_frequency_or_the_2010_timeout_interval():
    from types import SimpleNamespace
    sr = SimpleNamespace(version="2013", shadow_heartbeat_frequency=120.0, shadow_heartbeat_timeout_interval=900.0)
    assert heartbeat_period(sr) == 120.0
    assert heartbeat_period(SimpleNamespace(**{**vars(sr), "version": "2010"})) == 900.0


def test_unreachable_since_counts_from_the_last_success_of_the_previous_round():
    kw = dict(heartbeat_frequency=120, exchange_limit=30)
    # Already failing: the origin stays.
    assert unreachable_since(previous=1000.0, last_ok=900.0, now=5000.0, **kw) == 1000.0
    # First failure, the previous round succeeded: counted from that success.
    assert unreachable_since(previous=None, last_ok=4850.0, now=5000.0, **kw) == 4850.0
    # First failure, no recent success (or none at all): from now.
    assert unreachable_since(previous=None, last_ok=100.0, now=5000.0, **kw) == 5000.0
    assert unreachable_since(previous=None, last_ok=None, now=5000.0, **kw) == 5000.0
