"""Tests for transportd.tracking: the MSGTRK writer's bytes on disk, rolling, and the reader."""

from __future__ import annotations

import csv
import io
import re
import shutil
import smtplib
import threading
import uuid
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from conftest import wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

import transportd
from transportd import tracking
from transportd.tracking import (
    FIELDS_2010,
    FIELDS_2013,
    FIELDS_2016,
    TrackingLog,
    files_past_retention,
    format_datetime,
    iter_log_files,
    parse_datetime,
    parse_log_file,
    search,
)

BOM = b"\xef\xbb\xbf"
SPEC_FIELDS_LINE = (
    "date-time,client-ip,client-hostname,server-ip,server-hostname,source-context,connector-id,"
    "source,event-id,internal-message-id,message-id,network-message-id,recipient-address,"
    "recipient-status,total-bytes,recipient-count,related-recipient-address,reference,"
    "message-subject,sender-address,return-path,message-info,directionality,tenant-id,"
    "original-client-ip,original-server-ip,custom-data,transport-traffic-type,log-id,"
    "schema-version"
)
T0 = datetime(2026, 11, 22, 3, 6, 13, 123456, tzinfo=UTC)


class Clock:
    def __init__(self, now: datetime = T0) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **kwargs: float) -> None:
        self.now += timedelta(**kwargs)


def make_log(directory: Path, clock: Clock | None = None, **kwargs) -> TrackingLog:
    kwargs.setdefault("server_ip", "10.0.0.5")
    return TrackingLog(directory, "node1.example.net", clock=clock or Clock(), **kwargs)


def expected_header(when: str, version: str = transportd.__version__) -> bytes:
    return (
        BOM
        + (
            "#Software: transportd\r\n"
            f"#Version: {version}\r\n"
            "#Log-type: Message Tracking Log\r\n"
            f"#Date: {when}\r\n"
            f"#Fields: {SPEC_FIELDS_LINE}\r\n"
        ).encode()
    )


def data_lines(raw: bytes) -> list[bytes]:
    """Physical data lines of a file whose rows hold no CR/LF."""
    return [line for line in raw.split(b"\r\n") if line and not line.lstrip(BOM).startswith(b"#")]


# -- field lists ---------------------------------------------------------------------------


def test_field_lists_match_spec():
    assert ",".join(FIELDS_2016) == SPEC_FIELDS_LINE
    assert len(FIELDS_2016) == 30
    assert len(FIELDS_2013) == 27
    assert len(FIELDS_2010) == 26
    assert FIELDS_2013 == FIELDS_2016[:27]
    assert FIELDS_2013[-1] == "custom-data"
    assert "network-message-id" in FIELDS_2013
    assert "network-message-id" not in FIELDS_2010
    assert FIELDS_2010 == tuple(f for f in FIELDS_2013 if f != "network-message-id")
    assert FIELDS_2010[10:12] == ("message-id", "recipient-address")


# -- writer: bytes on disk ------------------------------------------------------------------


def test_header_bom_and_crlf_exact(tmp_path):
    log = make_log(tmp_path / "logs" / "node1")  # directory is created
    log.write("RECEIVE", "SMTP", internal_message_id=7, message_id="<a@b>")
    log.close()
    files = list((tmp_path / "logs" / "node1").iterdir())
    assert [f.name for f in files] == ["MSGTRK20261122-1.LOG"]
    raw = files[0].read_bytes()
    header = expected_header("2026-11-22T03:06:13.123Z")
    assert raw.startswith(header)
    assert raw.count(BOM) == 1
    assert raw.endswith(b"\r\n")
    assert b"\n" not in raw.replace(b"\r\n", b"")
    assert b"\r" not in raw.replace(b"\r\n", b"")
    assert len(data_lines(raw)) == 1


def test_row_values(tmp_path):
    log = make_log(tmp_path, software_version="9.8.7")
    log.write(
        "SENDEXTERNAL",
        "SMTP",
        internal_message_id=42,
        message_id="<m1@example.com>",
        network_message_id="6f1c0d5e-0000-4000-8000-000000000001",
        recipients=["a@x.org", "b@y.org"],
        recipient_status=["250 2.0.0 OK", "250 2.0.0 OK"],
        total_bytes=1234,
        sender_address="s@example.com",
        return_path="bounce@example.com",
        directionality="Originating",
        client_ip="192.0.2.1",
        client_hostname="client.example.com",
        connector_id="Outbound",
        source_context="mx.x.org",
        custom_data="S:x=y",
    )
    log.close()
    (line,) = data_lines(next(tmp_path.iterdir()).read_bytes())
    values = next(csv.reader(io.StringIO(line.decode())))
    assert len(values) == 30
    row = dict(zip(FIELDS_2016, values))
    assert row["date-time"] == "2026-11-22T03:06:13.123Z"
    assert row["server-hostname"] == "node1.example.net"
    assert row["server-ip"] == "10.0.0.5"
    assert row["event-id"] == "SENDEXTERNAL"
    assert row["source"] == "SMTP"
    assert row["internal-message-id"] == "42"
    assert row["recipient-address"] == "a@x.org;b@y.org"
    assert row["recipient-status"] == "250 2.0.0 OK;250 2.0.0 OK"
    assert row["recipient-count"] == "2"
    assert row["total-bytes"] == "1234"
    assert row["tenant-id"] == ""
    assert row["transport-traffic-type"] == "Email"
    assert row["schema-version"] == "9.8.7"
    assert uuid.UUID(row["log-id"])
    assert row["custom-data"] == "S:x=y"
    assert row["connector-id"] == "Outbound"
    assert row["directionality"] == "Originating"


