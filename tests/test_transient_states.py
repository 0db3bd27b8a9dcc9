"""No state that only a restart clears: each transient state has an owner
and a time-out that returns it to a state the loops take. Every check here is made on the
running node, before anything is restarted.

- recipients left Active by an outcome commit that failed (the disk filled up mid-delivery);
- discard ids handed out on a session whose client hung up during XQDISCARD.
"""

from __future__ import annotations

import base64
import json
import os
import smtplib
import socket
import time

from clusters import FOREIGN
from conftest import read_db as db
from conftest import wait_for
from helpers import fill


def test_outcome_commit_failing_on_a_full_disk_recovers_without_a_restart(make_node, sink, small_disk):
    sink.start(("-w", "2"))  # the next hop answers DATA after 2 s: the disk fills meanwhile
    node = make_node(smart_host=sink.address, overrides={"node": {"data_dir": str(small_disk / "data")}})
    node.data_dir = small_disk / "data"
    node.start()
    with smtplib.SMTP("127.0.0.1", node.port, timeout=20) as s:
        s.sendmail("a@remote.test", ["bob@elsewhere.test"], b"Subject: full disk\r\n\r\nbody\r\n")
    qdb = node.data_dir / "queue.db"
    wait_for(lambda: db(qdb, "SELECT status FROM recipients") == [("Active",)], timeout=5,
             what="the delivery to start")
    fill(small_disk)
    wait_for(lambda: "queue database commit failed" in node.log(), timeout=10, what="the outcome commit to fail")
    assert db(qdb, "SELECT status FROM recipients") == [("Active",)]
    os.unlink(small_disk / "filler")
    wait_for(lambda: db(qdb, "SELECT status FROM recipients") == [("Delivered",)], timeout=20,
             what="the recipient to be delivered without a restart")
    assert node.alive and "left Active and 0 message(s) left pending" in node.log()


def test_a_failed_local_commit_after_the_copy_leaves_nothing_behind(cluster, sink):
    """The shadow copy is made, then the local commit fails: the sender gets a 451 (never a 250 for
    what is not recorded), node1 keeps nothing, and the copy on the peer is discarded at its next
    heartbeat (no copy left behind to expire or be promoted)."""
    sink.start()
    c = cluster(overrides={"shadow_redundancy": {"shadow_copy_timeout": 2}})
    node1, node3 = c["node1"], c["node3"]
    node1.env["TRANSPORTD_TEST_FAULTS"] = json.dumps({"match": "SETTLE", "steps": ["settle"]})
    c.start()
    with smtplib.SMTP(node1.host, node1.frontend_port, timeout=20) as s:
        s.ehlo("client.test")
        s.mail("a@example.test")
        s.rcpt(FOREIGN)
        code, msg = s.data(b"Subject: SETTLE fails\r\n\r\nbody\r\n")
    assert code == 451, (code, msg)  # the sender retries
    assert db(node1.cfg.db_path, "SELECT count(*) FROM messages")[0][0] == 0
    received = wait_for(lambda: node3.tracking(event_id="HARECEIVE"), timeout=10, what="node3's copy")
    discarded = wait_for(lambda: node3.tracking(event_id="HADISCARD"), timeout=20,
                         what="node3 to discard the copy of the refused message")
    assert [r["network-message-id"] for r in discarded] == [r["network-message-id"] for r in received]
    assert db(node3.cfg.db_path, "SELECT count(*) FROM messages WHERE role = 'shadow' AND state = 'Queued'") \
        == [(0,)]
    assert node1.proc.poll() is None and not any(b"SETTLE fails" in m for m in sink.messages())


def test_discard_ids_of_a_client_gone_during_xqdiscard_are_handed_out_again(cluster, sink):
    sink.start()
    c = cluster()
    node1, node3 = c["node1"], c["node3"]
    c.start()
    # A delivered message whose shadow is on node3: node1 holds one discard event for node3.
    with smtplib.SMTP(node1.host, node1.frontend_port, timeout=20) as s:
        s.sendmail("a@example.test", [FOREIGN], b"Subject: discard me\r\n\r\nbody\r\n")
    node3.stop()
    qdb = node1.cfg.db_path
    wait_for(lambda: db(qdb, "SELECT count(*) FROM discard_events")[0][0] == 1, timeout=10,
             what="node1's discard event for node3")
    guid = db(qdb, "SELECT shadow_guid FROM discard_events")[0][0]
    auth = base64.b64encode(f"\0{node3.name}\0{c.secret}".encode()).decode()
    me = base64.b64encode(node3.name.encode()).decode()

    def session(hang_up: bool) -> str:
        with socket.create_connection((node1.transport_host, node1.transport_port), timeout=10) as sock:
            f = sock.makefile("rb")

            def say(line: str) -> bytes:
                sock.sendall(line.encode() + b"\r\n")
                out = b""
                while True:
                    got = f.readline()
                    out += got
                    if got[3:4] != b"-":
                        return out
            f.readline()
            say("EHLO node3.test")
            say(f"AUTH PLAIN {auth}")
            say(f"XSHADOW {me}")
            if hang_up:
                sock.sendall(b"XQDISCARD 50\r\n")
                sock.shutdown(socket.SHUT_RDWR)  # gone before the reply
                return ""
            reply = say("XQDISCARD 50").decode()
            say("QUIT")
            return reply
    for _ in range(5):
        session(hang_up=True)
    # Kept: lets node1 handle the last hang-up before the clean session asks. Nothing shows it
    # (the id is taken and handed back: discard_events looks as before); the poll below is bounded.
    time.sleep(0.5)
    reply = wait_for(lambda: (lambda r: r if guid in r else None)(session(hang_up=False)), timeout=15,
                     what="the discard id to be handed out again")
    assert reply.startswith("250")
    wait_for(lambda: db(qdb, "SELECT count(*) FROM discard_events")[0][0] == 0, timeout=5,
             what="the acknowledged id to be forgotten")
    assert node1.proc.poll() is None
