"""Prometheus metrics of one node: counters moved by events, gauges read from the queue database.

It owns the node's metric registry (a private CollectorRegistry, so several nodes
in one process never share counters), the mapping from message tracking events to
counters (a counter moves only after the commit its tracking row describes), and a
collector that reads queue lengths, shadow queue lengths and the Safety Net size at
scrape time through the queue layer's grouped COUNT queries (``queue.admin.queue_gauges``),
so nothing is counted per message. It never runs SQL of its own.
The HTTP endpoint is served only when ``metrics.listen`` is set (a bare port binds
127.0.0.1). Metric names and meanings: docs/operations.md.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from transportd.queue.admin import queue_gauges
from transportd.queue.messages import NOT_REDUNDANT

log = logging.getLogger("transportd.node.metrics")

# Tracking event -> (counter, label value). Every event is one message (a group of its recipients).
DELIVERED_EVENTS = {"DELIVER": "mailbox", "DUPLICATEDELIVER": "mailbox_duplicate", "SEND": "peer",
                    "SENDEXTERNAL": "smtp"}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)


class NodeMetrics:
    def __init__(self, node_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.received = Counter("transportd_messages_received", "messages accepted (250) on a receive connector",
                                ["connector"], registry=r)
        self.delivered = Counter("transportd_messages_delivered",
                                 "messages delivered (per next-hop attempt): mailbox, peer or SMTP",
                                 ["delivery_type"], registry=r)
        self.deferred = Counter("transportd_messages_deferred", "delivery attempts deferred (4xx or no connection)",
                                registry=r)
        self.failed = Counter("transportd_messages_failed", "messages failed (5xx or expired) for some recipients",
                              registry=r)
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
        self.accept_latency = Histogram("transportd_accept_latency_seconds",
                                        "end of DATA to the 250: durable commit and shadow copy",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.delivery_latency = Histogram("transportd_delivery_latency_seconds",
                                          "receipt to successful delivery of a message at a next hop",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.server: Any = None

    # ------------------------------------------------------------------ events

    def on_event(self, event_id: str, row: dict, source_context: str = "") -> None:
        """Move the counters for one tracking event (called after its commit)."""
        if event_id == "RECEIVE":
            self.received.labels(source_context or "frontend").inc()
        elif event_id in DELIVERED_EVENTS:
            self.delivered.labels(DELIVERED_EVENTS[event_id]).inc()
            if row.get("received_at"):
                self.delivery_latency.observe(max(0.0, time.time() - row["received_at"]))
        elif event_id == "DEFER":
            self.deferred.inc()
        elif event_id == "FAIL":
            self.failed.inc()
        elif event_id == "HAREDIRECTFAIL":
            self.unprotected.inc()
        elif event_id == "HARECEIVE":
            self.shadows_received.inc()

    # ------------------------------------------------------------------ scrape-time gauges

    def watch_store(self, store: Any) -> None:
        self.registry.register(QueueDatabaseCollector(store))

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


class QueueDatabaseCollector:
    """Gauges computed from the queue database when /metrics is scraped."""

    def __init__(self, store: Any):
        self.store = store

    def describe(self):
        return []

    def collect(self):
        queue_len = GaugeMetricFamily("transportd_queue_messages",
                                      "messages in a delivery queue by recipient state (Ready, Retry, Active)",
                                      labels=["queue", "state"])
        shadow_len = GaugeMetricFamily("transportd_shadow_queue_messages",
                                       "shadow copies held for a primary peer", labels=["primary"])
        safety_net = GaugeMetricFamily("transportd_safety_net_messages",
                                       "messages held in the Safety Net (primary) or Shadow Safety Net (shadow)",
                                       labels=["net"])
        not_redundant = GaugeMetricFamily(
            "transportd_messages_not_redundant",
            "queued messages without a shadow on a peer: reshadowing (promoted, or their shadow node lost "
            "its database) or unprotected (accepted without one; retried every heartbeat)", labels=["state"])
        up = GaugeMetricFamily("transportd_queue_database_up",
                               "1 when the queue database could be read for this scrape")
        try:
            rows = self.store.read(queue_gauges)
        except Exception as exc:  # noqa: BLE001 - a scrape must never fail the node
            log.warning("metrics: cannot read the queue database: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        for identity, state, n in rows["queues"]:
            queue_len.add_metric([identity, state], n)
        for primary, n in rows["shadows"]:
            shadow_len.add_metric([primary or ""], n)
        nets = dict(rows["safety_net"])
        for net in ("primary", "shadow"):
            safety_net.add_metric([net], nets.get(net, 0))
        poison_len = GaugeMetricFamily("transportd_poison_queue_length",
                                       "messages held in the Poison queue (primary and shadow copies)")
        poison_len.add_metric([], rows["poison"])
        exposed = dict(rows["not_redundant"])
        for state in NOT_REDUNDANT:
            not_redundant.add_metric([state], exposed.get(state, 0))
        up.add_metric([], 1)
        yield from (queue_len, shadow_len, safety_net, not_redundant, poison_len, up)

