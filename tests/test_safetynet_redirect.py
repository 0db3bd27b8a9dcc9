"""Safety Net resubmission (unit, on a real queue database) and `transportd redirect` (real nodes)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import free_port, queued_id, swaks, wait_for, wait_port
from sqlalchemy import select, update

from transportd.config import load_dict
from transportd.devtools.cluster import generate
from transportd.queue import messages as mq
from transportd.queue.routing import bifurcate
from transportd.queue.safetynet import resubmit
from transportd.queue.store import QueueStore, messages, recipients


def _cfg(tmp_path):
    return load_dict({"node": {"name": "n1.t", "data_dir": str(tmp_path)},
                      "routing": {"accepted_domains": ["example.test"], "mailbox_database": "MDB01",
                                  "smart_host": "127.0.0.1:2500"}})


def _processed(conn, cfg, rcpts, received_at, role="primary", **kw):
    """A message that went through delivery and sits in the Safety Net."""
    m = mq.NewMessage(str(uuid.uuid4()), "a@b.test", b"Subject: s\r\n\r\nbody\r\n", bifurcate(rcpts, cfg),
                      received_at, received_at + 1000, message_id=f"<{uuid.uuid4()}@t>", role=role,
                      primary_node="n2.t" if role == "shadow" else None, **kw)
    mid = mq.enqueue(conn, m)
    if role == "primary":
        conn.execute(update(recipients).where(recipients.c.message_id == mid).values(status=mq.ACTIVE))
        ids = conn.execute(select(recipients.c.id).where(recipients.c.message_id == mid)).scalars().all()
        mq.record_outcomes(conn, [mq.Outcome(r, mq.DELIVERED) for r in ids], received_at + 1,
                           retry_interval=1, retry_count=1, long_interval=1)
        mq.finish_if_done(conn, mid, received_at + 1, 3600)
    else:
        conn.execute(update(messages).where(messages.c.id == mid).values(state=mq.SAFETY_NET))
    return mid, m.network_message_id


def test_resubmit_picks_destination_window_and_safety_net(tmp_path):
    cfg = _cfg(tmp_path)
    store = QueueStore.open(tmp_path / "queue.db")
    try:
        now = 1_800_000_000.0
        inside, netid = store.transaction(lambda c: _processed(c, cfg, ["alice@example.test", "x@far.test"], now - 50))
        store.transaction(lambda c: _processed(c, cfg, ["bob@example.test"], now - 5000))  # before the window
        store.transaction(lambda c: _processed(c, cfg, ["y@far.test"], now - 40))  # other destination
        shadow, _ = store.transaction(lambda c: _processed(c, cfg, ["carol@example.test"], now - 30, role="shadow"))

        done = store.transaction(lambda c: resubmit(c, cfg, destination="MDB01", start=now - 100, end=now,
                                                    sources=("primary",), now=now))
        assert [(r.original_id, r.recipients) for r in done] == [(inside, ["alice@example.test"])]
        new = store.read(lambda c: mq.message_row(c, done[0].new_id))
        assert new["network_message_id"] == netid and new["origin"] == "resubmit" and new["suppress_dsn"] == 1
        assert store.read(lambda c: mq.body(c, done[0].new_id)) == b"Subject: s\r\n\r\nbody\r\n"

        from_shadow = store.transaction(lambda c: resubmit(c, cfg, destination="MDB01", start=now - 100, end=now,
                                                           sources=("shadow",), now=now))
        assert [(r.original_id, r.recipients, r.source) for r in from_shadow] == [
            (shadow, ["carol@example.test"], "shadow")]
        # x@far.test and y@far.test went outside the boundary: never resubmitted (Exchange), by any
        # destination, so no outside recipient sees a message twice
        outside = store.transaction(lambda c: resubmit(c, cfg, destination="smarthost:127.0.0.1:2500",
                                                       start=now - 100, end=now, now=now))
        assert outside == []
    finally:
        store.close()


def test_the_copies_read_first_are_those_resubmit_takes(tmp_path):
    """``resubmit_candidates`` (read without bodies, outside the write transaction, by
    ``transportd safetynet resubmit``) names exactly the copies ``resubmit`` queues again, for each
    destination, Safety Net and requesting primary; ``resubmit(among=...)`` takes only those."""
    from transportd.queue.safetynet import resubmit_candidates
    cfg = load_dict({"node": {"name": "n1.t", "data_dir": str(tmp_path)},
                     "routing": {"accepted_domains": ["example.test", "sales.example.test"],
                                 "mailbox_database": "MDB01", "smart_host": "127.0.0.1:2500",
                                 "mailbox_database_rules": ["*@sales.example.test=MDB02"]},
                     "mailbox_databases": {"MDB01": "n1.t", "MDB02": "n1.t"}})
    store = QueueStore.open(tmp_path / "queue.db")
    try:
        now = 1_800_000_000.0
        for when, rcpts, role in ((now - 50, ["alice@example.test", "x@far.test"], "primary"),
                                  (now - 5000, ["bob@example.test"], "primary"),
                                  (now - 45, ["y@far.test"], "primary"),
                                  (now - 40, ["s@sales.example.test", "alice@example.test"], "primary"),
                                  (now - 35, ["carol@example.test", "z@far.test"], "shadow"),
                                  (now - 30, ["t@sales.example.test"], "shadow")):
            store.transaction(lambda c, when=when, rcpts=rcpts, role=role: _processed(c, cfg, rcpts, when, role=role))
        picked: dict = {}
        for destination in ("MDB01", "MDB02", "mailbox:MDB01", "smarthost:127.0.0.1:2500"):
            for sources in (("primary",), ("shadow",), ("primary", "shadow")):
                for for_primary in (None, "n2.t", "n3.t"):
                    window = {"destination": destination, "start": now - 100, "end": now, "sources": sources,
                              "for_primary": for_primary}
                    ids = store.read(lambda c, w=window: resubmit_candidates(c, cfg, **w))
                    done = store.transaction(lambda c, w=window: resubmit(c, cfg, now=now, **w))
                    assert ids == [r.original_id for r in done], (window, ids, done)
                    picked[destination, sources, for_primary] = len(ids)
                    among = store.transaction(lambda c, w=window, ids=ids: resubmit(c, cfg, now=now, among=ids[1:], **w))
                    assert [r.original_id for r in among] == ids[1:]
        both = ("primary", "shadow")
        assert (picked["MDB01", both, None], picked["MDB02", both, None], picked["MDB01", both, "n3.t"]) == (3, 2, 2)
        assert picked["smarthost:127.0.0.1:2500", both, None] == 0
    finally:
        store.close()


def test_a_peers_request_takes_its_shadows_and_the_primary_copies_for_its_destination(tmp_path):
    """XRESUBMIT from n2.t (``for_primary``): our shadows of n2.t and our Primary Safety Net copies
    for the destination (mail handed to n2.t hop by hop is among them); not the shadows of another
    primary (n3.t resubmits those), and never a recipient outside the boundary."""
    cfg = _cfg(tmp_path)
    store = QueueStore.open(tmp_path / "queue.db")
    try:
        now = 1_800_000_000.0
        ours, _ = store.transaction(lambda c: _processed(c, cfg, ["alice@example.test", "x@far.test"], now - 50))
        of_n2, _ = store.transaction(lambda c: _processed(c, cfg, ["bob@example.test", "y@far.test"], now - 40,
                                                          role="shadow"))
        of_n3, _ = store.transaction(lambda c: _processed(c, cfg, ["carol@example.test"], now - 30, role="shadow"))
        store.transaction(lambda c: c.execute(update(messages).where(messages.c.id == of_n3).values(
            primary_node="n3.t")))
        done = store.transaction(lambda c: resubmit(c, cfg, destination="MDB01", start=now - 100, end=now,
                                                    sources=("primary", "shadow"), for_primary="n2.t", now=now))
        assert sorted((r.original_id, r.source, tuple(r.recipients)) for r in done) == [
            (ours, "primary", ("alice@example.test",)), (of_n2, "shadow", ("bob@example.test",))]
    finally:
        store.close()


def test_resubmit_window_is_when_the_copy_entered_the_safety_net(tmp_path):
    """Received long before the window, delivered inside it: resubmitted (and the reverse not)."""
    cfg = _cfg(tmp_path)
    store = QueueStore.open(tmp_path / "queue.db")
    try:
        now = 1_800_000_000.0
        late, _ = store.transaction(lambda c: _processed(c, cfg, ["alice@example.test"], now - 5000))
        store.transaction(lambda c: update_completed(c, late, now - 20))
        early, _ = store.transaction(lambda c: _processed(c, cfg, ["bob@example.test"], now - 50))
        store.transaction(lambda c: update_completed(c, early, now - 500))
        done = store.transaction(lambda c: resubmit(c, cfg, destination="MDB01", start=now - 100, end=now,
                                                    sources=("primary",), now=now))
        assert [r.original_id for r in done] == [late]
    finally:
        store.close()


def test_resubmitted_copy_keeps_the_senders_dsn_parameters(tmp_path):
    """RET/ENVID and each recipient's NOTIFY/ORCPT (RFC 3461) go on with a Safety Net resubmission,
    as they do with a shadow copy: a next hop offering DSN gets them as the sender gave them."""
    cfg = _cfg(tmp_path)
    store = QueueStore.open(tmp_path / "queue.db")
    try:
        now = 1_800_000_000.0
        params = {"x@example.test": "NOTIFY=NEVER ORCPT=rfc822;X@example.test", "y@example.test": ""}
        store.transaction(lambda c: _processed(c, cfg, ["x@example.test", "y@example.test"], now - 50,
                                               dsn_mail="RET=HDRS ENVID=QQ+2B314", dsn_rcpt=params))
        [done] = store.transaction(lambda c: resubmit(c, cfg, destination="MDB01", start=now - 100, end=now,
                                                      now=now))
        new = store.read(lambda c: mq.message_row(c, done.new_id))
        assert new["dsn_params"] == "RET=HDRS ENVID=QQ+2B314"
        got = store.read(lambda c: {r.address: r.dsn_params for r in c.execute(
            select(recipients.c.address, recipients.c.dsn_params).where(recipients.c.message_id == done.new_id))})
        assert got == params
    finally:
        store.close()


def update_completed(conn, mid, when):
    conn.execute(update(messages).where(messages.c.id == mid).values(completed_at=when))


def _cli(config, *args):
    return subprocess.run([sys.executable, "-m", "transportd", *args, "--config", config],
                          capture_output=True, text=True, timeout=60)


def _redirect_one(config, target):
    """``transportd redirect``, which moves the one queued message in one run: a recipient in the
    middle of an attempt (Active; with a 1-second retry the redirect can land in that window, as a
    CI run's did) is moved once the attempt ends."""
    res = _cli(config, "redirect", "--target", target)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("1 message(s) redirected"), res.stdout


def _events(config, **flt):
    args = ["tracking", "search", "--json"]
    for k, v in flt.items():
        args += [f"--{k.replace('_', '-')}", v]
    res = _cli(config, *args)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines() if line.strip()]