def test_row_defaults_and_overrides(tmp_path):
    log = make_log(tmp_path)
    log.write("DROP", "ADMIN")
    log.write("DELIVER", "STOREDRIVER", recipients="one@x.org", server_ip="10.9.9.9")
    log.write(
        "RECEIVE",
        "SMTP",
        recipients=["a@x", "b@x"],
        recipient_count=5,
        date_time=datetime(2026, 1, 2, 4, 5, 6, 789000, tzinfo=timezone(timedelta(hours=2))),
    )
    log.close()
    rows = list(parse_log_file(next(tmp_path.iterdir())))
    assert rows[0]["recipient-count"] == ""
    assert rows[0]["internal-message-id"] == ""
    assert rows[0]["total-bytes"] == ""
    assert rows[0]["server-ip"] == "10.0.0.5"
    assert rows[1]["recipient-address"] == "one@x.org"  # a bare string is one recipient
    assert rows[1]["recipient-count"] == "1"
    assert rows[1]["server-ip"] == "10.9.9.9"
    assert rows[2]["recipient-count"] == "5"
    assert rows[2]["date-time"] == "2026-01-02T02:05:06.789Z"
    assert rows[0]["log-id"] != rows[1]["log-id"]


def test_quoting_exact_bytes(tmp_path):
    assert tracking._csv_field("plain text; a@b") == "plain text; a@b"
    assert tracking._csv_field("") == ""
    assert tracking._csv_field(" lead and trail ") == " lead and trail "
    assert tracking._csv_field("a,b") == '"a,b"'
    assert tracking._csv_field('say "hi"') == '"say ""hi"""'
    assert tracking._csv_field("x\ry") == '"x\ry"'
    assert tracking._csv_field("x\ny") == '"x\ny"'
    assert tracking._csv_field("x'y\t") == "x'y\t"

    log = make_log(tmp_path)
    log.write("RECEIVE", "SMTP", message_subject='Re: "budget", Q3', custom_data="a=1")
    log.close()
    raw = next(tmp_path.iterdir()).read_bytes()
    assert b',"Re: ""budget"", Q3",' in raw
    assert b",a=1,Email," in raw


def test_a_multi_line_reply_is_written_on_the_rows_one_line(tmp_path):
    """Exchange stores each event on one line of the log; a next hop's multi-line reply (joined by
    line feeds, as the SMTP client reads it) was written as a quoted record over three lines,
    which a reader of MSGTRK lines (and the analytics job) took for three malformed rows."""
    log = make_log(tmp_path)
    reply = "550 5.1.1 <bad@far.test>: no such user\n5.1.1 see https://far.test/help\r\n5.1.1 code 17"
    log.write("FAIL", "SMTP", recipients=["bad@far.test"], recipient_status=[reply], source_context=reply)
    log.write("SEND", "SMTP", recipients=["good@far.test"], recipient_status=["250 2.0.0 ok"])
    log.close()
    lines = next(tmp_path.iterdir()).read_bytes().split(b"\r\n")
    data = [line for line in lines if line and not line.startswith((b"#", b"\xef\xbb\xbf#"))]
    assert len(data) == 2 and b"\n" not in b"".join(data) and b"\r" not in b"".join(data), data
    rows = list(parse_log_file(next(tmp_path.iterdir())))
    flat = "550 5.1.1 <bad@far.test>: no such user 5.1.1 see https://far.test/help 5.1.1 code 17"
    assert [r["recipient-status"] for r in rows] == [flat, "250 2.0.0 ok"]
    assert rows[0]["source-context"] == flat


def test_control_characters_are_written_as_spaces(tmp_path):
    """A Subject holds what its sender put there: a NUL, an ESC sequence (which recoloured the
    terminal a row was shown in), a tab. Written byte for byte before; now as spaces, as a line
    break is, in every field: a row is text."""
    log = make_log(tmp_path)
    log.write("RECEIVE", "SMTP", message_subject="a\x00b \x1b[31mred\x1b[0m", source_context="x\ty",
              recipient_status=["550 a\x07b"])
    log.close()
    raw = next(tmp_path.iterdir()).read_bytes()
    assert not re.search(rb"[\x00-\x09\x0b\x0c\x0e-\x1f\x7f]", raw), raw
    [row] = list(parse_log_file(next(tmp_path.iterdir())))
    assert (row["message-subject"], row["source-context"], row["recipient-status"]) == \
        ("a b  [31mred [0m", "x y", "550 a b")


def test_a_node_tracks_a_subject_with_control_characters_as_text(make_node):
    """The same through a node: a message whose Subject holds a NUL and an ESC sequence, received
    and delivered; no row of the node's MSGTRK files holds a control character but CRLF."""
    node = make_node().start()
    data = b"From: <bob@remote.test>\r\nTo: <alice@example.test>\r\nSubject: a\x00b \x1b[31mred\x1b[0m\r\n\r\nhi\r\n"
    with smtplib.SMTP("127.0.0.1", node.port, timeout=30) as s:
        s.sendmail("bob@remote.test", ["alice@example.test"], data)
    deliver = wait_for(lambda: node.tracking(event_id="DELIVER"), what="the DELIVER row")
    assert deliver[0]["message-subject"] == "a b  [31mred [0m"
    raw = b"".join(p.read_bytes() for p in (node.data_dir / "msgtrk").iterdir())
    assert b"[31mred" in raw and not re.search(rb"[\x00-\x09\x0b\x0c\x0e-\x1f\x7f]", raw)


def test_a_lone_surrogate_is_written_as_a_question_mark_not_lost(tmp_path):
    """Octets that were no UTF-8 (kept as surrogate escapes) must not cost the row: it was
    dropped with a UnicodeEncodeError, neither written nor kept."""
    log = make_log(tmp_path)
    log.write("RECEIVE", "SMTP", message_subject="bad\udcff octet", sender_address="a@b.test")
    log.close()
    assert log.pending_rows == 0
    [row] = list(tracking.parse_log_file(next(tmp_path.iterdir())))
    assert row["message-subject"] == "bad? octet" and row["sender-address"] == "a@b.test"


