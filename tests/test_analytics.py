"""Tracking-log analytics (transportd/analytics, `transportd analyze`): the Spark job end to end.

1. crafted logs of all three Exchange formats (2010: 26 fields, 2013: 27, 2016: 30), with and
   without header and BOM, CRLF and LF, quoted fields holding commas and quotes, lists joined
   with ``;``, malformed rows counted and never fatal;
2. crafted journeys: each final state and anomaly decided from the logs alone;
3. generated logs: every injected fact found exactly (the truth file);
4. report.html opened in headless Chromium, offline: every chart rendered.

Real clusters analyzed and the scale benchmark are in tests/test_analytics_processes.py (a file of
their own: the test run's processes share the files out, and these are the longest).

One SparkSession (local[2]) serves the module; the CLI runs in its own processes.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("pyspark")

from transportd.analytics import job
from transportd.analytics.generate import generate
from transportd.tracking import FIELDS_2010, FIELDS_2013, FIELDS_2016, TrackingLog

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def spark():
    session = job.spark_session("local[2]", conf={"spark.sql.shuffle.partitions": "4"})
    yield session
    session.stop()


def csv_rows(fields: tuple[str, ...], rows: list[dict[str, str]], newline: str) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator=newline)
    for row in rows:
        writer.writerow([row.get(f, "") for f in fields])
    return buf.getvalue()


def write_log(path: Path, fields: tuple[str, ...], rows: list[dict[str, str]], *, header: bool, bom: bool,
              newline: str, extra: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = ""
    if header:
        text += newline.join(("#Software: Microsoft Exchange Server", "#Version: 15.0.0.0",
                              "#Log-type: Message Tracking Log", "#Date: 2013-05-01T00:00:00.000Z",
                              "#Fields: " + ",".join(fields))) + newline
    text += csv_rows(fields, rows, newline) + extra
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    return path


def parsed_rows(spark, paths: list[str]) -> list[dict]:
    """Test only: the parsed rows of tiny inputs, collected."""
    df = job.read_events(spark, paths)
    return [r.asDict() for r in df.orderBy("file", "time").collect()]


# ------------------------------------------------------------------------------ 1


def test_all_three_formats_header_or_not_bom_crlf_quotes_and_malformed_rows(spark, tmp_path):
    subject = 'Re: "budget", Q3; final'
    redirect_ctx = 'node3.example=250 2.6.0 <a@b> [InternalId=7, Hostname=node3.example] "Queued"'
    # Exchange 2010: no header, no BOM, LF, 26 fields, no network-message-id, empty server-hostname.
    f2010 = write_log(tmp_path / "ex2010" / "hub-a" / "MSGTRK20100301-1.LOG", FIELDS_2010, [
        {"date-time": "2010-03-01T10:00:00.000Z", "event-id": "RECEIVE", "source": "SMTP",
         "message-id": "<old@x>", "recipient-address": "A@Example.test;b@example.test",
         "message-subject": subject, "internal-message-id": "5"},
        {"date-time": "2010-03-01T10:00:01.500Z", "event-id": "DELIVER", "source": "STOREDRIVER",
         "message-id": "<old@x>", "recipient-address": "a@example.test;b@example.test"},
    ], header=False, bom=False, newline="\n")
    # Exchange 2013: header, BOM, CRLF, 27 fields.
    f2013 = write_log(tmp_path / "ex2013" / "MSGTRK20130501-1.LOG", FIELDS_2013, [
        {"date-time": "2013-05-01T08:00:00.250Z", "event-id": "HAREDIRECT", "source": "SMTP",
         "server-hostname": "NODE1.example", "network-message-id": "AAAA-1", "message-id": "<n@x>",
         "source-context": redirect_ctx, "recipient-address": "c@example.test"},
    ], header=True, bom=True, newline="\r\n")
    # Exchange 2016: no header but a BOM, CRLF, 30 fields; then three malformed rows.
    bad = ('2016-01-01T00:00:00.000Z,"unterminated,quote\r\n'
           "only,three,fields\r\n"
           + "not-a-date" + "," * 29 + "\r\n")
    f2016 = write_log(tmp_path / "ex2016" / "MSGTRK20160101-1.LOG", FIELDS_2016, [
        {"date-time": "2016-01-01T00:00:00.000Z", "event-id": "RESUBMIT", "source": "REDUNDANCY",
         "server-hostname": "node3.example", "network-message-id": "BBBB-2", "message-id": "<m@x>",
         "source-context": "node1.example (ShadowHeartbeatFailure)", "reference": "17",
         "recipient-address": "d@example.test", "log-id": "x", "schema-version": "15.2"},
    ], header=False, bom=True, newline="\r\n", extra=bad)

    rows = parsed_rows(spark, [str(f2010), str(tmp_path / "ex2013"), str(tmp_path / "ex2016" / "MSGTRK*.LOG")])
    good = [r for r in rows if r["valid"]]
    bad_rows = [r for r in rows if not r["valid"]]
    assert len(good) == 4 and len(bad_rows) == 3, rows

    receive, deliver = [r for r in good if r["file"].endswith(f2010.name)]
    assert receive["event"] == "RECEIVE" and deliver["event"] == "DELIVER"
    assert receive["key"] == "<old@x>" and receive["network_message_id"] == ""  # 2010: keyed by message-id
    assert receive["node"] == "hub-a"  # the folder, server-hostname being empty
    assert receive["recipients"] == ["a@example.test", "b@example.test"]
    assert receive["internal_message_id"] == "5"
    assert (deliver["time"] - receive["time"]).total_seconds() == 1.5

    (redirect,) = [r for r in good if r["file"].endswith(f2013.name)]
    assert redirect["node"] == "node1.example" and redirect["key"] == "aaaa-1"
    assert redirect["context"] == redirect_ctx  # commas and doubled quotes kept inside one field
    assert redirect["peer"] == "node3.example"

    (resubmit,) = [r for r in good if r["file"].endswith(f2016.name)]
    assert (resubmit["peer"], resubmit["reason"], resubmit["reference"]) == (
        "node1.example", "ShadowHeartbeatFailure", "17")

    reasons = sorted(r["malformed_reason"] for r in bad_rows)
    assert reasons == ["3 fields and no #Fields header (expected 26, 27 or 30)", "bad date-time",
                       "unbalanced quote or more than 32 fields"], reasons


def test_a_header_decides_the_field_order_and_a_short_row_is_malformed(spark, tmp_path):
    fields = ("event-id", "date-time", "network-message-id", "server-hostname", "recipient-address")
    f = write_log(tmp_path / "custom" / "MSGTRK20200101-1.LOG", fields, [
        {"event-id": "SENDEXTERNAL", "date-time": "2020-01-01T00:00:00Z", "network-message-id": "CCCC",
         "server-hostname": "edge1", "recipient-address": "x@y.test"},
    ], header=True, bom=False, newline="\n", extra="SEND,2020-01-01T00:00:01Z,CCCC\n")
    rows = parsed_rows(spark, [str(f)])
    assert [(r["valid"], r["event"], r["key"], r["node"]) for r in rows if r["valid"]] == [
        (True, "SENDEXTERNAL", "cccc", "edge1")]
    assert [r["malformed_reason"] for r in rows if not r["valid"]] == ["3 fields, #Fields names 5"]


# ------------------------------------------------------------------------------ 2


def crafted_cluster_logs(base: Path) -> dict[str, str]:
    """Logs of node1..node3 (2016 format, written by the daemon's own TrackingLog) with one
    message per final state and anomaly; returns {name: network-message-id}."""
    from datetime import UTC, datetime, timedelta
    t0 = datetime(2026, 11, 22, 3, 0, tzinfo=UTC)
    logs = {n: TrackingLog(base / n / "msgtrk", f"{n}.test", clock=lambda: t0) for n in ("node1", "node2", "node3")}
    ids = {name: f"{i:08x}-0000-4000-8000-000000000000" for i, name in enumerate((
        "delivered", "lost", "promoted", "duplicate", "dropped_dup", "protected", "unprotected", "stale",
        "failed", "partly", "partly_alone"), start=1)}

    def w(node: str, at: float, event: str, name: str, rcpts=("r@foreign.test",), **kw) -> None:
        source = kw.pop("source", "STOREDRIVER" if event in ("DELIVER", "DUPLICATEDELIVER") else "SMTP")
        logs[node].write(event, source, network_message_id=ids[name], message_id=f"<{name}@x>",
                         recipients=list(rcpts), date_time=t0 + timedelta(seconds=at), **kw)

    def shadowed(primary: str, shadow: str, at: float, name: str, rcpts=("r@foreign.test",)) -> None:
        w(shadow, at - 0.002, "HARECEIVE", name, rcpts, source_context="guid", client_hostname=f"{primary}.test")
        w(primary, at, "RECEIVE", name, rcpts)
        w(primary, at + 0.001, "HAREDIRECT", name, rcpts, source_context=f"{shadow}.test=250 2.6.0 ok, queued")

    shadowed("node1", "node3", 0, "delivered")
    w("node1", 1, "SENDEXTERNAL", "delivered")
    w("node3", 5, "HADISCARD", "delivered", (), source_context="ExplicitlyDiscarded;guid")
    # accepted unprotected on node1, which dies at 30 s: lost
    w("node1", 10, "RECEIVE", "lost")
    w("node1", 10.001, "HAREDIRECTFAIL", "lost", source_context="No suitable shadow servers")
    # shadowed on node3, node1 dies before delivery: promoted, delivered by node3
    shadowed("node1", "node3", 20, "promoted")
    w("node1", 21, "DEFER", "promoted", recipient_status=["451 4.4.1 refused"])
    # delivered by node1 at 25 s but node1 dies before node3 hears of it: delivered twice outside
    shadowed("node1", "node3", 24, "duplicate", ("d1@foreign.test", "d2@foreign.test"))
    w("node1", 25, "SENDEXTERNAL", "duplicate", ("d1@foreign.test", "d2@foreign.test"))
    # mailbox mail: node1 delivered it, the promoted copy is dropped as a duplicate by node2
    shadowed("node1", "node3", 26, "dropped_dup", ("u@example.test",))
    w("node1", 27, "DELIVER", "dropped_dup", ("u@example.test",))
    for name in ("promoted", "duplicate", "dropped_dup"):
        w("node3", 100, "RESUBMIT", name, ("r@foreign.test",) if name == "promoted" else
          ("d1@foreign.test", "d2@foreign.test") if name == "duplicate" else ("u@example.test",),
          source="REDUNDANCY", source_context="node1.test (ShadowHeartbeatFailure)")
    w("node3", 100.5, "SENDEXTERNAL", "promoted")
    w("node3", 100.5, "SENDEXTERNAL", "duplicate", ("d1@foreign.test", "d2@foreign.test"))
    w("node3", 100.6, "SEND", "dropped_dup", ("u@example.test",))
    w("node2", 100.7, "RECEIVE", "dropped_dup", ("u@example.test",))
    w("node2", 100.8, "DUPLICATEDELIVER", "dropped_dup", ("u@example.test",))
    # still queued at the end of the logs, with and without a shadow
    shadowed("node2", "node3", 700, "protected")
    w("node2", 700.5, "RECEIVE", "unprotected")
    w("node2", 700.6, "HAREDIRECTFAIL", "unprotected", source_context="No suitable shadow servers")
    # delivered long before the end, yet its shadow on node3 was never discarded
    shadowed("node2", "node3", 50, "stale")
    w("node2", 51, "SENDEXTERNAL", "stale")
    # a permanent failure
    shadowed("node2", "node3", 60, "failed")
    w("node2", 61, "FAIL", "failed", recipient_status=["550 5.1.1 unknown"])
    w("node3", 65, "HADISCARD", "failed", (), source_context="ExplicitlyDiscarded;guid")
    # one recipient delivered, the other still queued on the same node: the node holds the message
    # (with its shadow: protected; without: unprotected, not lost)
    shadowed("node2", "node3", 600, "partly", ("p1@example.test", "p2@foreign.test"))
    w("node2", 601, "DELIVER", "partly", ("p1@example.test",))
    w("node2", 602, "DEFER", "partly", ("p2@foreign.test",), recipient_status=["451 4.4.1 no answer"])
    w("node2", 610, "RECEIVE", "partly_alone", ("q1@foreign.test", "q2@far.test"))
    w("node2", 610.001, "HAREDIRECTFAIL", "partly_alone", ("q1@foreign.test", "q2@far.test"),
      source_context="No suitable shadow servers")
    w("node2", 611, "SENDEXTERNAL", "partly_alone", ("q1@foreign.test",))
    w("node3", 701, "SEND", "protected", ())  # something late on node3 too: the logs end at 701 s
    for log in logs.values():
        log.close()
    return ids


def test_crafted_journeys_final_states_anomalies_and_summary(spark, tmp_path):
    ids = crafted_cluster_logs(tmp_path / "logs")
    out = tmp_path / "out"
    summary = job.analyze(spark, [str(tmp_path / "logs" / "node*" / "msgtrk")], str(out), grace_seconds=300,
                          progress=False)
    messages = {r["network_message_id"]: r.asDict(recursive=True)
                for r in spark.read.parquet(str(out / "messages")).collect()}
    state = {name: messages[netid]["state"] for name, netid in ids.items()}
    assert state == {"delivered": "delivered", "lost": "lost", "promoted": "delivered", "duplicate": "delivered",
                     "dropped_dup": "delivered", "protected": "in flight protected",
                     "unprotected": "in flight unprotected", "stale": "delivered", "failed": "failed",
                     "partly": "in flight protected", "partly_alone": "in flight unprotected"}
    assert messages[ids["partly"]]["live_copy_nodes"] == ["node2.test", "node3.test"]
    assert (messages[ids["partly_alone"]]["recipients_delivered"], messages[ids["partly_alone"]]["live_copies"]) == (1, 1)
    m = messages[ids["promoted"]]
    assert m["promoted"] and m["receive_node"] == "node1.test" and m["shadow_node"] == "node3.test"
    assert [(r["node"], r["primary"], r["reason"]) for r in m["resubmits"]] == [
        ("node3.test", "node1.test", "ShadowHeartbeatFailure")]
    assert [(d["event"], d["node"]) for d in m["deliveries"]] == [("SENDEXTERNAL", "node3.test")]
    assert m["latency_seconds"] == pytest.approx(80.5)
    assert messages[ids["duplicate"]]["duplicate_external_recipients"] == ["d1@foreign.test", "d2@foreign.test"]
    assert len(messages[ids["dropped_dup"]]["duplicate_delivers"]) == 1
    assert messages[ids["delivered"]]["shadow_hold_seconds"] == [pytest.approx(5.002)]
    assert messages[ids["lost"]]["unprotected_seconds"] == pytest.approx(690.999)  # to the end, 701 s

    assert summary["states"] == {"delivered": 5, "failed": 1, "in flight protected": 2,
                                 "in flight unprotected": 2, "left the logs": 0, "lost": 1, "incomplete": 0}
    assert summary["lost"] == 1 and summary["promoted"] == 3
    assert summary["received"] == 11 and summary["redundant"] == 8
    assert summary["redundancy_coverage"] == pytest.approx(8 / 11)
    assert summary["unprotected_messages"] == 3
    assert summary["duplicates"] == {"inside_boundary": 1, "outside_boundary": 1, "reached_mailbox": 0}
    assert [(e["shadow_node"], e["primary"], e["reason"], e["messages"]) for e in summary["failover_episodes"]] == [
        ("node3.test", "node1.test", "ShadowHeartbeatFailure", 3)]
    assert summary["anomalies"]["counts"] == {"lost": 1, "shadow never discarded": 1, "duplicate outside boundary": 1}
    kinds = {(a["kind"], a["network_message_id"]) for a in summary["anomalies"]["sample"]}
    assert kinds == {("lost", ids["lost"]), ("shadow never discarded", ids["stale"]),
                     ("duplicate outside boundary", ids["duplicate"])}
    assert spark.read.parquet(str(out / "anomalies")).count() == 3
    assert summary["events_by_node"]["node2.test"]["DUPLICATEDELIVER"] == 1
    assert json.loads((out / "summary.json").read_text())["lost"] == 1


def one_message_logs(tmp_path, nodes, network_message_id: str, message_id: str):
    """Tracking logs of ``nodes`` (``NODE.test``, under tmp_path/logs/NODE/msgtrk) and a writer of one
    message's rows: ``w(node, seconds after 13:00, event, recipients, **fields)``, DELIVER from
    STOREDRIVER, any other from SMTP unless ``source=`` says otherwise."""
    from datetime import UTC, datetime, timedelta
    t0 = datetime(2026, 11, 29, 13, 0, tzinfo=UTC)
    logs = {n: TrackingLog(tmp_path / "logs" / n / "msgtrk", f"{n}.test", clock=lambda: t0) for n in nodes}

    def w(node: str, at: float, event: str, rcpts, **kw) -> None:
        source = kw.pop("source", "STOREDRIVER" if event == "DELIVER" else "SMTP")
        logs[node].write(event, source, network_message_id=network_message_id, message_id=message_id,
                         recipients=list(rcpts), date_time=t0 + timedelta(seconds=at), **kw)
    return logs, w


def analyzed(spark, tmp_path, logs, message_id: str | None = None):
    """The logs closed and analyzed (grace 300 s): the summary and the messages (those of
    ``message_id`` when given), as dicts."""
    for log in logs.values():
        log.close()
    summary = job.analyze(spark, [str(tmp_path / "logs" / "node*" / "msgtrk")], str(tmp_path / "out"),
                          grace_seconds=300, progress=False)
    rows = [r.asDict(recursive=True) for r in spark.read.parquet(str(tmp_path / "out" / "messages")).collect()]
    return summary, [m for m in rows if message_id is None or m["message_id"] == message_id]


def test_a_fork_discarded_while_other_recipients_wait_leaves_the_copy_held(spark, tmp_path):
    """node1 hands one recipient hop by hop to the mailbox node node2 (SEND, keeping a fork) and
    defers the other; node2's discard of that hop releases the fork on node1 (HADISCARD naming
    node2), not node1's whole copy: the other recipient is still queued there, with its shadow on
    node3. Rows as the daemon writes them (a SEND names this node as client, the next hop as server)."""
    logs, w = one_message_logs(tmp_path, ("node1", "node2", "node3"), "0000f0a4-0000-4000-8000-000000000000",
                               "<fork@x>")
    both = ("a@example.test", "b@foreign.test")
    w("node3", -0.002, "HARECEIVE", both, source_context="guid1", client_hostname="node1.test")
    w("node1", 0, "RECEIVE", both)
    w("node1", 0.001, "HAREDIRECT", both, source_context="node3.test=250 2.6.0 ok, queued")
    w("node1", 1, "SEND", ("a@example.test",), client_hostname="node1.test", server_hostname="node2.test",
      connector_id="peer:node2.test", source_context="250 2.0.0 Ok: queued as 4")
    w("node2", 1.01, "RECEIVE", ("a@example.test",), client_hostname="node1.test")
    w("node2", 1.02, "DELIVER", ("a@example.test",))
    w("node1", 2, "DEFER", ("b@foreign.test",), recipient_status=["451 4.4.1 no answer"])
    w("node1", 3, "HADISCARD", (), source_context="ExplicitlyDiscarded;guid2", client_hostname="node2.test")
    w("node1", 600, "DEFER", ("b@foreign.test",), recipient_status=["451 4.4.1 no answer"])
    summary, [m] = analyzed(spark, tmp_path, logs)
    assert (m["state"], m["live_copy_nodes"]) == ("in flight protected", ["node1.test", "node3.test"]), m
    assert summary["lost"] == 0 and summary["unprotected_messages"] == 0


def test_a_copy_promoted_for_fewer_recipients_holds_nothing_once_it_delivers_them(spark, tmp_path):
    """node1 delivers one of two recipients and tells its shadow node2 (a per-recipient discard:
    no row), then dies; node2 promotes its copy, which now takes only the other recipient (its
    RESUBMIT names it), and delivers it. The message is delivered and no node holds a copy:
    node2's HARECEIVE named two recipients and its deliveries one, but its last take one."""
    logs, w = one_message_logs(tmp_path, ("node1", "node2"), "0000f0a5-0000-4000-8000-000000000000", "<fewer@x>")
    both = ("a@foreign.test", "b@foreign.test")
    w("node2", -0.002, "HARECEIVE", both, source_context="guid1", client_hostname="node1.test")
    w("node1", 0, "RECEIVE", both)
    w("node1", 0.001, "HAREDIRECT", both, source_context="node2.test=250 2.6.0 ok, queued")
    w("node1", 1, "SENDEXTERNAL", ("a@foreign.test",), recipient_status=["250 2.0.0 Ok"])
    w("node1", 2, "DEFER", ("b@foreign.test",), recipient_status=["451 4.4.1 no answer"])
    w("node2", 100, "HADISCARD", (), source_context="Resubmitted;guid1", client_hostname="node1.test")
    # (the promoted copy's RESUBMIT names the recipients it takes, as the daemon writes it)
    w("node2", 100, "RESUBMIT", ("b@foreign.test",), source="REDUNDANCY",
      source_context="node1.test (ShadowHeartbeatFailure)", reference="1")
    w("node2", 101, "SENDEXTERNAL", ("b@foreign.test",), recipient_status=["250 2.0.0 Ok"])
    w("node2", 700, "SEND", ())  # the logs go on after it
    summary, [m] = analyzed(spark, tmp_path, logs, "<fewer@x>")
    assert (m["state"], m["live_copies"], m["live_copy_nodes"]) == ("delivered", 0, []), m
    assert summary["lost"] == 0 and summary["anomalies"]["counts"].get("shadow never discarded", 0) == 0


