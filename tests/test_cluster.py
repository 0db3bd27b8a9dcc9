"""Shadow redundancy across real node processes: a 3-node, 2-site cluster on loopback.

``transportd.devtools.cluster.generate`` writes the configs (node1 + node2 in site-a, node3 in
site-b, each on its own 127.0.0.x address, mailbox database MDB01 on node1); each node runs
as ``python -m transportd serve`` and is ended by PID at teardown. Mail that leaves the
boundary goes to Postfix's smtp-sink (the conftest ``sink``), started only when a test
wants delivery to happen. Timers are short (heartbeat 0.5 s, retries 1 s) so the whole
file runs in well under two minutes.

What is checked is docs/PROTOCOL.md, from the outside: the shadow exists when the client gets
its 250 (section 2), placement (PreferRemote / LocalOnly / RemoteOnly), what happens when
no shadow can be made, who may speak the X-verbs on which connector (section 1), discard
by heartbeat into the Shadow Safety Net (sections 4 and 5), a malformed discard id keeping
every shadow (a fake primary), hop-by-hop delivery with XSHADOW (section 3), and
``transportd cluster up`` itself.

Read commands (``shadow list``, ``tracking search`` ...) run in this process through
click's CliRunner: the same code on the same files as ``python -m transportd``, without
the interpreter start-up per poll. ``cluster up``/``cluster status`` run as real processes.

The harness (``Cluster``, ``ClusterNode``, ``FakePrimary``, the SMTP helpers) is in clusters.py,
the ``cluster`` fixture in conftest.py; other test files use both.
"""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import smtplib
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from clusters import (
    FAST,
    FOREIGN,
    HEARTBEAT,
    LOCAL,
    FakePrimary,
    auth_plain,
    b64,
    b64_dbid,
    fqdn,
    invoke,
    json_lines,
    merge,
    netid_of,
    one,
    reply,
    smtp,
    write_node_config,
)
from conftest import free_port, queued_id, swaks, wait_for, wait_port
from helpers import assert_one_error_line, run_cli

# ------------------------------------------------------------------------------ 1. shadow before the 250

def test_shadow_exists_on_remote_site_when_client_gets_250(cluster):
    """docs/PROTOCOL.md 2: the copy is on the shadow (another site, PreferRemote) before the sender's 250.

    The sink is down, so node1 cannot deliver and nothing can discard the shadow: whatever the
    shadow node holds right after swaks returns is what it held when the 250 went out.
    """
    c = cluster().start()
    node1, node2, node3 = c["node1"], c["node2"], c["node3"]
    qid = queued_id(node1.swaks(FOREIGN))

    held = node3.shadow_row(node1.name)
    assert held["shadows"] == 1 and held["shadow_safety_net"] == 0, held
    assert node2.shadow_row(node1.name)["shadows"] == 0, "PreferRemote put the shadow in the local site"

    receive = one(node1.tracking(event_id="RECEIVE"), "RECEIVE on node1")
    assert receive["internal-message-id"] == str(qid)
    netid = receive["network-message-id"]
    shadow = one(node3.cli_json("shadow", "show", node1.name), "shadow of node1 on node3")
    assert shadow["network_message_id"] == netid
    assert shadow["state"] == "Shadow"
    # A host name in any case is the same primary; a name that is none is said, exit 1 (was an empty table).
    assert one(node3.cli_json("shadow", "show", node1.name.upper()))["id"] == shadow["id"]
    res = run_cli("shadow", "show", "nosuch.transportd.test", "--config", str(node3.config))
    assert res.returncode == 1 and "no primary 'nosuch.transportd.test'" in res.stderr, res.stderr
    assert node1.name in res.stderr

    redirect = one(node1.tracking(event_id="HAREDIRECT"), "HAREDIRECT on node1")
    assert redirect["network-message-id"] == netid
    assert redirect["source-context"].startswith(f"{node3.name}=250 2.6.0"), redirect["source-context"]
    # The shadow's reply names its own local id and FQDN (docs/PROTOCOL.md 2).
    assert f"InternalId={shadow['id']}" in redirect["source-context"]
    assert f"Hostname={node3.name}" in redirect["source-context"]

    hareceive = one(node3.tracking(event_id="HARECEIVE"), "HARECEIVE on node3")
    assert hareceive["client-hostname"] == node1.name
    assert hareceive["network-message-id"] == netid
    assert hareceive["source-context"] == shadow["shadow_guid"]
    assert not node2.tracking(event_id="HARECEIVE")

    primary = one([m for m in node1.messages() if m["id"] == qid], "primary message on node1")
    assert primary["redundancy"] == "shadowed"


# ------------------------------------------------------------------------------ 2. discard into the Shadow Safety Net

