"""Security defences (docs/security.md), each shown against a real node process.

- no open relay: swaks from an untrusted address to a foreign domain, on both connectors
- the command-rate limit per source IP (frontend.max_command_rate): unit tests with an
  injected clock, then a flood over a real socket
- slow-loris clients (a byte at a time, never finishing) are cut off by the absolute
  connection timeout, in a command line and inside DATA
- peer trust: a wrong cluster credential, an unknown name, or a peer claiming another
  peer's name is refused and logged; forged XQDISCARD ids (another primary's shadow ids
  sent by a member) discard nothing but that member's own shadows
- AUTH: PLAIN's authorization identity is the user's own or none (RFC 4616); an over-long
  response line after 334 fails the exchange (500 5.5.6) and the session goes on

STARTTLS on both connectors and peers requiring TLS are in test_receive.py
(test_starttls_then_auth_allows_relay, test_require_tls) and test_transport_tls.py
(test_shadow_over_verified_tls_and_plaintext_peers_refused).
"""

from __future__ import annotations

import base64
import random
import re
import smtplib
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid

import pytest
from clusters import (
    FAST,
    FOREIGN,
    FakePrimary,
    auth_plain,
    b64_dbid,
    merge,
    reply,
    smtp,
    write_node_config,
)
from conftest import free_port, swaks, wait_for, wait_port

from transportd.devtools import cluster as cluster_mod
from transportd.smtp.server import CommandRateLimiter

PEER = "peer1.transportd.test"
SECRET = "security-secret-" + uuid.uuid4().hex[:8]


# ------------------------------------------------------------------------------ helpers

