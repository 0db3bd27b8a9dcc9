"""Prometheus metrics: scrape /metrics over HTTP from real nodes while real mail (swaks) flows.

Counters must move with the traffic (received, delivered by delivery type, deferred, latency
histograms), the scrape-time gauges must show the queue database (queue length by queue and
state, Safety Net size, shadow queue length per primary), and on a cluster the shadow node must
count failed heartbeats and the promotion of a dead primary's shadows. Debian's prometheus, when
installed, scrapes a node for real.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from conftest import free_port, queued_id, swaks, wait_for
from helpers import scrape, scrape_until, value


def metrics_node(make_node, sink_address: str, **overrides):
    port = free_port()
    node = make_node(smart_host=sink_address, overrides={"metrics": {"listen": f"127.0.0.1:{port}"}, **overrides})
    node.metrics_port = port
    return node


def test_counters_and_histograms_move_with_real_traffic(make_node, sink):
    sink.start()
    node = metrics_node(make_node, sink.address).start()
    before = scrape("127.0.0.1", node.metrics_port)
    assert value(before, "transportd_messages_received_total", connector="frontend") == 0
    assert value(before, "transportd_queue_database_up") == 1

    for to in ("alice@example.test", "bob@example.test", "carol@elsewhere.test"):
        queued_id(swaks(node.port, "--to", to, "--from", "zed@example.test"))

    def delivered(s):
        return (value(s, "transportd_messages_delivered_total", delivery_type="mailbox") == 2
                and value(s, "transportd_messages_delivered_total", delivery_type="smtp") == 1)
    after = scrape_until("127.0.0.1", node.metrics_port, delivered, "three deliveries counted")
    assert value(after, "transportd_messages_received_total", connector="frontend") == 3
    assert value(after, "transportd_accept_latency_seconds_count") == 3
    assert value(after, "transportd_accept_latency_seconds_sum") > 0
    assert value(after, "transportd_delivery_latency_seconds_count") == 3
    assert value(after, "transportd_delivery_attempts_total", result="delivered", delivery_type="mailbox") == 2
    assert value(after, "transportd_delivery_attempts_total", result="delivered", delivery_type="smtp") == 1
    assert not [k for k in after if k[0] == "transportd_delivery_attempts_total"
                and dict(k[1])["result"] != "delivered" and after[k]]
    # Shadow redundancy is off on this node: nothing was accepted "without a shadow".
    assert value(after, "transportd_messages_accepted_without_shadow_total") == 0
    # Delivered messages sit in the Primary Safety Net; no queue holds anything. (The delivery
    # counters move with the tracking rows, just before the commit that records the deliveries:
    # the queue gauges are read once that commit is in.)
    nets = scrape_until("127.0.0.1", node.metrics_port,
                        lambda s: value(s, "transportd_safety_net_messages", net="primary") == 3,
                        "three messages in the Safety Net")
    assert not [k for k in nets if k[0] == "transportd_queue_messages" and nets[k]]
    assert len(sink.messages()) == 1


def test_deferred_message_shows_in_queue_gauge_until_the_next_hop_returns(make_node, sink):
    node = metrics_node(make_node, sink.address).start()  # the sink is not started yet
    queued_id(swaks(node.port, "--to", "carol@elsewhere.test", "--from", "zed@example.test"))
    queue = f"smarthost:{sink.address}"
    s = scrape_until("127.0.0.1", node.metrics_port,
                     lambda s: value(s, "transportd_delivery_attempts_total", result="deferred",
                                     delivery_type="smtp") >= 1, "a deferral counted")
    assert value(s, "transportd_queue_messages", queue=queue, state="Retry") + \
        value(s, "transportd_queue_messages", queue=queue, state="Active") == 1
    # A message the operator holds counts as Suspended, not as waiting to go.
    held = queued_id(swaks(node.port, "--to", "dave@elsewhere.test", "--from", "zed@example.test"))
    node.cli("message", "suspend", str(held))
    s = scrape_until("127.0.0.1", node.metrics_port,
                     lambda s: value(s, "transportd_queue_messages", queue=queue, state="Suspended") == 1,
                     "the held message counted as Suspended")
    assert value(s, "transportd_queue_messages", queue=queue, state="Retry") + \
        value(s, "transportd_queue_messages", queue=queue, state="Active") + \
        value(s, "transportd_queue_messages", queue=queue, state="Ready") == 1
    node.cli("message", "resume", str(held))
    sink.start()
    # (the counters move just before the commit that records the deliveries: the queues empty with it)
    s = scrape_until("127.0.0.1", node.metrics_port,
                     lambda s: value(s, "transportd_messages_delivered_total", delivery_type="smtp") == 2
                     and sum(v for k, v in s.items() if k[0] == "transportd_queue_messages") == 0,
                     "the deliveries counted and the queue empty")
    assert value(s, "transportd_delivery_latency_seconds_count") == 2


def test_mail_waiting_for_its_queues_next_retry_counts_as_retry_as_message_list_shows_it(make_node, sink):
    """The next hop is down and its queue in Retry for 10 minutes: a message that arrives meanwhile
    waits for the queue's retry, untried. message list (and --filter state=deferred) show it as
    Retry; the gauge counts it so too (it counted it Ready, so an alert on Retry missed all but
    the one message tried)."""
    slow = {"transient_failure_retry_interval": 600, "outbound_connection_failure_retry_interval": 600}
    node = metrics_node(make_node, sink.address, delivery=slow).start()  # the sink is not started
    queue = f"smarthost:{sink.address}"
    queued_id(swaks(node.port, "--to", "carol@elsewhere.test", "--from", "zed@example.test"))
    scrape_until("127.0.0.1", node.metrics_port,
                 lambda s: value(s, "transportd_delivery_attempts_total", result="deferred", delivery_type="smtp") >= 1,
                 "a deferral counted")
    queued_id(swaks(node.port, "--to", "dave@elsewhere.test", "--from", "zed@example.test"))
    listed = {m["status"] for m in node.cli_json("message", "list")}
    s = scrape("127.0.0.1", node.metrics_port)
    assert listed == {"Retry"}
    assert value(s, "transportd_queue_messages", queue=queue, state="Retry") == 2
    assert value(s, "transportd_queue_messages", queue=queue, state="Ready") == 0


def test_metrics_are_off_by_default_and_a_bare_port_binds_loopback(make_node, tmp_path):
    from transportd import config as config_mod
    cfg = config_mod.load_dict({"metrics": {"listen": "9101"}})
    assert cfg.metrics.listen == "127.0.0.1:9101"
    assert config_mod.load_dict({}).metrics.listen == ""
    with pytest.raises(config_mod.ConfigError, match=r"metrics\.listen"):
        config_mod.load_dict({"metrics": {"listen": "127.0.0.1:99999"}})
    node = make_node(overrides={"metrics": {"listen": ""}}).start()  # the test nodes serve metrics by default
    assert "Prometheus metrics" not in node.log()


def test_bad_metrics_address_is_a_startup_error_naming_the_key(make_node):
    node = make_node(overrides={"metrics": {"listen": "localhost:x"}})
    res = node.cli("config", "show", check=False)
    assert res.returncode == 2
    assert "metrics.listen" in res.stderr


def test_metrics_port_taken_means_the_node_does_not_start(make_node):
    taken = make_node("first", overrides={"metrics": {"listen": f"127.0.0.1:{free_port()}"}}).start()
    port = taken.sections["metrics"]["listen"].rpartition(":")[2]
    second = make_node("second", overrides={"metrics": {"listen": f"127.0.0.1:{port}"}})
    second.start(wait=False)
    assert second.proc.wait(timeout=20) == 1
    assert f"cannot start: metrics.listen 127.0.0.1:{port}: cannot listen: Address already in use" in second.log()
    assert taken.alive


@pytest.mark.slow
def test_shadow_node_counts_heartbeat_failures_and_promotions(procs, sink, tmp_path):
    from clusters import LocalCluster, accepted_with_shadow, send

    c = LocalCluster(procs, sink, tmp_path, {"shadow_redundancy": {
        "shadow_heartbeat_frequency": 0.5, "shadow_resubmit_time_span": 2}})
    ports = {}
    for short, n in c.nodes.items():
        ports[short] = free_port(n.host)
        with open(n.spec.config, "a") as f:
            f.write(f'\n[metrics]\nlisten = "{n.host}:{ports[short]}"\n')
    c.start()
    n1, n3 = c["node1"], c["node3"]
    netid = accepted_with_shadow(n1, n3, send(n1, "carol@foreign.test"))
    n1.wait_event("DEFER", netid)  # the sink is down: node1 keeps it queued
    s3 = scrape(n3.host, ports["node3"])
    assert value(s3, "transportd_shadow_queue_messages", primary=n1.name) == 1
    assert value(s3, "transportd_shadow_copies_received_total") == 1
    assert value(scrape(n1.host, ports["node1"]), "transportd_delivery_attempts_total", result="deferred",
                 delivery_type="smtp") >= 1

    s3 = scrape_until(n3.host, ports["node3"], lambda s: value(
        s, "transportd_shadow_heartbeat_last_success_timestamp_seconds", primary=n1.name) > 0, "a heartbeat")
    assert value(s3, "transportd_shadow_heartbeat_consecutive_failures", primary=n1.name) == 0

    n1.kill9()
    killed = time.time()
    promoted = {"primary": n1.name, "reason": "ShadowHeartbeatFailure"}
    s3 = scrape_until(n3.host, ports["node3"],
                      lambda s: value(s, "transportd_shadow_heartbeat_consecutive_failures", primary=n1.name) >= 2
                      or value(s, "transportd_promotions_total", **promoted),
                      "failed heartbeats to the dead primary", timeout=20)
    if not value(s3, "transportd_promotions_total", **promoted):  # seen before the promotion reset the count
        assert value(s3, "transportd_shadow_heartbeat_last_success_timestamp_seconds", primary=n1.name) < killed
    sink.start()
    n3.wait_event("RESUBMIT", netid, timeout=20)
    s3 = scrape_until(n3.host, ports["node3"],
                      lambda s: value(s, "transportd_messages_delivered_total", delivery_type="smtp") == 1,
                      "node3 delivering the promoted copy")
    assert value(s3, "transportd_heartbeat_failures_total", primary=n1.name) >= 4
    assert value(s3, "transportd_promotions_total", primary=n1.name, reason="ShadowHeartbeatFailure") == 1
    assert value(s3, "transportd_shadow_queue_messages", primary=n1.name) == 0


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed")
def test_debian_prometheus_scrapes_the_node(make_node, sink, procs, tmp_path):
    sink.start()
    node = metrics_node(make_node, sink.address).start()
    web = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: transportd\n    static_configs:\n"
        f"      - targets: [\"127.0.0.1:{node.metrics_port}\"]\n")
    with open(tmp_path / "prometheus.log", "ab") as log:
        procs.add(subprocess.Popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    def query(expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{web}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return json.loads(resp.read())["data"]["result"]
        except OSError:
            return []
    queued_id(swaks(node.port, "--to", "alice@example.test", "--from", "zed@example.test"))
    result = wait_for(lambda: query('transportd_messages_received_total{connector="frontend"} >= 1'),
                      timeout=30, interval=0.5, what="Prometheus to scrape the received counter")
    assert result[0]["metric"]["job"] == "transportd"
    assert query('up{job="transportd"}')[0]["value"][1] == "1"
    wait_for(lambda: query('transportd_messages_delivered_total{delivery_type="mailbox"} >= 1'),
             timeout=30, interval=0.5, what="Prometheus to see the delivery")


def test_operator_gauges_queue_age_suspended_connections_and_standard_collectors(make_node, sink):
    """What an on-call operator alerts on: the oldest message's age per queue, a suspended queue,
    open sessions against the connector's limit; and the standard process/platform/GC series."""
    import socket
    node = metrics_node(make_node, sink.address).start()  # the sink stays down: the message waits
    queue = f"smarthost:{sink.address}"
    queued_id(swaks(node.port, "--to", "carol@elsewhere.test", "--from", "zed@example.test"))
    first = scrape_until("127.0.0.1", node.metrics_port,
                         lambda s: value(s, "transportd_queue_oldest_message_age_seconds", queue=queue) > 0,
                         "the queue's oldest message age")
    age = value(first, "transportd_queue_oldest_message_age_seconds", queue=queue)
    assert age < 60
    scrape_until("127.0.0.1", node.metrics_port,
                 lambda s: value(s, "transportd_queue_oldest_message_age_seconds", queue=queue) >= age + 1,
                 "the age to grow with time")
    assert value(first, "transportd_queue_suspended", queue=queue) == 0
    assert value(first, "transportd_connections_limit", connector="frontend") == 5000  # MaxInboundConnection
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "python_info"):
        assert any(k[0] == name for k in first), name
    assert any(k[0] == "python_gc_objects_collected_total" for k in first)

    node.cli("queue", "suspend", queue)
    s = scrape_until("127.0.0.1", node.metrics_port,
                     lambda s: value(s, "transportd_queue_suspended", queue=queue) == 1, "the queue suspended")
    assert value(s, "transportd_queue_oldest_message_age_seconds", queue=queue) > age  # still waiting
    node.cli("queue", "resume", queue)
    scrape_until("127.0.0.1", node.metrics_port,
                 lambda s: value(s, "transportd_queue_suspended", queue=queue) == 0, "the queue resumed")

    held = [socket.create_connection(("127.0.0.1", node.port), timeout=5) for _ in range(3)]
    try:
        for c in held:
            assert c.recv(100).startswith(b"220")
        scrape_until("127.0.0.1", node.metrics_port,
                     lambda s: value(s, "transportd_connections_open", connector="frontend") == 3,
                     "three open frontend sessions")
    finally:
        for c in held:
            c.close()
    scrape_until("127.0.0.1", node.metrics_port,
                 lambda s: value(s, "transportd_connections_open", connector="frontend") == 0, "sessions closed")