# ------------------------------------------------------------------------------ 3, 4


@pytest.fixture(scope="module")
def generated(spark, tmp_path_factory):
    base = tmp_path_factory.mktemp("generated")
    truth = generate(base / "logs", messages=3000, nodes=4, seed=10, deaths=2, redirect_fail_rate=0.2,
                     lost_discard_rate=0.02, malformed=7, grace=60.0)
    summary = job.analyze(spark, [str(base / "logs")], str(base / "out"), recursive=True, grace_seconds=60.0,
                          progress=False)
    return base, truth, summary


def test_generated_logs_every_injected_fact_is_found_exactly(generated):
    _, truth, summary = generated
    assert truth["lost"] > 0 and truth["promoted"] > 0 and truth["stale_shadows"] > 0  # the run tests something
    assert truth["duplicates"]["outside_boundary"] > 0 and truth["duplicates"]["inside_boundary"] > 0
    assert summary["states"] == truth["states"]
    assert summary["messages"] == truth["messages"]
    assert summary["lost"] == truth["lost"]
    assert summary["unprotected_messages"] == truth["unprotected"]
    assert summary["promoted"] == truth["promoted"]
    assert summary["received"] == truth["received"] and summary["redundant"] == truth["redundant"]
    assert summary["duplicates"]["outside_boundary"] == truth["duplicates"]["outside_boundary"]
    assert summary["duplicates"]["inside_boundary"] == truth["duplicates"]["inside_boundary"]
    assert summary["anomalies"]["counts"]["shadow never discarded"] == truth["stale_shadows"]
    assert summary["anomalies"]["counts"]["lost"] == truth["lost"]
    assert summary["malformed"]["rows"] == truth["malformed"]
    assert summary["rows"] == truth["rows"] + truth["malformed"]
    dead = {d["node"] for d in truth["deaths"]}
    assert {e["primary"] for e in summary["failover_episodes"]} == dead
    assert sum(e["messages"] for e in summary["failover_episodes"]) == truth["promotions"]


