"""The chaos harness: checker and schedule as pure logic, then real runs.

The real runs start ``python -m transportd chaos`` (3 nodes, 2 sites, a sink, a fault
proxy on every peer link) at a small size: with shadow redundancy on, nothing
acknowledged may be lost and nothing unexpected may arrive; the control run, same
seed with shadow redundancy off, must report lost > 0, proving the checker can fail.
CHAOS_MESSAGES / CHAOS_FAULTS / CHAOS_SEED make them bigger by hand.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from transportd.queue import messages as mq
from transportd.devtools.chaos.checker import (
    ACK,
    REFUSED,
    REJECTED,
    UNKNOWN,
    Attempt,
    Delivery,
    Sent,
    check,
    parse_delivery,
    scan_maildir_tree,
)
from transportd.devtools.chaos.harness import ChaosCluster
from transportd.devtools.chaos.nemesis import FAULT_TYPES, PAIR_TYPES, Fault, Nemesis, schedule
from transportd.devtools.chaos.proxy import FaultProxy
from transportd.devtools.chaos.workload import message_bytes, recipients_for
from transportd.devtools.cluster import NodeSpec
from transportd.queue.routing import MAILBOX, NextHop
from transportd.queue.store import QueueStore

RUN = "abc123"


def sent(n: int, rcpts: list[str], *outcomes: str) -> Sent:
    return Sent(n, rcpts, [Attempt(o) for o in outcomes])


def dl(n: int, rcpt: str, where: str = "external", run: str = RUN) -> Delivery:
    return Delivery(run, n, rcpt, where)


# ------------------------------------------------------------------------------ checker

def test_checker_counts_lost_unexpected_duplicates_recovered():
    history = {
        1: sent(1, ["a@elsewhere.test"], UNKNOWN, ACK),           # acked, arrived three times (external dup)
        2: sent(2, ["u@example.test"], ACK),                      # acked, never arrived: lost
        3: sent(3, ["a@elsewhere.test"], UNKNOWN),                # unknown, arrived: recovered
        4: sent(4, ["u@example.test", "b@elsewhere.test"], ACK),  # bifurcated: one side missing: lost
        5: sent(5, ["a@elsewhere.test"], REFUSED, REJECTED),      # rejected, not arrived: fine
        6: sent(6, ["u@example.test"], ACK),                      # mailbox duplicate
    }
    deliveries = [dl(1, "a@elsewhere.test"), dl(1, "a@elsewhere.test"), dl(1, "a@elsewhere.test"),
                  dl(3, "a@elsewhere.test"),
                  dl(4, "u@example.test", "mailbox"), dl(6, "u@example.test", "mailbox"),
                  dl(6, "u@example.test", "mailbox"),
                  dl(99, "a@elsewhere.test"),                     # never sent: unexpected
                  dl(1, "x@elsewhere.test"),                      # not a recipient of #1: unexpected
                  dl(1, "a@elsewhere.test", run="other")]         # another run's mail: unexpected
    v = check(RUN, history, deliveries)
    assert v.lost == [(2, "u@example.test"), (4, "b@elsewhere.test")]
    assert len(v.unexpected) == 3
    assert (v.duplicates_external, v.duplicates_mailbox) == (2, 1)  # extra copies
    assert v.duplicated_external == [1]                             # one message
    assert v.recovered == 1
    assert (v.acknowledged, v.unknown, v.rejected) == (4, 1, 1)
    assert not v.ok
    s = v.summary()
    assert s["lost"] == 2 and s["unexpected"] == 3 and s["ok"] is False
    assert s["duplicates"] == {"mailbox": 1, "external": 2, "external_messages": [1]}


def test_checker_ok_when_everything_acknowledged_arrived():
    history = {1: sent(1, ["A@Elsewhere.test"], ACK), 2: sent(2, ["u@example.test"], REFUSED, ACK)}
    v = check(RUN, history, [dl(1, "a@elsewhere.test"), dl(2, "u@example.test", "mailbox")])
    assert v.ok and not v.lost and not v.unexpected and v.attempts == 3


def test_delivery_parsing_from_sink_and_mailbox_files(tmp_path):
    data = message_bytes(RUN, 42, ["a@elsewhere.test", "u@example.test"], 500, "Sun, 22 Nov 2026 05:00:00 GMT")
    sink_file = b"X-Sink-Mail-From: <c@chaos.test>\r\nX-Sink-Rcpt-To: <a@elsewhere.test>, <b@elsewhere.test>\r\n" + data
    got = parse_delivery(sink_file, where="external")
    assert [(d.run, d.number, d.recipient) for d in got] == [(RUN, 42, "a@elsewhere.test"), (RUN, 42, "b@elsewhere.test")]
    # A body line that looks like the header does not count: only the header block is read.
    assert parse_delivery(b"Subject: x\r\n\r\nX-Chaos-Id: abc123-7\r\n", where="mailbox", recipient="u@x")[0].number == -1
    box = tmp_path / "mailboxes" / "u%2Bx@example.test" / "new"
    box.mkdir(parents=True)
    (box / "1.id.host,S=1").write_bytes(data)
    (tmp_path / "sink" / "new").mkdir(parents=True)
    (tmp_path / "sink" / "new" / "m1").write_bytes(sink_file)
    found = scan_maildir_tree(tmp_path / "mailboxes", "mailbox", per_recipient_folders=True)
    assert [(d.number, d.recipient, d.where) for d in found] == [(42, "u+x@example.test", "mailbox")]
    assert len(scan_maildir_tree(tmp_path / "sink", "external", per_recipient_folders=False)) == 2


def test_recipients_mix_local_external_and_bifurcated():
    import random
    rng = random.Random(1)
    kinds = {tuple(sorted(r.split("@")[1] for r in recipients_for(n, rng))) for n in range(200)}
    assert kinds == {("example.test",), ("elsewhere.test",), ("elsewhere.test", "example.test")}


# ------------------------------------------------------------------------------ nemesis schedule

def test_schedule_is_reproducible_from_the_seed_and_covers_the_fault_types():
    nodes = ["node1", "node2", "node3"]
    a = schedule(7, 200, nodes, resubmit_span=4)
    b = schedule(7, 200, nodes, resubmit_span=4)
    assert [f.describe() for f in a] == [f.describe() for f in b]
    assert [f.describe() for f in a] != [f.describe() for f in schedule(8, 200, nodes, resubmit_span=4)]
    assert a[0].type == "wipe-behind-refusing-sink"
    assert {f.type for f in a} == set(FAULT_TYPES) - set(PAIR_TYPES)  # one at a time: no pair faults
    assert not any(f.overlap for f in a)
    # Up to two at once: the same seed, its double wipe first, pair faults drawn, about half overlapping.
    two = schedule(7, 200, nodes, resubmit_span=4, concurrent=2)
    assert two[0].type == "double-wipe-behind-refusing-sink" and not two[0].overlap
    assert {f.type for f in two} == set(FAULT_TYPES)
    assert 60 <= sum(f.overlap for f in two) <= 140
    assert all(len(set(f.targets)) == 3 for f in two if f.type == "kill-and-partition")
    for f in a:
        if f.type in ("partition", "delay", "reset"):
            assert len(set(f.targets)) == 2
        elif f.type.startswith("sink"):
            assert f.targets == []
        else:
            assert len(f.targets) == 1 and f.targets[0] in nodes
    assert any(f.type == "pause" and f.duration > 4 for f in a), "some pauses outlast the resubmit span"


class _ExposedCluster:
    """Stands in for ChaosCluster: not redundant for the first ``exposed_polls`` looks."""

    def __init__(self, exposed_polls: int):
        self.exposed_polls = exposed_polls
        self.events: list[str] = []

    def not_redundant(self) -> dict[str, int]:
        if self.exposed_polls > 0:
            self.exposed_polls -= 1
            self.events.append("exposed")
            return {"node2": 3}
        self.events.append("redundant")
        return {}

    def sink_refuse(self, on: bool) -> None:
        self.events.append(f"refuse {on}")

    def heal_all(self) -> None:
        self.events.append("heal")


class _RecordingCluster:
    """Stands in for ChaosCluster in overlap tests: records kills and restarts with their times."""

    by_short = {"node1": None, "node2": None, "node3": None}

    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []
        self.lock = threading.Lock()

    def _note(self, what: str, node: str) -> None:
        with self.lock:
            self.events.append((time.monotonic(), what, node))

    def not_redundant(self) -> dict[str, int]:
        return {}

    def kill(self, short: str) -> None:
        self._note("kill", short)

    def start_node(self, short: str) -> None:
        self._note("start", short)

    def heal_all(self) -> None:
        pass


def test_overlapping_faults_run_together_on_free_nodes_up_to_k():
    cluster = _RecordingCluster()
    plan = [Fault(1, "kill", ["node1"], duration=0.6, wait_before=0.0),
            Fault(2, "kill", ["node1"], duration=0.6, wait_before=0.05, overlap=True),  # node1 is busy
            Fault(3, "kill", ["node3"], duration=0.1, wait_before=0.0, overlap=True),   # no slot left (K = 2)
            Fault(4, "kill", ["node2"], duration=0.1, wait_before=0.0)]                 # waits for all
    nemesis = Nemesis(cluster, plan, settle=0, say=lambda m: None, concurrent=2)
    nemesis.start()
    nemesis.thread.join(20)
    assert not nemesis.thread.is_alive() and nemesis.error is None
    at: dict[tuple[str, str], list[float]] = {}
    for t, what, node in cluster.events:
        at.setdefault((what, node), []).append(t)
    # Fault 2 was moved to a free node and ran while fault 1 did.
    assert plan[1].targets == ["node2"] and "busy with a running fault" in plan[1].note
    assert at[("kill", "node2")][0] < at[("start", "node1")][0]
    # Fault 3 waited for a slot: it started after fault 1 or 2 ended, never three at once.
    assert at[("kill", "node3")][0] >= min(at[("start", "node1")][0], at[("start", "node2")][0])
    # Fault 4 (not overlapping: node2 again) started only once faults 1-3 had ended.
    assert at[("kill", "node2")][1] >= max(at[("start", "node1")][0], at[("start", "node2")][0],
                                           at[("start", "node3")][0])
    assert [f.index for f in nemesis.log.faults] == [1, 2, 3, 4]


def _sink_faults(n: int) -> list[Fault]:
    return [Fault(i + 1, "sink-refuse", [], duration=0.01, wait_before=0.0) for i in range(n)]


def test_nemesis_waits_for_redundancy_before_each_fault():
    cluster = _ExposedCluster(exposed_polls=3)
    said: list[str] = []
    nemesis = Nemesis(cluster, _sink_faults(2), settle=0, say=said.append, recovery_timeout=30)
    nemesis.start()
    nemesis.thread.join(20)
    assert not nemesis.thread.is_alive() and nemesis.error is None
    first, second = nemesis.log.faults
    assert first.recovery_wait >= 0.5, "three exposed looks, 0.25 s apart"
    assert second.recovery_wait < 0.25
    assert cluster.events[:5] == ["exposed", "exposed", "exposed", "redundant", "refuse True"]
    assert not any("still not redundant" in line for line in said)


def test_nemesis_goes_ahead_when_redundancy_does_not_come_back_in_time():
    cluster = _ExposedCluster(exposed_polls=10**6)
    said: list[str] = []
    nemesis = Nemesis(cluster, _sink_faults(1), settle=0, say=said.append, recovery_timeout=0.5)
    nemesis.start()
    nemesis.thread.join(20)
    assert nemesis.log.faults[0].recovery_wait >= 0.5
    assert "refuse True" in cluster.events
    assert any("still not redundant after 0.5s: {'node2': 3}" in line for line in said)


def test_not_redundant_counts_queued_primaries_without_a_shadow(tmp_path):
    """The SQL the nemesis waits on, against real queue databases (a missing one counts 0)."""
    specs = {}
    for short, states in (("node1", ["shadowed", "reshadowing", "unprotected", "unprotected"]),
                          ("node2", ["shadowed", "none", "pending"]), ("node3", None)):
        folder = tmp_path / short
        folder.mkdir()
        specs[short] = NodeSpec(short, short, "site-a", "", "", str(folder), "")
        if states is None:
            continue
        store = QueueStore.open(folder / "queue.db")
        try:
            for i, redundancy in enumerate(states):
                msg = mq.NewMessage(network_message_id=f"{short}-{i}", sender="s@sender.test",
                                    data=b"Subject: t\r\n\r\nbody\r\n",
                                    recipients={NextHop("mailbox:local", MAILBOX, "local"): ["a@example.test"]},
                                    received_at=1.0, expires_at=86400.0, redundancy=redundancy)
                store.transaction(lambda c, m=msg: mq.enqueue(c, m))
        finally:
            store.close()
    cluster = object.__new__(ChaosCluster)  # only the queue databases are needed
    cluster.by_short = specs
    assert cluster.not_redundant() == {"node1": 3}


# ------------------------------------------------------------------------------ fault preconditions

class _Clock:
    """An injected clock: sleep() advances it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_wait_until_returns_what_the_probe_saw_once_the_precondition_holds():
    from transportd.devtools.chaos.preconditions import wait_until
    clock = _Clock()
    seen: list[float] = []

    def probe(elapsed: float) -> int | None:
        seen.append(elapsed)
        return 3 if elapsed >= 1.0 else None
    w = wait_until(probe, limit=30, poll=0.3, clock=clock, sleep=clock.sleep)
    assert w.held and w.value == 3 and w.looks == 5 and w.waited == pytest.approx(1.2)
    assert seen == pytest.approx([0.0, 0.3, 0.6, 0.9, 1.2])