@pytest.mark.parametrize(
    ("subject", "read"),
    [
        ("commas, here, and there", None),
        ('quotes "inside" and "" doubled', None),
        ("crlf\r\nin the middle", "crlf in the middle"),
        ("bare lf\nand bare cr\rtoo", "bare lf and bare cr too"),
        ('"starts and ends with a quote"', None),
        ('mixed, "all",\r\nof them\n', 'mixed, "all", of them'),
        ("unicode: Grüße, 日本語", None),
        ("nul\x00esc\x1b[31mred\x1b[0m\ttab\x7fdel\x9bc1", "nul esc [31mred [0m tab del c1"),
    ],
)
def test_quoting_round_trips(tmp_path, subject, read):
    """Commas and quotes come back as written; a line break becomes a space (one row per line)."""
    log = make_log(tmp_path)
    log.write("RECEIVE", "SMTP", message_subject=subject, sender_address="s@x", custom_data="1")
    log.write("SEND", "SMTP", message_subject="after", custom_data="2")
    log.close()
    errors: list = []
    rows = list(parse_log_file(next(tmp_path.iterdir()), errors))
    assert errors == []
    assert [r["message-subject"] for r in rows] == [read or subject, "after"]
    assert rows[0]["sender-address"] == "s@x"
    assert [r["custom-data"] for r in rows] == ["1", "2"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(alphabet='ab ,"\r\n;é', max_size=6), min_size=1, max_size=8))
def test_a_csv_line_is_the_fields_quoted_one_by_one(values):
    """The one-join line (most rows quote nothing) is exactly the field-by-field record."""
    assert tracking._csv_line(values) == ",".join(tracking._csv_field(v) for v in values) + "\r\n"
    if values != [""]:  # csv reads an empty line as no record
        assert next(csv.reader(io.StringIO(tracking._csv_line(values)[:-2], newline=""))) == values


def test_log_ids_are_version_4_uuids():
    ids = {tracking.new_log_id() for _ in range(2000)}
    assert len(ids) == 2000
    for text in list(ids)[:200]:
        parsed = uuid.UUID(text)
        assert str(parsed) == text and parsed.version == 4 and parsed.variant == uuid.RFC_4122


def test_every_row_has_30_fields(tmp_path):
    log = make_log(tmp_path)
    for i in range(5):
        log.write("RECEIVE", "SMTP", internal_message_id=i, message_subject=f"s{i}, x")
    log.close()
    raw = next(tmp_path.iterdir()).read_bytes()
    lines = data_lines(raw)
    assert len(lines) == 5
    for line in lines:
        assert len(next(csv.reader(io.StringIO(line.decode())))) == 30


# -- writer: rolling and restart ------------------------------------------------------------


def test_roll_by_size(tmp_path):
    header_len = len(expected_header("2026-11-22T03:06:13.123Z"))
    log = make_log(tmp_path, max_file_size=header_len + 700)
    for i in range(10):
        log.write("RECEIVE", "SMTP", custom_data=f"row{i}", message_subject="x" * 100)
    log.close()
    files = iter_log_files(tmp_path)
    assert len(files) > 2
    assert [f.name for f in files] == [f"MSGTRK20261122-{n}.LOG" for n in range(1, len(files) + 1)]
    for f in files:
        raw = f.read_bytes()
        assert raw.startswith(expected_header("2026-11-22T03:06:13.123Z"))
        assert raw.count(b"#Software:") == 1
        assert len(raw) <= header_len + 700
        assert data_lines(raw)  # no header-only files
    assert [r["custom-data"] for r in search(tmp_path)] == [f"row{i}" for i in range(10)]


def test_row_larger_than_limit_gets_its_own_file(tmp_path):
    log = make_log(tmp_path, max_file_size=600)
    log.write("RECEIVE", "SMTP", custom_data="small")
    log.write("RECEIVE", "SMTP", custom_data="big", message_subject="y" * 2000)
    log.write("RECEIVE", "SMTP", custom_data="small2")
    log.close()
    files = iter_log_files(tmp_path)
    per_file = [[r["custom-data"] for r in parse_log_file(f)] for f in files]
    assert per_file == [["small"], ["big"], ["small2"]]


DAY = 86400.0


def test_retention_by_age_then_by_size_oldest_first_never_the_current_file():
    """Exchange's circular logging: files last written before MessageTrackingLogMaxAge go, then
    the oldest while the folder is over MessageTrackingLogMaxDirectorySize; 0 turns a rule off."""
    now = 100 * DAY
    files = [(Path(f"MSGTRK202611{d:02d}-1.LOG"), 1000, now - (30 - d) * DAY) for d in range(1, 30)]
    current = files[-1][0]
    # by age only: written more than 10 days ago
    by_age = files_past_retention(files, now, 10 * DAY, 0, current)
    assert [p.name for p, _ in by_age] == [f"MSGTRK202611{d:02d}-1.LOG" for d in range(1, 20)]
    assert {why for _, why in by_age} == {"older than message_tracking_log_max_age"}
    # by size only: 29 files of 1,000 bytes in 5,000 bytes: the 24 oldest go, the newest 5 stay
    by_size = files_past_retention(files, now, 0, 5000, current)
    assert [p.name for p, _ in by_size] == [f"MSGTRK202611{d:02d}-1.LOG" for d in range(1, 25)]
    assert {why for _, why in by_size} == {"folder over message_tracking_log_max_directory_size"}
    # both: age first, then size over what is left
    both = files_past_retention(files, now, 10 * DAY, 3000, current)
    assert [p.name for p, _ in both] == [f"MSGTRK202611{d:02d}-1.LOG" for d in range(1, 27)]
    # neither rule: nothing; the current file stays even when it alone is too old and too big
    assert files_past_retention(files, now, 0, 0, current) == []
    assert files_past_retention([(current, 10**9, 0.0)], now, DAY, 1000, current) == []
    # the same modification time: the lower name (the earlier file of the day) goes first
    same = [(Path("MSGTRK20261122-2.LOG"), 10, now), (Path("MSGTRK20261122-1.LOG"), 10, now)]
    assert [p.name for p, _ in files_past_retention(same, now, 0, 10)] == ["MSGTRK20261122-1.LOG"]


