"""The Spark job behind ``transportd analyze``: MSGTRK logs of many nodes in, per-message journeys out.

It owns reading tracking logs of any Exchange version (2010/2013/2016+, header or not, BOM or
not, CRLF or LF, quoted fields) from any path Spark reads, joining every node's rows by
network-message-id (2010 rows, which have none, by the message-id the other rows pair with one),
deciding each message's final state, and writing ``messages/``, ``anomalies/``, ``malformed/``
and, with ``--events``, ``events/`` (Parquet), ``summary.json`` and ``report.html`` under
``--out``. It must never collect row-level data to the driver: only aggregates (per node, per
time bucket, per failover episode, percentiles, histograms) and a bounded sample of anomalies
come back. A malformed row is counted and reported, never fatal.
Run it as ``transportd analyze`` or ``spark-submit transportd/analytics/job.py PATHS --out DIR``.
The state rules are in docs/analytics.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from transportd.analytics import reader
from transportd.analytics.reader import DEFAULT_NAME_FILTER
from transportd.analytics.schema import (
    COPY_RELEASE_EVENTS,
    DELIVERY_EVENTS,
    ENTRY_EVENTS,
    FAILED_EVENTS,
    MAILBOX_SOURCE,
    RECIPIENT_CHANGE_EVENTS,
    RELEASE_EVENTS,
    RESUBMITTED_DISCARD,
    SEND_FOLLOW_SECONDS,
    STATES,
    SUCCESS_EVENTS,
    TAKE_EVENTS,
)

HISTOGRAM_EDGES = (0.0, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 10800,
                   43200, 86400, 172800)
"""Seconds; the last bucket is everything above the last edge."""

NICE_BUCKETS = (1, 5, 10, 30, 60, 300, 600, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400, 7 * 86400)
MAX_TIME_BUCKETS = 120
HASHED_KEYS = 1_000_000
"""Keys one task may aggregate in its hash map before sorting instead (a bound on its memory)."""
PARTITION_BYTES = 64 * 1024 * 1024
"""Input bytes per shuffle partition when the job picks the count (AQE coalesces smaller ones)."""
JAVA_OPTIONS = "-XX:-DontCompileHugeMethods -XX:+UseParallelGC"
"""The driver's and executors' JVM options (``--conf spark.driver.extraJavaOptions=...`` replaces them)."""


class AnalyzeError(Exception):
    """Bad input that stops the job before it starts (no files, bad option): one line for the user."""


# ---------------------------------------------------------------------------- Spark session


def spark_session(master: str | None = None, app_name: str = "transportd-analyze",
                  conf: dict[str, str] | None = None):
    """A SparkSession: ``master`` if given, else spark-submit's, else ``local[*]``; quiet (WARN)."""
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    preset = SparkConf().get("spark.master", None)
    chosen = master or preset or "local[*]"
    if chosen.startswith("local"):
        # The hostname may resolve to a non-loopback address (PITFALLS.md).
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.appName(app_name)
    if master or not preset:
        builder = builder.master(chosen)
    defaults = {
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.ansi.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.debug.maxToStringFields": "200",
        # Spark's CSV reader fills the corrupt-record column only when it parses every column
        # (with column pruning a row of the wrong length passes unnoticed).
        "spark.sql.csv.parser.columnPruning.enabled": "false",
        "spark.sql.adaptive.enabled": "true",
        "spark.sql.adaptive.coalescePartitions.enabled": "true",
        "spark.sql.parquet.compression.codec": "snappy",
        # lower()/upper() through the JVM's case mapping (an ASCII fast path) instead of ICU's,
        # which costs several times more per host name and address
        "spark.sql.icu.caseMappings.enabled": "false",
        # The job's generated code (one method per stage) is longer than the 8,000 bytes the
        # JVM compiles by default: without this it runs interpreted, 2-3 times slower. The
        # parallel (throughput) collector instead of G1: a batch job needs no short pauses, and
        # G1's concurrent work competes for the same few cores (docs/analytics.md, fifth pass).
        "spark.driver.extraJavaOptions": JAVA_OPTIONS,
        "spark.executor.extraJavaOptions": JAVA_OPTIONS,
    }
    if chosen.startswith("local"):
        defaults["spark.ui.enabled"] = "false"
    for key, value in {**defaults, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    try:  # a glob input makes Spark look for a streaming sink's metadata and log a stack trace
        jvm = spark.sparkContext._jvm
        jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
            "org.apache.spark.sql.execution.streaming", jvm.org.apache.logging.log4j.Level.ERROR)
    except Exception:  # noqa: BLE001, S110 - only quieter logs are at stake
        pass
    return spark


class Progress(threading.Thread):
    """Shows, on stderr, which step runs and how far its active Spark stages are.

    On a terminal it redraws one line twice a second; otherwise it prints a line when the
    step changes and at most every ``interval`` seconds.
    """

    def __init__(self, spark: Any, stream: Any = None, interval: float = 10.0) -> None:
        super().__init__(name="analyze-progress", daemon=True)
        self.tracker = spark.sparkContext.statusTracker()
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval
        self.step = "starting"
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._last_line = ""
        self._last_print = 0.0

    def set_step(self, step: str) -> None:
        self.step = step
        self._show(force=True)

    def run(self) -> None:
        while not self._stop.wait(0.5):
            self._show()

    def stop(self) -> None:
        self._stop.set()
        if self.tty and self._last_line:
            self.stream.write("\n")
            self.stream.flush()

    def line(self) -> str:
        parts = []
        try:
            for stage_id in sorted(self.tracker.getActiveStageIds()):
                info = self.tracker.getStageInfo(stage_id)
                if info is not None:
                    parts.append(f"stage {stage_id} {info.numCompletedTasks}/{info.numTasks} tasks")
        except Exception:  # noqa: BLE001, S110 - progress must never fail the job
            pass
        elapsed = time.monotonic() - self.started
        return f"[analyze {elapsed:6.1f}s] {self.step}" + (": " + ", ".join(parts) if parts else "")

    def _show(self, force: bool = False) -> None:
        text = self.line()
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r" + text[:150].ljust(len(self._last_line[:150])))
            self.stream.flush()
            self._last_line = text
        elif force or now - self._last_print >= self.interval:
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last_print = now
            self._last_line = text


class _NoProgress:
    def set_step(self, step: str) -> None:
        pass


# ---------------------------------------------------------------------------- reading


def check_local_paths(paths: Sequence[str]) -> None:
    """Fail fast, before any Spark job, on a local path or glob that matches nothing."""
    import glob

    for path in paths:
        if "://" in path and not path.startswith("file://"):
            continue  # hdfs://, s3a://, ...: Spark will say
        local = path.removeprefix("file://")
        if not glob.glob(local):
            raise AnalyzeError(f"no such file or folder: {path}")


def check_local_out(out: str) -> None:
    """Fail fast, before any Spark job, on a local ``--out`` that cannot be a folder Spark writes
    in (a file there, a file on its way, a folder that cannot be made or written): Spark says so
    only when it writes, after the work, with a Java traceback. The folder is made here (Spark
    would make it); hdfs://, s3a://... are left to Spark."""
    import tempfile
    from pathlib import Path

    if "://" in out and not out.startswith("file://"):
        return
    local = Path(out.removeprefix("file://")).absolute()
    there = next(p for p in (local, *local.parents) if os.path.lexists(p))  # "/" at least
    if not there.is_dir():
        raise AnalyzeError(f"--out {out}: {there} is not a folder")
    try:
        local.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=local):  # writable, by this user, on this file system
            pass
    except OSError as exc:
        raise AnalyzeError(f"--out {out}: cannot make or write the folder: {exc.strerror or exc}") from None


def read_events(spark: Any, paths: Sequence[str], name_filter: str = DEFAULT_NAME_FILTER,
                recursive: bool = False):
    """Every row of the files the paths name, typed (``reader.normalize``); lazy."""
    try:
        return reader.read_events(spark, paths, name_filter, recursive)
    except reader.InputError as exc:
        raise AnalyzeError(str(exc)) from None


def _write_events(spark: Any, rows: Any, path: str) -> None:
    """Every row, typed, to ``path`` as Parquet partitioned by ``valid`` (``--events``)."""
    # Two writers per task (valid=true, valid=false) instead of a sort of every row by the
    # partition column before writing.
    planned = spark.conf.get("spark.sql.optimizer.plannedWrite.enabled", "true")
    concurrent = spark.conf.get("spark.sql.maxConcurrentOutputFiles", "0")
    spark.conf.set("spark.sql.optimizer.plannedWrite.enabled", "false")
    spark.conf.set("spark.sql.maxConcurrentOutputFiles", "2")
    try:
        # no dictionary pages: most columns are unique per row (keys, contexts), and trying
        # a dictionary first costs more than it saves
        rows.write.option("parquet.enable.dictionary", "false").mode("overwrite").partitionBy(
            "valid").parquet(path)
    finally:
        spark.conf.set("spark.sql.optimizer.plannedWrite.enabled", planned)
        spark.conf.set("spark.sql.maxConcurrentOutputFiles", concurrent)