@pytest.fixture
def two_nodes(tmp_path, procs, sink):
    return _start_two_nodes(tmp_path, procs, sink)


def _start_two_nodes(tmp_path, procs, sink, resubmit_span: float = 60, unreachable: float = 8, **delivery):
    base = random.randint(20, 200)
    specs = generate(tmp_path / "cluster", nodes=2, sites=1, ip_base=base, frontend_port=free_port(),
                     transport_port=free_port(), sink_address=sink.address,
                     overrides={"shadow_redundancy": {"shadow_heartbeat_frequency": 0.5,
                                                      "shadow_resubmit_time_span": resubmit_span},
                                "delivery": {"queue_poll_interval": 0.2, "transient_failure_retry_interval": 1,
                                             "outbound_connection_failure_retry_interval": 1,
                                             "send_connect_timeout": 2, **delivery},
                                # long enough for a CLI started right after a kill on a busy machine
                                "safety_net": {"primary_safety_net_unreachable_time": unreachable}})
    for spec in specs:
        log = open(tmp_path / f"{spec.short}.log", "wb")
        proc = procs.add(subprocess.Popen([sys.executable, "-m", "transportd", "serve", "--config", spec.config],
                                          stdout=log, stderr=subprocess.STDOUT))
        host, _, port = spec.frontend.rpartition(":")
        wait_port(host, int(port), proc=proc)
    return specs


