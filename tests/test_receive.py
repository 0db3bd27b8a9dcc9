"""The frontend receive connector seen from the wire.

Real daemon processes on 127.0.0.1, real peers (swaks, smtplib, raw sockets):
EHLO keywords, relay control, size / line / recipient / connection limits,
timeouts, garbage input, STARTTLS and AUTH, clients that vanish mid-DATA, bad
configuration, and (in-process) the rule that our own failures are 451 4.3.0.
"""

from __future__ import annotations

import asyncio
import re
import smtplib
import socket
import ssl
import struct
import subprocess
import sys
import time

import pytest
from conftest import free_port, queued_id, silent_peer, swaks, wait_for, write_toml

NODE_NAME = "node1.transportd.test"
ENHANCED = re.compile(r"^\d{3} [245]\.\d{1,3}\.\d{1,3} ")
LEAK = re.compile(r"Error|Exception|Traceback|\(\w+Error\)|\w+Error\b|\w+Exception\b")


# --------------------------------------------------------------------------- helpers

class Raw:
    """A byte-level SMTP client on a real socket."""

    def __init__(self, port: int, source: str = "127.0.0.1", timeout: float = 5.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                             source_address=(source, 0))
        self.buf = b""
        self.greeting = self.reply()

    def send(self, data: bytes | str) -> None:
        self.sock.sendall(data.encode() if isinstance(data, str) else data)

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError(f"connection closed; unread {self.buf!r}")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def reply(self) -> list[str]:
        """One (possibly multi-line) reply; every line must be clean printable ASCII."""
        lines = []
        while True:
            raw = self._line()
            assert re.fullmatch(rb"\d{3}[ -][\x20-\x7e]*", raw), f"malformed reply line {raw!r}"
            lines.append(raw.decode("ascii"))
            if raw[3:4] == b" ":
                return lines

    def cmd(self, line: bytes | str) -> str:
        """Send one command line, return the final line of its reply."""
        self.send((line.encode() if isinstance(line, str) else line) + b"\r\n")
        return self.reply()[-1]

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True when the server closes the connection (EOF) within timeout."""
        self.sock.settimeout(timeout)
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return True
                self.buf += chunk
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()

    def abort(self) -> None:
        """Close with RST (SO_LINGER 0) instead of FIN."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def assert_reply(reply: str, code: int, enhanced: str) -> None:
    assert reply.startswith(f"{code} {enhanced} "), f"expected {code} {enhanced}, got {reply!r}"


def messages(node) -> list[dict]:
    """Every primary message the node holds, queued or already delivered."""
    return node.cli_json("message", "list", "--all")


def send_one(c: Raw, sender: str, rcpts: list[str], body: bytes) -> str:
    assert_reply(c.cmd(f"MAIL FROM:<{sender}>"), 250, "2.1.0")
    for r in rcpts:
        assert_reply(c.cmd(f"RCPT TO:<{r}>"), 250, "2.1.5")
    assert c.cmd("DATA").startswith("354 ")
    c.send(body + b".\r\n")
    return c.reply()[-1]


def body_of(size: int, subject: str = "x") -> bytes:
    """A dot-terminated-ready message of exactly `size` octets (as counted by the server)."""
    head = f"From: a@remote.test\r\nSubject: {subject}\r\n\r\n".encode()
    lines, n = [], size - len(head)
    while n > 0:
        take = min(n, 78)
        if take < 3:  # never leave a line too short to hold its CRLF
            lines[-1] = lines[-1][:-2] + b"y" * take + b"\r\n"
            break
        lines.append(b"y" * (take - 2) + b"\r\n")
        n -= take
    data = head + b"".join(lines)
    assert len(data) == size
    return data


def ehlo(c: Raw, name: str = "client.test") -> list[str]:
    c.send(f"EHLO {name}\r\n")
    lines = c.reply()
    assert lines[-1].startswith("250 "), lines
    return lines


# --------------------------------------------------------------------------- 1. EHLO / HELO

def test_ehlo_advertises_extensions_without_tls_or_auth(make_node):
    node = make_node(overrides={"frontend": {"max_message_size": 123456}}).start()
    c = Raw(node.port)
    assert c.greeting[0].startswith(f"220 {NODE_NAME} ")
    lines = ehlo(c)
    assert lines == [f"250-{NODE_NAME}", "250-SIZE 123456", "250-8BITMIME", "250-SMTPUTF8",
                     "250-PIPELINING", "250-CHUNKING", "250-DSN", "250-ENHANCEDSTATUSCODES", "250 HELP"]
    keywords = {l[4:].split()[0].upper() for l in lines[1:]}
    assert not keywords & {"STARTTLS", "AUTH"}
    # Without a certificate neither STARTTLS nor AUTH can be used.
    # A permanent answer (not 454 "try later"), as Postfix gives where neither is configured.
    assert c.cmd("STARTTLS") == "502 5.3.3 Command not implemented"
    assert c.cmd("AUTH PLAIN AGFsaWNlAHMzY3JldA==") == "503 5.5.1 Error: authentication not enabled"
    # HELP names every command served (STARTTLS and AUTH only where they can be used) and the syntax of
    # one: 214, the help reply (RFC 5321 4.2, 4.3.2); a topic that is no command here is 504.
    help_line = c.cmd("HELP")
    assert help_line.startswith("214 2.0.0 Supported commands: "), help_line
    assert set(help_line.split(": ", 1)[1].split()) >= {"BDAT", "DATA", "EHLO", "HELO", "HELP", "MAIL", "NOOP",
                                                        "QUIT", "RCPT", "RSET", "VRFY"}, help_line
    assert not {"STARTTLS", "AUTH"} & set(help_line.split()), help_line
    assert not any(w.startswith("X") for w in help_line.split()), help_line
    assert c.cmd("HELP bdat") == "214 2.0.0 Syntax: BDAT chunk-size [LAST]"
    unknown = c.cmd("HELP frobnicate")
    assert unknown.startswith("504 5.5.1 ") and "DATA" in unknown.split(), unknown
    # HELO: a plain 250 naming the server (no enhanced code in HELO/EHLO replies, RFC 2034).
    assert c.cmd("HELO client.test") == f"250 {NODE_NAME}"
    assert_reply(c.cmd("QUIT"), 221, "2.0.0")
    assert c.closed_by_peer()

    # A real client library sees the same.
    with smtplib.SMTP("127.0.0.1", node.port, timeout=10) as s:
        code, _ = s.ehlo("client.test")
        assert code == 250
        assert s.esmtp_features["size"] == "123456"
        for ext in ("8bitmime", "smtputf8", "pipelining", "enhancedstatuscodes"):
            assert s.has_extn(ext), ext
        assert not s.has_extn("starttls") and not s.has_extn("auth")


def _transport_connector_verbs() -> set[str]:
    """The X-verbs the transport connector serves: its own ``smtp_X...`` methods (not the frontend's
    502 it inherits: a verb it did not serve would be missing here)."""
    from transportd.redundancy.server import TransportSMTP
    from transportd.smtp.server import LimitedSMTP
    return {name[len("smtp_"):] for name in dir(TransportSMTP) if name.startswith("smtp_X")
            and getattr(TransportSMTP, name) is not LimitedSMTP._verb_not_served_here}


def test_frontend_answers_every_shadow_redundancy_verb_502(make_node):
    """README and docs/PROTOCOL.md section 1: the frontend answers every X-verb the transport
    connector knows ``502 5.3.3`` (not ``500 unrecognized``, which also counts toward the cut-off
    of aiosmtpd's five unknown commands), before and after EHLO, with or without arguments."""
    verbs = _transport_connector_verbs()
    assert {"XSHADOWREQUEST", "XSHADOW", "XQDISCARD", "XQUERYDISCARD", "XQSTATUS", "XRESUBMIT",
            "XSHADOWADOPT"} <= verbs, verbs
    node = make_node().start()
    c = Raw(node.port)
    for verb in sorted(verbs):
        assert c.cmd(verb) == "502 5.3.3 Command not implemented", verb
    ehlo(c)
    for _ in range(2):  # more of them than the unknown-command cut-off: the session stays open
        for verb in sorted(verbs):
            assert c.cmd(f"{verb.lower()} some argument") == "502 5.3.3 Command not implemented", verb
    assert c.cmd("NOOP").startswith("250 "), "the session was closed"
    help_line = c.cmd("HELP")
    assert not any(w.startswith("X") for w in help_line.split()), help_line  # not offered here
    assert_reply(c.cmd("QUIT"), 221, "2.0.0")


def test_the_one_list_of_shadow_redundancy_verbs():
    """protocol.VERBS is what the transport connector serves and its connection judges, so the
    frontend's 502 cannot miss a verb added later."""
    from transportd.redundancy.connection import OtherCommand, ServerConnection
    from transportd.redundancy.protocol import VERBS

    assert set(VERBS) == _transport_connector_verbs()
    conn = ServerConnection("node1.transportd.test", "0d3c1a52-3c3f-4c55-9c55-0f1e2d3c4b5a")
    for verb in VERBS:
        assert not isinstance(conn.receive_command(verb, None)[0], OtherCommand), verb


