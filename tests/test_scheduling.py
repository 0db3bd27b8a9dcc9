"""Fair scheduling under pressure: one slow next hop never stops the other queues.

A real node process, Postfix's smtp-sink answering every DATA after 2 s (a slow but healthy smart
host), and a queue database holding thousands of due recipients for it (written before the node
starts, through the same queue code the daemon uses). A message for a local mailbox sent
afterwards must be delivered at once, whatever the backlog, with one big queue or 50 of them.
"""

from __future__ import annotations

import smtplib
import time

import pytest
from conftest import wait_for
from helpers import backlog

from transportd.queue.routing import SMART_HOST, NextHop


@pytest.mark.parametrize("queues,per_queue", [(1, 5000), (50, 1000)], ids=["one queue of 5000", "50 queues of 1000"])
def test_local_mail_is_delivered_at_once_behind_a_slow_smart_host_backlog(make_node, sink, queues, per_queue):
    sink.start(("-w", "2"))  # every DATA answered after 2 s
    node = make_node(smart_host=sink.address,
                     overrides={"delivery": {"max_per_domain_outbound_connections": 4}})
    hops = [NextHop(f"smarthost:{sink.address}" + (f"#{k}" if k else ""), SMART_HOST, sink.address)
            for k in range(queues)]
    backlog(node.data_dir / "queue.db", hops, per_queue)
    node.start()
    # The backlog is being worked on: sessions are open to the slow next hop.
    wait_for(lambda: any(q["state"] == "Active" for q in node.cli_json("queue", "list")), timeout=10,
             what="the backlog to be in delivery")
    started = time.monotonic()
    with smtplib.SMTP("127.0.0.1", node.port, timeout=30) as s:
        s.sendmail("bob@example.test", ["alice@example.test"], b"Subject: urgent\r\n\r\nnot behind the backlog\r\n")
    wait_for(lambda: node.maildir_files("alice@example.test"), timeout=10, interval=0.05,
             what="the local message to be delivered")
    took = time.monotonic() - started
    assert took < 2.5, f"the local message waited {took:.1f}s behind the backlog"