def narrow_events(rows: Any):
    """The typed rows cut to what the job reads: each column only on the events that use it
    (null elsewhere), ``file``, ``malformed_reason`` and ``line`` only on malformed rows, and a
    flag instead of the network-message-id (the key is the network-message-id when there is one)."""
    from pyspark.sql import functions as F

    e = F.col("event")
    valid = F.col("valid")

    def on(events: Sequence[str], col: str):
        return F.when(e.isin(*events), F.col(col)).alias(col)

    recipient_events = sorted({*TAKE_EVENTS, *SUCCESS_EVENTS, *FAILED_EVENTS, *DELIVERY_EVENTS,
                               *RECIPIENT_CHANGE_EVENTS})
    return rows.select(
        valid.alias("valid"),
        F.when(~valid, F.col("file")).alias("file"),
        F.when(~valid, F.col("malformed_reason")).alias("malformed_reason"),
        F.when(~valid, F.col("line")).alias("line"),
        "key", "time", "node", "event", "source",
        on(("HAREDIRECT", "RESUBMIT", *DELIVERY_EVENTS), "peer"),
        on(("RESUBMIT",), "reason"),
        on(recipient_events, "recipients"),
        on(RECIPIENT_CHANGE_EVENTS, "replaced"),
        on(("HADISCARD", "RESUBMIT"), "context"),
        on(("HARECEIVE",), "client_hostname"),
        on(("RECEIVE",), "sender"),
        (F.col("network_message_id") != "").alias("has_netid"),
        "message_id",
        reader.internal_id(e, F.col("network_message_id")).alias("internal_id"),
        "hop_id", "writer", "node_ip", "peer_ip",
    )


# ---------------------------------------------------------------------------- facts per node


_ADDRESS = r"[0-9.]+|[0-9a-f:]*:[0-9a-f:.]*|\[.*\]"  # an IPv4 or IPv6 address, or an address literal


def _is_address(name: str) -> bool:
    return bool(re.fullmatch(_ADDRESS, name))


def host_label(col: str) -> Any:
    """A host's first label (Exchange names itself by it or by its FQDN), as a column; an address
    stays whole: 10.0.0.5 and 10.9.9.9 are two hosts, not "10"."""
    from pyspark.sql import functions as F
    return F.when(F.col(col).rlike(f"^({_ADDRESS})$"), F.col(col)).otherwise(F.substring_index(F.col(col), ".", 1))


def _fqdns_by_label(names: set[str]) -> dict[str, set[str]]:
    """The fully qualified names among ``names`` (not addresses), by their first label."""
    out: dict[str, set[str]] = {}
    for n in names:
        if n and "." in n and not _is_address(n):
            out.setdefault(n.split(".", 1)[0], set()).add(n)
    return out


def node_names(names: set[str]) -> dict[str, str]:
    """Host name -> node name: a first label and the one FQDN it begins are one node (the FQDN),
    unless two FQDNs begin with that label (then nothing says which one it is). Addresses and
    names already fully qualified map to themselves."""
    by_label = _fqdns_by_label(names)
    out = {}
    for n in names:
        if n and "." not in n and len(by_label.get(n, ())) == 1:
            out[n] = next(iter(by_label[n]))
        # a short name seen only as a short name, or an FQDN: itself
    return out


def host_aliases(nodes: set[str], names: set[str],
                 addresses: dict[str, set[str]] | None = None) -> dict[str, Any]:
    """How a host named elsewhere than in a node's own rows (a SEND's next hop, a HARECEIVE's
    primary) is one of the ``nodes`` of the logs: ``short`` maps a short name to the node whose
    first label it is (the node short or fully qualified), ``fqdn`` maps the first label of a fully
    qualified name to the node that logs under that short name (Exchange names itself by its short
    name and its peers by their FQDN). Only where nothing contradicts it: a label two nodes share,
    or (for ``fqdn``) a label two fully qualified names seen begin with, maps to nothing; and, per
    row (``_foreign``), a next hop the rows place elsewhere is not the node: ``addresses``, by
    first label, the addresses its nodes were seen at (``addresses``: node -> the addresses its own
    rows show it at), and ``domains``, the domains of the boundary's own fully qualified names
    (``names``: the nodes, the shadows of HAREDIRECTs and primaries of HARECEIVEs and RESUBMITs)."""
    def label(n: str) -> str:
        return n.split(".", 1)[0]

    nodes = {n for n in nodes if n and not _is_address(n)}
    count: dict[str, int] = {}
    for n in nodes:
        count[label(n)] = count.get(label(n), 0) + 1
    fqdns = _fqdns_by_label(names)
    short = {label(n): n for n in nodes if count[label(n)] == 1}
    fqdn = {n: n for n in nodes if "." not in n and count[n] == 1 and len(fqdns.get(n, ())) <= 1}
    seen: dict[str, set[str]] = {}
    for n, at in (addresses or {}).items():
        if n in nodes and at:
            seen.setdefault(label(n), set()).update(at)
    domains = {n.split(".", 1)[1] for n in {*names, *nodes} if n and "." in n and not _is_address(n)}
    return {"short": short, "fqdn": fqdn, "addresses": {k: sorted(v) for k, v in sorted(seen.items())},
            "domains": sorted(domains)}


def collect_facts(parsed: Any) -> dict[str, Any]:
    """One pass over the events for the small facts everything else needs (collected: at most
    nodes x events x peers rows, and one row per file and reason of malformed rows): the span of
    the logs, rows per node and event, rows about no message, malformed rows per file and
    reason, the node names, and per node the time before which its copies are gone."""
    from pyspark.sql import functions as F

    e = F.col("event")
    valid = F.col("valid")
    head = e.isin("HAREDIRECT", "RESUBMIT")

    def ok(col: Any):
        return F.when(valid, col)

    grouped = (parsed.groupBy(
        valid.alias("valid"), "file", "malformed_reason", ok(F.col("node")).alias("node"),
        ok(e).alias("event"), ok(F.col("source")).alias("source"), ok(F.when(head, F.col("peer"))).alias("peer"),
        ok(F.when(e == "RESUBMIT", F.col("reason"))).alias("reason"),
        ok(F.col("client_hostname")).alias("primary"), ok(F.col("key").isNull()).alias("no_key"),
        ok(F.col("has_netid")).alias("has_netid"), ok(F.col("node_ip")).alias("address"))
        .agg(F.min(ok(F.col("time"))).alias("start"), F.max(ok(F.col("time"))).alias("end"),
             F.count(F.lit(1)).alias("n"))
        .collect())
    rows = [r for r in grouped if r["valid"]]
    malformed = {(r["file"], r["malformed_reason"]): int(r["n"]) for r in grouped if not r["valid"]}
    names: set[str] = set()
    for r in rows:
        names.add(r["node"])
        if r["peer"]:
            names.add(r["peer"])
        if r["primary"]:  # a HARECEIVE's primary: a node of the boundary
            names.add(r["primary"])
    rename = node_names(names)

    def canon(name: str | None) -> str | None:
        return rename.get(name, name) if name is not None else None

    facts: dict[str, Any] = {"rename": rename, "start": None, "end": None, "rows": 0,
                             "events_by_node": {}, "non_message": {}, "nodes": set(),
                             "malformed": sum(malformed.values()), "malformed_by_file": malformed}
    last_row: dict[str, Any] = {}
    promoted: dict[tuple[str, str], Any] = {}
    addresses: dict[str, set[str]] = {}
    for r in rows:
        node = canon(r["node"])
        facts["nodes"].add(node)
        if r["address"]:
            addresses.setdefault(node, set()).add(r["address"])
        facts["rows"] += int(r["n"])
        if facts["start"] is None or r["start"] < facts["start"]:
            facts["start"] = r["start"]
        if facts["end"] is None or r["end"] > facts["end"]:
            facts["end"] = r["end"]
        per = facts["events_by_node"].setdefault(node, {})
        per[r["event"]] = per.get(r["event"], 0) + int(r["n"])
        if r["no_key"]:
            facts["non_message"][r["event"]] = facts["non_message"].get(r["event"], 0) + int(r["n"])
        else:
            keyed = "by_netid" if r["has_netid"] else "by_message_id"
            facts[keyed] = facts.get(keyed, 0) + int(r["n"])
        last_row[node] = max(last_row.get(node, r["end"]), r["end"])
        if r["event"] == "RESUBMIT" and r["source"] == "REDUNDANCY" and r["peer"]:
            k = (canon(r["peer"]), r["reason"])
            promoted[k] = max(promoted.get(k, r["end"]), r["end"])
    # A peer promoted a node's shadows: with ShadowStateChange it came back with a new queue
    # database (every copy it took before is gone); with ShadowHeartbeatFailure its copies are
    # gone only if it wrote no row after the promotion.
    cutoffs: dict[str, Any] = {}
    for (node, why), when in promoted.items():
        last = last_row.get(node)
        if why == "ShadowStateChange" or last is None or last <= when:
            cutoffs[node] = max(cutoffs.get(node, when), when)
    facts["cutoffs"] = cutoffs
    facts["by_label"] = host_aliases(facts["nodes"], names, addresses)
    facts["events_by_node"] = {n: dict(sorted(v.items())) for n, v in sorted(facts["events_by_node"].items())}
    return facts