def test_wait_until_gives_up_at_the_limit_after_a_last_look():
    from transportd.devtools.chaos.preconditions import wait_until
    clock = _Clock()
    w = wait_until(lambda _: None, limit=2.0, poll=0.75, clock=clock, sleep=clock.sleep)
    assert not w.held and w.value is None and w.waited == pytest.approx(2.0)
    assert clock.slept == pytest.approx([0.75, 0.75, 0.5])   # the last sleep ends at the limit
    assert w.looks == 4
    # A probe that holds at once is looked at once, with no sleep.
    clock = _Clock()
    w = wait_until(lambda _: 0, limit=2.0, poll=0.75, clock=clock, sleep=clock.sleep)
    assert w.held and w.value == 0 and w.looks == 1 and clock.slept == []
    # Stopped (the run is ending): no more looks.
    clock = _Clock()
    w = wait_until(lambda _: None, limit=60, poll=1, clock=clock, sleep=clock.sleep, stopped=lambda: True)
    assert not w.held and w.looks == 1


def test_wipe_target_prefers_the_scheduled_node_then_takes_the_one_holding_most():
    from transportd.devtools.chaos.preconditions import wipe_target
    # The case: node1 scheduled, the clients send to node2 and node3 only.
    queued = {"node1": 0, "node2": 4, "node3": 7}
    assert wipe_target(queued, "node1", elapsed=2.0, grace=6.0) is None          # still node1's grace
    assert wipe_target(queued, "node1", elapsed=6.0, grace=6.0) == "node3"
    assert wipe_target({**queued, "node1": 1}, "node1", elapsed=0.0, grace=6.0) == "node1"
    assert wipe_target({"node1": 0, "node2": 0, "node3": 0}, "node1", elapsed=99, grace=6.0) is None
    assert wipe_target({}, "node1", elapsed=99, grace=6.0) is None
    assert wipe_target({"node1": 2, "node2": 2}, "node2", elapsed=9, grace=6.0, minimum=3) is None
    assert wipe_target({"node1": 3, "node2": 3, "node3": 0}, "node3", elapsed=9, grace=6.0) == "node1"
    assert wipe_target({"node1": 3, "node2": 3}, "node2", elapsed=9, grace=6.0, minimum=3) == "node2"