def test_transport_connector_help_gives_each_verbs_syntax(make_node):
    """HELP on the transport connector names every command it serves, MAIL and each X-verb, with
    the syntax docs/PROTOCOL.md gives it (XSHADOWADOPT's rank, XQDISCARD's optional words)."""
    transport_port = free_port()
    peer = {"name": "node2.transportd.test", "site": "site-b", "transport": f"127.0.0.1:{free_port()}"}
    node = make_node(overrides={"shadow_redundancy": {"shadow_redundancy_enabled": True},
                                "cluster": {"secret": "s3cret-for-the-test"},
                                "transport": {"listen": f"127.0.0.1:{transport_port}"}})
    write_toml(node.config_path, {**node.sections, "peers": [peer]})
    node.start()
    c = Raw(transport_port)
    ehlo(c, "node2.transportd.test")
    help_line = c.cmd("HELP")
    assert help_line.startswith("214 2.0.0 Supported commands: "), help_line
    served = set(help_line.split(": ", 1)[1].split())
    assert served >= {"MAIL", "RCPT", "DATA", "BDAT", "XSHADOWREQUEST", "XSHADOW", "XQDISCARD", "XQUERYDISCARD",
                      "XQSTATUS", "XRESUBMIT", "XSHADOWADOPT"}, help_line
    syntaxes = {
        "MAIL": "MAIL FROM: <address> [SP <mail-parameters>]",
        "XSHADOWREQUEST": "XSHADOWREQUEST fqdn base64-queue-database-id",
        "XSHADOW": "XSHADOW base64-fqdn",
        "XQDISCARD": "XQDISCARD max-count [RCPT [FAILED [NOTIFY [DELAY]]]]",
        "XQUERYDISCARD": "XQUERYDISCARD max-count [RCPT [FAILED [NOTIFY [DELAY]]]]",
        "XQSTATUS": "XQSTATUS guid ...",
        "XRESUBMIT": "XRESUBMIT destination start-epoch end-epoch",
        "XSHADOWADOPT": "XSHADOWADOPT base64-fqdn-of-lost-primary rank guid ...",
    }
    for verb, text in syntaxes.items():
        assert c.cmd(f"HELP {verb}") == f"214 2.0.0 Syntax: {text}", verb
    assert_reply(c.cmd("QUIT"), 221, "2.0.0")


def test_smtputf8_8bitmime_and_pipelined_transaction(make_node):
    node = make_node().start()
    c = Raw(node.port)
    ehlo(c)
    body = "Subject: ünïcödé\r\n\r\nGrüße, 8-bit body\r\n".encode()
    # RFC 2920: the whole transaction in one write; the replies come back in order.
    c.send("MAIL FROM:<jörg@remote.test> SMTPUTF8 BODY=8BITMIME\r\nRCPT TO:<zoë@example.test>\r\n"
           "RCPT TO:<alice@example.test>\r\nDATA\r\n".encode())
    assert_reply(c.reply()[-1], 250, "2.1.0")
    assert_reply(c.reply()[-1], 250, "2.1.5")
    assert_reply(c.reply()[-1], 250, "2.1.5")
    assert c.reply()[-1].startswith("354 ")
    c.send(body + b".\r\nQUIT\r\n")
    r = c.reply()[-1]
    assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", r), r
    assert_reply(c.reply()[-1], 221, "2.0.0")
    [row] = messages(node)
    assert row["from"] == "jörg@remote.test" and row["recipient_count"] == 2
    files = wait_for(lambda: node.maildir_files("zoë@example.test"), timeout=10, what="UTF-8 mailbox delivery")
    assert "Grüße, 8-bit body".encode() in files[0].read_bytes()


# --------------------------------------------------------------------------- 2. relay control

def test_a_node_on_ipv6_loopback(make_node, sink):
    """A frontend on ``[::1]``: the client's address literal in Received is ``[IPv6:::1]`` (RFC
    5321 4.4), the relay rule matches ``::1/128``, the tracking row names the client, ``config
    show`` prints the listener as ``[::1]:PORT`` (it reads back) and ``health`` finds it."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    sink.start()
    node = make_node(smart_host=sink.address, overrides={
        "frontend": {"listen": "[::1]:0"}, "routing": {"trusted_networks": ["::1/128"]}})
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            port = probe.getsockname()[1]
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback: {exc}")
    node.sections["frontend"]["listen"] = f"[::1]:{port}"
    write_toml(node.config_path, node.sections)
    node.start(wait=False)
    wait_for(lambda: " ready on " in node.log(), timeout=15, what="the node ready")
    with smtplib.SMTP("::1", port, timeout=20) as c:
        c.ehlo("v6client.test")
        assert c.sendmail("a@remote.test", ["b@elsewhere.test"], b"Subject: over v6\r\n\r\nhi\r\n") == {}
    got = wait_for(sink.messages, timeout=15, what="the message at the sink")
    assert b"Received: from v6client.test ([IPv6:::1])\n" in got[0], got[0][:400]  # the sink writes LF
    row = wait_for(lambda: node.tracking(event_id="RECEIVE"), what="the RECEIVE row")[0]
    assert (row["client-ip"], row["client-hostname"]) == ("::1", "v6client.test")
    shown = node.cli("config", "show").stdout
    assert re.search(rf"^frontend\.listen\s+\[\[::1\]:{port}\]\s", shown, re.MULTILINE), shown
    assert node.cli("health", check=False).returncode == 0
    # with the data directory alone, the node's own config (it listens on [::1] only): was an error
    assert node.cli("health", use_data_dir=True, check=False).returncode == 0


def test_a_node_on_several_bindings_ipv4_and_ipv6_with_receive_workers(make_node, sink):
    """``frontend.listen`` as a list (Exchange's Bindings): IPv4 and IPv6 loopback on one port and
    a second IPv4 address on another, served by the node and its receive worker alike (each process
    binds every one, SO_REUSEPORT). A message over each arrives; ``health`` checks each."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    sink.start()
    node = make_node(smart_host=sink.address, overrides={"routing": {"trusted_networks": ["127.0.0.0/8", "::1/128"]}})
    other = free_port()
    bindings = [f"127.0.0.1:{node.port}", f"[::1]:{node.port}", f"127.0.0.3:{other}"]
    node.sections["frontend"].update(listen=bindings, workers=2)
    write_toml(node.config_path, node.sections)
    try:
        node.start()
    except Exception:
        if "[::1]" in node.log() and "Cannot assign requested address" in node.log():
            pytest.skip("no IPv6 loopback")
        raise
    wait_for(lambda: "receive worker 1" in node.log() and "serving the frontend on" in node.log(), timeout=30,
             what="the receive worker serving")
    assert f"serving the frontend on {', '.join(bindings)}" in node.log()
    for host, port in (("127.0.0.1", node.port), ("::1", node.port), ("127.0.0.3", other)):
        for _ in range(3):  # new sessions: the kernel spreads them over the two processes
            with smtplib.SMTP(host, port, timeout=20) as c:
                c.ehlo("client.test")
                assert c.sendmail("a@remote.test", ["b@elsewhere.test"], f"Subject: via {host}\r\n\r\nhi\r\n") == {}
    got = wait_for(lambda: len(sink.messages()) == 9 and sink.messages(), timeout=20, what="9 messages at the sink")
    assert sorted(m.count(b"Subject: via ") for m in got) == [1] * 9
    assert {h: sum(f"Subject: via {h}\n".encode() in m for m in got) for h in ("127.0.0.1", "::1", "127.0.0.3")} \
        == {"127.0.0.1": 3, "::1": 3, "127.0.0.3": 3}
    health = node.cli("health", check=False)
    assert health.returncode == 0 and all(b in health.stdout for b in bindings), health.stdout


def test_relay_denied_for_untrusted_client(make_node, sink):
    sink.start()
    node = make_node(smart_host=sink.address).start()

    r = swaks(node.port, "--local-interface", "127.0.0.2", "--from", "refused@remote.test",
              "--to", "carol@foreign.test")
    assert "<** 550 5.7.1 Relaying denied" in r.stdout, r.stdout
    assert r.returncode != 0
    assert " queued as " not in r.stdout

    r = swaks(node.port, "--local-interface", "127.0.0.2", "--from", "outsider@remote.test",
              "--to", "alice@example.test")
    inbound = queued_id(r)

    r = swaks(node.port, "--from", "insider@example.test", "--to", "carol@foreign.test")
    relayed = queued_id(r)

    rows = {m["id"]: m for m in messages(node)}
    assert set(rows) == {inbound, relayed}
    assert rows[inbound]["from"] == "outsider@remote.test"
    assert rows[relayed]["from"] == "insider@example.test"
    assert all(m["from"] != "refused@remote.test" for m in rows.values())
    # The trusted client's relayed message really leaves through the smart host.
    wait_for(lambda: sink.messages(), timeout=10, what="relayed message at the sink")

    # A refused recipient does not spoil the transaction for the accepted one.
    c = Raw(node.port, source="127.0.0.2")
    ehlo(c)
    assert_reply(c.cmd("MAIL FROM:<mixed@remote.test>"), 250, "2.1.0")
    assert_reply(c.cmd("RCPT TO:<x@foreign.test>"), 550, "5.7.1")
    assert_reply(c.cmd("RCPT TO:<alice@example.test>"), 250, "2.1.5")
    assert c.cmd("DATA").startswith("354 ")
    c.send(b"Subject: mixed\r\n\r\nhi\r\n.\r\n")
    mixed = int(re.match(r"250 2\.0\.0 Ok: queued as (\d+)$", c.reply()[-1]).group(1))
    c.close()
    row = {m["id"]: m for m in messages(node)}[mixed]
    assert row["recipient_count"] == 1 and row["queues"] == ["mailbox:local"]


def test_postmaster_without_a_domain_is_accepted_from_anyone(make_node):
    """RFC 5321 4.1.1.3 and 4.5.1: RCPT TO:<Postmaster> (any case, no domain) MUST be accepted; it is
    the postmaster of the first accepted domain (Exchange's: that of its default accepted domain)."""
    node = make_node().start()
    c = Raw(node.port, source="127.0.0.2")  # not a trusted network: no relay
    ehlo(c)
    reply = send_one(c, "someone@remote.test", ["Postmaster", "postmaster"],
                     b"Subject: to the postmaster\r\n\r\nhi\r\n")
    c.close()
    mid = int(re.match(r"250 2\.0\.0 Ok: queued as (\d+)$", reply).group(1))
    assert {m["id"]: m for m in messages(node)}[mid]["queues"] == ["mailbox:local"]
    shown = node.cli_json("message", "show", str(mid))[0]
    assert [r["address"] for r in shown["recipients"]] == ["postmaster@example.test"]

    # A node that accepts no domain has no postmaster mailbox: it says so (not "bad syntax").
    relay = make_node("node2", overrides={"routing": {"accepted_domains": []}}).start()
    c = Raw(relay.port)
    ehlo(c)
    assert_reply(c.cmd("MAIL FROM:<someone@remote.test>"), 250, "2.1.0")
    assert_reply(c.cmd("RCPT TO:<POSTMASTER>"), 550, "5.1.1")
    c.close()


# --------------------------------------------------------------------------- 3. message size

def test_oversize_message_refused_and_session_goes_on(make_node):
    node = make_node(overrides={"frontend": {"max_message_size": 2000}}).start()
    c = Raw(node.port)
    ehlo(c)
    # Declared size over the limit: refused at MAIL.
    assert_reply(c.cmd("MAIL FROM:<a@remote.test> SIZE=999999"), 552, "5.3.4")
    # Undeclared, sent anyway: refused at the end of DATA.
    r = send_one(c, "a@remote.test", ["alice@example.test"], body_of(2001, "too-big"))
    assert_reply(r, 552, "5.3.4")
    r = send_one(c, "a@remote.test", ["alice@example.test"], body_of(5000, "way-too-big"))
    assert_reply(r, 552, "5.3.4")
    # A declared size at the limit is fine, and a message of exactly the limit goes through.
    assert_reply(c.cmd("MAIL FROM:<a@remote.test> SIZE=2000"), 250, "2.1.0")
    assert_reply(c.cmd("RSET"), 250, "2.0.0")
    r = send_one(c, "a@remote.test", ["alice@example.test"], body_of(2000, "exact"))
    assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", r), r
    r = send_one(c, "a@remote.test", ["alice@example.test"], b"Subject: small\r\n\r\nhello\r\n")
    assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", r), r
    assert_reply(c.cmd("QUIT"), 221, "2.0.0")
    assert sorted(m["subject"] for m in messages(node)) == ["exact", "small"]
    assert node.alive


def test_a_header_section_over_max_header_size_is_refused_over_data_and_bdat(make_node):
    """Exchange's MaxHeaderSize (frontend.max_header_size): a message whose header section is over
    it is refused, 552 5.3.4, before its header is parsed (megabytes of fields within the message
    size limit cost the event loop seconds); nothing is queued and the session goes on. The body
    does not count; a message with no empty line is all header."""
    node = make_node(overrides={"frontend": {"max_header_size": "4KB"}}).start()
    fields = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"f" * 70) for i in range(60))  # ~5 KB
    c = Raw(node.port)
    ehlo(c)
    r = send_one(c, "a@remote.test", ["alice@example.test"], b"Subject: big-header\r\n" + fields + b"\r\nhi\r\n")
    assert r == "552 5.3.4 Header size exceeds fixed maximum size", r
    r = send_one(c, "a@remote.test", ["alice@example.test"], b"Subject: no-body\r\n" + fields)
    assert_reply(r, 552, "5.3.4")
    small = b"Subject: big-body\r\n" + b"".join(fields.splitlines(keepends=True)[:35]) + b"\r\n" + b"body\r\n" * 2000
    r = send_one(c, "a@remote.test", ["alice@example.test"], small)
    assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", r), r
    assert_reply(c.cmd("MAIL FROM:<a@remote.test>"), 250, "2.1.0")
    assert_reply(c.cmd("RCPT TO:<alice@example.test>"), 250, "2.1.5")
    chunk = b"Subject: bdat-header\r\n" + fields + b"\r\nhi\r\n"
    c.send(b"BDAT %d LAST\r\n" % len(chunk) + chunk)
    assert_reply(c.reply()[-1], 552, "5.3.4")
    assert_reply(c.cmd("QUIT"), 221, "2.0.0")
    assert [m["subject"] for m in messages(node)] == ["big-body"]
    assert "header section over frontend.max_header_size" in node.log()