def test_redirect_drains_a_node_to_its_peer_protected(two_nodes, sink):
    node1, node2 = two_nodes
    host, _, port = node1.frontend.rpartition(":")
    # The sink is down: node1 keeps the message queued (shadowed on node2).
    qid = queued_id(swaks(int(port), "--to", "carol@elsewhere.test", "--from", "bob@example.test", server=host))
    wait_for(lambda: _events(node1.config, event_id="DEFER"), what="a DEFER on node1")

    _redirect_one(node1.config, node2.name)

    # node2 becomes primary over XSHADOW; node1 keeps its copy as a hop-by-hop shadow until node2's discard.
    # Tracked as Exchange tracks Redirect-Message: the hand-over (SEND to node2, RECEIVE there);
    # REDIRECT is Exchange's event for a recipient redirected to an alternate recipient.
    sends = wait_for(lambda: _events(node1.config, event_id="SEND"), what="SEND from node1 to node2")
    assert [e["internal-message-id"] for e in sends] == [str(qid)]
    assert [e["source"] for e in sends] == ["SMTP"]
    assert _events(node1.config, event_id="REDIRECT") == []
    netid = sends[0]["network-message-id"]
    received = wait_for(lambda: [e for e in _events(node2.config, event_id="RECEIVE")
                                 if e["network-message-id"] == netid], what="node2 RECEIVE")
    assert received[0]["source-context"] == "transport"
    sink.start()
    wait_for(lambda: len(sink.messages()) >= 1, timeout=20, what="delivery by node2")
    ext = wait_for(lambda: _events(node2.config, event_id="SENDEXTERNAL"), timeout=10,
                   what="node2's SENDEXTERNAL row (written once the sink's reply is read)")
    assert [e["network-message-id"] for e in ext] == [netid]
    wait_for(lambda: any(e["network-message-id"] == netid for e in _events(node1.config, event_id="HADISCARD")),
             timeout=15, what="node1 releasing its copy after node2's discard")
    time.sleep(1)  # waiting for absence: no second copy from either node
    assert len(sink.messages()) == 1
    assert _events(node1.config, event_id="SENDEXTERNAL") == []


def test_redirect_waits_for_an_attempt_under_way_and_moves_what_it_leaves(tmp_path, procs, sink):
    """The next hop accepts the connection and never greets: node1's recipient is Active for the
    whole attempt (8 s: two CLI starts fit in it on a loaded machine), when the redirect runs. The redirect waits for the attempt to end and moves
    the deferred recipient to node2, in one run (Redirect-Message drains the queues); with --wait 0
    it moves nothing and says what is still in an attempt."""
    import socket

    silent = socket.create_server(("127.0.0.1", sink.port))  # connections complete, nothing is said
    try:
        node1, node2 = _start_two_nodes(tmp_path, procs, sink, send_connection_inactivity_timeout=8)
        host, _, port = node1.frontend.rpartition(":")
        qid = queued_id(swaks(int(port), "--to", "carol@elsewhere.test", "--from", "bob@example.test",
                              server=host))
        wait_for(lambda: _cli(node1.config, "message", "list", "--filter", "state=Active", "--json").stdout.strip(),
                 timeout=10, interval=0.1, what="node1's attempt under way (Active)")
        res = _cli(node1.config, "redirect", "--target", node2.name, "--wait", "0")
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines()[:2] == [
            f"0 message(s) redirected to {node2.name} (queue peer:{node2.name})",
            "1 message(s) still in a delivery attempt here after 0s: what the attempt leaves pending stays "
            "here; run redirect again once it ends"], res.stdout
        started = time.monotonic()
        res = _cli(node1.config, "redirect", "--target", node2.name, "--wait", "20")
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == f"1 message(s) redirected to {node2.name} (queue peer:{node2.name})", res.stdout
        assert time.monotonic() - started < 20
        assert [e["internal-message-id"] for e in _events(node1.config, event_id="DEFER")] == [str(qid)]
        sends = wait_for(lambda: _events(node1.config, event_id="SEND"), what="SEND from node1 to node2")
        assert [e["internal-message-id"] for e in sends] == [str(qid)]
    finally:
        silent.close()