def test_between_acks_is_what_a_peer_shadows_and_the_node_has_not_acknowledged():
    from transportd.devtools.chaos.preconditions import between_acks
    assert between_acks(["a", "b", "c"], ["b", "c", "z"]) == {"z"}
    assert between_acks(["a"], []) == set() and between_acks([], ["a"]) == {"a"}


class _PreconditionCluster:
    """Stands in for ChaosCluster in the precondition faults: scripted reads, recorded actions."""

    def __init__(self, queued: list[dict[str, int]] | None = None, in_flight: list[int] | None = None):
        self.queued = queued or [{}]
        self.in_flight = in_flight or [0]
        self.events: list[str] = []
        self.proxy = self

    def not_redundant(self) -> dict[str, int]:
        return {}

    def queued_behind_sink(self) -> dict[str, int]:
        return self.queued.pop(0) if len(self.queued) > 1 else self.queued[0]

    def between_acks(self, short: str) -> int:
        return self.in_flight.pop(0) if len(self.in_flight) > 1 else self.in_flight[0]

    def links_of(self, short: str) -> list[str]:
        return [f"{short}->x"]

    def set(self, links: list[str], mode: str, delay: float) -> None:
        self.events.append(f"links {mode} {delay:g}")

    def __getattr__(self, name: str):  # sink_refuse, kill, wipe, start_node, heal_all
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a: self.events.append(" ".join([name, *map(str, a)]))


def _run_nemesis(cluster: _PreconditionCluster, fault: Fault, **limits: float) -> tuple[Fault, list[str]]:
    said: list[str] = []
    nemesis = Nemesis(cluster, [fault], settle=0, say=said.append, **limits)
    nemesis.start()
    nemesis.thread.join(20)
    assert not nemesis.thread.is_alive() and nemesis.error is None, said
    return nemesis.log.faults[0], said


def test_wipe_behind_refusing_sink_not_done_when_no_mail_is_ever_queued():
    """seed 5936's first fault: nothing queued behind the sink: no kill, no wipe, reported not done."""
    cluster = _PreconditionCluster(queued=[{"node1": 0, "node2": 0, "node3": 0}])
    f, said = _run_nemesis(cluster, Fault(1, "wipe-behind-refusing-sink", ["node1"], 0.05, 0.0), wipe_limit=0.5)
    assert not f.done and f.precondition_wait >= 0.5
    assert "precondition never held" in f.note
    assert cluster.events[:2] == ["sink_refuse True", "sink_refuse False"]
    assert not any(e.startswith(("kill", "wipe")) for e in cluster.events)
    assert any("fault 1 (wipe-behind-refusing-sink) not done" in line for line in said)


def test_wipe_behind_refusing_sink_waits_for_queued_mail_and_takes_the_node_holding_it():
    empty = {"node1": 0, "node2": 0, "node3": 0}
    cluster = _PreconditionCluster(queued=[empty] * 3 + [{"node1": 0, "node2": 5, "node3": 2}])
    f, _ = _run_nemesis(cluster, Fault(1, "wipe-behind-refusing-sink", ["node1"], 0.05, 0.0), wipe_limit=20)
    assert f.done and f.targets == ["node2"], f
    assert "5 message(s) queued behind the refusing sink on node2" in f.note and "scheduled node1" in f.note
    assert cluster.events[:4] == ["sink_refuse True", "kill node2", "wipe node2", "start_node node2"]
    assert cluster.events[4] == "sink_refuse False"
    # The scheduled node as soon as it holds some.
    cluster = _PreconditionCluster(queued=[empty, {"node1": 1, "node2": 0, "node3": 0}, {"node1": 2, "node2": 9, "node3": 0}])
    f, _ = _run_nemesis(cluster, Fault(1, "wipe-behind-refusing-sink", ["node1"], 0.05, 0.0), wipe_limit=20)
    assert f.done and f.targets == ["node1"] and "kill node1" in cluster.events


def test_kill_mid_shadow_kills_only_with_a_message_between_the_two_acknowledgements():
    cluster = _PreconditionCluster(in_flight=[0, 0, 0, 2])
    f, _ = _run_nemesis(cluster, Fault(1, "kill-mid-shadow", ["node3"], 0.01, 0.0, delay=0.7), mid_shadow_limit=20)
    assert f.done and "2 message(s) between the shadow's 250 and the client's" in f.note
    assert cluster.events == ["links ok 0.7", "kill node3", "links ok 0", "start_node node3", "heal_all"]
    # Shadow redundancy off (the control run): never; the links healed, nothing killed, not done.
    cluster = _PreconditionCluster(in_flight=[0])
    f, said = _run_nemesis(cluster, Fault(1, "kill-mid-shadow", ["node3"], 0.01, 0.0, delay=0.7),
                           mid_shadow_limit=0.3)
    assert not f.done and "precondition never held" in f.note
    assert cluster.events == ["links ok 0.7", "links ok 0", "heal_all"]


