"""Reading MSGTRK files into typed events with Spark's CSV data source (one pass, no Python UDF).

The driver lists the input files and reads only the first lines of each (its ``#Fields:`` header,
or, without one, the field count of its first data rows) to group the files by format; each group
is read by Spark's CSV source with an explicit all-string schema in that order, ``comment='#'``,
PERMISSIVE mode and a corrupt-record column. A row whose field count is not its file's, or that
holds a stray quote, lands in that column with its raw text; only those rows are parsed again
(``from_csv`` with a sentinel field that gives the row's own count) to decide whether they are
another known format (a headerless file mixing 26 and 30 fields) or malformed, and why.
Spark's line reader drops a UTF-8 byte-order mark at the start of a file and splits CRLF, LF
and CR alike.

``normalize`` types the rows: the local node of each row (the event-direction rule of
docs/TRACKING_LOG.md), lower-cased names and keys, the message key, and the reason a row is
malformed. A row with no network-message-id and no message-id is not malformed: it is a row
that is not about a message (NOTIFYMAPI, a STOREDRIVER notice), counted apart.
"""

from __future__ import annotations

import csv
import fnmatch
import glob
import os
import re
from collections.abc import Sequence
from typing import Any

from transportd.analytics.schema import (
    CLIENT_SIDE_EVENTS,
    FIELDS_2016,
    FIELDS_BY_COUNT,
    GENERIC_FOLDERS,
    LEGACY_CLIENT_SIDE_EVENTS,
    MAILBOX_SOURCE,
    MAX_FIELDS,
    MODERATION_DECISION_EVENTS,
    RECIPIENT_CHANGE_EVENTS,
    REVERSED_CHANGE_EVENTS,
    SEND_EVENTS,
)

DEFAULT_NAME_FILTER = "[Mm][Ss][Gg][Tt][Rr][Kk]*"
"""Files read from folders: MSGTRK*.LOG in any case."""

SENTINEL = "\u0001end-of-row"
"""Appended to a re-parsed row as one more field: its position is the row's field count."""

NEEDED = ("date-time", "client-hostname", "server-hostname", "source-context", "source", "event-id",
          "internal-message-id", "message-id", "network-message-id", "recipient-address",
          "recipient-status", "related-recipient-address", "reference", "sender-address", "client-ip", "server-ip")
"""The fields the job reads; any other field is parsed by the CSV reader and dropped."""

UNSPECIFIED_ADDRESSES = ("", "0.0.0.0", "::")
"""Addresses that say nothing of a host (a listener on every interface): taken as none."""

SNIFF_LINES = 64
"""Lines read from the start of each file on the driver to find its format."""

CORRUPT = "_corrupt_record"


class InputError(Exception):
    """The inputs cannot be listed or read (one line for the user)."""


# ------------------------------------------------------------------------- listing and sniffing


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def list_files(spark: Any, paths: Sequence[str], name_filter: str = DEFAULT_NAME_FILTER,
               recursive: bool = False) -> list[str]:
    """Every input file: the files given, and in folders the files whose name matches
    ``name_filter`` (sub-folders too with ``recursive``). Hidden files (``.``, ``_``) are skipped."""
    found: list[str] = []
    for path in paths:
        if _is_local(path):
            local = path.removeprefix("file://")
            for hit in sorted(glob.glob(local)):
                if os.path.isdir(hit):
                    if recursive:
                        for root, dirs, files in os.walk(hit):
                            dirs[:] = sorted(d for d in dirs if not _hidden(d))
                            found += [os.path.join(root, f) for f in sorted(files)
                                      if not _hidden(f) and fnmatch.fnmatchcase(f, name_filter)]
                    else:
                        found += [os.path.join(hit, f) for f in sorted(os.listdir(hit))
                                  if os.path.isfile(os.path.join(hit, f)) and not _hidden(f)
                                  and fnmatch.fnmatchcase(f, name_filter)]
                elif fnmatch.fnmatchcase(os.path.basename(hit), name_filter):
                    found.append(hit)
            continue
        found += _list_hadoop(spark, path, name_filter, recursive)
    seen: set[str] = set()
    unique = []
    for f in found:
        key = os.path.abspath(f) if "://" not in f else f
        if key not in seen:
            seen.add(key)
            unique.append(key)
    return unique


