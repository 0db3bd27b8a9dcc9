"""``transportd analyze generate``: realistic multi-node MSGTRK logs with failures injected, and the truth.

It simulates a cluster that follows docs/PROTOCOL.md: a message enters a live node (RECEIVE), a shadow
is made on a peer in the other site before the 250 (HARECEIVE on the shadow, HAREDIRECT on the
primary) or cannot be (HAREDIRECTFAIL); the primary delivers outside the boundary
(SENDEXTERNAL; to several recipients, sometimes one at once and the rest minutes later, DEFER
between), or fails (FAIL and a DSN), or hands local mail to the mailbox node hop by hop
(SEND; RECEIVE and DELIVER there; HADISCARD of the fork at the sender's next poll); the shadow
drops its copy at its next heartbeat after the primary processed it (HADISCARD). Injected at known
rates: node deaths (the node writes nothing after; each shadow holder promotes that node's
shadows at its first heartbeat after ShadowResubmitTimeSpan: HADISCARD Resubmitted and RESUBMIT
REDUNDANCY, a new shadow, delivery again, so a message delivered but not yet discarded is delivered
twice; a promoted copy whose new primary dies too is promoted again by its new shadow), HAREDIRECTFAIL
(a message lost when its primary dies), lost discards (a shadow never discarded) and malformed
rows. Rows are the shapes the daemon writes (see ``transportd.tracking`` and ``track(`` calls).

``truth.json`` beside the logs is computed from the simulation itself (which copies exist where,
which node is alive), not from the logs: the analyzer must find the same numbers. The generator
must keep every node's rows in time order and never hold more than a sliding window in memory.

``Cluster`` is the simulated topology (sites, addresses, heartbeats, which node dies when, the
span of the logs); ``Generator`` walks each message through receive, shadow, discard and
promotion, handing each processing attempt to ``Delivery`` (mailbox hop, external send, failure
and DSN); ``logfiles.Journal`` keeps the rows in time order on their way to disk; ``tally``
turns the simulated fates into the truth.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from transportd.analytics.logfiles import Journal

DOMAIN = "transportd.test"
MAILBOX_DOMAIN = "example.test"
EXTERNAL_DOMAINS = ("foreign.test", "elsewhere.test", "remote.test")
MAX_DEFER = 300.0
HORIZON = 600.0
"""Seconds: no event is generated later than this after its message's arrival (bounded memory);
more when ShadowResubmitTimeSpan needs it."""


@dataclass
class Settings:
    messages: int
    nodes: int = 3
    seed: int = 1
    start: float = datetime(2026, 11, 22, 0, 0, tzinfo=UTC).timestamp()
    rate: float | None = None
    """Messages per second over the whole cluster; default: 50, lower for small runs so the
    logs span at least 10 minutes (room for a death and its promotions)."""
    deaths: int = 1
    redirect_fail_rate: float = 0.02
    local_rate: float = 0.2
    fail_rate: float = 0.005
    defer_rate: float = 0.05
    """Messages whose next hop is down for a while: DEFER, delivered 30 s to 5 min later."""
    split_rate: float = 0.1
    """Messages to several outside recipients whose first recipient's next hop answers while the
    others' is down for a while: SENDEXTERNAL for one, DEFER for the rest, sent 30 s to 5 min
    later; the node holds the message until then (or dies with it)."""
    lost_discard_rate: float = 0.001
    malformed: int = 10
    exchange2010_nodes: int = 0
    """The first this many nodes write Exchange 2010's 26 fields (no network-message-id), as
    2010-mode nodes of a mixed cluster do."""
    heartbeat: float = 10.0
    resubmit_span: float = 60.0
    grace: float = 600.0
    max_file_size: int = 64 * 1024 * 1024


@dataclass
class Copy:
    node: str
    taken: float
    released: float = float("inf")


@dataclass
class Sim:
    """One message's simulated fate: its copies and recipients' outcomes, for the truth file."""
    key: str
    received: bool = True
    redundant: bool = False
    unprotected: bool = False
    promoted_at: float | None = None
    promotions: int = 0
    """RESUBMIT REDUNDANCY rows inside the logs (a promoted copy may be promoted again)."""
    copies: list[Copy] = field(default_factory=list)
    done: dict[str, tuple[float, bool]] = field(default_factory=dict)
    """recipient -> (time, success) of its first terminal event."""
    recipients: tuple[str, ...] = ()
    external_sends: dict[str, int] = field(default_factory=dict)
    duplicate_dropped: bool = False
    stale_shadow: tuple[str, float] | None = None


class Cluster:
    """The simulated nodes: names, sites and addresses, heartbeat phases, arrival times, the end of
    the logs, and which node dies when. Draws from ``rng`` in a fixed order, so a seed fixes it."""

    def __init__(self, s: Settings, rng: random.Random) -> None:
        if s.nodes < 2:
            raise ValueError("need at least 2 nodes")
        if s.messages < 1:
            raise ValueError("need at least 1 message")
        if not 0 <= s.deaths <= s.nodes - 1:
            raise ValueError("deaths must leave the mailbox node alive (0 <= deaths <= nodes - 1)")
        self.s = s
        self.rng = rng
        self.names = [f"node{i + 1}.{DOMAIN}" for i in range(s.nodes)]
        self.site = {n: ("site-a" if i < (s.nodes + 1) // 2 else "site-b") for i, n in enumerate(self.names)}
        self.ips = {n: f"127.0.0.{11 + i}" for i, n in enumerate(self.names)}
        self.mailbox_node = self.names[0]
        self.internal = dict.fromkeys(self.names, 0)
        self.phase = {(a, b): rng.uniform(0, s.heartbeat) for a in self.names for b in self.names}
        self.rate = s.rate or min(50.0, max(0.01, s.messages / 600.0))
        t = s.start
        self.arrivals = []
        for _ in range(s.messages):
            t += rng.expovariate(self.rate)
            self.arrivals.append(t)
        self.end = t + 0.5
        """The logs end here: events later are not written (messages still in flight)."""
        self.death: dict[str, float] = {}
        span = self.end - s.start
        victims = rng.sample(self.names[1:], s.deaths)
        latest = self.end - s.resubmit_span - 2 * s.heartbeat - 60.0
        for i, victim in enumerate(victims):
            lo = s.start + span * (0.2 + 0.5 * i / max(1, s.deaths))
            if latest <= lo:
                raise ValueError("the logs are too short for a node death to be followed by promotions; "
                                 "generate more messages or lower --deaths")
            self.death[victim] = rng.uniform(lo, min(latest, lo + span * 0.5 / max(1, s.deaths)))
        self.horizon = max(HORIZON, 2 * MAX_DEFER + s.resubmit_span + 2 * s.heartbeat + 60.0)

    def alive(self, node: str, t: float) -> bool:
        return t < self.death.get(node, float("inf"))

    def next_poll(self, poller: str, target: str, t: float) -> float:
        """The first heartbeat (XQDISCARD) of ``poller`` to ``target`` strictly after ``t``."""
        hb = self.s.heartbeat
        phase = self.phase[(poller, target)]
        return t + ((phase - t) % hb or hb)

    def new_id(self, node: str) -> int:
        self.internal[node] += 1
        return self.internal[node]

    def pick_shadow(self, primary: str, t: float, exclude: tuple[str, ...] = ()) -> str | None:
        """PreferRemote: a live peer in another site, else one in the same site."""
        peers = [n for n in self.names if n != primary and n not in exclude and self.alive(n, t)]
        remote = [n for n in peers if self.site[n] != self.site[primary]]
        pool = remote or peers
        return self.rng.choice(pool) if pool else None


class Delivery:
    """What the current primary does with a message when it processes it: delivers local mail to
    the mailbox node hop by hop, sends the rest outside the boundary, or fails it and writes a DSN;
    and each recipient's first terminal outcome, for the truth."""

    def __init__(self, s: Settings, rng: random.Random, cluster: Cluster, journal: Journal,
                 sims: list[Sim]) -> None:
        self.s = s
        self.rng = rng
        self.cluster = cluster
        self.journal = journal
        self.sims = sims
        # Split deliveries draw from their own generator, so a seed gives the other fates it gave
        # before they were added.
        self.split_rng = random.Random(f"split-{s.seed}")

    def latency(self) -> float:
        if self.rng.random() < self.s.defer_rate:
            return self.rng.uniform(30.0, MAX_DEFER)
        return min(30.0, self.rng.lognormvariate(-1.2, 1.0))

    def deliver(self, sim: Sim, msg: dict, node: str, iid: int, t: float, copy: Copy) -> float | None:
        """``node`` (the current primary) processes the message at ``t``. Returns when it counts as
        processed (its shadow may then be discarded), or None if the node is dead by then."""
        cluster, emit = self.cluster, self.journal.emit
        if not cluster.alive(node, t):
            return None
        rcpts = msg["recipients"]
        if msg["local"]:
            if node == cluster.mailbox_node:
                emit(t, node, "DELIVER", "STOREDRIVER", msg, recipients=rcpts, internal_id=iid,
                     status=";".join(["250 2.0.0 delivered"] * len(rcpts)), context="MDB:MDB01")
                self.finish(sim, rcpts, t, True)
                copy.released = t
                return t
            self.to_mailbox(sim, msg, node, iid, t, copy)
            return t
        reply = "250 2.0.0 Ok: queued as " + f"{self.rng.getrandbits(40):010X}"
        if self.rng.random() < self.s.fail_rate and not sim.done:
            emit(t, node, "FAIL", "SMTP", msg, recipients=rcpts, internal_id=iid, context="smarthost",
                 status=";".join(["550 5.1.1 User unknown"] * len(rcpts)), connector="smarthost")
            self.finish(sim, rcpts, t, False)
            copy.released = t
            self.dsn(msg, node, t, iid)
            return t
        if len(rcpts) > 1 and self.split_rng.random() < self.s.split_rate:
            # One recipient sent; the others wait for their next hop, still on this node.
            self.send_external(sim, msg, node, iid, t, rcpts[:1], reply)
            rcpts = rcpts[1:]
            emit(t + 0.001, node, "DEFER", "SMTP", msg, recipients=rcpts, internal_id=iid,
                 status=";".join(["451 4.4.1 Connection refused"] * len(rcpts)), context="smarthost",
                 connector="smarthost")
            t += self.split_rng.uniform(30.0, MAX_DEFER)
            if not cluster.alive(node, t):
                return None
            reply = "250 2.0.0 Ok: queued as " + f"{self.split_rng.getrandbits(40):010X}"
        self.send_external(sim, msg, node, iid, t, rcpts, reply)
        copy.released = t
        return t

    def send_external(self, sim: Sim, msg: dict, node: str, iid: int, t: float, rcpts: tuple[str, ...],
                      reply: str) -> None:
        self.journal.emit(t, node, "SENDEXTERNAL", "SMTP", msg, recipients=rcpts, internal_id=iid, context=reply,
                          status=";".join([reply] * len(rcpts)), connector="smarthost", server_ip="127.0.0.10")
        for r in rcpts:
            if t <= self.cluster.end:
                sim.external_sends[r] = sim.external_sends.get(r, 0) + 1
        self.finish(sim, rcpts, t, True)

    def to_mailbox(self, sim: Sim, msg: dict, node: str, iid: int, t: float, copy: Copy) -> None:
        """SEND from ``node`` to the mailbox node at ``t``, RECEIVE and DELIVER (or DUPLICATEDELIVER)
        there, and the sender's HADISCARD of its fork at its next poll."""
        cluster, emit = self.cluster, self.journal.emit
        rcpts = msg["recipients"]
        box = cluster.mailbox_node
        reply = f"250 2.0.0 Ok: queued as {cluster.internal[box] + 1}"
        emit(t, node, "SEND", "SMTP", msg, recipients=rcpts, internal_id=iid, status=";".join(
            [reply] * len(rcpts)), context=reply, connector=f"mailbox:{box}", server_ip=cluster.ips[box])
        biid = cluster.new_id(box)
        t_recv = t + 0.004
        first_copy = not any(c.node == box for c in sim.copies)
        emit(t_recv, box, "RECEIVE", "SMTP", msg, recipients=rcpts, internal_id=biid,
             context="transport", connector=f"{box}\\transport", directionality="Incoming",
             client_hostname=node, client_ip=cluster.ips[node])
        box_copy = Copy(box, t_recv, t + 0.008)
        sim.copies.append(box_copy)
        dup = not first_copy and any(ok for _, ok in sim.done.values())
        event = "DUPLICATEDELIVER" if dup else "DELIVER"
        if emit(t + 0.008, box, event, "STOREDRIVER", msg, recipients=rcpts, internal_id=biid,
                status=";".join(["250 2.0.0 " + ("duplicate dropped" if dup else "delivered")] * len(rcpts)),
                context="MDB:MDB01"):
            if dup:
                sim.duplicate_dropped = True
            self.finish(sim, rcpts, t + 0.008, True)
        # The sender keeps a fork until the mailbox node's discard event, fetched at its next poll.
        released = cluster.next_poll(node, box, t + 0.008)
        copy.released = released if cluster.alive(node, released) else copy.released
        emit(released, node, "HADISCARD", "SMTP", msg, internal_id=iid,
             context=f"ExplicitlyDiscarded;{self.journal.guid()}", client_hostname=box)

    def finish(self, sim: Sim, rcpts: tuple[str, ...], t: float, ok: bool) -> None:
        if t > self.cluster.end:
            return
        for r in rcpts:
            # A success wins over an earlier failure (a promoted copy delivered after a FAIL).
            if r not in sim.done or (ok and not sim.done[r][1]):
                sim.done[r] = (t, ok)

    def dsn(self, original: dict, node: str, t: float, original_iid: int) -> None:
        cluster, emit = self.cluster, self.journal.emit
        netid = self.journal.guid()
        msg = {"netid": netid, "message_id": f"<{netid[:13]}@{node}>", "sender": "",
               "recipients": (original["sender"],), "subject": "Undeliverable: " + original["subject"],
               "size": 2048, "local": False}
        sim = Sim(key=netid, received=False, recipients=msg["recipients"])
        iid = cluster.new_id(node)
        t0 = t + 0.001
        if not emit(t0, node, "DSN", "DSN", msg, recipients=msg["recipients"], internal_id=iid,
                    reference=original["message_id"],
                    context=f"original internal id {original_iid}; failed"):
            return
        self.sims.append(sim)
        copy = Copy(node, t0)
        sim.copies.append(copy)
        t1 = t0 + 0.05
        if cluster.alive(node, t1) and t1 <= cluster.end:
            emit(t1, node, "SENDEXTERNAL", "SMTP", msg, recipients=msg["recipients"], internal_id=iid,
                 context="250 2.0.0 Ok", status="250 2.0.0 Ok", connector="smarthost", server_ip="127.0.0.10")
            self.finish(sim, msg["recipients"], t1, True)
            copy.released = t1


