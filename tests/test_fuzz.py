"""Bad input on the receive path, fuzzed with hypothesis over real sockets.

One real node process (module scope) with a frontend and a transport connector (one
configured peer name, the cluster secret known to the test). Hypothesis generates
random and mutated command lines, over-long lines, binary bytes, bare LF and CR,
pipelined junk, MAIL/RCPT parameters, X-verbs with bad arguments from untrusted and
trusted (authenticated peer) sessions, and DATA bodies with SMTP smuggling sequences
(``\\n.\\n``, ``\\r.\\n``). After every example: each line the server read got exactly one
reply (or the session was ended with a 421/5xx), the daemon still answers, every
message acknowledged so far is still in the queue database, and nothing malformed
(a smuggled transaction, an invalid address) was queued.

Bounded: FUZZ_EXAMPLES examples per test (default 60), deadline off.
"""

from __future__ import annotations

import base64
import os
import re
import socket
import sqlite3
import time
import uuid

import pytest
from conftest import Node, ProcessRegistry, free_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transportd.devtools import cluster as cluster_mod
from transportd.smtp.addresses import valid_address

settings.register_profile("fuzz", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")), deadline=None,
                          database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
FUZZ = settings.get_profile("fuzz")
PEER = "peer1.transportd.test"
SECRET = "fuzz-cluster-secret"
FINAL = re.compile(rb"^(\d{3})(?: |$)")


class FuzzNode:
    def __init__(self, node: Node, transport_port: int):
        self.node = node
        self.host = "127.0.0.1"
        self.frontend = node.port
        self.transport = transport_port
        self.acknowledged: set[int] = set()

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.node.data_dir / 'queue.db'}?mode=ro", uri=True, timeout=10)

    def message_ids(self) -> set[int]:
        con = self.db()
        try:
            return {r[0] for r in con.execute("SELECT id FROM messages")}
        finally:
            con.close()

    def check_queue(self) -> None:
        """Everything acknowledged is there; every queued envelope is well formed."""
        con = self.db()
        try:
            ids = {r[0] for r in con.execute("SELECT id FROM messages")}
            assert self.acknowledged <= ids, f"acknowledged but gone: {sorted(self.acknowledged - ids)}"
            assert ids <= self.acknowledged, f"queued without a 250: {sorted(ids - self.acknowledged)}"
            for sender, in con.execute("SELECT sender FROM messages"):
                assert sender == "" or valid_address(sender), sender
            for address, in con.execute("SELECT address FROM recipients"):
                assert valid_address(address), address
        finally:
            con.close()

    def alive(self) -> None:
        assert self.node.alive, "the daemon died:\n" + self.node.log()[-4000:]
        with socket.create_connection((self.host, self.frontend), timeout=10) as s:
            assert s.recv(200).startswith(b"220 ")


@pytest.fixture(scope="module")
def fuzz_node(tmp_path_factory):
    registry = ProcessRegistry()
    base = tmp_path_factory.mktemp("fuzz")
    tport = free_port()
    node = Node(registry, base, "fuzz", overrides={
        "node": {"log_level": "info"},
        "transport": {"listen": f"127.0.0.1:{tport}"},
        "cluster": {"secret": SECRET},
        "frontend": {"max_inbound_connection_per_source": 50},
    })
    # A configured peer name (no process behind it): the transport connector's trusted sessions.
    node.config_path.write_text(cluster_mod.render_toml(
        node.sections, [{"name": PEER, "site": "site-b", "transport": "127.0.0.1:9"}]))
    try:
        node.start()
        yield FuzzNode(node, tport)
    finally:
        registry.cleanup()


# ------------------------------------------------------------------------------ a raw session

class Session:
    def __init__(self, host: str, port: int):
        self.sock = socket.create_connection((host, port), timeout=10)
        self.buf = b""
        self.closed = False
        greeting = self.replies(1)
        assert greeting and greeting[0].startswith(b"220"), greeting

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            self.closed = True

    def replies(self, n: int, timeout: float = 10) -> list[bytes]:
        """Read up to n final reply lines (the last line of each reply); fewer if the server closes."""
        out: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            while b"\n" in self.buf and len(out) < n:
                line, self.buf = self.buf.split(b"\n", 1)
                if FINAL.match(line):
                    out.append(line.rstrip(b"\r"))
            if len(out) >= n:
                break
            if self.closed or time.monotonic() > deadline:
                break
            self.sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.closed = True
            self.buf += chunk
        return out

    def command(self, line: bytes) -> bytes:
        self.send(line + b"\r\n")
        got = self.replies(1)
        assert got, f"no reply to {line[:80]!r}"
        return got[0]

    def close(self) -> None:
        try:
            self.sock.sendall(b"QUIT\r\n")
            self.replies(1, timeout=2)
        except OSError:
            pass
        self.sock.close()