def _list_hadoop(spark: Any, path: str, name_filter: str, recursive: bool) -> list[str]:
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    try:
        hpath = jvm.org.apache.hadoop.fs.Path(path)
        fs = hpath.getFileSystem(conf)
        statuses = fs.globStatus(hpath) or []
    except Exception as exc:  # noqa: BLE001 - Py4JJavaError: no such bucket, no credentials, ...
        raise InputError(f"cannot list {path}: {str(exc).strip().splitlines()[0]}") from None
    out = []
    for st in statuses:
        if st.isDirectory():
            it = fs.listFiles(st.getPath(), recursive)
            while it.hasNext():
                f = it.next()
                name = f.getPath().getName()
                if not _hidden(name) and fnmatch.fnmatchcase(name, name_filter):
                    out.append(f.getPath().toString())
        elif fnmatch.fnmatchcase(st.getPath().getName(), name_filter):
            out.append(st.getPath().toString())
    return out


def _head_lines(spark: Any, path: str, limit: int = SNIFF_LINES) -> list[str]:
    lines: list[str] = []
    if "://" not in path:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            for line in f:
                lines.append(line)
                if len(lines) >= limit:
                    break
    else:
        jvm = spark.sparkContext._jvm
        hpath = jvm.org.apache.hadoop.fs.Path(path)
        fs = hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        stream = fs.open(hpath)
        try:
            reader = jvm.java.io.BufferedReader(jvm.java.io.InputStreamReader(stream, "UTF-8"))
            while len(lines) < limit:
                line = reader.readLine()
                if line is None:
                    break
                lines.append(line)
        finally:
            stream.close()
    return [ln.lstrip("\ufeff").rstrip("\r\n") for ln in lines]


def file_format(lines: list[str]) -> tuple[tuple[str, ...], bool]:
    """(field names, from a header?) of a file, from its first lines: the ``#Fields:`` header,
    else the known format of the first data rows' field count (2016's when none is known)."""
    counts: dict[int, int] = {}
    for line in lines:
        if line.lower().startswith("#fields:"):
            return tuple(n.strip().lower() for n in line[8:].split(",")), True
        if line.startswith("#") or not line.strip():
            continue
        try:
            n = len(next(csv.reader([line])))
        except (csv.Error, StopIteration):
            continue
        if n in FIELDS_BY_COUNT:
            counts[n] = counts.get(n, 0) + 1
    if counts:
        return FIELDS_BY_COUNT[max(counts, key=lambda n: counts[n])], False
    return FIELDS_2016, False


def written_by_transportd(lines: list[str]) -> bool:
    """Whether a file's ``#Software:`` header names transportd (Exchange writes ``Microsoft
    Exchange Server``): the two keep a sent message differently (``RELEASE_EVENTS``)."""
    for line in lines:
        if line.lower().startswith("#software:"):
            return line[10:].strip().lower().startswith("transportd")
        if not line.startswith("#") and line.strip():
            break
    return False


def plan(spark: Any, files: Sequence[str]) -> dict[tuple[tuple[str, ...], bool, bool], list[str]]:
    """Files grouped by (field names, header given, written by transportd)."""
    groups: dict[tuple[tuple[str, ...], bool, bool], list[str]] = {}
    for f in files:
        try:
            lines = _head_lines(spark, f)
            fmt = (*file_format(lines), written_by_transportd(lines))
        except (OSError, Exception):  # noqa: BLE001 - unreadable: Spark will say when it reads it
            fmt = (FIELDS_2016, False, False)
        groups.setdefault(fmt, []).append(f)
    return groups


# ------------------------------------------------------------------------- reading


def _read_group(spark: Any, fields: tuple[str, ...], header: bool, ours: bool, files: list[str]):
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField, StructType

    schema = StructType([StructField(f"c{i}", StringType()) for i in range(len(fields))]
                        + [StructField(CORRUPT, StringType())])
    df = (spark.read.schema(schema)
          .options(comment="#", quote='"', escape='"', mode="PERMISSIVE", multiLine="false",
                   columnNameOfCorruptRecord=CORRUPT, ignoreLeadingWhiteSpace="false",
                   ignoreTrailingWhiteSpace="false", enforceSchema="true", header="false",
                   # a node's retention may remove its oldest file while the job reads a live
                   # folder: that file's rows are not read (analyze counts such files), no failure
                   ignoreMissingFiles="true")
          .csv(list(files)))
    index = {name: i for i, name in reversed(list(enumerate(fields)))}
    cols = [F.col(f"c{index[name]}") if name in index else F.lit(None).cast("string") for name in NEEDED]
    names = (F.array(*[F.lit(n) for n in fields]) if header else F.lit(None).cast("array<string>"))
    return df.select(F.col("_metadata.file_path").alias("file"), F.col(CORRUPT).alias("bad_line"),
                     names.alias("header_names"), F.lit(LEGACY_MARK not in fields).alias("legacy"),
                     F.lit(ours).alias("ours"),
                     *[c.alias(n.replace("-", "_")) for c, n in zip(cols, NEEDED, strict=True)])


