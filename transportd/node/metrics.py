"""Prometheus metrics of one node: counters moved by events, gauges read from the queue database.

It owns the node's metric registry (a private CollectorRegistry, so several nodes
in one process never share counters), the mapping from message tracking events to
counters (a counter moves only after the commit its tracking row describes), the
standard process, platform and GC collectors, the receive connectors' open sessions,
and a collector that reads per-queue lengths, oldest message ages and suspended flags
(the ``queue`` label capped at ``metrics.max_queue_series``, the rest summed up as
``other``), shadow queues, heartbeat state per primary, the Poison queue and the Safety
Net at scrape time through the queue layer's grouped queries (``queue.admin.queue_gauges``),
so nothing is counted per message. It never runs SQL of its own.
The HTTP endpoint is served only when ``metrics.listen`` is set (a bare port binds
127.0.0.1). Metric names and meanings: docs/operations.md.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily

from transportd.queue.admin import queue_gauges
from transportd.queue.messages import NOT_REDUNDANT, PARTIAL

log = logging.getLogger("transportd.node.metrics")

# Tracking event -> (counter, label value). Every event is one message (a group of its recipients).
# A queue identity's prefix -> the delivery_type label of delivery attempts.
DELIVERY_TYPES = {"mailbox": "mailbox", "peer": "peer", "smarthost": "smtp", "dns": "smtp"}
OTHER_QUEUES = "other"  # the queue label of the queues beyond metrics.max_queue_series
DELIVERED_EVENTS = {"DELIVER": "mailbox", "DUPLICATEDELIVER": "mailbox_duplicate", "SEND": "peer",
                    "SENDEXTERNAL": "smtp"}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)


class NodeMetrics:
    def __init__(self, node_name: str, max_queue_series: int = 50):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.max_queue_series = max_queue_series
        # The standard collectors (process_*, python_info, python_gc_*), on this node's registry.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.connections = ConnectionCollector()
        r.register(self.connections)
        self.received = Counter("transportd_messages_received", "messages accepted (250) on a receive connector",
                                ["connector"], registry=r)
        self.delivered = Counter("transportd_messages_delivered",
                                 "messages delivered (per next-hop attempt): mailbox, peer or SMTP",
                                 ["delivery_type"], registry=r)
        self.attempts = Counter("transportd_delivery_attempts",
                                "delivery attempts of a message at a next hop by result (delivered, deferred: 4xx or "
                                "no connection, failed: 5xx, expired) and delivery type (mailbox, peer, smtp)",
                                ["result", "delivery_type"], registry=r)
        self.unprotected = Counter("transportd_messages_accepted_without_shadow",
                                   "messages acknowledged although no shadow copy could be made (HAREDIRECTFAIL)",
                                   registry=r)
        self.shadows_received = Counter("transportd_shadow_copies_received",
                                        "shadow copies stored for a primary peer (HARECEIVE)", registry=r)
        self.heartbeat_failures = Counter("transportd_heartbeat_failures",
                                          "failed XSHADOW/XQDISCARD heartbeats to a primary", ["primary"],
                                          registry=r)
        self.promotions = Counter("transportd_promotions", "shadow messages promoted to primary",
                                  ["primary", "reason"], registry=r)
        self.internal_failures = Counter("transportd_message_internal_failures",
                                         "internal errors while handling one message, by step (deliver, dsn, "
                                         "shadow, reshadow, promote, discard, resubmit, expire, crash)",
                                         ["step"], registry=r)
        self.poisoned = Counter("transportd_poison_messages",
                                "messages moved to the Poison queue (PoisonThreshold internal failures)",
                                registry=r)
        self.scheduler_passes = Counter("transportd_scheduler_passes",
                                        "delivery scheduler passes completed (maintenance due, due work read and "
                                        "handed out): a counter that stops moving is a stuck scheduler",
                                        registry=r)
        self.worker_restarts = Counter("transportd_receive_worker_restarts",
                                       "receive worker processes (frontend.workers) that died and were started again",
                                       registry=r)
        self.accept_latency = Histogram("transportd_accept_latency_seconds",
                                        "end of DATA to the 250: durable commit and shadow copy",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.acknowledgement_delay = Histogram(
            "transportd_acknowledgement_delay_seconds",
            "shadow redundancy 2010: end of DATA to the held 250, by why it went (Delivered, QueueRetry, "
            "QueueSuspended, QueueLength, MaxAcknowledgementDelay)", ["reason"], buckets=LATENCY_BUCKETS, registry=r)
        self.delivery_latency = Histogram("transportd_delivery_latency_seconds",
                                          "receipt to successful delivery of a message at a next hop",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.server: Any = None

    # ------------------------------------------------------------------ events

    def on_event(self, event_id: str, row: dict, source_context: str = "", queue: str = "") -> None:
        """Move the counters for one tracking event (called after its commit); ``queue``: the
        delivery queue's identity for a delivery attempt (DEFER, FAIL)."""
        if event_id == "RECEIVE":
            self.received.labels(source_context or "frontend").inc()
        elif event_id in DELIVERED_EVENTS:
            kind = DELIVERED_EVENTS[event_id]
            self.delivered.labels(kind).inc()
            self.attempts.labels("delivered", kind.removesuffix("_duplicate")).inc()
            if row.get("received_at"):
                self.delivery_latency.observe(max(0.0, time.time() - row["received_at"]))
        elif event_id == "DEFER":
            self.attempts.labels("deferred", delivery_type_of(queue)).inc()
        elif event_id == "FAIL":
            result = "expired" if source_context == "MessageExpired" else "failed"
            self.attempts.labels(result, delivery_type_of(queue)).inc()
        elif event_id == "HAREDIRECTFAIL":
            self.unprotected.inc()
        elif event_id == "HARECEIVE":
            self.shadows_received.inc()

    # ------------------------------------------------------------------ scrape-time gauges

    def watch_store(self, store: Any) -> None:
        self.registry.register(QueueDatabaseCollector(store, self.max_queue_series))

    def watch_connections(self, connector: str, counter: Any) -> None:
        """Open sessions of a receive connector against its limit (a ``ConnectionCounter``)."""
        self.connections.counters[connector] = counter

    def serve(self, listen: str) -> None:
        """Serve /metrics on ``host:port`` (a thread of this process)."""
        from prometheus_client import start_http_server
        host, _, port = listen.rpartition(":")
        self.server, _thread = start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
        log.info("Prometheus metrics on http://%s/metrics", listen)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def delivery_type_of(queue: str) -> str:
    """The delivery_type label of a queue identity (``dns:example.org`` -> smtp); ``none`` without one."""
    return DELIVERY_TYPES.get(queue.partition(":")[0], "none") if queue else "none"