def test_remove_old_files_removes_only_our_files_past_retention(tmp_path):
    import os
    clock = Clock()
    log = make_log(tmp_path, clock, max_file_size=2000)
    now = T0.timestamp()
    old = tmp_path / "MSGTRK20261001-1.LOG"
    old.write_bytes(b"x" * 100)
    os.utime(old, (now - 40 * DAY, now - 40 * DAY))
    foreign = tmp_path / "notes.txt"  # not a tracking-log file: never touched, not counted
    foreign.write_bytes(b"y" * 100000)
    os.utime(foreign, (now - 400 * DAY, now - 400 * DAY))
    for i in range(40):  # several files of at most 2,000 bytes today
        log.write("RECEIVE", "SMTP", custom_data=f"row{i}", message_subject="s" * 200)
    today = sorted(tmp_path.glob("MSGTRK20261122-*.LOG"), key=lambda p: int(p.stem.split("-")[1]))
    assert len(today) > 4
    for n, path in enumerate(today):  # written one second apart, in order
        os.utime(path, (now - 100 + n, now - 100 + n))
    removed = log.remove_old_files(now, 30 * DAY, 5000)
    names = [p.name for p, _, _ in removed]
    assert names[0] == old.name and removed[0][2] == "older than message_tracking_log_max_age"
    left = sorted(tmp_path.glob("MSGTRK*.LOG"))
    assert sum(p.stat().st_size for p in left) <= 5000
    assert log.current_path in left and foreign.exists()
    assert set(names[1:]) == {p.name for p in today} - {p.name for p in left}
    assert all(not (tmp_path / n).exists() for n in names)
    # the rows go on into the current file, and a second round finds nothing more to remove
    log.write("SEND", "SMTP", custom_data="after")
    assert log.remove_old_files(now, 30 * DAY, 0) == []
    current = log.current_path
    log.close()
    assert [r["custom-data"] for r in parse_log_file(current)][-1] == "after"


def test_search_skips_a_file_removed_after_it_was_listed(tmp_path, monkeypatch):
    log = make_log(tmp_path, max_file_size=700)
    for i in range(4):
        log.write("RECEIVE", "SMTP", custom_data=f"row{i}", message_subject="x" * 100)
    log.close()
    files = iter_log_files(tmp_path)
    assert len(files) > 2
    monkeypatch.setattr(tracking, "iter_log_files", lambda d: files)
    files[0].unlink()  # listed, then removed by the node's retention
    rows = [r["custom-data"] for r in search(tmp_path)]
    assert rows and "row3" in rows and "row0" not in rows


def test_subject_logging_off_leaves_the_subject_field_empty(tmp_path):
    log = make_log(tmp_path, subject_logging=False)
    log.write("RECEIVE", "SMTP", message_subject="Salary review", sender_address="a@example.test")
    log.close()
    [row] = search(tmp_path)
    assert row["message-subject"] == "" and row["sender-address"] == "a@example.test"


def test_roll_by_day(tmp_path):
    clock = Clock(datetime(2026, 11, 22, 23, 59, 59, 999000, tzinfo=UTC))
    log = make_log(tmp_path, clock)
    log.write("RECEIVE", "SMTP", custom_data="before")
    clock.advance(milliseconds=1)
    log.write("SEND", "SMTP", custom_data="after")
    clock.advance(hours=1)
    log.write("SEND", "SMTP", custom_data="later")
    log.close()
    names = [f.name for f in iter_log_files(tmp_path)]
    assert names == ["MSGTRK20261122-1.LOG", "MSGTRK20261123-1.LOG"]
    day2 = (tmp_path / "MSGTRK20261123-1.LOG").read_bytes()
    assert day2.startswith(expected_header("2026-11-23T00:00:00.000Z"))
    assert [r["custom-data"] for r in parse_log_file(tmp_path / names[0])] == ["before"]
    rows = list(parse_log_file(tmp_path / names[1]))
    assert [r["custom-data"] for r in rows] == ["after", "later"]
    assert rows[0]["date-time"] == "2026-11-23T00:00:00.000Z"


def test_day_follows_utc_not_local_offset(tmp_path):
    # 2026-11-23 01:30 at +05:00 is 2026-11-22 20:30 UTC.
    clock = Clock(datetime(2026, 11, 23, 1, 30, tzinfo=timezone(timedelta(hours=5))))
    log = make_log(tmp_path, clock)
    log.write("RECEIVE", "SMTP")
    log.close()
    assert [f.name for f in tmp_path.iterdir()] == ["MSGTRK20261122-1.LOG"]
    assert next(parse_log_file(tmp_path / "MSGTRK20261122-1.LOG"))["date-time"] == (
        "2026-11-22T20:30:00.000Z"
    )


def test_restart_appends_without_second_header(tmp_path):
    clock = Clock()
    log = make_log(tmp_path, clock)
    log.write("RECEIVE", "SMTP", custom_data="1")
    log.write("SEND", "SMTP", custom_data="2")
    log.close()
    clock.advance(hours=1)
    log = make_log(tmp_path, clock)
    log.write("DELIVER", "STOREDRIVER", custom_data="3")
    log.close()
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == ["MSGTRK20261122-1.LOG"]
    raw = files[0].read_bytes()
    assert raw.count(BOM) == 1
    assert raw.count(b"#Software:") == 1
    assert raw.count(b"#Fields:") == 1
    assert raw.startswith(expected_header("2026-11-22T03:06:13.123Z"))
    assert [r["custom-data"] for r in parse_log_file(files[0])] == ["1", "2", "3"]


def test_restart_picks_highest_number_and_respects_limit(tmp_path):
    clock = Clock()
    log = make_log(tmp_path, clock, max_file_size=700)
    for i in range(4):
        log.write("RECEIVE", "SMTP", custom_data=str(i), message_subject="z" * 150)
    log.close()
    names = sorted(f.name for f in tmp_path.iterdir())
    highest = max(int(n.split("-")[1].split(".")[0]) for n in names)
    assert highest >= 2
    last = tmp_path / f"MSGTRK20261122-{highest}.LOG"
    size_before = last.stat().st_size

    # Under the limit: append to the highest-numbered file.
    log = make_log(tmp_path, clock, max_file_size=10_000)
    log.write("SEND", "SMTP", custom_data="appended")
    log.close()
    assert last.stat().st_size > size_before
    assert last.read_bytes().count(b"#Fields:") == 1
    assert [r["custom-data"] for r in parse_log_file(last)][-1] == "appended"

    # At or over the limit: start the next number.
    log = make_log(tmp_path, clock, max_file_size=last.stat().st_size)
    log.write("SEND", "SMTP", custom_data="next")
    log.close()
    nxt = tmp_path / f"MSGTRK20261122-{highest + 1}.LOG"
    assert nxt.read_bytes().startswith(BOM + b"#Software: transportd\r\n")
    assert [r["custom-data"] for r in parse_log_file(nxt)] == ["next"]