LEGACY_MARK = "network-message-id"
"""A format without this field is Exchange 2010's (or 2007's): a row's ``legacy`` flag."""


def read_rows(spark: Any, files: Sequence[str]):
    """Every data row of ``files`` with the needed fields (snake_case), ``file``, ``reason`` (why
    the row is malformed, or null), ``line`` (the raw text of a malformed row) and ``legacy``
    (its format is Exchange 2010's: no network-message-id field). Lazy, one pass."""
    from pyspark.sql import functions as F

    groups = plan(spark, files)
    if not groups:
        raise InputError("no input files")
    df = None
    for (fields, header, ours), members in sorted(groups.items()):
        part = _read_group(spark, fields, header, ours, members)
        df = part if df is None else df.unionByName(part)
    assert df is not None

    bad = F.col("bad_line").isNotNull()
    df = df.filter(~bad | (F.trim(F.col("bad_line")) != ""))
    # Rows the CSV reader could not fit to their file's format: parse them again on their own,
    # with a sentinel field appended (its position is the row's count; a stray quote or too many
    # fields swallows it). Evaluated for those rows only.
    by_count = F.lit(None).cast("array<string>")
    for n, fields in FIELDS_BY_COUNT.items():
        by_count = F.when(F.col("n") == n, F.array(*[F.lit(f) for f in fields])).otherwise(by_count)
    schema = ", ".join(f"c{i} STRING" for i in range(MAX_FIELDS + 1))
    parsed = F.from_csv(F.concat(F.col("bad_line"), F.lit("," + SENTINEL)), schema,
                        {"quote": '"', "escape": '"', "mode": "PERMISSIVE", "ignoreLeadingWhiteSpace": "false"})
    df = (df.withColumn("parsed", F.when(bad, parsed))
          .withColumn("tokens", F.when(bad, F.array(*[F.col("parsed")[f"c{i}"] for i in range(MAX_FIELDS + 1)])))
          .withColumn("n", F.when(bad, (F.array_position(F.col("tokens"), SENTINEL) - 1).cast("int")))
          .withColumn("names", F.when(bad, F.coalesce(F.col("header_names"), by_count))))

    def token(name: str):
        pos = F.array_position(F.col("names"), name).cast("int")
        return F.coalesce(F.when(pos > 0, F.element_at(F.col("tokens"), pos)), F.lit(""))

    reason = F.when(bad, F.when(F.col("n") < 0, F.lit(f"unbalanced quote or more than {MAX_FIELDS} fields"))
                    .when(F.col("header_names").isNull() & F.col("names").isNull(),
                          F.concat(F.col("n").cast("string"),
                                   F.lit(" fields and no #Fields header (expected 26, 27 or 30)")))
                    .when(F.size("names") != F.col("n"),
                          F.concat(F.col("n").cast("string"), F.lit(" fields, #Fields names "),
                                   F.size("names").cast("string"))))
    df = df.withColumn("reason", reason)
    ok = F.col("reason").isNull()
    out = []
    for name in NEEDED:
        col = name.replace("-", "_")
        out.append(F.when(~ok, F.lit("")).when(bad, token(name))
                   .otherwise(F.coalesce(F.col(col), F.lit(""))).alias(col))
    legacy = F.when(bad, ~F.coalesce(F.array_contains(F.col("names"), LEGACY_MARK), F.lit(False))).otherwise(
        F.col("legacy"))
    return df.select("file", "reason", F.when(~ok, F.substring("bad_line", 1, 500)).alias("line"), *out,
                     legacy.alias("legacy"), "ours")


