"""A receive connector's certificate renewed on disk is used without a restart (smtp/tls.py); a
STARTTLS handshake that fails is a routine event of the session (smtp/server.py)."""

from __future__ import annotations

import logging
import os
import re
import smtplib
import socket
import ssl
import time
from pathlib import Path

import pytest
from conftest import free_port, wait_for, wait_port

from transportd.smtp.tls import ServerTLS

trustme = pytest.importorskip("trustme")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write_pair(folder: Path, cert, stamp: int) -> None:
    """The certificate and key files, with a distinct modification time (as a renewal writes)."""
    cert.cert_chain_pems[0].write_to_path(str(folder / "cert.pem"))
    cert.private_key_pem.write_to_path(str(folder / "key.pem"))
    for name in ("cert.pem", "key.pem"):
        os.utime(folder / name, ns=(stamp, stamp))


def _loaded_serial(context: ssl.SSLContext) -> int:
    """The serial number of the certificate a context serves, by a handshake in memory."""
    client_ctx = ssl.create_default_context()
    client_ctx.check_hostname = False
    client_ctx.verify_mode = ssl.CERT_NONE
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(c_in, c_out, server_side=False)
    server = context.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side, out, into in ((client, c_out, s_in), (server, s_out, c_in)):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
            into.write(out.read())
    der = client.getpeercert(binary_form=True)
    from cryptography import x509
    return x509.load_der_x509_certificate(der).serial_number


