"""Regression (found by `transportd chaos`, docs/reliability.md): a shadow node that loses its
queue database takes our messages' shadow copies with it; the primary must make them again.

Seen in the long chaos run: node2 held two messages behind a refusing sink, shadowed on node3;
node3 was wiped (a new queue database) and came back; 11 s later node2 was wiped before it had
delivered them, and nothing held a copy any more. Now, when node3 announces its new queue
database ID (XSHADOWREQUEST), node2 re-makes the shadows it had there; the later loss of node2
is survived through the new shadow (promoted on node2's ShadowStateChange).
"""

from __future__ import annotations

import shutil

from conftest import free_port, wait_for
from test_cluster_failover import accepted_with_shadow, make_cluster, send, sink_copies  # noqa: F401

LOCAL = "alice@example.test"  # MDB01 on node1: delivered, so nothing stays queued on node3


def test_primary_remakes_shadows_lost_with_a_wiped_shadow_node(make_cluster, sink):  # noqa: F811
    c = make_cluster(heartbeat=0.5, resubmit=60)  # only a state change may promote here
    c.start()
    n1, n2, n3 = c["node1"], c["node2"], c["node3"]

    def n3_dbid_known_to_n2() -> str | None:
        return n2.shadow_list().get(n3.name, {}).get("queue_database_id")

    # node3 announces its queue database ID to node2 when it shadows its own mail there.
    for _ in range(6):
        send(n3, LOCAL)
        if n3_dbid_known_to_n2():
            break
    old = wait_for(n3_dbid_known_to_n2, timeout=10, what="node2 to record node3's queue database ID")

    # A message queued on node2 (the sink is down), shadowed on node3 (the only remote-site peer).
    mid = send(n2, "carol@foreign.test")
    netid = accepted_with_shadow(n2, n3, mid)
    n2.wait_event("DEFER", netid)

    # node3 loses its queue database, and with it the shadow.
    n3.kill9()
    shutil.rmtree(n3.spec.data_dir)
    n3.start()
    for _ in range(10):
        send(n3, LOCAL)
        if (n3_dbid_known_to_n2() or old) != old:
            break
    wait_for(lambda: n3_dbid_known_to_n2() != old, timeout=10, what="node2 to see node3's new database")
    redirects = n2.wait_event("HAREDIRECT", netid, n=2, timeout=15)
    assert redirects[-1]["source-context"].startswith(f"{n3.name}=250 2.6.0 "), redirects[-1]
    assert "made 1 lost shadow(s)" in n2.log()
    wait_for(lambda: n3.shadow_list().get(n2.name, {}).get("shadows") == 1, timeout=10,
             what="the new shadow on node3")

    # Now node2 is wiped before delivering: the new shadow is promoted and delivered.
    n2.kill9()
    shutil.rmtree(n2.spec.data_dir)
    n2.start()
    sink.start()
    wait_for(lambda: sink_copies(sink, netid), timeout=30, what="the message at the sink after both wipes")
    assert n3.events("RESUBMIT", netid), "node3 promoted the re-made shadow"
    assert n1.proc.poll() is None


def test_promotion_survives_the_announcing_peer_hanging_up(procs, sink, tmp_path):
    """Regression (found by `transportd chaos`): a primary that announces a new queue database ID
    and hangs up at once (its own shadow attempt timed out) must still get its old shadows
    promoted and delivered; the cancelled session handler left them ``pending`` for ever."""
    import random
    import socket
    import subprocess
    import sys
    import threading
    import time
    import uuid

    from conftest import wait_port
    from test_cluster import FAST, FOREIGN, FakePrimary, auth_plain, b64_dbid, merge, reply, smtp, write_node_config

    sink.start()
    # A second peer that accepts and never answers: re-making the promoted copies redundant takes
    # the whole shadow_copy_timeout, long after the announcing peer hung up.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    base = random.randint(20, 200)
    node_ip, fake_name, secret = f"127.0.0.{base}", "fake.transportd.test", "s-" + uuid.uuid4().hex
    fake = FakePrimary((f"127.0.0.{base + 1}", free_port()), fake_name, str(uuid.uuid4()))
    fake.default_discard = []
    threading.Thread(target=fake.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        tport = free_port()
        config = tmp_path / "shadow.toml"
        write_node_config(config, merge(FAST, {
            "node": {"name": "shadow.transportd.test", "site": "site-a", "data_dir": str(tmp_path / "data")},
            "frontend": {"listen": f"{node_ip}:{free_port()}"},
            "transport": {"listen": f"{node_ip}:{tport}"},
            "cluster": {"secret": secret},
            "routing": {"accepted_domains": ["example.test"], "trusted_networks": ["127.0.0.1/32"],
                        "smart_host": sink.address},
            "shadow_redundancy": {"shadow_redundancy_enabled": True, "shadow_resubmit_time_span": 3600,
                                  "shadow_copy_timeout": 2},
        }), [{"name": fake_name, "site": "site-b", "transport": f"{fake.server_address[0]}:{fake.server_address[1]}"},
             {"name": "silent.transportd.test", "site": "site-a", "transport": f"127.0.0.1:{silent.getsockname()[1]}"}])
        with open(tmp_path / "shadow.log", "ab") as log:
            proc = procs.add(subprocess.Popen([sys.executable, "-m", "transportd", "serve", "--config", str(config)],
                                              stdout=log, stderr=subprocess.STDOUT))
        wait_port(node_ip, tport, proc=proc)
        guids = [str(uuid.uuid4()) for _ in range(5)]
        s = smtp(node_ip, tport, helo=fake_name)
        assert auth_plain(s, fake_name, secret)[0] == 235
        assert reply(s, f"XSHADOWREQUEST {fake_name} {b64_dbid(fake.dbid)}")[0] == 250
        for g in guids:
            assert reply(s, f"MAIL FROM:<a@example.test> XSHADOW={g}")[0] == 250
            assert reply(s, f"RCPT TO:<{FOREIGN}>")[0] == 250
            assert s.data(f"Subject: hangup {g}\r\n\r\nbody\r\n".encode())[0] == 250
        s.quit()

        # The primary comes back with a new queue database, says so, and hangs up at once.
        s = smtp(node_ip, tport, helo=fake_name)
        assert auth_plain(s, fake_name, secret)[0] == 235
        s.sock.sendall(f"XSHADOWREQUEST {fake_name} {b64_dbid(str(uuid.uuid4()))}\r\n".encode())
        wait_for(lambda: "promoting its shadows" in (tmp_path / "shadow.log").read_text(errors="replace"),
                 timeout=10, what="the promotion to begin")
        time.sleep(0.5)
        s.close()  # the socket and smtplib's file on it: the fd really closes

        wait_for(lambda: sum(any(g.encode() in m for m in sink.messages()) for g in guids) == len(guids),
                 timeout=30, what="every promoted shadow at the sink")
        assert proc.poll() is None
    finally:
        silent.close()
        fake.shutdown()
        fake.server_close()
