"""Peers over STARTTLS on the transport connector: required when configured, certificates verified
against the cluster CA before the cluster secret is sent."""

from __future__ import annotations

import json
import random
import smtplib
import subprocess
import sys

import trustme

from conftest import free_port, queued_id, swaks, wait_for, wait_port
from transportd.devtools.cluster import generate


def _events(config, event_id):
    res = subprocess.run([sys.executable, "-m", "transportd", "tracking", "search", "--event-id", event_id,
                          "--json", "--config", config], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [json.loads(x) for x in res.stdout.splitlines() if x.strip()]


def _start(specs, procs, tmp_path):
    for spec in specs:
        proc = procs.add(subprocess.Popen([sys.executable, "-m", "transportd", "serve", "--config", spec.config],
                                          stdout=open(tmp_path / f"{spec.short}.log", "wb"), stderr=subprocess.STDOUT))
        host, _, port = spec.frontend.rpartition(":")
        wait_port(host, int(port), proc=proc)


def _cluster(tmp_path, sink, ca: trustme.CA, signer: trustme.CA | None = None):
    base = random.randint(20, 200)
    ips = [f"127.0.0.{base + i}" for i in range(2)]
    cert = (signer or ca).issue_cert(*ips, "node1.transportd.test", "node2.transportd.test")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "node.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return generate(tmp_path / "cluster", nodes=2, sites=1, ip_base=base, frontend_port=free_port(),
                    transport_port=free_port(), sink_address=sink.address,
                    overrides={"transport": {"tls_certificate": str(tmp_path / "node.pem"),
                                             "tls_key": str(tmp_path / "node.pem"),
                                             "tls_ca": str(tmp_path / "ca.pem")},
                               "shadow_redundancy": {"shadow_heartbeat_frequency": 0.5, "shadow_copy_timeout": 5},
                               "delivery": {"queue_poll_interval": 0.2}})


def test_shadow_over_verified_tls_and_plaintext_peers_refused(tmp_path, procs, sink):
    sink.start()
    specs = _cluster(tmp_path, sink, trustme.CA())
    _start(specs, procs, tmp_path)
    host, _, port = specs[0].frontend.rpartition(":")
    queued_id(swaks(int(port), "--to", "carol@elsewhere.test", server=host))
    redirect = _events(specs[0].config, "HAREDIRECT")
    assert len(redirect) == 1 and redirect[0]["source-context"].startswith("node2.transportd.test=250 2.6.0")
    wait_for(lambda: _events(specs[1].config, "HADISCARD"), timeout=15, what="discard over TLS")

    # Without STARTTLS a client gets no further than EHLO: AUTH and the X-verbs need TLS first.
    t_host, _, t_port = specs[0].transport.rpartition(":")
    with smtplib.SMTP(t_host, int(t_port), timeout=10) as s:
        s.ehlo("node2.transportd.test")
        assert s.has_extn("starttls")
        code, msg = s.docmd("AUTH", "PLAIN AG5vZGUyAHgK")
        assert code == 530, (code, msg)
        code, msg = s.docmd("XQDISCARD", "5")
        assert code == 530, (code, msg)


def test_peer_with_a_certificate_from_another_ca_gets_no_shadow(tmp_path, procs, sink):
    sink.start()
    cluster_ca, rogue_ca = trustme.CA(), trustme.CA()
    specs = _cluster(tmp_path, sink, cluster_ca, signer=rogue_ca)
    _start(specs, procs, tmp_path)
    host, _, port = specs[0].frontend.rpartition(":")
    queued_id(swaks(int(port), "--to", "carol@elsewhere.test", server=host))
    fail = _events(specs[0].config, "HAREDIRECTFAIL")
    assert len(fail) == 1 and "node2.transportd.test" in fail[0]["source-context"]
    assert _events(specs[1].config, "HARECEIVE") == []
