"""A real Sendmail (Debian's sendmail-bin 8.17, ``transportd.devtools.sendmail``) on both sides of a node.

Sendmail as a client pipelines RCPT and DATA (MAIL alone first), writes ``MAIL From:`` in its own
case and passes the DSN parameters on; as a server it offers PIPELINING, DSN,
8BITMIME and SIZE but neither CHUNKING nor SMTPUTF8. smtp-sink stands behind both. Its SMTP
traffic (``-X``) is what the tests read: Sendmail logs to syslog only.
"""

from __future__ import annotations

import re
import time

import pytest
from conftest import private_mtas_of, wait_for
from test_opensmtpd_peer import through_the_next_hop
from test_postfix_peer import DSN_MAIL, assert_relayed_with_dsn, by_subject, send, sink_args

from transportd.devtools.sendmail import SendmailMTA

pytestmark = pytest.mark.skipif(SendmailMTA.available() is not None, reason=f"{SendmailMTA.available()}")


@pytest.fixture
def sendmail():
    """A factory of started Sendmail daemons (``sendmail(relay_to, name, defines=)``)."""
    yield from private_mtas_of(SendmailMTA, "transportd-sendmail-", "sendmail.test")


def test_sendmail_relays_into_the_node_and_the_dsn_parameters_cross(make_node, sink, sendmail):
    """client -> Sendmail -> node -> smtp-sink: Sendmail's pipelined transaction gets the node's
    250 (the node's queue id in Sendmail's traffic), the message arrives once, RET, ENVID and
    NOTIFY as the client gave them; the 8-bit body whole."""
    sink.start()
    node = make_node(smart_host=sink.address).start()
    mta = sendmail(f"127.0.0.1:{node.port}")
    assert send(mta.host, mta.port, "bob@remote.test", ["carol@foreign.test"], "sendmail relays", "caf\u00e9\r\n",
                mail_options=DSN_MAIL, rcpt_options=("NOTIFY=FAILURE,DELAY",)) == {}
    got = wait_for(lambda: by_subject(sink, "sendmail relays"), timeout=30, what="the message at the sink")
    received = wait_for(lambda: node.tracking(event_id="RECEIVE"), timeout=10, what="the RECEIVE row")
    wait_for(lambda: re.search(r"<<< 250 2\.0\.0 Ok: queued as \d+", mta.traffic()), timeout=10,
             what="the node's 250 in Sendmail's traffic")
    assert len(got) == 1 and len(received) == 1, (got, received)
    assert f"<<< 250 2.0.0 Ok: queued as {received[0]['internal-message-id']}" in mta.traffic()
    assert_relayed_with_dsn(got[0], {"NOTIFY=FAILURE,DELAY"})
    assert [r["client-hostname"] for r in received] == ["sendmail.test"]


def test_the_node_delivers_to_sendmail(make_node, sink, sendmail):
    """node -> Sendmail -> smtp-sink: Sendmail offers PIPELINING and DSN, no CHUNKING: the node
    sends with DATA, the DSN parameters go on, and each SENDEXTERNAL row carries Sendmail's queue
    id."""
    sink.start()
    mta = sendmail(sink.address)
    node = make_node(smart_host=mta.address).start()
    rows = through_the_next_hop(node, sink, "to sendmail", 4)
    assert all(re.fullmatch(r"(250 2\.0\.0 \w+ Message accepted for delivery;?){2}", r["recipient-status"])
               for r in rows), [r["recipient-status"] for r in rows]
    assert not node.tracking(event_id="DEFER") and not node.tracking(event_id="FAIL")


def test_sendmails_recipient_limit_splits_the_message_at_once(make_node, sink, sendmail):
    """Sendmail's MaxRecipientsPerMessage answers the RCPTs past it ``452 4.5.3 Too many
    recipients``: the node sends them in further transactions at once, every recipient once, no
    DEFER row."""
    sink.start()
    mta = sendmail(sink.address, defines={"confMAX_RCPTS_PER_MESSAGE": "2"})
    node = make_node(smart_host=mta.address).start()
    rcpts = [f"r{i}@foreign.test" for i in range(5)]
    send("127.0.0.1", node.port, "bob@remote.test", rcpts, "split by sendmail")

    def arrived() -> list[str] | None:
        got = sorted(r.split()[0] for m in by_subject(sink, "split by sendmail") for r in sink_args(m)[1])
        return got if len(got) >= 5 else None
    assert wait_for(arrived, timeout=30, what="5 recipients at the sink") == [f"<{r}>" for r in rcpts]
    assert "452 4.5.3 Too many recipients" in mta.traffic()
    assert not node.tracking(event_id="DEFER"), node.tracking(event_id="DEFER")
    time.sleep(1)  # waiting for absence: no second copy for anyone
    assert len([r for m in by_subject(sink, "split by sendmail") for r in sink_args(m)[1]]) == 5


def test_sendmail_queues_while_the_node_is_down_and_delivers_once_after(make_node, sink, sendmail):
    """A message Sendmail takes while the node is down waits in Sendmail's queue; its queue
    runner delivers it once the node is back, once."""
    sink.start()
    node = make_node(smart_host=sink.address).start()
    mta = sendmail(f"127.0.0.1:{node.port}")
    assert node.stop() == 0
    assert send(mta.host, mta.port, "bob@remote.test", ["carol@foreign.test"], "while down") == {}
    time.sleep(2)  # a queue run or two against the stopped node
    assert not by_subject(sink, "while down")
    node.start()
    got = wait_for(lambda: by_subject(sink, "while down"), timeout=30, what="the message at the sink")
    time.sleep(2)  # waiting for absence: no second copy
    assert len(by_subject(sink, "while down")) == len(got) == 1
    assert len(node.tracking(event_id="RECEIVE")) == 1