def test_a_message_with_more_received_fields_than_max_hop_count_is_refused_as_a_loop(make_node):
    """Exchange's MaxHopCount (frontend.max_hop_count) counts the Received fields a message comes
    with (RFC 5321 6.3's loop detection): as many as allowed are accepted, one more is refused 554
    5.4.14 and nothing is queued; the Received field the node adds is not counted against it."""
    node = make_node(overrides={"frontend": {"max_hop_count": 3}}).start()

    def hops(n: int, subject: str) -> bytes:
        return b"".join(b"Received: from hop%d.remote.test by relay%d.remote.test; Sat, 28 Nov 2026 12:00:0%d +0000\r\n"
                        % (i, i, i) for i in range(n)) + b"Subject: " + subject.encode() + b"\r\n\r\nhi\r\n"
    c = Raw(node.port)
    ehlo(c)
    r = send_one(c, "a@remote.test", ["alice@example.test"], hops(3, "three-hops"))
    assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", r), r
    r = send_one(c, "a@remote.test", ["alice@example.test"], hops(4, "four-hops"))
    assert r == "554 5.4.14 Hop count exceeded - possible mail loop", r
    assert_reply(c.cmd("QUIT"), 221, "2.0.0")
    assert [m["subject"] for m in messages(node)] == ["three-hops"]
    assert "looped (4 Received headers)" in node.log()


# --------------------------------------------------------------------------- 4. line length

def test_over_long_lines(make_node):
    """RFC 5321 4.5.3.1.6: a text line is at most 1000 octets with its CRLF (998 of text), the
    default of frontend.max_line_length (998, octets of text). A line a standards-following next
    hop would refuse is refused here (500 5.5.2, nothing queued), not taken with a 250 and sent
    back as an NDR; a command line is held to it too."""
    node = make_node().start()  # max_line_length = 998 (octets without CRLF)
    c = Raw(node.port)
    ehlo(c)
    assert_reply(c.cmd("NOOP " + "x" * 993), 250, "2.0.0")           # 998 octets: fine
    assert_reply(c.cmd("NOOP " + "x" * 994), 500, "5.5.2")           # 999 octets
    assert_reply(c.cmd("NOOP " + "x" * 5000), 500, "5.5.2")
    assert_reply(c.cmd(b"X" * 70000), 500, "5.5.2")
    assert_reply(c.cmd("NOOP"), 250, "2.0.0")  # the stream is back in step

    ok_line = b"z" * 998 + b"\r\n"
    for over in (999, 1000):  # 1000 octets of text: what a 1000-octet limit without the CRLF let in
        r = send_one(c, "a@remote.test", ["alice@example.test"],
                     b"Subject: long-line\r\n\r\nstart\r\n" + b"z" * over + b"\r\nend\r\n")
        assert_reply(r, 500, "5.5.2")
        assert_reply(bdat_message(c, [b"Subject: long-bdat\r\n\r\n" + b"z" * over + b"\r\n"])[-1], 500, "5.5.2")
    r = send_one(c, "a@remote.test", ["alice@example.test"],
                 b"Subject: huge-line\r\n\r\n" + b"z" * 200000 + b"\r\n")
    assert_reply(r, 500, "5.5.2")
    r = send_one(c, "a@remote.test", ["alice@example.test"], b"Subject: max-line\r\n\r\n" + ok_line)
    assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", r), r
    got = bdat_message(c, [b"Subject: max-bdat\r\n\r\n" + ok_line])
    assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", got[-1]), got
    assert_reply(c.cmd("QUIT"), 221, "2.0.0")
    assert sorted(m["subject"] for m in messages(node)) == ["max-bdat", "max-line"]


def test_the_dot_doubled_for_transparency_is_not_counted_in_a_lines_length(make_node):
    """RFC 5321 4.5.3.1.6: the line limit does not count "the leading dot duplicated for
    transparency". A line of the limit that begins with a dot is sent as ``..`` and the rest, one
    octet over on the wire: taken like the same line without its dot (it got 500 5.5.2); over
    BDAT, which has no stuffing, the same line is the same length. One octet more is refused."""
    node = make_node().start()
    c = Raw(node.port)
    ehlo(c)
    text = b"." + b"d" * 997  # 998 octets of text
    # send_one sends the octets as given: the line goes out stuffed, as "..ddd...", 999 octets.
    r = send_one(c, "a@remote.test", ["alice@example.test"], b"Subject: dot-line\r\n\r\n." + text + b"\r\n")
    assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", r), r
    got = bdat_message(c, [b"Subject: dot-bdat\r\n\r\n" + text + b"\r\n"])
    assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", got[-1]), got
    r = send_one(c, "a@remote.test", ["alice@example.test"], b"Subject: dot-over\r\n\r\n." + text + b"d\r\n")
    assert_reply(r, 500, "5.5.2")
    assert_reply(bdat_message(c, [b"Subject: dot-over-bdat\r\n\r\n" + text + b"d\r\n"])[-1], 500, "5.5.2")
    assert_reply(c.cmd("QUIT"), 221, "2.0.0")
    assert sorted(m["subject"] for m in messages(node)) == ["dot-bdat", "dot-line"]
    delivered = wait_for(lambda: len(f := node.maildir_files("alice@example.test")) == 2 and f,
                         what="both messages in alice's mailbox")
    assert all(b"\r\n" + text + b"\r\n" in p.read_bytes() for p in delivered)  # one dot: unstuffed