def _folder_node():
    """The node a row's file names by its folder: the folder's name, or the nearest one above it
    whose name is not generic (``msgtrk``, ``MessageTracking``, Exchange's ``V15/TransportRoles/Logs``,
    ...); the folder itself when every one above is generic."""
    from pyspark.sql import functions as F

    folder = F.lower(F.regexp_extract("file", r"([^/]+)/[^/]+$", 1))
    generic = "|".join(re.escape(g) for g in GENERIC_FOLDERS)
    # the file's folders (its URI without the file name and the scheme), generic names cut off the end
    path = F.regexp_replace(F.lower(F.regexp_extract("file", r"^(?:[a-z]+:)?(.*)/[^/]+$", 1)),
                            f"(/({generic}))+$", "")
    named = F.regexp_extract(path, r"([^/]+)$", 1)
    return F.when(named != "", named).otherwise(folder)


def _local_node(event: Any, source: Any, client: Any, server: Any, legacy: Any):
    """The server a row was written on (docs/TRACKING_LOG.md, "Which server a row was written
    on"): client-hostname for the events Exchange writes there (``CLIENT_SIDE_EVENTS``, a RESUBMIT
    from a mailbox, a RECEIVE by an agent, and Exchange 2010's DELIVER, written by the Hub Transport
    server with the mailbox server it delivered to in server-hostname) when it is set, else
    server-hostname, else the file's folder. A FAIL or DEFER of Exchange's SMTP send names the
    remote host in server-hostname: read as the node, remote MX hosts became cluster nodes."""
    from pyspark.sql import functions as F

    client_side = (event.isin(*CLIENT_SIDE_EVENTS) | ((event == "RESUBMIT") & (source == MAILBOX_SOURCE))
                   | ((event == "RECEIVE") & (source == "AGENT"))
                   | (event.isin(*LEGACY_CLIENT_SIDE_EVENTS) & F.coalesce(legacy, F.lit(False)))) & (client != "")
    local = F.when(client_side, client).otherwise(server)
    return F.when(local != "", local).otherwise(_folder_node())


def _address(col: str):
    """An IP address field, trimmed and lower-cased; null when empty or unspecified."""
    from pyspark.sql import functions as F

    a = F.lower(F.trim(col))
    return F.when(~a.isin(*UNSPECIFIED_ADDRESSES), a)


def _addresses(event: Any, source: Any, sent_by_client: Any, server: Any):
    """(node_ip, peer_ip) of a row: the address it shows the local node at (server-ip of a RECEIVE
    or HARECEIVE the node wrote as the receiving server, client-ip of a SEND or SENDEXTERNAL it
    wrote as the sender: docs/TRACKING_LOG.md, "Which server a row was written on"), and the next
    hop's on such a SEND (its server-ip); null elsewhere. The job tells by them whether a next hop
    named ``label.domain`` is the node that logs as ``label`` (``job.host_aliases``)."""
    from pyspark.sql import functions as F

    received = ((event == "HARECEIVE") | ((event == "RECEIVE") & (source != "AGENT"))) & (server != "")
    node_ip = F.when(sent_by_client, _address("client_ip")).when(received, _address("server_ip"))
    peer_ip = F.when(sent_by_client & (server != ""), _address("server_ip"))
    return node_ip, peer_ip


HOP_ID = r"(?i)(?:queued as |\[InternalId=)(\d+)(?!\w)"
"""The receiving node's internal-message-id in a SEND row's reply: ours (``250 2.0.0 Ok: queued as
52``) or Exchange's (``250 2.6.0 <id> [InternalId=52, Hostname=EX02] Queued mail for delivery``);
a queue ID that is not a number (Postfix's ``queued as 4F5A21C0A4``) names none."""


def _hop_id(event: Any):
    """On a SEND row, the internal-message-id the next hop gave the message (its reply, in
    recipient-status or source-context); null elsewhere or when the reply names none."""
    from pyspark.sql import functions as F

    # The expression is written once, inside the branch: written twice (the condition and the
    # value), Spark's common-subexpression elimination would run the regular expression on every row.
    found = F.regexp_extract(F.concat_ws(" ", F.col("recipient_status"), F.col("source_context")), HOP_ID, 1)
    return F.when(event == "SEND", F.nullif(found, F.lit("")))


def internal_id(event: Any, netid: Any):
    """The internal-message-id where the job joins by it: on rows without a network-message-id
    (Exchange 2010's) and on RECEIVE rows (what a SEND's reply names)."""
    from pyspark.sql import functions as F

    return F.when((netid == "") | (event == "RECEIVE"), F.nullif(F.trim("internal_message_id"), F.lit("")))