def raw(port: int, source: str = "127.0.0.1", host: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection((host, port), timeout=10, source_address=(source, 0))
    assert s.recv(1000).startswith(b"220 ")
    return s


def read_all(s: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or the time is up)."""
    s.settimeout(0.2)
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return out


def peer_node(make_node, **overrides):
    """A node with a transport connector and one configured peer (no process behind it)."""
    tport = free_port()
    node = make_node(overrides=merge({"transport": {"listen": f"127.0.0.1:{tport}"},
                                      "cluster": {"secret": SECRET}}, overrides))
    node.config_path.write_text(cluster_mod.render_toml(
        node.sections, [{"name": PEER, "site": "site-b", "transport": "127.0.0.1:9"}]))
    node.transport_port = tport
    node.start()
    wait_port("127.0.0.1", tport, proc=node.proc)
    return node


# ------------------------------------------------------------------------------ open relay

@pytest.mark.parametrize("connector", ["frontend", "transport"])
def test_no_open_relay_for_untrusted_clients(make_node, sink, connector):
    sink.start()
    node = peer_node(make_node, routing={"smart_host": sink.address})
    port = node.port if connector == "frontend" else node.transport_port
    r = swaks(port, "--local-interface", "127.0.0.2", "--from", "spammer@remote.test",
              "--to", "victim@foreign.test")
    assert "<** 550 5.7.1 Relaying denied" in r.stdout, r.stdout
    assert " queued as " not in r.stdout and r.returncode != 0
    # The same client may send to an accepted domain; a trusted one may relay (the rule is not "refuse all").
    assert " queued as " in swaks(port, "--local-interface", "127.0.0.2", "--from", "x@remote.test",
                                  "--to", "alice@example.test").stdout
    assert " queued as " in swaks(port, "--from", "insider@example.test", "--to", "carol@foreign.test").stdout
    time.sleep(1.5)  # waiting for absence: nothing for the victim may reach the sink
    assert not any(b"victim@foreign.test" in m for m in sink.messages())
    assert "relay denied: 127.0.0.2 -> victim@foreign.test" in node.log()


# ------------------------------------------------------------------------------ command-rate limit

def test_rate_limiter_token_bucket():
    lim = CommandRateLimiter(5)  # 5/s, burst 10
    assert all(lim.allow("a", 0.0) for _ in range(10))
    assert not lim.allow("a", 0.0)
    assert lim.allow("b", 0.0), "sources are limited separately"
    assert not lim.allow("a", 0.1)        # half a token refilled
    assert lim.allow("a", 0.3)            # 1.5 tokens since t=0.0 (one spent now)
    assert not lim.allow("a", 0.3)
    assert sum(lim.allow("a", 100.0) for _ in range(20)) == 10, "refills to the burst, not beyond"


def test_rate_limiter_forgets_idle_sources_when_full():
    lim = CommandRateLimiter(1, max_sources=3)
    for ip in ("a", "b", "c"):
        lim.allow(ip, 0.0)
    lim.allow("d", 100.0)  # a, b, c have refilled: forgotten
    assert set(lim.buckets) == {"d"}
    lim2 = CommandRateLimiter(1, burst=2, max_sources=2)
    lim2.allow("a", 0.0)
    lim2.allow("a", 0.0)  # empty
    lim2.allow("b", 0.0)
    lim2.allow("c", 0.1)  # a has not refilled: kept (a flooding source cannot reset itself)
    assert "a" in lim2.buckets


def test_command_flood_from_one_address_is_cut_off(make_node):
    node = make_node(overrides={"frontend": {"max_command_rate": 5}}).start()
    time.sleep(1.0)  # kept: no daemon scan is awaited here (the buckets depend on the clock alone)
    # A normal client under the limit is served.
    r = swaks(node.port, "--from", "a@remote.test", "--to", "alice@example.test")
    assert " queued as " in r.stdout, r.stdout
    time.sleep(2.0)  # part of the scenario: 127.0.0.1's bucket refills to its burst (a clock)
    flood = raw(node.port)
    flood.sendall(b"EHLO flood.test\r\n" + b"NOOP\r\n" * 40)
    got = read_all(flood, 5)
    flood.close()
    assert b"421 4.7.0 Too many commands from your address, slow down" in got, got[-300:]
    assert got.count(b"250 2.0.0 OK") < 15, "the flood was answered far beyond the burst"
    # Another address is not affected; the flooding one gets service again once its bucket refills.
    other = raw(node.port, source="127.0.0.2")
    other.sendall(b"EHLO other.test\r\nNOOP\r\nQUIT\r\n")
    assert b"250 2.0.0 OK" in read_all(other, 3)
    time.sleep(2.5)  # part of the scenario: the flooding address's bucket refills (a clock)
    again = raw(node.port)
    again.sendall(b"EHLO again.test\r\nHELP\r\nHELP MAIL\r\nQUIT\r\n")
    got = read_all(again, 3)
    assert b"221 2.0.0" in got
    # the limit wraps every verb; HELP still lists them and their syntax (it lost both once)
    assert re.search(rb"214 2\.0\.0 Supported commands: [^\r]*\bMAIL\b", got) or \
        re.search(rb"250 2\.0\.0 Supported commands: [^\r]*\bMAIL\b", got), got
    assert b"Syntax: MAIL FROM: <address>" in got, got
    assert node.alive
    assert "over frontend.max_command_rate" in node.log()


def test_command_rate_limit_off_by_default(make_node):
    node = make_node().start()
    s = raw(node.port)
    s.sendall(b"EHLO fast.test\r\n" + b"RSET\r\n" * 200 + b"QUIT\r\n")
    got = read_all(s, 10)
    assert got.count(b"250 2.0.0 OK") == 200 and b"221 2.0.0" in got


def test_transport_connector_holds_a_client_that_is_no_peer_to_the_frontend_limits(make_node):
    """frontend.max_header_size and frontend.max_command_rate guard the transport connector too,
    against every session that has not authenticated as a boundary peer (anyone may connect
    there); a peer is trusted (its node applied them when the message came in)."""
    node = peer_node(make_node, frontend={"max_header_size": "2KB", "max_command_rate": 5})
    time.sleep(1.0)  # kept: no daemon scan is awaited here (the buckets depend on the clock alone)
    big = b"Subject: big header\r\n" + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 70) for i in range(40)) + \
        b"\r\nbody\r\n"
    peer = smtp("127.0.0.1", node.transport_port, helo=PEER)
    try:
        assert auth_plain(peer, PEER, SECRET)[0] == 235
        for _ in range(30):  # a peer is not rate limited (5/s, burst 10)
            assert reply(peer, "NOOP")[0] == 250
        assert reply(peer, "MAIL FROM:<a@remote.test>")[0] == 250
        assert reply(peer, "RCPT TO:<alice@example.test>")[0] == 250
        code, text = peer.data(big)
        assert code == 250, text
    finally:
        peer.close()
    stranger = smtp("127.0.0.1", node.transport_port, helo="client.example", source="127.0.0.2")
    try:
        assert reply(stranger, "MAIL FROM:<a@remote.test>")[0] == 250
        assert reply(stranger, "RCPT TO:<alice@example.test>")[0] == 250
        assert stranger.data(big) == (552, b"5.3.4 Header size exceeds fixed maximum size")
    finally:
        stranger.close()
    time.sleep(2.5)  # part of the scenario: 127.0.0.2's bucket refills (a clock)
    flood = raw(node.transport_port, source="127.0.0.2")
    flood.sendall(b"EHLO flood.test\r\n" + b"NOOP\r\n" * 40)
    got = read_all(flood, 5)
    flood.close()
    assert b"421 4.7.0 Too many commands from your address, slow down" in got, got[-300:]
    assert node.alive


# ------------------------------------------------------------------------------ slow loris

@pytest.mark.parametrize("where", ["command", "data"])
def test_slow_loris_is_disconnected_by_the_connection_timeout(make_node, where):
    node = make_node(overrides={"frontend": {"connection_timeout": 3, "connection_inactivity_timeout": 2}}).start()
    s = raw(node.port)
    if where == "data":
        s.sendall(b"EHLO slow.test\r\nMAIL FROM:<a@remote.test>\r\nRCPT TO:<alice@example.test>\r\nDATA\r\n")
        time.sleep(0.5)  # the pipelined replies, up to the 354, arrive together for the one recv
        assert b"354 " in s.recv(4096)
    trickle = b"Subject: never ending\r\n" if where == "data" else b"MAIL FROM:<" + b"x" * 200
    t0 = time.monotonic()
    closed_after = None
    got = b""
    for byte in trickle * 5:  # one byte every 0.25 s: never idle for the inactivity timeout
        try:
            s.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - t0
            break
        s.settimeout(0.25)
        try:
            chunk = s.recv(4096)
            got += chunk
            if not chunk:
                closed_after = time.monotonic() - t0
                break
        except TimeoutError:
            pass
        except ConnectionResetError:
            closed_after = time.monotonic() - t0
            break
        if time.monotonic() - t0 > 10:
            break
    s.close()
    assert closed_after is not None, "the slow client was never disconnected"
    assert 2.0 <= closed_after <= 6.0, closed_after
    assert b"421 4.4.2" in got, got
    assert node.alive
    assert not node.cli_json("message", "list", "--all"), "a slow-loris message was queued"


# ------------------------------------------------------------------------------ peer trust

def test_peer_trust_refusals_are_logged(make_node):
    # Shadow redundancy on: a node with it off offers (and stores) no shadows at all.
    node = peer_node(make_node, shadow_redundancy={"shadow_redundancy_enabled": True})
    port = node.transport_port
    for user, password, why in ((PEER, SECRET + "x", "wrong credential"),
                                ("intruder.transportd.test", SECRET, "unknown name")):
        s = smtp("127.0.0.1", port)
        assert auth_plain(s, user, password)[0] == 535, why
        code, _ = reply(s, f"XSHADOWREQUEST {user} {b64_dbid(str(uuid.uuid4()))}")
        assert code == 550, why
        code, _ = reply(s, f"MAIL FROM:<a@b.test> XSHADOW={uuid.uuid4()}")
        assert code == 550, why
        s.quit()
    s = smtp("127.0.0.1", port)
    assert auth_plain(s, PEER, SECRET)[0] == 235
    assert reply(s, f"XSHADOWREQUEST other.transportd.test {b64_dbid(str(uuid.uuid4()))}")[0] == 550
    assert reply(s, f"XSHADOW {base64.b64encode(b'other.transportd.test').decode()}")[0] == 550
    s.quit()
    wait_for(lambda: node.log().count("peer authentication failed") >= 2, timeout=5, what="the refusals in the log")
    log = node.log()
    assert "X-verb from unauthenticated session" in log
    assert f"XSHADOWREQUEST: peer {PEER} claims to be other.transportd.test" in log
    assert f"XSHADOW: peer {PEER} claims to be other.transportd.test" in log
    assert node.alive


def test_forged_discard_ids_from_another_member_discard_nothing_of_others(procs, sink, tmp_path):
    """Two (fake) primaries hold shadows on the node; one answers the heartbeat with the other's
    shadow ids and random ids: only shadows of the answering primary can ever be discarded."""
    base = random.randint(20, 200)
    node_ip = f"127.0.0.{base}"
    names = ["fake1.transportd.test", "fake2.transportd.test"]
    fakes = [FakePrimary((f"127.0.0.{base + 1 + i}", free_port()), n, str(uuid.uuid4())) for i, n in enumerate(names)]
    for f in fakes:
        f.default_discard = []
        threading.Thread(target=f.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        fport, tport = free_port(), free_port()
        config = tmp_path / "shadow.toml"
        sections = merge(FAST, {
            "node": {"name": "shadow.transportd.test", "site": "site-a", "data_dir": str(tmp_path / "data")},
            "frontend": {"listen": f"{node_ip}:{fport}"},
            "transport": {"listen": f"{node_ip}:{tport}"},
            "cluster": {"secret": SECRET},
            "routing": {"accepted_domains": ["example.test"], "trusted_networks": ["127.0.0.1/32"],
                        "smart_host": sink.address},
            "shadow_redundancy": {"shadow_redundancy_enabled": True, "shadow_resubmit_time_span": 3600},
        })
        write_node_config(config, sections, [
            {"name": n, "site": "site-b", "transport": f"{f.server_address[0]}:{f.server_address[1]}"}
            for n, f in zip(names, fakes)])
        with open(tmp_path / "shadow.log", "ab") as log:
            proc = procs.add(subprocess.Popen([sys.executable, "-m", "transportd", "serve", "--config", str(config)],
                                              stdout=log, stderr=subprocess.STDOUT))
        wait_port(node_ip, tport, proc=proc)
        guids: dict[str, list[str]] = {}
        for name, fake in zip(names, fakes):
            guids[name] = [str(uuid.uuid4()) for _ in range(2)]
            s = smtp(node_ip, tport, helo=name)
            assert auth_plain(s, name, SECRET)[0] == 235
            assert reply(s, f"XSHADOWREQUEST {name} {b64_dbid(fake.dbid)}")[0] == 250
            for g in guids[name]:
                assert reply(s, f"MAIL FROM:<a@example.test> XSHADOW={g}")[0] == 250
                assert reply(s, f"RCPT TO:<{FOREIGN}>")[0] == 250
                assert s.data(f"Subject: {g}\r\n\r\nbody\r\n".encode())[0] == 250
            s.quit()

        def held() -> dict[str, tuple[int, int]]:
            import json
            out = subprocess.run([sys.executable, "-m", "transportd", "shadow", "list", "--config", str(config),
                                  "--json"], capture_output=True, text=True, timeout=30).stdout
            rows = {r["primary"]: r for r in map(json.loads, filter(None, out.splitlines()))}
            return {n: (rows.get(n, {}).get("shadows", 0), rows.get(n, {}).get("shadow_safety_net", 0))
                    for n in names}

        assert held() == {names[0]: (2, 0), names[1]: (2, 0)}
        # fake2 forges: fake1's ids and random ones.
        with fakes[1].lock:
            fakes[1].default_discard = guids[names[0]] + [str(uuid.uuid4())]
        start = fakes[1].count("XQDISCARD")
        wait_for(lambda: fakes[1].count("XQDISCARD") >= start + 3, timeout=15, what="three heartbeats to fake2")
        assert held() == {names[0]: (2, 0), names[1]: (2, 0)}
        # Control: fake2's own id is discarded (the forged heartbeats were real exchanges).
        with fakes[1].lock:
            fakes[1].default_discard = []
            fakes[1].next_discards = [[guids[names[1]][0]]]
        wait_for(lambda: held()[names[1]] == (1, 1), timeout=15, what="fake2's own discard")
        assert held()[names[0]] == (2, 0)
        assert proc.poll() is None
    finally:
        for f in fakes:
            f.shutdown()
            f.server_close()


# ------------------------------------------------------------------------------ AUTH exchanges

USERS = {"alice": "alice-pw", "bob": "bob-pw"}


def auth_node(make_node, tmp_path):
    """A node whose frontend offers AUTH for alice and bob, on its implicit-TLS port too (returned),
    and relays for authenticated clients only."""
    trustme = pytest.importorskip("trustme")
    cert = trustme.CA().issue_cert("node1.transportd.test", "127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    tls_port = free_port()
    node = make_node(overrides={"frontend": {
        "tls_certificate": str(tmp_path / "cert.pem"), "tls_key": str(tmp_path / "key.pem"),
        "implicit_tls_listen": f"127.0.0.1:{tls_port}", "auth_users": USERS},
        "routing": {"trusted_networks": []}}).start()  # relay only after AUTH
    return node, tls_port  # ready: the node opens its listeners together


def tls_session(port: int) -> smtplib.SMTP_SSL:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    s = smtplib.SMTP_SSL("127.0.0.1", port, timeout=10, context=context)
    s.ehlo("client.test")
    return s


def plain_token(authzid: str, authcid: str, password: str) -> str:
    return base64.b64encode(f"{authzid}\0{authcid}\0{password}".encode()).decode("ascii")


def test_an_over_long_auth_response_line_fails_the_exchange_and_the_session_goes_on(make_node, tmp_path):
    """RFC 4954 section 4: a response line after 334 longer than the server takes is answered
    ``500 5.5.6`` and the AUTH exchange fails; the rest of the line is read and dropped (never
    taken for commands), and the session goes on: no internal error, no traceback."""
    node, tls_port = auth_node(make_node, tmp_path)
    s = tls_session(tls_port)
    try:
        for mechanism, line in (("PLAIN", b"A" * 1100), ("LOGIN", b"A" * 2000), ("LOGIN", b"QQ" * 10_000)):
            assert s.docmd("AUTH", mechanism)[0] == 334
            s.send(line + b"\r\n")
            assert s.getreply() == (500, b"5.5.6 Authentication Exchange line is too long"), (mechanism, len(line))
            assert s.noop() == (250, b"2.0.0 OK"), (mechanism, len(line))  # its reply, no 500 of a line's rest
        # A username within the limit, then an over-long password line: the same.
        assert s.docmd("AUTH", "LOGIN " + base64.b64encode(b"alice").decode())[0] == 334
        s.send(b"B" * 5000 + b"\r\n")
        assert s.getreply()[0] == 500
        assert s.login("alice", "alice-pw")[0] == 235
    finally:
        s.close()
    log = node.log()
    assert "Traceback" not in log and "SMTP session error" not in log and "Internal error" not in log
    assert node.alive


def test_auth_plain_takes_no_authorization_identity_other_than_its_own(make_node, tmp_path):
    """RFC 4616 section 2: the server verifies that the authentication identity may act as the
    authorization identity. No user may act as another here: ``bob\\0alice\\0<alice's password>``
    is refused (535 5.7.8), not taken as alice with bob dropped; an empty authzid, or the user's
    own name, is taken. On the transport connector a peer's name is compared as its AUTH
    compares it (case-insensitively)."""
    node, tls_port = auth_node(make_node, tmp_path)
    for authzid in ("bob", "Alice", "alice\0"):
        s = tls_session(tls_port)
        try:
            assert s.docmd("AUTH", "PLAIN " + plain_token(authzid, "alice", "alice-pw"))[0] in (535, 501), authzid
            assert s.docmd("MAIL", "FROM:<alice@remote.test>")[0] == 250
            assert s.docmd("RCPT", "TO:<carol@foreign.test>")[0] == 550, authzid  # not authenticated
        finally:
            s.close()
    s = tls_session(tls_port)
    try:
        assert s.docmd("AUTH", "PLAIN " + plain_token("bob", "alice", "alice-pw")) == \
            (535, b"5.7.8 Authentication credentials invalid")
        assert s.docmd("AUTH", "PLAIN")[0] == 334  # the initial response after a 334, the same rule
        assert s.docmd(plain_token("bob", "alice", "alice-pw"))[0] == 535
        assert s.docmd("AUTH", "PLAIN " + plain_token("alice", "alice", "alice-pw"))[0] == 235
    finally:
        s.close()
    s = tls_session(tls_port)
    try:
        assert s.docmd("AUTH", "PLAIN " + plain_token("", "bob", "bob-pw"))[0] == 235
    finally:
        s.close()
    assert "Traceback" not in node.log()

    peer = peer_node(lambda **kw: make_node("node2", **kw))
    for authzid, code in (("other.transportd.test", 535), (PEER.upper(), 235), ("", 235)):
        s = smtp("127.0.0.1", peer.transport_port)
        try:
            assert reply(s, "AUTH PLAIN " + plain_token(authzid, PEER, SECRET))[0] == code, authzid
        finally:
            s.close()