def test_bare_lf_lines_are_measured_one_by_one(make_node):
    """A bare LF ends a line for the length check too: the message is sent on with each one made a
    CRLF (smtp/transaction.py), so a bare-LF message of short lines over 1000 octets in all is no
    long line (it got 500 5.5.2), over DATA, over BDAT, and in a line that starts with a stuffed
    dot. A line over the limit with no line end in it is still refused."""
    node = make_node().start()
    lines = b"".join(b"line %02d " % i + b"x" * 50 + b"\n" for i in range(30))  # 58 octets each
    body = b"Subject: lf-only\n\n" + lines
    c = Raw(node.port)
    ehlo(c)
    r = send_one(c, "a@remote.test", ["alice@example.test"], body + b"\r\n")
    assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", r), r
    r = send_one(c, "a@remote.test", ["alice@example.test"], b"Subject: dot-lf\r\n\r\n.." + lines + b"\r\n")
    assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", r), r
    got = bdat_message(c, [b"Subject: bdat-lf\n\n" + lines])
    assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", got[-1]), got
    long_line = b"Subject: long-lf\n\n" + b"z" * 1001 + b"\n" + lines
    assert_reply(send_one(c, "a@remote.test", ["alice@example.test"], long_line + b"\r\n"), 500, "5.5.2")
    assert_reply(bdat_message(c, [long_line])[-1], 500, "5.5.2")
    assert_reply(c.cmd("QUIT"), 221, "2.0.0")
    assert sorted(m["subject"] for m in messages(node)) == ["bdat-lf", "dot-lf", "lf-only"]


# --------------------------------------------------------------------------- 5. recipients

def test_too_many_recipients(make_node):
    node = make_node(overrides={"frontend": {"max_recipients_per_message": 2}}).start()
    c = Raw(node.port)
    ehlo(c)
    assert_reply(c.cmd("MAIL FROM:<a@remote.test>"), 250, "2.1.0")
    assert_reply(c.cmd("RCPT TO:<r1@example.test>"), 250, "2.1.5")
    assert_reply(c.cmd("RCPT TO:<r2@example.test>"), 250, "2.1.5")
    assert_reply(c.cmd("RCPT TO:<r3@example.test>"), 452, "4.5.3")
    assert_reply(c.cmd("RCPT TO:<r4@example.test>"), 452, "4.5.3")
    assert c.cmd("DATA").startswith("354 ")
    c.send(b"Subject: two\r\n\r\nhi\r\n.\r\n")
    r = c.reply()[-1]
    mid = int(re.fullmatch(r"250 2\.0\.0 Ok: queued as (\d+)", r).group(1))
    # The limit is per message: the next transaction starts from zero.
    r = send_one(c, "a@remote.test", ["r3@example.test", "r4@example.test"], b"Subject: next\r\n\r\nhi\r\n")
    assert r.startswith("250 2.0.0 Ok: queued as ")
    c.close()
    rows = {m["id"]: m for m in messages(node)}
    assert rows[mid]["recipient_count"] == 2
    assert len(rows) == 2


# --------------------------------------------------------------------------- 6. garbage

def test_garbage_gets_clean_errors_and_daemon_stays_up(make_node):
    node = make_node().start()
    c = Raw(node.port)
    assert c.cmd("MAIL FROM:<a@remote.test>")[:9] == "503 5.5.1"  # before EHLO
    ehlo(c)
    junk = [
        (b"FROB", "500 5.5.1"),
        (b"\xff\xfe\x00\x01binary", "500 5.5.2"),
        (b"", "500 5.5.2"),
        (b"   ", "500 5.5."),
        (b"MAIL FROM:<bad address>", "501 5.1.7"),
        (b"MAIL FROM:<\xff\xfe@remote.test>", "501 5.1.7"),
        (b"MAIL", "501 5.5.4"),
        (b"RCPT TO:<alice@example.test>", "503 5.5.1"),  # RCPT before MAIL
        (b"DATA", "503 5.5.1"),                         # DATA before MAIL
        (b"MAIL FROM:<a@remote.test> BODY=BINARYMIME", "501 5.5.4"),
        (b"MAIL FROM:<a@remote.test> SIZE=lots", "501 5.5.4"),
        (b"MAIL FROM:<a@remote.test> SIZE=10 SIZE=99999", "501 5.5.4"),  # which would hold?
        (b"MAIL FROM:<a@remote.test> BODY=7BIT body=8BITMIME", "501 5.5.4"),
        (b"MAIL FROM:<a@remote.test", "553 5.1.3"),  # a path never closed (was taken as <a@remote.test>)
        (b"MAIL FROM:<a@remote.test>", "250 2.1.0"),
        (b"MAIL FROM:<b@remote.test>", "503 5.5.1"),    # nested MAIL
        (b"DATA", "503 5.5.1"),                         # DATA before RCPT
        (b"RCPT TO:<not an address>", "501 5.1.3"),
        (b"RCPT TO:<alice@example.test", "553 5.1.3"),
        (b"RCPT TO:<x\xff@example.test>", "501 5.1.3"),
        (b"RCPT TO:<a@[999.1.1.1]>", "501 5.1.3"),            # an address literal with no address
        (b"RCPT TO:<a@[IPv6:fe80::1%eth0]>", "501 5.1.3"),    # a zone index (RFC 5321 4.1.3 has none)
        (b"RCPT TO:<bad address@example.test>", "501 5.1.3"),  # blanks in a local part not quoted
        (b"RCPT TO:<@relay.test:a b@example.test>", "501 5.1.3"),  # ...after a source route too
        (b"RCPT TO:<\"a\tb\"@example.test>", "501 5.1.3"),  # a tab is not qtextSMTP (RFC 5321 4.1.2)
        (b"RCPT TO:<alice@example.test> FOO=BAR", "555 5."),
        (b"RCPT TO:<alice@example.test> NOTIFY=NEVER NOTIFY=SUCCESS", "501 5.5.4"),
        (b"RCPT alice@example.test", "501 5.5.4"),
        (b"XYZZY\rinjected", "500 5.5.1"),
        (b"VRFY <a\xff\xfe", "553 5.1.3"),  # a path never closed (a malformed address, as for MAIL; 502
        (b"VRFY \"", "553 5.1.3"),  # would say VRFY is not implemented); the email package's parser
        (b"VRFY a@", "553 5.1.3"),  # raised IndexError on these
        (b"VRFY (x\x1b[2J\xff", "553 5.1.3"),  # echoed back: control octets and bad UTF-8 become '?'
        (b"MAIL FROM:\"", "553 5.1.3"),
        (b"MAIL FROM:a@", "553 5.1.3"),
        (b"MAIL FROM:<a@[1>", "553 5.1.3"),  # ...and AttributeError on an unclosed address literal
        (b"VRFY a@[1", "553 5.1.3"),
        (b"NOOP\x00", "500 5.5.1"),
        (b"RSET", "250 2.0.0"),
    ]
    c.send(b"".join(line + b"\r\n" for line, _ in junk))  # all pipelined in one write
    for line, expected in junk:
        r = c.reply()
        assert len(r) == 1, (line, r)
        assert r[0].startswith(expected if expected.endswith(".") else expected + " "), (line, r[0], expected)
        assert ENHANCED.match(r[0]), (line, r[0])
        assert not LEAK.search(r[0][10:]), (line, r[0])
        assert r[0].isprintable(), (line, r[0])
    # A proper message on the same session, then from a real client.
    r = send_one(c, "a@remote.test", ["alice@example.test"], b"Subject: after-junk\r\n\r\nhi\r\n")
    assert r.startswith("250 2.0.0 Ok: queued as ")
    assert_reply(c.cmd("QUIT"), 221, "2.0.0")
    queued_id(swaks(node.port, "--to", "alice@example.test", "--from", "b@remote.test",
                    "--header", "Subject: swaks-after-junk"))
    assert node.alive
    assert sorted(m["subject"] for m in messages(node)) == ["after-junk", "swaks-after-junk"]
    assert "Traceback" not in node.log()


def test_unicode_address_needs_smtputf8_declared_on_mail(make_node):
    """RFC 6531: a client sends a non-ASCII address only in a transaction whose MAIL gave
    SMTPUTF8. Without it MAIL and RCPT get 553 5.6.7 (Postfix's answer) and nothing is queued;
    with it the same addresses are taken."""
    node = make_node().start()
    c = Raw(node.port)
    ehlo(c)
    dialogue = [("MAIL FROM:<jürgen@bücher.example>", 553, "5.6.7"), ("MAIL FROM:<a@remote.test>", 250, "2.1.0"),
                ("RCPT TO:<üser@example.test>", 553, "5.6.7"), ("RCPT TO:<user@exämple.test>", 553, "5.6.7"),
                ("RCPT TO:<alice@example.test>", 250, "2.1.5"), ("RSET", 250, "2.0.0"),
                ("MAIL FROM:<jürgen@bücher.example> SMTPUTF8", 250, "2.1.0"), ("RCPT TO:<üser@example.test>", 250, "2.1.5")]
    for line, code, enhanced in dialogue:
        assert_reply(c.cmd(line), code, enhanced)
    assert c.cmd("DATA").startswith("354 ")
    c.send(b"Subject: declared\r\n\r\nhi\r\n.\r\n")
    r = c.reply()[-1]
    assert r.startswith("250 2.0.0 Ok: queued as "), r
    c.close()
    rows = messages(node)
    assert [(m["from"], m["subject"]) for m in rows] == [("jürgen@bücher.example", "declared")]


def test_too_many_unknown_commands_closes(make_node):
    node = make_node().start()
    c = Raw(node.port)
    ehlo(c)
    c.send(b"".join(b"BOGUS%d\r\n" % i for i in range(8)))
    replies = []
    while True:
        try:
            replies.append(c.reply()[-1])
        except EOFError:
            break
    assert all(r.startswith("500 5.5.1 ") for r in replies[:-1]), replies
    assert replies[-1].startswith("421 4.7.0 ") and "too many errors" in replies[-1], replies  # RFC 5321 3.8
    assert len(replies) == 5
    assert node.alive
    c2 = Raw(node.port)
    assert ehlo(c2)[0] == f"250-{NODE_NAME}"
    c2.close()


# --------------------------------------------------------------------------- 7. connection limits

