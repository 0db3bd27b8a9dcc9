"""Message tracking log (MSGTRK) in the Exchange 2016/2019 format: writing and reading.

This module owns the node's on-disk tracking log, as specified in docs/TRACKING_LOG.md (the
contract): ``TrackingLog`` appends one CSV row per message event to ``MSGTRK<yyyymmdd>-<n>.LOG``
files (UTF-8 with BOM, CRLF, ``#`` header, rolled by UTC day and by size) and flushes each row
as it is written; ``parse_log_file``, ``iter_log_files`` and ``search`` read our files and
Exchange's (2010: 26 fields, 2013: 27, 2016/2019: 30; BOM or not, header or not, CRLF or LF).
It must never swallow a write error (the caller decides what a failed log write means), never
keep writing after a failed write without reopening the file from disk, and never let one
malformed row stop a reader: bad rows are skipped and reported.
"""

from __future__ import annotations

import csv
import difflib
import errno
import logging
import os
import re
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, BinaryIO, Self

import transportd

__all__ = [
    "EVENT_IDS",
    "FIELDS_2010",
    "FIELDS_2013",
    "FIELDS_2016",
    "SOURCES",
    "TrackingLog",
    "files_past_retention",
    "format_datetime",
    "iter_log_files",
    "parse_datetime",
    "parse_log_file",
    "search",
    "unknown_event_id",
    "utc_now",
]

log = logging.getLogger(__name__)

FIELDS_2016: tuple[str, ...] = (
    "date-time",
    "client-ip",
    "client-hostname",
    "server-ip",
    "server-hostname",
    "source-context",
    "connector-id",
    "source",
    "event-id",
    "internal-message-id",
    "message-id",
    "network-message-id",
    "recipient-address",
    "recipient-status",
    "total-bytes",
    "recipient-count",
    "related-recipient-address",
    "reference",
    "message-subject",
    "sender-address",
    "return-path",
    "message-info",
    "directionality",
    "tenant-id",
    "original-client-ip",
    "original-server-ip",
    "custom-data",
    "transport-traffic-type",
    "log-id",
    "schema-version",
)
"""The 30 fields of Exchange 2016/2019 logs, in ``#Fields:`` order; the ones we write."""

FIELDS_2013: tuple[str, ...] = FIELDS_2016[:-3]
"""Exchange 2013: 27 fields, the 2016 list without transport-traffic-type, log-id, schema-version."""

FIELDS_2010: tuple[str, ...] = tuple(f for f in FIELDS_2013 if f != "network-message-id")
"""Exchange 2010: 26 fields, the 2013 list without network-message-id."""

EVENT_IDS: tuple[str, ...] = (
    "AGENTINFO", "BADMAIL", "CLIENTSUBMISSION", "DEFER", "DELIVER", "DELIVERFAIL", "DROP", "DSN",
    "DUPLICATEDELIVER", "DUPLICATEEXPAND", "DUPLICATEREDIRECT", "EXPAND", "FAIL", "HADISCARD",
    "HARECEIVE", "HAREDIRECT", "HAREDIRECTFAIL", "INITMESSAGECREATED", "LOAD", "MODERATIONEXPIRE",
    "MODERATORAPPROVE", "MODERATORREJECT", "MODERATORSALLNDR", "NOTIFYMAPI", "NOTIFYSHADOW",
    "POISONMESSAGE", "PROCESS", "PROCESSMEETINGMESSAGE", "RECEIVE", "REDIRECT", "RESOLVE", "RESUBMIT",
    "RESUBMITDEFER", "RESUBMITFAIL", "SEND", "SENDEXTERNAL", "SUBMIT", "SUBMITDEFER", "SUBMITFAIL",
    "SUPPRESSED", "THROTTLE", "TRANSFER",
)
"""Every event-id of Exchange's message tracking log (2007 to 2019), not only the ones we write:
a search runs over real Exchange servers' logs too, so a search for any of them is a real one
and any other value is a typo that would match nothing."""