def _map_lit(mapping: dict[str, Any], value_type: str = "string"):
    from pyspark.sql import functions as F

    if not mapping:
        return F.create_map().cast(f"map<string,{value_type}>")
    items = []
    for k, v in sorted(mapping.items()):
        items += [F.lit(k), F.lit(v).cast(value_type)]
    return F.create_map(*items)


def _foreign(c: Any, by_label: dict[str, Any], address: Any = None):
    """Whether the rows place the host ``c`` (fully qualified, at ``address`` if given) elsewhere
    than the node of the logs its first label names (``host_aliases``): its address is given and
    is none of those that node was seen at (when it was seen at any); else, where the boundary's
    own names show its domains, its domain is none of them. False where nothing says so."""
    from pyspark.sql import functions as F

    domains = by_label.get("domains") or []
    other_domain = (~c.substr(F.instr(c, ".") + 1, F.length(c)).isin(*domains)) if domains else F.lit(False)
    addresses = by_label.get("addresses") or {}
    if address is None or not addresses:
        return other_domain
    items = []
    for k, v in sorted(addresses.items()):
        items += [F.lit(k), F.array(*[F.lit(a) for a in v])]
    seen = F.try_element_at(F.create_map(*items), F.substring_index(c, ".", 1))
    return F.when(address.isNotNull() & seen.isNotNull(), ~F.array_contains(seen, address)).otherwise(other_domain)


def _renamed(col: str, rename: dict[str, str], by_label: dict[str, Any] | None = None,
             address: str | None = None):
    """``col`` (a host name) as the node name the logs know it by: the FQDN of a short name
    (``rename``), and with ``by_label`` (``host_aliases``) a host named by its other form; with
    ``address`` (the column of the host's address: a SEND's next hop), a fully qualified name the
    rows place elsewhere (``_foreign``) is not the node of its first label."""
    from pyspark.sql import functions as F

    c = F.col(col)
    out = F.try_element_at(_map_lit(rename), c) if rename else F.lit(None).cast("string")
    if by_label and by_label.get("short"):
        out = F.coalesce(out, F.when(~c.contains("."), F.try_element_at(_map_lit(by_label["short"]), c)))
    if by_label and by_label.get("fqdn"):
        node = F.when(c.contains(".") & ~c.rlike(f"^({_ADDRESS})$"),
                      F.try_element_at(_map_lit(by_label["fqdn"]), F.substring_index(c, ".", 1)))
        if address is not None:
            # the evidence is looked at only where the label names a node (few rows)
            node = F.when(node.isNotNull() & ~_foreign(c, by_label, F.col(address)), node)
        out = F.coalesce(out, node)
    return F.coalesce(out, c)


def _peer_label(ev: Any, by_label: dict[str, Any] | None, nodes: set[str] | None):
    """The peer's first label, as the 2010 joins compare hosts (``host_label``); a fully qualified
    peer that is no node by its name and that the rows place elsewhere than the node of its first
    label (``_foreign``, by its address on a SEND) stays whole, so it matches no node."""
    from pyspark.sql import functions as F

    label = host_label("peer")
    if not by_label or not (by_label.get("addresses") or by_label.get("domains")):
        return label
    c = F.col("peer")
    named = (F.try_element_at(_map_lit(dict.fromkeys(nodes, True), "boolean"), c).isNotNull()
             if nodes else F.lit(False))
    address = F.col("peer_ip") if "peer_ip" in ev.columns else None
    dotted = c.contains(".") & ~c.rlike(f"^({_ADDRESS})$")
    return F.when(dotted & ~named & _foreign(c, by_label, address), c).otherwise(label)


# ---------------------------------------------------------------------------- per message


def join_message_ids(ev: Any, by_label: dict[str, Any] | None = None, nodes: set[str] | None = None):
    """Rows keyed by message-id (Exchange 2010's, which have no network-message-id) take the
    network-message-id of their message, so a message crossing 2010 and 2013+ nodes is one
    message. First by the hop: a SEND row's reply names the internal-message-id the next hop gave
    the message (``queued as 52``, Exchange's ``[InternalId=52, Hostname=...]``), so a 2013+ node's
    SEND names the 2010 node's copy, and a 2010 node's SEND names a 2013+ node's RECEIVE whose
    network-message-id is known; the rows of that copy (node, internal-message-id and
    message-id alike) take it. Else by the message-id, when rows of other nodes give it one
    network-message-id only. A message-id given two or more (a message forked under new ids, or
    a client sending one Message-ID twice, to two nodes) and no hop: its rows stay keyed by the
    message-id. Only the rows without a network-message-id and the pairs of their message-ids
    take part in the joins; the other rows pass through. Hosts are compared by first label; a
    next hop the rows place elsewhere than the node of its label (``_peer_label``, with
    ``by_label`` and ``nodes`` from the facts) is no node's."""
    from pyspark.sql import functions as F

    bare = ev.filter(~F.col("has_netid"))
    wanted = bare.select(F.col("key").alias("mid")).distinct()
    with_netid = ev.filter(F.col("has_netid") & (F.col("message_id") != "")).join(
        wanted, F.col("message_id") == F.col("mid"), "left_semi")
    pairs = (with_netid.select(F.col("message_id").alias("mid"), F.col("key").alias("netid"))
             .groupBy("mid").agg(F.min("netid").alias("netid"), F.max("netid").alias("other")))
    pairs = pairs.filter(F.col("netid") == F.col("other")).select("mid", "netid")
    # a 2013+ node's SEND to a 2010 node: (that node, the id it gave, message-id) -> network id
    peer = _peer_label(ev, by_label, nodes)
    sent_to_bare = with_netid.filter(F.col("hop_id").isNotNull() & F.col("peer").isNotNull()).select(
        peer.alias("hnode"), F.col("hop_id").alias("hid"), F.col("message_id").alias("hmid"),
        F.col("key").alias("hnetid"))
    # a 2010 node's SEND to a 2013+ node: the RECEIVE it names carries the network id
    received = with_netid.filter((F.col("event") == "RECEIVE") & F.col("internal_id").isNotNull()).select(
        host_label("node").alias("rnode"), F.col("internal_id").alias("rid"), F.col("message_id").alias("rmid"),
        F.col("key").alias("hnetid"))
    bare_sends = bare.filter(F.col("hop_id").isNotNull() & F.col("peer").isNotNull()
                             & F.col("internal_id").isNotNull())
    sent_by_bare = bare_sends.join(
        received, (peer == F.col("rnode")) & (F.col("hop_id") == F.col("rid"))
        & (F.col("key") == F.col("rmid"))).select(
        host_label("node").alias("hnode"), F.col("internal_id").alias("hid"), F.col("key").alias("hmid"), "hnetid")
    hops = (sent_to_bare.unionByName(sent_by_bare).groupBy("hnode", "hid", "hmid")
            .agg(F.min("hnetid").alias("hnetid"), F.max("hnetid").alias("hother"))
            .filter(F.col("hnetid") == F.col("hother")).drop("hother"))
    joined = (bare.join(hops, (host_label("node") == F.col("hnode")) & (F.col("internal_id") == F.col("hid"))
                        & (F.col("key") == F.col("hmid")), "left")
              .join(pairs, F.col("key") == F.col("mid"), "left")
              .withColumn("key", F.coalesce(F.col("hnetid"), F.col("netid"), F.col("key")))
              .withColumn("has_netid", F.col("hnetid").isNotNull() | F.col("netid").isNotNull())
              .drop("mid", "netid", "hnode", "hid", "hmid", "hnetid"))
    return ev.filter(F.col("has_netid")).unionByName(joined)


LIST_EVENTS = tuple(sorted({"HAREDIRECT", "HAREDIRECTFAIL", "HARECEIVE", "HADISCARD", "RECEIVE", "RESUBMIT",
                            "DUPLICATEDELIVER", *DELIVERY_EVENTS, *ENTRY_EVENTS, *SUCCESS_EVENTS,
                            *FAILED_EVENTS, *RECIPIENT_CHANGE_EVENTS}))
"""Events whose rows a message's journey lists or its per-recipient figures read."""