def test_delivery_discards_shadow_into_shadow_safety_net(cluster, sink):
    """docs/PROTOCOL.md 4-5: once node1 delivered, node3's next heartbeat discards its copy."""
    sink.start()
    c = cluster().start()
    node1, node3 = c["node1"], c["node3"]
    qid = queued_id(node1.swaks(FOREIGN))
    netid = netid_of(node1, qid)

    wait_for(lambda: len(sink.messages()) == 1, timeout=10, what="delivery to the sink")
    delivered_at = time.monotonic()
    row = wait_for(lambda: (r := node3.shadow_row(node1.name))["shadow_safety_net"] == 1 and r,
                   timeout=HEARTBEAT + 3, interval=0.05, what="the shadow to reach the Shadow Safety Net")
    discarded_after = time.monotonic() - delivered_at
    assert row["shadows"] == 0, row
    assert discarded_after < HEARTBEAT + 2.5, discarded_after
    # The heartbeat's bookkeeping is written just after the discard itself.
    row = wait_for(lambda: (r := node3.shadow_row(node1.name))["last_heartbeat_at"] and r, timeout=2,
                   what="the heartbeat to be recorded")
    assert row["consecutive_failures"] == 0 and row["last_error"] == "", row
    assert row["queue_database_id"] == node1.queue_database_id()

    # One network-message-id across the nodes' logs.
    assert one(node1.tracking(event_id="HAREDIRECT"))["network-message-id"] == netid
    assert one(node1.tracking(event_id="SENDEXTERNAL"))["network-message-id"] == netid
    assert one(node3.tracking(event_id="HARECEIVE"))["network-message-id"] == netid
    hadiscard = one(node3.tracking(event_id="HADISCARD"), "HADISCARD on node3")
    assert hadiscard["network-message-id"] == netid
    shadow = one(node3.cli_json("shadow", "show", node1.name, "--all"))
    assert shadow["state"] == "SafetyNet"
    assert hadiscard["source-context"] == f"ExplicitlyDiscarded;{shadow['shadow_guid']}"
    assert not c["node2"].tracking(network_message_id=netid)

    primary = one([m for m in node1.messages() if m["id"] == qid])
    assert primary["status"] == "SafetyNet", primary  # Primary Safety Net


# ------------------------------------------------------------------------------ 3. placement

@pytest.mark.parametrize("preference, down, expected", [
    ("LocalOnly", None, "node2"),
    ("PreferRemote", None, "node3"),
    ("PreferRemote", "node3", "node2"),  # remote attempts fail: fall back to the local site
    ("RemoteOnly", "node3", None),       # the only remote peer is down: no shadow at all
])
def test_shadow_placement(cluster, preference, down, expected):
    c = cluster()
    node1 = c["node1"]
    node1.set("shadow_redundancy", "shadow_message_preference_setting", preference)
    c.start(*[s for s in c.nodes if s != down])
    r = node1.swaks(FOREIGN)
    qid = queued_id(r)  # RejectMessageOnShadowFailure = false: accepted either way
    netid = netid_of(node1, qid)

    for short in ("node2", "node3"):
        if short == down:
            continue
        held = c[short].shadow_row(node1.name)["shadows"]
        assert held == (1 if short == expected else 0), (short, held)
    if expected:
        redirect = one(node1.tracking(event_id="HAREDIRECT"))
        assert redirect["network-message-id"] == netid
        assert redirect["source-context"].startswith(f"{fqdn(expected)}=250 2.6.0"), redirect
        assert not node1.tracking(event_id="HAREDIRECTFAIL")
    else:
        fail = one(node1.tracking(event_id="HAREDIRECTFAIL"))
        assert fail["network-message-id"] == netid
        assert fqdn("node3") in fail["source-context"], fail["source-context"]
        assert fqdn("node2") not in fail["source-context"], "RemoteOnly tried a local-site peer"
        assert not node1.tracking(event_id="HAREDIRECT")
        # No copy anywhere: unprotected, or reshadowing once the re-protection has tried again
        # (its retry may come before this read on a busy machine); never shadowed.
        assert one([m for m in node1.messages() if m["id"] == qid])["redundancy"] in ("unprotected", "reshadowing")


def test_no_suitable_shadow_server(cluster):
    """node3 is alone in site-b: LocalOnly leaves no candidate at all."""
    c = cluster()
    node3 = c["node3"]
    node3.set("shadow_redundancy", "shadow_message_preference_setting", "LocalOnly")
    c.start()
    qid = queued_id(node3.swaks(FOREIGN))
    fail = one(node3.tracking(event_id="HAREDIRECTFAIL"))
    assert fail["network-message-id"] == netid_of(node3, qid)
    assert fail["source-context"] == "No suitable shadow servers"
    assert all(not c[s].tracking(event_id="HARECEIVE") for s in ("node1", "node2"))


# ------------------------------------------------------------------------------ 4. no peer reachable

def test_all_peers_down_accepts_unprotected_by_default(cluster):
    c = cluster()
    node1 = c["node1"]
    c.start("node1")
    qid = queued_id(node1.swaks(FOREIGN))
    fail = one(node1.tracking(event_id="HAREDIRECTFAIL"))
    assert fail["network-message-id"] == netid_of(node1, qid)
    # The peers' replies (here: no connection), both sites tried.
    assert fqdn("node2") in fail["source-context"] and fqdn("node3") in fail["source-context"], fail
    msg = one(node1.messages(include_done=False))
    assert msg["id"] == qid and msg["redundancy"] in ("unprotected", "reshadowing")  # (a re-protection try)


def test_all_peers_down_rejects_when_configured(cluster):
    c = cluster(overrides={"shadow_redundancy": {"reject_message_on_shadow_failure": True}})
    node1 = c["node1"]
    c.start("node1")
    r = node1.swaks(FOREIGN)
    assert "451 4.4.0" in r.stdout, r.stdout
    assert "queued as" not in r.stdout
    assert node1.messages(include_done=True) == [], "a refused message must leave nothing behind"
    assert not node1.tracking(event_id="RECEIVE")
    # Still up and still refusing (not a one-off).
    assert "451 4.4.0" in node1.swaks(FOREIGN).stdout