def test_a_control_run_that_loses_nothing_fails_and_faults_not_done_are_shown():
    from transportd.devtools.chaos.harness import format_summary, judge
    base = {"lost": 0, "unexpected": 0, "ok": True, "duplicates": {"mailbox": 0, "external": 0},
            "internal_errors": 0, "fault_counts": {"kill": 2}}
    assert judge(base, expect_loss=False)[0]
    good, reason = judge(base, expect_loss=True)
    assert not good and "control run lost nothing" in reason
    assert judge({**base, "lost": 3, "ok": False}, expect_loss=True) == (True, "control run lost 3, as it must")
    assert not judge({**base, "lost": 3, "unexpected": 1, "ok": False}, expect_loss=True)[0]
    assert not judge({**base, "lost": 1, "ok": False}, expect_loss=False)[0]
    assert not judge({}, expect_loss=True)[0] and not judge({}, expect_loss=False)[0]
    # Pair faults with one shadow per message: the verdict says why the loss was certain.
    double = {**base, "lost": 4, "ok": False, "fault_counts": {"double-wipe-behind-refusing-sink": 1}}
    assert "--shadow-copies 2" in judge({**double, "shadow_copies": 1}, expect_loss=False)[1]
    assert "--shadow-copies 2" not in judge({**double, "shadow_copies": 2}, expect_loss=False)[1]
    # A 2010 node alone in its site acknowledges behind a refusing sink with its only copy.
    from transportd.devtools.chaos.harness import lone_2010_nodes
    from transportd.devtools.cluster import NodeSpec
    specs = [NodeSpec(f"node{i}.t", f"node{i}", site, "", "", "", "") for i, site in
             ((1, "site-a"), (2, "site-a"), (3, "site-b"))]
    assert lone_2010_nodes(specs, ["2010", "2013", "2010"]) == ["node3"]
    assert lone_2010_nodes(specs, ["2010", "2013", "2013"]) == [] and lone_2010_nodes(specs, None) == []
    lone = judge({**base, "lost": 13, "ok": False, "lone_2010_nodes": ["node3"]}, expect_loss=False)[1]
    assert "node3 ran Exchange 2010's design alone in its site" in lone
    s = {**base, "passed": good, "verdict_reason": reason,
         "faults_not_done": ["fault 1: wipe-behind-refusing-sink node1 for 2.0s after 1.3s: precondition never held"]}
    text = format_summary(s)
    assert "faults: 2 done kill 2; 1 not done" in text
    assert "not done: fault 1: wipe-behind-refusing-sink" in text
    assert "verdict: FAILED (control run lost nothing" in text


def test_code_errors_in_the_nodes_logs_fail_any_run():
    """A background task that died of a bug (here: the promotion's re-protection, which once left
    promoted copies "reshadowing" for good) shows in no delivery figure: its log line fails the run."""
    from transportd.devtools.chaos.checker import code_errors
    from transportd.devtools.chaos.harness import format_summary, judge
    lines = [
        ("2026-11-27T05:17:38.586Z ERROR transportd: cannot write tracking log (HADISCARD 274): "
         "[Errno 28] No space left on device\n"),                                   # a fault's
        "2026-11-27T05:20:13.344Z ERROR transportd.node.workers: receive worker 1 exited (signal 9)\n",
        ("2026-11-27T05:21:30.217Z ERROR transportd.redundancy.manager: making the promoted copies of "
         "node3 redundant failed: UnboundLocalError(\"cannot access local variable 'guids'\")\n"),
        "KeyError: 'shadow_guid'\n",                                                 # a traceback's last line
        "WARNING XSHADOWADOPT to node2 failed: ConnectionRefusedError(111)\n",
        "INFO subject mentions a KeyErrorish word\n",                               # not the name alone
    ]
    assert code_errors(lines) == [lines[2].rstrip("\n"), "KeyError: 'shadow_guid'"]
    base = {"lost": 0, "unexpected": 0, "ok": True, "duplicates": {"mailbox": 0, "external": 0}}
    assert judge({**base, "code_errors": 0}, expect_loss=False)[0]
    for expect_loss in (False, True):
        good, reason = judge({**base, "lost": 2, "code_errors": 2, "code_error_examples": code_errors(lines)},
                             expect_loss=expect_loss)
        assert not good and "UnboundLocalError" in reason, reason
    text = format_summary({**base, "code_errors": 2, "code_error_examples": code_errors(lines)})
    assert "code errors in the nodes' logs: 2" in text and "KeyError: 'shadow_guid'" in text


# ------------------------------------------------------------------------------ disk full

def test_replies_while_full_counts_what_the_clients_got_from_the_full_node():
    from transportd.devtools.chaos.disk import replies_while_full
    attempts = [("127.0.0.1", ACK, "250 ok", 9.0),                          # before
                ("127.0.0.1", REFUSED, "452 4.3.1 Insufficient system storage", 10.5),
                ("127.0.0.1", REFUSED, "451 4.3.0 queue database unavailable", 11.0),
                ("127.0.0.1", ACK, "250 2.0.0 queued as 3", 11.5),
                ("127.0.0.1", UNKNOWN, "TimeoutError()", 12.0),
                ("127.0.0.1", REFUSED, "ConnectionRefusedError(111)", 12.1),  # not a reply
                ("127.0.0.2", REJECTED, "554 5.0.0 no", 11.0),              # another node
                ("127.0.0.1", REJECTED, "554 5.3.4 no", 13.0),
                ("127.0.0.1", ACK, "250 ok", 13.5)]                         # after
    assert replies_while_full(attempts, "127.0.0.1", 10.0, 13.0) == {"ack": 1, "4xx": 2, "5xx": 1, "unknown": 1}
    from transportd.devtools.chaos.harness import format_summary, judge
    s = {"lost": 0, "unexpected": 0, "ok": True,
         "disk_full": [{"fault": 2, "node": "node3", "ack": 1, "4xx": 2, "5xx": 1, "unknown": 1}]}
    good, reason = judge(s, expect_loss=False)
    assert not good and "node3 (fault 2: 1)" in reason
    assert "disk full on node3 (fault 2): clients got 1 ack, 2 4xx, 1 5xx" in format_summary(s)
    s["disk_full"][0]["5xx"] = 0
    assert judge(s, expect_loss=False)[0]


def test_disk_full_is_not_scheduled_where_no_tmpfs_can_be_mounted(tmp_path, monkeypatch):
    from transportd.devtools.chaos import disk
    from transportd.devtools.chaos.harness import schedulable
    monkeypatch.setattr(disk.os, "geteuid", lambda: 1000)
    reason = disk.cannot_mount(tmp_path)
    assert reason == "mounting a tmpfs needs root"
    types = schedulable(None, reason)
    assert "disk-full" not in types and set(types) == set(FAULT_TYPES) - {"disk-full"}
    plan = schedule(7, 300, ["node1", "node2", "node3"], resubmit_span=4, types=types)
    assert "disk-full" not in {f.type for f in plan} and plan[0].type == "wipe-behind-refusing-sink"
    assert schedulable(["disk-full"], reason) == []
    assert schedulable(["kill", "disk-full"], reason) == ["kill"]
    assert schedulable(None, None) is None and schedulable(["disk-full"], None) == ["disk-full"]