def test_connections_per_source_limit(make_node):
    node = make_node(overrides={"frontend": {"max_inbound_connection_per_source": 2}}).start()
    # Kept: lets the start-up probe's slot be released (on close, not a scan); a client cannot
    # observe that without taking a slot itself.
    time.sleep(0.3)
    a, b = Raw(node.port), Raw(node.port)
    assert a.greeting[0].startswith("220 ") and b.greeting[0].startswith("220 ")
    third = Raw(node.port)
    assert_reply(third.greeting[-1], 421, "4.7.0")
    assert third.closed_by_peer(3)
    other = Raw(node.port, source="127.0.0.2")
    assert other.greeting[0].startswith("220 ")
    ehlo(other)
    # The refused connection was not counted, and a closed one frees its slot.
    a.cmd("QUIT")
    a.close()

    def slot_free():
        c = Raw(node.port)
        if c.greeting[0].startswith("220 "):
            return c
        c.close()
        return None

    fourth = wait_for(slot_free, timeout=5, what="a freed per-source slot")
    ehlo(fourth)
    r = send_one(fourth, "a@remote.test", ["alice@example.test"], b"Subject: slot\r\n\r\nhi\r\n")
    assert r.startswith("250 2.0.0 Ok: queued as ")
    for x in (b, other, fourth):
        x.close()


def test_total_connection_limit(make_node):
    node = make_node(overrides={"frontend": {"max_inbound_connection": 3}}).start()
    time.sleep(0.3)  # kept, as above: the start-up probe's slot is released on close
    held = [Raw(node.port), Raw(node.port, source="127.0.0.2"), Raw(node.port, source="127.0.0.3")]
    assert all(h.greeting[0].startswith("220 ") for h in held)
    for src in ("127.0.0.1", "127.0.0.4"):
        extra = Raw(node.port, source=src)
        assert_reply(extra.greeting[-1], 421, "4.3.2")
        assert extra.closed_by_peer(3)
    held.pop().close()

    def slot_free():
        c = Raw(node.port, source="127.0.0.4")
        if c.greeting[0].startswith("220 "):
            return c
        c.close()
        return None

    c = wait_for(slot_free, timeout=5, what="a freed connection slot")
    ehlo(c)
    for h in held + [c]:
        h.close()
    assert node.alive


# --------------------------------------------------------------------------- 8. timeouts

def test_inactivity_timeout(make_node):
    node = make_node(overrides={"frontend": {"connection_inactivity_timeout": 1.5}}).start()
    c = Raw(node.port)
    ehlo(c)
    t0 = time.monotonic()
    assert c.reply() == [f"421 4.4.2 {NODE_NAME} Connection timed out"]
    elapsed = time.monotonic() - t0
    assert c.closed_by_peer(2)
    assert 1.2 <= elapsed <= 3.0, elapsed


def test_inactivity_timer_counts_data_lines_as_activity(make_node):
    """A client steadily sending a long message is not idle."""
    node = make_node(overrides={"frontend": {"connection_inactivity_timeout": 1.0}}).start()
    c = Raw(node.port)
    ehlo(c)
    assert_reply(c.cmd("MAIL FROM:<a@remote.test>"), 250, "2.1.0")
    assert_reply(c.cmd("RCPT TO:<alice@example.test>"), 250, "2.1.5")
    assert c.cmd("DATA").startswith("354 ")
    c.send(b"Subject: slow\r\n\r\n")
    for i in range(10):  # 2.5 s in all, never more than 0.25 s without a byte
        time.sleep(0.25)
        c.send(b"line %d\r\n" % i)
    c.send(b".\r\n")
    r = c.reply()[-1]
    assert r.startswith("250 2.0.0 Ok: queued as "), r
    c.close()
    assert [m["subject"] for m in messages(node)] == ["slow"]


def test_absolute_connection_timeout(make_node):
    node = make_node(overrides={"frontend": {"connection_timeout": 2, "connection_inactivity_timeout": 1.5}}).start()
    c = Raw(node.port)
    t0 = time.monotonic()
    ehlo(c)
    noops = 0
    timed_out = None
    while time.monotonic() - t0 < 6:
        time.sleep(0.3)
        try:
            r = c.cmd("NOOP")
        except (EOFError, ConnectionResetError, BrokenPipeError):
            break
        if r.startswith("421 "):
            timed_out = r
            break
        assert_reply(r, 250, "2.0.0")
        noops += 1
    elapsed = time.monotonic() - t0
    assert timed_out == f"421 4.4.2 {NODE_NAME} Connection timed out", timed_out
    assert c.closed_by_peer(2)
    assert noops >= 4  # the inactivity timer (1.5 s) never fired: the NOOPs kept it alive
    assert 1.7 <= elapsed <= 3.0, elapsed


def delayed_ack_node(make_node, next_hop_port: int, **frontend):
    """A shadow redundancy 2010 node whose smart host never answers: every message's 250 is held
    for max_acknowledgement_delay (3 s) after the message was made durable."""
    return make_node(smart_host=f"127.0.0.1:{next_hop_port}", overrides={
        "shadow_redundancy": {"shadow_redundancy_enabled": True, "version": "2010"},
        "frontend": {"max_acknowledgement_delay": 3, **frontend},
        "delivery": {"send_connect_timeout": 30}}).start()


def test_the_inactivity_timeout_waits_for_a_held_acknowledgement(make_node):
    """RFC 5321 4.5.3.2.7: the server's timeout is for waiting on its client. While the 250 of a
    durable message is held (2010's delayed acknowledgement) the client waits on the server: a
    421 then would make it send the message again (a duplicate). The idle time counts from the
    reply; past it the session is closed as usual."""
    with silent_peer() as hop:
        node = delayed_ack_node(make_node, hop, connection_inactivity_timeout=2)
        c = Raw(node.port, timeout=10)
        ehlo(c)
        t0 = time.monotonic()
        r = send_one(c, "a@remote.test", ["carol@elsewhere.test"], b"Subject: held-ack\r\n\r\nhi\r\n")
        assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", r), r
        assert time.monotonic() - t0 >= 2.5  # held: the acknowledgement delay, not the idle limit
        time.sleep(1.3)  # idle, but less than the limit since the reply
        assert_reply(c.cmd("NOOP"), 250, "2.0.0")
        t1 = time.monotonic()
        assert c.reply() == [f"421 4.4.2 {NODE_NAME} Connection timed out"]
        assert 1.6 <= time.monotonic() - t1 <= 3.5  # the limit, counted from the NOOP's reply
        assert c.closed_by_peer(2)
        assert [m["subject"] for m in messages(node)] == ["held-ack"]


def test_the_absolute_timeout_waits_for_a_held_acknowledgement(make_node):
    """The session's absolute limit passes while a message's 250 is held: the 250 goes out, then
    the 421, and the session ends (never a 421 for a message the node already holds)."""
    with silent_peer() as hop:
        node = delayed_ack_node(make_node, hop, connection_timeout=2, connection_inactivity_timeout=2)
        c = Raw(node.port, timeout=10)
        t0 = time.monotonic()
        ehlo(c)
        while time.monotonic() - t0 < 1.0:  # busy, not idle: the inactivity limit stays away
            assert_reply(c.cmd("NOOP"), 250, "2.0.0")
            time.sleep(0.2)
        r = send_one(c, "a@remote.test", ["carol@elsewhere.test"], b"Subject: held-ack\r\n\r\nhi\r\n")
        assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", r), r
        assert time.monotonic() - t0 >= 3.5  # the 250 came after the session's limit had passed
        t1 = time.monotonic()
        assert c.reply() == [f"421 4.4.2 {NODE_NAME} Connection timed out"]
        assert time.monotonic() - t1 < 1.0  # right after the 250, not at the idle limit (2 s)
        assert c.closed_by_peer(2)
        assert [m["subject"] for m in messages(node)] == ["held-ack"]


# --------------------------------------------------------------------------- 9. STARTTLS and AUTH

@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert(NODE_NAME, "127.0.0.1")
    d = tmp_path_factory.mktemp("tls")
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    for pem in cert.cert_chain_pems[1:]:
        pem.write_to_path(str(d / "cert.pem"), append=True)
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return {"cert": str(d / "cert.pem"), "key": str(d / "key.pem"), "ca": str(d / "ca.pem"), "client_ctx": ctx}


def tls_node(make_node, tls_files, sink=None, **frontend):
    fe = {"tls_certificate": tls_files["cert"], "tls_key": tls_files["key"],
          "auth_users": {"alice": "s3cret"}, **frontend}
    return make_node(smart_host=sink.address if sink else "", overrides={"frontend": fe}).start()