def test_redirect_leaves_a_suspended_queue_held_and_says_which_hold(two_nodes, sink):
    """The operator suspended node1's queue to the smart host (Suspend-Queue: the hold is the
    queue's) and one message besides. A drain moves neither: node2 would relay the queue's mail
    to the same smart host at once, while node1's queue still says Suspended. The output counts
    what stays by hold; with the smart host back, nothing reaches it from either node."""
    node1, node2 = two_nodes
    host, _, port = node1.frontend.rpartition(":")
    smarthost = f"smarthost:{sink.address}"

    def queue_one() -> int:
        return queued_id(swaks(int(port), "--to", "carol@elsewhere.test", "--from", "bob@example.test",
                               server=host))
    first = queue_one()  # the sink is down: deferred, its queue made
    wait_for(lambda: _events(node1.config, event_id="DEFER"), what="a DEFER on node1")
    res = _cli(node1.config, "queue", "suspend", smarthost)
    assert res.returncode == 0, res.stderr
    queue_one()
    held = queue_one()
    res = _cli(node1.config, "message", "suspend", str(held))
    assert res.returncode == 0, res.stderr

    res = _cli(node1.config, "redirect", "--target", node2.name, "--wait", "0")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        f"0 message(s) redirected to {node2.name} (queue peer:{node2.name})",
        ("3 suspended or poison message(s) stay here, held (1 suspended message, 2 suspended queue): resume them "
         "and redirect again to move them")], res.stdout

    sink.start()
    time.sleep(3)  # waiting for absence: node2 would have relayed a redirected copy within a second
    assert sink.messages() == []
    assert _events(node1.config, event_id="SEND") == []
    listed = [json.loads(line) for line in _cli(node1.config, "queue", "list", "--json").stdout.splitlines()
              if line.strip()]
    assert [(q["identity"], q["state"]) for q in listed if q["identity"] == smarthost] == [(smarthost, "Suspended")]
    res = _cli(node1.config, "queue", "resume", smarthost)
    assert res.returncode == 0, res.stderr
    wait_for(lambda: len(sink.messages()) >= 2, timeout=20, what="node1 delivering once its queue is resumed")
    assert {e["internal-message-id"] for e in _events(node1.config, event_id="SENDEXTERNAL")} >= {str(first)}


def test_redirected_copy_is_resubmitted_when_the_target_comes_back_empty(two_nodes, procs, tmp_path):
    """node1 drained its message to node2 and keeps the hop-by-hop copy; node2 comes back with a new
    queue database before delivering it: node1 resubmits its copy (ShadowStateChange), tracked as
    Exchange tracks a resubmitted shadow: HADISCARD Resubmitted, then RESUBMIT REDUNDANCY whose
    reference is the internal id of the copy resubmitted (node1's own message)."""
    import shutil
    import signal

    node1, node2 = two_nodes
    host, _, port = node1.frontend.rpartition(":")
    qid = queued_id(swaks(int(port), "--to", "carol@elsewhere.test", "--from", "bob@example.test", server=host))
    wait_for(lambda: _events(node1.config, event_id="DEFER"), what="a DEFER on node1")
    _redirect_one(node1.config, node2.name)
    netid = wait_for(lambda: _events(node1.config, event_id="SEND"), what="SEND to node2")[0]["network-message-id"]
    wait_for(lambda: [e for e in _events(node2.config, event_id="RECEIVE") if e["network-message-id"] == netid],
             what="node2 primary for the drained message")

    proc2 = next(p for p in procs.procs if node2.config in p.args)
    proc2.send_signal(signal.SIGKILL)
    proc2.wait()
    shutil.rmtree(node2.data_dir)
    log = open(tmp_path / f"{node2.short}-again.log", "wb")
    procs.add(subprocess.Popen([sys.executable, "-m", "transportd", "serve", "--config", node2.config],
                               stdout=log, stderr=subprocess.STDOUT))

    resub = wait_for(lambda: [e for e in _events(node1.config, event_id="RESUBMIT")
                              if e["network-message-id"] == netid], timeout=25,
                     what="node1 to resubmit its copy after node2's new queue database")
    assert [(e["source"], e["source-context"]) for e in resub] == [
        ("REDUNDANCY", f"{node2.name} (ShadowStateChange)")]
    assert resub[0]["internal-message-id"] == resub[0]["reference"] == str(qid)
    discards = [e for e in _events(node1.config, event_id="HADISCARD") if e["network-message-id"] == netid]
    assert len(discards) == 1 and discards[0]["internal-message-id"] == str(qid), discards
    reason, _, guid = discards[0]["source-context"].partition(";")
    assert reason == "Resubmitted" and str(uuid.UUID(guid)) == guid, discards
    assert _events(node1.config, event_id="REDIRECT") == []