@pytest.mark.parametrize(("nodes", "deaths", "exchange2010"), [(2, 1, 0), (3, 1, 0), (10, 3, 0), (3, 1, 1)])
def test_generated_logs_of_2_3_and_10_nodes_with_deaths_match_the_truth(spark, tmp_path, nodes, deaths,
                                                                        exchange2010):
    """exchange2010: node1 writes Exchange 2010's 26 fields (no network-message-id) in a mixed
    cluster: its rows join the other nodes' by message-id, each message is still one journey."""
    truth = generate(tmp_path / "logs", messages=4000, nodes=nodes, seed=7, deaths=deaths, redirect_fail_rate=0.1,
                     lost_discard_rate=0.02, malformed=5, grace=60.0, exchange2010_nodes=exchange2010)
    if exchange2010:
        head = next((tmp_path / "logs" / "node1" / "msgtrk").glob("MSGTRK*")).read_text(encoding="utf-8-sig")
        assert "#Fields: " + ",".join(FIELDS_2010) in head
    s = job.analyze(spark, [str(tmp_path / "logs")], str(tmp_path / "out"), recursive=True, grace_seconds=60.0,
                    progress=False, report=False)
    assert truth["promoted"] > 0 and (truth["stale_shadows"] > 0 or nodes == 2)  # 2 nodes: no pair outlives
    assert s["states"] == truth["states"] and s["messages"] == truth["messages"]
    assert (s["received"], s["redundant"], s["unprotected_messages"]) == (
        truth["received"], truth["redundant"], truth["unprotected"])
    assert (s["lost"], s["promoted"]) == (truth["lost"], truth["promoted"])
    assert s["duplicates"]["outside_boundary"] == truth["duplicates"]["outside_boundary"]
    assert s["duplicates"]["inside_boundary"] == truth["duplicates"]["inside_boundary"]
    assert s["anomalies"]["counts"]["shadow never discarded"] == truth["stale_shadows"]
    assert s["malformed"]["rows"] == truth["malformed"] and s["rows"] == truth["rows"] + truth["malformed"]
    assert {e["primary"] for e in s["failover_episodes"]} == {d["node"] for d in truth["deaths"]}
    # a copy promoted by a node that dies in turn is promoted again (another episode)
    assert sum(e["messages"] for e in s["failover_episodes"]) == truth["promotions"]
    if exchange2010:
        messages = spark.read.parquet(str(tmp_path / "out" / "messages"))
        assert messages.filter("network_message_id = ''").count() < messages.count() // 10


def test_a_file_removed_while_the_job_reads_is_skipped_and_said(spark, tmp_path, monkeypatch):
    """A node's retention may remove its oldest tracking-log file while the job reads a live
    folder: the job does not fail on it (Spark's FILE_NOT_EXIST); the other files are read and the
    summary names the file removed."""
    from transportd.analytics import reader
    generate(tmp_path / "logs", messages=300, nodes=3, seed=3)
    files = reader.list_files(spark, [str(tmp_path / "logs")], recursive=True)
    victim = files[0]
    read_rows = reader.read_rows

    def read_then_remove(spark_, files_):
        rows = read_rows(spark_, files_)  # listed and planned; then the file goes
        os.remove(victim)
        return rows
    monkeypatch.setattr(reader, "read_rows", read_then_remove)
    s = job.analyze(spark, [str(tmp_path / "logs")], str(tmp_path / "out"), recursive=True, progress=False,
                    report=False)
    assert s["files"] == len(files) and s["files_removed_while_read"] == [victim]
    assert 0 < s["rows"] and s["events_by_node"]
    assert "1 input file(s) removed while the job read them" in job.console_table(s)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")