def test_starttls_then_auth_allows_relay(make_node, sink, tls_files):
    sink.start()
    node = tls_node(make_node, tls_files, sink)
    s = smtplib.SMTP("127.0.0.1", node.port, timeout=10, source_address=("127.0.0.2", 0))
    try:
        s.ehlo("client.test")
        assert s.has_extn("starttls")
        assert not s.has_extn("auth")
        code, msg = s.docmd("MAIL", "FROM:<alice@remote.test> AUTH=<>")  # AUTH not offered: unknown
        assert (code, msg[:6]) == (555, b"5.5.4 "), (code, msg)
        code, msg = s.docmd("AUTH", "PLAIN AGFsaWNlAHMzY3JldA==")
        assert code == 538 and msg.startswith(b"5.7.11"), (code, msg)
        code, msg = s.starttls(context=tls_files["client_ctx"])
        assert (code, msg) == (220, b"2.0.0 Ready to start TLS")  # enhanced: RFC 2034 exempts only 220 greetings
        s.ehlo("client.test")
        assert not s.has_extn("starttls")
        assert set(s.esmtp_features["auth"].split()) == {"PLAIN", "LOGIN"}
        # RFC 3207 section 4.2: no second STARTTLS inside TLS (aiosmtpd answered 220 and the
        # session died in a nested handshake); the session goes on.
        assert s.docmd("STARTTLS") == (503, b"5.5.1 Error: TLS already active")
        # Not authenticated yet: still no relay.
        assert s.docmd("MAIL", "FROM:<alice@remote.test>")[0] == 250
        code, msg = s.docmd("RCPT", "TO:<bob@foreign.test>")
        assert (code, msg) == (550, b"5.7.1 Relaying denied")
        # RFC 4954 section 4: AUTH inside a mail transaction is refused, and changes nothing.
        assert s.docmd("AUTH", "PLAIN AGFsaWNlAHMzY3JldA==") == (503, b"5.5.1 Error: MAIL transaction in progress")
        assert s.docmd("RCPT", "TO:<bob@foreign.test>")[0] == 550
        s.rset()
        with pytest.raises(smtplib.SMTPAuthenticationError) as err:
            s.login("alice", "wrong")
        assert err.value.smtp_code == 535 and err.value.smtp_error.startswith(b"5.7.8")
        with pytest.raises(smtplib.SMTPAuthenticationError) as err:
            s.login("mallory", "s3cret")
        assert err.value.smtp_code == 535
        code, msg = s.login("alice", "s3cret")
        assert code == 235 and msg.startswith(b"2.7.0")
        refused = s.sendmail("alice@remote.test", ["bob@foreign.test"], b"Subject: authed-relay\r\n\r\nhi\r\n")
        assert refused == {}
        # RFC 4954 section 5: where AUTH is offered, MAIL's AUTH parameter (xtext, or <>) is taken
        # (sendmail and Exchange send it); a malformed one is a syntax error, and RCPT has none.
        for value in ("<>", "alice@remote.test", "alice+2Bx@remote.test"):
            assert s.docmd("MAIL", f"FROM:<alice@remote.test> SIZE=20 AUTH={value}")[0] == 250, value
            assert s.rset()[0] == 250
        assert s.docmd("MAIL", "FROM:<alice@remote.test> AUTH=a+zz@remote.test")[0] == 501
        assert s.docmd("MAIL", "FROM:<alice@remote.test> AUTH=<> AUTH=<>")[0] == 501  # given twice
        assert s.docmd("MAIL", "FROM:<alice@remote.test> AUTH=<>")[0] == 250
        assert s.docmd("RCPT", "TO:<bob@foreign.test> AUTH=<>")[0] == 555
        assert s.rset()[0] == 250
    finally:
        s.close()

    r = swaks(node.port, "--tls", "--auth", "PLAIN", "--auth-user", "alice", "--auth-password", "s3cret",
              "--local-interface", "127.0.0.2", "--from", "alice@remote.test", "--to", "carol@foreign.test",
              "--header", "Subject: swaks-authed")
    queued_id(r)
    r = swaks(node.port, "--tls", "--auth", "PLAIN", "--auth-user", "alice", "--auth-password", "nope",
              "--local-interface", "127.0.0.2", "--from", "alice@remote.test", "--to", "carol@foreign.test",
              "--header", "Subject: swaks-bad-password")
    assert re.search(r"^<[~*]\* 535 5\.7\.8 ", r.stdout, re.MULTILINE), r.stdout
    assert r.returncode != 0
    assert sorted(m["subject"] for m in messages(node)) == ["authed-relay", "swaks-authed"]
    wait_for(lambda: len(sink.messages()) == 2, timeout=10, what="both relayed messages at the sink")


def test_implicit_tls_submission_port(make_node, sink, tls_files):
    """RFC 8314 implicit TLS (``frontend.implicit_tls_listen``, submissions on port 465 as mail
    clients default to): the greeting comes over TLS; EHLO offers AUTH and no STARTTLS; relay after
    AUTH, the Received field saying ESMTPSA; swaks --tls-on-connect and curl smtps:// likewise. A
    client speaking plaintext to it gets nothing and the node goes on; ``health`` checks it with a
    handshake; the STARTTLS listener is unchanged."""
    sink.start()
    tls_port = free_port()
    node = tls_node(make_node, tls_files, sink, implicit_tls_listen=[f"127.0.0.1:{tls_port}"])
    assert f"ready on 127.0.0.1:{node.port}, 127.0.0.1:{tls_port} (implicit TLS)" in node.log()
    with socket.create_connection(("127.0.0.1", tls_port), timeout=10) as plain:
        plain.sendall(b"EHLO plain.test\r\n")  # not a TLS ClientHello: the handshake fails, the node closes
        answer = b""
        try:
            while chunk := plain.recv(512):
                answer += chunk
        except ConnectionResetError:  # a reset ends it as well as a close
            pass
        assert b"220" not in answer and b"250" not in answer, answer
    s = smtplib.SMTP_SSL("127.0.0.1", tls_port, timeout=10, source_address=("127.0.0.2", 0),
                         context=tls_files["client_ctx"])
    try:
        assert s.sock.version() in ("TLSv1.2", "TLSv1.3")
        s.ehlo("client.test")
        assert not s.has_extn("starttls")
        assert set(s.esmtp_features["auth"].split()) == {"PLAIN", "LOGIN"}
        assert s.docmd("STARTTLS")[0] == 502
        assert s.docmd("MAIL", "FROM:<alice@remote.test>")[0] == 250
        assert s.docmd("RCPT", "TO:<bob@foreign.test>") == (550, b"5.7.1 Relaying denied")
        s.rset()
        assert s.login("alice", "s3cret")[0] == 235
        assert s.sendmail("alice@remote.test", ["bob@foreign.test"], b"Subject: implicit-tls\r\n\r\nhi\r\n") == {}
    finally:
        s.close()
    r = swaks(tls_port, "--tls-on-connect", "--auth", "PLAIN", "--auth-user", "alice", "--auth-password", "s3cret",
              "--local-interface", "127.0.0.2", "--from", "alice@remote.test", "--to", "carol@foreign.test",
              "--header", "Subject: swaks-tls-on-connect")
    queued_id(r)
    curl = subprocess.run(["curl", "-sS", "--max-time", "30", f"smtps://127.0.0.1:{tls_port}/client.test",
                           "--cacert", tls_files["ca"], "--interface", "127.0.0.2", "--user", "alice:s3cret",
                           "--mail-from", "alice@remote.test", "--mail-rcpt", "dave@foreign.test", "-T", "-"],
                          input=b"Subject: curl-smtps\r\n\r\nhi\r\n", capture_output=True, timeout=60, check=False)
    assert curl.returncode == 0, curl.stderr
    got = wait_for(lambda: len(sink.messages()) == 3 and sink.messages(), timeout=15, what="all three at the sink")
    assert all(re.search(rb"\swith\s+ESMTPSA\s", m) for m in got), got
    assert node.proc.poll() is None
    health = node.cli("health", check=False)
    assert health.returncode == 0 and f"127.0.0.1:{tls_port} (implicit TLS)" in health.stdout, health


def test_tls_without_auth_users_offers_no_auth(make_node, tls_files):
    """A certificate and no frontend.auth_users: STARTTLS, but no AUTH after it (aiosmtpd offered
    AUTH LOGIN PLAIN there, with a check that always failed); AUTH gets Postfix's 503, HELP does
    not list it, and MAIL's AUTH= parameter stays unknown."""
    node = tls_node(make_node, tls_files, auth_users={})
    s = smtplib.SMTP("127.0.0.1", node.port, timeout=10)
    try:
        s.ehlo("client.test")
        listed = s.docmd("HELP")[1].split()
        assert b"AUTH" not in listed and b"STARTTLS" in listed, listed
        s.starttls(context=tls_files["client_ctx"])
        s.ehlo("client.test")
        assert not s.has_extn("auth"), s.esmtp_features
        assert s.docmd("AUTH", "PLAIN AGFsaWNlAHMzY3JldA==") == (503, b"5.5.1 Error: authentication not enabled")
        assert b"AUTH" not in s.docmd("HELP")[1].split()
        assert s.docmd("MAIL", "FROM:<a@remote.test> AUTH=<>")[0] == 555
    finally:
        s.close()


def test_require_tls(make_node, tls_files):
    node = tls_node(make_node, tls_files, require_tls=True)
    s = smtplib.SMTP("127.0.0.1", node.port, timeout=10)
    try:
        s.ehlo("client.test")
        assert s.has_extn("starttls")
        code, msg = s.docmd("MAIL", "FROM:<a@remote.test>")
        assert (code, msg[:6]) == (530, b"5.7.0 "), (code, msg)
        code, msg = s.docmd("RCPT", "TO:<alice@example.test>")
        assert code == 530
        s.starttls(context=tls_files["client_ctx"])
        s.ehlo("client.test")
        assert s.sendmail("a@remote.test", ["alice@example.test"], b"Subject: over-tls\r\n\r\nhi\r\n") == {}
    finally:
        s.close()
    assert [m["subject"] for m in messages(node)] == ["over-tls"]


def test_a_client_that_never_starts_its_tls_handshake_is_timed_out(make_node, tls_files):
    """After STARTTLS's 220 the client's handshake is awaited: the client's turn, so the inactivity
    limit applies (a command being carried out holds it off; a handshake is not one)."""
    node = tls_node(make_node, tls_files, connection_inactivity_timeout=1)
    c = Raw(node.port)
    ehlo(c)
    t0 = time.monotonic()
    assert c.cmd("STARTTLS") == "220 2.0.0 Ready to start TLS"
    assert c.closed_by_peer(5)
    assert time.monotonic() - t0 < 4
    assert node.alive