def _per_node(ev: Any, facts: dict[str, Any]):
    """Per message, the figures that need its rows per node: plain aggregates only (minimum,
    maximum, sum, count of ``when`` expressions), which Spark runs as a code-generated hash
    aggregate, per (key, node); then merged per message, where the only lists are of nodes
    (a few per message): the nodes holding a copy at the end, the hold time of each shadow copy,
    the nodes whose shadow was neither discarded nor resubmitted."""
    from pyspark.sql import functions as F

    e, t, node = F.col("event"), F.col("time"), F.col("node")

    def when_event(events: Sequence[str], value: Any):
        return F.when(e.isin(*events), value)

    # A shadow copy discarded because it was resubmitted here is held on as the resubmitted copy.
    kept = ~((e == "HADISCARD") & F.coalesce(F.trim(F.substring_index(F.col("context"), ";", 1))
                                             == RESUBMITTED_DISCARD, F.lit(False)))
    redundancy = (e == "RESUBMIT") & (F.col("source") == "REDUNDANCY")
    # a mailbox's resubmission (Exchange's RESUBMIT from the store driver) is no copy in transport
    mailbox_resubmit = (e == "RESUBMIT") & F.coalesce(F.col("source") == MAILBOX_SOURCE, F.lit(False))
    cutoff = F.try_element_at(_map_lit(facts["cutoffs"], "timestamp"), node) \
        if facts["cutoffs"] else F.lit(None).cast("timestamp")
    take = e.isin(*TAKE_EVENTS) & ~mailbox_resubmit
    # A SEND releases the recipients it names where the sender keeps no copy (schema.RELEASE_EVENTS).
    logged = F.array(*[F.lit(n) for n in sorted(facts["nodes"])]) if facts.get("nodes") else F.array().cast(
        "array<string>")
    writer = F.col("writer")
    # transportd keeps a sent message as a shadow where shadow redundancy is on: a node that wrote
    # no row of it (HAREDIRECT, HAREDIRECTFAIL, HARECEIVE, HADISCARD) in the logs given runs without
    # it, and its SEND hands the message on (docs/PROTOCOL.md section 2).
    ha = sorted(n for n, by_event in facts.get("events_by_node", {}).items()
                if any(ev in by_event for ev in ("HAREDIRECT", "HAREDIRECTFAIL", "HARECEIVE", "HADISCARD")))
    ha_nodes = F.array(*[F.lit(n) for n in ha]) if ha else F.array().cast("array<string>")
    # (without the rows per node, as when facts are not given, every transportd node keeps its SENDs)
    plain_relay = ~F.array_contains(ha_nodes, node) if "events_by_node" in facts else F.lit(False)
    send_releases = (e == "SEND") & ((writer == "exchange") | (
        (writer == "exchange2010") & F.coalesce(~F.array_contains(logged, F.col("peer")), F.lit(True)))
        | ((writer == "transportd") & plain_relay))
    # A transportd SEND that releases nothing keeps a fork of the recipients it names, released by
    # the next hop's discard (HADISCARD on the sender): on a node that has such a fork its
    # HADISCARD ends those recipients, not the whole copy (others may still be queued there).
    fork_send = (e == "SEND") & F.coalesce((writer == "transportd") & ~plain_relay, F.lit(False))
    discard = (e == "HADISCARD") & kept
    # The recipients a node took: those of its last take that names any (a copy promoted after its
    # primary processed some recipients takes only the others, and its RESUBMIT names them), else
    # of its largest take (our RESUBMIT named none before); where rows are keyed by Message-ID
    # (Exchange 2010's), the distinct recipients of all its takes, for one Message-ID may be two
    # transactions (two copies) there.
    if facts.get("by_message_id"):
        taken = F.size(F.array_distinct(F.flatten(F.collect_list(F.when(take, F.col("recipients"))))))
    else:
        named = take & (F.size("recipients") > 0)
        taken = F.coalesce(F.max_by(F.when(named, F.size("recipients")), F.when(named, t)),
                           F.max(F.when(take, F.size("recipients"))))
    kn = ev.groupBy("key", "node").agg(
        F.max(F.when(take, t)).alias("last_take"),
        F.max(F.when((e.isin(*RELEASE_EVENTS) & kept) | send_releases, t)).alias("last_release"),
        F.max(F.when(e.isin(*COPY_RELEASE_EVENTS) & kept & (e != "HADISCARD"), t)).alias("last_badmail"),
        F.max(F.when(discard, t)).alias("last_discard"),
        F.max(F.when(fork_send, t)).alias("last_fork_send"),
        F.sum(F.when(fork_send, F.size("recipients"))).alias("forked_count"),
        F.sum(fork_send.cast("int")).alias("forks"),
        F.sum(discard.cast("int")).alias("discards"),
        taken.alias("taken_count"),
        F.sum(F.when((e.isin(*RELEASE_EVENTS) & ~e.isin(*COPY_RELEASE_EVENTS)) | send_releases,
                     F.size("recipients"))).alias("own_released_count"),
        F.min(when_event(["HARECEIVE"], t)).alias("shadow_received"),
        F.min(F.when((e == "HADISCARD") & kept, t)).alias("shadow_discarded"),
        F.min(F.when(redundancy, t)).alias("promoted_here"),
        F.max("has_netid").alias("has_netid"),
        F.max(e == "DSN").alias("generated"),
        F.min(when_event(["HAREDIRECTFAIL"], t)).alias("haredirectfail_time"),
        F.sum((e == "HAREDIRECTFAIL").cast("int")).alias("haredirectfail_count"),
        F.max(e == "HARECEIVE").alias("has_shadow_copy"),
        F.max(redundancy).alias("promoted"),
        F.count(F.lit(1)).alias("event_count"),
        F.max(t).alias("last_event_time"),
    ).withColumn("cutoff", cutoff)
    forked = F.col("last_fork_send").isNotNull()
    kn = (kn.withColumn("last_copy_release", F.greatest("last_badmail", F.when(~forked, F.col("last_discard"))))
          .withColumn("released_count", F.coalesce("own_released_count", F.lit(0)) + F.when(
              forked & (F.col("last_discard") >= F.col("last_fork_send")) & (F.col("discards") >= F.col("forks")),
              F.col("forked_count")).otherwise(0)))
    dead = F.coalesce(F.col("cutoff").isNotNull() & (F.col("last_take") < F.col("cutoff")), F.lit(False))
    # A node holds its copy from its last take until a release of the whole copy (a shadow
    # discarded, Exchange's BADMAIL), or until its deliveries and failures (rows about the
    # recipients they name) have named as many recipients as it took: a node that delivered one
    # recipient still holds the message for the others (queued there, or handed on by SEND and
    # kept until the next hop's discard).
    holds = (F.col("last_take").isNotNull() & ~dead
             & (F.col("last_copy_release").isNull() | (F.col("last_take") > F.col("last_copy_release")))
             & (F.col("last_release").isNull() | (F.col("last_take") > F.col("last_release"))
                | (F.coalesce(F.col("released_count"), F.lit(0)) < F.coalesce(F.col("taken_count"), F.lit(0)))))
    hold = F.when(F.col("shadow_discarded") >= F.col("shadow_received"),
                  F.col("shadow_discarded").cast("double") - F.col("shadow_received").cast("double"))
    undiscarded = (F.col("shadow_received").isNotNull() & F.col("shadow_discarded").isNull()
                   & F.col("promoted_here").isNull() & ~dead)
    return kn.groupBy("key").agg(
        F.max("has_netid").alias("has_netid"),
        F.max("generated").alias("generated"),
        F.min("haredirectfail_time").alias("haredirectfail_time"),
        F.sum("haredirectfail_count").alias("haredirectfail_count"),
        F.max("has_shadow_copy").alias("has_shadow_copy"),
        F.max("promoted").alias("promoted"),
        F.sum("event_count").alias("event_count"),
        F.max("last_event_time").alias("last_event_time"),
        F.sum(holds.cast("int")).alias("live_copies"),
        F.sort_array(F.collect_list(F.when(holds, node))).alias("live_copy_nodes"),
        F.collect_list(hold).alias("shadow_hold_seconds"),
        F.collect_list(F.when(undiscarded, node)).alias("undiscarded_nodes"),
    )


def _rows_per_message(ev: Any, partitions: int | None):
    """Per message, its rows of the LIST_EVENTS as one list (one small struct per row, only the
    fields that event carries), its message-id and sender: one ``collect_list`` for every list
    the journey shows, cut apart per event by ``_journey``. The struct is built before the
    shuffle (code-generated), so the aggregate only appends it."""
    from pyspark.sql import functions as F

    e = F.col("event")
    row = F.struct(F.col("time"), e.alias("event"), F.col("node"), F.col("recipients"), F.col("replaced"),
                   F.col("peer"), F.col("context"), F.col("source"), F.col("reason"), F.col("client_hostname"))
    rows = ev.select("key", "message_id", F.when(e == "RECEIVE", F.col("sender")).alias("sender"),
                     F.when(e.isin(*LIST_EVENTS), row).alias("row"))
    rows = rows.repartition(partitions, "key") if partitions else rows.repartition("key")
    return rows.groupBy("key").agg(
        F.max("message_id").alias("message_id"),
        F.max("sender").alias("sender"),
        F.collect_list("row").alias("rows"),
    )