# ------------------------------------------------------------------------------ 5. who may speak the X-verbs

def x_verbs(dbid: str) -> list[str]:
    return [f"XSHADOWREQUEST {fqdn('node2')} {b64_dbid(dbid)}", f"XSHADOW {b64(fqdn('node2'))}", "XQDISCARD 5",
            f"MAIL FROM:<a@b.test> XSHADOW={uuid.uuid4()}"]


def assert_all_refused(s: smtplib.SMTP, dbid: str, expected: str) -> None:
    for line in x_verbs(dbid):
        code, msg = reply(s, line)
        assert f"{code} {msg}".startswith(expected), (line, code, msg)


def test_transport_connector_security(cluster):
    c = cluster()
    node1 = c["node1"]
    c.start("node1")
    dbid = node1.queue_database_id()
    host, tport = node1.transport_host, node1.transport_port

    # Unauthenticated on the transport connector: 550 5.7.1 for every X-verb.
    s = smtp(host, tport)
    assert s.has_extn("xshadowrequest") and "PLAIN" in s.esmtp_features.get("auth", "").upper()
    assert_all_refused(s, dbid, "550 5.7.1")
    assert reply(s, "MAIL FROM:<a@b.test>")[0] == 250, "the refused MAIL XSHADOW= must not open a transaction"
    s.quit()

    # The frontend does not know them at all.
    s = smtp(node1.host, node1.frontend_port)
    assert not s.has_extn("xshadowrequest")
    for line in x_verbs(dbid)[:3]:
        code, msg = reply(s, line)
        assert (code, msg) == (502, "5.3.3 Command not implemented"), (line, code, msg)
    code, _ = reply(s, f"MAIL FROM:<a@b.test> XSHADOW={uuid.uuid4()}")
    assert code >= 500, "the frontend accepted MAIL ... XSHADOW="
    s.quit()

    # A wrong secret, and the right secret for a name that is not a peer.
    for user, password in ((fqdn("node2"), c.secret + "x"), (fqdn("node2"), ""),
                           ("intruder.transportd.test", c.secret), (fqdn("node1"), c.secret)):
        s = smtp(host, tport)
        code, msg = auth_plain(s, user, password)
        assert code == 535, (user, code, msg)
        assert_all_refused(s, dbid, "550 5.7.1")
        s.quit()

    # An authenticated peer: argument and sequence errors, then the real exchange.
    s = smtp(host, tport, helo=fqdn("node2"))
    assert auth_plain(s, fqdn("node2"), c.secret)[0] == 235
    assert reply(s, "XSHADOWREQUEST") == (501, "5.5.4 Invalid arguments")
    assert reply(s, f"XSHADOWREQUEST {fqdn('node2')}") == (501, "5.5.4 Invalid arguments")
    assert reply(s, f"XSHADOWREQUEST {fqdn('node2')} not-base64!") == (501, "5.5.4 Invalid arguments")
    assert reply(s, "MAIL FROM:<a@b.test>")[0] == 250
    assert reply(s, f"XSHADOWREQUEST {fqdn('node2')} {b64_dbid(str(uuid.uuid4()))}") == \
        (503, "5.5.1 Bad sequence of commands")
    assert reply(s, f"XSHADOW {b64(fqdn('node2'))}") == (503, "5.5.1 Bad sequence of commands")
    assert reply(s, "RSET")[0] == 250
    assert reply(s, "XQDISCARD 5") == (503, "5.5.1 Bad sequence of commands")  # before XSHADOW
    assert reply(s, "XSHADOW") == (501, "5.5.4 Invalid arguments")
    code, _ = reply(s, f"XSHADOW {b64(fqdn('node3'))}")  # claiming to be another peer
    assert code >= 500
    assert reply(s, "XQDISCARD 5") == (503, "5.5.1 Bad sequence of commands")

    code, msg = reply(s, f"XSHADOW {b64(fqdn('node2'))}")
    assert code == 250, msg
    raw = base64.b64decode(msg.strip(), validate=True)
    assert len(raw) == 16 and str(uuid.UUID(bytes=raw)) == dbid
    assert reply(s, "XQDISCARD 0") == (501, "5.5.4 Invalid arguments")
    assert reply(s, "XQDISCARD -3") == (501, "5.5.4 Invalid arguments")
    assert reply(s, "XQDISCARD") == (501, "5.5.4 Invalid arguments")
    assert reply(s, "XQDISCARD 5") == (251, "OK, no discard events")
    s.quit()

    # XSHADOWREQUEST: only for the authenticated name; the answer is our own FQDN in base64.
    s = smtp(host, tport, helo=fqdn("node2"))
    assert auth_plain(s, fqdn("node2"), c.secret)[0] == 235
    code, _ = reply(s, f"XSHADOWREQUEST {fqdn('node3')} {b64_dbid(str(uuid.uuid4()))}")
    assert code >= 500, "a peer may not ask for shadows in another peer's name"
    code, msg = reply(s, f"XSHADOWREQUEST {fqdn('node2')} {b64_dbid(str(uuid.uuid4()))}")
    assert (code, base64.b64decode(msg.strip(), validate=True).decode()) == (250, node1.name)
    s.quit()
    assert node1.proc.poll() is None


# ------------------------------------------------------------------------------ 6. a malformed discard id

