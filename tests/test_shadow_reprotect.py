"""Regaining redundancy after a failure (found by `transportd chaos`, docs/reliability.md).

A shadow node that loses its queue database takes our messages' shadow copies with it; the
primary must make them again. A promoted copy is delivered at once, while its new shadow is
made. A message accepted without a shadow gets one when a peer is back.

Seen in the long chaos run: node2 held two messages behind a refusing sink, shadowed on node3;
node3 was wiped (a new queue database) and came back; 11 s later node2 was wiped before it had
delivered them, and nothing held a copy any more. Now, when node3 announces its new queue
database ID (XSHADOWREQUEST), node2 re-makes the shadows it had there; the later loss of node2
is survived through the new shadow (promoted on node2's ShadowStateChange).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from clusters import (
    FAST,
    FOREIGN,
    FakePrimary,
    accepted_with_shadow,
    auth_plain,
    b64_dbid,
    merge,
    reply,
    send,
    sink_copies,
    smtp,
    write_node_config,
)
from conftest import free_port, silent_peer, wait_for, wait_port
from helpers import scrape, scrape_until, value

LOCAL = "alice@example.test"  # MDB01 on node1: delivered, so nothing stays queued on node3


def test_primary_remakes_shadows_lost_with_a_wiped_shadow_node(make_cluster, sink):
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
    # logged once every lost copy was tried, just after the row above
    wait_for(lambda: "made 1 of 1 lost shadow(s)" in n2.log(), timeout=5, what="the reprotect summary logged")
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


@pytest.mark.parametrize("contact", ["holder-shadow-request", "primary-next-copy"])
def test_shadow_lost_before_the_primary_knew_the_holders_database_is_made_again(make_cluster, sink, contact):
    """Regression (an audit with real nodes): node1's message is shadowed on node3 while node1 has
    never recorded node3's queue database ID; node3 is wiped and comes back. node1 took the first
    ID it then heard for node3 on trust, kept counting the lost copy, and lost the acknowledged
    message with its own death. Now node3 names, in its reply to the copy, the queue database that
    holds it (docs/PROTOCOL.md section 2), and a later contact naming another one makes node1 copy
    the message again: node3's XSHADOWREQUEST for its own mail, or node3's reply to node1's next copy."""
    c = make_cluster(heartbeat=1, resubmit=8)
    c.start()
    n1, n3 = c["node1"], c["node3"]

    # The sink is down: the message stays queued on node1, shadowed on node3 (its one remote peer).
    mid = send(n1, "carol@foreign.test")
    netid = accepted_with_shadow(n1, n3, mid)
    n1.wait_event("DEFER", netid)
    first = n1.events("HAREDIRECT", netid)[0]["source-context"]
    assert "QueueDatabaseId=" in first, first  # node3 said which of its databases holds the copy
    assert n3.name not in n1.shadow_list(), "node1 never recorded node3's queue database ID"

    n3.kill9()
    shutil.rmtree(n3.spec.data_dir)
    n3.start()
    if contact == "holder-shadow-request":
        # node3 shadows its own mail (on node1 or node2): its XSHADOWREQUEST names its new database.
        for _ in range(10):
            send(n3, LOCAL)
            if n3.name in n1.shadow_list():
                break
        wait_for(lambda: n3.name in n1.shadow_list(), timeout=10, what="node1 to hear node3's new database ID")
        also: list[str] = []
    else:
        # node1's next message is copied to node3, whose reply names its new database.
        later = accepted_with_shadow(n1, n3, send(n1, "dave@foreign.test"))
        assert n3.name not in n1.shadow_list(), "heard only in the copy's reply"
        also = [later]

    redirects = n1.wait_event("HAREDIRECT", netid, n=2, timeout=15)
    holder = next(n for n in (c["node3"], c["node2"]) if redirects[-1]["source-context"].startswith(f"{n.name}=250 2.6.0 "))
    wait_for(lambda: "made 1 of 1 lost shadow(s)" in n1.log(), timeout=5, what="the reprotect summary logged")
    holder.wait_event("HARECEIVE", netid)

    # node1 dies: the new shadow is promoted and delivered.
    n1.kill9()
    sink.start()
    for m in [netid, *also]:
        wait_for(lambda m=m: sink_copies(sink, m), timeout=40, what=f"{m} at the sink after node1's death")
    assert holder.events("RESUBMIT", netid), "the re-made shadow was promoted"


@contextlib.contextmanager
def shadow_node_of_a_fake_primary(procs: Any, sink: Any, tmp_path: Path, copy_timeout: float,
                                  shadows: int = 5):
    """A real node holding ``shadows`` shadow copies (for the sink) of a fake primary, whose only
    other peer accepts connections and never answers: making a promoted copy redundant again
    takes the node the whole ``copy_timeout``. Yields (node ip, transport port, fake, secret,
    guids, node log path, process)."""
    stack = contextlib.ExitStack()
    base = random.randint(20, 200)
    node_ip, fake_name, secret = f"127.0.0.{base}", "fake.transportd.test", "s-" + uuid.uuid4().hex
    fake = FakePrimary((f"127.0.0.{base + 1}", free_port()), fake_name, str(uuid.uuid4()))
    fake.default_discard = []
    threading.Thread(target=fake.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        silent = stack.enter_context(silent_peer())
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
                                  "shadow_copy_timeout": copy_timeout},
        }), [{"name": fake_name, "site": "site-b", "transport": f"{fake.server_address[0]}:{fake.server_address[1]}"},
             {"name": "silent.transportd.test", "site": "site-a", "transport": f"127.0.0.1:{silent}"}])
        log_path = tmp_path / "shadow.log"
        with open(log_path, "ab") as log:
            proc = procs.add(subprocess.Popen([sys.executable, "-m", "transportd", "serve", "--config", str(config)],
                                              stdout=log, stderr=subprocess.STDOUT))
        wait_port(node_ip, tport, proc=proc)
        guids = [str(uuid.uuid4()) for _ in range(shadows)]
        s = smtp(node_ip, tport, helo=fake_name)
        assert auth_plain(s, fake_name, secret)[0] == 235
        assert reply(s, f"XSHADOWREQUEST {fake_name} {b64_dbid(fake.dbid)}")[0] == 250
        for g in guids:
            assert reply(s, f"MAIL FROM:<a@example.test> XSHADOW={g}")[0] == 250
            assert reply(s, f"RCPT TO:<{FOREIGN}>")[0] == 250
            assert s.data(f"Subject: hangup {g}\r\n\r\nbody\r\n".encode())[0] == 250
        s.quit()
        yield node_ip, tport, fake, secret, guids, log_path, proc
    finally:
        stack.close()
        fake.shutdown()
        fake.server_close()