def test_tls_sessions_are_counted_once(make_node, tls_files):
    """STARTTLS re-enters connection_made: the slot must be taken and released exactly once."""
    node = tls_node(make_node, tls_files, max_inbound_connection=1)
    # Kept: lets the start-up probe's slot be released (on close, not a scan); a client cannot
    # observe that without taking a slot itself.
    time.sleep(0.3)
    s = smtplib.SMTP("127.0.0.1", node.port, timeout=10)
    s.starttls(context=tls_files["client_ctx"])
    s.ehlo("client.test")
    extra = Raw(node.port, source="127.0.0.2")  # refused while the TLS session holds the slot
    assert_reply(extra.greeting[-1], 421, "4.3.2")
    extra.close()
    s.quit()

    def free():
        c = Raw(node.port)
        ok = c.greeting[0].startswith("220 ")
        c.close()
        return ok
    wait_for(free, timeout=5, what="the TLS session's slot to be released")
    time.sleep(0.3)  # kept: free()'s own probe slot is released on close (not observable)
    # Exactly one slot again (a double release would let both in).
    a = Raw(node.port)
    b = Raw(node.port, source="127.0.0.2")
    assert a.greeting[0].startswith("220 ")
    assert_reply(b.greeting[-1], 421, "4.3.2")
    a.close()
    b.close()


# --------------------------------------------------------------------------- 10. vanishing clients

@pytest.mark.parametrize("workers", [1, 2])
def test_a_stop_tells_waiting_sessions_421(make_node, workers):
    """RFC 5321 3.8: a server shut down SHOULD send 421 first. On SIGTERM every session that waits
    for its client (between commands, or in the middle of a message's DATA) gets 421 4.3.2 and is
    closed; the message cut off is not queued, one acknowledged before is; with receive workers,
    sessions of every process are told."""
    node = make_node(overrides={"frontend": {"workers": workers}}).start()
    wait_for(lambda: node.log_path.read_text().count("serving the frontend on") == workers - 1, timeout=30,
             what="the receive worker listening")
    done = Raw(node.port)
    ehlo(done)
    assert send_one(done, "a@remote.test", ["alice@example.test"], body_of(200, "before")).startswith("250 ")
    waiting = [Raw(node.port) for _ in range(8)]  # with two workers, both processes hold some
    for c in waiting:
        ehlo(c)
    cut = Raw(node.port)
    ehlo(cut)
    for line in ("MAIL FROM:<a@remote.test>", "RCPT TO:<alice@example.test>", "DATA"):
        assert cut.cmd(line)[0] in "23"
    cut.send(b"Subject: cut off\r\n\r\nhalf a message\r\n")
    time.sleep(0.3)
    assert node.stop() == 0
    for c in [done, *waiting, cut]:
        assert c.reply() == ["421 4.3.2 Service shutting down"]
        assert c.closed_by_peer()
    assert [m["subject"] for m in messages(node)] == ["before"]


def test_client_gone_mid_data_stores_nothing(make_node):
    node = make_node().start()
    for gone in (Raw.close, Raw.abort):  # FIN, then RST
        c = Raw(node.port)
        ehlo(c)
        assert_reply(c.cmd("MAIL FROM:<a@remote.test>"), 250, "2.1.0")
        assert_reply(c.cmd("RCPT TO:<alice@example.test>"), 250, "2.1.5")
        assert c.cmd("DATA").startswith("354 ")
        c.send(b"Subject: half\r\n\r\nfirst half of the body\r\nsecond li")
        time.sleep(0.2)  # part of the scenario: half the body, then the client goes
        gone(c)
    time.sleep(0.5)  # waiting for absence: nothing may be stored for the vanished clients
    assert node.alive
    assert messages(node) == []
    r = swaks(node.port, "--to", "alice@example.test", "--from", "b@remote.test", "--header", "Subject: whole")
    queued_id(r)
    assert [m["subject"] for m in messages(node)] == ["whole"]


@pytest.mark.parametrize("how", ["bdat", "data"])
def test_a_client_that_half_closes_after_its_pipelined_quit_gets_every_reply(make_node, how):
    """Exim pipelines ``BDAT n LAST`` (or the final dot) with QUIT, then shuts its socket down for
    writing and reads the replies (TCP half-close). Every command sent before the end is carried
    out and answered and the message is queued once; aiosmtpd alone dropped the session at the
    end of input, so Exim never saw a 250 and deferred the message for good."""
    node = make_node().start()
    c = Raw(node.port)
    ehlo(c)
    body = b"From: a@remote.test\r\nSubject: half-closed " + how.encode() + b"\r\n\r\nbody\r\n"
    wire = b"MAIL FROM:<a@remote.test>\r\nRCPT TO:<alice@example.test>\r\n"
    if how == "bdat":
        wire += f"BDAT {len(body)} LAST\r\n".encode() + body + b"QUIT\r\n"
        c.send(wire)
    else:
        c.send(wire + b"DATA\r\n")
        assert [c.reply()[-1][:3] for _ in range(3)] == ["250", "250", "354"]
        c.send(body + b".\r\nQUIT\r\n")
    c.sock.shutdown(socket.SHUT_WR)
    got = [c.reply()[-1] for _ in range(4 if how == "bdat" else 2)]
    if how == "bdat":
        assert_reply(got.pop(0), 250, "2.1.0")
        assert_reply(got.pop(0), 250, "2.1.5")
    assert got[0].startswith("250 2.0.0 Ok: queued as "), got
    assert_reply(got[1], 221, "2.0.0")
    assert c.closed_by_peer()
    assert [m["subject"] for m in messages(node)] == [f"half-closed {how}"]
    assert node.alive and "Traceback" not in node.log()


def test_a_half_close_in_the_middle_of_a_command_or_a_chunk_ends_the_session_cleanly(make_node):
    """The end of input after a partial command line, inside a BDAT chunk or inside DATA: the
    session ends without a reply to the unfinished part, nothing is queued, no loop, no error."""
    node = make_node().start()
    transaction = b"MAIL FROM:<a@remote.test>\r\nRCPT TO:<alice@example.test>\r\n"
    for tail in (b"NOOP\r\nMAIL FROM:<a@remote.test", transaction + b"BDAT 100 LAST\r\nSubject: cut\r\n",
                 transaction + b"DATA\r\nSubject: cut\r\n\r\nno end"):
        c = Raw(node.port)
        ehlo(c)
        c.send(tail)
        c.sock.shutdown(socket.SHUT_WR)
        assert c.closed_by_peer()
        finals = [line for line in c.buf.decode().split("\r\n") if line[3:4] == " "]
        assert all(line[:1] in "23" for line in finals), finals  # the whole commands were answered
    time.sleep(0.3)  # waiting for absence: nothing may be stored
    assert messages(node) == []
    assert node.alive
    log = node.log()
    assert "Traceback" not in log and "SMTP session error" not in log


# --------------------------------------------------------------------------- 11. bad configuration

@pytest.mark.parametrize("frontend, key", [
    ({"max_message_size": "lots"}, "frontend.max_message_size"),
    ({"max_mesage_size": 1000}, "frontend.max_mesage_size"),
    ({"connection_inactivity_timeout": "soon"}, "frontend.connection_inactivity_timeout"),
])
def test_bad_config_exits_2_naming_the_key(tmp_path, frontend, key):
    cfg = tmp_path / "bad.toml"
    write_toml(cfg, {"node": {"name": NODE_NAME, "data_dir": str(tmp_path / "data")},
                     "frontend": {"listen": "127.0.0.1:1", **frontend}})
    res = subprocess.run([sys.executable, "-m", "transportd", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert key in lines[0], lines[0]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "data").exists()


# --------------------------------------------------------------------------- 12. internal errors (in process)

async def _start_frontend(tmp_path, accept, **frontend):
    from transportd.config import load_dict
    from transportd.smtp.frontend import FrontendHandler
    from transportd.smtp.server import ConnectionCounter, smtp_factory
    cfg = load_dict({"node": {"name": NODE_NAME, "data_dir": str(tmp_path / "data")},
                     "frontend": {"listen": "127.0.0.1:2525", **frontend},
                     "routing": {"accepted_domains": ["example.test"], "trusted_networks": ["127.0.0.1/32"]}},
                    base_dir=tmp_path)
    handler = FrontendHandler(cfg, accept)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(smtp_factory(cfg, handler, ConnectionCounter(10, 10)),
                                      host="127.0.0.1", port=0)
    return cfg, server, server.sockets[0].getsockname()[1]


async def test_internal_errors_are_451_never_5xx(tmp_path, monkeypatch):
    import aiosmtplib

    from transportd.errors import MessageRejected

    mode = {"v": "crash"}

    async def accept(envelope, session, connector):
        if mode["v"] == "crash":
            raise RuntimeError("disk on fire (KeyError: 'x')")
        if mode["v"] == "reject":
            raise MessageRejected("554 5.6.0 Policy says no")
        return 42

    cfg, server, port = await _start_frontend(tmp_path, accept)
    try:
        client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, timeout=10, start_tls=False)
        await client.connect()
        await client.ehlo(hostname="client.test")
        await client.mail("a@remote.test")
        await client.rcpt("alice@example.test")
        with pytest.raises(aiosmtplib.SMTPDataError) as err:
            await client.data(b"Subject: x\r\n\r\nhi\r\n")
        assert err.value.code == 451
        assert err.value.message.startswith("4.3.0 "), err.value.message
        assert "RuntimeError" not in err.value.message and "fire" not in err.value.message

        # The handler's own rejection is passed through as given.
        mode["v"] = "reject"
        await client.mail("a@remote.test")
        await client.rcpt("alice@example.test")
        with pytest.raises(aiosmtplib.SMTPDataError) as err:
            await client.data(b"Subject: x\r\n\r\nhi\r\n")
        assert (err.value.code, err.value.message) == (554, "5.6.0 Policy says no")

        # An exception inside a session hook (here RCPT) is 451 4.3.0 too, and the session lives on.
        mode["v"] = "ok"
        import transportd.smtp.frontend as frontend

        def broken(domain, accepted):
            raise TypeError("a broken rule")
        monkeypatch.setattr(frontend, "is_accepted", broken)
        await client.mail("a@remote.test")
        with pytest.raises(aiosmtplib.SMTPRecipientRefused) as err:
            await client.rcpt("bob@elsewhere.test")
        assert err.value.code == 451 and err.value.message.startswith("4.3.0 "), err.value
        assert "TypeError" not in err.value.message
        monkeypatch.undo()
        await client.rset()
        await client.mail("a@remote.test")
        await client.rcpt("alice@example.test")
        code, msg = await client.data(b"Subject: x\r\n\r\nhi\r\n")
        assert (code, msg) == (250, "2.0.0 Ok: queued as 42")
        await client.quit()
    finally:
        server.close()
        await server.wait_closed()