def test_redirect_refuses_an_unknown_target(two_nodes):
    res = _cli(two_nodes[0].config, "redirect", "--target", "nobody.transportd.test")
    assert res.returncode == 2
    assert "is not a peer" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_resubmit_gap_is_filled_from_the_peers_shadow_safety_net(two_nodes, procs, tmp_path):
    """node1 loses its whole data dir (queue database and mailboxes); the window before its new queue
    database is resubmitted from node2's Safety Net, and alice gets both her messages back: the one
    node1 received (node2 held its shadow) and the one node2 received and handed node1 hop by hop
    (node1 took it as primary; node2's copy is in node2's Primary Safety Net, the only one left)."""
    import shutil
    import signal
    from datetime import datetime, timezone

    from transportd.queue.mailbox import MailboxStore

    node1, node2 = two_nodes
    host, _, port = node1.frontend.rpartition(":")
    start = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    time.sleep(1.1)  # part of the scenario (a clock): --start has whole seconds, the message comes after
    queued_id(swaks(int(port), "--to", "alice@example.test", "--from", "bob@remote.test",
                    "--header", "Subject: safety net me", server=host))
    h2, _, p2 = node2.frontend.rpartition(":")
    queued_id(swaks(int(p2), "--to", "alice@example.test", "--from", "dan@remote.test",
                    "--header", "Subject: handed hop by hop", server=h2))
    alice = lambda: MailboxStore(__import__("pathlib").Path(node1.data_dir) / "mailboxes").list("alice@example.test")
    wait_for(lambda: len(alice()) == 2, what="delivery of both messages to alice on node1")

    def node2_safety_net():
        res = _cli(node2.config, "safetynet", "list", "--json")
        return sorted(json.loads(x)["safety_net"] for x in res.stdout.splitlines())
    wait_for(lambda: node2_safety_net() == ["Primary", "Shadow"], timeout=15,
             what="node2's shadow in its Shadow Safety Net, its hop-by-hop copy in its Primary Safety Net")

    # node1 dies and comes back with nothing: a new queue database ID, an empty mailbox store.
    proc1 = next(p for p in procs.procs if node1.config in p.args)
    proc1.send_signal(signal.SIGKILL)
    proc1.wait()
    shutil.rmtree(node1.data_dir)
    time.sleep(1.1)  # part of the scenario (a clock): the new database starts a whole second later
    restarted = procs.add(subprocess.Popen([sys.executable, "-m", "transportd", "serve", "--config", node1.config],
                                           stdout=open(tmp_path / "node1-restarted.log", "wb"), stderr=subprocess.STDOUT))
    wait_port(host, int(port), proc=restarted)
    assert alice() == []

    res = _cli(node1.config, "safetynet", "resubmit", "--destination", "MDB01", "--start", start)
    assert res.returncode == 0, res.stderr
    assert "0 message(s) resubmitted" in res.stdout  # node1's own Primary Safety Net is empty
    assert f"{node2.name}: 250 2.0.0 2 message(s) resubmitted from the Safety Net" in res.stdout

    resub = _events(node2.config, event_id="RESUBMIT")
    assert [(e["source"], e["source-context"]) for e in resub] == [("SAFETYNET", "MDB01;MessageResubmit")] * 2
    # Each row names the message as Exchange's do: its sender, Message-ID, subject and size.
    assert sorted(e["message-subject"] for e in resub) == ["handed hop by hop", "safety net me"], resub
    assert all(e["sender-address"] and e["return-path"] and e["message-id"] and int(e["total-bytes"]) > 0
               for e in resub), resub
    files = wait_for(lambda: len(alice()) == 2 and alice(), timeout=20, what="the resubmitted copies in alice's Maildir")
    subjects = sorted(line for f in files for line in f.read_bytes().splitlines() if line.startswith(b"Subject:"))
    assert subjects == [b"Subject: handed hop by hop", b"Subject: safety net me"]


def test_discard_events_are_kept_until_the_shadow_quits(two_nodes, procs, sink):
    """XQDISCARD ids handed out on a session that breaks are handed out again; a clean QUIT
    (the shadow applied them) removes them."""
    import base64
    import signal
    import smtplib
    import tomllib

    node1, node2 = two_nodes
    host, _, port = node1.frontend.rpartition(":")
    t_host, _, t_port = node1.transport.rpartition(":")
    secret = tomllib.loads(open(node1.config).read())["cluster"]["secret"]
    # node2 keeps the shadow, then stops, so nobody asks node1 for the discard but us.
    queued_id(swaks(int(port), "--to", "carol@elsewhere.test", server=host))
    proc2 = next(p for p in procs.procs if node2.config in p.args)
    proc2.send_signal(signal.SIGTERM)
    proc2.wait(timeout=15)
    sink.start()
    wait_for(lambda: sink.messages(), timeout=20, what="delivery by node1")

    def session():
        s = smtplib.SMTP(t_host, int(t_port), timeout=10)
        s.ehlo("node2.transportd.test")
        s.login("node2.transportd.test", secret)
        code, reply = s.docmd("XSHADOW", base64.b64encode(b"node2.transportd.test").decode())
        assert code == 250, reply
        return s

    s = session()
    code, reply = s.docmd("XQDISCARD", "5")
    assert code == 250
    guid = reply.decode().strip()
    uuid.UUID(guid)
    s.close()  # broken: the connection ends without QUIT

    def again():
        s2 = session()
        c, r = s2.docmd("XQDISCARD", "5")
        if c == 250:
            return s2, r.decode().strip()
        s2.close()
        return None
    s2, guid2 = wait_for(again, timeout=5, what="the discard handed out again")
    assert guid2 == guid
    s2.quit()  # acknowledged

    s3 = session()
    assert s3.docmd("XQDISCARD", "5")[0] == 251
    s3.quit()