def _journey(m: Any):
    """The journey's lists cut from a message's rows (each sorted, by time first), its first
    RECEIVE, first HAREDIRECT or HAREDIRECTFAIL and first HAREDIRECT, and the nodes whose shadow
    was never discarded once its primary let its copy go."""
    from pyspark.sql import functions as F

    rows = F.col("rows")

    def pick(events: Sequence[str], fields: dict[str, Any], sort: bool = True):
        picked = F.transform(F.filter(rows, lambda r: r["event"].isin(*events)),
                             lambda r: F.struct(*[(r[v] if isinstance(v, str) else v(r)).alias(k)
                                                  for k, v in fields.items()]))
        return F.sort_array(picked) if sort else picked

    m = (m.withColumn("redundancy_events", pick(["HAREDIRECT", "HAREDIRECTFAIL"], {
            "time": "time", "fail": lambda r: r["event"] == "HAREDIRECTFAIL"}))
         .withColumn("hareceive", pick(["HARECEIVE"], {"time": "time", "node": "node", "primary": "client_hostname"}))
         .withColumn("hadiscard", pick(["HADISCARD"], {"time": "time", "node": "node", "context": "context"}))
         .withColumn("deliveries", pick(DELIVERY_EVENTS, {"time": "time", "event": "event", "node": "node",
                                                          "recipients": "recipients", "next_hop": "peer"}))
         .withColumn("receives", pick(["RECEIVE"], {"time": "time", "node": "node"}, sort=False))
         .withColumn("resubmits", pick(["RESUBMIT"], {"time": "time", "node": "node", "source": "source",
                                                      "primary": "peer", "reason": "reason", "context": "context"}))
         .withColumn("duplicate_delivers", pick(["DUPLICATEDELIVER"], {"time": "time", "node": "node",
                                                                      "recipients": "recipients"}))
         .withColumn("first_receive", F.array_min("receives"))
         # the first of redundancy_events (sorted by time, then HAREDIRECT before HAREDIRECTFAIL)
         .withColumn("first_redundancy", F.array_min("redundancy_events"))
         .withColumn("shadow", F.array_min(pick(["HAREDIRECT"], {"time": "time", "node": "peer"}, sort=False))))
    # A shadow not discarded is an anomaly only once its primary has let its copy go: a primary
    # that still holds the message (a promoted copy not yet delivered) keeps its shadow legitimately.
    # The primary of a shadow is named by its node's HARECEIVE (the least name if several).

    def primary_of(n: Any):
        return F.array_min(F.transform(F.filter("hareceive", lambda h: h["node"] == n), lambda h: h["primary"]))

    return m.withColumn("undiscarded_shadow_nodes", F.sort_array(F.filter(
        "undiscarded_nodes", lambda n: ~F.coalesce(F.array_contains("live_copy_nodes", primary_of(n)), F.lit(False)))))


def build_messages(ev: Any, log_end: Any, facts: dict[str, Any] | None = None, partitions: int | None = None):
    """One row per message key with its journey and final state (lazy DataFrame).

    The rows are shuffled by message key into two aggregates: the per-node figures
    (``_per_node``: plain aggregates per (key, node), then per key) and the message's rows as one
    list (``_rows_per_message``); the two are joined by key on the same partitions, and the
    journey, the per-recipient figures and the state are computed from the message's few rows.
    """
    from pyspark.sql import functions as F

    facts = facts or {"rename": {}, "cutoffs": {}, "nodes": set()}
    rename = facts["rename"]
    by_label = facts.get("by_label")

    ev = ev.filter(F.col("key").isNotNull())
    if facts.get("by_netid") and facts.get("by_message_id"):
        ev = join_message_ids(ev, by_label, facts.get("nodes"))
    ev = (ev
          .select("key", "time", _renamed("node", rename).alias("node"), "event", "source",
                  _renamed("peer", rename, by_label, "peer_ip" if "peer_ip" in ev.columns else None).alias("peer"),
                  "reason", "recipients", "replaced", "context",
                  _renamed("client_hostname", rename, by_label).alias("client_hostname"), "sender", "writer",
                  "has_netid", "message_id"))
    # Two shuffles by key, one per aggregate (each reads only its columns); the join of the two
    # results is on those same partitions (no third exchange). Each task aggregates the keys of its
    # partition in a hash map (see analyze: partitions are sized to the input).
    by_key = ev.repartition(partitions, "key") if partitions else ev.repartition("key")
    m = _journey(_per_node(by_key, facts).hint("shuffle_hash").join(_rows_per_message(ev, partitions), "key"))
    wanted_events = (*ENTRY_EVENTS, "HARECEIVE")

    # -- per (message, recipient), from the message's few recipient rows: done or not, duplicates.
    # The recipients of a message are those of its RECEIVE, HARECEIVE and DSN rows, with those an
    # Exchange EXPAND, RESOLVE, REDIRECT or DUPLICATEREDIRECT row replaced by its own (a group by
    # its members, nested groups too: a group both added and replaced is replaced), except where a
    # row keeps the recipient (redirected and kept: deliver and forward).
    rev = F.col("rows")
    changes = F.filter(rev, lambda x: x["event"].isin(*RECIPIENT_CHANGE_EVENTS) & (F.size(x["replaced"]) > 0))
    wanted = F.array_except(
        F.array_distinct(F.concat(
            F.flatten(F.transform(F.filter(rev, lambda x: x["event"].isin(*wanted_events)), lambda x: x["recipients"])),
            F.flatten(F.transform(changes, lambda x: x["recipients"])))),
        F.array_except(F.flatten(F.transform(changes, lambda x: F.array_except(x["replaced"], x["recipients"]))),
                       F.flatten(F.transform(changes, lambda x: F.array_intersect(x["replaced"], x["recipients"])))))

    def first(events: Sequence[str], r):
        return F.array_min(F.transform(F.filter(rev, lambda x: x["event"].isin(*events) & F.array_contains(
            x["recipients"], r)), lambda x: x["time"]))

    def times(event: str, r):
        return F.size(F.filter(rev, lambda x: (x["event"] == event) & F.array_contains(x["recipients"], r)))

    per_rcpt = F.transform(wanted, lambda r: F.struct(
        r.alias("recipient"), first(SUCCESS_EVENTS, r).alias("succeeded"), first(FAILED_EVENTS, r).alias("failed"),
        times("SENDEXTERNAL", r).alias("external"), times("DELIVER", r).alias("mailbox")))
    m = m.withColumn("rcpt", per_rcpt)
    rc = F.col("rcpt")
    m = (m.withColumn("recipient_count", F.when(F.size(rc) > 0, F.size(rc)))
         .withColumn("recipients_delivered", F.size(F.filter(rc, lambda s: s["succeeded"].isNotNull())))
         .withColumn("recipients_failed", F.size(F.filter(
             rc, lambda s: s["succeeded"].isNull() & s["failed"].isNotNull())))
         .withColumn("last_done", F.array_max(F.transform(rc, lambda s: F.coalesce(s["succeeded"], s["failed"]))))
         .withColumn("duplicate_external_recipients", F.sort_array(F.transform(
             F.filter(rc, lambda s: s["external"] > 1), lambda s: s["recipient"])))
         .withColumn("duplicate_mailbox_recipients", F.sort_array(F.transform(
             F.filter(rc, lambda s: s["mailbox"] > 1), lambda s: s["recipient"]))))

    terminal = (F.col("recipient_count") > 0) & (F.col("recipients_delivered") + F.col("recipients_failed")
                                                == F.col("recipient_count"))
    received = (F.col("first_receive").isNotNull() | F.col("has_shadow_copy")
                | F.coalesce(F.col("generated"), F.lit(False)))
    live = F.coalesce(F.col("live_copies"), F.lit(0))

    # -- the journey left the logs given: a SEND to a named server whose logs were not read, or
    # (the next hop unnamed, as in our rows) a SEND no other node read follows with a RECEIVE.
    logged = F.array(*[F.lit(n) for n in sorted(facts["nodes"])]) if facts["nodes"] else F.array().cast(
        "array<string>")
    end_s = log_end.cast("double")

    def unfollowed(s):
        named_outside = s["next_hop"].isNotNull() & ~F.array_contains(logged, s["next_hop"])
        no_receive = ~F.exists("receives", lambda r: (r["node"] != s["node"]) & (
            r["time"].cast("double") >= s["time"].cast("double") - SEND_FOLLOW_SECONDS))
        return (s["event"] == "SEND") & (named_outside | (
            s["next_hop"].isNull() & no_receive & (s["time"].cast("double") < end_s - SEND_FOLLOW_SECONDS)))

    left = F.exists("deliveries", unfollowed)
    state = (F.when(~received, F.lit("incomplete"))
             .when(terminal & (F.col("recipients_failed") == 0), F.lit("delivered"))
             .when(terminal, F.lit("failed"))
             .when(left, F.lit("left the logs"))
             .when(live >= 2, F.lit("in flight protected"))
             .when(live == 1, F.lit("in flight unprotected"))
             .otherwise(F.lit("lost")))
    m = (m.withColumn("state", state)
         .withColumn("terminal_time", F.when(terminal, F.col("last_done"))))

    # -- time spent unprotected: from each HAREDIRECTFAIL to the next HAREDIRECT (or
    # HAREDIRECTFAIL), the message's terminal event, or the end of the logs, whichever comes first.
    stop = F.coalesce(F.col("terminal_time"), log_end).cast("double")
    reds = F.col("redundancy_events")
    nexts = F.concat(F.transform(F.slice(reds, 2, 1 << 30), lambda r: r["time"].cast("double")),
                     F.array(F.lit(None).cast("double")))
    gaps = F.zip_with(reds, nexts, lambda r, n: F.when(
        r["fail"], F.greatest(F.least(F.coalesce(n, stop), stop) - r["time"].cast("double"), F.lit(0.0))
    ).otherwise(F.lit(0.0)))
    unprotected = F.aggregate(gaps, F.lit(0.0), lambda acc, g: acc + g)
    latency = F.col("terminal_time").cast("double") - F.col("first_receive.time").cast("double")

    rec = F.col("first_receive").isNotNull()
    return m.select(
        "key", F.when(F.col("has_netid"), F.col("key")).otherwise(F.lit("")).alias("network_message_id"),
        "message_id", "sender",
        F.col("first_receive.node").alias("receive_node"),
        F.col("first_receive.time").alias("receive_time"),
        (rec & F.coalesce(~F.col("first_redundancy.fail"), F.lit(False)))
        .alias("redundant_at_receipt"),
        (rec & F.coalesce(F.col("first_redundancy.fail"), F.lit(False)))
        .alias("unprotected_at_receipt"),
        F.col("shadow.node").alias("shadow_node"),
        F.col("shadow.time").alias("haredirect_time"),
        "haredirectfail_time", "haredirectfail_count", "hareceive", "hadiscard", "deliveries",
        "resubmits", "duplicate_delivers", F.coalesce("promoted", F.lit(False)).alias("promoted"),
        "recipient_count", "recipients_delivered", "recipients_failed",
        F.coalesce("duplicate_external_recipients", F.array()).alias("duplicate_external_recipients"),
        F.coalesce("duplicate_mailbox_recipients", F.array()).alias("duplicate_mailbox_recipients"),
        F.coalesce("live_copies", F.lit(0)).alias("live_copies"), "live_copy_nodes",
        "shadow_hold_seconds", "undiscarded_shadow_nodes",
        F.coalesce(unprotected, F.lit(0.0)).alias("unprotected_seconds"),
        "state", "terminal_time",
        # two servers' clocks a little apart can put the end before the receipt: no negative time
        F.when(latency < 0, F.lit(0.0)).otherwise(latency).alias("latency_seconds"),
        "event_count", "last_event_time",
    )