def test_report_opens_offline_in_headless_chromium_with_every_chart_drawn(generated, tmp_path):
    base, _, summary = generated
    report = base / "out" / "report.html"
    page = report.read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    res = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", report.as_uri()],
                         capture_output=True, text=True, timeout=120, check=False)
    dom = res.stdout
    assert 'data-charts="6"' in dom, res.stderr[-2000:]
    # the operator's first question first, then the failover timeline, then the distributions
    assert dom.index('id="first-question"') < dom.index('id="failover"') < dom.index('id="distributions"')
    assert dom.index('id="verdict"') < dom.index('id="chart-risk"') < dom.index('id="anomalies"')
    for chart in ("chart-risk", "chart-messages", "chart-coverage", "chart-latency", "chart-hold", "chart-failover"):
        start = dom.index(f'id="{chart}"')
        tag = dom[dom.rindex("<", 0, start):dom.index(">", start)]
        assert 'data-rendered="true"' in tag, tag
        assert int(tag.split('data-marks="')[1].split('"')[0]) > 0, tag
    assert dom.count('class="series"') == 2 + 4 + 1  # lost and unprotected, one line per node, coverage
    assert dom.count('class="episode"') == len(summary["failover_episodes"]) > 0
    assert dom.count("<tr>") >= summary["anomalies"]["counts"]["lost"]
    # screenshots at a desktop and a phone width, kept with the test's output
    shots = Path(os.environ.get("ANALYTICS_SCREENSHOTS", str(tmp_path)))
    shots.mkdir(parents=True, exist_ok=True)
    for name, size in (("report-1280x800.png", "1280,800"), ("report-390x844.png", "390,844")):
        res = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                              "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={size}",
                              f"--screenshot={shots / name}", report.as_uri()],
                             capture_output=True, text=True, timeout=120, check=False)
        png = (shots / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n", res.stderr[-2000:]
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        assert (width, height) == tuple(int(v) for v in size.split(",")), (width, height)
        print(f"screenshot: {shots / name}")


# ------------------------------------------------------------------------------ CLI


def run_cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transportd", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, check=False, env={**os.environ, **(env or {})})


def test_cli_generate_writes_logs_and_truth_and_bad_input_exits_2(tmp_path):
    res = run_cli("analyze", "generate", "--messages", "300", "--nodes", "3", "--out", str(tmp_path / "g"))
    assert res.returncode == 0, res.stderr
    truth = json.loads((tmp_path / "g" / "truth.json").read_text())
    assert truth["received"] == 300
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == ["node1", "node2", "node3", "truth.json"]
    assert list((tmp_path / "g" / "node2" / "msgtrk").glob("MSGTRK*.LOG"))

    res = run_cli("analyze", str(tmp_path / "nothing-here"), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and "no such file or folder" in res.stderr
    res = run_cli("analyze", "generate", "--messages", "10", "--nodes", "2", "--deaths", "2", "--out",
                  str(tmp_path / "h"))
    assert res.returncode == 2 and "deaths" in res.stderr


def test_cli_a_local_out_that_cannot_be_a_folder_is_one_line_and_exit_2_before_spark_starts(tmp_path):
    """A local --out that is a file, under a file, or cannot be made: Spark said so only when it
    wrote, after the work, with 113 to 458 lines of Python and Java traceback (exit 1). Now one line
    naming it, exit 2, before Spark starts (nothing else on stderr: not one line of Spark's)."""
    from helpers import assert_one_error_line
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "MSGTRK2026112910-1.LOG").write_text("#Software: Microsoft Exchange Server\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for out, needle in ((a_file, f"--out {a_file}: {a_file} is not a folder"),
                        (a_file / "sub", f"--out {a_file / 'sub'}: {a_file} is not a folder"),
                        ("/proc/nope", "--out /proc/nope: cannot make or write the folder: No such file or directory"),
                        ("file:///proc/nope", "--out file:///proc/nope: cannot make or write the folder")):
        assert_one_error_line(run_cli("analyze", "run", str(logs), "--out", str(out)), 2, needle)
    assert a_file.read_text() == "x"


# ------------------------------------------------------------------------------ real Exchange shapes


def exchange_row(fields: tuple[str, ...], **values: str) -> dict[str, str]:
    """A row keyed by Exchange's field names (``client_hostname`` -> ``client-hostname``), only
    those the format has."""
    row = {k.replace("_", "-"): v for k, v in values.items()}
    unknown = set(row) - set(FIELDS_2016)
    assert not unknown, unknown
    return {k: v for k, v in row.items() if k in fields}


def exchange_logs(base: Path) -> dict[str, str]:
    """Logs shaped as Exchange 2016, 2013 and 2010 write them (built from the field tables):
    SEND/SENDEXTERNAL rows name the local server in client-hostname and the next hop in
    server-hostname; NOTIFYMAPI and STOREDRIVER notices carry no message id; AGENTINFO rows,
    ``<>`` senders, ``Internal`` directionality; a short host name beside its FQDN."""
    f16, f13, f10 = FIELDS_2016, FIELDS_2013, FIELDS_2010
    ex1, ex2 = "EX1.contoso.test", "EX2.contoso.test"

    def r16(**kw):
        return exchange_row(f16, transport_traffic_type="Email", schema_version="15.01.2507.009", **kw)

    ids = {"left": "11111111-aaaa-4aaa-8aaa-000000000001", "external": "11111111-aaaa-4aaa-8aaa-000000000002",
           "redirect_only": "11111111-aaaa-4aaa-8aaa-000000000003", "group": "11111111-aaaa-4aaa-8aaa-000000000004",
           "alias": "11111111-aaaa-4aaa-8aaa-000000000005", "forwarded": "11111111-aaaa-4aaa-8aaa-000000000006",
           "badmail": "11111111-aaaa-4aaa-8aaa-000000000007", "quoted": "11111111-aaaa-4aaa-8aaa-000000000008",
           "refused": "11111111-aaaa-4aaa-8aaa-000000000009", "kept": "11111111-aaaa-4aaa-8aaa-00000000000a",
           "moderated": "11111111-aaaa-4aaa-8aaa-00000000000b", "approved": "11111111-aaaa-4aaa-8aaa-00000000000c",
           "agent": "11111111-aaaa-4aaa-8aaa-00000000000d"}

    def changed(event: str, key: str, t: str, recipient: str, related: str, **kw: str) -> dict[str, str]:
        return r16(date_time=t, server_hostname=kw.pop("server_hostname", ex1), source=kw.pop("source", "ROUTING"),
                   event_id=event,
                   internal_message_id="104", message_id=f"<{key}@fabrikam.test>", network_message_id=ids[key],
                   recipient_address=recipient, related_recipient_address=related, sender_address="bob@fabrikam.test",
                   directionality="Incoming", **kw)

    def at_ex1(event: str, key: str, t: str, to: str, **kw: str) -> dict[str, str]:
        return r16(date_time=t, client_hostname=kw.pop("client_hostname", ex1), server_hostname=ex1,
                   source=kw.pop("source", "STOREDRIVER"), event_id=event, internal_message_id="104",
                   message_id=f"<{key}@fabrikam.test>", network_message_id=ids[key], recipient_address=to,
                   sender_address="bob@fabrikam.test", directionality="Incoming", **kw)
    def refused(event: str, t: str, remote_ip: str, remote: str, status: str) -> dict[str, str]:
        """A row of Exchange's SMTP send about a next hop's refusal: the local server (its short
        name) in client-hostname, the remote host in server-hostname."""
        return r16(date_time=t, client_ip="10.0.0.1", client_hostname="EX1", server_ip=remote_ip,
                   server_hostname=remote, source_context="08D3D1F6B0E8C1A9", connector_id="Internet",
                   source="SMTP", event_id=event, internal_message_id="105", message_id="<refused@contoso.test>",
                   network_message_id=ids["refused"], recipient_address="zed@fabrikam.test",
                   recipient_status=status, sender_address="carl@contoso.test", directionality="Originating")

    rows_ex1 = [
        # received from the Internet on EX1 (written with its short name), shadowed on EX2, sent on to EX3
        r16(date_time="2016-03-01T10:00:00.000Z", client_ip="203.0.113.9", client_hostname="mail.fabrikam.test",
            server_ip="10.0.0.1", server_hostname="EX1", source_context="08D3D1F6B0E8C1A2;250 2.6.0",
            connector_id="EX1\\Default Frontend EX1", source="SMTP", event_id="RECEIVE", internal_message_id="101",
            message_id="<left@fabrikam.test>", network_message_id=ids["left"],
            recipient_address="ann@contoso.test", recipient_count="1", sender_address="bob@fabrikam.test",
            return_path="bob@fabrikam.test", directionality="Incoming", original_client_ip="203.0.113.9"),
        r16(date_time="2016-03-01T10:00:00.010Z", client_hostname="", server_hostname="EX1",
            source_context=f"{ex2}=250 2.6.0 <left@fabrikam.test> Queued", source="SMTP", event_id="HAREDIRECT",
            internal_message_id="101", message_id="<left@fabrikam.test>", network_message_id=ids["left"],
            recipient_address="ann@contoso.test", sender_address="bob@fabrikam.test", directionality="Incoming"),
        r16(date_time="2016-03-01T10:00:00.020Z", client_hostname="", server_hostname="EX1", source="AGENT",
            event_id="AGENTINFO", internal_message_id="101", message_id="<left@fabrikam.test>",
            network_message_id=ids["left"], recipient_address="ann@contoso.test",
            sender_address="bob@fabrikam.test", custom_data="S:CFA=SUM|SFV=NSPM", directionality="Incoming"),
        r16(date_time="2016-03-01T10:00:01.000Z", client_ip="10.0.0.1", client_hostname=ex1, server_ip="10.0.0.3",
            server_hostname="EX3.contoso.test", source_context="08D3D1F6B0E8C1A2;250 2.6.0 Queued",
            connector_id="Intra-Organization SMTP Send Connector", source="SMTP", event_id="SEND",
            internal_message_id="101", message_id="<left@fabrikam.test>", network_message_id=ids["left"],
            recipient_address="ann@contoso.test", recipient_status="250 2.1.5 Recipient OK",
            sender_address="bob@fabrikam.test", directionality="Incoming"),
        # a DSN-ish message with a null sender sent outside: the remote MX must not become a node
        r16(date_time="2016-03-01T10:01:00.000Z", client_ip="10.0.0.2", client_hostname=ex2, server_ip="10.0.0.1",
            server_hostname=ex1, source="SMTP", event_id="RECEIVE", internal_message_id="102",
            message_id="<ext@contoso.test>", network_message_id=ids["external"],
            recipient_address="zoe@fabrikam.test", sender_address="<>", directionality="Originating"),
        r16(date_time="2016-03-01T10:01:00.010Z", server_hostname=ex1, source="SMTP", event_id="HAREDIRECTFAIL",
            source_context="No suitable shadow servers", internal_message_id="102",
            message_id="<ext@contoso.test>", network_message_id=ids["external"],
            recipient_address="zoe@fabrikam.test", sender_address="<>"),
        r16(date_time="2016-03-01T10:01:02.000Z", client_ip="10.0.0.1", client_hostname=ex1,
            server_ip="198.51.100.25", server_hostname="mx.fabrikam.test",
            source_context="250 2.0.0 OK", connector_id="Internet", source="SMTP", event_id="SENDEXTERNAL",
            internal_message_id="102", message_id="<ext@contoso.test>", network_message_id=ids["external"],
            recipient_address="zoe@fabrikam.test", recipient_status="250 2.0.0 OK", sender_address="<>",
            directionality="Originating"),
        # mailbox notices: about no message (no message-id, no network-message-id)
        r16(date_time="2016-03-01T10:02:00.000Z", client_ip="10.0.0.1", client_hostname=ex1, server_hostname="EX1",
            source="STOREDRIVER", event_id="NOTIFYMAPI", sender_address="carl@contoso.test",
            directionality="Undefined"),
        r16(date_time="2016-03-01T10:02:00.100Z", client_ip="10.0.0.1", client_hostname=ex1, server_hostname="EX1",
            source="STOREDRIVER", event_id="SUBMITDEFER", sender_address="carl@contoso.test",
            directionality="Undefined", recipient_status="MapiExceptionNotFound"),
        # recipients replaced (Exchange's EXPAND, RESOLVE: related-recipient-address holds the ones
        # replaced; REDIRECT: the recipient redirected in recipient-address, the alternate in
        # related-recipient-address): a group, with a nested group, delivered to its members; an
        # alias resolved (written in another case); a recipient redirected to an alternate
        at_ex1("RECEIVE", "group", "2016-03-01T10:04:00.000Z", "Sales@contoso.test", source="SMTP",
               client_hostname="mail.fabrikam.test"),
        changed("EXPAND", "group", "2016-03-01T10:04:00.100Z", "ann@contoso.test;team@contoso.test",
                "sales@contoso.test"),
        changed("EXPAND", "group", "2016-03-01T10:04:00.200Z", "carl@contoso.test;dan@contoso.test",
                "team@contoso.test"),
        at_ex1("DELIVER", "group", "2016-03-01T10:04:01.000Z", "ann@contoso.test;carl@contoso.test;dan@contoso.test"),
        at_ex1("RECEIVE", "alias", "2016-03-01T10:05:00.000Z", "Ann.Alias@contoso.test", source="SMTP",
               client_hostname="mail.fabrikam.test"),
        changed("RESOLVE", "alias", "2016-03-01T10:05:00.100Z", "ann@contoso.test", "ann.alias@contoso.test"),
        changed("RESOLVE", "alias", "2016-03-01T10:05:00.110Z", "ann@contoso.test", "ANN@contoso.test"),
        at_ex1("DELIVER", "alias", "2016-03-01T10:05:01.000Z", "ann@contoso.test"),
        at_ex1("RECEIVE", "forwarded", "2016-03-01T10:06:00.000Z", "dan@contoso.test;eve@contoso.test",
               source="SMTP", client_hostname="mail.fabrikam.test"),
        changed("REDIRECT", "forwarded", "2016-03-01T10:06:00.100Z", "dan@contoso.test", "fay@contoso.test"),
        at_ex1("DELIVER", "forwarded", "2016-03-01T10:06:01.000Z", "eve@contoso.test;fay@contoso.test"),
        # deliver and forward (the recipient redirected to itself and to an alternate: both get it),
        # and a redirection to another connector (no alternate: the recipient stays)
        at_ex1("RECEIVE", "kept", "2016-03-01T10:06:30.000Z", "gil@contoso.test;ivy@contoso.test", source="SMTP",
               client_hostname="mail.fabrikam.test"),
        # rerouted for high availability by Exchange's routing: a HAREDIRECT that names no shadow
        changed("HAREDIRECT", "kept", "2016-03-01T10:06:30.050Z", "gil@contoso.test;ivy@contoso.test", "",
                source_context="NoShadowServer"),
        changed("REDIRECT", "kept", "2016-03-01T10:06:30.100Z", "gil@contoso.test", "gil@contoso.test"),
        changed("REDIRECT", "kept", "2016-03-01T10:06:30.110Z", "gil@contoso.test", "hank@contoso.test"),
        changed("REDIRECT", "kept", "2016-03-01T10:06:30.120Z", "ivy@contoso.test", "", source="AGENT",
                custom_data="S:ConnectorRedirect=contoso.test(hub)"),
        at_ex1("DELIVER", "kept", "2016-03-01T10:06:31.000Z", "gil@contoso.test;hank@contoso.test;ivy@contoso.test"),
        # refused by the remote MX: Exchange's SMTP send writes its FAIL (and a DEFER before it) with
        # the local server in client-hostname and the remote host in server-hostname
        r16(date_time="2016-03-01T10:09:00.000Z", client_ip="10.0.0.2", client_hostname=ex2, server_ip="10.0.0.1",
            server_hostname=ex1, source="SMTP", event_id="RECEIVE", internal_message_id="105",
            message_id="<refused@contoso.test>", network_message_id=ids["refused"],
            recipient_address="zed@fabrikam.test", sender_address="carl@contoso.test", directionality="Originating"),
        refused("DEFER", "2016-03-01T10:09:01.000Z", "198.51.100.26", "mx2.fabrikam.test",
                "451 4.7.1 Try again later"),
        refused("FAIL", "2016-03-01T10:10:00.000Z", "198.51.100.25", "mx.fabrikam.test", "550 5.1.1 User unknown"),
        # sent to a moderated group: handed to the arbitration mailbox for approval (Exchange leaves
        # both host names empty and acknowledges the group as done); the decision is written about
        # the approval request (its own message-id, the original's in reference)
        changed("INITMESSAGECREATED", "moderated", "2016-03-01T10:11:00.100Z", "all@contoso.test", "",
                server_hostname="", source_context="SystemMailbox{bb558c35-97f1-4cb9-8ff7-d53741dc928c}@contoso.test",
                reference="<init-1@contoso.test>"),
        at_ex1("RECEIVE", "moderated", "2016-03-01T10:11:00.000Z", "all@contoso.test", source="SMTP",
               client_hostname="mail.fabrikam.test"),
        at_ex1("RECEIVE", "approved", "2016-03-01T10:12:00.000Z", "all@contoso.test", source="SMTP",
               client_hostname="mail.fabrikam.test"),
        changed("INITMESSAGECREATED", "approved", "2016-03-01T10:12:00.100Z", "all@contoso.test", "",
                server_hostname="", reference="<init-2@contoso.test>"),
        r16(date_time="2016-03-01T10:20:00.000Z", source="APPROVAL", event_id="MODERATORAPPROVE",
            internal_message_id="0", message_id="<init-2@contoso.test>", recipient_address="all@contoso.test",
            reference="<approved@fabrikam.test>", sender_address="bob@fabrikam.test"),
        at_ex1("RECEIVE", "approved", "2016-03-01T10:20:00.100Z", "all@contoso.test", source="APPROVAL",
               client_hostname="boss@contoso.test", reference="<init-2@contoso.test>"),
        changed("EXPAND", "approved", "2016-03-01T10:20:00.200Z", "kim@contoso.test;lee@contoso.test",
                "all@contoso.test"),
        at_ex1("DELIVER", "approved", "2016-03-01T10:20:01.000Z", "kim@contoso.test;lee@contoso.test"),
        # a quoted local part holding the list separator (RFC 5321 4.1.2): one recipient, not two
        at_ex1("RECEIVE", "quoted", "2016-03-01T10:08:00.000Z", '"x;y"@contoso.test;ann@contoso.test', source="SMTP",
               client_hostname="mail.fabrikam.test"),
        at_ex1("DELIVER", "quoted", "2016-03-01T10:08:01.000Z", '"x;y"@contoso.test; ann@contoso.test'),
        # from the Pickup directory, neither deliverable nor returnable: failed, not lost
        at_ex1("RECEIVE", "badmail", "2016-03-01T10:07:00.000Z", "gus@fabrikam.test", source="PICKUP"),
        at_ex1("BADMAIL", "badmail", "2016-03-01T10:07:01.000Z", "gus@fabrikam.test", source="PICKUP"),
        # shadowed only (no RECEIVE in the logs given): never counted as received nor redundant
        r16(date_time="2016-03-01T10:03:00.000Z", server_hostname=ex1, source="SMTP", event_id="HAREDIRECT",
            source_context=f"{ex2}=250 2.6.0 Queued", internal_message_id="103",
            message_id="<r@x>", network_message_id=ids["redirect_only"], recipient_address="ann@contoso.test"),
    ]
    rows_ex2 = [
        r16(date_time="2016-03-01T09:59:59.990Z", client_ip="10.0.0.1", client_hostname=ex1, server_ip="10.0.0.2",
            server_hostname=ex2, source_context="08D3D1F6B0E8C1A2", source="SMTP", event_id="HARECEIVE",
            internal_message_id="9001", message_id="<left@fabrikam.test>", network_message_id=ids["left"],
            recipient_address="ann@contoso.test", sender_address="bob@fabrikam.test", directionality="Incoming"),
        r16(date_time="2016-03-01T10:00:11.000Z", client_hostname=ex1, server_hostname=ex2,
            source_context="ExplicitlyDiscarded;08D3D1F6B0E8C1A2", source="SMTP", event_id="HADISCARD",
            internal_message_id="9001", message_id="<left@fabrikam.test>", network_message_id=ids["left"],
            directionality="Incoming"),
    ]
    rows_ex2 += [
        # a recipient added by a transport rule: Exchange writes a RECEIVE by the agent with the
        # local host in client-hostname and server-hostname empty (this one in a folder of logs
        # collected from several servers, whose name is no server's)
        r16(date_time="2016-03-01T10:13:00.000Z", client_ip="10.0.0.9", client_hostname="mail.fabrikam.test",
            server_hostname=ex2, source="SMTP", event_id="RECEIVE", internal_message_id="9002",
            message_id="<agent@fabrikam.test>", network_message_id=ids["agent"], recipient_address="ann@contoso.test",
            sender_address="bob@fabrikam.test", directionality="Incoming"),
        r16(date_time="2016-03-01T10:13:01.000Z", client_hostname=ex2, server_hostname=ex2, source="STOREDRIVER",
            event_id="DELIVER", internal_message_id="9002", message_id="<agent@fabrikam.test>",
            network_message_id=ids["agent"], recipient_address="ann@contoso.test;audit@contoso.test",
            sender_address="bob@fabrikam.test", directionality="Incoming"),
    ]
    write_log(base / "ex2016" / "collected" / "MSGTRK2016030110-1.LOG", f16, [
        r16(date_time="2016-03-01T10:13:00.500Z", client_hostname="EX2", source="AGENT", event_id="RECEIVE",
            source_context="Transport Rule Agent", internal_message_id="9002", message_id="<agent@fabrikam.test>",
            network_message_id=ids["agent"], recipient_address="audit@contoso.test",
            sender_address="bob@fabrikam.test", directionality="Incoming"),
    ], header=True, bom=True, newline="\r\n")
    write_log(base / "ex2016" / "EX1" / "MSGTRK2016030110-1.LOG", f16, rows_ex1, header=True, bom=True,
              newline="\r\n")
    write_log(base / "ex2016" / "EX2" / "MSGTRK2016030110-1.LOG", f16, rows_ex2, header=True, bom=True,
              newline="\r\n")
    # Exchange 2013: an internal message with no network-message-id on its rows (keyed by message-id)
    write_log(base / "ex2013" / "MBX1" / "MSGTRK2013050108-1.LOG", f13, [
        exchange_row(f13, date_time="2013-05-01T08:00:00.000Z", client_hostname="mbx1.contoso.test",
                     server_hostname="mbx1", source="STOREDRIVER", event_id="RECEIVE", internal_message_id="5",
                     message_id="<int@contoso.test>", recipient_address="dan@contoso.test",
                     sender_address="eve@contoso.test", directionality="Internal"),
        exchange_row(f13, date_time="2013-05-01T08:00:01.000Z", client_hostname="mbx1.contoso.test",
                     server_hostname="mbx1.contoso.test", source="STOREDRIVER", event_id="DELIVER",
                     internal_message_id="5", message_id="<int@contoso.test>", recipient_address="dan@contoso.test",
                     sender_address="eve@contoso.test", directionality="Internal"),
        exchange_row(f13, date_time="2013-05-01T08:00:02.000Z", server_hostname="mbx1", source="STOREDRIVER",
                     event_id="NOTIFYMAPI"),
        # the mailbox's submission names the transport server it submits to in server-hostname
        # (here one whose logs are not given), itself in client-hostname; a RESUBMIT from the
        # mailbox holds no copy in transport
        exchange_row(f13, date_time="2013-05-01T08:01:00.000Z", client_ip="10.2.0.1",
                     client_hostname="mbx1.contoso.test", server_ip="10.2.0.9", server_hostname="hub9.contoso.test",
                     source="STOREDRIVER", event_id="SUBMIT", message_id="<sub@contoso.test>",
                     sender_address="eve@contoso.test"),
        exchange_row(f13, date_time="2013-05-01T08:02:00.000Z", client_ip="10.2.0.1",
                     client_hostname="mbx1.contoso.test", server_ip="10.2.0.9", server_hostname="hub9.contoso.test",
                     source="STOREDRIVER", event_id="RESUBMIT", message_id="<sub@contoso.test>",
                     sender_address="eve@contoso.test"),
    ], header=True, bom=True, newline="\r\n")
    # Exchange 2010: no header, 26 fields, no network-message-id; sent outside
    write_log(base / "ex2010" / "HUB1" / "MSGTRK20100301-1.LOG", f10, [
        exchange_row(f10, date_time="2010-03-01T10:00:00.000Z", client_ip="10.1.0.5", client_hostname="client1",
                     server_ip="10.1.0.1", server_hostname="HUB1", source="SMTP", event_id="RECEIVE",
                     internal_message_id="77", message_id="<old@contoso.test>", recipient_address="x@fabrikam.test",
                     sender_address="fay@contoso.test"),
        exchange_row(f10, date_time="2010-03-01T10:00:02.000Z", client_ip="10.1.0.1", client_hostname="HUB1",
                     server_ip="198.51.100.25", server_hostname="198.51.100.25", source="SMTP",
                     event_id="SENDEXTERNAL", internal_message_id="77", message_id="<old@contoso.test>",
                     recipient_address="x@fabrikam.test", sender_address="fay@contoso.test"),
        # Exchange 2010's hub delivers to a mailbox server: itself in client-hostname, the mailbox
        # server (whose logs hold no such row) in server-hostname
        exchange_row(f10, date_time="2010-03-01T10:01:00.000Z", client_ip="10.1.0.5", client_hostname="client1",
                     server_ip="10.1.0.1", server_hostname="HUB1", source="SMTP", event_id="RECEIVE",
                     internal_message_id="78", message_id="<local@contoso.test>", recipient_address="y@contoso.test",
                     sender_address="fay@contoso.test"),
        exchange_row(f10, date_time="2010-03-01T10:01:01.000Z", client_ip="10.1.0.1", client_hostname="HUB1",
                     server_ip="10.1.0.7", server_hostname="MBX2010", source="STOREDRIVER", event_id="DELIVER",
                     internal_message_id="78", message_id="<local@contoso.test>", recipient_address="y@contoso.test",
                     sender_address="fay@contoso.test"),
    ], header=False, bom=False, newline="\n")
    return ids


def test_a_message_id_sent_twice_across_2010_and_2013_is_joined_by_the_hop(spark, tmp_path):
    """A client sends one Message-ID twice (a retry after no reply): two messages, two
    network-message-ids. A 2010 hub's rows carry only the Message-ID, which names both: the SEND
    replies name the copy each hop made (Exchange's ``[InternalId=N, Hostname=H]``, ours ``queued
    as N``), and each 2010 copy joins its own message, in both directions."""
    f13, f10 = FIELDS_2013, FIELDS_2010
    n1, n2, n3, n4 = ("0a0a0a0a-0000-4000-8000-00000000000" + c for c in "1234")

    def r13(**kw):
        return exchange_row(f13, **{"server_hostname": "EX1.contoso.test", "server_ip": "10.0.0.1", **kw})
    ex1 = []
    # two sends of <dup@...> to the 2010 hub, each copy named by the hub's reply
    for iid, at, netid, reply in (
            ("10", "09:00", n1, ("250 2.6.0 <dup@contoso.test> [InternalId=500, Hostname=HUB1.contoso.test] "
                                 "Queued mail for delivery")),
            ("11", "09:05", n2, "250 2.0.0 Ok: queued as 501")):
        same = {"internal_message_id": iid, "message_id": "<dup@contoso.test>", "network_message_id": netid,
                "recipient_address": "x@fabrikam.test", "sender_address": "a@contoso.test", "source": "SMTP"}
        ex1 += [r13(date_time=f"2013-05-01T{at}:00.000Z", client_hostname="client1", event_id="RECEIVE", **same),
                # a SEND names the next hop's address in server-ip (the hub's, 10.0.0.2)
                r13(date_time=f"2013-05-01T{at}:01.000Z", client_ip="10.0.0.1", client_hostname="EX1.contoso.test",
                    server_ip="10.0.0.2", server_hostname="HUB1.contoso.test", event_id="SEND", recipient_status=reply,
                    **same)]
    # the other way: the hub's two sends of <rev@...> arrive here as two messages
    for iid, at, netid in (("20", "09:10", n3), ("21", "09:15", n4)):
        same = {"internal_message_id": iid, "message_id": "<rev@contoso.test>", "network_message_id": netid,
                "recipient_address": "y@contoso.test", "sender_address": "b@fabrikam.test"}
        ex1 += [r13(date_time=f"2013-05-01T{at}:01.000Z", client_hostname="HUB1.contoso.test", source="SMTP",
                    event_id="RECEIVE", **same),
                r13(date_time=f"2013-05-01T{at}:02.000Z", client_hostname="EX1.contoso.test", source="STOREDRIVER",
                    event_id="DELIVER", **same)]
    write_log(tmp_path / "logs" / "EX1" / "MSGTRK20130501-1.LOG", f13, ex1, header=True, bom=True, newline="\r\n")

    def r10(**kw):
        return exchange_row(f10, **{"server_hostname": "HUB1", "server_ip": "10.0.0.2", **kw})
    rows = []
    for iid, at in (("500", "09:00"), ("501", "09:05")):
        rows += [r10(date_time=f"2013-05-01T{at}:01.000Z", client_hostname="EX1.contoso.test", source="SMTP",
                     event_id="RECEIVE", internal_message_id=iid, message_id="<dup@contoso.test>",
                     recipient_address="x@fabrikam.test", sender_address="a@contoso.test"),
                 r10(date_time=f"2013-05-01T{at}:02.000Z", client_hostname="HUB1", server_hostname="mx.fabrikam.test",
                     source="SMTP", event_id="SENDEXTERNAL", internal_message_id=iid, message_id="<dup@contoso.test>",
                     recipient_address="x@fabrikam.test", sender_address="a@contoso.test")]
    for iid, at, theirs in (("600", "09:10", "20"), ("601", "09:15", "21")):
        rows += [r10(date_time=f"2013-05-01T{at}:00.000Z", client_hostname="mx.fabrikam.test", source="SMTP",
                     event_id="RECEIVE", internal_message_id=iid, message_id="<rev@contoso.test>",
                     recipient_address="y@contoso.test", sender_address="b@fabrikam.test"),
                 r10(date_time=f"2013-05-01T{at}:01.000Z", client_ip="10.0.0.2", client_hostname="HUB1",
                     server_ip="10.0.0.1", server_hostname="EX1.contoso.test", source="SMTP", event_id="SEND", internal_message_id=iid, message_id="<rev@contoso.test>",
                     recipient_address="y@contoso.test", sender_address="b@fabrikam.test",
                     recipient_status=f"250 2.6.0 <rev@contoso.test> [InternalId={theirs}, "
                                      "Hostname=EX1.contoso.test] Queued mail for delivery")]
    write_log(tmp_path / "logs" / "HUB1" / "MSGTRK20130501-1.LOG", f10, rows, header=False, bom=False, newline="\n")

    out = tmp_path / "out"
    summary = job.analyze(spark, [str(tmp_path / "logs")], str(out), recursive=True, progress=False, report=False)
    messages = {r["key"]: r.asDict(recursive=True) for r in spark.read.parquet(str(out / "messages")).collect()}
    assert sorted(messages) == sorted([n1, n2, n3, n4]), sorted(messages)  # no journey keyed by a Message-ID
    for n in (n1, n2):
        assert messages[n]["state"] == "delivered" and messages[n]["receive_node"] == "ex1.contoso.test", messages[n]
    for n in (n3, n4):  # entered at the hub, delivered here: one journey each
        assert messages[n]["state"] == "delivered" and messages[n]["receive_node"] == "hub1", messages[n]
    assert summary["states"]["delivered"] == 4 and summary["lost"] == 0
    # --events (every row typed to events/, then cut): the same journeys
    again = job.analyze(spark, [str(tmp_path / "logs")], str(tmp_path / "out2"), recursive=True, progress=False,
                        report=False, write_events=True)
    assert (again["states"], again["messages"]) == (summary["states"], summary["messages"])
    assert spark.read.parquet(str(tmp_path / "out2" / "events")).filter("hop_id IS NOT NULL").count() == 4


def test_exchange_shaped_logs_are_read_as_exchange_means_them(spark, tmp_path):
    ids = exchange_logs(tmp_path / "logs")
    out = tmp_path / "out"
    summary = job.analyze(spark, [str(tmp_path / "logs")], str(out), recursive=True, progress=False)
    messages = {r["key"]: r.asDict(recursive=True) for r in spark.read.parquet(str(out / "messages")).collect()}

    assert summary["malformed"]["rows"] == 0, summary["malformed"]
    # rows about no message: mailbox notices, and a moderation decision (about the approval request)
    assert summary["non_message_rows"] == {"rows": 4, "by_event": {"NOTIFYMAPI": 2, "SUBMITDEFER": 1,
                                                                   "MODERATORAPPROVE": 1}}
    assert "<init-2@contoso.test>" not in messages
    # local nodes only: SEND/SENDEXTERNAL, FAIL, DEFER and submission rows from client-hostname (the
    # remote MX hosts and the transport server submitted to are not nodes), a RECEIVE by an agent
    # from client-hostname (not the folder); EX1 and its FQDN are one node
    assert set(summary["events_by_node"]) == {"ex1.contoso.test", "ex2.contoso.test", "mbx1.contoso.test", "hub1"}
    assert summary["events_by_node"]["ex1.contoso.test"]["AGENTINFO"] == 1
    assert summary["events_by_node"]["ex1.contoso.test"]["FAIL"] == 1
    assert summary["events_by_node"]["mbx1.contoso.test"]["RESUBMIT"] == 1
    assert summary["events_by_node"]["hub1"]["DELIVER"] == 1  # 2010: the hub, not the mailbox server
    assert summary["events_by_node"]["ex2.contoso.test"]["RECEIVE"] == 2
    assert summary["node_names"] == {"ex1": "ex1.contoso.test", "ex2": "ex2.contoso.test",
                                     "mbx1": "mbx1.contoso.test"}
    # coverage counted once per message, over received messages only
    # (redundant: "left", and "kept", rerouted for high availability: made redundant by the hop)
    assert summary["received"] == 15 and summary["redundant"] == 2
    assert 0 <= summary["redundancy_coverage"] <= 1
    left = messages[ids["left"]]
    assert left["state"] == "left the logs" and left["receive_node"] == "ex1.contoso.test"
    assert [(d["event"], d["node"], d["next_hop"]) for d in left["deliveries"]] == [
        ("SEND", "ex1.contoso.test", "ex3.contoso.test")]
    ext = messages[ids["external"]]
    assert ext["state"] == "delivered" and ext["sender"] == "<>"
    assert [(d["node"], d["next_hop"]) for d in ext["deliveries"]] == [("ex1.contoso.test", "mx.fabrikam.test")]
    assert messages["<int@contoso.test>"]["state"] == "delivered"  # 2013, keyed by message-id
    assert messages["<old@contoso.test>"]["state"] == "delivered"  # 2010, headerless
    local = messages["<local@contoso.test>"]
    assert (local["state"], local["live_copies"]) == ("delivered", 0)  # the DELIVER released the hub's copy
    assert messages[ids["redirect_only"]]["state"] == "incomplete"
    # recipients replaced by EXPAND / RESOLVE / REDIRECT: delivered to who took their place
    # (read as never delivered, these three were reported lost)
    assert messages[ids["badmail"]]["state"] == "failed"
    # refused outside: failed, and the FAIL released the sending node's copy
    refused = messages[ids["refused"]]
    assert (refused["state"], refused["live_copies"], refused["live_copy_nodes"] or []) == ("failed", 0, [])
    assert messages[ids["kept"]]["shadow_node"] is None
    # a mailbox's resubmission is no copy in transport: nothing holds it, it never entered the logs
    sub = messages["<sub@contoso.test>"]
    assert (sub["state"], sub["live_copies"], sub["live_copy_nodes"] or []) == ("incomplete", 0, [])
    # handed to moderation: done (the arbitration mailbox holds it), then approved and delivered
    for key, count in (("group", 3), ("alias", 1), ("forwarded", 2), ("quoted", 2), ("kept", 3), ("moderated", 1),
                       ("approved", 2), ("agent", 2)):
        m = messages[ids[key]]
        assert (m["state"], m["recipient_count"], m["recipients_delivered"]) == ("delivered", count, count), key
    assert summary["states"]["left the logs"] == 1 and summary["lost"] == 0
    assert summary["unprotected_messages"] == 1  # the HAREDIRECTFAIL of a received message


# ------------------------------------------------------------------------------ bounded by construction

_NODES = ("n1.example.test", "n2.example.test", "n1", "n3.example.test")
_EVENTS = ("RECEIVE", "HAREDIRECT", "HAREDIRECTFAIL", "HARECEIVE", "HADISCARD", "SEND", "SENDEXTERNAL", "DELIVER",
           "DUPLICATEDELIVER", "RESUBMIT", "FAIL", "DSN", "DEFER", "DROP", "AGENTINFO", "NOTIFYMAPI", "EXPAND",
           "REDIRECT", "INITMESSAGECREATED", "MODERATORAPPROVE")
_row = st.fixed_dictionaries({
    "at": st.integers(0, 200), "node": st.sampled_from(_NODES), "event": st.sampled_from(_EVENTS),
    "key": st.integers(0, 5), "rcpts": st.lists(st.sampled_from(("a@x.test", "b@x.test")), max_size=2, unique=True),
    "peer": st.sampled_from(_NODES + ("mx.remote.test",)), "client": st.booleans(),
    "why": st.sampled_from(("ShadowHeartbeatFailure", "ShadowStateChange")),
})


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(_row, min_size=1, max_size=40))
# A DSN generated and dropped: lost, though never received (DSNs are not counted as received).
@example(rows=[{"at": 0, "rcpts": ["a@x.test", "b@x.test"], "peer": "n1.example.test", "client": False, "key": 1,
                "event": "DSN", "why": "ShadowHeartbeatFailure", "node": "n3.example.test"},
               {"at": 0, "rcpts": [], "peer": "n1.example.test", "client": False, "key": 1,
                "event": "DROP", "why": "ShadowHeartbeatFailure", "node": "n3.example.test"}])