def test_shadow_node_resubmits_for_an_unreachable_primary(tmp_path, procs, sink):
    """Served once node1 has been unreachable for primary_safety_net_unreachable_time (15 s: the
    request must be filed before it passes, by CLIs started on a machine perhaps busy with other
    tests), though the promotion span (3 s, shorter as by default: 3 h against 12 h) restarts
    meanwhile (it reset the unreachable time: a request was never served on its own)."""
    import signal
    from datetime import datetime, timezone

    node1, node2 = _start_two_nodes(tmp_path, procs, sink, resubmit_span=3, unreachable=15)
    host, _, port = node1.frontend.rpartition(":")
    start = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    time.sleep(1.1)  # part of the scenario (a clock): --start has whole seconds, the message comes after
    queued_id(swaks(int(port), "--to", "alice@example.test", server=host))
    wait_for(lambda: _events(node2.config, event_id="HADISCARD"), timeout=15, what="node2's Shadow Safety Net copy")
    listed = [json.loads(x) for x in _cli(node2.config, "safetynet", "list", "--json").stdout.splitlines()]
    assert [(r["safety_net"], r["primary"]) for r in listed] == [("Shadow", node1.name)]
    primary_list = [json.loads(x) for x in _cli(node1.config, "safetynet", "list", "--from", "primary",
                                                "--json").stdout.splitlines()]
    assert [r["safety_net"] for r in primary_list] == ["Primary"]

    proc1 = next(p for p in procs.procs if node1.config in p.args)
    proc1.send_signal(signal.SIGKILL)
    proc1.wait()
    # node1 answered a heartbeat a moment ago (within primary_safety_net_unreachable_time, 15 s here):
    # node2 files the request and serves it on its own once node1 has been unreachable that long.
    filed_at = time.monotonic()
    res = _cli(node2.config, "safetynet", "resubmit", "--destination", "MDB01", "--start", start,
               "--for-primary", node1.name)
    assert res.returncode == 0 and "request is filed" in res.stdout and "--force" in res.stdout, res.stdout
    assert not _events(node2.config, event_id="RESUBMIT")
    resub = wait_for(lambda: _events(node2.config, event_id="RESUBMIT"), timeout=40,
                     what="node2 to serve the request from its Shadow Safety Net on its own")
    assert time.monotonic() - filed_at >= 8  # not before node1 had been unreachable for 15 s
    assert [(e["source"], e["source-context"]) for e in resub] == [("SAFETYNET", "MDB01;MessageResubmit")]
    queued = [json.loads(x) for x in _cli(node2.config, "message", "list", "--json").stdout.splitlines()]
    assert [(m["origin"], m["queues"]) for m in queued] == [("resubmit", [f"peer:{node1.name}"])]
    # --force does it at once, whatever the time.
    res = _cli(node2.config, "safetynet", "resubmit", "--destination", "MDB01", "--start", start,
               "--for-primary", node1.name, "--force")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("1 message(s) resubmitted to MDB01 for node1.transportd.test"), res.stdout
    by_cli = _events(node2.config, event_id="RESUBMIT")[-1]  # written by the CLI, as complete as the node's
    assert by_cli["sender-address"] and by_cli["message-id"] == resub[0]["message-id"], by_cli


def test_resubmit_to_a_next_hop_outside_the_boundary_is_refused(tmp_path):
    """Exchange: no resubmission from Safety Net once a message crossed the boundary; the CLI says
    so and changes nothing."""
    [spec] = generate(tmp_path / "cluster", nodes=1, sites=1, ip_base=random.randint(20, 200),
                      frontend_port=free_port(), transport_port=free_port())
    for destination in ("smarthost:127.0.0.1:2500", "dns:example.org"):
        res = _cli(spec.config, "safetynet", "resubmit", "--destination", destination, "--start",
                   "2026-01-01T00:00:00Z")
        assert res.returncode == 2, res
        assert "outside the boundary" in res.stderr and "Traceback" not in res.stderr
    # A name the config does not know (a typo) is refused, listing those it does.
    res = _cli(spec.config, "safetynet", "resubmit", "--destination", "MDB99", "--start", "2026-01-01T00:00:00Z")
    assert res.returncode == 2 and "MDB99 is no mailbox database or peer queue" in res.stderr, res.stderr
    assert "MDB01" in res.stderr and "Traceback" not in res.stderr
    assert not (Path(spec.data_dir) / "queue.db").exists()


def test_a_redirected_message_is_routed_again_when_its_target_dies(tmp_path, procs, sink):
    """node1 drains carol's message (the smart host is down) to node2 with ``redirect``; node2 dies
    before delivering it. node1's promotion of its hop-by-hop copy (ShadowHeartbeatFailure) routes
    the recipient again, as a new message's (Exchange 2010: the shadow server "resubmits the
    messages in the shadow queue", "delivered to another" server; 2016/2019: it "transmits the
    messages to the next hop"): carol goes to the smart host, not back into node2's queue. Dave,
    whose mailbox database (MDB02) lives on node2, was handed to node2 as his next hop: his
    promoted copy waits for node2 again (no route is invented)."""
    from clusters import LocalCluster, send, sink_copies

    c = LocalCluster(procs, sink, tmp_path, {
        "shadow_redundancy": {"shadow_heartbeat_frequency": 0.5, "shadow_resubmit_time_span": 3},
        "routing": {"mailbox_database_rules": ["dave@example.test=MDB02"]}})
    c.start()
    n1, n2 = c["node1"], c["node2"]
    peer_queue = f"peer:{n2.name}"

    def sent_to_node2(qid: int) -> str:
        row = wait_for(lambda: [r for r in n1.events("SEND") if r["internal-message-id"] == str(qid)],
                       timeout=15, what=f"node1's SEND of {qid} to node2")[0]
        assert row["server-hostname"] == n2.name, row
        n2.wait_event("RECEIVE", row["network-message-id"])
        return row["network-message-id"]

    # dave: node2's mailbox queue made by a first message, then suspended, so the one node1 hands
    # it hop by hop stays there, node1 keeping its fork until node2's discard.
    send(n2, "dave@example.test")
    wait_for(lambda: n2.maildir("dave@example.test"), timeout=15, what="the first message in dave's mailbox")
    n2.cli("queue", "suspend", "mailbox:MDB02")
    dave = sent_to_node2(send(n1, "dave@example.test", "zed@example.test", "--header", "Subject: for dave"))

    carol_qid = send(n1, "carol@elsewhere.test", "zed@example.test", "--header", "Subject: for carol")
    wait_for(lambda: [r for r in n1.events("DEFER") if r["internal-message-id"] == str(carol_qid)],
             timeout=15, what="node1's DEFER of carol's message (the sink is down)")
    _redirect_one(n1.spec.config, n2.name)
    carol = sent_to_node2(carol_qid)
    assert not n1.events("SENDEXTERNAL", carol)

    n2.kill9()
    for netid in (carol, dave):
        resubmit = n1.wait_event("RESUBMIT", netid, timeout=25)
        assert [(r["source"], r["source-context"]) for r in resubmit] == [
            ("REDUNDANCY", f"{n2.name} (ShadowHeartbeatFailure)")], resubmit
        discarded = n1.events("HADISCARD", netid)
        assert [d["source-context"].split(";")[0] for d in discarded] == ["Resubmitted"], discarded
    sink.start()

    # carol: to the smart host, by node1, once.
    wait_for(lambda: sink_copies(sink, carol), timeout=20, what="carol's message at the sink, sent by node1")
    sent = n1.wait_event("SENDEXTERNAL", carol, timeout=10)
    assert [r["recipient-address"] for r in sent] == ["carol@elsewhere.test"], sent
    wait_for(lambda: not [m for m in n1.cli_json("message", "list") if m["network_message_id"] == carol],
             timeout=10, what="carol's message leaving node1's queue")
    # dave: his mailbox database is on node2, so his copy waits for node2, as routing says.
    [held] = [m for m in n1.cli_json("message", "list") if m["network_message_id"] == dave]
    assert held["queues"] == [peer_queue], held
    assert not n1.events("SENDEXTERNAL", dave) and not n1.maildir("dave@example.test")
    assert len(sink_copies(sink, carol)) == 1 and not sink_copies(sink, dave)


