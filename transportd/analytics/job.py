"""The Spark job behind ``transportd analyze``: MSGTRK logs of many nodes in, per-message journeys out.

It owns reading tracking logs of any Exchange version (2010/2013/2016+, header or not, BOM or
not, CRLF or LF, quoted fields) from any path Spark reads, joining every node's rows by
network-message-id (message-id for 2010 logs), deciding each message's final state, and writing
``events/``, ``messages/``, ``anomalies/`` and ``malformed/`` (Parquet), ``summary.json`` and
``report.html`` under ``--out``. It must never collect row-level data to the driver: only
aggregates (per node, per time bucket, per failover episode, percentiles, histograms) and a
bounded sample of anomalies come back. A malformed row is counted and reported, never fatal.
Run it as ``transportd analyze`` or ``spark-submit transportd/analytics/job.py PATHS --out DIR``.
The state rules are in docs/analytics.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from transportd.analytics.schema import (
    DELIVERY_EVENTS,
    ENTRY_EVENTS,
    FAILED_EVENTS,
    FIELDS_BY_COUNT,
    GENERIC_FOLDERS,
    MAX_FIELDS,
    RELEASE_EVENTS,
    SUCCESS_EVENTS,
    TAKE_EVENTS,
)

DEFAULT_NAME_FILTER = "[Mm][Ss][Gg][Tt][Rr][Kk]*"
"""Files read from folders: MSGTRK*.LOG in any case (Spark's pathGlobFilter)."""

HISTOGRAM_EDGES = (0.0, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 10800,
                   43200, 86400, 172800)
"""Seconds; the last bucket is everything above the last edge."""

NICE_BUCKETS = (1, 5, 10, 30, 60, 300, 600, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400, 7 * 86400)
MAX_TIME_BUCKETS = 120
SENTINEL = "\u0001end-of-row"
"""Appended to each line as one more field: its position is the row's field count."""


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
        "spark.sql.shuffle.partitions": "16" if chosen.startswith("local") else "200",
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


def read_raw(spark: Any, paths: Sequence[str], name_filter: str = DEFAULT_NAME_FILTER,
             recursive: bool = False):
    """Every physical line of the given files, folders or globs, with the file it came from."""
    from pyspark.sql import functions as F

    reader = spark.read.option("pathGlobFilter", name_filter)
    if recursive:
        reader = reader.option("recursiveFileLookup", "true")
    try:
        df = reader.text(list(paths))
    except Exception as exc:  # noqa: BLE001 - AnalysisException: path does not exist, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise AnalyzeError(f"cannot read {', '.join(paths)}: {first}") from None
    return df.select(F.col("value").alias("line"), F.col("_metadata.file_path").alias("file"))


def parse_lines(raw: Any):
    """Parse raw lines into one column per needed field (snake_case) plus ``file``, ``reason``
    (why the row is malformed, or null) and ``line`` (the raw text of a malformed row).

    The field names of each row come from its file's ``#Fields:`` header or, without one, from
    its own count. Lazy; one pass over the input.
    """
    from pyspark.sql import functions as F

    line = F.regexp_replace(F.col("line"), "^\ufeff", "")
    lines = raw.select(line.alias("line"), "file")
    headers = (lines.filter(F.lower(F.substring("line", 1, 8)) == "#fields:")
               .groupBy("file").agg(F.min("line").alias("header"))
               .select("file", F.transform(F.split(F.substring("header", 9, 1 << 20), ","),
                                           lambda name: F.lower(F.trim(name))).alias("header_names")))
    data = lines.filter(~F.col("line").startswith("#") & (F.trim(F.col("line")) != ""))
    data = data.join(F.broadcast(headers), "file", "left")

    by_count = F.lit(None).cast("array<string>")
    for n, fields in FIELDS_BY_COUNT.items():
        by_count = F.when(F.col("n") == n, F.array(*[F.lit(f) for f in fields])).otherwise(by_count)
    # One CSV parse per row gives both the fields and their count: a sentinel field appended to
    # the line lands right after the last field (a stray quote swallows it; so do too many fields).
    schema = ", ".join(f"c{i} STRING" for i in range(MAX_FIELDS + 1))
    parsed = F.from_csv(F.concat(F.col("line"), F.lit("," + SENTINEL)), schema,
                        {"quote": '"', "escape": '"', "mode": "PERMISSIVE", "ignoreLeadingWhiteSpace": "false"})
    # from_csv once per row: a column of its own, then the array refers to that column (built
    # from the expression itself, Spark would parse the line once per array element).
    data = (data.withColumn("parsed", parsed)
            .withColumn("tokens", F.array(*[F.col("parsed")[f"c{i}"] for i in range(MAX_FIELDS + 1)]))
            .withColumn("n", (F.array_position(F.col("tokens"), SENTINEL) - 1).cast("int"))
            .withColumn("names", F.coalesce(F.col("header_names"), by_count)))

    def field(name: str):
        pos = F.array_position(F.col("names"), name).cast("int")
        return F.coalesce(F.when(pos > 0, F.element_at(F.col("tokens"), pos)), F.lit(""))

    reason = (F.when(F.col("n") < 0, F.lit(f"unbalanced quote or more than {MAX_FIELDS} fields"))
              .when(F.col("header_names").isNull() & F.col("names").isNull(),
                    F.concat(F.col("n").cast("string"), F.lit(" fields and no #Fields header (expected 26, 27 or 30)")))
              .when(F.size("names") != F.col("n"),
                    F.concat(F.col("n").cast("string"), F.lit(" fields, #Fields names "),
                             F.size("names").cast("string"))))
    data = data.withColumn("reason", reason)
    fields = ("date-time", "client-hostname", "server-hostname", "source-context", "source", "event-id",
              "internal-message-id", "message-id", "network-message-id", "recipient-address",
              "reference", "sender-address")
    ok = F.col("reason").isNull()
    return data.select(
        "file", "reason", F.when(~ok, F.substring("line", 1, 500)).alias("line"),
        *[F.when(ok, field(f)).otherwise(F.lit("")).alias(f.replace("-", "_")) for f in fields])


def normalize(rows: Any):
    """Typed, lower-cased events, with ``valid`` false and ``malformed_reason`` set for malformed rows
    (bad CSV, or no usable date-time, event-id or message key)."""
    from pyspark.sql import functions as F

    folder = F.regexp_extract("file", r"([^/]+)/[^/]+$", 1)
    grand = F.regexp_extract("file", r"([^/]+)/[^/]+/[^/]+$", 1)
    folder_node = F.lower(F.when(F.lower(folder).isin(*GENERIC_FOLDERS) & (grand != ""), grand)
                          .otherwise(folder))
    server = F.lower(F.trim("server_hostname"))
    netid = F.lower(F.trim("network_message_id"))
    message_id = F.trim("message_id")
    ctx = F.col("source_context")
    event = F.upper(F.trim("event_id"))
    source = F.upper(F.trim("source"))
    redundancy_ctx = r"^\s*(\S+)\s*\(([^)]*)\)"
    ev = rows.select(
        "file", F.col("reason").alias("csv_reason"), "line",
        F.try_to_timestamp(F.trim("date_time")).alias("time"),
        F.when(server != "", server).otherwise(folder_node).alias("node"),
        event.alias("event"),
        source.alias("source"),
        F.coalesce(F.when(netid != "", netid), F.when(message_id != "", message_id)).alias("key"),
        netid.alias("network_message_id"),
        message_id.alias("message_id"),
        F.trim("internal_message_id").alias("internal_message_id"),
        F.filter(F.transform(F.split("recipient_address", ";"), lambda a: F.lower(F.trim(a))),
                 lambda a: a != "").alias("recipients"),
        ctx.alias("context"),
        F.lower(F.trim("client_hostname")).alias("client_hostname"),
        F.trim("reference").alias("reference"),
        F.lower(F.trim("sender_address")).alias("sender"),
        F.when(event == "HAREDIRECT", F.lower(F.trim(F.substring_index(ctx, "=", 1))))
         .when(event == "RESUBMIT", F.lower(F.regexp_extract(ctx, redundancy_ctx, 1)))
         .alias("peer"),
        F.when((event == "RESUBMIT") & (source == "REDUNDANCY"), F.regexp_extract(ctx, redundancy_ctx, 2))
         .alias("reason"),
    )
    reason = (F.when(F.col("csv_reason").isNotNull(), F.col("csv_reason"))
              .when(F.col("time").isNull(), F.lit("bad date-time"))
              .when(F.col("event") == "", F.lit("no event-id"))
              .when(F.col("key").isNull(), F.lit("no network-message-id or message-id")))
    return (ev.withColumn("malformed_reason", reason).drop("csv_reason")
            .withColumn("valid", F.col("malformed_reason").isNull())
            .withColumn("line", F.when(~F.col("valid"), F.coalesce(
                F.col("line"), F.concat_ws(",", F.col("event"), F.col("key"), F.col("context"))))))


# ---------------------------------------------------------------------------- per message


def node_cutoffs(ev: Any):
    """Per node, the time before which its copies are gone (small DataFrame: node, cutoff).

    A peer promoted its shadows (RESUBMIT REDUNDANCY naming it): with ShadowStateChange the
    node came back with a new queue database, so everything it held before is gone; with
    ShadowHeartbeatFailure its copies are gone only if it wrote no row after the promotion.
    """
    from pyspark.sql import functions as F

    promotions = (ev.filter((F.col("event") == "RESUBMIT") & (F.col("source") == "REDUNDANCY"))
                  .groupBy(F.col("peer").alias("node"), "reason").agg(F.max("time").alias("promoted")))
    last_row = ev.groupBy("node").agg(F.max("time").alias("last_row"))
    joined = promotions.join(last_row, "node", "left")
    gone = (F.col("reason") == "ShadowStateChange") | F.col("last_row").isNull() | (
        F.col("last_row") <= F.col("promoted"))
    return (joined.filter(gone).groupBy("node").agg(F.max("promoted").alias("cutoff")))


def build_messages(ev: Any, log_end: Any):
    """One row per message key with its journey and final state (lazy DataFrame)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    e = F.col("event")

    def when_event(events: Sequence[str], value: Any):
        return F.when(e.isin(*events), value)

    # -- per (message, node): copies taken and released, shadow hold times
    cut = node_cutoffs(ev)
    kn = (ev.groupBy("key", "node").agg(
        F.max(when_event(TAKE_EVENTS, F.col("time"))).alias("last_take"),
        F.max(when_event(RELEASE_EVENTS, F.col("time"))).alias("last_release"),
        F.min(when_event(["HARECEIVE"], F.col("time"))).alias("shadow_received"),
        F.min(when_event(["HADISCARD"], F.col("time"))).alias("shadow_discarded"),
        F.min(F.when((e == "RESUBMIT") & (F.col("source") == "REDUNDANCY"), F.col("time"))).alias("promoted"),
    ).join(F.broadcast(cut), "node", "left"))
    dead = F.col("cutoff").isNotNull() & (F.col("last_take") < F.col("cutoff"))
    holds = (F.col("last_take").isNotNull() & ~F.coalesce(dead, F.lit(False))
             & (F.col("last_release").isNull() | (F.col("last_take") > F.col("last_release"))))
    hold = F.when(F.col("shadow_discarded") >= F.col("shadow_received"),
                  F.col("shadow_discarded").cast("double") - F.col("shadow_received").cast("double"))
    undiscarded = (F.col("shadow_received").isNotNull() & F.col("shadow_discarded").isNull()
                   & F.col("promoted").isNull() & ~F.coalesce(dead, F.lit(False)))
    copies = kn.groupBy("key").agg(
        F.sum(holds.cast("int")).alias("live_copies"),
        F.array_sort(F.collect_list(F.when(holds, F.col("node")))).alias("live_copy_nodes"),
        F.collect_list(hold).alias("shadow_hold_seconds"),
        F.array_sort(F.collect_list(F.when(undiscarded, F.col("node")))).alias("undiscarded_shadow_nodes"),
    )

    # -- per (message, recipient): done or not, duplicates
    wanted_events = (*ENTRY_EVENTS, "HARECEIVE")
    rk = (ev.filter(e.isin(*wanted_events, *SUCCESS_EVENTS, *FAILED_EVENTS))
          .select("key", "event", "time", F.explode("recipients").alias("recipient"))
          .groupBy("key", "recipient").agg(
              F.max(F.col("event").isin(*wanted_events)).alias("wanted"),
              F.min(when_event(SUCCESS_EVENTS, F.col("time"))).alias("succeeded"),
              F.min(when_event(FAILED_EVENTS, F.col("time"))).alias("failed"),
              F.sum((e == "SENDEXTERNAL").cast("int")).alias("external"),
              F.sum((e == "DELIVER").cast("int")).alias("mailbox")))
    ok = F.col("succeeded").isNotNull()
    failed_only = ~ok & F.col("failed").isNotNull()
    recipients = rk.filter("wanted").groupBy("key").agg(
        F.count(F.lit(1)).alias("recipient_count"),
        F.sum(ok.cast("int")).alias("recipients_delivered"),
        F.sum(failed_only.cast("int")).alias("recipients_failed"),
        F.max(F.coalesce("succeeded", "failed")).alias("last_done"),
        F.array_sort(F.collect_list(F.when(F.col("external") > 1, F.col("recipient"))))
         .alias("duplicate_external_recipients"),
        F.array_sort(F.collect_list(F.when(F.col("mailbox") > 1, F.col("recipient"))))
         .alias("duplicate_mailbox_recipients"),
    )

    # -- per message: the journey
    t = F.col("time")
    journey = ev.groupBy("key").agg(
        F.max("network_message_id").alias("network_message_id"),
        F.max("message_id").alias("message_id"),
        F.max(when_event(["RECEIVE"], F.col("sender"))).alias("sender"),
        F.min(when_event(["RECEIVE"], F.struct(t.alias("time"), F.col("node").alias("node"))))
         .alias("first_receive"),
        F.max(e == "DSN").alias("generated"),
        F.min(when_event(["HAREDIRECT", "HAREDIRECTFAIL"], F.struct(t.alias("time"), e.alias("event"))))
         .alias("first_redundancy"),
        F.min(when_event(["HAREDIRECT"], F.struct(t.alias("time"), F.col("peer").alias("node"))))
         .alias("shadow"),
        F.min(when_event(["HAREDIRECTFAIL"], t)).alias("haredirectfail_time"),
        F.sum((e == "HAREDIRECTFAIL").cast("int")).alias("haredirectfail_count"),
        F.array_sort(F.collect_list(when_event(["HARECEIVE"], F.struct(
            t.alias("time"), F.col("node").alias("node"), F.col("client_hostname").alias("primary")))))
         .alias("hareceive"),
        F.array_sort(F.collect_list(when_event(["HADISCARD"], F.struct(
            t.alias("time"), F.col("node").alias("node"), F.col("context").alias("context")))))
         .alias("hadiscard"),
        F.array_sort(F.collect_list(when_event(DELIVERY_EVENTS, F.struct(
            t.alias("time"), e.alias("event"), F.col("node").alias("node"),
            F.col("recipients").alias("recipients"))))).alias("deliveries"),
        F.array_sort(F.collect_list(when_event(["RESUBMIT"], F.struct(
            t.alias("time"), F.col("node").alias("node"), F.col("source").alias("source"),
            F.col("peer").alias("primary"), F.col("reason").alias("reason"),
            F.col("context").alias("context"))))).alias("resubmits"),
        F.array_sort(F.collect_list(when_event(["DUPLICATEDELIVER"], F.struct(
            t.alias("time"), F.col("node").alias("node"), F.col("recipients").alias("recipients")))))
         .alias("duplicate_delivers"),
        F.max(F.col("event") == "HARECEIVE").alias("has_shadow_copy"),
        F.max((e == "RESUBMIT") & (F.col("source") == "REDUNDANCY")).alias("promoted"),
        F.count(F.lit(1)).alias("event_count"),
        F.max(t).alias("last_event_time"),
    )

    m = journey.join(recipients, "key", "left").join(copies, "key", "left")
    terminal = (F.col("recipient_count") > 0) & (F.col("recipients_delivered") + F.col("recipients_failed")
                                                == F.col("recipient_count"))
    received = (F.col("first_receive").isNotNull() | F.col("has_shadow_copy")
                | F.coalesce(F.col("generated"), F.lit(False)))
    live = F.coalesce(F.col("live_copies"), F.lit(0))
    state = (F.when(~received, F.lit("incomplete"))
             .when(terminal & (F.col("recipients_failed") == 0), F.lit("delivered"))
             .when(terminal, F.lit("failed"))
             .when(live >= 2, F.lit("in flight protected"))
             .when(live == 1, F.lit("in flight unprotected"))
             .otherwise(F.lit("lost")))
    m = (m.withColumn("state", state)
         .withColumn("terminal_time", F.when(terminal, F.col("last_done"))))

    # -- time spent unprotected: from each HAREDIRECTFAIL to the next HAREDIRECT, the message's
    # terminal event, or the end of the logs, whichever comes first.
    stops = m.select("key", F.coalesce(F.col("terminal_time"), log_end).alias("stop"))
    window = Window.partitionBy("key").orderBy("time")
    red = (ev.filter(e.isin("HAREDIRECT", "HAREDIRECTFAIL")).select("key", "time", "event")
           .withColumn("next", F.lead("time").over(window))
           .join(stops, "key"))
    until = F.least(F.coalesce(F.col("next"), F.col("stop")), F.col("stop"))
    gap = F.greatest(until.cast("double") - F.col("time").cast("double"), F.lit(0.0))
    unprotected = red.groupBy("key").agg(
        F.sum(F.when(F.col("event") == "HAREDIRECTFAIL", gap).otherwise(0.0)).alias("unprotected_seconds"))
    m = m.join(unprotected, "key", "left")

    return m.select(
        "key", "network_message_id", "message_id", "sender",
        F.col("first_receive.node").alias("receive_node"),
        F.col("first_receive.time").alias("receive_time"),
        (F.col("first_redundancy.event") == "HAREDIRECT").alias("redundant_at_receipt"),
        F.col("shadow.node").alias("shadow_node"),
        F.col("shadow.time").alias("haredirect_time"),
        "haredirectfail_time", "haredirectfail_count", "hareceive", "hadiscard", "deliveries",
        "resubmits", "duplicate_delivers", F.coalesce("promoted", F.lit(False)).alias("promoted"),
        "recipient_count", "recipients_delivered", "recipients_failed",
        F.coalesce("duplicate_external_recipients", F.array()).alias("duplicate_external_recipients"),
        F.coalesce("duplicate_mailbox_recipients", F.array()).alias("duplicate_mailbox_recipients"),
        F.coalesce("live_copies", F.lit(0)).alias("live_copies"), "live_copy_nodes",
        "shadow_hold_seconds", "undiscarded_shadow_nodes",
        F.coalesce("unprotected_seconds", F.lit(0.0)).alias("unprotected_seconds"),
        "state", "terminal_time",
        (F.col("terminal_time").cast("double") - F.col("first_receive.time").cast("double"))
        .alias("latency_seconds"),
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


def _histogram(df: Any, col: str) -> list[dict]:
    from pyspark.sql import functions as F
    idx = F.lit(len(HISTOGRAM_EDGES) - 1)
    for i in range(len(HISTOGRAM_EDGES) - 1, 0, -1):
        idx = F.when(F.col(col) < HISTOGRAM_EDGES[i], F.lit(i - 1)).otherwise(idx)
    rows = (df.filter(F.col(col).isNotNull()).groupBy(idx.alias("b")).count().collect())
    counts = {r["b"]: r["count"] for r in rows}
    out = []
    for i, low in enumerate(HISTOGRAM_EDGES):
        high = HISTOGRAM_EDGES[i + 1] if i + 1 < len(HISTOGRAM_EDGES) else None
        out.append({"from": low, "to": high, "count": int(counts.get(i, 0))})
    return out


def _percentiles(df: Any, col: str) -> dict[str, float | None]:
    from pyspark.sql import functions as F
    row = df.filter(F.col(col).isNotNull()).agg(
        F.percentile_approx(col, [0.5, 0.95, 0.99], 10000).alias("p"), F.count(col).alias("n")).first()
    values = row["p"] or [None, None, None]
    return {"count": int(row["n"]), "p50": values[0], "p95": values[1], "p99": values[2]}


def _ts(value: Any) -> str | None:
    if value is None:
        return None
    return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


def summarize(spark: Any, ev: Any, messages: Any, anomalies: Any, malformed: Any,
              log_start: Any, log_end: Any, episode_gap: float, anomaly_sample: int = 200) -> dict:
    """Aggregates only: every ``collect`` here returns per-node, per-bucket or bounded rows."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    span = (log_end - log_start).total_seconds() if log_start and log_end else 0.0
    bucket = pick_bucket(span)
    summary: dict[str, Any] = {
        "log_start": _ts(log_start), "log_end": _ts(log_end), "bucket_seconds": bucket,
    }

    # states and totals
    states = {r["state"]: int(r["count"]) for r in messages.groupBy("state").count().collect()}
    tot = messages.agg(
        F.count(F.lit(1)).alias("messages"),
        F.sum(F.col("receive_node").isNotNull().cast("int")).alias("received"),
        F.sum(F.coalesce(F.col("redundant_at_receipt"), F.lit(False)).cast("int")).alias("redundant"),
        F.sum((F.col("haredirectfail_count") > 0).cast("int")).alias("unprotected_messages"),
        F.sum(F.col("promoted").cast("int")).alias("promoted"),
        F.sum((F.size("duplicate_delivers") > 0).cast("int")).alias("dup_inside"),
        F.sum((F.size("duplicate_external_recipients") > 0).cast("int")).alias("dup_outside"),
        F.sum((F.size("duplicate_mailbox_recipients") > 0).cast("int")).alias("dup_mailbox"),
        F.sum("unprotected_seconds").alias("unprotected_seconds"),
    ).first()
    received = int(tot["received"] or 0)
    summary["messages"] = int(tot["messages"] or 0)
    summary["states"] = {s: states.get(s, 0) for s in
                         ("delivered", "failed", "in flight protected", "in flight unprotected", "lost",
                          "incomplete")}
    summary["received"] = received
    summary["redundant"] = int(tot["redundant"] or 0)
    summary["redundancy_coverage"] = (summary["redundant"] / received) if received else None
    summary["unprotected_messages"] = int(tot["unprotected_messages"] or 0)
    summary["unprotected_seconds"] = float(tot["unprotected_seconds"] or 0.0)
    summary["promoted"] = int(tot["promoted"] or 0)
    summary["lost"] = summary["states"]["lost"]
    summary["duplicates"] = {"inside_boundary": int(tot["dup_inside"] or 0),
                             "outside_boundary": int(tot["dup_outside"] or 0),
                             "reached_mailbox": int(tot["dup_mailbox"] or 0)}

    # coverage per node and over time, messages per node over time
    rec = messages.filter(F.col("receive_node").isNotNull())
    red = F.coalesce(F.col("redundant_at_receipt"), F.lit(False)).cast("int")
    per_node = rec.groupBy("receive_node").agg(
        F.count(F.lit(1)).alias("received"), F.sum(red).alias("redundant"),
        F.sum("unprotected_seconds").alias("unprotected_seconds")).orderBy("receive_node").collect()
    summary["coverage_by_node"] = [
        {"node": r["receive_node"], "received": int(r["received"]), "redundant": int(r["redundant"]),
         "coverage": r["redundant"] / r["received"] if r["received"] else None,
         "unprotected_seconds": float(r["unprotected_seconds"] or 0.0)} for r in per_node]
    over_time = (rec.withColumn("bucket", _bucket_col("receive_time", bucket))
                 .groupBy("bucket", "receive_node").agg(F.count(F.lit(1)).alias("received"),
                                                        F.sum(red).alias("redundant"))
                 .orderBy("bucket", "receive_node").collect())
    timeline: dict[int, dict[str, Any]] = {}
    for r in over_time:
        slot = timeline.setdefault(int(r["bucket"]), {"received": 0, "redundant": 0, "by_node": {}})
        slot["received"] += int(r["received"])
        slot["redundant"] += int(r["redundant"])
        slot["by_node"][r["receive_node"]] = int(r["received"])
    summary["timeline"] = [
        {"time": _ts_from_epoch(b), "received": s["received"], "redundant": s["redundant"],
         "coverage": s["redundant"] / s["received"] if s["received"] else None, "by_node": s["by_node"]}
        for b, s in sorted(timeline.items())]

    # percentiles and histograms
    holds = messages.select(F.explode("shadow_hold_seconds").alias("hold"))
    delivered = messages.filter(F.col("state") == "delivered")
    summary["shadow_hold_seconds"] = _percentiles(holds, "hold")
    summary["latency_seconds"] = _percentiles(delivered, "latency_seconds")
    summary["histograms"] = {"latency_seconds": _histogram(delivered, "latency_seconds"),
                             "shadow_hold_seconds": _histogram(holds, "hold")}

    # failover episodes: RESUBMIT REDUNDANCY by promoting node, primary and reason, split by gaps
    promos = ev.filter((F.col("event") == "RESUBMIT") & (F.col("source") == "REDUNDANCY"))
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
    safety = ev.filter((F.col("event") == "RESUBMIT") & (F.col("source") == "SAFETYNET")) \
        .groupBy("node").agg(F.countDistinct("key").alias("messages")).collect()
    summary["safety_net_resubmits"] = {r["node"]: int(r["messages"]) for r in safety}

    # per-node event counts
    counts = ev.groupBy("node", "event").count().collect()
    per_node_events: dict[str, dict[str, int]] = {}
    for r in counts:
        per_node_events.setdefault(r["node"], {})[r["event"]] = int(r["count"])
    summary["events_by_node"] = {n: dict(sorted(v.items())) for n, v in sorted(per_node_events.items())}
    summary["events"] = int(sum(sum(v.values()) for v in per_node_events.values()))

    # malformed rows
    bad = malformed.groupBy("file", "reason").count().orderBy(F.desc("count")).limit(200).collect()
    summary["malformed"] = {"rows": int(sum(r["count"] for r in bad)) if len(bad) < 200 else
                            int(malformed.count()),
                            "by_file": [{"file": r["file"], "reason": r["reason"], "rows": int(r["count"])}
                                        for r in bad]}

    # anomalies
    kinds = {r["kind"]: int(r["count"]) for r in anomalies.groupBy("kind").count().collect()}
    summary["anomalies"] = {
        "counts": {k: kinds.get(k, 0) for k in ("lost", "shadow never discarded", "duplicate outside boundary")},
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


def analyze(spark: Any, paths: Sequence[str], out: str, *, name_filter: str = DEFAULT_NAME_FILTER,
            recursive: bool = False, grace_seconds: float = 600.0, episode_gap: float = 60.0,
            progress: bool = True, report: bool = True) -> dict:
    """Run the whole job; returns the summary (also written to ``out``/summary.json)."""
    from pyspark.sql import functions as F

    if not paths:
        raise AnalyzeError("no input paths given")
    shown: Any = Progress(spark) if progress else _NoProgress()
    if isinstance(shown, Progress):
        shown.start()
    started = time.monotonic()
    try:
        shown.set_step("reading and parsing logs")
        spark.sparkContext.setJobDescription("parse MSGTRK rows")
        check_local_paths(paths)
        rows = normalize(parse_lines(read_raw(spark, paths, name_filter, recursive)))
        rows.write.mode("overwrite").partitionBy("valid").parquet(_join(out, "events"))
        try:
            parsed = spark.read.parquet(_join(out, "events"))
        except Exception as exc:  # nothing was written: no file matched, or all were empty
            if "UNABLE_TO_INFER_SCHEMA" in str(exc) or "Unable to infer schema" in str(exc):
                raise AnalyzeError(f"no tracking log rows in {', '.join(paths)}") from None
            raise
        valid = F.col("valid").cast("string") == "true"  # a partition column reads back as a string
        ev = parsed.filter(valid).drop("valid", "malformed_reason", "line")
        malformed = parsed.filter(~valid).select("file", F.col("malformed_reason").alias("reason"), "line")

        shown.set_step("time range")
        bounds = ev.agg(F.min("time").alias("start"), F.max("time").alias("end"),
                        F.count(F.lit(1)).alias("n")).first()
        log_start, log_end = bounds["start"], bounds["end"]
        end_lit = F.lit(log_end).cast("timestamp") if log_end else F.current_timestamp()

        shown.set_step("joining messages across nodes")
        spark.sparkContext.setJobDescription("per-message journeys")
        build_messages(ev, end_lit).write.mode("overwrite").parquet(_join(out, "messages"))
        messages = spark.read.parquet(_join(out, "messages"))
        shown.set_step("anomalies")
        build_anomalies(messages, end_lit, grace_seconds).write.mode("overwrite").parquet(
            _join(out, "anomalies"))
        anomalies = spark.read.parquet(_join(out, "anomalies"))

        shown.set_step("summary")
        spark.sparkContext.setJobDescription("summary aggregates")
        summary = summarize(spark, ev, messages, anomalies, malformed, log_start, log_end, episode_gap)
        summary["inputs"] = list(paths)
        summary["rows"] = int(bounds["n"]) + summary["malformed"]["rows"]
        summary["seconds"] = round(time.monotonic() - started, 3)
        summary["rows_per_second"] = summary["rows"] / summary["seconds"] if summary["seconds"] else None
        write_text(spark, _join(out, "summary.json"), json.dumps(summary, indent=2, default=str) + "\n")
        if report:
            from transportd.analytics.report import render
            shown.set_step("report")
            write_text(spark, _join(out, "report.html"), render(summary))
        shown.set_step(f"done in {summary['seconds']:.1f}s")
        return summary
    finally:
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
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print summary.json instead of the table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_local_paths(args.paths)
    except AnalyzeError as exc:
        print(f"transportd analyze: error: {exc}", file=sys.stderr)
        return 2
    spark = spark_session(args.master)
    try:
        summary = analyze(spark, args.paths, args.out, name_filter=args.name_filter,
                          recursive=args.recursive, grace_seconds=args.grace,
                          episode_gap=args.episode_gap, progress=not args.no_progress)
    except AnalyzeError as exc:
        print(f"transportd analyze: error: {exc}", file=sys.stderr)
        return 2
    finally:
        spark.stop()
    print(json.dumps(summary, indent=2, default=str) if args.json else console_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