def test_restart_on_a_new_day_starts_at_one(tmp_path):
    clock = Clock()
    make_log(tmp_path, clock).write("RECEIVE", "SMTP")
    clock.advance(days=1)
    log = make_log(tmp_path, clock)
    log.write("RECEIVE", "SMTP")
    log.close()
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "MSGTRK20261122-1.LOG",
        "MSGTRK20261123-1.LOG",
    ]


def test_restart_after_torn_row(tmp_path):
    log = make_log(tmp_path)
    log.write("RECEIVE", "SMTP", custom_data="whole")
    log.close()
    path = tmp_path / "MSGTRK20261122-1.LOG"
    with open(path, "ab") as f:
        f.write(b"2026-11-22T03:06:14.000Z,1.2.3.4,torn")  # crash mid-row
    log = make_log(tmp_path)
    log.write("SEND", "SMTP", custom_data="new")
    log.close()
    errors: list = []
    rows = list(parse_log_file(path, errors))
    assert [r["custom-data"] for r in rows] == ["whole", "new"]
    assert len(errors) == 1
    assert errors[0][:2] == (path, 7)


def test_empty_existing_file_gets_header(tmp_path):
    (tmp_path / "MSGTRK20261122-1.LOG").write_bytes(b"")
    log = make_log(tmp_path)
    log.write("RECEIVE", "SMTP")
    log.close()
    raw = (tmp_path / "MSGTRK20261122-1.LOG").read_bytes()
    assert raw.startswith(expected_header("2026-11-22T03:06:13.123Z"))


def test_write_after_close_raises_and_close_is_idempotent(tmp_path):
    log = make_log(tmp_path)
    log.close()
    log.close()
    with pytest.raises(ValueError):
        log.write("RECEIVE", "SMTP")


def test_context_manager(tmp_path):
    with make_log(tmp_path) as log:
        log.write("RECEIVE", "SMTP")
        assert log.current_path == tmp_path / "MSGTRK20261122-1.LOG"
    assert log.current_path is None


class FailingFile:
    def write(self, data):
        raise OSError(28, "No space left on device")

    def flush(self):
        pass

    def close(self):
        pass


def test_io_error_is_raised_and_the_row_is_written_by_the_next_write(tmp_path):
    log = make_log(tmp_path)
    log.write("RECEIVE", "SMTP", custom_data="1")
    real = log._file
    log._file = FailingFile()
    real.close()
    with pytest.raises(OSError):
        log.write("SEND", "SMTP", custom_data="kept")
    assert log.current_path is None  # no half-open handle kept
    assert log.pending_rows == 1
    log.write("SEND", "SMTP", custom_data="2")
    assert log.pending_rows == 0
    log.close()
    files = list(tmp_path.iterdir())
    assert len(files) == 1
    assert files[0].read_bytes().count(b"#Fields:") == 1
    assert [r["custom-data"] for r in parse_log_file(files[0])] == ["1", "kept", "2"]


def one_file(directory: Path) -> Path:
    files = list(directory.iterdir())
    assert len(files) == 1, files
    return files[0]


class PartFile:
    """Takes the first ``room`` bytes into the real file, then the disk is full."""

    def __init__(self, real, room: int):
        self.real, self.room = real, room

    def write(self, data):
        if self.room <= 0:
            raise OSError(28, "No space left on device")
        n = self.real.write(bytes(data[:self.room]))
        self.room -= n
        return n

    def close(self):
        self.real.close()


def test_a_row_cut_short_by_a_full_disk_is_written_whole_after_it(tmp_path):
    """The fragment the failed write left is one malformed line; the row itself is not lost."""
    log = make_log(tmp_path)
    log.write("RECEIVE", "SMTP", custom_data="1")
    log._file = PartFile(log._file, room=13)
    with pytest.raises(OSError):
        log.write("SEND", "SMTP", custom_data="cut")
    log.write("DELIVER", "STOREDRIVER", custom_data="2")
    log.close()
    path = one_file(tmp_path)
    errors: list = []
    rows = parse_log_file(path, errors=errors)
    assert [(r["event-id"], r["custom-data"]) for r in rows] == [("RECEIVE", "1"), ("SEND", "cut"), ("DELIVER", "2")]
    assert len(errors) == 1  # the 13 bytes of the cut row, ended with CRLF
    lines = data_lines(path.read_bytes())
    assert len(lines) == 4 and len(lines[1]) == 13


def test_rows_wait_while_the_disk_is_full_within_a_bound_and_are_written_in_order(tmp_path, monkeypatch):
    log = make_log(tmp_path)
    log.write("DEFER", "SMTP", custom_data="before")
    row = len(data_lines(one_file(tmp_path).read_bytes())[0]) + 2
    log.max_pending_bytes = 3 * row + row // 2  # room for three rows like it
    full = {"on": True}
    real_open = log._open_for_day

    def open_for_day(now):
        if full["on"]:
            raise OSError(28, "No space left on device")
        real_open(now)
    monkeypatch.setattr(log, "_open_for_day", open_for_day)
    log._abandon_file()  # the disk fills: the next write must reopen, and cannot
    sizes = []
    for n in range(6):
        with pytest.raises(OSError):
            log.write("DEFER", "SMTP", custom_data=f"w{n}")
        sizes.append(log.pending_rows)
    kept = sizes[-1]
    assert sizes == [1, 2, 3, 3, 3, 3] and log.dropped_rows == 3  # bounded: the newest ones given up
    with pytest.raises(OSError):
        log.write_pending()
    assert log.pending_rows == kept  # still full: nothing written, nothing lost
    full["on"] = False
    log.write("DEFER", "SMTP", custom_data="after")  # the kept rows first, then this one: none given up
    assert log.pending_rows == 0 and log.dropped_rows == 3
    log.close()
    got = [r["custom-data"] for r in parse_log_file(one_file(tmp_path))]
    assert got == ["before", *[f"w{n}" for n in range(kept)], "after"]