def test_queue_label_is_capped_the_rest_summed_as_other(tmp_path):
    """metrics.max_queue_series: with one queue per destination domain (MX routing) the queue label
    would grow without bound; the fullest N keep their name, the rest are summed up as "other".
    The collector runs its real queries on a real queue database."""
    import time

    from transportd.node.metrics import QueueDatabaseCollector
    from transportd.queue import messages as mq
    from transportd.queue.routing import NextHop
    from transportd.queue.store import QueueStore

    store = QueueStore.open(tmp_path / "queue.db", create=True, repair=False, node_name="n.test")
    now = time.time()
    try:
        def fill(conn):
            for d in range(10):  # domain d holds d + 1 messages, the oldest received d hours ago
                hop = NextHop(f"dns:d{d}.test", "DnsConnectorDelivery", f"d{d}.test")
                for i in range(d + 1):
                    mq.enqueue(conn, mq.NewMessage(network_message_id=f"{d}-{i}", sender="a@x.test", data=b"x",
                                                   recipients={hop: [f"r{i}@d{d}.test"]},
                                                   received_at=now - 3600 * d + i, expires_at=now + 86400))
            mq.set_queue_suspended(conn, mq.resolve_queue(conn, "dns:d0.test")["id"], True)
        store.transaction(fill)
        families = {f.name: f for f in QueueDatabaseCollector(store, max_queue_series=3).collect()}
    finally:
        store.close()
    sizes = {s.labels["queue"]: s.value for s in families["transportd_queue_messages"].samples}
    assert sizes == {"dns:d9.test": 10, "dns:d8.test": 9, "dns:d7.test": 8, "other": sum(range(1, 8))}
    ages = {s.labels["queue"]: s.value for s in families["transportd_queue_oldest_message_age_seconds"].samples}
    assert set(ages) == set(sizes)
    assert 6 * 3600 - 60 < ages["other"] <= 6 * 3600 + 60  # the oldest of d0..d6 (d6, received 6 h ago)
    assert 9 * 3600 - 60 < ages["dns:d9.test"] <= 9 * 3600 + 60
    flags = {s.labels["queue"]: s.value for s in families["transportd_queue_suspended"].samples}
    assert flags == {"dns:d9.test": 0, "dns:d8.test": 0, "dns:d7.test": 0, "other": 1}  # d0 is in "other"