class Generator:
    """Runs the simulation: each arriving message is received, shadowed on a peer (or not),
    processed by ``Delivery``, its shadow discarded, or promoted when its primary died first; rows
    are flushed behind a sliding window, and the truth is written beside the logs."""

    def __init__(self, settings: Settings, out: Path) -> None:
        s = self.s = settings
        self.out = out
        self.rng = random.Random(s.seed)
        self.cluster = Cluster(s, self.rng)
        c = self.cluster
        self.journal = Journal(out, c.names, c.ips, c.alive, c.end, s.start, self.rng, s.max_file_size,
                               tuple(c.names[:s.exchange2010_nodes]))
        self.sims: list[Sim] = []
        self.delivery = Delivery(s, self.rng, c, self.journal, self.sims)

    def message(self, t0: float) -> None:
        s, rng, cluster, emit = self.s, self.rng, self.cluster, self.journal.emit
        live = [n for n in cluster.names if cluster.alive(n, t0)]
        primary = rng.choice(live)
        netid = self.journal.guid()
        local = rng.random() < s.local_rate
        count = rng.choice((1, 1, 1, 2, 3))
        if local:
            rcpts = tuple(sorted({f"user{rng.randrange(500)}@{MAILBOX_DOMAIN}" for _ in range(count)}))
        else:
            rcpts = tuple(sorted({f"user{rng.randrange(5000)}@{rng.choice(EXTERNAL_DOMAINS)}"
                                  for _ in range(count)}))
        sender = f"sender{rng.randrange(1000)}@remote.test"
        msg = {"netid": netid, "message_id": f"<{netid[:18]}@client.test>", "sender": sender,
               "recipients": rcpts, "subject": rng.choice(("Invoice 42", "hello, world", 'Re: "plans"', "report")),
               "size": rng.randrange(2000, 60000), "local": local}
        sim = Sim(key=netid, recipients=rcpts)
        self.sims.append(sim)
        iid = cluster.new_id(primary)
        shadow = None if rng.random() < s.redirect_fail_rate else cluster.pick_shadow(primary, t0)
        guid = self.journal.guid()
        if shadow is not None:
            siid = cluster.new_id(shadow)
            emit(t0 - 0.002, shadow, "HARECEIVE", "SMTP", msg, recipients=rcpts, internal_id=siid,
                 context=guid, client_hostname=primary, client_ip=cluster.ips[primary])
            sim.copies.append(Copy(shadow, t0 - 0.002))
        emit(t0, primary, "RECEIVE", "SMTP", msg, recipients=rcpts, internal_id=iid, context="frontend",
             connector=f"{primary}\\frontend", directionality="Incoming", client_ip="127.0.0.1",
             client_hostname="client.test")
        pcopy = Copy(primary, t0)
        sim.copies.append(pcopy)
        if shadow is not None:
            sim.redundant = True
            emit(t0 + 0.001, primary, "HAREDIRECT", "SMTP", msg, recipients=rcpts, internal_id=iid,
                 context=f"{shadow}=250 2.6.0 {msg['message_id']} [InternalId={siid}, Hostname={shadow}] "
                         "Queued mail for redundancy")
        else:
            sim.unprotected = True
            emit(t0 + 0.001, primary, "HAREDIRECTFAIL", "SMTP", msg, recipients=rcpts, internal_id=iid,
                 context="No suitable shadow servers")
        td = t0 + 0.002 + self.delivery.latency()
        if td - t0 > 2.0:
            emit(t0 + 1.0, primary, "DEFER", "SMTP", msg, recipients=rcpts, internal_id=iid,
                 status=";".join(["451 4.4.1 Connection refused"] * len(rcpts)), context="smarthost",
                 connector="smarthost")
        processed = self.delivery.deliver(sim, msg, primary, iid, td, pcopy)
        if shadow is None:
            return
        scopy = sim.copies[0]
        death = cluster.death.get(primary)
        if processed is not None:
            discard = cluster.next_poll(shadow, primary, processed)
            if death is None or discard < death:
                lost_discard = (death is None and shadow not in cluster.death and rng.random() < s.lost_discard_rate)
                if lost_discard:
                    sim.stale_shadow = (shadow, processed)
                    return
                if emit(discard, shadow, "HADISCARD", "SMTP", msg, internal_id=siid,
                        context=f"ExplicitlyDiscarded;{guid}", client_hostname=primary):
                    scopy.released = discard
                return
        # The primary died before the shadow heard it processed the message: promotion.
        assert death is not None
        promote = cluster.next_poll(shadow, primary, death + s.resubmit_span - 1e-6)
        if not cluster.alive(shadow, promote) or promote > cluster.end:
            return
        if processed is None:
            pcopy.released = min(pcopy.released, death)
        self.promote(sim, msg, primary, shadow, siid, guid, scopy, promote)

    def promote(self, sim: Sim, msg: dict, primary: str, shadow: str, siid: int, guid: str, scopy: Copy,
                promote: float) -> None:
        """``shadow`` promotes its copy at ``promote``, its first heartbeat after ShadowResubmitTimeSpan
        past the primary's death: HADISCARD Resubmitted and RESUBMIT REDUNDANCY (reference: the
        shadow copy's internal id), a new shadow, delivery again, that shadow's discard."""
        cluster, emit = self.cluster, self.journal.emit
        rcpts = msg["recipients"]
        emit(promote, shadow, "HADISCARD", "SMTP", msg, internal_id=siid, context=f"Resubmitted;{guid}",
             client_hostname=primary)
        emit(promote, shadow, "RESUBMIT", "REDUNDANCY", msg, recipients=rcpts, internal_id=siid,
             context=f"{primary} (ShadowHeartbeatFailure)", reference=str(siid))
        if sim.promoted_at is None:
            sim.promoted_at = promote
        sim.promotions += promote <= cluster.end
        other = cluster.pick_shadow(shadow, promote, exclude=(primary,))
        guid2 = self.journal.guid()
        if other is not None:
            oiid = cluster.new_id(other)
            emit(promote + 0.002, other, "HARECEIVE", "SMTP", msg, recipients=rcpts, internal_id=oiid,
                 context=guid2, client_hostname=shadow, client_ip=cluster.ips[shadow])
            ocopy = Copy(other, promote + 0.002)
            sim.copies.append(ocopy)
            emit(promote + 0.003, shadow, "HAREDIRECT", "SMTP", msg, recipients=rcpts, internal_id=siid,
                 context=f"{other}=250 2.6.0 {msg['message_id']} [InternalId={oiid}, Hostname={other}] "
                         "Queued mail for redundancy")
        else:
            emit(promote + 0.003, shadow, "HAREDIRECTFAIL", "SMTP", msg, recipients=rcpts, internal_id=siid,
                 context="No suitable shadow servers")
        processed2 = self.delivery.deliver(sim, msg, shadow, siid, promote + 0.005 + self.delivery.latency(), scopy)
        if other is None:
            return
        death = cluster.death.get(shadow)
        if processed2 is not None:
            discard2 = cluster.next_poll(other, shadow, processed2)
            if death is None or discard2 < death:
                if emit(discard2, other, "HADISCARD", "SMTP", msg, internal_id=oiid,
                        context=f"ExplicitlyDiscarded;{guid2}", client_hostname=shadow):
                    ocopy.released = discard2
                return
        # The promoting node died too before its new shadow heard the copy was processed: that
        # shadow promotes it in turn.
        assert death is not None
        again = cluster.next_poll(other, shadow, death + self.s.resubmit_span - 1e-6)
        if not cluster.alive(other, again) or again > cluster.end:
            return
        if processed2 is None:
            scopy.released = min(scopy.released, death)
        self.promote(sim, msg, shadow, other, oiid, guid2, ocopy, again)

    def run(self) -> dict[str, Any]:
        for i, t in enumerate(self.cluster.arrivals):
            self.message(t)
            if i % 2000 == 0:
                self.journal.flush(t - self.cluster.horizon)
        self.journal.flush(float("inf"))
        malformed = self.journal.inject_malformed(self.s.malformed)
        rows = self.journal.close()
        truth = tally(self.sims, self.cluster, self.journal, self.s)
        truth["malformed"] = malformed
        truth["rows"] = rows
        (self.out / "truth.json").write_text(json.dumps(truth, indent=2) + "\n")
        return truth