# Delivered on a server whose clock is behind the receiver's: the DELIVER is stamped before the RECEIVE.
@example(rows=[{"at": 0, "rcpts": ["a@x.test"], "peer": "n1.example.test", "client": False, "key": 2,
                "event": "DELIVER", "why": "ShadowHeartbeatFailure", "node": "n2.example.test"},
               {"at": 1, "rcpts": ["a@x.test"], "peer": "n1.example.test", "client": False, "key": 2,
                "event": "RECEIVE", "why": "ShadowHeartbeatFailure", "node": "n1.example.test"}])
def test_summary_figures_are_bounded_by_construction_on_any_rows(spark, tmp_path_factory, rows):
    """Rows of any events in any order: every ratio is in [0, 1], every message is in exactly one
    state, and the states add up to the messages."""
    from datetime import UTC, datetime, timedelta
    base = tmp_path_factory.mktemp("any")
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    out_rows = []
    for r in sorted(rows, key=lambda r: r["at"]):
        ev = r["event"]
        no_id = ev == "NOTIFYMAPI"
        ctx = (f"{r['peer']}=250 ok" if ev == "HAREDIRECT" else f"{r['peer']} ({r['why']})" if ev == "RESUBMIT"
               else "")
        sending = ev in ("SEND", "SENDEXTERNAL") and r["client"]
        out_rows.append({
            "date-time": (t0 + timedelta(seconds=r["at"])).strftime("%Y-%m-%dT%H:%M:%S.000Z"),
            "client-hostname": r["node"] if sending else (r["peer"] if ev == "HARECEIVE" else ""),
            "server-hostname": r["peer"] if sending else r["node"],
            "source-context": ctx, "source": "REDUNDANCY" if ev == "RESUBMIT" else "SMTP", "event-id": ev,
            "network-message-id": "" if no_id else f"k{r['key']}", "message-id": "" if no_id else f"<{r['key']}@x>",
            "recipient-address": ";".join(r["rcpts"]), "sender-address": "<>",
            "related-recipient-address": "c@x.test" if ev in ("EXPAND", "REDIRECT") else ""})
    write_log(base / "logs" / "MSGTRK20260101-1.LOG", FIELDS_2016, out_rows, header=True, bom=True, newline="\r\n")
    summary = job.analyze(spark, [str(base / "logs")], str(base / "out"), progress=False, report=False)
    messages = spark.read.parquet(str(base / "out" / "messages"))
    states = [r["state"] for r in messages.select("state").collect()]
    assert len(states) == messages.select("key").distinct().count() == summary["messages"]
    assert set(states) <= set(job.STATES)
    assert sum(summary["states"].values()) == summary["messages"]
    ratios = [summary["redundancy_coverage"], summary["unprotected_share"],
              *[c["coverage"] for c in summary["coverage_by_node"]], *[b["coverage"] for b in summary["timeline"]]]
    assert all(v is None or 0.0 <= v <= 1.0 for v in ratios), ratios
    assert summary["redundant"] <= summary["received"] <= summary["messages"]
    assert summary["unprotected_messages"] <= summary["received"]
    # times are never negative, wherever the servers' clocks stand
    assert all(v is None or v >= 0 for r in messages.select("latency_seconds", "unprotected_seconds").collect()
               for v in r), "negative time"
    assert all(v is None or v >= 0 for v in summary["latency_seconds"].values())
    # lost: a message that entered the logs (received, held as a shadow, or a DSN generated), not done,
    # with no live copy; "received" counts RECEIVEs only (docs/analytics.md), so it does not bound it
    entered = {r["key"] for r in rows if r["event"] in ("RECEIVE", "HARECEIVE", "DSN")}
    assert summary["lost"] <= len(entered)