def test_malformed_discard_id_keeps_every_shadow(procs, sink, tmp_path):
    """docs/PROTOCOL.md 4: a malformed id in an XQDISCARD reply is a contract violation: keep every shadow.

    A fake primary answers the heartbeat; the node under test holds two shadows for it, given
    over its transport connector exactly as a primary would (XSHADOWREQUEST + MAIL XSHADOW=).
    """
    base = random.randint(20, 200)
    node_ip, fake_ip = f"127.0.0.{base}", f"127.0.0.{base + 1}"
    secret = "s3cret-" + uuid.uuid4().hex
    fake_name, node_name = "fake.transportd.test", "shadow.transportd.test"
    fake_dbid = str(uuid.uuid4())
    fake = FakePrimary((fake_ip, free_port()), fake_name, fake_dbid)
    threading.Thread(target=fake.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        frontend_port, transport_port = free_port(), free_port()
        config = tmp_path / "shadow.toml"
        sections = merge(FAST, {
            "node": {"name": node_name, "site": "site-a", "data_dir": str(tmp_path / "data")},
            "frontend": {"listen": f"{node_ip}:{frontend_port}"},
            "transport": {"listen": f"{node_ip}:{transport_port}"},
            "cluster": {"secret": secret},
            "routing": {"accepted_domains": ["example.test"], "trusted_networks": ["127.0.0.1/32"],
                        "smart_host": sink.address},
            # Long enough that failed heartbeats never promote during the test.
            "shadow_redundancy": {"shadow_redundancy_enabled": True, "shadow_resubmit_time_span": 3600},
        })
        write_node_config(config, sections, [{"name": fake_name, "site": "site-b",
                                              "transport": f"{fake_ip}:{fake.server_address[1]}"}])
        log_path = tmp_path / "shadow.log"
        with open(log_path, "ab") as log:
            proc = procs.add(subprocess.Popen([sys.executable, "-m", "transportd", "serve", "--config", str(config)],
                                              stdout=log, stderr=subprocess.STDOUT))
        wait_port(node_ip, transport_port, proc=proc)

        # Act as the fake primary: make two shadows on the node.
        guids = [str(uuid.uuid4()), str(uuid.uuid4())]
        s = smtp(node_ip, transport_port, helo=fake_name)
        assert auth_plain(s, fake_name, secret)[0] == 235
        code, msg = reply(s, f"XSHADOWREQUEST {fake_name} {b64_dbid(fake_dbid)}")
        assert (code, base64.b64decode(msg.strip()).decode()) == (250, node_name)
        for i, guid in enumerate(guids):
            assert reply(s, f"MAIL FROM:<a@example.test> XSHADOW={guid}")[0] == 250
            assert reply(s, f"RCPT TO:<{FOREIGN}>")[0] == 250
            code, msg = s.data(f"From: a@example.test\r\nTo: {FOREIGN}\r\nSubject: shadow {i}\r\n"
                               f"Message-ID: <{guid}@fake>\r\n\r\nbody {i}\r\n".encode())
            assert code == 250 and msg.decode().startswith("2.6.0"), (code, msg)
        s.quit()

        def shadow_row() -> dict:
            rows = {r["primary"]: r for r in json_lines(invoke("shadow", "list", "--config", str(config),
                                                               "--json").stdout)}
            return rows.get(fake_name, {"shadows": 0, "shadow_safety_net": 0})

        def tracked(event: str) -> list[dict]:
            r = invoke("tracking", "search", "--config", str(config), "--json", "--event-id", event,
                       ok_codes=(0, 1))
            return json_lines(r.stdout) if r.exit_code == 0 else []

        assert shadow_row()["shadows"] == 2
        assert len(tracked("HARECEIVE")) == 2

        def heartbeats(n: int) -> None:
            start = fake.count("XQDISCARD")
            wait_for(lambda: fake.count("XQDISCARD") >= start + n, timeout=n * HEARTBEAT + 8,
                     what=f"{n} heartbeats (XQDISCARD) from the shadow node")

        # Only a malformed id: nothing discarded, the violation logged.
        heartbeats(3)
        assert fake.count("XSHADOW") >= 3 and fake.count("AUTH") >= 3
        row = shadow_row()
        assert (row["shadows"], row["shadow_safety_net"]) == (2, 0), row
        assert "protocol violation" in row["last_error"], row
        assert not tracked("HADISCARD")
        log_text = log_path.read_text(errors="replace")
        assert "protocol violation" in log_text and "not-a-guid" in log_text, log_text[-3000:]

        # A good id next to a malformed one: still nothing discarded (never discard on bad data).
        with fake.lock:
            fake.default_discard = [guids[0], "not-a-guid"]
        heartbeats(3)
        row = shadow_row()
        assert (row["shadows"], row["shadow_safety_net"]) == (2, 0), row
        assert not tracked("HADISCARD")

        # Control: a well-formed reply does discard (so the checks above could have failed).
        with fake.lock:
            fake.default_discard = []
            fake.next_discards = [[guids[0]]]
        wait_for(lambda: shadow_row()["shadow_safety_net"] == 1, timeout=HEARTBEAT + 8,
                 what="the well-formed discard to take effect")
        row = shadow_row()
        assert (row["shadows"], row["shadow_safety_net"]) == (1, 1), row
        # Recorded just after the discard: the exchange worked, the violation is history.
        wait_for(lambda: shadow_row()["last_error"] == "", timeout=2, what="a clean heartbeat to be recorded")
        hadiscard = one(tracked("HADISCARD"))
        assert hadiscard["source-context"] == f"ExplicitlyDiscarded;{guids[0]}"
        assert proc.poll() is None
    finally:
        fake.shutdown()
        fake.server_close()


# ------------------------------------------------------------------------------ 7. hop by hop

def test_a_peer_that_refuses_the_connection_is_named_once_in_the_recipients_error(cluster, sink):
    """node1, which holds MDB01, is down: node2's hop-by-hop attempt is deferred with the peer's
    transport address named once and the system's reason, not asyncio's text, which named the
    address a second time ("Connect call failed ('127.0.0.x', port)")."""
    sink.start()
    c = cluster(nodes=2, sites=1).start("node2")
    node1, node2 = c["node1"], c["node2"]
    queued_id(node2.swaks(LOCAL))

    def deferred() -> str:
        [m] = node2.messages(include_done=False)
        return m["last_error"]
    error = wait_for(deferred, timeout=15, what="node2's attempt to hand the message to node1")
    address = f"{node1.transport_host}:{node1.transport_port}"
    assert error == f"451 4.4.0 Unable to connect to {node1.name}: {address}: Connection refused", error


def test_hop_by_hop_delivery_to_mailbox_database_on_peer(cluster, sink):
    """docs/PROTOCOL.md 3: node3 hands alice's message to node1 (MDB01) with XSHADOW and keeps it until
    node1's discard. node1's mailbox queue is suspended for a while so that "keeps it" is observed,
    not guessed."""
    sink.start()
    c = cluster().start()
    node1, node3 = c["node1"], c["node3"]

    # A first message straight to node1 creates its mailbox:MDB01 queue; then hold that queue.
    queued_id(node1.swaks(LOCAL))
    wait_for(lambda: len(node1.maildir(LOCAL)) == 1, timeout=10, what="the first delivery on node1")
    invoke("queue", "suspend", "mailbox:MDB01", "--config", node1.config)

    qid3 = queued_id(node3.swaks(LOCAL, "--header", "Subject: hop by hop"))
    netid = netid_of(node3, qid3)
    send = wait_for(lambda: node3.tracking(event_id="SEND", network_message_id=netid), timeout=10,
                    what="node3 to send to node1")
    assert one(send)["recipient-address"] == LOCAL
    received = one(wait_for(lambda: node1.tracking(event_id="RECEIVE", network_message_id=netid), timeout=5,
                            what="node1 RECEIVE"))
    assert received["source-context"] == "transport"
    assert received["network-message-id"] == netid  # the same id on both nodes

    # node1 has not processed it: several heartbeats (discard exchanges with node1) later, node3
    # still holds its copy.
    node3.wait_heartbeats(node1.name, 4)
    assert "HADISCARD" not in node3.events(netid)
    held = one([m for m in node3.messages() if m["network_message_id"] == netid], "node3's copy")
    assert held["status"] != "SafetyNet", held
    assert "DELIVER" not in node1.events(netid)

    invoke("queue", "resume", "mailbox:MDB01", "--config", node1.config)
    deliver = one(wait_for(lambda: node1.tracking(event_id="DELIVER", network_message_id=netid), timeout=5,
                           what="node1 DELIVER"))
    assert deliver["recipient-address"] == LOCAL
    files = [p for p in node1.maildir(LOCAL) if f".{netid}." in p.name]
    assert len(files) == 1 and b"Subject: hop by hop" in files[0].read_bytes()

    hadiscard = one(wait_for(lambda: node3.tracking(event_id="HADISCARD", network_message_id=netid),
                             timeout=HEARTBEAT + 5, what="node3 HADISCARD after node1's discard"))
    assert hadiscard["source-context"].startswith("ExplicitlyDiscarded;")
    assert hadiscard["client-hostname"] == node1.name
    assert hadiscard["date-time"] >= deliver["date-time"]
    assert one([m for m in node3.messages() if m["network_message_id"] == netid])["status"] == "SafetyNet"
    assert not sink.messages(), "alice's mail left the boundary"

    # node3 also shadowed the message it received from the client (in the other site: node1 or
    # node2); once node3 processed it, that shadow is discarded too. One id on every node.
    holder = one([n for n in (c["node1"], c["node2"]) if "HARECEIVE" in n.events(netid)], "node3's shadow holder")
    wait_for(lambda: "HADISCARD" in holder.events(netid), timeout=HEARTBEAT + 5,
             what=f"{holder.short} to discard node3's shadow")
    assert {"RECEIVE", "HAREDIRECT", "SEND", "HADISCARD"} <= set(node3.events(netid))
    assert {"RECEIVE", "DELIVER"} <= set(node1.events(netid))
    assert not node1.tracking(event_id="HAREDIRECTFAIL", network_message_id=netid)
    assert not node1.tracking(event_id="HAREDIRECT", network_message_id=netid), \
        "a message from a boundary peer needs no new shadow"


def test_bifurcated_message_released_only_when_every_fork_is_processed(cluster, sink):
    """docs/PROTOCOL.md 3: alice's fork goes to node1 (hop by hop), bob's to the sink. node1's discard
    of alice's fork is not enough for node3 to let go of the message while bob's fork is pending
    (sink down); when bob is delivered too, node3's copy and its own shadow are released."""
    c = cluster().start()
    node1, node3 = c["node1"], c["node3"]
    netid = netid_of(node3, queued_id(node3.swaks(f"{LOCAL},{FOREIGN}")))

    wait_for(lambda: node1.tracking(event_id="DELIVER", network_message_id=netid), timeout=10,
             what="node1 to deliver alice's fork")
    wait_for(lambda: "DEFER" in node3.events(netid), timeout=10, what="bob's fork to be deferred")
    # node1's discard of alice's fork has reached node3: its fork row is gone (node3 decides about
    # the message in that same commit).
    wait_for(lambda: node3.forks_held_for(node1.name) == 0, timeout=HEARTBEAT + 10,
             what="node1's discard of alice's fork to reach node3 (its shadow_forks row)")
    msg = one([m for m in node3.messages() if m["network_message_id"] == netid])
    assert msg["status"] not in ("SafetyNet", "Removed"), msg
    holder = one([n for n in (c["node1"], c["node2"]) if "HARECEIVE" in n.events(netid)], "node3's shadow holder")
    # Since then, the holder of node3's own shadow has asked node3 for discards (twice).
    holder.wait_heartbeats(node3.name, 2)
    assert "HADISCARD" not in holder.events(netid), "node3's shadow was released with a fork still pending"
    assert holder.shadow_row(node3.name)["shadows"] == 1

    sink.start()
    wait_for(lambda: "SENDEXTERNAL" in node3.events(netid), timeout=10, what="bob's fork to reach the sink")
    wait_for(lambda: one([m for m in node3.messages() if m["network_message_id"] == netid])["status"]
             == "SafetyNet", timeout=5, what="node3's copy to reach the Primary Safety Net")
    wait_for(lambda: "HADISCARD" in holder.events(netid), timeout=HEARTBEAT + 5,
             what=f"{holder.short} to discard node3's shadow")
    assert len(sink.messages()) == 1
    assert [p for p in node1.maildir(LOCAL) if f".{netid}." in p.name]


def test_every_session_to_the_primary_asks_for_discards(cluster, sink):
    """docs/PROTOCOL.md 4: the shadow runs XQDISCARD "on every session it opens to the primary for any
    reason", not only on its heartbeat. node3's heartbeat is a minute here, so only the hop-by-hop
    session of a second message can bring back the discard of the first."""
    sink.start()
    c = cluster()
    node1, node3 = c["node1"], c["node3"]
    node3.set("shadow_redundancy", "shadow_heartbeat_frequency", 60)
    node3.set("shadow_redundancy", "shadow_resubmit_time_span", 3600)  # not shorter than one heartbeat
    node3.set("shadow_redundancy", "shadow_message_auto_discard_interval", 3600)
    c.start()

    first = netid_of(node3, queued_id(node3.swaks(LOCAL)))
    wait_for(lambda: node1.tracking(event_id="DELIVER", network_message_id=first), timeout=10,
             what="node1 to deliver the first message")
    # Waiting for absence: no heartbeat from node3 in this time (it is a minute), so there is
    # nothing to observe; the discard must not come back without a session to node1.
    time.sleep(4 * HEARTBEAT)
    assert "HADISCARD" not in node3.events(first)

    second = netid_of(node3, queued_id(node3.swaks(LOCAL)))
    wait_for(lambda: node3.tracking(event_id="SEND", network_message_id=second), timeout=10,
             what="node3 to hand the second message to node1")
    hadiscard = one(wait_for(lambda: node3.tracking(event_id="HADISCARD", network_message_id=first),
                             timeout=5, what="the hop session to bring back the first discard"))
    assert hadiscard["source-context"].startswith("ExplicitlyDiscarded;")


TCP_STATES = {"01": "ESTABLISHED", "08": "CLOSE_WAIT", "09": "LAST_ACK"}


def sockets_to(pid: int, port: int) -> list[str]:
    """The TCP states of the sockets process ``pid`` holds open to remote ``port`` (its fds'
    socket inodes, looked up in /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    states = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[9] in inodes and int(f[2].rsplit(":", 1)[1], 16) == port:
            states.append(TCP_STATES.get(f[3], f[3]))
    return states


def test_an_idle_pooled_session_the_peer_closed_is_closed_here_too(cluster):
    """The pool keeps idle sessions for the next shadow copy; one the peer closed (here its
    connection_inactivity_timeout of 3 s) is closed by the pool within about a second, not left
    in CLOSE-WAIT until the next copy to that peer (an idle node held 14 such sockets)."""
    c = cluster(nodes=2, sites=1, overrides={"frontend": {"connection_inactivity_timeout": 3}})
    c.start()
    node1, node2 = c["node1"], c["node2"]
    qid = queued_id(node1.swaks(FOREIGN))  # its shadow copy goes to node2 over a pooled session
    assert "ESTABLISHED" in sockets_to(node1.proc.pid, node2.transport_port)
    assert one([m for m in node1.messages() if m["id"] == qid])["redundancy"] == "shadowed"
    wait_for(lambda: sockets_to(node1.proc.pid, node2.transport_port) == [], timeout=10, interval=0.1,
             what="node1 to close the session node2 closed (not left in CLOSE-WAIT)")
    # The next copy opens a new session.
    again = queued_id(node1.swaks(FOREIGN))
    assert one([m for m in node1.messages() if m["id"] == again])["redundancy"] == "shadowed"


# ------------------------------------------------------------------------------ 8. transportd cluster up

def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    except OSError:
        return False


def test_cluster_up_runs_a_working_cluster_and_stops_it(procs, tmp_path):
    base = random.randint(20, 200)
    data = tmp_path / "cl"
    fport, tport, sport = free_port(), free_port(), free_port()
    sink_addr = f"127.0.0.{base + 3}:{sport}"
    with open(tmp_path / "cluster.out", "wb") as out:
        proc = procs.add(subprocess.Popen(
            [sys.executable, "-m", "transportd", "cluster", "up", "--data-dir", str(data), "--ip-base", str(base),
             "--frontend-port", str(fport), "--transport-port", str(tport), "--sink", sink_addr,
             "--set", f"shadow_redundancy.shadow_heartbeat_frequency={HEARTBEAT}",
             "--set", "delivery.queue_poll_interval=0.2"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    def output() -> str:
        return (tmp_path / "cluster.out").read_text(errors="replace")

    try:
        doc = wait_for(lambda: (data / "cluster.json").exists() and json.loads((data / "cluster.json").read_text()),
                       timeout=15, what="cluster.json")
        assert [n["name"] for n in doc["nodes"]] == [fqdn(f"node{i}") for i in (1, 2, 3)]
        assert [n["site"] for n in doc["nodes"]] == ["site-a", "site-a", "site-b"]
        for n in doc["nodes"]:
            host, _, port = n["frontend"].rpartition(":")
            assert host.startswith("127.") and int(port) == fport
            wait_port(host, int(port), proc=proc)
            thost, _, tp = n["transport"].rpartition(":")
            wait_port(thost, int(tp), proc=proc)
        wait_port(f"127.0.0.{base + 3}", sport, proc=proc)
        sink_new = Path(doc["sink"]["mail_dir"])
        assert sink_new == (data / "sink" / "new").resolve()
        node1_host = doc["nodes"][0]["frontend"].rpartition(":")[0]
        node1_cfg, node3_cfg = doc["nodes"][0]["config"], str(data / "node3.toml")

        def node3_shadows() -> dict:
            r = run_cli("shadow", "list", "--config", node3_cfg, "--json")
            assert r.returncode == 0, r.stderr
            rows = {x["primary"]: x for x in json_lines(r.stdout)}
            return rows.get(fqdn("node1"), {"shadows": 0, "shadow_safety_net": 0})

        r = swaks(fport, "--from", "carol@example.test", "--to", FOREIGN, server=node1_host)
        queued_id(r)
        wait_for(lambda: len(list(sink_new.iterdir())) == 1, timeout=10, what="the message in the sink")
        status = run_cli("cluster", "status", "--data-dir", str(data), "--json")
        assert status.returncode == 0, status.stderr
        rows = json_lines(status.stdout)
        assert [r["name"] for r in rows] == [fqdn(f"node{i}") for i in (1, 2, 3)]
        assert all(r["alive"] for r in rows), rows
        wait_for(lambda: node3_shadows()["shadow_safety_net"] == 1, timeout=10,
                 what="node3's shadow of the first message to be discarded")

        # Hold node1's smart-host queue: the next shadow stays on node3 until the queue resumes.
        queue = f"smarthost:{sink_addr}"
        assert run_cli("queue", "suspend", queue, "--config", node1_cfg).returncode == 0
        queued_id(swaks(fport, "--from", "carol@example.test", "--to", FOREIGN, server=node1_host))
        held = node3_shadows()
        assert (held["shadows"], held["shadow_safety_net"]) == (1, 1), held
        assert run_cli("queue", "resume", queue, "--config", node1_cfg).returncode == 0
        wait_for(lambda: len(list(sink_new.iterdir())) == 2, timeout=10, what="the second message in the sink")
        wait_for(lambda: (x := node3_shadows())["shadows"] == 0 and x["shadow_safety_net"] == 2, timeout=10,
                 what="node3's second shadow to be discarded")
        assert "[node1]" in output() and "[node3]" in output()
    except BaseException:
        sys.stderr.write(output()[-20000:])
        raise

    pids = [n["pid"] for n in doc["nodes"]] + [doc["sink"]["pid"]]
    assert all(pids) and all(running(p) for p in pids)

    # A node that dies shows as not alive (status is not a copy of cluster.json).
    os.kill(doc["nodes"][1]["pid"], signal.SIGKILL)
    wait_for(lambda: "[cluster] node2 exited with code -9" in output(), timeout=5, what="the cluster to notice")
    rows = json_lines(run_cli("cluster", "status", "--data-dir", str(data), "--json").stdout)
    assert [r["alive"] for r in rows] == [True, False, True], rows
    # -d before the command names the cluster's folder too (it was ignored for ./data/cluster).
    assert json_lines(run_cli("--json", "-d", str(data), "cluster", "status").stdout) == rows
    pids.remove(doc["nodes"][1]["pid"])
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0, output()[-5000:]
    assert time.monotonic() - started < 15
    left = [p for p in pids if running(p)]
    assert not left, f"processes still running after the cluster stopped: {left}"
    assert "[cluster] stopping" in output()


def test_cluster_up_stops_with_exit_1_when_no_node_could_start(procs, tmp_path):
    """Every node's frontend address already taken: the nodes exit, and so does ``cluster up``
    (exit 1, saying why) instead of running on with nothing to serve mail."""
    import socket
    base = random.randint(20, 200)
    fport, tport, sport = free_port(), free_port(), free_port()
    args = ["--ip-base", str(base), "--frontend-port", str(fport), "--transport-port", str(tport),
            "--sink", f"127.0.0.{base + 3}:{sport}"]
    specs = run_cli("cluster", "config", "--out", str(tmp_path / "configs"), *args)
    assert specs.returncode == 0, specs.stderr
    taken = []
    for line in specs.stdout.splitlines():  # "<config>  <name>  <site>  frontend H:P  transport H:P"
        host, _, port = line.split("frontend ")[1].split()[0].rpartition(":")
        s = socket.socket()
        s.bind((host, int(port)))
        s.listen()
        taken.append(s)
    assert len(taken) == 3
    try:
        with open(tmp_path / "cluster.out", "wb") as out:
            proc = procs.add(subprocess.Popen(
                [sys.executable, "-m", "transportd", "cluster", "up", "--data-dir", str(tmp_path / "cl"), *args],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            code = proc.wait(timeout=60)
    finally:
        for s in taken:
            s.close()
    output = (tmp_path / "cluster.out").read_text(errors="replace")
    assert code == 1, output[-5000:]
    assert "[cluster] every node has exited" in output and "[cluster] stopping" in output, output[-5000:]
    assert "Traceback" not in output, output[-5000:]
    assert output.count(f":{fport}: cannot listen: Address already in use") == 3, output[-5000:]
    assert "cannot start: frontend.listen 127.0.0." in output, output[-5000:]


def test_cluster_up_on_a_running_clusters_folder_is_refused_and_status_follows_the_data_dir_lock(procs, tmp_path):
    """A second ``cluster up`` on the folder of a running cluster (whole or in part) stops with
    one line naming the running nodes and their pids, before writing anything: it rewrote the
    configs the running nodes were started with (a --set of the first run undone) and
    cluster.json with the pids of new nodes that exited at once, so ``cluster status`` showed
    every serving node dead. ``cluster status`` shows a node restarted by hand (``serve``) alive,
    with its pid: a node runs where its data dir's lock is held, whoever started it."""
    base = random.randint(20, 200)
    data = tmp_path / "cl"
    fport, tport, sport = free_port(), free_port(), free_port()
    args = ["--data-dir", str(data), "--ip-base", str(base), "--frontend-port", str(fport),
            "--transport-port", str(tport), "--sink", f"127.0.0.{base + 3}:{sport}"]
    with open(tmp_path / "cluster.out", "wb") as out:
        proc = procs.add(subprocess.Popen(
            [sys.executable, "-m", "transportd", "cluster", "up", *args,
             "--set", "shadow_redundancy.shadow_resubmit_time_span=30s"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    def output() -> str:
        return (tmp_path / "cluster.out").read_text(errors="replace")

    try:
        doc = wait_for(lambda: (data / "cluster.json").exists() and json.loads((data / "cluster.json").read_text()),
                       timeout=15, what="cluster.json")
        for n in doc["nodes"]:
            host, _, port = n["frontend"].rpartition(":")
            wait_port(host, int(port), proc=proc)
    except BaseException:
        sys.stderr.write(output()[-20000:])
        raise
    pids = {n["short"]: n["pid"] for n in doc["nodes"]}
    written = {p.name: p.read_text() for p in data.iterdir() if p.is_file()}
    assert 'shadow_resubmit_time_span = "30s"' in written["node1.toml"]

    def refused(*needles: str) -> str:
        for again in (["cluster", "up", *args], ["cluster", "config", "--out", str(data), *args[2:]]):
            line = assert_one_error_line(run_cli(*again), 1, f"a cluster runs in {data}", *needles)
            assert {p.name: p.read_text() for p in data.iterdir() if p.is_file()} == written, again
        return line

    refused(*(f"{short} (pid {pid})" for short, pid in pids.items()))
    assert all(r["alive"] for r in json_lines(run_cli("cluster", "status", "-d", str(data), "--json").stdout))

    # Partly running: node1 killed; still refused (it started node1 alone and went on degraded).
    os.kill(pids["node1"], signal.SIGKILL)
    wait_for(lambda: "[cluster] node1 exited with code -9" in output(), timeout=10, what="the cluster to notice")
    line = refused(f"node2 (pid {pids['node2']})", f"node3 (pid {pids['node3']})")
    assert "node1" not in line, line

    # node1 started again by hand on its config: alive, with the pid of the process that serves.
    by_hand = procs.add(subprocess.Popen([sys.executable, "-m", "transportd", "serve", "--config",
                                          str(data / "node1.toml")],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_port(doc["nodes"][0]["frontend"].rpartition(":")[0], fport, proc=by_hand)
    rows = json_lines(run_cli("cluster", "status", "-d", str(data), "--json").stdout)
    assert [(r["alive"], r["pid"]) for r in rows] == [(True, by_hand.pid), (True, pids["node2"]),
                                                     (True, pids["node3"])], rows
    refused(f"node1 (pid {by_hand.pid})")
    by_hand.send_signal(signal.SIGTERM)
    assert by_hand.wait(timeout=30) == 0
    rows = json_lines(run_cli("cluster", "status", "-d", str(data), "--json").stdout)
    assert [(r["alive"], r["pid"]) for r in rows] == [(False, None), (True, pids["node2"]),
                                                     (True, pids["node3"])], rows