def build_anomalies(messages: Any, log_end: Any, grace_seconds: float):
    """Lost messages, shadows never discarded nor resubmitted, duplicates outside the boundary."""
    from pyspark.sql import functions as F

    base = ["key", "network_message_id", "message_id"]
    lost = messages.filter(F.col("state") == "lost").select(
        *base, F.lit("lost").alias("kind"), F.col("receive_node").alias("node"),
        F.col("receive_time").alias("time"),
        F.lit("received, no terminal event, no live copy at the end of the logs").alias("detail"))
    settled_early = F.col("terminal_time") < (log_end - F.expr(f"INTERVAL {int(grace_seconds)} SECONDS"))
    stale = messages.filter(settled_early & (F.size("undiscarded_shadow_nodes") > 0)).select(
        *base, F.lit("shadow never discarded").alias("kind"),
        F.array_join("undiscarded_shadow_nodes", ";").alias("node"),
        F.col("terminal_time").alias("time"),
        F.concat(F.lit("message "), F.col("state"), F.lit("; shadow still held, neither discarded nor resubmitted"))
        .alias("detail"))
    dup = messages.filter(F.size("duplicate_external_recipients") > 0).select(
        *base, F.lit("duplicate outside boundary").alias("kind"),
        F.array_join(F.transform(F.filter("deliveries", lambda d: d["event"] == "SENDEXTERNAL"),
                                 lambda d: d["node"]), ";").alias("node"),
        F.col("terminal_time").alias("time"),
        F.concat(F.lit("sent outside the boundary more than once to "),
                 F.array_join("duplicate_external_recipients", ";")).alias("detail"))
    return lost.unionByName(stale).unionByName(dup)


# ---------------------------------------------------------------------------- summary


def pick_bucket(span_seconds: float) -> int:
    """A round bucket size giving at most MAX_TIME_BUCKETS buckets over the span."""
    for size in NICE_BUCKETS:
        if span_seconds / size <= MAX_TIME_BUCKETS:
            return size
    return NICE_BUCKETS[-1]


def _bucket_col(col: Any, size: int):
    from pyspark.sql import functions as F
    return (F.floor(F.col(col).cast("double") / size) * size).cast("long")


def _distributions(messages: Any) -> dict[str, tuple[dict[str, float | None], list[dict]]]:
    """Approximate percentiles (1/10,000 accuracy) and the histogram over HISTOGRAM_EDGES of the
    latency of delivered messages and of the hold time of each shadow copy, in one pass: each
    message gives its values as (kind, value) rows, grouped by kind."""
    from pyspark.sql import functions as F

    kinds = ("latency_seconds", "shadow_hold_seconds")
    latency = F.when(F.col("state") == "delivered", F.col("latency_seconds"))
    values = F.concat(
        F.array(F.struct(F.lit(kinds[0]).alias("kind"), latency.cast("double").alias("v"))),
        F.transform(F.coalesce(F.col("shadow_hold_seconds"), F.array().cast("array<double>")),
                    lambda h: F.struct(F.lit(kinds[1]).alias("kind"), h.cast("double").alias("v"))))
    v = F.col("v")
    idx = F.lit(len(HISTOGRAM_EDGES) - 1)
    for i in range(len(HISTOGRAM_EDGES) - 1, 0, -1):
        idx = F.when(v < HISTOGRAM_EDGES[i], F.lit(i - 1)).otherwise(idx)
    counts = [F.sum((idx == i).cast("long")).alias(f"h{i}") for i in range(len(HISTOGRAM_EDGES))]
    rows = {r["kind"]: r for r in (
        messages.select(F.inline(values)).filter(v.isNotNull()).groupBy("kind")
        .agg(F.percentile_approx("v", [0.5, 0.95, 0.99], 10000).alias("p"), F.count("v").alias("n"), *counts)
        .collect())}
    out = {}
    for kind in kinds:
        row = rows.get(kind)
        values_ = (row["p"] if row else None) or [None, None, None]
        hist = []
        for i, low in enumerate(HISTOGRAM_EDGES):
            high = HISTOGRAM_EDGES[i + 1] if i + 1 < len(HISTOGRAM_EDGES) else None
            hist.append({"from": low, "to": high, "count": int(row[f"h{i}"] or 0) if row else 0})
        out[kind] = ({"count": int(row["n"]) if row else 0, "p50": values_[0], "p95": values_[1],
                      "p99": values_[2]}, hist)
    return out


def _ts(value: Any) -> str | None:
    """A timestamp collected from Spark as UTC text. PySpark gives a naive datetime in this
    process's local time zone (whatever the session's): ``astimezone`` takes it as such."""
    from datetime import UTC
    if value is None:
        return None
    value = value.astimezone(UTC)
    return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