def test_a_host_label_keeps_an_address_whole(spark):
    """The hop join compares hosts by first label (EX1 and EX1.contoso.test are one server), but an
    address is one host: 10.0.0.5 and 10.9.9.9 must not both become "10"."""
    df = spark.createDataFrame([("EX1.contoso.test",), ("hub1",), ("10.0.0.5",), ("10.9.9.9",), ("[10.0.0.5]",),
                                ("2001:db8::25",)], ["host"])
    labels = [r[0] for r in df.select(job.host_label("host")).collect()]
    assert labels == ["EX1", "hub1", "10.0.0.5", "10.9.9.9", "[10.0.0.5]", "2001:db8::25"]


def test_a_short_name_and_its_fqdn_are_one_node_only_where_nothing_contradicts_it():
    """Pure naming rules (no Spark): a short name is its one FQDN's node; a label two FQDNs begin
    with, a label two nodes share, and addresses map to nothing."""
    names = {"ex1", "ex1.contoso.test", "hub", "hub.a.test", "hub.b.test", "10.0.0.5", "ex3.contoso.test", ""}
    assert job.node_names(names) == {"ex1": "ex1.contoso.test"}
    aliases = job.host_aliases({"ex1", "ex2.contoso.test", "hub", "mx", "mx.b.test", "10.0.0.5"},
                               {"ex1.contoso.test", "hub.a.test", "hub.b.test", "10.0.0.9"})
    # ex1 logs under its short name: its FQDN's label maps to it; hub: two FQDNs begin with it, none
    assert aliases["fqdn"] == {"ex1": "ex1"}
    # mx and mx.b.test share a label: neither is the node a bare "mx" names
    assert aliases["short"] == {"ex1": "ex1", "ex2": "ex2.contoso.test", "hub": "hub"}