def check_answered(s: Session, sent_lines: int, replies: list[bytes]) -> None:
    """One reply per line the server read, unless it ended the session with a 421 or 5xx."""
    if len(replies) < sent_lines:
        assert s.closed, f"{len(replies)} replies to {sent_lines} lines and the session still open: {replies[-3:]}"
        assert replies and replies[-1][:3] in (b"421", b"500", b"554"), replies[-3:]  # 421: too many errors
    for r in replies:
        assert FINAL.match(r), r
        assert not r.startswith(b"451 4.3.0 Internal error"), r  # bad input is the client's error, never ours


# ------------------------------------------------------------------------------ strategies

VERBS = [b"HELO", b"EHLO", b"MAIL FROM:", b"RCPT TO:", b"NOOP", b"RSET", b"VRFY", b"EXPN", b"HELP",
         b"XSHADOW", b"XSHADOWREQUEST", b"XQDISCARD", b"XRESUBMIT", b"STARTTLS", b"AUTH", b"BDAT", b"ETRN",
         b"TURN", b"mail from:", b"rcpt to:", b""]
VALID = [b"EHLO fuzz.test", b"MAIL FROM:<a@example.test>", b"RCPT TO:<b@example.test>",
         b"MAIL FROM:<> BODY=8BITMIME SIZE=100", b"RCPT TO:<x@elsewhere.test> NOTIFY=NEVER",
         b"MAIL FROM:<a@example.test> SMTPUTF8", b"XQDISCARD 5", b"NOOP", b"RSET", b"VRFY postmaster",
         b"MAIL FROM:<a@example.test> XSHADOW=" + str(uuid.uuid4()).encode(),
         b"XSHADOWREQUEST " + PEER.encode() + b" " + base64.b64encode(uuid.uuid4().bytes),
         b"XSHADOW " + base64.b64encode(PEER.encode()), b"XRESUBMIT MDB01 0 100"]
PARAMS = [b"SIZE=abc", b"SIZE=99999999999999999999", b"BODY=JUNK", b"SMTPUTF8", b"XSHADOW=", b"XSHADOW=not-a-guid",
          b"AUTH=<>", b"RET=FULL", b"ENVID=x", b"NOTIFY=SUCCESS,FAILURE", b"ORCPT=rfc822;x@y", b"=", b"A=B=C"]
ADDRESSES = [b"<a@example.test>", b"<>", b"<@relay:a@b>", b"a@example.test", b"<a@[127.0.0.1]>", b"<\"q u\"@x.test>",
             b"<a@b@c>", b"<" + b"x" * 300 + b"@example.test>", b"<a@example.test", b"<\xff\xfe@x>",
             "<ü@exämple.test>".encode(), b"\"", b"a@", b"<a@[1>", b"a@[", b"<a@[IPv6:::1]>", b"<a@(c)b.test>"]

no_newline = st.binary(max_size=200).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b""))
text_arg = st.text(max_size=120).map(lambda t: t.encode("utf-8", "surrogatepass").replace(b"\n", b"")
                                     .replace(b"\r", b""))
long_arg = st.integers(900, 6000).map(lambda n: b"a" * n)
mail_arg = st.tuples(st.sampled_from(ADDRESSES), st.lists(st.sampled_from(PARAMS) | text_arg, max_size=4)).map(
    lambda t: b" ".join([t[0], *t[1]]))
arg = st.one_of(no_newline, text_arg, long_arg, mail_arg)


def _mutate(line: bytes, edits: list[tuple[int, bytes]]) -> bytes:
    b = bytearray(line)
    for pos, data in edits:
        i = pos % (len(b) + 1)
        b[i:i + 1] = data
    return bytes(b).replace(b"\n", b"").replace(b"\r", b"")


mutated = st.builds(_mutate, st.sampled_from(VALID),
                    st.lists(st.tuples(st.integers(0, 200), st.binary(min_size=0, max_size=3)), max_size=4))
command_line = st.one_of(
    st.builds(lambda v, a: (v + b" " + a) if v and not v.endswith(b":") else v + a, st.sampled_from(VERBS), arg),
    mutated, st.sampled_from(VALID), no_newline, long_arg,
)


def safe(line: bytes) -> bool:
    """DATA and BDAT switch the session to message mode (BDAT reads its chunk's octets: the lines
    after it) and QUIT ends it: the fuzzers send none of them (test_receive.py has BDAT's cases)."""
    verb = line.partition(b" ")[0].upper()
    return verb not in (b"DATA", b"QUIT", b"BDAT")


lines_strategy = st.lists(command_line.filter(safe), min_size=1, max_size=12)
separators = st.sampled_from([b"\r\n", b"\n", b"\r", b"\r\r\n", b"\n\r"])