def test_a_file_or_folder_removed_while_in_use_costs_no_row(tmp_path):
    """An operator removes the folder (or the file) the node writes to: the next row starts a new
    file, the folder made again, instead of going to a file no reader will ever see."""
    d = tmp_path / "msgtrk"
    log = make_log(d)
    log.write("RECEIVE", "SMTP", internal_message_id=1)
    shutil.rmtree(d)
    log.write("RECEIVE", "SMTP", internal_message_id=2)
    assert [r["internal-message-id"] for p in iter_log_files(d) for r in parse_log_file(p)] == ["2"]
    log.current_path.unlink()
    log.write("RECEIVE", "SMTP", internal_message_id=3)
    log.close()
    assert [r["internal-message-id"] for p in iter_log_files(d) for r in parse_log_file(p)] == ["3"]


def test_close_writes_the_rows_that_wait(tmp_path):
    log = make_log(tmp_path)
    real = log._file
    log._file = FailingFile()
    real.close()
    with pytest.raises(OSError):
        log.write("RECEIVE", "SMTP", custom_data="waiting")
    log.close()
    assert log.pending_rows == 0
    assert [r["custom-data"] for r in parse_log_file(one_file(tmp_path))] == ["waiting"]


def test_threads_do_not_interleave_rows(tmp_path):
    log = make_log(tmp_path, max_file_size=20_000)

    def worker(n: int) -> None:
        for i in range(150):
            log.write("RECEIVE", "SMTP", custom_data=f"{n}:{i}", message_subject="a, b " * 5)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    errors: list = []
    rows = [r for f in iter_log_files(tmp_path) for r in parse_log_file(f, errors)]
    assert errors == []
    assert len(rows) == 8 * 150
    assert {r["custom-data"] for r in rows} == {f"{n}:{i}" for n in range(8) for i in range(150)}
    for n in range(8):  # each thread's rows are in its own order
        mine = [int(r["custom-data"].split(":")[1]) for r in rows if r["custom-data"][0] == str(n)]
        assert mine == list(range(150))
    for f in iter_log_files(tmp_path):
        assert f.read_bytes().count(b"#Fields:") == 1


# -- reading --------------------------------------------------------------------------------


def exchange_row(fields: tuple[str, ...], **values: str) -> list[str]:
    return [values.get(name.replace("-", "_"), "") for name in fields]


def test_read_2010_headerless_lf_no_bom(tmp_path):
    rows = [
        exchange_row(
            FIELDS_2010,
            date_time="2012-03-04T05:06:07.890Z",
            event_id="RECEIVE",
            source="SMTP",
            internal_message_id="123",
            message_id="<old@ex2010>",
            recipient_address="a@x;b@x",
            message_subject="Hello, world",
            custom_data="last",
        ),
        exchange_row(FIELDS_2010, event_id="DELIVER", source="STOREDRIVER", custom_data="2nd"),
    ]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    path = tmp_path / "excerpt.log"
    path.write_bytes(buf.getvalue().encode())
    assert not path.read_bytes().startswith(BOM)
    errors: list = []
    parsed = list(parse_log_file(path, errors))
    assert errors == []
    assert len(parsed) == 2
    assert set(parsed[0]) == set(FIELDS_2016)
    assert parsed[0]["date-time"] == "2012-03-04T05:06:07.890Z"
    assert parsed[0]["message-subject"] == "Hello, world"
    assert parsed[0]["recipient-address"] == "a@x;b@x"
    assert parsed[0]["internal-message-id"] == "123"
    assert parsed[0]["custom-data"] == "last"
    assert parsed[0]["network-message-id"] == ""
    assert parsed[0]["log-id"] == ""
    assert parsed[1]["event-id"] == "DELIVER"
    assert parsed[1]["custom-data"] == "2nd"


def test_read_2013_with_header_bom_crlf(tmp_path):
    header = (
        "#Software: Microsoft Exchange Server\r\n"
        "#Version: 15.00.1497.002\r\n"
        "#Log-type: Message Tracking Log\r\n"
        "#Date: 2019-05-06T00:00:01.234Z\r\n"
        "#Fields: " + ",".join(FIELDS_2013) + "\r\n"
    )
    row = exchange_row(
        FIELDS_2013,
        date_time="2019-05-06T07:08:09.010Z",
        event_id="SEND",
        network_message_id="0b5f3c3e-aaaa-bbbb-cccc-0123456789ab",
        message_subject='Re: "x", y\r\nz',
        custom_data="S:DeliveryPriority=Normal",
    )
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\r\n").writerow(row)
    path = tmp_path / "MSGTRK2019050600-1.LOG"
    path.write_bytes(BOM + (header + buf.getvalue()).encode())
    errors: list = []
    (parsed,) = list(parse_log_file(path, errors))
    assert errors == []
    assert parsed["network-message-id"] == "0b5f3c3e-aaaa-bbbb-cccc-0123456789ab"
    assert parsed["message-subject"] == 'Re: "x", y\r\nz'
    assert parsed["custom-data"] == "S:DeliveryPriority=Normal"
    assert parsed["date-time"] == "2019-05-06T07:08:09.010Z"  # BOM not glued to a field
    assert parsed["schema-version"] == ""


def test_read_2016_headerless_and_header_field_order(tmp_path):
    # Headerless 30 fields.
    row = exchange_row(FIELDS_2016, event_id="SEND", log_id="L1", schema_version="15.1")
    path = tmp_path / "a.log"
    path.write_text(",".join(row) + "\n")
    (parsed,) = parse_log_file(path)
    assert parsed["log-id"] == "L1"
    assert parsed["schema-version"] == "15.1"
    # A #Fields header decides the order, whatever the count.
    path = tmp_path / "b.log"
    path.write_text("#Fields: event-id,date-time,custom-data\nRECEIVE,2026-01-01T00:00:00Z,c\n")
    (parsed,) = parse_log_file(path)
    assert parsed["event-id"] == "RECEIVE"
    assert parsed["custom-data"] == "c"
    assert parsed["date-time"] == "2026-01-01T00:00:00Z"
    assert parsed["source"] == ""


