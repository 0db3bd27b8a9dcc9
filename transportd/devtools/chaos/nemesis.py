"""The nemesis: faults at random moments, from a seeded schedule, one at a time or up to K at once.

``schedule(seed, ...)`` is pure: the same seed gives the same list of faults
(type, target, duration, pause before it, whether it overlaps the one before),
printed so a run can be replayed. ``Nemesis`` applies them to a running
ChaosCluster, logging each fault with its wall-clock start and end. With
``concurrent`` 1 (the default) every fault is healed before the next begins, a
node that lost its queue database gets time to settle (the shadows of its old
database promoted) before anything else happens, and no fault starts while a node
still holds queued mail without all its shadows (promoted copies being made
redundant again, shadows lost with a wiped peer being re-made): at most one
failure at a time. With ``concurrent`` K, a fault marked ``overlap`` starts while
others still run (up to K at once, on nodes no running fault holds), and pair
faults apply two failures together by construction: the primary of queued mail
and the peer holding its shadows wiped at once, a kill and a partition of the
survivors. How long each recovery took is recorded (``recovery_wait``). A fault that exists for a
situation (mail queued behind a refusing sink, messages between the shadow's 250 and the
client's) waits for it, up to a limit (``preconditions``); if it never comes the fault is not
applied and is recorded as not done (``done`` false, the reason in ``note``).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from transportd.devtools.chaos.disk import DiskNotFilled
from transportd.devtools.chaos.pairs import PairFaults
from transportd.devtools.chaos.preconditions import (
    MID_SHADOW_LIMIT,
    WIPE_LIMIT,
    Waited,
    wait_until,
    wipe_target,
)

# name: what it does (the harness prints this list)
FAULT_TYPES: dict[str, str] = {
    "kill": "kill -9 a node, restart it with its queue database",
    "kill-wipe": "kill -9 a node, delete its queue database, restart it",
    "wipe-behind-refusing-sink": "the sink answers 4xx until a node holds queued mail (the scheduled node, "
                                 "or after a grace time the one holding most); kill -9 that node, delete its "
                                 "queue database, restart it; the sink accepts again (not done if no mail "
                                 "was queued within the limit)",
    "kill-mid-shadow": "slow the links of a node (replies held back), then kill -9 it as soon as a message sits "
                       "between the shadow's 250 and its own; restart with its database (not done if none "
                       "did within the limit)",
    "kill-worker": "kill -9 one receive worker process of a node under load (the node starts it again)",
    "pause": "SIGSTOP a node (heartbeats fail while it still holds mail), SIGCONT it later",
    "partition": "cut the links between two nodes (a black hole: bytes swallowed)",
    "delay": "delay every chunk on the links between two nodes",
    "reset": "reset (TCP RST) every connection on the links between two nodes, and new ones",
    "disk-full": "fill the disk of a node's data directory (a tmpfs the harness mounted: root only, else "
                 "not scheduled); it must answer 4xx, lose nothing, and take mail again once it is freed",
    "sink-refuse": "the external sink answers 451 for a while",
    "sink-restart": "kill -9 the external sink, start it again",
}
# Two failures at once by construction (two slots of --concurrent): scheduled only when K >= 2.
PAIR_TYPES: dict[str, str] = {
    "double-wipe-behind-refusing-sink": "the sink answers 4xx until a node holds queued mail; kill -9 that node "
                                        "and the peer holding most of its shadows together, delete both queue "
                                        "databases, restart both (with one shadow per message this loses mail)",
    "kill-and-partition": "kill -9 a node and cut the links between the two others at the same time; restart it "
                          "and heal the links together",
}
FAULT_TYPES.update(PAIR_TYPES)
WEIGHTS = {"kill": 3, "kill-worker": 2, "kill-wipe": 2, "wipe-behind-refusing-sink": 1, "kill-mid-shadow": 2, "pause": 2,
           "partition": 2, "delay": 2, "reset": 2, "sink-refuse": 2, "sink-restart": 1, "disk-full": 1}
PAIR_WEIGHTS = {"double-wipe-behind-refusing-sink": 2, "kill-and-partition": 2}
SINK_TYPES = ("sink-refuse", "sink-restart", "wipe-behind-refusing-sink", "double-wipe-behind-refusing-sink")
OVERLAP_CHANCE = 0.5  # with --concurrent K >= 2: the share of faults that start while others run


@dataclass
class Fault:
    index: int
    type: str
    targets: list[str]
    duration: float
    wait_before: float
    delay: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    note: str = ""
    recovery_wait: float = 0.0  # seconds waited before it for the cluster to be redundant again
    done: bool = True           # False: its precondition never held, it was not applied (see note)
    precondition_wait: float = 0.0  # seconds it waited for its precondition
    overlap: bool = False       # starts while earlier faults still run (--concurrent K >= 2)

    @property
    def slots(self) -> int:
        """How many of the --concurrent slots it takes (a pair fault is two failures)."""
        return 2 if self.type in PAIR_TYPES else 1

    def resources(self) -> set[str]:
        """The nodes (and the sink) it holds while it runs: no overlapping fault may touch them."""
        return set(self.targets) | ({"sink"} if self.type in SINK_TYPES else set())

    def describe(self) -> str:
        extra = f" delay {self.delay:.2f}s" if self.delay else ""
        return (f"fault {self.index}: {self.type} {'/'.join(self.targets) or 'sink'} for {self.duration:.1f}s"
                f"{extra} after {self.wait_before:.1f}s{' (overlapping)' if self.overlap else ''}")


def schedule(seed: int, faults: int, nodes: list[str], *, resubmit_span: float,
             first: str | None = "wipe-behind-refusing-sink", types: list[str] | None = None,
             concurrent: int = 1) -> list[Fault]:
    """The fault list for a seed. ``first`` (default: the sink-refusing wipe, the fault that makes a
    run without shadow redundancy lose mail for certain; with ``concurrent`` >= 2 its double form,
    which makes a run with one shadow per message lose mail) opens the schedule. ``concurrent`` 1
    gives the same list as ever for a seed; K >= 2 adds the pair faults and marks about half the
    faults as overlapping the ones before."""
    rng = random.Random(seed)
    pairs = concurrent >= 2
    if pairs and first == "wipe-behind-refusing-sink" and (types is None or "double-wipe-behind-refusing-sink"
                                                            in types):
        first = "double-wipe-behind-refusing-sink"
    kinds = [k for k in (types or [*WEIGHTS, *(PAIR_WEIGHTS if pairs else ())]) if pairs or k not in PAIR_TYPES]
    weights = [WEIGHTS.get(k, PAIR_WEIGHTS.get(k, 1)) for k in kinds]
    out: list[Fault] = []
    for i in range(faults):
        kind = first if (i == 0 and first) else rng.choices(kinds, weights)[0]
        wait = rng.uniform(1.0, 4.0)
        if kind == "kill-and-partition":
            targets = rng.sample(nodes, 3)  # the killed node, then the two cut apart
        elif kind in ("partition", "delay", "reset"):
            targets = rng.sample(nodes, 2)
        elif kind in ("sink-refuse", "sink-restart"):
            targets = []
        else:
            targets = [rng.choice(nodes)]
        if kind == "pause":
            # Sometimes past the resubmit span: the peers promote while the node still holds the mail.
            duration = rng.uniform(1.0, resubmit_span * 2.0)
        elif kind in ("kill", "kill-wipe", "kill-mid-shadow"):
            duration = rng.uniform(0.2, 3.0)
        elif kind in ("wipe-behind-refusing-sink", "double-wipe-behind-refusing-sink"):
            duration = rng.uniform(2.0, 4.0)
        else:
            duration = rng.uniform(1.0, 6.0)
        delay = rng.uniform(0.2, 1.5) if kind in ("delay", "kill-mid-shadow") else 0.0
        overlap = pairs and i > 0 and rng.random() < OVERLAP_CHANCE
        out.append(Fault(i + 1, kind, targets, round(duration, 2), round(wait, 2), round(delay, 2), overlap=overlap))
    return out


@dataclass
class NemesisLog:
    faults: list[Fault] = field(default_factory=list)

    def as_json(self) -> list[dict[str, Any]]:
        return [asdict(f) for f in self.faults]


class Nemesis(PairFaults):
    """Runs a schedule against a cluster (see harness.ChaosCluster for the operations)."""

    def __init__(self, cluster: Any, plan: list[Fault], *, settle: float, say: Callable[[str], None],
                 recovery_timeout: float = 60.0, wipe_limit: float = WIPE_LIMIT,
                 mid_shadow_limit: float = MID_SHADOW_LIMIT, concurrent: int = 1):
        self.cluster = cluster
        self.concurrent = max(1, concurrent)
        self._running: dict[int, Fault] = {}  # faults applied now, by index
        self._lock = threading.Lock()
        self.wipe_limit = wipe_limit
        self.mid_shadow_limit = mid_shadow_limit
        self.plan = plan
        self.settle = settle
        self.recovery_timeout = recovery_timeout
        self.say = say
        self.stop = threading.Event()
        self.log = NemesisLog()
        self.thread = threading.Thread(target=self._run, name="nemesis", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self.thread.start()

    def _sleep(self, seconds: float) -> None:
        self.stop.wait(seconds)

    def _run(self) -> None:
        threads: list[threading.Thread] = []
        try:
            for fault in self.plan:
                if self.stop.is_set():
                    break
                if not self._make_room(fault):
                    break
                self._sleep(fault.wait_before)
                if not self._running:
                    fault.recovery_wait = self._await_redundancy()
                with self._lock:
                    self._running[fault.index] = fault
                    self.log.faults.append(fault)
                if self.concurrent == 1:
                    self._apply(fault)
                else:
                    t = threading.Thread(target=self._apply, args=(fault,), name=f"fault-{fault.index}", daemon=True)
                    t.start()
                    threads.append(t)
            for t in threads:
                t.join()
        except BaseException as exc:  # noqa: BLE001 - reported by the harness
            self.error = exc
            self.say(f"nemesis failed: {exc!r}")
        finally:
            for t in threads:
                t.join(timeout=120)
            self.cluster.heal_all()

    def _make_room(self, fault: Fault) -> bool:
        """Wait until ``fault`` may start: nothing running unless it overlaps; then a free slot and
        nodes no running fault holds (a busy target is swapped for a free node, said in its note).
        False when the nemesis was stopped meanwhile."""
        while not self.stop.is_set():
            with self._lock:
                running = list(self._running.values())
                if not running:
                    return True
                if fault.overlap and sum(f.slots for f in running) + fault.slots <= self.concurrent:
                    held = set().union(*(f.resources() for f in running))
                    if self._retarget(fault, held):
                        return True
            self._sleep(0.1)
        return False

    def _retarget(self, fault: Fault, held: set[str]) -> bool:
        """Point an overlapping fault at nodes no running fault holds; False if it cannot be."""
        if "sink" in fault.resources() and "sink" in held:
            return False
        busy = [t for t in fault.targets if t in held]
        if not busy:
            return True
        if fault.type == "disk-full":
            return False  # its node's data directory is the tmpfs mounted for it: it waits instead
        free = sorted(n for n in self.cluster.by_short if n not in held and n not in fault.targets)
        if len(free) < len(busy):
            return False
        swap = dict(zip(busy, free))
        fault.note = f"scheduled on {'/'.join(fault.targets)}, busy with a running fault; "
        fault.targets = [swap.get(t, t) for t in fault.targets]
        return True

    def _apply(self, fault: Fault) -> None:
        try:
            fault.started_at = time.time()
            self.say(fault.describe())
            getattr(self, "_" + fault.type.replace("-", "_"))(fault)
            fault.ended_at = time.time()
            if not fault.done:
                self.say(f"fault {fault.index} ({fault.type}) not done: {fault.note}")
        except BaseException as exc:  # noqa: BLE001 - reported by the harness
            self.error = exc
            self.say(f"nemesis failed in fault {fault.index}: {exc!r}")
            self.stop.set()
        finally:
            with self._lock:
                self._running.pop(fault.index, None)

    def _await_redundancy(self) -> float:
        """Wait (at most ``recovery_timeout``) until no node holds queued mail without a shadow;
        returns the seconds waited. A timeout is reported and the fault goes ahead."""
        t0 = time.monotonic()
        while not self.stop.is_set():
            exposed = self.cluster.not_redundant()
            if not exposed:
                break
            if time.monotonic() - t0 > self.recovery_timeout:
                self.say(f"still not redundant after {self.recovery_timeout:g}s: {exposed}; going ahead")
                break
            self._sleep(0.25)
        return round(time.monotonic() - t0, 2)

    # -- the faults --------------------------------------------------------------------

    def _kill(self, f: Fault) -> None:
        self.cluster.kill(f.targets[0])
        self._sleep(f.duration)
        self.cluster.start_node(f.targets[0])

    def _kill_wipe(self, f: Fault) -> None:
        self.cluster.kill(f.targets[0])
        self.cluster.wipe(f.targets[0])
        self._sleep(f.duration)
        self.cluster.start_node(f.targets[0])
        self._sleep(self.settle)  # the peers see the new queue database ID and promote its shadows

    def _precondition(self, f: Fault, probe: Callable[[float], Any], limit: float, poll: float) -> Waited:
        w = wait_until(probe, limit=limit, poll=poll, sleep=self._sleep, stopped=self.stop.is_set)
        f.precondition_wait = w.waited
        f.done = w.held
        return w

    def _wipe_behind_refusing_sink(self, f: Fault) -> None:
        scheduled = f.targets[0]
        grace = min(self.wipe_limit / 2, f.duration * 3)
        self.cluster.sink_refuse(True)
        try:
            # At least ``duration`` under the refusing sink, so that mail piles up (and is acknowledged).
            # Two at least: one deferred a moment ago may not have had its 250 yet (its client would retry).
            w = self._precondition(f, lambda elapsed: None if elapsed < f.duration else wipe_target(
                self.cluster.queued_behind_sink(), scheduled, elapsed, grace, minimum=2), self.wipe_limit, 0.3)
            if not w.held:
                f.note += (f"precondition never held: no mail queued behind the refusing sink on any node "
                          f"after {w.waited:g} s")
                return
            node = w.value
            f.targets = [node]
            held = self.cluster.queued_behind_sink().get(node, 0)
            self.cluster.kill(node)
            self.cluster.wipe(node)
            f.note += (f"{held} message(s) queued behind the refusing sink on {node} when killed "
                      f"(after {w.waited:g} s)" + (f"; scheduled {scheduled}, which held fewer" if node != scheduled
                                                   else ""))
            self.cluster.start_node(node)
            self._sleep(self.settle)
        finally:
            self.cluster.sink_refuse(False)

    def _kill_mid_shadow(self, f: Fault) -> None:
        node = f.targets[0]
        links = self.cluster.links_of(node)
        self.cluster.proxy.set(links, "ok", f.delay)
        try:
            w = self._precondition(f, lambda _: self.cluster.between_acks(node) or None,
                                   self.mid_shadow_limit, 0.05)
            if w.held:
                self.cluster.kill(node)
        finally:
            self.cluster.proxy.set(links, "ok", 0.0)
        if not w.held:
            f.note += (f"precondition never held: no message between the shadow's 250 and the client's on "
                      f"{node} within {w.waited:g} s")
            return
        f.note += f"{w.value} message(s) between the shadow's 250 and the client's when killed (after {w.waited:g} s)"
        self._sleep(f.duration)
        self.cluster.start_node(node)

    def _kill_worker(self, f: Fault) -> None:
        pid = self.cluster.kill_worker(f.targets[0], f.index)
        f.note += f"worker pid {pid} killed" if pid else "no receive worker to kill"
        self._sleep(f.duration)

    def _disk_full(self, f: Fault) -> None:
        node = f.targets[0]
        try:
            held = self.cluster.disks.fill(node)
        except DiskNotFilled as exc:
            f.done, f.note = False, str(exc)
            return
        try:
            self._sleep(f.duration)
        finally:
            self.cluster.disks.free(node)
        f.note += f"data directory of {node} full for {f.duration:g} s ({held // 1024} KiB of data on it)"

    def _pause(self, f: Fault) -> None:
        self.cluster.pause(f.targets[0])
        self._sleep(f.duration)
        self.cluster.resume(f.targets[0])

    def _links(self, f: Fault, mode: str, delay: float = 0.0) -> None:
        links = self.cluster.links_between(*f.targets)
        self.cluster.proxy.set(links, mode, delay)
        self._sleep(f.duration)
        self.cluster.proxy.set(links, "ok", 0.0)

    def _partition(self, f: Fault) -> None:
        self._links(f, "cut")

    def _delay(self, f: Fault) -> None:
        self._links(f, "ok", f.delay)

    def _reset(self, f: Fault) -> None:
        self._links(f, "reset")

    def _sink_refuse(self, f: Fault) -> None:
        self.cluster.sink_refuse(True)
        self._sleep(f.duration)
        self.cluster.sink_refuse(False)

    def _sink_restart(self, f: Fault) -> None:
        self.cluster.kill_sink()
        self._sleep(f.duration)
        self.cluster.start_sink()