async def test_accept_is_not_cancelled_when_client_vanishes(tmp_path):
    """The commit behind DATA runs to its end even if the client is gone meanwhile."""
    started, finished = asyncio.Event(), asyncio.Event()
    seen: list[bytes] = []

    async def accept(envelope, session, connector):
        started.set()
        await asyncio.sleep(0.5)
        seen.append(envelope.original_content)
        finished.set()
        return 7

    _, server, port = await _start_frontend(tmp_path, accept)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await reader.readline()
        writer.write(b"EHLO c.test\r\nMAIL FROM:<a@remote.test>\r\nRCPT TO:<alice@example.test>\r\nDATA\r\n")
        while not (await reader.readline()).startswith(b"250 HELP"):  # EHLO's lines
            pass
        for _ in range(2):  # MAIL's and RCPT's 250; 354 below
            await reader.readline()
        assert (await reader.readline()).startswith(b"354 ")
        writer.write(b"Subject: vanish\r\n\r\nbody\r\n.\r\n")
        await asyncio.wait_for(started.wait(), 5)
        writer.transport.abort()
        await asyncio.wait_for(finished.wait(), 5)
        assert seen == [b"Subject: vanish\r\n\r\nbody\r\n"]
    finally:
        server.close()
        await server.wait_closed()



# --------------------------------------------------------------------------- CHUNKING (BDAT, RFC 3030)

def stored_bodies(node) -> dict[int, bytes]:
    from conftest import read_db
    return dict(read_db(node.data_dir / "queue.db", "SELECT message_id, data FROM message_bodies"))


def bdat_message(c: Raw, chunks: list[bytes], sender: str = "a@remote.test", rcpt: str = "alice@example.test",
                 ) -> list[str]:
    """MAIL, RCPT and every chunk (the last with LAST) in one write; the final line of each reply."""
    wire = f"MAIL FROM:<{sender}>\r\nRCPT TO:<{rcpt}>\r\n".encode()
    for i, chunk in enumerate(chunks):
        wire += f"BDAT {len(chunk)}{' LAST' if i == len(chunks) - 1 else ''}\r\n".encode() + chunk
    c.send(wire)
    return [c.reply()[-1] for _ in range(2 + len(chunks))]


def test_bdat_split_and_pipelined_chunks_make_one_message(make_node):
    """Chunks cut anywhere (inside CRLF, a lone dot line, an empty LAST chunk), all in one write:
    one 250 per chunk, the message queued with exactly the octets sent (no dot-stuffing)."""
    node = make_node().start()
    c = Raw(node.port)
    ehlo(c)
    body = (b"From: a@remote.test\r\nSubject: chunked\r\n\r\nline one\r\n.\r\n..two dots\r\n"
            + b"z" * 700 + b"\r\nend\r\n")
    cuts = [0, 1, 38, 39, 52, 53, 54, 120, len(body)]
    chunks = [body[a:b] for a, b in zip(cuts, cuts[1:])] + [b""]
    got = bdat_message(c, chunks)
    assert_reply(got[0], 250, "2.1.0")
    assert_reply(got[1], 250, "2.1.5")
    for size, r in zip((len(x) for x in chunks[:-1]), got[2:-1]):
        assert r == f"250 2.0.0 {size} octets received", r
    assert got[-1].startswith("250 2.0.0 Ok: queued as "), got[-1]
    qid = int(got[-1].rsplit(" ", 1)[1])
    assert stored_bodies(node)[qid].endswith(body)  # after the Received header we add
    # The same session goes on with a plain DATA transaction.
    assert send_one(c, "a@remote.test", ["alice@example.test"], b"Subject: after\r\n\r\nx\r\n").startswith("250 2.0.0")
    assert [m["subject"] for m in messages(node)] == ["chunked", "after"]
    assert "Traceback" not in node.log()


def test_bdat_refusals_consume_the_chunk_and_change_nothing(make_node):
    node = make_node(overrides={"frontend": {"max_message_size": 2000}}).start()
    c = Raw(node.port)
    ehlo(c)
    smuggled = b"RSET\r\nMAIL FROM:<evil@remote.test>\r\nRCPT TO:<alice@example.test>\r\nDATA\r\n"
    # Before MAIL: 503, and the chunk's octets are not read as commands.
    c.send(f"BDAT {len(smuggled)} LAST\r\n".encode() + smuggled)
    assert_reply(c.reply()[-1], 503, "5.5.1")
    assert_reply(c.cmd("NOOP"), 250, "2.0.0")
    # Syntax errors: 501, the session goes on.
    for bad in ("BDAT", "BDAT x", "BDAT 5 FIRST", "BDAT -1 LAST", "BDAT 1 LAST extra"):
        assert_reply(c.cmd(bad), 501, "5.5.4")
    # Over the size limit: the chunk that crosses it and every later one are refused (552), the
    # transaction ends at LAST, and the next one works.
    got = bdat_message(c, [b"a" * 900 + b"\r\n", b"b" * 1500, b"c" * 10, b""])
    assert got[2] == "250 2.0.0 902 octets received"
    assert [r[:9] for r in got[3:]] == ["552 5.3.4"] * 3, got
    # BDAT without LAST, then RSET: the chunk is dropped; DATA in the new transaction works.
    assert_reply(c.cmd("MAIL FROM:<a@remote.test>"), 250, "2.1.0")
    assert_reply(c.cmd("RCPT TO:<alice@example.test>"), 250, "2.1.5")
    c.send(b"BDAT 9\r\nleftover!")
    assert c.reply()[-1] == "250 2.0.0 9 octets received"
    assert_reply(c.cmd("DATA"), 503, "5.5.1")  # no DATA once BDAT began (RFC 3030 2)
    assert_reply(c.cmd("RSET"), 250, "2.0.0")
    r = send_one(c, "a@remote.test", ["alice@example.test"], b"Subject: clean\r\n\r\nclean\r\n")
    assert r.startswith("250 2.0.0 Ok: queued as ")
    # An over-long line in a chunked message: refused like in DATA.
    got = bdat_message(c, [b"Subject: long\r\n\r\n" + b"x" * 1200 + b"\r\n"])
    assert_reply(got[-1], 500, "5.5.2")
    assert_reply(c.cmd("QUIT"), 221, "2.0.0")
    assert [m["subject"] for m in messages(node)] == ["clean"]
    bodies = list(stored_bodies(node).values())
    assert len(bodies) == 1 and b"leftover" not in bodies[0] and b"evil" not in bodies[0]
    assert node.alive and "Traceback" not in node.log()


async def test_a_multiline_reply_goes_out_in_one_write(tmp_path, monkeypatch):
    """aiosmtpd writes (and drains) each reply line; an EHLO reply was ten writes. Every reply,
    multiline or not, is now one write, its lines in order (RFC 5321 4.2.1)."""
    async def accept(envelope, session, connector):
        return 7

    cfg, server, port = await _start_frontend(tmp_path, accept)
    writes: list[bytes] = []
    real_write = asyncio.StreamWriter.write

    def recording_write(self, data):
        if self.get_extra_info("sockname")[1] == port:  # the server's side of the connection
            writes.append(bytes(data))
        return real_write(self, data)

    monkeypatch.setattr(asyncio.StreamWriter, "write", recording_write)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def exchange(command: bytes) -> bytes:
            writer.write(command)
            out = b""
            while not re.search(rb"(^|\r\n)\d{3} [^\r\n]*\r\n$", out):
                out += await asyncio.wait_for(reader.read(65536), 10) or pytest.fail(f"closed after {out!r}")
            return out

        greeting = await exchange(b"")
        assert greeting.startswith(b"220 ") and writes == [greeting]
        reply = await exchange(b"EHLO client.test\r\n")
        lines = reply.decode().split("\r\n")[:-1]
        assert lines[0] == f"250-{NODE_NAME}" and lines[-1] == "250 HELP" and len(lines) >= 7, lines
        assert all(line.startswith("250-") for line in lines[:-1])
        assert writes[1:] == [reply]  # one write for the whole reply
        del writes[:]
        for command in (b"MAIL FROM:<a@remote.test>\r\n", b"RCPT TO:<alice@example.test>\r\n",
                        b"DATA\r\n", b"Subject: x\r\n\r\nhi\r\n.\r\n"):
            reply = await exchange(command)
            assert writes[-1] == reply and reply.count(b"\r\n") == 1, (command, reply)
        assert len(writes) == 4
        assert (await exchange(b"QUIT\r\n")).startswith(b"221 2.0.0")
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


def test_commands_pipelined_after_starttls_in_plaintext_are_discarded(make_node, tls_files):
    """CVE-2011-0411's class: commands sent in plaintext after STARTTLS, in the same packet, must
    not be run as if they came over TLS (an attacker on the path could inject them)."""
    node = tls_node(make_node, tls_files)
    c = Raw(node.port)
    c.cmd("EHLO client.test")
    c.send("STARTTLS\r\nMAIL FROM:<injected@remote.test>\r\n")
    assert c.reply()[-1].startswith("220") and c.buf == b""  # nothing more in plaintext
    c.sock = tls_files["client_ctx"].wrap_socket(c.sock, server_hostname="127.0.0.1")
    c.send("EHLO client.test\r\n")
    ehlo = c.reply()
    assert ehlo[0].startswith("250-"), ehlo  # the EHLO's reply, not one to the injected MAIL
    assert c.cmd("RCPT TO:<alice@example.test>").startswith("503"), "the injected MAIL opened a transaction"
    assert c.cmd("QUIT").startswith("221")
    c.close()
    assert node.alive