def test_malformed_rows_are_counted_not_fatal(tmp_path):
    good = ",".join(exchange_row(FIELDS_2016, event_id="RECEIVE", custom_data="ok"))
    lines = [
        "#Software: transportd",  # 1
        "#Fields: " + SPEC_FIELDS_LINE,  # 2
        good,  # 3
        "too,few,fields",  # 4
        "",  # 5 blank: ignored, not an error
        good.replace("ok", "ok2"),  # 6
        good[:-1] + ',"',  # 7 one field too many, and a stray quote
        good.replace("ok", "ok3"),  # 8
        good.replace("ok", "ok4"),  # 9
        ",".join(["x"] * 31),  # 10
    ]
    path = tmp_path / "MSGTRK20261122-1.LOG"
    path.write_bytes(BOM + "\r\n".join(lines).encode() + b"\r\n")
    errors: list = []
    rows = list(parse_log_file(path, errors))
    assert [r["custom-data"] for r in rows] == ["ok", "ok2", "ok3", "ok4"]
    assert [(p, n) for p, n, _ in errors] == [(path, 4), (path, 7), (path, 10)]
    assert "30" in errors[0][2] and "3" in errors[0][2]
    assert "unterminated" in errors[1][2]
    # Without an errors list the same file still reads.
    assert len(list(parse_log_file(path))) == 4


def test_headerless_unknown_field_count_is_malformed(tmp_path):
    path = tmp_path / "x.log"
    path.write_text(",".join(["a"] * 12) + "\n" + ",".join(["b"] * 27) + "\n")
    errors: list = []
    rows = list(parse_log_file(path, errors))
    assert len(rows) == 1 and rows[0]["date-time"] == "b"
    assert errors == [(path, 1, errors[0][2])]
    assert "12" in errors[0][2]


def test_stray_quote_far_from_eof_costs_one_row(tmp_path):
    good = ",".join(exchange_row(FIELDS_2016, event_id="RECEIVE"))
    lines = [good.replace("RECEIVE", 'BAD"')] + [
        good.replace("RECEIVE", f"E{i}") for i in range(300)
    ]
    path = tmp_path / "y.log"
    path.write_text("\n".join(lines) + "\n")
    errors: list = []
    rows = list(parse_log_file(path, errors))
    assert [r["event-id"] for r in rows] == [f"E{i}" for i in range(300)]
    assert [(n, reason) for _, n, reason in errors] == [(1, "unterminated quoted field")]


# -- files and search -----------------------------------------------------------------------


def test_iter_log_files_order(tmp_path):
    names = [
        "MSGTRK20261122-10.LOG",
        "MSGTRK20261122-2.LOG",
        "MSGTRK20261122-1.LOG",
        "MSGTRK20261121-3.LOG",
        "MSGTRK20261123-1.log",
        "notes.txt",
        "MSGTRK-copy.LOG",
        "RECV20261122-1.LOG",
    ]
    for name in names:
        (tmp_path / name).write_text("")
    (tmp_path / "MSGTRK20261124-1.LOG").mkdir()
    assert [p.name for p in iter_log_files(tmp_path)] == [
        "MSGTRK20261121-3.LOG",
        "MSGTRK20261122-1.LOG",
        "MSGTRK20261122-2.LOG",
        "MSGTRK20261122-10.LOG",
        "MSGTRK20261123-1.log",
    ]


@pytest.fixture
def populated(tmp_path):
    clock = Clock(datetime(2026, 11, 22, 10, 0, tzinfo=UTC))
    log = make_log(tmp_path, clock, max_file_size=1000)
    nmid1 = "AAAAAAAA-0000-4000-8000-000000000001"
    nmid2 = "bbbbbbbb-0000-4000-8000-000000000002"
    log.write(
        "RECEIVE",
        "SMTP",
        internal_message_id=1,
        message_id="<one@x>",
        network_message_id=nmid1,
        sender_address="Alice@Example.com",
        recipients=["bob@x.org", "Carol@Y.org"],
        custom_data="r1",
    )
    clock.advance(minutes=1)
    log.write(
        "SEND",
        "SMTP",
        internal_message_id=1,
        message_id="<one@x>",
        network_message_id=nmid1,
        sender_address="alice@example.com",
        recipients=["bob@x.org"],
        custom_data="s1",
    )
    clock.advance(minutes=1)
    log.write(
        "RECEIVE",
        "SMTP",
        internal_message_id=2,
        message_id="<two@x>",
        network_message_id=nmid2,
        sender_address="dave@example.com",
        recipients=["carol@y.org"],
        custom_data="r2",
    )
    clock.advance(days=1)
    log.write(
        "DELIVER",
        "STOREDRIVER",
        internal_message_id=12,
        message_id="<two@x>",
        network_message_id=nmid2,
        sender_address="dave@example.com",
        recipients=["carol@y.org"],
        custom_data="d2",
    )
    log.close()
    assert len(iter_log_files(tmp_path)) >= 3  # rows spread over size- and day-rolled files
    return tmp_path


def tags(rows) -> list[str]:
    return [r["custom-data"] for r in rows]


def test_search_no_filter_in_file_order(populated):
    assert tags(search(populated)) == ["r1", "s1", "r2", "d2"]


def test_search_message_id_with_or_without_brackets(populated):
    assert tags(search(populated, message_id="<one@x>")) == ["r1", "s1"]
    assert tags(search(populated, message_id="two@x")) == ["r2", "d2"]
    assert tags(search(populated, message_id="ONE@x")) == []


def test_search_network_and_internal_id(populated):
    assert tags(search(populated, network_message_id="aaaaaaaa-0000-4000-8000-000000000001")) == [
        "r1",
        "s1",
    ]
    assert tags(search(populated, network_message_id="BBBBBBBB-0000-4000-8000-000000000002")) == [
        "r2",
        "d2",
    ]
    assert tags(search(populated, internal_message_id=1)) == ["r1", "s1"]
    assert tags(search(populated, internal_message_id="2")) == ["r2"]  # not 12