def test_tmpfs_disk_fills_frees_and_keeps_the_data_when_unmounted(tmp_path):
    from transportd.devtools.chaos.disk import FILLER, TmpfsDisks, cannot_mount
    reason = cannot_mount(tmp_path)
    if reason:
        pytest.skip(f"disk-full faults need a tmpfs mount: {reason}")
    disks = TmpfsDisks(size_mb=64)
    data = tmp_path / "node2"
    try:
        disks.mount("node2", data)
        assert os.path.ismount(data)
        (data / "queue.db").write_bytes(b"q" * 300_000)
        assert disks.fill("node2") >= 300_000
        with pytest.raises(OSError) as err:
            with open(data / "more", "wb") as f:
                f.write(b"m" * 200_000)
                f.flush()
                os.fsync(f.fileno())
        assert err.value.errno == 28   # ENOSPC
        assert os.statvfs(data).f_blocks * os.statvfs(data).f_frsize < 2 * 1024 * 1024  # shrunk, cheap
        disks.free("node2")
        (data / "more").write_bytes(b"m" * 2_000_000)      # room again
        assert not (data / FILLER).exists()
        disks.fill("node2")
    finally:
        disks.free_all()
        disks.unmount_all()
    assert not os.path.ismount(data) and disks.mounted == {}
    assert (data / "queue.db").read_bytes() == b"q" * 300_000 and (data / "more").stat().st_size == 2_000_000
    assert not (data / FILLER).exists() and sorted(p.name for p in tmp_path.iterdir()) == ["node2"]


# ------------------------------------------------------------------------------ fault proxy

def _echo(c: socket.socket) -> None:
    with c:
        try:
            for data in iter(lambda: c.recv(100), b""):
                c.sendall(data)
        except OSError:
            pass


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(c,), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_fault_proxy_forwards_delays_cuts_and_resets():
    srv, port = _echo_server()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        lport = probe.getsockname()[1]
    proxy = FaultProxy()
    proxy.add("a->b", ("127.0.0.1", lport), ("127.0.0.1", port))
    proxy.start()
    try:
        with socket.create_connection(("127.0.0.1", lport), timeout=3) as c:
            c.sendall(b"hello")
            assert c.recv(100) == b"hello"
        proxy.set(["a->b"], "ok", 0.4)
        time.sleep(0.1)  # kept (here and below): the in-process proxy, no daemon scan to observe
        with socket.create_connection(("127.0.0.1", lport), timeout=3) as c:
            t = time.monotonic()
            c.sendall(b"slow")
            assert c.recv(100) == b"slow"
            assert time.monotonic() - t >= 0.7  # held back in both directions
        proxy.set(["a->b"], "cut")
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", lport), timeout=3) as c:
            c.settimeout(0.5)
            c.sendall(b"void")
            with pytest.raises(socket.timeout):
                c.recv(100)
        proxy.set(["a->b"], "reset")
        time.sleep(0.1)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):  # at connect or at first use
            with socket.create_connection(("127.0.0.1", lport), timeout=3) as c:
                c.sendall(b"x")
                time.sleep(0.1)
                c.recv(100)
        proxy.heal()
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", lport), timeout=3) as c:
            c.sendall(b"again")
            assert c.recv(100) == b"again"
    finally:
        proxy.stop()
        srv.close()


def test_fault_proxy_stays_on_loopback():
    with pytest.raises(ValueError):
        FaultProxy().add("x", ("0.0.0.0", 1), ("127.0.0.1", 2))


# ------------------------------------------------------------------------------ real runs

MESSAGES = int(os.environ.get("CHAOS_MESSAGES", "300"))
FAULTS = int(os.environ.get("CHAOS_FAULTS", "6"))
SEED = int(os.environ.get("CHAOS_SEED", "4242"))