def _message_key(event: Any, netid: Any, message_id: Any):
    """The network-message-id, else the message-id; none for a row about no message (no id, or a
    moderation decision: its ids are the approval request's, not a message in transport)."""
    from pyspark.sql import functions as F

    return F.when(~event.isin(*MODERATION_DECISION_EVENTS),
                  F.coalesce(F.when(netid != "", netid), F.when(message_id != "", message_id)))


def _recipient_change(event: Any, wanted: Any, written_text: Any = None, related_text: Any = None):
    """(recipients, replaced) of a row: the new recipients and the ones they replace on a
    recipient change (EXPAND, RESOLVE: as written; REDIRECT, DUPLICATEREDIRECT: Exchange writes
    the recipient redirected in recipient-address and the alternate in related-recipient-address,
    and a row with no alternate replaces nobody), the recipients as written on other rows;
    recipients only where ``wanted`` (a condition on the row) holds. ``written_text`` and
    ``related_text``: the two fields already trimmed and lower-cased (``_list_text``), if at hand."""
    from pyspark.sql import functions as F

    related = _recipient_list(_list_text("related_recipient_address") if related_text is None else related_text)
    written = _recipient_list(_list_text("recipient_address") if written_text is None else written_text)
    reversed_ = event.isin(*REVERSED_CHANGE_EVENTS)
    new = F.when(reversed_, related).otherwise(written)
    replaced = (F.when(reversed_, F.when(F.size(related) > 0, written).otherwise(F.array().cast("array<string>")))
                .when(event.isin(*RECIPIENT_CHANGE_EVENTS), related))
    return F.when(wanted, new), replaced


REDUNDANCY_CONTEXT = r"^\s*(\S+)\s*\(([^)]*)\)"
"""source-context of a RESUBMIT by shadow redundancy: ``<primary> (<reason>)``."""


def _peer(event: Any, ctx: Any, sent_by_client: Any, server: Any):
    """The other node a row names: the (first) shadow of a HAREDIRECT (``<shadow>=...``), the
    primary of a RESUBMIT, the next hop of a SEND/SENDEXTERNAL written by the sending server."""
    from pyspark.sql import functions as F

    # HAREDIRECT: "<shadow>=<reply>[;<shadow>=<reply>...]"; Exchange's routing and queue write it
    # with no shadow named ("NoShadowServer", "ResubmitForDirectDelivery": rerouted for high
    # availability), which names no node
    return (F.when((event == "HAREDIRECT") & (F.instr(ctx, "=") > 0), F.lower(F.trim(F.substring_index(ctx, "=", 1))))
            .when(event == "RESUBMIT", F.lower(F.regexp_extract(ctx, REDUNDANCY_CONTEXT, 1)))
            .when(sent_by_client & (server != ""), server))


def _send_writer(event: Any):
    """Who wrote a SEND row, which decides whether the sender keeps the message (``RELEASE_EVENTS``):
    ``transportd``, ``exchange2010`` (Exchange 2010's format, no network-message-id) or
    ``exchange`` (2013 and later); null on other rows."""
    from pyspark.sql import functions as F

    return F.when(event == "SEND", F.when(F.col("ours"), F.lit("transportd"))
                  .when(F.col("legacy"), F.lit("exchange2010")).otherwise(F.lit("exchange")))


def _redundancy_reason(event: Any, source: Any, ctx: Any):
    """Why shadow redundancy resubmitted (ShadowHeartbeatFailure, ShadowStateChange, ...)."""
    from pyspark.sql import functions as F

    return F.when((event == "RESUBMIT") & (source == "REDUNDANCY"), F.regexp_extract(ctx, REDUNDANCY_CONTEXT, 2))