def test_a_renewed_pair_is_taken_at_the_next_check_and_a_broken_one_never(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="transportd")
    ca = trustme.CA()
    first, second, third = (ca.issue_cert("node1.transportd.test") for _ in range(3))
    write_pair(tmp_path, first, 10**18)
    clock = Clock()
    tls = ServerTLS(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"), check_interval=60, clock=clock)
    original = tls.context()
    serial = _loaded_serial(original)
    write_pair(tmp_path, second, 2 * 10**18)
    assert tls.context() is original  # not yet due: no file is read
    clock.now += 60
    renewed = tls.context()
    assert renewed is not original and _loaded_serial(renewed) != serial and tls.reloads == 1
    assert "changed: new sessions use it" in caplog.text
    # a certificate written without its key yet (a renewal half done): the one in use stays
    third.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    os.utime(tmp_path / "cert.pem", ns=(3 * 10**18, 3 * 10**18))
    clock.now += 60
    assert tls.context() is renewed and tls.reloads == 1
    assert caplog.text.count("does not load") == 1
    clock.now += 60
    assert tls.context() is renewed and caplog.text.count("does not load") == 1  # said once per change
    third.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    os.utime(tmp_path / "key.pem", ns=(3 * 10**18, 3 * 10**18))
    clock.now += 60
    assert _loaded_serial(tls.context()) not in (serial, _loaded_serial(renewed)) and tls.reloads == 2


def test_a_file_gone_missing_is_said_once_per_state_and_taken_again_when_back(tmp_path, caplog):
    """A certificate moved away (a renewal replacing it in two steps, a volume unmounted) is said
    once, not at every check; back as it was, it is taken again and said so; another bad state
    (the key gone now) is said once in its turn. The context in use stays meanwhile."""
    caplog.set_level(logging.INFO, logger="transportd")
    write_pair(tmp_path, trustme.CA().issue_cert("node1.transportd.test"), 10**18)
    clock = Clock()
    tls = ServerTLS(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"), check_interval=1, clock=clock)
    original = tls.context()

    def checks(n: int) -> None:
        for _ in range(n):
            clock.now += 1
            assert tls.context() is not None

    (tmp_path / "cert.pem").rename(tmp_path / "cert.away")
    checks(4)
    assert tls.context() is original and caplog.text.count("does not load") == 1, caplog.text
    assert "No such file" in caplog.text
    (tmp_path / "cert.away").rename(tmp_path / "cert.pem")
    checks(2)
    assert tls.reloads == 1 and caplog.text.count("changed: new sessions use it") == 1, caplog.text
    back = tls.context()
    (tmp_path / "key.pem").rename(tmp_path / "key.away")
    checks(4)
    assert tls.context() is back and caplog.text.count("does not load") == 2, caplog.text


def test_an_implicit_tls_listener_hands_each_handshake_to_the_current_certificate(tmp_path):
    """frontend.implicit_tls_listen's context is fixed when the server starts; each handshake is
    handed to ``context()``, so a renewal is served there too."""
    ca = trustme.CA()
    first, second = ca.issue_cert("node1.transportd.test"), ca.issue_cert("node1.transportd.test")
    write_pair(tmp_path, first, 10**18)
    clock = Clock()
    tls = ServerTLS(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"), check_interval=60, clock=clock)
    front = tls.implicit_context()
    serial = _loaded_serial(front)
    write_pair(tmp_path, second, 2 * 10**18)
    assert _loaded_serial(front) == serial  # not yet due
    clock.now += 60
    assert _loaded_serial(front) not in (serial, None) and tls.reloads == 1


def test_no_check_with_an_interval_of_zero(tmp_path):
    ca = trustme.CA()
    write_pair(tmp_path, ca.issue_cert("a.test"), 10**18)
    clock = Clock()
    tls = ServerTLS(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"), check_interval=0, clock=clock)
    first = tls.context()
    write_pair(tmp_path, ca.issue_cert("a.test"), 2 * 10**18)
    clock.now += 10**6
    assert tls.context() is first


def peer_serial(port: int, implicit: bool = False) -> int:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if implicit:
        with smtplib.SMTP_SSL("127.0.0.1", port, timeout=20, context=context) as c:
            der = c.sock.getpeercert(binary_form=True)
    else:
        with smtplib.SMTP("127.0.0.1", port, timeout=20) as c:
            c.ehlo("client.test")
            c.starttls(context=context)
            der = c.sock.getpeercert(binary_form=True)
    from cryptography import x509
    return x509.load_der_x509_certificate(der).serial_number


def test_a_running_node_serves_its_renewed_certificate(make_node, tmp_path):
    """certbot (or a secret mounted in a container) replaces the files: the node's next STARTTLS
    session, and the next on its implicit-TLS port, presents the new certificate, with no
    restart, and says so in its log."""
    certs = tmp_path / "certs"
    certs.mkdir()
    ca = trustme.CA()
    old, new = ca.issue_cert("node1.transportd.test", "127.0.0.1"), ca.issue_cert("node1.transportd.test")
    write_pair(certs, old, 10**18)
    tls_port = free_port()
    node = make_node(overrides={
        "node": {"tls_certificate_check_interval": 1},
        "frontend": {"tls_certificate": str(certs / "cert.pem"), "tls_key": str(certs / "key.pem"),
                     "implicit_tls_listen": f"127.0.0.1:{tls_port}"}}).start()
    from cryptography import x509
    old_serial = x509.load_pem_x509_certificate(old.cert_chain_pems[0].bytes()).serial_number
    new_serial = x509.load_pem_x509_certificate(new.cert_chain_pems[0].bytes()).serial_number
    assert peer_serial(node.port) == old_serial == peer_serial(tls_port, implicit=True)
    write_pair(certs, new, 2 * 10**18)
    wait_for(lambda: peer_serial(node.port) == new_serial, timeout=15, interval=0.5, what="the renewed certificate")
    assert peer_serial(tls_port, implicit=True) == new_serial
    assert "TLS certificate" in node.log() and "changed: new sessions use it" in node.log()
    assert node.alive


# ------------------------------------------------------------------------------ failed handshakes


def tls_files(folder: Path) -> tuple[Path, Path]:
    """A certificate for node1.transportd.test and 127.0.0.1 and its key, from a CA no client here trusts."""
    folder.mkdir(exist_ok=True)
    write_pair(folder, trustme.CA().issue_cert("node1.transportd.test", "127.0.0.1"), 10**18)
    return folder / "cert.pem", folder / "key.pem"


def starttls_accepted(port: int) -> socket.socket:
    """A connection whose STARTTLS was answered 220: the server waits for the client's handshake."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    f = s.makefile("rb")
    assert f.readline().startswith(b"220 ")
    s.sendall(b"EHLO client.test\r\n")
    while not f.readline().startswith(b"250 "):
        pass
    s.sendall(b"STARTTLS\r\n")
    assert f.readline().startswith(b"220 2.0.0 Ready to start TLS")
    f.close()  # the socket stays open (makefile holds a reference of its own, now dropped)
    return s


def until_closed(s: socket.socket, timeout: float = 10) -> bytes:
    """What the server sends until it closes the connection."""
    s.settimeout(timeout)
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got


def served(port: int) -> bool:
    """A new session is served (not refused over the per-source limit): the slots of the sessions
    before it were given back (the node does so as it closes them, the client may see the close first)."""
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as client:
            return client.noop()[0] == 250
    except smtplib.SMTPConnectError:
        return False


def fail_handshakes(port: int) -> None:
    """Three ways a STARTTLS handshake ends without TLS, as clients on the Internet end them: the
    client hangs up after the 220, it goes on in plaintext, it refuses the certificate."""
    starttls_accepted(port).close()
    s = starttls_accepted(port)
    s.sendall(b"EHLO plain.test\r\n")  # not a TLS ClientHello
    until_closed(s)
    s.close()
    s = starttls_accepted(port)
    with pytest.raises(ssl.SSLCertVerificationError):
        ssl.create_default_context().wrap_socket(s, server_hostname="node1.transportd.test")  # an unknown CA
    s.close()


def test_a_failed_starttls_handshake_is_a_line_of_the_log_not_an_internal_error(make_node, tmp_path):
    """A client whose STARTTLS handshake fails (it hangs up, speaks plaintext, refuses the
    certificate) is routine on the Internet: one INFO line naming the client and the reason, on
    both connectors, no ERROR and no traceback (an ERROR with a traceback is for our bugs); the
    connection's slot is given back (one slot per source here: the next client is served)."""
    cert, key = tls_files(tmp_path / "certs")
    transport_port = free_port()
    node = make_node(overrides={
        "frontend": {"tls_certificate": str(cert), "tls_key": str(key), "max_inbound_connection_per_source": 1},
        "transport": {"listen": f"127.0.0.1:{transport_port}", "tls_certificate": str(cert), "tls_key": str(key)},
        "cluster": {"secret": "tls-test-secret"}}).start()
    wait_port("127.0.0.1", transport_port, proc=node.proc)
    wait_for(lambda: served(node.port), timeout=5, what="wait_port's session to end")
    for port in (node.port, transport_port):
        fail_handshakes(port)
    lines = wait_for(lambda: (found := re.findall(r".*STARTTLS from \('127\.0\.0\.1', \d+\) failed: .*", node.log()))
                     and len(found) >= 6 and found, timeout=10, what="six failed handshakes in the log")
    assert len(lines) == 6 and all(" INFO " in line for line in lines), lines
    assert any("closed" in line for line in lines) and any("unknown ca" in line.lower() for line in lines), lines
    assert "SMTP session error" not in node.log() and "Traceback" not in node.log()
    wait_for(lambda: served(node.port), timeout=5, what="the slot given back")
    assert node.alive


def test_a_time_out_while_the_handshake_is_awaited_closes_without_a_plaintext_reply(make_node, tmp_path):
    """RFC 3207 section 4: after the 220 to STARTTLS only the TLS negotiation follows. A client
    that sends nothing (or half a ClientHello) until connection_inactivity_timeout is cut off
    without the 421 (in plaintext, it would be garbage inside the handshake); its slot is given back."""
    cert, key = tls_files(tmp_path / "certs")
    node = make_node(overrides={"frontend": {
        "tls_certificate": str(cert), "tls_key": str(key), "max_inbound_connection_per_source": 1,
        "connection_inactivity_timeout": 1, "connection_timeout": 30}}).start()
    wait_for(lambda: served(node.port), timeout=5, what="wait_port's session to end")
    for partial in (b"", b"\x16\x03\x01\x02\x00\x01"):  # nothing; a TLS record header and a few octets
        s = starttls_accepted(node.port)
        s.sendall(partial)
        t0 = time.monotonic()
        got = until_closed(s, timeout=10)
        s.close()
        assert got == b"" and time.monotonic() - t0 < 8, got
        wait_for(lambda: served(node.port), timeout=5, what="the slot given back")
    assert node.log().count("inactivity timeout during the TLS handshake") == 2, node.log()[-3000:]
    assert node.alive


def test_a_running_node_says_once_that_its_certificate_went_missing(make_node, tmp_path):
    """The certificate file moved away while the node runs, checked at every connection (1 s):
    one ERROR line for the change, not one per check; sessions go on with the certificate in use."""
    cert, key = tls_files(tmp_path / "certs")
    node = make_node(overrides={"node": {"tls_certificate_check_interval": 1},
                                "frontend": {"tls_certificate": str(cert), "tls_key": str(key)}}).start()
    serial = peer_serial(node.port)
    cert.rename(cert.with_suffix(".away"))
    for _ in range(4):
        time.sleep(1.1)  # a check is due at each connection
        assert peer_serial(node.port) == serial
    assert node.log().count("does not load") == 1, node.log()[-3000:]
    assert node.alive