def tally(sims: list[Sim], cluster: Cluster, journal: Journal, s: Settings) -> dict[str, Any]:
    """The truth from the simulated fates: each message's state at the end of the logs, from the
    copies that exist where and which node is alive, never from the rows written."""
    end = cluster.end
    states = dict.fromkeys(("delivered", "failed", "in flight protected", "in flight unprotected",
                            "left the logs", "lost", "incomplete"), 0)
    received = redundant = unprotected = promoted = promotions = dup_in = dup_out = stale = 0
    for sim in sims:
        if sim.received:
            received += 1
            redundant += sim.redundant
            unprotected += sim.unprotected
        promoted += sim.promoted_at is not None and sim.promoted_at <= end
        promotions += sim.promotions
        dup_in += sim.duplicate_dropped
        dup_out += any(n > 1 for n in sim.external_sends.values())
        done = [sim.done.get(r) for r in sim.recipients]
        if all(d is not None for d in done):
            state = "delivered" if all(ok for _, ok in done) else "failed"  # type: ignore[misc]
            last = max(when for when, _ in done)  # type: ignore[misc]
            # The analyzer's end of the logs is the last row written.
            if sim.stale_shadow and last < journal.last_written - s.grace:
                stale += 1
        else:
            live = sum(1 for c in sim.copies if c.taken <= end < c.released and cluster.alive(c.node, end))
            state = ("in flight protected" if live >= 2 else "in flight unprotected" if live == 1
                     else "lost")
        states[state] += 1
    return {
        "messages": len(sims), "received": received, "redundant": redundant,
        "states": states, "lost": states["lost"], "unprotected": unprotected, "promoted": promoted,
        "promotions": promotions,
        "duplicates": {"inside_boundary": dup_in, "outside_boundary": dup_out},
        "stale_shadows": stale, "grace_seconds": s.grace,
        "deaths": [{"node": n, "time": journal.stamp(t)} for n, t in sorted(cluster.death.items())],
        "log_end": journal.stamp(end), "nodes": cluster.names, "seed": s.seed,
        "heartbeat_seconds": s.heartbeat, "resubmit_span_seconds": s.resubmit_span,
    }


def generate(out: str | os.PathLike[str], messages: int, nodes: int = 3, seed: int = 1,
             **options: Any) -> dict[str, Any]:
    """Write the logs under ``out/<node>/msgtrk/`` and ``out/truth.json``; returns the truth."""
    settings = Settings(messages=messages, nodes=nodes, seed=seed, **options)
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    return Generator(settings, directory).run()