# The labels whose values are a fixed set the operator alerts on (not queue or peer names).
ENUMERATED_LABELS = ("state", "net", "connector")


def test_every_exported_metric_and_its_states_are_in_the_operations_guide(make_node, sink):
    """docs/operations.md's metrics table names every transportd_ metric a node exports (from the
    exposition's ``# HELP`` lines: a labelled metric with no sample yet, such as a histogram by
    reason, is exported with no series, so a check of the samples alone misses it), and in its
    row every value of an enumerated label the node exports (the ``state`` of
    transportd_messages_not_redundant: ``partial`` too)."""
    import re
    from pathlib import Path
    node = metrics_node(make_node, sink.address).start()
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    # prometheus-client also exports a counter's or histogram's creation time as <name>_created.
    exported = {m.group(1) for m in re.finditer(r"^# HELP (transportd_\w+)", text, re.MULTILINE)
                if not m.group(1).endswith("_created")}
    assert {"transportd_acknowledgement_delay_seconds", "transportd_receive_worker_restarts_total",
            "transportd_messages_not_redundant"} <= exported, sorted(exported)
    guide = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    rows = {name: line for line in guide.splitlines() if line.startswith("| `transportd_")
            for name in re.findall(r"`(transportd_\w+)`", line.split("|")[1])}
    assert not exported - set(rows), f"exported but not in docs/operations.md: {sorted(exported - set(rows))}"
    for name, labels in scrape("127.0.0.1", node.metrics_port):
        base = re.sub(r"_(total|bucket|sum|count|created)$", "", name)
        row = rows.get(name) or rows.get(base) or rows.get(base + "_total")
        if row is None:
            continue
        for label, val in labels:
            if label in ENUMERATED_LABELS:
                assert f"`{val}`" in row, f"{name}{{{label}={val!r}}} not in its docs/operations.md row: {row}"