SOURCES: tuple[str, ...] = (
    "ADMIN", "AGENT", "APPROVAL", "BOOKINGS", "DNS", "DSN", "GATEWAY", "MAILBOXRULE",
    "MEETINGMESSAGEPROCESSOR", "ORAR", "PICKUP", "POISONMESSAGE", "PUBLICFOLDER", "QUEUE",
    "REDUNDANCY", "RESOLVER", "ROUTING", "SAFETYNET", "SMTP", "STOREDRIVER",
)
"""Exchange's values of the ``source`` field (the component that wrote the row); some are
mistaken for event ids (STOREDRIVER writes DELIVER, RECEIVE, SUBMIT ... rows)."""


def unknown_event_id(event_id: str) -> str | None:
    """Why ``event_id`` is no event id of the tracking log (compared in any case), or None when it is one."""
    want = event_id.strip().upper()
    if want in EVENT_IDS:
        return None
    if want in SOURCES:
        hint = f"; {want} is a source (the component that wrote a row), not an event id"
    else:
        close = difflib.get_close_matches(want, EVENT_IDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown event id {event_id!r}{hint} (event ids: {', '.join(EVENT_IDS)})"


_FIELDS_BY_COUNT: dict[int, tuple[str, ...]] = {
    len(FIELDS_2010): FIELDS_2010,
    len(FIELDS_2013): FIELDS_2013,
    len(FIELDS_2016): FIELDS_2016,
}

_BOM = b"\xef\xbb\xbf"
_CRLF = "\r\n"
_MUST_QUOTE = re.compile(r'[,"\r\n]')
_QUOTE_OR_BREAK = re.compile(r'["\r\n]')
_BREAK = re.compile(r"[\r\n]")
_BREAKS_AND_BLANKS = re.compile(r"[ \t]*[\r\n][\r\n \t]*")
# Any control character (C0, DEL, C1): a line break, or one that is no text (a NUL, an ESC
# sequence a Subject carried that would recolour the terminal a row is shown in).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_OTHER_CONTROL = re.compile(r"[\x00-\x09\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# Our own file names, used by the writer to find today's files after a restart.
_OWN_NAME = re.compile(r"^MSGTRK(\d{8})-(\d+)\.LOG$")
# Any MSGTRK log, ours or Exchange's (MSGTRKyyyymmdd-n, MSGTRKyyyymmddhh-n, MSGTRKMD..., .log).
_ANY_NAME = re.compile(r"^MSGTRK([A-Z]*)(\d{8})(\d{2})?-(\d+)\.LOG$", re.IGNORECASE)
# A quoted record longer than this many physical lines is taken to be a stray quote: the
# reader reports its first line as malformed and resumes at the next line.
_MAX_RECORD_LINES = 100


def utc_now() -> datetime:
    """The current time as an aware UTC datetime (the default clock)."""
    return datetime.now(UTC)


def _as_utc(value: datetime) -> datetime:
    """Aware UTC datetime; a naive datetime is taken to be UTC already."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def format_datetime(value: datetime) -> str:
    """Format as the log's ``yyyy-MM-ddTHH:mm:ss.fffZ`` (UTC, milliseconds; naive means UTC)."""
    value = _as_utc(value)
    return f"{value:%Y-%m-%dT%H:%M:%S}.{value.microsecond // 1000:03d}Z"


def parse_datetime(text: str) -> datetime:
    """Parse a date-time field (``2026-11-22T03:06:13.123Z``, any ISO 8601 form) as aware UTC.

    A value without an offset is taken to be UTC. Raises ValueError if it is not a date-time.
    """
    return _as_utc(datetime.fromisoformat(text.strip()))


def _csv_field(value: str) -> str:
    if _MUST_QUOTE.search(value):
        return '"' + value.replace('"', '""') + '"'
    return value


def return_path(sender: str | None) -> str:
    """The return-path field of an envelope sender: ``<>`` for the null sender (Exchange: the field
    "is never empty, it can have the null sender address value represented as <>"), empty only
    where the sender is not known."""
    return "<>" if sender == "" else (sender or "")


def sender_address(row: Mapping[str, Any]) -> str:
    """The sender-address field of a message row: its header's author (Exchange: "the Sender
    header field, or the From header field if Sender isn't present"), else its envelope sender
    (a header naming no address, a row from before the queue database kept the author)."""
    return row.get("author") or row.get("sender") or ""


def _one_line(values: list[str]) -> list[str]:
    """The fields with every line break (and the blanks around it) made one space: Exchange stores
    "each message event on a single line in the log", and a tool reading MSGTRK reads a line as a
    row. A next hop's multi-line reply (``550-5.1.1 ...`` then ``550 5.1.1 ...``) comes to a
    recipient-status or source-context with its lines joined by line feeds. Every other control
    character (a tab, a NUL, an ESC: a Subject holds what its sender put there) is one space too:
    a row is text, shown as it is by whatever reads the file."""
    return [_OTHER_CONTROL.sub(" ", _BREAKS_AND_BLANKS.sub(" ", v).strip(" \t") if _BREAK.search(v) else v)
            for v in values]


def _csv_line(values: Sequence[str]) -> str:
    """One CSV record. Most rows need no quoting: one join, then a check that no field held a
    comma (the count of separators), a quote or a line break; else field by field."""
    line = ",".join(values)
    if line.count(",") == len(values) - 1 and not _QUOTE_OR_BREAK.search(line):
        return line + _CRLF
    return ",".join(_csv_field(v) for v in values) + _CRLF


def new_log_id() -> str:
    """A random (version 4) UUID as text, as ``str(uuid.uuid4())`` gives, at a fifth of its cost."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _join_list(values: Sequence[str]) -> str:
    if isinstance(values, str):  # one address passed bare, not a one-item list
        return values
    return ";".join(values)


LIST_SEPARATOR = re.compile(r';(?=(?:[^"]*"[^"]*")*[^"]*$)')
"""A ';' of a list field outside double quotes: a quoted local part (``"a;b"@x``, RFC 5321
4.1.2) may hold one."""


def split_list(value: str) -> list[str]:
    """A ``;``-joined list field (recipients) read back, a quoted local part kept whole."""
    return LIST_SEPARATOR.split(value) if '"' in value else value.split(";")


def _write_all(file: BinaryIO, data: bytes) -> None:
    """Write every byte through an unbuffered file (a short write is continued; an error raised
    part-way leaves the bytes before it in the file)."""
    view = memoryview(data)
    while view:
        written = file.write(view)
        if not written:
            raise OSError(errno.EIO, "the tracking log file took no byte")
        view = view[written:]


def files_past_retention(files: Sequence[tuple[Path, int, float]], now: float, max_age: float,
                         max_directory_size: int, current: Path | None = None) -> list[tuple[Path, str]]:
    """Which tracking-log files to remove, Exchange's way (MessageTrackingLogMaxAge,
    MessageTrackingLogMaxDirectorySize): ``files`` are (path, size, last-modified time) of one
    folder; a file last written more than ``max_age`` seconds before ``now`` goes, then the
    oldest ones while the folder holds more than ``max_directory_size`` bytes. 0 turns either
    rule off. ``current`` (the file being written) always stays and counts in the folder's size.
    Returns (path, reason) oldest first."""
    removed: list[tuple[Path, str]] = []
    total = sum(size for _, size, _ in files)
    for path, size, mtime in sorted(files, key=lambda f: (f[2], f[0].name)):
        if path == current:
            continue
        if max_age and now - mtime > max_age:
            why = "older than message_tracking_log_max_age"
        elif max_directory_size and total > max_directory_size:
            why = "folder over message_tracking_log_max_directory_size"
        else:
            continue
        removed.append((path, why))
        total -= size
    return removed


def _exclusive(path: str, flags: int) -> int:
    """Opener for a new file in append mode that fails if the file exists (like "xb")."""
    return os.open(path, flags | os.O_EXCL, 0o666)


class _LogFiles:
    """The files of one tracking-log folder, for ``TrackingLog`` (which holds the lock and sets
    the attributes these read): which file is current, a new one per UTC day or past
    ``max_file_size``, its header, and appending to a file another process writes too."""

    directory: Path
    fields: tuple[str, ...]
    software_version: str
    max_file_size: int
    _file: BinaryIO | None
    _path: Path | None
    _day: date | None
    _number: int
    _size: int
    _has_rows: bool
    _lock: threading.Lock

    def remove_old_files(self, now: float, max_age: float, max_directory_size: int) -> list[tuple[Path, int, str]]:
        """Remove this folder's own files past the retention limits (``files_past_retention``;
        ``now`` is epoch seconds, compared with the files' last-modified times), never the file
        being written; returns (path, size, reason) of each file removed. A file another
        process removed first is skipped; other I/O errors are raised."""
        files = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if _OWN_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    files.append((Path(entry.path), st.st_size, st.st_mtime))
        with self._lock:
            current = self._path
        removed = []
        sizes = {path: size for path, size, _ in files}
        for path, why in files_past_retention(files, now, max_age, max_directory_size, current):
            with self._lock:  # the writer may have rolled over to it meanwhile: never that one
                if path == self._path:
                    continue
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
            removed.append((path, sizes[path], why))
        return removed

    def _header(self, now: datetime) -> bytes:
        lines = (
            "#Software: transportd",
            f"#Version: {self.software_version}",
            "#Log-type: Message Tracking Log",
            f"#Date: {format_datetime(now)}",
            "#Fields: " + ",".join(self.fields),
        )
        return _BOM + "".join(line + _CRLF for line in lines).encode("utf-8")

    def _path_for(self, day: date, number: int) -> Path:
        return self.directory / f"MSGTRK{day:%Y%m%d}-{number}.LOG"

    def _open_for_day(self, now: datetime) -> None:
        """Open today's file: append to the highest-numbered one if under the limit. A folder
        removed meanwhile (an operator's cleanup) is made again."""
        day = now.date()
        stamp = f"{day:%Y%m%d}"
        highest = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        for entry in self.directory.iterdir():
            match = _OWN_NAME.match(entry.name)
            if match and match.group(1) == stamp:
                highest = max(highest, int(match.group(2)))
        if highest:
            path = self._path_for(day, highest)
            size = path.stat().st_size
            if size < self.max_file_size and self._same_fields(path):
                self._append_existing(path, day, highest, now)
                return
        self._open_new(now, highest + 1)

    def _same_fields(self, path: Path) -> bool:
        """Whether the file's ``#Fields:`` line is ours (a node switched formats starts a new file)."""
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8-sig", "replace")
        for line in head.splitlines():
            if line.startswith("#Fields:"):
                return tuple(x.strip() for x in line[8:].split(",")) == self.fields
        return True  # no header yet (an empty file): ours to start

    def _append_existing(self, path: Path, day: date, number: int, now: datetime) -> None:
        # Append mode (O_APPEND): the CLI (message remove) writes to the file the daemon has
        # open; every row must land at the current end, never over another process's row.
        file = open(path, "a+b", buffering=0)  # noqa: SIM115 (kept open across writes)
        self._file, self._path, self._day, self._number = file, path, day, number
        size = file.seek(0, os.SEEK_END)
        if size == 0:
            _write_all(file, self._header(now))
            self._has_rows = False
        else:
            file.seek(size - 1)
            last = file.read(1)
            file.seek(0, os.SEEK_END)
            if last != b"\n":
                # The previous process died mid-row, or a write failed part-way (the row itself
                # is still kept): end that row so ours starts on a new line; readers will report
                # the partial row as malformed.
                _write_all(file, _CRLF.encode())
            self._has_rows = True
        self._size = file.seek(0, os.SEEK_END)

    def _open_new(self, now: datetime, number: int) -> None:
        day = now.date()
        while True:
            path = self._path_for(day, number)
            try:
                file = open(path, "ab", buffering=0, opener=_exclusive)  # noqa: SIM115 (kept open across writes)
            except FileExistsError:
                number += 1
                continue
            break
        self._file, self._path, self._day, self._number = file, path, day, number
        header = self._header(now)
        _write_all(file, header)
        self._size = len(header)
        self._has_rows = False

    def _close_file(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def _abandon_file(self) -> None:
        """After a failed write: drop the handle so the next write reopens from disk."""
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass


class TrackingLog(_LogFiles):
    """The message tracking log writer of one node (thread-safe; one instance per directory).

    The current file is chosen on construction: today's highest-numbered file is appended to
    if it is under ``max_file_size``, else the next number is started. Each ``write`` may roll
    to a new file: on a new UTC day (per ``clock``) or when the row would take the file over
    ``max_file_size`` (a row larger than the limit still goes into a file of its own).

    A row that cannot be written (a full disk, an I/O error) is kept, up to ``max_pending_bytes``
    of rows, and written before the next row, or by ``write_pending``, once the file can take it:
    a disk full for a few seconds costs no row, only the time it is written at (its date-time is
    the event's). A row cut short by the failure stays behind as one malformed line.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        server_hostname: str,
        server_ip: str = "",
        max_file_size: int = 10 * 1024 * 1024,
        software_version: str = transportd.__version__,
        clock: Callable[[], datetime] = utc_now,
        fields: Sequence[str] = FIELDS_2016,
        max_pending_bytes: int = 8 * 1024 * 1024,
        subject_logging: bool = True,
    ) -> None:
        if tuple(fields) not in (FIELDS_2016, FIELDS_2010):
            raise ValueError("fields: FIELDS_2016 or FIELDS_2010")
        self.fields = tuple(fields)  # the 2016 format (30 fields) or Exchange 2010's (26)
        self.directory = Path(directory)
        self.server_hostname = server_hostname
        self.server_ip = server_ip
        self.max_file_size = max_file_size
        self.software_version = software_version
        self._clock = clock
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._path: Path | None = None
        self._day: date | None = None
        self._number = 0
        self._size = 0
        self._has_rows = False
        self._closed = False
        self.max_pending_bytes = max_pending_bytes
        self.subject_logging = subject_logging  # MessageTrackingLogSubjectLoggingEnabled
        self._pending: deque[bytes] = deque()  # rows not yet written, oldest first
        self._pending_bytes = 0
        self.dropped_rows = 0  # rows given up: more than max_pending_bytes waited
        self.directory.mkdir(parents=True, exist_ok=True)
        with self._lock:
            try:
                self._open_for_day(self._now())
            except BaseException:
                self._abandon_file()
                raise

    @property
    def current_path(self) -> Path | None:
        """The file rows are being written to (None once closed or after a failed write)."""
        return self._path if self._file is not None else None

    def write(
        self,
        event_id: str,
        source: str,
        *,
        internal_message_id: int | str | None = None,
        message_id: str = "",
        network_message_id: str = "",
        recipients: Sequence[str] = (),
        recipient_status: Sequence[str] = (),
        total_bytes: int | None = None,
        recipient_count: int | None = None,
        related_recipient_address: str = "",
        reference: str = "",
        message_subject: str = "",
        sender_address: str = "",
        return_path: str = "",
        message_info: str = "",
        directionality: str = "",
        client_ip: str = "",
        client_hostname: str = "",
        server_ip: str | None = None,
        server_hostname: str | None = None,
        source_context: str = "",
        connector_id: str = "",
        original_client_ip: str = "",
        original_server_ip: str = "",
        custom_data: str = "",
        date_time: datetime | None = None,
    ) -> None:
        """Append one row and write it through. I/O errors are raised; the row is kept (see the
        class) and the next write reopens the file.

        ``date_time`` defaults to ``clock()``; the file (day) is always chosen by ``clock()``.
        ``recipient_count`` defaults to ``len(recipients)`` when recipients are given.
        """
        if recipient_count is None and recipients:
            recipient_count = 1 if isinstance(recipients, str) else len(recipients)
        with self._lock:
            if self._closed:
                raise ValueError("tracking log is closed")
            now = self._now()
            values = {
                "date-time": format_datetime(date_time if date_time is not None else now),
                "client-ip": client_ip,
                "client-hostname": client_hostname,
                "server-ip": self.server_ip if server_ip is None else server_ip,
                "server-hostname": self.server_hostname if server_hostname is None else server_hostname,
                "source-context": source_context,
                "connector-id": connector_id,
                "source": source,
                "event-id": event_id,
                "internal-message-id": "" if internal_message_id is None else internal_message_id,
                "message-id": message_id,
                "network-message-id": network_message_id,
                "recipient-address": _join_list(recipients),
                "recipient-status": _join_list(recipient_status),
                "total-bytes": "" if total_bytes is None else total_bytes,
                "recipient-count": "" if recipient_count is None else recipient_count,
                "related-recipient-address": related_recipient_address,
                "reference": reference,
                "message-subject": message_subject if self.subject_logging else "",
                "sender-address": sender_address,
                "return-path": return_path,
                "message-info": message_info,
                "directionality": directionality,
                "tenant-id": "",
                "original-client-ip": original_client_ip,
                "original-server-ip": original_server_ip,
                "custom-data": custom_data,
                "transport-traffic-type": "Email",
                "log-id": new_log_id(),
                "schema-version": self.software_version,
            }
            # (a lone surrogate, from octets that were no UTF-8, becomes "?": the row is written all the same)
            fields = [str(values[name]) for name in self.fields]
            line = _csv_line(fields)
            if _CONTROL.search(line, 0, len(line) - 2):  # rare: a value held a line break or another control
                line = _csv_line(_one_line(fields))
            data = line.encode("utf-8", "replace")
            try:
                self._write_pending(now)  # the rows kept before this one go first
            except BaseException:
                self._keep(data)
                raise
            self._keep(data)
            self._write_pending(now)

    @property
    def pending_rows(self) -> int:
        """Rows kept after a failed write, not yet in the file."""
        return len(self._pending)

    def write_pending(self) -> int:
        """Write the rows kept after a failed write; returns how many still wait (0 when all were
        written). I/O errors are raised as by ``write``."""
        with self._lock:
            if self._pending and not self._closed:
                self._write_pending(self._now())
            return len(self._pending)

    def close(self) -> None:
        """Write what waits if the file takes it, then close; later writes raise ValueError. Safe to
        call twice. Rows the file still refuses are lost with the process (``pending_rows``)."""
        with self._lock:
            if self._pending and not self._closed:
                try:
                    self._write_pending(self._now())
                except OSError:
                    pass
            self._closed = True
            self._close_file()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals; all called with self._lock held ---------------------------------------

    def _now(self) -> datetime:
        return _as_utc(self._clock())

    def _keep(self, data: bytes) -> None:
        if self._pending and self._pending_bytes + len(data) > self.max_pending_bytes:
            self.dropped_rows += 1  # memory stays bounded while the file takes nothing
            return
        self._pending.append(data)
        self._pending_bytes += len(data)

    def _write_pending(self, now: datetime) -> None:
        """Write the kept rows in order, each whole or not at all as far as we count it."""
        try:
            if self._file is not None and self._path is not None and not os.path.exists(self._path):
                # removed while open (or its folder deleted or moved away): rows written to it are
                # lost to any reader, so a new file is started (the folder made again if need be)
                log.warning("tracking log file %s was removed while in use: starting a new one", self._path)
                self._close_file()
            while self._pending:
                data = self._pending[0]
                if self._file is None or now.date() != self._day:
                    self._close_file()
                    self._open_for_day(now)
                if self._has_rows and self._size + len(data) > self.max_file_size:
                    self._close_file()
                    self._open_new(now, self._number + 1)
                assert self._file is not None
                _write_all(self._file, data)
                self._pending.popleft()
                self._pending_bytes -= len(data)
                self._size += len(data)
                self._has_rows = True
        except BaseException:
            self._abandon_file()
            raise

# -- reading --------------------------------------------------------------------------------


def _iter_records(lines: Iterator[tuple[int, str]]) -> Iterator[tuple[int, list[str] | None, str]]:
    """Group physical lines into records: yields (first line number, record lines, header).

    A record is a run of lines with balanced double quotes (a quoted field may hold CR/LF).
    A line starting with ``#`` at a record boundary is a header line: yielded with
    ``record`` None. A record still open after ``_MAX_RECORD_LINES`` lines or at end of file
    is yielded with ``header`` set to the reason and ``record`` empty, and its lines after the
    first are read again, so one stray quote costs one row, not the rest of the file.
    """
    replay: deque[tuple[int, str]] = deque()
    record: list[tuple[int, str]] = []
    in_quotes = False
    while True:
        if replay:
            item: tuple[int, str] | None = replay.popleft()
        else:
            item = next(lines, None)
        if item is None:
            if not record:
                return
            yield record[0][0], [], "unterminated quoted field"
            replay.extend(record[1:])
            record, in_quotes = [], False
            continue
        number, text = item
        if not record:
            text = text.lstrip("\ufeff")
            if not text.strip():
                continue
            if text.startswith("#"):
                yield number, None, text.rstrip("\r\n")
                continue
        record.append((number, text))
        if text.count('"') % 2:
            in_quotes = not in_quotes
        if not in_quotes:
            yield record[0][0], [t for _, t in record], ""
            record = []
        elif len(record) >= _MAX_RECORD_LINES:
            yield record[0][0], [], "unterminated quoted field"
            replay.extendleft(reversed(record[1:]))
            record, in_quotes = [], False


def parse_log_file(
    path: str | os.PathLike[str],
    errors: list[tuple[Path, int, str]] | None = None,
) -> Iterator[dict[str, str]]:
    """Yield the rows of one tracking log file as dicts keyed by field name.

    Takes our files and Exchange's: BOM or not, CRLF or LF, with or without the ``#`` header
    (without one, the field list is inferred from the count: 26, 27 or 30). Every dict has
    all ``FIELDS_2016`` keys (absent fields are ``""``) plus any other ``#Fields:`` names.
    A malformed row is skipped; if ``errors`` is given, ``(path, line_number, reason)`` is
    appended to it (line numbers are 1-based physical lines; the row's first line).
    """
    path = Path(path)
    fields: tuple[str, ...] | None = None
    with open(path, encoding="utf-8-sig", errors="replace", newline="\n") as file:
        numbered = enumerate(file, start=1)
        for number, record, note in _iter_records(numbered):
            if record is None:
                if note[:8].lower() == "#fields:":
                    names = tuple(name.strip() for name in note[8:].split(","))
                    fields = names if any(names) else None
                continue
            if note:
                _report(errors, path, number, note)
                continue
            try:
                rows = list(csv.reader(record))
            except csv.Error as exc:
                _report(errors, path, number, f"bad CSV: {exc}")
                continue
            if len(rows) != 1:
                _report(errors, path, number, f"bad CSV: {len(rows)} rows in one record")
                continue
            row = rows[0]
            if fields is not None:
                names = fields
                if len(row) != len(names):
                    reason = f"expected {len(names)} fields (per #Fields), got {len(row)}"
                    _report(errors, path, number, reason)
                    continue
            else:
                found = _FIELDS_BY_COUNT.get(len(row))
                if found is None:
                    reason = f"{len(row)} fields and no #Fields header (expected 26, 27 or 30)"
                    _report(errors, path, number, reason)
                    continue
                names = found
            result = dict.fromkeys(FIELDS_2016, "")
            result.update(zip(names, row))
            yield result


def _rows_if_present(path: Path, errors: list[tuple[Path, int, str]] | None) -> Iterator[dict[str, str]]:
    """``parse_log_file``'s rows, none if the file was removed after it was listed (the node's
    retention removes old files while a search runs)."""
    try:
        yield from parse_log_file(path, errors)
    except FileNotFoundError:
        return


def _report(errors: list[tuple[Path, int, str]] | None, path: Path, line: int, reason: str) -> None:
    if errors is not None:
        errors.append((path, line, reason))


def iter_log_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The MSGTRK*.LOG files in ``directory``, sorted by date (and hour) then number.

    Matches ours (``MSGTRKyyyymmdd-n.LOG``) and Exchange's (``MSGTRKyyyymmddhh-n.LOG``, the
    ``MSGTRKMA/MD/MS`` prefixes, any case). Files whose name does not parse are left out.
    """
    found: list[tuple[tuple[str, str, int, str], Path]] = []
    for entry in Path(directory).iterdir():
        match = _ANY_NAME.match(entry.name)
        if match is None or not entry.is_file():
            continue
        prefix, day, hour, number = match.groups()
        found.append(((day, hour or "", int(number), prefix.upper()), entry))
    found.sort(key=lambda pair: pair[0])
    return [path for _, path in found]


def _strip_brackets(message_id: str) -> str:
    message_id = message_id.strip()
    if message_id.startswith("<") and message_id.endswith(">"):
        message_id = message_id[1:-1].strip()
    return message_id


def search(
    directory: str | os.PathLike[str],
    *,
    message_id: str | None = None,
    network_message_id: str | None = None,
    internal_message_id: str | int | None = None,
    sender: str | None = None,
    recipient: str | Sequence[str] | None = None,
    event_id: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    errors: list[tuple[Path, int, str]] | None = None,
    subject: str | None = None,
) -> Iterator[dict[str, str]]:
    """Yield the rows of every log in ``directory`` that match all the given filters.

    Addresses, event-id and network-message-id compare case-insensitively (``sender`` matches the
    sender-address, the header's author, or the return-path, the envelope's: ``<>`` finds the null
    sender's rows; ``recipient``, one
    address or several, matches when any of them is an entry of the ``;`` list, as
    Get-MessageTrackingLog's ``-Recipients``); ``subject`` is found anywhere in the subject, in
    any case (as ``-MessageSubject``); ``message_id`` compares exactly, with or without
    angle brackets. ``start``/``end`` are inclusive (naive means UTC); with either given,
    rows whose date-time does not parse are skipped. Rows come in file order; malformed rows
    are skipped and reported into ``errors`` as in ``parse_log_file``.
    """
    want_message_id = None if message_id is None else _strip_brackets(message_id)
    want_network_id = None if network_message_id is None else network_message_id.strip().lower()
    want_internal_id = None if internal_message_id is None else str(internal_message_id).strip()
    want_sender = None if sender is None else sender.strip().casefold()
    if isinstance(recipient, str):
        recipient = (recipient,)
    want_recipients = None if not recipient else {r.strip().casefold() for r in recipient}
    want_event = None if event_id is None else event_id.strip().casefold()
    want_subject = None if subject is None else subject.casefold()
    start_utc = None if start is None else _as_utc(start)
    end_utc = None if end is None else _as_utc(end)

    for path in iter_log_files(directory):
        for row in _rows_if_present(path, errors):
            if want_event is not None and row["event-id"].strip().casefold() != want_event:
                continue
            if (
                want_message_id is not None
                and _strip_brackets(row["message-id"]) != want_message_id
            ):
                continue
            if (
                want_network_id is not None
                and row["network-message-id"].strip().lower() != want_network_id
            ):
                continue
            if (
                want_internal_id is not None
                and row["internal-message-id"].strip() != want_internal_id
            ):
                continue
            if want_sender is not None and want_sender not in (
                    row["sender-address"].strip().casefold(), row["return-path"].strip().casefold()):
                continue
            if want_subject is not None and want_subject not in row["message-subject"].casefold():
                continue
            if want_recipients is not None and want_recipients.isdisjoint(
                address.strip().casefold() for address in split_list(row["recipient-address"])
            ):
                continue
            if start_utc is not None or end_utc is not None:
                try:
                    when = parse_datetime(row["date-time"])
                except ValueError:
                    continue
                if start_utc is not None and when < start_utc:
                    continue
                if end_utc is not None and when > end_utc:
                    continue
            yield row