def test_exchange_logs_named_copied_and_sent_as_real_servers_write_them(spark, tmp_path):
    """Journeys as real Exchange servers log them, each misread before:

    - Exchange 2010, one Message-ID received in two SMTP transactions (a list server's one
      recipient per transaction): two copies on the hub; one delivered, the other still queued
      there. Read as one copy, the delivery ended it and the message was reported lost.
    - a SEND to the next hop by its FQDN while that server logs under its short name (2010 hub to
      hub, 2016 server to server): the next hop's logs are given, so the message did not leave
      them; and the 2016 next hop's shadow names its primary by FQDN too.
    - an Edge server (outside the boundary) sends into the organisation, whose server finds no
      shadow: Exchange 2013+ moves a sent message into Safety Net once the next hop acknowledges
      it, so the one copy is the receiving server's: unprotected, not protected by the Edge's.
    - rows with no host name in Exchange's own folder layout name the server above
      V15/TransportRoles/Logs/MessageTracking, not "logs".
    - transportd nodes without shadow redundancy: the sender of a hop-by-hop SEND keeps nothing."""
    f16, f10 = FIELDS_2016, FIELDS_2010
    logs = tmp_path / "logs"

    def r10(**kw):
        return exchange_row(f10, **kw)
    same = {"message_id": "<list-42@lists.fabrikam.test>", "sender_address": "list-bounces@lists.fabrikam.test"}
    write_log(logs / "HUB1" / "MSGTRK20240301-1.LOG", f10, [
        r10(date_time="2024-03-01T10:50:00.000Z", client_ip="203.0.113.20", client_hostname="lists.fabrikam.test",
            server_hostname="HUB1", source="SMTP", event_id="RECEIVE", internal_message_id="5010",
            recipient_address="ann@contoso.test", **same),
        r10(date_time="2024-03-01T10:50:00.100Z", client_ip="203.0.113.20", client_hostname="lists.fabrikam.test",
            server_hostname="HUB1", source="SMTP", event_id="RECEIVE", internal_message_id="5011",
            recipient_address="dan@contoso.test", **same),
        r10(date_time="2024-03-01T10:50:00.600Z", client_hostname="HUB1", server_hostname="MBX1",
            source="STOREDRIVER", event_id="DELIVER", internal_message_id="5010", recipient_address="ann@contoso.test",
            **same),
        # hub to hub: the next hop named by its FQDN
        r10(date_time="2024-03-01T10:40:00.000Z", client_ip="10.1.0.9", client_hostname="client9",
            server_hostname="HUB1", source="SMTP", event_id="RECEIVE", internal_message_id="5006",
            message_id="<b5@fabrikam.test>", recipient_address="ivy@contoso.test", sender_address="bob@fabrikam.test"),
        r10(date_time="2024-03-01T10:40:00.500Z", client_ip="10.1.0.10", client_hostname="HUB1",
            server_hostname="HUB2.contoso.test", source="SMTP", event_id="SEND", internal_message_id="5006",
            message_id="<b5@fabrikam.test>", recipient_address="ivy@contoso.test", sender_address="bob@fabrikam.test"),
    ], header=False, bom=False, newline="\r\n")
    write_log(logs / "HUB2" / "MSGTRK20240301-1.LOG", f10, [
        r10(date_time="2024-03-01T10:40:00.450Z", client_ip="10.1.0.10", client_hostname="HUB1.contoso.test",
            server_hostname="HUB2", source="SMTP", event_id="RECEIVE", internal_message_id="7006",
            message_id="<b5@fabrikam.test>", recipient_address="ivy@contoso.test", sender_address="bob@fabrikam.test"),
        r10(date_time="2024-03-01T10:41:00.000Z", client_hostname="HUB2", server_hostname="MBX2",
            source="STOREDRIVER", event_id="DEFER", internal_message_id="7006", message_id="<b5@fabrikam.test>",
            recipient_address="ivy@contoso.test", sender_address="bob@fabrikam.test",
            recipient_status="432 4.2.0 STOREDRV.Deliver; mailbox database thread limit exceeded"),
    ], header=False, bom=False, newline="\r\n")

    def r16(**kw):
        return exchange_row(f16, transport_traffic_type="Email", schema_version="15.01.2507.009", **kw)
    hop, edge = "22222222-bbbb-4bbb-8bbb-000000000001", "22222222-bbbb-4bbb-8bbb-000000000002"
    h = {"message_id": "<d1@fabrikam.test>", "network_message_id": hop, "recipient_address": "kim@contoso.test",
         "sender_address": "bob@fabrikam.test"}
    g = {"message_id": "<e1@fabrikam.test>", "network_message_id": edge, "recipient_address": "lee@contoso.test",
         "sender_address": "bob@fabrikam.test"}
    def shadowed(server: str, client: str, at: str, iid: str, shadow: str) -> list[dict[str, str]]:
        """A server's RECEIVE of message ``h`` at 11:00:``at``.000 and, 0.1 s later, its HAREDIRECT
        to ``shadow``."""
        return [r16(date_time=f"2024-03-01T11:00:{at}.000Z", client_hostname=client, server_hostname=server,
                    source="SMTP", event_id="RECEIVE", internal_message_id=iid, **h),
                r16(date_time=f"2024-03-01T11:00:{at}.100Z", server_hostname=server, source="SMTP",
                    event_id="HAREDIRECT", source_context=f"{shadow}=250 2.6.0 Queued mail for redundancy",
                    internal_message_id=iid, **h)]
    write_log(logs / "EX1" / "MSGTRK2024030110-1.LOG", f16, [
        *shadowed("EX1", "mail.fabrikam.test", "00", "100", "EX2.contoso.test"),
        r16(date_time="2024-03-01T11:00:01.000Z", client_hostname="EX1", server_hostname="EX3.contoso.test",
            source="SMTP", event_id="SEND", internal_message_id="100", **h),
        # from the Edge: no shadow server to be had
        r16(date_time="2024-03-01T11:30:00.400Z", client_hostname="EDGE1.perimeter.test", server_hostname="EX1",
            source="SMTP", event_id="RECEIVE", internal_message_id="1012", **g),
        r16(date_time="2024-03-01T11:30:00.410Z", server_hostname="EX1", source_context="No suitable shadow servers",
            source="SMTP", event_id="HAREDIRECTFAIL", internal_message_id="1012", **g),
    ], header=True, bom=True, newline="\r\n")
    write_log(logs / "EX2" / "MSGTRK2024030110-1.LOG", f16, [
        r16(date_time="2024-03-01T11:00:00.050Z", client_hostname="EX1.contoso.test", server_hostname="EX2",
            source="SMTP", event_id="HARECEIVE", internal_message_id="200", **h),
        r16(date_time="2024-03-01T11:00:01.200Z", client_hostname="EX1.contoso.test", server_hostname="EX2",
            source_context="ExplicitlyDiscarded;x", source="SMTP", event_id="HADISCARD", internal_message_id="200", **h),
    ], header=True, bom=True, newline="\r\n")
    write_log(logs / "EX3" / "MSGTRK2024030110-1.LOG", f16, [
        *shadowed("EX3", "EX1.contoso.test", "01", "300", "EX4.contoso.test"),
        r16(date_time="2024-03-01T11:01:00.000Z", client_hostname="EX3", server_hostname="mbx9.contoso.test",
            source="SMTP", event_id="DEFER", internal_message_id="300", recipient_status="451 4.4.0 retry", **h),
    ], header=True, bom=True, newline="\r\n")
    write_log(logs / "EX4" / "MSGTRK2024030110-1.LOG", f16, [
        r16(date_time="2024-03-01T11:00:01.050Z", client_hostname="EX3.contoso.test", server_hostname="EX4",
            source="SMTP", event_id="HARECEIVE", internal_message_id="400", **h),
    ], header=True, bom=True, newline="\r\n")
    write_log(logs / "EDGE1" / "MSGTRK2024030111-1.LOG", f16, [
        r16(date_time="2024-03-01T11:30:00.000Z", client_hostname="mail.fabrikam.test",
            server_hostname="EDGE1.perimeter.test", source="SMTP", event_id="RECEIVE", internal_message_id="9", **g),
        r16(date_time="2024-03-01T11:30:00.500Z", client_hostname="EDGE1.perimeter.test", server_hostname="EX1",
            source_context="250 2.6.0 <e1@fabrikam.test> [InternalId=1012, Hostname=EX1.contoso.test] Queued mail",
            source="SMTP", event_id="SEND", internal_message_id="9", **g),
    ], header=True, bom=True, newline="\r\n")
    write_log(logs / "EX6" / "V15" / "TransportRoles" / "Logs" / "MessageTracking" / "MSGTRKMS2024030111-1.LOG",
              f16, [r16(date_time="2024-03-01T11:40:00.000Z", source="STOREDRIVER", event_id="NOTIFYMAPI")],
              header=True, bom=True, newline="\r\n")

    # transportd nodes without shadow redundancy (no HA row anywhere): a hop-by-hop SEND keeps nothing
    from datetime import UTC, datetime, timedelta
    t0 = datetime(2024, 3, 1, 11, 50, tzinfo=UTC)
    plain = {n: TrackingLog(logs / n / "msgtrk", f"{n}.test", clock=lambda: t0) for n in ("plain1", "plain2")}
    relayed = "33333333-cccc-4ccc-8ccc-000000000001"
    for node, at, event, kw in (("plain1", 0, "RECEIVE", {}),
                                ("plain1", 1, "SEND", {"client_hostname": "plain1.test",
                                                       "server_hostname": "plain2.test"}),
                                ("plain2", 1.1, "RECEIVE", {}),
                                ("plain2", 2, "DEFER", {"recipient_status": ["451 4.4.1 no answer"]})):
        plain[node].write(event, "SMTP", network_message_id=relayed, message_id="<p@x>", recipients=["q@far.test"],
                          date_time=t0 + timedelta(seconds=at), **kw)
    for log in plain.values():
        log.close()

    out = tmp_path / "out"
    summary = job.analyze(spark, [str(logs)], str(out), recursive=True, progress=False, report=False)
    messages = {r["key"]: r.asDict(recursive=True) for r in spark.read.parquet(str(out / "messages")).collect()}

    p = messages[relayed]
    assert (p["state"], p["live_copy_nodes"]) == ("in flight unprotected", ["plain2.test"]), p
    listed = messages["<list-42@lists.fabrikam.test>"]
    assert (listed["state"], listed["live_copy_nodes"]) == ("in flight unprotected", ["hub1"]), listed
    assert (listed["recipient_count"], listed["recipients_delivered"]) == (2, 1)
    b5 = messages["<b5@fabrikam.test>"]  # the 2010 hub keeps a shadow for its peer hub
    assert (b5["state"], b5["live_copy_nodes"]) == ("in flight protected", ["hub1", "hub2"]), b5
    d1 = messages[hop]  # EX1's copy went to Safety Net with the SEND; EX3 holds it, shadowed on EX4
    assert d1["state"] == "in flight protected", d1
    assert d1["live_copy_nodes"] == ["ex3.contoso.test", "ex4.contoso.test"], d1
    assert (d1["undiscarded_shadow_nodes"] or []) == [], d1
    e1 = messages[edge]
    assert (e1["state"], e1["live_copy_nodes"]) == ("in flight unprotected", ["ex1.contoso.test"]), e1
    assert e1["unprotected_at_receipt"] is True
    assert summary["lost"] == 0 and summary["states"]["left the logs"] == 0, summary["states"]
    assert "logs" not in summary["events_by_node"] and summary["events_by_node"]["ex6"] == {"NOTIFYMAPI": 1}