def run_lines(node: FuzzNode, port: int, lines: list[bytes], seps: list[bytes], *, login: bool = False) -> None:
    s = Session(node.host, port)
    try:
        assert s.command(b"EHLO fuzz.test").startswith(b"250")
        if login:
            token = base64.b64encode(b"\0" + PEER.encode() + b"\0" + SECRET.encode())
            assert s.command(b"AUTH PLAIN " + token).startswith(b"235")
        stream = b"".join(line + sep for line, sep in zip(lines, seps)) + b"NOOP\r\n"
        expected = stream.count(b"\n")
        s.send(stream)  # pipelined: all at once
        check_answered(s, expected, s.replies(expected, timeout=30))
    finally:
        s.close()
    node.alive()
    node.check_queue()


# ------------------------------------------------------------------------------ the tests

@FUZZ
@given(lines=lines_strategy, data=st.data())
def test_fuzz_frontend_command_lines(fuzz_node, lines, data):
    seps = [data.draw(separators) for _ in lines]
    run_lines(fuzz_node, fuzz_node.frontend, lines, seps)


@FUZZ
@given(lines=lines_strategy, data=st.data())
def test_fuzz_transport_untrusted_session(fuzz_node, lines, data):
    seps = [data.draw(separators) for _ in lines]
    run_lines(fuzz_node, fuzz_node.transport, lines, seps)


xverb_line = st.builds(lambda v, a: v + b" " + a,
                       st.sampled_from([b"XSHADOW", b"XSHADOWREQUEST", b"XQDISCARD", b"XRESUBMIT",
                                        b"XSHADOWREQUEST " + PEER.encode(), b"MAIL FROM:<a@example.test> XSHADOW=",
                                        b"XSHADOWREQUEST other.transportd.test"]),
                       arg) | mutated


@FUZZ
@given(lines=st.lists(xverb_line.filter(safe), min_size=1, max_size=10))
def test_fuzz_x_verbs_from_an_authenticated_peer(fuzz_node, lines):
    run_lines(fuzz_node, fuzz_node.transport, lines, [b"\r\n"] * len(lines), login=True)


SMUGGLE = [b"\n.\n", b"\r.\n", b"\n.\r\n", b"\r\n.\n", b"\r\n.\r", b"\n..\n", b"\r\n\x00.\r\n", b"\r.\r"]
body_piece = st.one_of(st.sampled_from(SMUGGLE), no_newline,
                       st.just(b"MAIL FROM:<evil@elsewhere.test>\r\nRCPT TO:<victim@example.test>\r\nDATA\r\n"
                               b"Subject: smuggled\r\n\r\nsmuggled\r\n"),
                       st.sampled_from([b"\r\n", b"\n", b"\r", b"\r\n\r\n"]))


@FUZZ
@given(pieces=st.lists(body_piece, min_size=1, max_size=15), via_transport=st.booleans())
def test_fuzz_data_smuggling_queues_one_message_or_none(fuzz_node, pieces, via_transport):
    body = b"Subject: fuzz\r\n\r\n" + b"".join(pieces)
    if b"\r\n.\r\n" in b"\r\n" + body + b"\r\n":
        body = body.replace(b"\r\n.\r\n", b"\r\n..\r\n")  # a real end of data would be the client's own choice
        if b"\r\n.\r\n" in b"\r\n" + body + b"\r\n":
            return
    port = fuzz_node.transport if via_transport else fuzz_node.frontend
    before = fuzz_node.message_ids()
    s = Session(fuzz_node.host, port)
    try:
        assert s.command(b"EHLO fuzz.test").startswith(b"250")
        assert s.command(b"MAIL FROM:<a@example.test>").startswith(b"250")
        assert s.command(b"RCPT TO:<b@example.test>").startswith(b"250")
        assert s.command(b"DATA").startswith(b"354")
        s.send(body + b"\r\n.\r\nNOOP\r\n")
        got = s.replies(2, timeout=30)
        assert len(got) == 2, f"expected the DATA reply and NOOP's, got {got}"
        end, noop = got
        assert noop.startswith(b"250"), (end, noop)
    finally:
        s.close()
    after = fuzz_node.message_ids()
    m = re.match(rb"250 2\.0\.0 Ok: queued as (\d+)", end)
    if m:
        qid = int(m.group(1))
        fuzz_node.acknowledged.add(qid)
        assert after - before == {qid}, f"one 250, queued {sorted(after - before)}"
        con = fuzz_node.db()
        try:
            stored = con.execute("SELECT data FROM message_bodies WHERE message_id = ?", (qid,)).fetchone()[0]
        finally:
            con.close()
        # The whole body, smuggled commands included, is inside the one message.
        assert b"".join(p for p in pieces if b"smuggled" in p)[:20] in stored
    else:
        assert end[:1] in (b"4", b"5"), end
        assert after == before, "refused, yet queued"
    fuzz_node.alive()
    fuzz_node.check_queue()


def test_fuzzed_node_kept_everything_it_acknowledged(fuzz_node):
    """Runs last in this module: every 250 of the smuggling test is still queued, and the log shows
    no crash."""
    fuzz_node.check_queue()
    log = fuzz_node.node.log()
    assert "Traceback" not in log, log[-4000:]
    assert fuzz_node.node.alive