class ChaosRun:
    """``transportd chaos`` as a real process, started at once; ``result()`` waits for its summary."""

    def __init__(self, folder: Path, *extra: str, ip_base: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.out = folder / "summary.json"
        self.log = folder / "chaos.out"
        cmd = [sys.executable, "-m", "transportd", "chaos", "--messages", str(MESSAGES), "--faults", str(FAULTS),
               "--seed", str(SEED), "--ip-base", str(ip_base), "--dir", str(folder / "run"),
               "--json", str(self.out), "--drain-timeout", "90", *extra]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def result(self) -> tuple[int, dict, str]:
        try:
            code = self.proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        report = self.log.read_text(errors="replace")[-3000:]
        assert self.out.exists(), f"no summary written:\n{report}"
        return code, json.loads(self.out.read_text()), report

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the harness stops its cluster on SIGTERM via its finally block
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _stopped_after(runs: dict):
    """A fixture's body for runs started together: yields them, stops every one afterwards."""
    try:
        yield runs
    finally:
        for r in runs.values():
            r.stop()


@pytest.fixture(scope="module")
def chaos_runs(tmp_path_factory):
    """The shadow run and its control run (same seed, shadow redundancy off), side by side."""
    base = tmp_path_factory.mktemp("chaos")
    runs = {"shadow": ChaosRun(base / "shadow", ip_base=111),
            "control": ChaosRun(base / "control", "--no-shadow", "--expect-loss", ip_base=121)}
    yield from _stopped_after(runs)


@pytest.mark.chaos
def test_chaos_run_loses_nothing_acknowledged(chaos_runs):
    code, s, report = chaos_runs["shadow"].result()
    assert s["nemesis_error"] is None, report
    assert len(s["faults"]) == FAULTS, report
    assert s["acknowledged"] >= MESSAGES * 0.9, report
    assert s["lost"] == 0, report
    assert s["unexpected"] == 0, report
    assert s["duplicates"]["mailbox"] == 0, report
    assert s["internal_errors"] == 0, report  # nothing acknowledged stranded by an internal error
    assert s["code_errors"] == 0, report      # no task of a node died of a bug
    assert s["utf8_sent"] > 0, report         # internationalized mail is part of the workload
    assert code == 0, report
    assert "wipe-behind-refusing-sink" in s["fault_counts"]


@pytest.mark.chaos
def test_chaos_control_run_without_shadow_redundancy_loses_mail(chaos_runs):
    code, s, report = chaos_runs["control"].result()
    assert s["shadow_redundancy"] is False
    assert s["lost"] > 0, report
    assert s["unexpected"] == 0, report
    assert code == 0, report
    assert s["fault_counts"].get("wipe-behind-refusing-sink") == 1, report  # its precondition held


# Control runs at a small size (the first fault only: the sink-refusing wipe) for several seeds:
# 5936 is issue 18's (node1 scheduled, no client sending to node1: it used to lose nothing); the
# others are random seeds that passed at CI size. And a run of disk-full faults only.
CONTROL_SEEDS = (5936, 2095264729, 652681491)


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("chaos-small")
    runs = {seed: ChaosRun(base / f"control-{seed}", "--messages", "100", "--faults", "1", "--seed", str(seed),
                           "--no-shadow", "--expect-loss", ip_base=131 + 10 * i)
            for i, seed in enumerate(CONTROL_SEEDS)}
    runs["disk"] = ChaosRun(base / "disk-full", "--messages", "60", "--faults", "2", "--seed", "77",
                            "--fault-types", "disk-full", ip_base=171)
    yield from _stopped_after(runs)


@pytest.mark.chaos
@pytest.mark.parametrize("seed", CONTROL_SEEDS)
def test_control_runs_lose_mail_whatever_the_seed(small_runs, seed):
    code, s, report = small_runs[seed].result()
    assert s["fault_counts"] == {"wipe-behind-refusing-sink": 1} and not s["faults_not_done"], report
    assert s["lost"] > 0 and s["unexpected"] == 0, report
    assert s["passed"] and code == 0, report


@pytest.mark.chaos
def test_disk_full_faults_lose_nothing_and_never_answer_5xx(small_runs):
    code, s, report = small_runs["disk"].result()
    if s.get("disk_full_unavailable"):   # not root, or no tmpfs: not scheduled, and said so
        assert "disk-full faults not scheduled" in report and not s["faults"]
        pytest.skip(s["disk_full_unavailable"])
    assert s["fault_counts"] == {"disk-full": 2}, report
    assert [d["5xx"] for d in s["disk_full"]] == [0, 0], report
    assert s["lost"] == 0 and s["unexpected"] == 0 and s["internal_errors"] == 0, report
    assert code == 0 and s["passed"], report


# Two failures at once (issue 18): the first fault of a --concurrent run wipes a primary holding
# queued mail and the peer holding its shadows together. Two shadows per message lose nothing;
# one shadow per message (the control) loses that mail.
DOUBLE = ("--messages", "200", "--faults", "5", "--seed", "1", "--concurrent", "2")


@pytest.fixture(scope="module")
def double_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("chaos-double")
    runs = {"nway": ChaosRun(base / "nway", *DOUBLE, "--shadow-copies", "2", ip_base=181),
            "control": ChaosRun(base / "control", *DOUBLE, "--expect-loss", ip_base=201)}
    yield from _stopped_after(runs)


@pytest.mark.chaos
def test_two_shadows_survive_a_primary_and_its_shadow_wiped_together(double_runs):
    code, s, report = double_runs["nway"].result()
    assert s["nemesis_error"] is None and s["shadow_copies"] == 2 and s["concurrent"] == 2, report
    assert s["fault_counts"].get("double-wipe-behind-refusing-sink") == 1, report  # its precondition held
    assert s["lost"] == 0 and s["unexpected"] == 0 and s["duplicates"]["mailbox"] == 0, report
    assert s["internal_errors"] == 0 and code == 0, report


@pytest.mark.chaos
def test_one_shadow_loses_mail_when_a_primary_and_its_shadow_are_wiped_together(double_runs):
    code, s, report = double_runs["control"].result()
    assert s["shadow_redundancy"] and s["shadow_copies"] == 1, report
    assert s["fault_counts"].get("double-wipe-behind-refusing-sink") == 1, report
    assert s["lost"] > 0 and s["unexpected"] == 0, report
    assert s["passed"] and code == 0, report


def test_sink_refuses_on_sigusr1_and_accepts_on_sigusr2(procs, tmp_path):
    import signal
    import smtplib

    from conftest import free_port, wait_for, wait_port
    port = free_port()
    proc = procs.add(subprocess.Popen([sys.executable, "-m", "transportd", "sink", "--listen", f"127.0.0.1:{port}",
                                       "--dir", str(tmp_path / "sink")], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    wait_port("127.0.0.1", port, proc=proc)

    def send() -> int:
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as s:
            s.ehlo("t.test")
            s.mail("a@x.test")
            s.rcpt("b@elsewhere.test")
            return s.data(b"Subject: t\r\n\r\nhi\r\n")[0]

    assert send() == 250
    proc.send_signal(signal.SIGUSR1)
    # Kept: the sink handles the signal in its event loop; probing with a message would store one
    # while it still accepts (and change the count checked below).
    time.sleep(0.3)
    assert send() == 451
    proc.send_signal(signal.SIGUSR2)
    # A refused message stores nothing: poll until the sink accepts again.
    wait_for(lambda: send() == 250, timeout=10, interval=0.1, what="the sink to accept again after SIGUSR2")
    assert len(list((tmp_path / "sink" / "new").iterdir())) == 2


# --------------------------------------------------------------------------- internationalized mail and internal errors

DATE = "Wed, 25 Nov 2026 10:00:00 +0000"


def test_utf8_deliveries_are_matched_at_the_sink_and_in_mailbox_folders(tmp_path: Path) -> None:
    """UTF-8 recipients round trip: the sink's UTF-8 X-Sink-Rcpt-To, mailbox folders named by
    mailbox_name (the address's UTF-8 octets %-encoded), compared case-insensitively."""
    from transportd.devtools.chaos.workload import internationalized
    from transportd.queue.mailbox import mailbox_name
    local, external = internationalized(["user3@example.test", "rcpt7@elsewhere.test"])
    assert (local, external) == ("üser3@example.test", "rcpt-ñ7@elsewhere.test")
    data = message_bytes("r1", 5, [local, external], 600, DATE, utf8=True)
    assert "Subject: chaos r1 #5 — grüße".encode() in data and b"\r\nX-Chaos-Id: r1-5\r\n" in data
    # The sink writes its envelope lines as UTF-8 (sink.py); the daemon may hand over another case.
    sink = tmp_path / "sink" / "new"
    sink.mkdir(parents=True)
    (sink / "m1").write_bytes("X-Sink-Mail-From: <klïent@chaos.test>\r\nX-Sink-Rcpt-To: <RCPT-Ñ7@elsewhere.test>\r\n"
                              .encode() + data)
    assert parse_delivery((sink / "m1").read_bytes(), where="external")[0].recipient == external
    # node1's mailbox folder: lower-cased, the UTF-8 octets %-encoded (two escapes for ü).
    folder = mailbox_name("Üser3@example.test")
    assert folder.isascii() and folder.lower().startswith("%c3%bcser3@")
    box = tmp_path / "mailboxes" / folder / "new"
    box.mkdir(parents=True)
    (box / "m1").write_bytes(data)
    mailbox = scan_maildir_tree(tmp_path / "mailboxes", "mailbox", per_recipient_folders=True)
    assert [(d.number, d.recipient) for d in mailbox] == [(5, local)]
    deliveries = scan_maildir_tree(tmp_path / "sink", "external", per_recipient_folders=False) + mailbox
    v = check("r1", {5: Sent(5, [local, external], [Attempt(ACK, "n1")], utf8=True)}, deliveries)
    assert v.ok and not v.lost and not v.unexpected, v.summary()
    # The same files do not stand for the ASCII twins: a mismatch is still seen.
    v = check("r1", {5: Sent(5, ["user3@example.test", "rcpt7@elsewhere.test"], [Attempt(ACK, "n1")])},
              deliveries)
    assert len(v.lost) == 2 and len(v.unexpected) == 2


def test_internal_errors_and_poison_fail_the_verdict() -> None:
    from transportd.devtools.chaos.checker import HeldRow
    from transportd.devtools.chaos.harness import format_summary
    history = {1: sent(1, ["a@example.test", "b@elsewhere.test"], ACK), 2: sent(2, ["c@elsewhere.test"], ACK),
               3: sent(3, ["d@elsewhere.test"], UNKNOWN)}
    deliveries = [dl(1, "a@example.test", "mailbox"), dl(1, "b@elsewhere.test"), dl(2, "c@elsewhere.test")]
    assert check(RUN, history, deliveries, []).ok
    ours = "451 4.3.0 internal error in deliver: KeyError: 'x'"
    harmless = [
        HeldRow("node1", RUN, 1, "Retry", "451 4.4.0 Unable to connect to elsewhere.test: refused", False, 7),
        HeldRow("node1", RUN, 1, "Ready", "", False, 8),
        HeldRow("node1", "other", 1, "Retry", ours, False, 9),     # another run's message
        HeldRow("node2", RUN, 3, "Retry", ours, False, 10),        # never acknowledged
        HeldRow("node2", RUN, 2, "Active", ours, False, 11),       # being delivered again
    ]
    v = check(RUN, history, deliveries, harmless)
    assert v.ok and v.summary()["internal_errors"] == 0, v.summary()
    bad = {
        "ours": [HeldRow("node1", RUN, 1, "Retry", ours, False, 12)],
        "a peer's": [HeldRow("node2", RUN, 2, "Retry", "451 4.3.0 Internal error, message not accepted; "
                                                       "try again later", False, 13)],
        "poisoned": [HeldRow("node3", RUN, 2, "", "", True, 14)],
        # one message, two recipients held: counted once
        "two recipients": [HeldRow("node1", RUN, 1, "Retry", ours, False, 15),
                           HeldRow("node1", RUN, 1, "Retry", ours, False, 15)],
    }
    for name, rows in bad.items():
        v = check(RUN, history, deliveries, harmless + rows)
        s = v.summary()
        assert not v.ok and s["ok"] is False and s["internal_errors"] == 1, (name, s)
        (example,) = s["internal_error_examples"]
        assert example.startswith(f"{rows[0].node} #{rows[0].number}"), example
        assert ("Poison" if rows[0].poisoned else rows[0].last_error) in example, example
        assert "internal errors 1" in format_summary(s) and example in format_summary(s)
    # Two copies of one chaos message (a client retry) held on two nodes are two messages.
    v = check(RUN, history, deliveries, bad["ours"] + bad["poisoned"] + bad["a peer's"])
    assert len(v.internal_errors) == 3 and [r.number for r in v.internal_errors] == [1, 2, 2]


def _queue_db_with(folder: Path, messages: list[tuple[str, bytes, list[tuple[str, str]], int]]) -> None:
    """A real queue database (transportd.queue.store) holding primary messages with recipients in the
    given (status, last_error) and the given poisoned flag."""
    import sqlite3
    folder.mkdir()
    store = QueueStore.open(folder / "queue.db")
    try:
        for i, (role, data, rcpts, _) in enumerate(messages):
            msg = mq.NewMessage(network_message_id=f"{folder.name}-{i}", sender="klïent@chaos.test", data=data,
                                recipients={NextHop("mailbox:local", MAILBOX, "local"):
                                            [f"üser{j}@example.test" for j in range(len(rcpts))]},
                                received_at=1.0, expires_at=86400.0, role=role, smtputf8=True)
            store.transaction(lambda c, m=msg: mq.enqueue(c, m))
    finally:
        store.close()
    con = sqlite3.connect(folder / "queue.db")
    try:
        ids = [r[0] for r in con.execute("SELECT id FROM messages ORDER BY id")]
        for mid, (_, _, rcpts, poisoned) in zip(ids, messages):
            con.execute("UPDATE messages SET poisoned = ? WHERE id = ?", (poisoned, mid))
            rids = [r[0] for r in con.execute("SELECT id FROM recipients WHERE message_id = ? ORDER BY id", (mid,))]
            for rid, (status, last_error) in zip(rids, rcpts):
                con.execute("UPDATE recipients SET status = ?, last_error = ? WHERE id = ?", (status, last_error, rid))
        con.commit()
    finally:
        con.close()


def test_held_rows_read_every_node_queue_database_for_the_checker(tmp_path: Path) -> None:
    """The harness's read of the queue databases (real schema; an older one without ``poisoned``),
    judged by the checker: a 451 4.3.0 Retry and a poisoned message fail the run, a 451 4.4.0 one
    and shadows do not."""
    import sqlite3
    ours = "451 4.3.0 internal error in deliver: UnicodeEncodeError: 'ascii' codec can't encode"

    def body(n: int) -> bytes:
        return message_bytes(RUN, n, ["üser0@example.test"], 600, DATE, utf8=True)

    dsn = (b"From: MAILER-DAEMON@node2\r\nSubject: Undeliverable\r\n\r\n--b\r\n\r\nX-Chaos-Id: "
           + RUN.encode() + b"-4\r\n")
    _queue_db_with(tmp_path / "node1", [
        ("primary", body(1), [("Retry", ours), ("Delivered", "250 2.0.0 delivered")], 0),   # counts
        ("primary", body(2), [("Retry", "451 4.4.0 Unable to connect")], 0),                # transient
        ("shadow", body(3), [("Retry", ours)], 0),                                          # a shadow
        ("primary", dsn, [("Retry", ours)], 0),                                             # quotes #4
    ])
    _queue_db_with(tmp_path / "node2", [
        ("primary", body(4), [("Failed", "550 5.1.1 no such user")], 1),                    # Poison
        ("primary", body(5), [("Ready", "")], 0),
    ])
    # node3: a database from before the Poison queue (no ``poisoned`` column).
    (tmp_path / "node3").mkdir()
    con = sqlite3.connect(tmp_path / "node3" / "queue.db")
    con.executescript("CREATE TABLE messages (id INTEGER PRIMARY KEY, role TEXT, state TEXT);"
                      "CREATE TABLE recipients (id INTEGER PRIMARY KEY, message_id INTEGER, status TEXT, "
                      "last_error TEXT);"
                      "CREATE TABLE message_bodies (message_id INTEGER PRIMARY KEY, data BLOB);")
    con.execute("INSERT INTO messages VALUES (1, 'primary', 'Queued')")
    con.execute("INSERT INTO recipients VALUES (1, 1, 'Retry', ?)", ("451 4.3.0 internal error in route",))
    con.execute("INSERT INTO message_bodies VALUES (1, ?)", (body(6),))
    con.commit()
    con.close()
    specs = {short: NodeSpec(short, short, "site-a", "", "", str(tmp_path / short), "")
             for short in ("node1", "node2", "node3", "node4")}   # node4: no database yet
    cluster = object.__new__(ChaosCluster)  # only the queue databases are needed
    cluster.by_short = specs
    held = {short: cluster.held_rows(short) for short in specs}
    assert held["node4"] == []
    assert sorted((r.number, r.status, r.poisoned) for r in held["node1"]) == [(-1, "Retry", False),
                                                                                 (1, "Retry", False),
                                                                                 (2, "Retry", False)]
    assert [(r.number, r.status, r.poisoned) for r in held["node2"]] == [(4, "", True), (5, "Ready", False)]
    assert [(r.number, r.last_error) for r in held["node3"]] == [(6, "451 4.3.0 internal error in route")]
    history = {n: sent(n, ["üser0@example.test"], ACK) for n in range(1, 7)}
    deliveries = [dl(n, "üser0@example.test", "mailbox") for n in range(1, 7)]
    v = check(RUN, history, deliveries, [r for rows in held.values() for r in rows])
    assert not v.ok
    assert [(r.node, r.number) for r in v.internal_errors] == [("node1", 1), ("node2", 4), ("node3", 6)]
    assert v.summary()["internal_errors"] == 3


def test_workload_sends_a_share_of_utf8_messages_with_the_same_recipients_otherwise() -> None:
    from transportd.devtools.chaos.workload import UTF8_SHARE, Workload, WorkloadSettings

    def history(seed: int, **kw) -> dict[int, Sent]:
        return Workload("r", [("127.0.0.1", 1)], WorkloadSettings(messages=1000, clients=1, rate=1, **kw),
                        seed=seed).history

    def before_utf8(seed: int) -> dict[int, list[str]]:
        """The recipients a run with this seed had before internationalized mail was added."""
        import random
        rng = random.Random(seed ^ 0x5EED)
        out = {}
        for n in range(1, 1001):
            out[n] = recipients_for(n, rng)
            rng.choice((600, 2_000, 8_000, 30_000))
        return out

    assert UTF8_SHARE == 0.15
    default, again, without = history(7), history(7), history(7, utf8_share=0)
    assert {n: s.recipients for n, s in without.items()} == before_utf8(7)
    utf8 = [n for n, s in default.items() if s.utf8]
    assert 0.12 < len(utf8) / 1000 < 0.18                      # the configured share, 15 %
    assert utf8 == [n for n, s in again.items() if s.utf8]      # reproducible from the seed
    assert utf8 != [n for n, s in history(8).items() if s.utf8]
    assert not any(s.utf8 for s in without.values())
    half = [n for n, s in history(7, utf8_share=0.5).items() if s.utf8]
    assert 0.45 < len(half) / 1000 < 0.55
    ascii_rcpts = before_utf8(7)
    for n, s in default.items():
        if s.utf8:   # UTF-8 local parts, both kinds of recipient, the ASCII message's mailboxes
            assert all(not r.split("@")[0].isascii() and r.split("@")[1].isascii() for r in s.recipients)
            assert [r.replace("ü", "u").replace("-ñ", "") for r in s.recipients] == ascii_rcpts[n]
        else:        # the others keep the 45/45/10 recipients of a run without UTF-8 mail
            assert s.recipients == ascii_rcpts[n]
    kinds = {tuple(r.split("@")[1] for r in default[n].recipients) for n in utf8}
    assert kinds == {("example.test",), ("elsewhere.test",), ("example.test", "elsewhere.test")}


def test_workload_sends_utf8_messages_with_smtputf8_through_the_sink(procs, tmp_path: Path) -> None:
    """The clients' real path (smtplib, MAIL ... SMTPUTF8 BODY=8BITMIME, raw UTF-8 headers) against
    the development sink; the checker matches what it stored."""
    from conftest import free_port, wait_port

    from transportd.devtools.chaos.workload import UTF8_SENDER, Workload, WorkloadSettings
    port = free_port()
    proc = procs.add(subprocess.Popen([sys.executable, "-m", "transportd", "sink", "--listen", f"127.0.0.1:{port}",
                                       "--dir", str(tmp_path / "sink")], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    wait_port("127.0.0.1", port, proc=proc)
    w = Workload(RUN, [("127.0.0.1", port)],
                 WorkloadSettings(messages=30, clients=2, rate=300, per_connection=4, utf8_share=0.5), seed=3)
    w.retry_until = time.monotonic() + 10
    w.start()
    assert w.join(timeout=60)
    utf8 = {n for n, s in w.history.items() if s.utf8}
    assert 5 < len(utf8) < 25
    assert all(s.outcome == ACK for s in w.history.values()), {n: s.attempts for n, s in w.history.items()}
    deliveries = scan_maildir_tree(tmp_path / "sink", "external", per_recipient_folders=False)
    v = check(RUN, w.history, deliveries)
    assert v.ok and v.acknowledged == 30 and not v.lost and not v.unexpected, v.summary()
    senders = {}
    for f in (tmp_path / "sink" / "new").iterdir():
        data = f.read_bytes()
        (d, *_) = parse_delivery(data, where="external")
        senders[d.number] = data.split(b"\r\n", 1)[0].decode("utf-8")
        if d.number in utf8:
            assert f"Subject: chaos {RUN} #{d.number} — grüße".encode() in data
    assert {n for n, line in senders.items() if line == f"X-Sink-Mail-From: <{UTF8_SENDER}>"} == utf8


def test_utf8_message_on_a_session_without_smtputf8_is_refused_not_a_crash() -> None:
    """A node that refused EHLO leaves smtplib's commands in ASCII: the UTF-8 sender cannot be
    sent. That is a refused attempt (retried elsewhere), not a dead client thread."""
    import smtplib

    from transportd.devtools.chaos.workload import Workload, WorkloadSettings
    w = Workload(RUN, [("127.0.0.1", 1)], WorkloadSettings(messages=1, clients=1, rate=1, utf8_share=1), seed=1)
    s = w.history[1]
    assert s.utf8
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    conn = smtplib.SMTP()
    conn.sock = a   # connected, but no successful EHLO: does_esmtp is false
    try:
        assert w._send(conn, s, b"Subject: x\r\n\r\nx\r\n") == REFUSED
    finally:
        for sock in (a, b, srv):
            sock.close()
    assert [x.outcome for x in s.attempts] == [REFUSED] and "UnicodeEncodeError" in s.attempts[0].detail


def test_an_overlapping_disk_full_fault_waits_for_its_own_node():
    """Its node's data directory is the tmpfs mounted for it: it is never moved to another node."""
    nemesis = Nemesis(_RecordingCluster(), [], settle=0, say=lambda m: None, concurrent=2)
    full = Fault(2, "disk-full", ["node1"], duration=1, wait_before=0, overlap=True)
    assert not nemesis._retarget(full, {"node1"}) and full.targets == ["node1"]
    assert nemesis._retarget(full, {"node2"})
    sink = Fault(3, "sink-refuse", [], duration=1, wait_before=0, overlap=True)
    assert not nemesis._retarget(sink, {"sink"}) and nemesis._retarget(sink, {"node1"})