@pytest.fixture(scope="module")
def named_hosts(spark, tmp_path_factory):
    """One run over servers that log under their short names and send by FQDN, as Exchange 2016
    and 2010 write them (addresses in client-ip and server-ip):

    - 2016: MAIL (10.0.0.1) sends ``b1`` to a partner's MX ``mail.fabrikam.test`` (198.51.100.25),
      ``e1`` to ``EX2.contoso.test`` at EX2's address (EX2 logs as ``EX2``, 10.0.0.2: its RECEIVE
      and a DEFER follow), and ``e2`` to its own FQDN at its own address (mailbox delivery; its
      DELIVER follows);
    - 2010: hub MX (10.1.0.1) sends ``<c1@...>`` to a partner's MX ``mx.fabrikam.test``
      (198.51.100.26) and ``<c2@...>`` to ``HUB2.contoso.test`` at HUB2's address (HUB2 logs as
      ``HUB2``, 10.1.0.2: its RECEIVE and a DEFER follow).

    Returns the messages by key."""
    f16, f10 = FIELDS_2016, FIELDS_2010
    logs = tmp_path_factory.mktemp("named_hosts") / "logs"
    b1, e1, e2 = ("b1b1b1b1-0000-4000-8000-00000000000" + c for c in "123")

    def r16(**kw):
        return exchange_row(f16, transport_traffic_type="Email", schema_version="15.01.2507.006", **kw)

    def received(t: str, key: str, netid: str, to: str, **kw: str) -> dict[str, str]:
        return r16(date_time=f"2024-05-01T10:{t}.000Z", client_ip="10.0.0.50", client_hostname="client50.contoso.test",
                   server_ip="10.0.0.1", server_hostname="MAIL", source="SMTP", event_id="RECEIVE",
                   internal_message_id=kw.pop("iid"), message_id=f"<{key}@contoso.test>", network_message_id=netid,
                   recipient_address=to, sender_address="carl@contoso.test", return_path="carl@contoso.test",
                   directionality="Originating")

    def sent(t: str, key: str, netid: str, to: str, ip: str, host: str, connector: str, iid: str) -> dict[str, str]:
        return r16(date_time=f"2024-05-01T10:{t}.000Z", client_ip="10.0.0.1", client_hostname="MAIL", server_ip=ip,
                   server_hostname=host, source_context="08DC000000000001;250 2.0.0 OK", connector_id=connector,
                   source="SMTP", event_id="SEND", internal_message_id=iid, message_id=f"<{key}@contoso.test>",
                   network_message_id=netid, recipient_address=to, recipient_status="250 2.0.0 OK",
                   sender_address="carl@contoso.test", directionality="Originating")

    write_log(logs / "MAIL" / "MSGTRK2024050110-1.LOG", f16, [
        # the audit's rows: the partner's MX shares MAIL's first label
        received("00:00", "b1", b1, "zoe@fabrikam.test", iid="11"),
        sent("00:01", "b1", b1, "zoe@fabrikam.test", "198.51.100.25", "mail.fabrikam.test", "Internet", "11"),
        received("01:00", "e1", e1, "ivy@contoso.test", iid="12"),
        sent("01:01", "e1", e1, "ivy@contoso.test", "10.0.0.2", "EX2.contoso.test",
             "Intra-Organization SMTP Send Connector", "12"),
        received("02:00", "e2", e2, "carl@contoso.test", iid="13"),
        sent("02:01", "e2", e2, "carl@contoso.test", "10.0.0.1", "MAIL.contoso.test",
             "Intra-Organization SMTP Send Connector", "13"),
        r16(date_time="2024-05-01T10:02:02.000Z", client_hostname="MAIL", server_hostname="MAIL", source="STOREDRIVER",
            event_id="DELIVER", internal_message_id="13", message_id="<e2@contoso.test>", network_message_id=e2,
            recipient_address="carl@contoso.test", recipient_status="250 2.1.5 RecipientSuccessfullyDelivered",
            sender_address="carl@contoso.test", directionality="Originating"),
    ], header=True, bom=True, newline="\r\n")
    write_log(logs / "EX2" / "MSGTRK2024050110-1.LOG", f16, [
        r16(date_time="2024-05-01T10:01:00.900Z", client_ip="10.0.0.1", client_hostname="MAIL.contoso.test",
            server_ip="10.0.0.2", server_hostname="EX2", source="SMTP", event_id="RECEIVE", internal_message_id="21",
            message_id="<e1@contoso.test>", network_message_id=e1, recipient_address="ivy@contoso.test",
            sender_address="carl@contoso.test", directionality="Originating"),
        r16(date_time="2024-05-01T10:01:30.000Z", client_hostname="EX2", server_hostname="EX2.contoso.test",
            source="SMTP", event_id="DEFER", internal_message_id="21", message_id="<e1@contoso.test>",
            network_message_id=e1, recipient_address="ivy@contoso.test",
            recipient_status="432 4.2.0 STOREDRV.Deliver; mailbox database thread limit exceeded",
            sender_address="carl@contoso.test", directionality="Originating"),
    ], header=True, bom=True, newline="\r\n")

    def r10(t: str, key: str, **kw: str) -> dict[str, str]:
        return exchange_row(f10, date_time=f"2010-05-01T10:{t}Z", message_id=f"<{key}@contoso.test>",
                            sender_address="carl@contoso.test", **kw)
    write_log(logs / "MX" / "MSGTRK20100501-1.LOG", f10, [
        r10("00:00.000", "c1", client_ip="10.1.0.50", client_hostname="client50", server_ip="10.1.0.1",
            server_hostname="MX", source="SMTP", event_id="RECEIVE", internal_message_id="31",
            recipient_address="zoe@fabrikam.test"),
        r10("00:01.000", "c1", client_ip="10.1.0.1", client_hostname="MX", server_ip="198.51.100.26",
            server_hostname="mx.fabrikam.test", source_context="08CC000000000001", connector_id="Internet",
            source="SMTP", event_id="SEND", internal_message_id="31", recipient_address="zoe@fabrikam.test",
            recipient_status="250 2.0.0 OK"),
        r10("01:00.000", "c2", client_ip="10.1.0.50", client_hostname="client50", server_ip="10.1.0.1",
            server_hostname="MX", source="SMTP", event_id="RECEIVE", internal_message_id="32",
            recipient_address="ivy@contoso.test"),
        r10("01:01.000", "c2", client_ip="10.1.0.1", client_hostname="MX", server_ip="10.1.0.2",
            server_hostname="HUB2.contoso.test", source="SMTP", event_id="SEND", internal_message_id="32",
            recipient_address="ivy@contoso.test", recipient_status="250 2.0.0 OK"),
    ], header=False, bom=False, newline="\r\n")
    write_log(logs / "HUB2" / "MSGTRK20100501-1.LOG", f10, [
        r10("01:00.900", "c2", client_ip="10.1.0.1", client_hostname="MX.contoso.test", server_ip="10.1.0.2",
            server_hostname="HUB2", source="SMTP", event_id="RECEIVE", internal_message_id="41",
            recipient_address="ivy@contoso.test"),
        r10("01:30.000", "c2", client_hostname="HUB2", server_hostname="MBX2", source="STOREDRIVER", event_id="DEFER",
            internal_message_id="41", recipient_address="ivy@contoso.test",
            recipient_status="432 4.2.0 STOREDRV.Deliver; mailbox database thread limit exceeded"),
    ], header=False, bom=False, newline="\r\n")

    out = logs.parent / "out"
    job.analyze(spark, [str(logs)], str(out), recursive=True, progress=False, report=False)
    return {r["key"]: r.asDict(recursive=True) for r in spark.read.parquet(str(out / "messages")).collect()}


def _hops(message: dict) -> list[tuple[str, str, str | None]]:
    return [(d["event"], d["node"], d["next_hop"]) for d in message["deliveries"] or []]


def test_a_partners_mx_named_like_a_short_named_server_is_not_that_server(named_hosts):
    """A server named MAIL (Exchange names itself by its short name) sends to a partner's MX
    ``mail.fabrikam.test``, whose address in server-ip is none MAIL was seen at: the message left
    the logs. It read as sent from ``mail`` to itself, and so lost (2016: the sender's copy went
    to Safety Net) or in flight on the 2010 hub that kept it."""
    b1 = named_hosts["b1b1b1b1-0000-4000-8000-000000000001"]
    assert b1["state"] == "left the logs", b1
    assert _hops(b1) == [("SEND", "mail", "mail.fabrikam.test")], b1
    c1 = named_hosts["<c1@contoso.test>"]
    assert c1["state"] == "left the logs", c1
    assert _hops(c1) == [("SEND", "mx", "mx.fabrikam.test")], c1


def test_a_next_hop_by_fqdn_at_the_short_named_servers_own_address_is_that_server(named_hosts):
    """A SEND to ``EX2.contoso.test`` at the address EX2 (logging as ``EX2``) was seen at is to
    that node, and so is a server's SEND to its own FQDN at its own address (mailbox delivery);
    the same from a 2010 hub to its peer hub."""
    e1 = named_hosts["b1b1b1b1-0000-4000-8000-000000000002"]
    assert (e1["state"], e1["live_copy_nodes"]) == ("in flight unprotected", ["ex2"]), e1
    assert _hops(e1) == [("SEND", "mail", "ex2")], e1
    e2 = named_hosts["b1b1b1b1-0000-4000-8000-000000000003"]
    assert e2["state"] == "delivered", e2
    assert _hops(e2) == [("SEND", "mail", "mail"), ("DELIVER", "mail", None)], e2
    c2 = named_hosts["<c2@contoso.test>"]
    assert (c2["state"], c2["live_copy_nodes"]) == ("in flight protected", ["hub2", "mx"]), c2
    assert _hops(c2) == [("SEND", "mx", "hub2")], c2


def test_a_next_hop_is_the_node_of_its_first_label_unless_its_address_or_domain_says_otherwise(spark):
    """The evidence rules on their own (``_renamed``, and the label the 2010 hop join compares,
    ``_peer_label``): an address given and none the node was seen at, or (no address to go by) a
    domain none of the boundary's own names has, makes a next hop not the node of its label."""
    aliases = job.host_aliases({"mail", "smtp", "ex9.contoso.test"}, {"mail", "smtp", "ex9.contoso.test"},
                               {"mail": {"10.0.0.1"}, "ex9.contoso.test": {"10.0.0.9"}})
    assert aliases["fqdn"] == {"mail": "mail", "smtp": "smtp"}
    assert aliases["addresses"] == {"mail": ["10.0.0.1"], "ex9": ["10.0.0.9"]}
    assert aliases["domains"] == ["contoso.test"]
    cases = [  # (peer, its address, the node it is, the label the hop join compares)
        ("mail.fabrikam.test", "198.51.100.25", "mail.fabrikam.test", "mail.fabrikam.test"),  # address
        ("mail.contoso.test", "10.0.0.1", "mail", "mail"),       # the node's own address
        ("mail.fabrikam.test", "10.0.0.1", "mail", "mail"),      # its address, whatever the domain
        ("mail.contoso.test", None, "mail", "mail"),             # no address: the boundary's domain
        ("mail.fabrikam.test", None, "mail.fabrikam.test", "mail.fabrikam.test"),  # another domain
        ("smtp.contoso.test", "192.0.2.7", "smtp", "smtp"),      # smtp was seen at no address
        ("smtp.fabrikam.test", "192.0.2.7", "smtp.fabrikam.test", "smtp.fabrikam.test"),
        ("ex9.contoso.test", "192.0.2.9", "ex9.contoso.test", "ex9"),  # a node by its own name
        ("ex9.fabrikam.test", "192.0.2.9", "ex9.fabrikam.test", "ex9.fabrikam.test"),
        ("10.0.0.1", "10.0.0.1", "10.0.0.1", "10.0.0.1"),
        ("mail", None, "mail", "mail"),
    ]
    df = spark.createDataFrame([(p, a) for p, a, _, _ in cases], "peer string, peer_ip string")
    got = df.select(job._renamed("peer", {}, aliases, "peer_ip").alias("node"),
                    job._peer_label(df, aliases, {"mail", "smtp", "ex9.contoso.test"}).alias("label")).collect()
    assert [(r["node"], r["label"]) for r in got] == [(n, lb) for _, _, n, lb in cases]