def announce_new_database(node_ip: str, tport: int, fake: Any, secret: str):
    """The fake primary comes back with a new queue database and says so; the open session."""
    s = smtp(node_ip, tport, helo=fake.name)
    assert auth_plain(s, fake.name, secret)[0] == 235
    s.sock.sendall(f"XSHADOWREQUEST {fake.name} {b64_dbid(str(uuid.uuid4()))}\r\n".encode())
    return s


def at_sink(sink: Any, guids: list[str]) -> int:
    return sum(any(g.encode() in m for m in sink.messages()) for g in guids)


def test_promotion_survives_the_announcing_peer_hanging_up(procs, sink, tmp_path):
    """Regression (found by `transportd chaos`): a primary that announces a new queue database ID
    and hangs up at once (its own shadow attempt timed out) must still get its old shadows
    promoted and delivered; the cancelled session handler left them ``pending`` for ever."""
    sink.start()
    with shadow_node_of_a_fake_primary(procs, sink, tmp_path, copy_timeout=2) as (ip, tport, fake, secret, guids,
                                                                                    log_path, proc):
        s = announce_new_database(ip, tport, fake, secret)
        wait_for(lambda: "promoting its shadows" in log_path.read_text(errors="replace"),
                 timeout=10, what="the promotion to begin")
        time.sleep(0.5)  # part of the scenario: the peer hangs up while the promotion runs
        s.close()  # the socket and smtplib's file on it: the fd really closes
        wait_for(lambda: at_sink(sink, guids) == len(guids), timeout=30, what="every promoted shadow at the sink")
        assert proc.poll() is None


def test_promoted_copies_are_delivered_while_their_new_shadow_is_made(procs, sink, tmp_path):
    """Regression (found by `transportd chaos`, run C): a promoted copy waited to be made redundant
    again before delivery, one copy after the other, each up to shadow_copy_timeout; a second
    failure in that time lost it. The promotion is the failover: delivery starts at once."""
    sink.start()
    with shadow_node_of_a_fake_primary(procs, sink, tmp_path, copy_timeout=60) as (ip, tport, fake, secret, guids,
                                                                                     log_path, proc):
        s = announce_new_database(ip, tport, fake, secret)
        promoted_at = time.monotonic()
        # The only other peer never answers: the new shadows are still being made for a minute.
        wait_for(lambda: at_sink(sink, guids) == len(guids), timeout=20, what="every promoted copy at the sink")
        assert time.monotonic() - promoted_at < 20
        assert "HAREDIRECTFAIL" not in log_path.read_text(errors="replace")
        s.close()
        assert proc.poll() is None


def test_message_accepted_without_a_shadow_gets_one_when_a_peer_is_back(make_cluster, sink):
    """node1 alone accepts a message unprotected (HAREDIRECTFAIL; the sink is down, so it stays
    queued); node3 starts; the heartbeat loop makes the shadow, and the later death of node1 is
    survived through it. The metrics show the exposure while it lasts."""
    c = make_cluster(heartbeat=0.5, resubmit=2)
    n1, n3 = c["node1"], c["node3"]
    port = free_port(n1.host)
    with open(n1.spec.config, "a") as f:
        f.write(f'\n[metrics]\nlisten = "{n1.host}:{port}"\n')
    c.start("node1")
    mid = send(n1, "carol@foreign.test")
    failed = [r for r in n1.wait_event("HAREDIRECTFAIL") if r["internal-message-id"] == str(mid)]
    assert len(failed) == 1, failed
    netid = failed[0]["network-message-id"]
    n1.wait_event("DEFER", netid)
    assert value(scrape(n1.host, port), "transportd_messages_not_redundant", state="unprotected") == 1

    c.start("node3")
    redirect = n1.wait_event("HAREDIRECT", netid, timeout=20)
    assert redirect[0]["source-context"].startswith(f"{n3.name}=250 2.6.0 "), redirect
    n3.wait_event("HARECEIVE", netid)
    scrape_until(n1.host, port, lambda s: value(s, "transportd_messages_not_redundant", state="unprotected") == 0
                 and value(s, "transportd_messages_not_redundant", state="reshadowing") == 0,
                 "no exposed message left on node1")
    assert len(n1.events("HAREDIRECTFAIL", netid)) == 1, "a failed retry is not tracked again"

    n1.kill9()
    sink.start()
    n3.wait_event("RESUBMIT", netid, timeout=20)
    wait_for(lambda: sink_copies(sink, netid), timeout=20, what="the re-protected message at the sink")