def summarize(spark: Any, messages: Any, anomalies: Any, malformed: Any, facts: dict[str, Any],
              episode_gap: float, grace_seconds: float = 600.0, anomaly_sample: int = 200) -> dict:
    """Aggregates only, from the per-message table (and the facts pass): every ``collect`` here
    returns per-node, per-bucket, per-state or bounded rows."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    log_start, log_end = facts["start"], facts["end"]
    span = (log_end - log_start).total_seconds() if log_start and log_end else 0.0
    bucket = pick_bucket(span)
    summary: dict[str, Any] = {
        "log_start": _ts(log_start), "log_end": _ts(log_end), "bucket_seconds": bucket,
    }
    end_lit = F.lit(log_end).cast("timestamp") if log_end else F.current_timestamp()

    # One pass: per receiving node, time bucket and state (at most nodes x 120 x states rows).
    received = F.col("receive_node").isNotNull()
    red = F.coalesce(F.col("redundant_at_receipt"), F.lit(False))
    settled_early = F.col("terminal_time") < (end_lit - F.expr(f"INTERVAL {int(grace_seconds)} SECONDS"))
    rows = messages.groupBy(
        "receive_node", _bucket_col("receive_time", bucket).alias("bucket"), "state").agg(
        F.count(F.lit(1)).alias("messages"),
        F.sum((received & red).cast("int")).alias("redundant"),
        F.sum((received & F.col("unprotected_at_receipt")).cast("int")).alias("unprotected_messages"),
        F.sum(F.when(received, F.col("unprotected_seconds")).otherwise(0.0)).alias("unprotected_seconds"),
        F.sum(F.col("promoted").cast("int")).alias("promoted"),
        F.sum((F.size("duplicate_delivers") > 0).cast("int")).alias("dup_inside"),
        F.sum((F.size("duplicate_external_recipients") > 0).cast("int")).alias("dup_outside"),
        F.sum((F.size("duplicate_mailbox_recipients") > 0).cast("int")).alias("dup_mailbox"),
        F.sum((settled_early & (F.size("undiscarded_shadow_nodes") > 0)).cast("int")).alias("stale"),
    ).collect()

    states = dict.fromkeys(STATES, 0)
    tot: dict[str, float] = {}
    per_node: dict[str, dict[str, float]] = {}
    timeline: dict[int, dict[str, Any]] = {}
    keys = ("redundant", "unprotected_messages", "unprotected_seconds", "promoted", "dup_inside",
            "dup_outside", "dup_mailbox", "stale")
    for r in rows:
        n = int(r["messages"])
        states[r["state"]] = states.get(r["state"], 0) + n
        for k in keys:
            tot[k] = tot.get(k, 0) + (r[k] or 0)
        if r["receive_node"] is None:
            continue
        tot["received"] = tot.get("received", 0) + n
        node = per_node.setdefault(r["receive_node"], {"received": 0, "redundant": 0, "unprotected_seconds": 0.0,
                                                       "unprotected_messages": 0, "lost": 0})
        node["received"] += n
        node["redundant"] += int(r["redundant"] or 0)
        node["unprotected_seconds"] += float(r["unprotected_seconds"] or 0.0)
        node["unprotected_messages"] += int(r["unprotected_messages"] or 0)
        node["lost"] += n if r["state"] == "lost" else 0
        if r["bucket"] is not None:
            slot = timeline.setdefault(int(r["bucket"]), {"received": 0, "redundant": 0, "by_node": {},
                                                          "lost": 0, "unprotected": 0})
            slot["received"] += n
            slot["redundant"] += int(r["redundant"] or 0)
            slot["by_node"][r["receive_node"]] = slot["by_node"].get(r["receive_node"], 0) + n
            slot["lost"] += n if r["state"] == "lost" else 0
            slot["unprotected"] += int(r["unprotected_messages"] or 0)

    received_n = int(tot.get("received", 0))
    summary["messages"] = sum(states.values())
    summary["states"] = states
    summary["received"] = received_n
    summary["redundant"] = int(tot.get("redundant", 0))
    summary["redundancy_coverage"] = (summary["redundant"] / received_n) if received_n else None
    summary["unprotected_messages"] = int(tot.get("unprotected_messages", 0))
    summary["unprotected_share"] = (summary["unprotected_messages"] / received_n) if received_n else None
    summary["unprotected_seconds"] = float(tot.get("unprotected_seconds", 0.0))
    summary["promoted"] = int(tot.get("promoted", 0))
    summary["lost"] = states["lost"]
    summary["duplicates"] = {"inside_boundary": int(tot.get("dup_inside", 0)),
                             "outside_boundary": int(tot.get("dup_outside", 0)),
                             "reached_mailbox": int(tot.get("dup_mailbox", 0))}
    summary["coverage_by_node"] = [
        {"node": n, "received": int(c["received"]), "redundant": int(c["redundant"]),
         "coverage": c["redundant"] / c["received"] if c["received"] else None,
         "unprotected_messages": int(c["unprotected_messages"]),
         "unprotected_seconds": float(c["unprotected_seconds"]), "lost": int(c["lost"])}
        for n, c in sorted(per_node.items())]
    summary["timeline"] = [
        {"time": _ts_from_epoch(b), "received": s["received"], "redundant": s["redundant"],
         "coverage": s["redundant"] / s["received"] if s["received"] else None, "by_node": s["by_node"],
         "lost": s["lost"], "unprotected": s["unprotected"]}
        for b, s in sorted(timeline.items())]

    # percentiles and histograms: latency of delivered messages, hold time of each shadow copy
    dist = _distributions(messages)
    summary["latency_seconds"], lat_hist = dist["latency_seconds"]
    summary["shadow_hold_seconds"], hold_hist = dist["shadow_hold_seconds"]
    summary["histograms"] = {"latency_seconds": lat_hist, "shadow_hold_seconds": hold_hist}

    # failover episodes: RESUBMIT REDUNDANCY by promoting node, primary and reason, split by gaps
    resubmits = (messages.filter(F.size("resubmits") > 0)
                 .select("key", F.explode("resubmits").alias("r"))
                 .select("key", "r.time", "r.node", "r.source", F.col("r.primary").alias("peer"), "r.reason"))
    promos = resubmits.filter(F.col("source") == "REDUNDANCY")
    w = Window.partitionBy("node", "peer", "reason").orderBy("time")
    gap = F.col("time").cast("double") - F.lag("time").over(w).cast("double")
    episodes = (promos.withColumn("new", F.when(gap.isNull() | (gap > episode_gap), 1).otherwise(0))
                .withColumn("episode", F.sum("new").over(w.rowsBetween(Window.unboundedPreceding, 0)))
                .groupBy("node", "peer", "reason", "episode")
                .agg(F.min("time").alias("start"), F.max("time").alias("end"),
                     F.countDistinct("key").alias("messages"))
                .orderBy("start").limit(1000).collect())
    summary["failover_episodes"] = [
        {"shadow_node": r["node"], "primary": r["peer"], "reason": r["reason"], "start": _ts(r["start"]),
         "end": _ts(r["end"]), "messages": int(r["messages"])} for r in episodes]
    safety = (resubmits.filter(F.col("source") == "SAFETYNET").groupBy("node")
              .agg(F.countDistinct("key").alias("messages")).collect())
    summary["safety_net_resubmits"] = {r["node"]: int(r["messages"]) for r in safety}

    summary["events_by_node"] = facts["events_by_node"]
    summary["events"] = int(facts["rows"])
    summary["non_message_rows"] = {"rows": int(sum(facts["non_message"].values())),
                                   "by_event": dict(sorted(facts["non_message"].items()))}
    summary["node_names"] = dict(sorted(facts["rename"].items()))

    # malformed rows (counted in the facts pass)
    bad = sorted(facts["malformed_by_file"].items(), key=lambda kv: (-kv[1], kv[0]))
    summary["malformed"] = {"rows": int(facts["malformed"]),
                            "by_file": [{"file": f, "reason": why, "rows": n} for (f, why), n in bad[:200]]}

    # anomalies: counted in the pass above, a bounded sample read back
    summary["anomalies"] = {
        "counts": {"lost": states["lost"], "shadow never discarded": int(tot.get("stale", 0)),
                   "duplicate outside boundary": summary["duplicates"]["outside_boundary"]},
        "sample": [{**r.asDict(), "time": _ts(r["time"])}
                   for r in anomalies.orderBy("kind", "time", "key").limit(anomaly_sample).collect()],
    }
    return summary


def _ts_from_epoch(seconds: int) -> str:
    from datetime import UTC, datetime
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------- output


def write_text(spark: Any, uri: str, text: str) -> None:
    """Write one small file through Hadoop's FileSystem: works for local, HDFS and S3 paths."""
    jvm = spark.sparkContext._jvm
    path = jvm.org.apache.hadoop.fs.Path(uri)
    fs = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    stream = fs.create(path, True)
    try:
        stream.write(bytearray(text.encode("utf-8")))
    finally:
        stream.close()


def remove(spark: Any, uri: str) -> None:
    """Delete a folder through Hadoop's FileSystem (local, HDFS, S3 alike); quiet if it is gone."""
    jvm = spark.sparkContext._jvm
    path = jvm.org.apache.hadoop.fs.Path(uri)
    try:
        path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()).delete(path, True)
    except Exception:  # noqa: BLE001, S110 - a scratch folder left behind is harmless
        pass


def _join(out: str, name: str) -> str:
    return out.rstrip("/") + "/" + name


def console_table(summary: dict) -> str:
    """The summary as a few plain-text tables for the terminal."""
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f} %"

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f} s"

    lines = [(f"logs {summary['log_start']} .. {summary['log_end']}: {summary['events']} events, "
              f"{summary['messages']} messages, {summary['malformed']['rows']} malformed rows")]
    gone = summary.get("files_removed_while_read") or []
    if gone:
        lines.append(f"warning:     {len(gone)} input file(s) removed while the job read them (a node's "
                     f"retention?): their rows may be missing, e.g. {gone[0]}")
    lines.append("states:      " + ", ".join(f"{k} {v}" for k, v in summary["states"].items()))
    lines.append(f"coverage:    {pct(summary['redundancy_coverage'])} of {summary['received']} received "
                 f"made redundant; {summary['unprotected_messages']} accepted unprotected, "
                 f"{summary['unprotected_seconds']:.1f} s unprotected in all")
    lines.append(f"promoted:    {summary['promoted']} messages in {len(summary['failover_episodes'])} "
                 f"failover episode(s)")
    d = summary["duplicates"]
    lines.append(f"duplicates:  {d['inside_boundary']} dropped inside the boundary (DUPLICATEDELIVER), "
                 f"{d['outside_boundary']} delivered twice outside, {d['reached_mailbox']} stored twice")
    for name in ("latency_seconds", "shadow_hold_seconds"):
        p = summary[name]
        lines.append(f"{name.replace('_seconds', '').replace('_', ' '):12} n={p['count']} p50 {secs(p['p50'])} "
                     f"p95 {secs(p['p95'])} p99 {secs(p['p99'])}")
    a = summary["anomalies"]["counts"]
    lines.append("anomalies:   " + ", ".join(f"{k} {v}" for k, v in a.items()))
    lines.append("")
    lines.append(f"{'node':32} {'received':>9} {'coverage':>9} {'unprot s':>9} {'events':>9}")
    events = summary["events_by_node"]
    cov = {c["node"]: c for c in summary["coverage_by_node"]}
    for node in sorted(set(events) | set(cov)):
        c = cov.get(node, {})
        lines.append(f"{node[:32]:32} {c.get('received', 0):>9} {pct(c.get('coverage')):>9} "
                     f"{c.get('unprotected_seconds', 0.0):>9.1f} {sum(events.get(node, {}).values()):>9}")
    if summary["failover_episodes"]:
        lines.append("")
        lines.append(f"{'failover start':25} {'shadow node':24} {'primary':24} {'reason':24} {'messages':>8}")
        for ep in summary["failover_episodes"][:20]:
            lines.append(f"{ep['start']:25} {ep['shadow_node'][:24]:24} {ep['primary'][:24]:24} "
                         f"{ep['reason'][:24]:24} {ep['messages']:>8}")
    return "\n".join(lines)


def _input_bytes(files: Sequence[str]) -> int | None:
    """The size of the input files, or None when one is not local."""
    size = 0
    for f in files:
        if "://" in f:
            return None
        try:
            size += os.path.getsize(f)
        except OSError:
            pass
    return size