class RedirectNextHop:
    """The smart host of both nodes (aiosmtpd in a thread of this process). While ``holding``, it
    defers every recipient (450 4.7.1): the message waits on node1 to be drained. Then it answers
    by local part: ``ok`` 250, ``bad`` 550, ``grey`` 450 until ``grey_ok``; every other address (a
    DSN's recipient) 250. It notes each RCPT answered while not holding, and each transaction."""

    def __init__(self) -> None:
        import socket

        from aiosmtpd.controller import Controller

        self.holding, self.grey_ok = True, False
        self.rcpts: list[tuple[str, str]] = []  # (address, reply code) while not holding
        self.transactions: list[tuple[str, list[str], bytes]] = []
        hop = self

        class Handler:
            async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
                local = address.partition("@")[0]
                if hop.holding:
                    return "450 4.7.1 Not yet"
                code = {"bad": "550", "grey": "250" if hop.grey_ok else "450"}.get(local, "250")
                hop.rcpts.append((address, code))
                if code == "550":
                    return "550 5.1.1 No such user"
                if code == "450":
                    return "450 4.2.1 Mailbox busy, try again later"
                envelope.rcpt_tos.append(address)
                return "250 2.1.5 Ok"

            async def handle_DATA(self, server, session, envelope):
                hop.transactions.append((envelope.mail_from, list(envelope.rcpt_tos), envelope.content))
                return "250 2.0.0 queued"

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.address = f"127.0.0.1:{probe.getsockname()[1]}"
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=int(self.address.rpartition(":")[2]))
        self.controller.start()

    def copies(self, address: str, null_sender: bool = False) -> list[tuple[str, list[str], bytes]]:
        return [t for t in self.transactions if address in t[1] and (t[0] == "<>") == null_sender]