def normalize(rows: Any):
    """Typed, lower-cased events, with ``valid`` false and ``malformed_reason`` set for malformed
    rows (bad CSV, no usable date-time or event-id). ``key`` is null for a row about no message.

    The node of a row is where it was written (``_local_node``): server-hostname, or client-hostname
    for the events Exchange writes there (SEND and SENDEXTERNAL, whose server-hostname is the next
    hop; FAIL, DEFER, ...); when empty, the file's folder."""
    from pyspark.sql import functions as F

    server = F.lower(F.trim("server_hostname"))
    client = F.lower(F.trim("client_hostname"))
    netid = F.lower(F.trim("network_message_id"))
    message_id = F.trim("message_id")
    ctx = F.col("source_context")
    event = F.upper(F.trim("event_id"))
    source = F.upper(F.trim("source"))
    sent_by_client = event.isin(*SEND_EVENTS) & (client != "")
    recipients, replaced = _recipient_change(event, F.lit(True))
    node_ip, peer_ip = _addresses(event, source, sent_by_client, server)
    ev = rows.select(
        "file", F.col("reason").alias("csv_reason"), "line",
        F.trim("date_time").try_cast("timestamp").alias("time"),
        _local_node(event, source, client, server, F.col("legacy")).alias("node"),
        event.alias("event"),
        source.alias("source"),
        _message_key(event, netid, message_id).alias("key"),
        netid.alias("network_message_id"),
        message_id.alias("message_id"),
        F.trim("internal_message_id").alias("internal_message_id"),
        _hop_id(event).alias("hop_id"),
        # no lambda per row: split on ';' (outside quotes) with the blanks around it, drop empty items
        recipients.alias("recipients"),
        replaced.alias("replaced"),
        ctx.alias("context"),
        F.when(sent_by_client, F.lit("")).otherwise(client).alias("client_hostname"),
        F.trim("reference").alias("reference"),
        F.lower(F.trim("sender_address")).alias("sender"),
        _peer(event, ctx, sent_by_client, server).alias("peer"),
        _redundancy_reason(event, source, ctx).alias("reason"),
        _send_writer(event).alias("writer"),
        node_ip.alias("node_ip"),
        peer_ip.alias("peer_ip"),
    )
    reason = (F.when(F.col("csv_reason").isNotNull(), F.col("csv_reason"))
              .when(F.col("time").isNull(), F.lit("bad date-time"))
              .when(F.col("event") == "", F.lit("no event-id")))
    return (ev.withColumn("malformed_reason", reason).drop("csv_reason")
            .withColumn("valid", F.col("malformed_reason").isNull())
            .withColumn("line", F.when(~F.col("valid"), F.coalesce(
                F.col("line"), F.concat_ws(",", F.col("event"), F.col("key"), F.col("context"))))))


def read_events(spark: Any, paths: Sequence[str], name_filter: str = DEFAULT_NAME_FILTER,
                recursive: bool = False):
    """``normalize(read_rows(...))`` over the files the paths name (lazy)."""
    files = list_files(spark, paths, name_filter, recursive)
    if not files:
        raise InputError(f"no tracking log files in {', '.join(paths)}")
    return normalize(read_rows(spark, files))


RECIPIENT_EVENTS = ("BADMAIL", "DELIVER", "DROP", "DSN", "DUPLICATEDELIVER", "DUPLICATEREDIRECT", "EXPAND", "FAIL",
                    "HARECEIVE", "INITMESSAGECREATED", "RECEIVE", "REDIRECT", "RESOLVE", "RESUBMIT", "SEND",
                    "SENDEXTERNAL")
"""Events whose recipients the job reads (entry, take, delivery, done and recipient-change events)."""


def _list_text(col: str):
    """A recipient list field, trimmed and lower-cased (what ``_recipient_list`` splits)."""
    from pyspark.sql import functions as F

    return F.lower(F.trim(col))


def _recipient_list(text: Any):
    """``a@x; b@y`` (``_list_text`` of a field) -> ``[a@x, b@y]``: split on ';' (a plain split;
    the regular expression that also drops the blanks around each ';' only for a value that holds
    a blank, and the one that keeps a quoted local part such as ``"a;b"@x`` whole only for a value
    that holds a '"'), empty items dropped. ``text`` is read up to eight times: give it as a
    column computed in an earlier projection (``narrow``), not as an expression, where it counts."""
    from pyspark.sql import functions as F

    blank = F.lit(False)
    for ch in (" ", "\t", "\x0b", "\x0c"):
        blank = blank | (F.instr(text, ch) > 0)
    return F.array_remove(F.when(F.instr(text, '"') > 0, F.split(text, QUOTED_LIST_SEPARATOR))
                          .when(blank, F.split(text, r"\s*;\s*")).otherwise(F.split(text, ";")), "")