def labelled_queues(sizes: dict[str, int], suspended: set[str], limit: int) -> set[str]:
    """The queues that keep their own ``queue`` label: the ``limit`` fullest (suspended ones first
    among equals, then by name, so the choice is stable between scrapes); the rest are ``other``."""
    ranked = sorted(set(sizes) | suspended, key=lambda q: (-sizes.get(q, 0), q not in suspended, q))
    return set(ranked[:limit])


class ConnectionCollector:
    """Open sessions of each receive connector and its limit, read at scrape time."""

    def __init__(self) -> None:
        self.counters: dict[str, Any] = {}

    def describe(self):
        return []

    def collect(self):
        open_ = GaugeMetricFamily("transportd_connections_open", "open SMTP sessions on a receive connector",
                                  labels=["connector"])
        limit = GaugeMetricFamily("transportd_connections_limit",
                                  "the most sessions a receive connector accepts at once (MaxInboundConnection)",
                                  labels=["connector"])
        for name, counter in sorted(self.counters.items()):
            open_.add_metric([name], counter.total)
            limit.add_metric([name], counter.limit)
        yield from (open_, limit)


class QueueDatabaseCollector:
    """Gauges computed from the queue database when /metrics is scraped."""

    def __init__(self, store: Any, max_queue_series: int = 50):
        self.store = store
        self.max_queue_series = max_queue_series

    def describe(self):
        return []

    def collect(self):
        up = GaugeMetricFamily("transportd_queue_database_up",
                               "1 when the queue database could be read for this scrape")
        try:
            rows = self.store.read(queue_gauges)
        except Exception as exc:  # noqa: BLE001 - a scrape must never fail the node
            log.warning("metrics: cannot read the queue database: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        now = time.time()
        yield from self.queue_families(rows, now)
        shadow_len = GaugeMetricFamily("transportd_shadow_queue_messages",
                                       "shadow copies held for a primary peer", labels=["primary"])
        for primary, n in rows["shadows"]:
            shadow_len.add_metric([primary or ""], n)
        safety_net = GaugeMetricFamily("transportd_safety_net_messages",
                                       "messages held in the Safety Net (primary) or Shadow Safety Net (shadow)",
                                       labels=["net"])
        nets = dict(rows["safety_net"])
        for net in ("primary", "shadow"):
            safety_net.add_metric([net], nets.get(net, 0))
        not_redundant = GaugeMetricFamily(
            "transportd_messages_not_redundant",
            "queued messages less redundant than configured. No shadow on any peer: reshadowing (promoted, or "
            "their shadow node lost its database) or unprotected (accepted without one; retried every "
            "heartbeat); partial: a shadow on a peer, but fewer than shadow_copies (N-way; the missing ones "
            "retried every heartbeat)", labels=["state"])
        exposed = dict(rows["not_redundant"])
        for state in (*NOT_REDUNDANT, PARTIAL):
            not_redundant.add_metric([state], exposed.get(state, 0))
        poison_len = GaugeMetricFamily("transportd_poison_queue_length",
                                       "messages held in the Poison queue (primary and shadow copies)")
        poison_len.add_metric([], rows["poison"])
        poison_age = GaugeMetricFamily("transportd_poison_queue_oldest_message_age_seconds",
                                       "age of the oldest message held in the Poison queue; 0 when empty")
        poison_age.add_metric([], max(0.0, now - rows["poison_oldest"]) if rows["poison_oldest"] else 0.0)
        last_ok = GaugeMetricFamily("transportd_shadow_heartbeat_last_success_timestamp_seconds",
                                    "when this node last completed a heartbeat (XQDISCARD) with a primary it "
                                    "shadows for (Unix time; 0 = never)", labels=["primary"])
        failures = GaugeMetricFamily("transportd_shadow_heartbeat_consecutive_failures",
                                     "failed heartbeats to a primary since its last successful one",
                                     labels=["primary"])
        for primary, at, n in rows["contexts"]:
            last_ok.add_metric([primary], at or 0.0)
            failures.add_metric([primary], n or 0)
        up.add_metric([], 1)
        yield from (shadow_len, safety_net, not_redundant, poison_len, poison_age, last_ok, failures, up)

    def queue_families(self, rows: dict, now: float):
        """Per delivery queue: messages by state, the oldest message's age, suspended. Only the
        ``max_queue_series`` fullest queues keep their name; the others are summed up as ``other``
        (messages added, the oldest age the largest, suspended the number of suspended queues)."""
        queue_len = GaugeMetricFamily("transportd_queue_messages",
                                      "messages in a delivery queue by recipient state (Ready, Retry, Active; Suspended: held by an operator)",
                                      labels=["queue", "state"])
        age = GaugeMetricFamily("transportd_queue_oldest_message_age_seconds",
                                "age of the oldest message waiting in a delivery queue (since it was received)",
                                labels=["queue"])
        suspended = GaugeMetricFamily("transportd_queue_suspended",
                                      "1 when an operator suspended the queue (queue suspend); for queue=\"other\" "
                                      "the number of suspended queues summed up there", labels=["queue"])
        sizes: dict[str, int] = {}
        for identity, _state, n in rows["queues"]:
            sizes[identity] = sizes.get(identity, 0) + n
        held = set(rows["suspended"])
        named = labelled_queues(sizes, held, self.max_queue_series)

        def label(identity: str) -> str:
            return identity if identity in named else OTHER_QUEUES
        by_state: dict[tuple[str, str], int] = {}
        for identity, state, n in rows["queues"]:
            key = (label(identity), state)
            by_state[key] = by_state.get(key, 0) + n
        for (queue, state), n in sorted(by_state.items()):
            queue_len.add_metric([queue, state], n)
        oldest: dict[str, float] = {}
        for identity, received_at in rows["oldest"]:
            queue = label(identity)
            oldest[queue] = min(oldest.get(queue, received_at), received_at)
        for queue, received_at in sorted(oldest.items()):
            age.add_metric([queue], max(0.0, now - received_at))
        flags: dict[str, int] = {q: 0 for q in named}
        for identity in held:
            flags[label(identity)] = flags.get(label(identity), 0) + 1
        for queue, n in sorted(flags.items()):
            suspended.add_metric([queue], n)
        return queue_len, age, suspended