def test_a_lost_peers_fork_delivers_only_the_recipients_it_had_not_processed(tmp_path, procs):
    """node1 drains a message for three outside recipients to node2 (hop by hop: node2 primary,
    node1 keeps the fork as its shadow). node2's next hop takes ``ok``, refuses ``bad`` (an NDR
    goes out) and defers ``grey``; node2 tells node1 per recipient (Delivered=, Failed=) at its
    next heartbeats, then dies (kill -9). node1's promotion of the fork routes again only ``grey``:
    ``ok`` gets no second copy, ``bad`` no second RCPT nor second NDR (docs/PROTOCOL.md section 4)."""
    import signal

    from conftest import read_db

    hop = RedirectNextHop()
    try:
        node1, node2 = _start_two_nodes(tmp_path, procs, hop, resubmit_span=3)
        host, _, port = node1.frontend.rpartition(":")
        to = ["ok@elsewhere.test", "bad@elsewhere.test", "grey@elsewhere.test"]
        queued_id(swaks(int(port), "--to", ",".join(to), "--from", "sender@remote.test", server=host))
        wait_for(lambda: _events(node1.config, event_id="DEFER"), what="a DEFER on node1")
        _redirect_one(node1.config, node2.name)
        hop.holding = False
        netid = wait_for(lambda: _events(node1.config, event_id="SEND"), what="SEND to node2")[0]["network-message-id"]

        ok, bad, grey = to
        wait_for(lambda: hop.copies(ok) and hop.copies("sender@remote.test", null_sender=True) and (grey, "450") in hop.rcpts, timeout=20,
            what="node2 to deliver ok, send the NDR for bad and be deferred for grey")
        # node1 has asked node2 for its discards since (two heartbeats after the NDR: node2 told
        # Failed= once the NDR was out), and none for node1 is left on node2.
        seen = time.time() + 0.5
        db1, db2 = Path(node1.data_dir) / "queue.db", Path(node2.data_dir) / "queue.db"
        wait_for(lambda: (read_db(db1, "SELECT last_heartbeat_at FROM shadow_contexts WHERE peer = ?",
                                  (node2.name,)) or [(0,)])[0][0] > seen, timeout=15, what="a heartbeat of node1")
        wait_for(lambda: read_db(db2, "SELECT count(*) FROM discard_events WHERE shadow_node = ?",
                                 (node1.name,))[0][0] == 0, timeout=15, what="node1 to take node2's discards")

        proc2 = next(p for p in procs.procs if node2.config in p.args)
        proc2.send_signal(signal.SIGKILL)
        proc2.wait()
        hop.grey_ok = True
        resub = wait_for(lambda: [e for e in _events(node1.config, event_id="RESUBMIT")
                                  if e["network-message-id"] == netid], timeout=25,
                         what="node1 to resubmit its fork after node2's loss")
        assert [(e["source"], e["source-context"]) for e in resub] == [
            ("REDUNDANCY", f"{node2.name} (ShadowHeartbeatFailure)")]
        wait_for(lambda: hop.copies(grey), timeout=20, what="grey delivered by node1")
        time.sleep(3)  # room for a second copy of ok, a second RCPT of bad, a second NDR
        assert len(hop.copies(ok)) == 1, hop.transactions
        assert [r for r in hop.rcpts if r[0] == bad] == [(bad, "550")], hop.rcpts
        assert len(hop.copies("sender@remote.test", null_sender=True)) == 1, hop.transactions
        assert len(hop.copies(grey)) == 1, hop.transactions
    finally:
        hop.controller.stop()


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_a_drained_node_stopped_at_once_has_its_mail_delivered_once(tmp_path, procs, sink, stop):
    """node1 queues carol's message (the smart host is down), its shadow on node2, and is drained
    to node2 with ``redirect``: node2 takes the message as primary hop by hop, its shadow of
    node1's copy now redundant. node1 is stopped right away, as an operator does for maintenance
    (SIGTERM; then a crash, kill -9), before node2 ever heard of a discard. node2's shadow is
    released when it takes the drained copy (HADISCARD ExplicitlyDiscarded, in the same commit),
    so once node1 has been unreachable past shadow_resubmit_time_span nothing is promoted: carol
    gets one copy, the drained one (was: node2 also promoted its old shadow, a second copy)."""
    from clusters import LocalCluster, accepted_with_shadow, send, sink_copies

    c = LocalCluster(procs, sink, tmp_path, {
        "shadow_redundancy": {"shadow_heartbeat_frequency": 0.5, "shadow_resubmit_time_span": 2}}, nodes=2)
    c.start()
    n1, n2 = c["node1"], c["node2"]
    qid = send(n1, "carol@elsewhere.test")
    netid = accepted_with_shadow(n1, n2, qid)
    shadow_guid = n2.wait_event("HARECEIVE", netid)[0]["source-context"]
    n1.wait_event("DEFER", netid)
    _redirect_one(n1.spec.config, n2.name)
    received = n2.wait_event("RECEIVE", netid)
    assert [r["source-context"] for r in received] == ["transport"], received
    held_for_node1 = n2.shadow_list().get(n1.name, {}).get("shadows", 0)

    n1.kill9() if stop == "SIGKILL" else n1.stop()
    stopped = time.monotonic()
    sink.start()
    wait_for(lambda: sink_copies(sink, netid), timeout=20, what="the drained copy delivered by node2")
    n2.wait_event("SENDEXTERNAL", netid)
    # Waiting for absence: past the span (2 s) and a few heartbeats, node2 would have promoted its
    # old shadow (about 3 s after the stop) and sent it to the sink within a second.
    time.sleep(max(0.0, 6 - (time.monotonic() - stopped)))
    assert len(sink_copies(sink, netid)) == 1
    assert n2.events("RESUBMIT", netid) == []
    # node2's shadow went with the commit that took the drained copy: the shadow list showed nothing
    # held for node1 right after the drain (the documented check before stopping a drained node).
    assert held_for_node1 == 0
    discarded = n2.events("HADISCARD", netid)
    assert [(d["source-context"], d["client-hostname"]) for d in discarded] == [
        (f"ExplicitlyDiscarded;{shadow_guid}", n1.name)], discarded


def test_a_drained_copy_releases_only_the_recipients_it_takes_from_the_shadow(tmp_path, procs, sink):
    """The same drain of a message for carol (outside) and alice, whose mailbox queue on node1 an
    operator suspended: the redirect moves carol only, alice stays held on node1. node2's shadow
    of node1's message is done for carol (node2's own copy has her) and stays a shadow for alice:
    node1 killed, node2 promotes it for alice alone (RESUBMIT names her; her mailbox database is
    node1's, so it waits for node1) and carol still gets one copy. Nothing is lost, nothing doubled."""
    from clusters import LocalCluster, accepted_with_shadow, send, sink_copies

    c = LocalCluster(procs, sink, tmp_path, {
        "shadow_redundancy": {"shadow_heartbeat_frequency": 0.5, "shadow_resubmit_time_span": 2}}, nodes=2)
    c.start()
    n1, n2 = c["node1"], c["node2"]
    send(n1, "alice@example.test")  # makes node1's mailbox queue, which the operator then suspends
    wait_for(lambda: n1.maildir("alice@example.test"), timeout=15, what="the first message in alice's mailbox")
    n1.cli("queue", "suspend", "mailbox:MDB01")
    qid = send(n1, "carol@elsewhere.test,alice@example.test")
    netid = accepted_with_shadow(n1, n2, qid)
    n1.wait_event("DEFER", netid)
    _redirect_one(n1.spec.config, n2.name)
    n2.wait_event("RECEIVE", netid)
    assert n2.shadow_list()[n1.name]["shadows"] == 1  # still protecting alice

    n1.kill9()
    sink.start()
    resubmit = n2.wait_event("RESUBMIT", netid, timeout=20)
    assert [r["recipient-address"] for r in resubmit] == ["alice@example.test"], resubmit
    wait_for(lambda: sink_copies(sink, netid), timeout=20, what="carol's drained copy delivered by node2")
    time.sleep(1)  # waiting for absence: a second copy for carol would be at the sink within a second
    assert len(sink_copies(sink, netid)) == 1
    from conftest import read_db
    waiting = read_db(Path(n2.spec.data_dir) / "queue.db",
                      "SELECT r.address, q.identity FROM recipients r JOIN messages m ON m.id = r.message_id"
                      " JOIN queues q ON q.id = r.queue_id WHERE m.network_message_id = ? AND m.state = 'Queued'"
                      " AND r.status NOT IN ('Delivered', 'Failed', 'Removed')", (netid,))
    assert waiting == [("alice@example.test", f"peer:{n1.name}")], waiting