def test_search_addresses_and_event(populated):
    assert tags(search(populated, sender="ALICE@example.COM")) == ["r1", "s1"]
    assert tags(search(populated, sender="alice")) == []
    assert tags(search(populated, recipient="carol@y.org")) == ["r1", "r2", "d2"]
    assert tags(search(populated, recipient="BOB@X.ORG")) == ["r1", "s1"]
    assert tags(search(populated, recipient="x.org")) == []
    assert tags(search(populated, event_id="receive")) == ["r1", "r2"]
    assert tags(search(populated, event_id="receive", sender="dave@example.com")) == ["r2"]


def test_search_time_window_inclusive(populated):
    t = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
    assert tags(search(populated, start=t + timedelta(minutes=1))) == ["s1", "r2", "d2"]
    assert tags(search(populated, end=t + timedelta(minutes=1))) == ["r1", "s1"]
    assert tags(
        search(populated, start=t + timedelta(minutes=1), end=t + timedelta(minutes=2))
    ) == ["s1", "r2"]
    # naive means UTC; other offsets are converted
    assert tags(search(populated, start=datetime(2026, 11, 23))) == ["d2"]
    plus2 = timezone(timedelta(hours=2))
    assert tags(search(populated, end=datetime(2026, 11, 22, 12, 0, tzinfo=plus2))) == ["r1"]


def test_search_skips_unparseable_dates_only_with_time_filter(tmp_path):
    row = exchange_row(FIELDS_2016, date_time="not a date", event_id="RECEIVE", custom_data="bad")
    row2 = exchange_row(
        FIELDS_2016, date_time="2026-11-22T10:00:00.000Z", event_id="RECEIVE", custom_data="ok"
    )
    (tmp_path / "MSGTRK20261122-1.LOG").write_text(",".join(row) + "\n" + ",".join(row2) + "\n")
    assert tags(search(tmp_path)) == ["bad", "ok"]
    assert tags(search(tmp_path, start=datetime(2026, 1, 1, tzinfo=UTC))) == ["ok"]
    assert tags(search(tmp_path, end=datetime(2027, 1, 1, tzinfo=UTC))) == ["ok"]


def test_search_reports_malformed_rows(tmp_path):
    (tmp_path / "MSGTRK20261122-1.LOG").write_text("a,b,c\n")
    errors: list = []
    assert list(search(tmp_path, errors=errors)) == []
    assert [(p.name, n) for p, n, _ in errors] == [("MSGTRK20261122-1.LOG", 1)]


# -- date-times -----------------------------------------------------------------------------


def test_format_datetime():
    assert format_datetime(T0) == "2026-11-22T03:06:13.123Z"
    assert format_datetime(datetime(2026, 1, 2, 3, 4, 5)) == "2026-01-02T03:04:05.000Z"
    local = datetime(2026, 1, 2, 3, 4, 5, 999999, tzinfo=timezone(timedelta(hours=-5)))
    assert format_datetime(local) == "2026-01-02T08:04:05.999Z"


def test_parse_datetime():
    assert parse_datetime("2026-11-22T03:06:13.123Z") == datetime(
        2026, 11, 22, 3, 6, 13, 123000, tzinfo=UTC
    )
    parsed = parse_datetime("2026-11-22T03:06:13.1234567Z")
    assert parsed.tzinfo is UTC and parsed.microsecond == 123456
    assert parse_datetime("2026-11-22T05:06:13+02:00") == datetime(
        2026, 11, 22, 3, 6, 13, tzinfo=UTC
    )
    assert parse_datetime("2026-11-22T03:06:13").tzinfo is UTC
    assert parse_datetime(format_datetime(T0)) == T0.replace(microsecond=123000)
    with pytest.raises(ValueError):
        parse_datetime("22/11/2026 03:06")


# -- Exchange 2010's 26-field format (tracking.format) ---------------------------------------


def test_exchange2010_format_writes_26_fields_and_reads_back(tmp_path):
    log = make_log(tmp_path, fields=FIELDS_2010)
    log.write("RECEIVE", "SMTP", internal_message_id=7, message_id="<a@b>", network_message_id="dropped",
              recipients=["r@x.test"], custom_data="S:AckDelay=1.000")
    log.close()
    path = next(tmp_path.iterdir())
    raw = path.read_bytes()
    assert b"#Fields: " + ",".join(FIELDS_2010).encode() + b"\r\n" in raw
    (line,) = data_lines(raw)
    assert len(next(csv.reader(io.StringIO(line.decode())))) == 26
    (row,) = parse_log_file(path)
    assert (row["message-id"], row["network-message-id"], row["event-id"]) == ("<a@b>", "", "RECEIVE")
    assert row["custom-data"] == "S:AckDelay=1.000"
    with pytest.raises(ValueError):
        make_log(tmp_path / "other", fields=FIELDS_2016[:5])


def test_a_node_that_switches_format_starts_a_new_file(tmp_path):
    clock = Clock()
    with make_log(tmp_path, clock) as log:
        log.write("RECEIVE", "SMTP", internal_message_id=1)
    with make_log(tmp_path, clock, fields=FIELDS_2010) as log:
        log.write("RECEIVE", "SMTP", internal_message_id=2)
    with make_log(tmp_path, clock, fields=FIELDS_2010) as log:  # the same format again: appended
        log.write("RECEIVE", "SMTP", internal_message_id=3)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["MSGTRK20261122-1.LOG", "MSGTRK20261122-2.LOG"]
    assert [r["internal-message-id"] for r in parse_log_file(tmp_path / files[1])] == ["2", "3"]


@pytest.mark.parametrize("value,items", [
    ("a@x;b@y", ["a@x", "b@y"]), ('"a;b"@x;c@y', ['"a;b"@x', "c@y"]), ('"a;b"@x', ['"a;b"@x']), ("a@x", ["a@x"]),
])
def test_a_recipient_list_keeps_a_quoted_local_part_whole(value, items):
    """A quoted local part may hold the list separator (RFC 5321 4.1.2): searching by recipient
    reads the list back with it kept whole."""
    from transportd.tracking import split_list
    assert split_list(value) == items
