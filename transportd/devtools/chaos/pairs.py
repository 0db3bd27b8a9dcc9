"""Pair faults: two failures applied together, for ``transportd chaos --concurrent K`` (K >= 2).

It owns the two faults that are dangerous by construction: the primary of mail
queued behind the refusing sink and the peer holding most of its shadows killed
and wiped at once (with one shadow per message this loses that mail for certain),
and a kill of one node with a partition of the two others. The schedule,
overlapping and the other faults are the nemesis's (nemesis.py); the cluster
operations are harness.ChaosCluster's; the precondition rule is preconditions.py's.
"""

from __future__ import annotations

from typing import Any

from transportd.devtools.chaos.preconditions import wipe_target


class PairFaults:
    """Mixed into the Nemesis: ``_<fault type>`` for each pair fault type."""

    cluster: Any
    settle: float
    wipe_limit: float
    _sleep: Any          # the nemesis's interruptible sleep
    _precondition: Any   # the nemesis's precondition wait (records it on the fault)

    def _double_wipe_behind_refusing_sink(self, f: Any) -> None:
        """Two failures at once: the primary of mail queued behind the refusing sink and the peer
        that holds most of its shadows, both killed and wiped together."""
        scheduled = f.targets[0]
        grace = min(self.wipe_limit / 2, f.duration * 3)
        self.cluster.sink_refuse(True)
        try:
            def probe(elapsed: float) -> tuple[str, str] | None:
                if elapsed < f.duration:
                    return None
                node = wipe_target(self.cluster.queued_behind_sink(), scheduled, elapsed, grace, minimum=2)
                holder = self.cluster.shadow_holder(node) if node else None
                return (node, holder) if node and holder else None
            w = self._precondition(f, probe, self.wipe_limit, 0.3)
            if not w.held:
                f.note += (f"precondition never held: no mail queued behind the refusing sink with its shadow "
                           f"on a peer after {w.waited:g} s")
                return
            node, holder = w.value
            f.targets = [node, holder]
            held = self.cluster.queued_behind_sink().get(node, 0)
            shadows = self.cluster.shadows_of(holder, node)
            for short in (node, holder):
                self.cluster.kill(short)
            for short in (node, holder):
                self.cluster.wipe(short)
            f.note += (f"{held} message(s) queued behind the refusing sink on {node}, {shadows} of its shadows "
                       f"on {holder}: both killed and wiped (after {w.waited:g} s)")
            self._sleep(f.duration)
            for short in (node, holder):
                self.cluster.start_node(short)
            self._sleep(self.settle)
        finally:
            self.cluster.sink_refuse(False)

    def _kill_and_partition(self, f: Any) -> None:
        """Two failures at once: one node killed, the two others cut apart."""
        killed, a, b = f.targets
        links = self.cluster.links_between(a, b)
        self.cluster.kill(killed)
        self.cluster.proxy.set(links, "cut", 0.0)
        try:
            self._sleep(f.duration)
        finally:
            self.cluster.proxy.set(links, "ok", 0.0)
            self.cluster.start_node(killed)