QUOTED_LIST_SEPARATOR = r'\s*;\s*(?=(?:[^"]*"[^"]*")*[^"]*$)'
"""A ';' outside double quotes, with the blanks around it (a quoted local part may hold one)."""


def narrow(rows: Any):
    """The typed rows cut to what the analytics job reads, straight from ``read_rows``: the same
    values as ``normalize`` (then cut per event by the job's ``narrow_events``), but each column
    is computed only on the events that use it (null elsewhere): recipients on entry, take,
    delivery and done rows, the peer on HAREDIRECT/RESUBMIT/SEND rows, the context on
    HADISCARD/RESUBMIT rows, the client on HARECEIVE rows, the sender on RECEIVE rows, the
    source and reason on RESUBMIT rows, the node's address on RECEIVE/HARECEIVE/SEND rows and
    the next hop's on SEND rows (``_addresses``); ``file``, ``malformed_reason`` and ``line`` only on
    malformed rows; ``has_netid`` instead of the network-message-id (the key is the
    network-message-id when there is one)."""
    from pyspark.sql import functions as F

    netid = F.lower(F.trim("network_message_id"))
    message_id = F.trim("message_id")
    event = F.upper(F.trim("event_id"))
    # every row: the event, time, key and node (these decide whether a row is malformed and
    # which message and node it belongs to); and, as columns of their own, the values the next
    # projection reads several times (Spark computes a column once; an expression read in
    # several branches of a CASE is computed in each): the host names, and the recipient lists'
    # text on the rows whose recipients are read.
    first = rows.select(
        "file", F.col("reason").alias("csv_reason"), "line", "source_context", "source",
        "sender_address", "legacy", "ours", "internal_message_id", "recipient_status", "client_ip", "server_ip",
        F.lower(F.trim("network_message_id")).alias("netid"),
        F.trim("date_time").try_cast("timestamp").alias("time"),
        event.alias("event"),
        _message_key(event, netid, message_id).alias("key"),
        (netid != "").alias("has_netid"),
        message_id.alias("message_id"),
        F.lower(F.trim("server_hostname")).alias("server"),
        F.lower(F.trim("client_hostname")).alias("client"),
        F.when(event.isin(*RECIPIENT_EVENTS), _list_text("recipient_address")).alias("written_text"),
        F.when(event.isin(*RECIPIENT_CHANGE_EVENTS), _list_text("related_recipient_address")).alias("related_text"))
    e = F.col("event")
    server = F.col("server")
    client = F.col("client")
    sent_by_client = e.isin(*SEND_EVENTS) & (client != "")
    ctx = F.col("source_context")
    reason = (F.when(F.col("csv_reason").isNotNull(), F.col("csv_reason"))
              .when(F.col("time").isNull(), F.lit("bad date-time"))
              .when(e == "", F.lit("no event-id")))
    second = first.select("*", reason.alias("malformed_reason"))
    valid = F.col("malformed_reason").isNull()
    source = F.upper(F.trim("source"))
    recipients, replaced = _recipient_change(e, e.isin(*RECIPIENT_EVENTS), F.col("written_text"),
                                             F.col("related_text"))
    node_ip, peer_ip = _addresses(e, source, sent_by_client, server)
    return second.select(
        valid.alias("valid"),
        F.when(~valid, F.col("file")).alias("file"),
        F.when(~valid, F.col("malformed_reason")).alias("malformed_reason"),
        F.when(~valid, F.coalesce(F.col("line"), F.concat_ws(",", e, F.col("key"), ctx))).alias("line"),
        "key", "time",
        _local_node(e, source, client, server, F.col("legacy")).alias("node"),
        "event",
        F.when(e == "RESUBMIT", source).alias("source"),
        _peer(e, ctx, sent_by_client, server).alias("peer"),
        _redundancy_reason(e, source, ctx).alias("reason"),
        recipients.alias("recipients"),
        replaced.alias("replaced"),
        F.when(e.isin("HADISCARD", "RESUBMIT"), ctx).alias("context"),
        F.when(e == "HARECEIVE", client).alias("client_hostname"),
        F.when(e == "RECEIVE", F.lower(F.trim("sender_address"))).alias("sender"),
        "has_netid", "message_id",
        internal_id(e, F.col("netid")).alias("internal_id"),
        _hop_id(e).alias("hop_id"),
        _send_writer(e).alias("writer"),
        node_ip.alias("node_ip"),
        peer_ip.alias("peer_ip"),
    )