def _split_bytes(spark: Any, files: Sequence[str]) -> int | None:
    """Bytes per input split for the parse: about eight splits per core (so the last wave of
    tasks is short), between 8 MiB and Spark's 128 MiB; None when the user set
    spark.sql.files.maxPartitionBytes or the input is not local."""
    size = _input_bytes(files)
    if size is None or spark.conf.get("spark.sql.files.maxPartitionBytes", None) is not None:
        return None
    cores = spark.sparkContext.defaultParallelism
    return max(8 << 20, min(128 << 20, math.ceil(size / (8 * cores))))


def _partitions(spark: Any, files: Sequence[str]) -> int | None:
    """Shuffle partitions fit to the input: about one per PARTITION_BYTES, rounded up to a multiple
    of the default parallelism; None (Spark's setting) when the user set spark.sql.shuffle.partitions."""
    if spark.sparkContext.getConf().contains("spark.sql.shuffle.partitions"):
        return None
    size = _input_bytes(files)
    if size is None:
        return None
    cores = spark.sparkContext.defaultParallelism
    # a whole number of waves: every core busy in the last one too
    return max(1, math.ceil(size / PARTITION_BYTES / cores)) * cores


def analyze(spark: Any, paths: Sequence[str], out: str, *, name_filter: str = DEFAULT_NAME_FILTER,
            recursive: bool = False, grace_seconds: float = 600.0, episode_gap: float = 60.0,
            progress: bool = True, report: bool = True, timings: dict[str, float] | None = None,
            write_events: bool = False) -> dict:
    """Run the whole job; returns the summary (also written to ``out``/summary.json).

    Spark jobs, in order: parse every row (the only pass over the text) and write the narrow
    events (``reader.narrow``) to a scratch folder, or every row typed to ``events/`` with
    ``write_events`` (read back through ``narrow_events``); the facts pass over them (span, rows
    per node and event, malformed rows, node names, when each node's copies died) and
    ``malformed/``; the per-message table (the rows shuffled by key into two aggregates joined
    on their partitions) written to ``messages/``; ``anomalies/``; then the summary's
    aggregates, all from ``messages/``. ``timings`` (if given) receives the seconds of each step."""
    from pyspark.sql import functions as F

    if not paths:
        raise AnalyzeError("no input paths given")
    shown: Any = Progress(spark) if progress else _NoProgress()
    if isinstance(shown, Progress):
        shown.start()
    started = time.monotonic()
    steps: dict[str, float] = timings if timings is not None else {}
    mark = [started]

    def step(name: str) -> None:
        now = time.monotonic()
        steps[name] = round(now - mark[0], 3)
        mark[0] = now

    scratch: list[str] = []
    restore: list[tuple[str, str | None]] = []
    try:
        shown.set_step("reading and parsing logs")
        spark.sparkContext.setJobDescription("parse MSGTRK rows")
        check_local_paths(paths)
        try:
            files = reader.list_files(spark, paths, name_filter, recursive)
        except reader.InputError as exc:
            raise AnalyzeError(str(exc)) from None
        if not files:
            raise AnalyzeError(f"no tracking log rows in {', '.join(paths)}")
        partitions = _partitions(spark, files)
        spark.conf.set("spark.sql.csv.parser.columnPruning.enabled", "false")
        split = _split_bytes(spark, files)
        if split:
            spark.conf.set("spark.sql.files.maxPartitionBytes", str(split))
            restore.append(("spark.sql.files.maxPartitionBytes", None))
        rows = reader.read_rows(spark, files)
        # The text is parsed once, and written once: every row typed to events/ (--events), or
        # only the narrow columns the job reads to a scratch folder removed at the end. Every
        # later step reads them from there.
        if write_events:
            _write_events(spark, reader.normalize(rows), _join(out, "events"))
        else:
            scratch.append(_join(out, "parsed.scratch"))
            reader.narrow(rows).write.option("parquet.enable.dictionary", "false").mode("overwrite").parquet(
                scratch[-1])
        # The text has been read: a local file gone by now was removed while the job ran (a
        # node's tracking-log retention on a live folder): its rows, if it was gone before Spark
        # read it, are missing from what follows. Said in the summary, not a failure.
        removed = [f for f in files if "://" not in f and not os.path.exists(f)]
        step("parse")
        try:
            parsed = spark.read.parquet(_join(out, "events") if write_events else scratch[-1])
        except Exception as exc:  # nothing was written: all files were empty
            if "UNABLE_TO_INFER_SCHEMA" in str(exc) or "Unable to infer schema" in str(exc):
                raise AnalyzeError(f"no tracking log rows in {', '.join(paths)}") from None
            raise
        if write_events:
            parsed = narrow_events(parsed.withColumn("valid", F.col("valid").cast("string") == "true"))
        valid = F.col("valid")
        ev = parsed.filter(valid).drop("valid", "malformed_reason", "line", "file")
        malformed = parsed.filter(~valid).select("file", F.col("malformed_reason").alias("reason"), "line")

        shown.set_step("facts per node")
        spark.sparkContext.setJobDescription("facts per node")
        facts = collect_facts(parsed)
        if not facts["rows"] and not facts["malformed"]:
            raise AnalyzeError(f"no tracking log rows in {', '.join(paths)}")
        end_lit = F.lit(facts["end"]).cast("timestamp") if facts["end"] else F.current_timestamp()
        malformed.write.mode("overwrite").parquet(_join(out, "malformed"))
        step("facts")

        shown.set_step("joining messages across nodes")
        spark.sparkContext.setJobDescription("per-message journeys")
        # The object hash aggregate (collect_list) falls back to sorting every row past 128 keys
        # per task by default: let it hash a partition's keys (a partition is ~64 MB of input).
        fallback = spark.conf.get("spark.sql.objectHashAggregate.sortBased.fallbackThreshold", "128")
        spark.conf.set("spark.sql.objectHashAggregate.sortBased.fallbackThreshold", str(HASHED_KEYS))
        try:
            build_messages(ev, end_lit, facts, partitions).write.option("parquet.enable.dictionary", "false").mode("overwrite").parquet(
                _join(out, "messages"))
        finally:
            spark.conf.set("spark.sql.objectHashAggregate.sortBased.fallbackThreshold", fallback)
        messages = spark.read.parquet(_join(out, "messages"))
        step("messages")
        shown.set_step("anomalies")
        build_anomalies(messages, end_lit, grace_seconds).write.mode("overwrite").parquet(_join(out, "anomalies"))
        anomalies = spark.read.parquet(_join(out, "anomalies"))
        step("anomalies")

        shown.set_step("summary")
        spark.sparkContext.setJobDescription("summary aggregates")
        summary = summarize(spark, messages, anomalies, malformed, facts, episode_gap, grace_seconds)
        summary["inputs"] = list(paths)
        summary["files"] = len(files)
        summary["files_removed_while_read"] = removed
        summary["rows"] = int(facts["rows"]) + summary["malformed"]["rows"]
        step("summary")
        summary["seconds"] = round(time.monotonic() - started, 3)
        summary["rows_per_second"] = summary["rows"] / summary["seconds"] if summary["seconds"] else None
        summary["step_seconds"] = dict(steps)
        write_text(spark, _join(out, "summary.json"), json.dumps(summary, indent=2, default=str) + "\n")
        if report:
            from transportd.analytics.report import render
            shown.set_step("report")
            write_text(spark, _join(out, "report.html"), render(summary))
        shown.set_step(f"done in {summary['seconds']:.1f}s")
        return summary
    finally:
        for path in scratch:
            remove(spark, path)
        for key, value in restore:
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
        if isinstance(shown, Progress):
            shown.stop()


# ---------------------------------------------------------------------------- spark-submit


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="transportd-analyze",
                                description="Analyze MSGTRK logs of many nodes with Spark.")
    p.add_argument("paths", nargs="+", help="files, folders or globs (any path Spark reads)")
    p.add_argument("--out", required=True, help="output folder (any path Spark writes)")
    p.add_argument("--master", default=None, help="Spark master (default: spark-submit's, else local[*])")
    p.add_argument("--recursive", action="store_true", help="read folders recursively")
    p.add_argument("--name-filter", default=DEFAULT_NAME_FILTER, help="file-name glob inside folders")
    p.add_argument("--grace", type=float, default=600.0,
                   help="seconds after delivery before an undiscarded shadow is an anomaly")
    p.add_argument("--episode-gap", type=float, default=60.0,
                   help="promotions further apart than this many seconds are separate failover episodes")
    p.add_argument("--events", action="store_true",
                   help="also write every row, typed, to OUT/events/ (Parquet, partitioned by valid)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print summary.json instead of the table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_local_paths(args.paths)
        check_local_out(args.out)
    except AnalyzeError as exc:
        print(f"transportd analyze: error: {exc}", file=sys.stderr)
        return 2
    spark = spark_session(args.master)
    try:
        summary = analyze(spark, args.paths, args.out, name_filter=args.name_filter,
                          recursive=args.recursive, grace_seconds=args.grace,
                          episode_gap=args.episode_gap, progress=not args.no_progress,
                          write_events=args.events)
    except AnalyzeError as exc:
        print(f"transportd analyze: error: {exc}", file=sys.stderr)
        return 2
    finally:
        spark.stop()
    print(json.dumps(summary, indent=2, default=str) if args.json else console_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
