"""A hostile Subject, From or Sender costs a bounded, small amount to read.

A header section may be 256 KB (frontend.max_header_size) and one field all of it. The email
package's readers cost far more than the field on hostile input: the Subject's header_factory
took ~1.5 GB and 3 s for 264 KB of folded ``=?x-unknown?Q?a=FF=?=`` words, getaddresses ~2.3 s
for a From of 240 KB of ``@``, on the event loop of the receiving process, again in the shadow
store and in the DSN, and the memory was never given back. smtp/headers.py reads only a Subject's
first SUBJECT_LIMIT and an address field's first ADDRESS_FIELD_LIMIT characters. Here: the readers
in-process (time, tracemalloc peak), the DSN builder, and a node over a real socket (its 250s and
its peak RSS, VmHWM).
"""

from __future__ import annotations

import email
import email.policy
import re
import time
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path

from test_receive import Raw, assert_reply, ehlo, messages, send_one

from transportd.smtp.dsn import RecipientReport, build_dsn
from transportd.smtp.headers import author_address, decoded_subject, header_fields

HOSTILE_WORD = b"=?x-unknown?Q?a=FF=?="
MAX_SECONDS = 0.5  # each; the unbounded readers took 2-3 s (far more under tracemalloc)
MAX_TRACED = 50 * 1024 * 1024  # each; the Subject took ~1.5 GB
SUBJECT_LIMIT = 4096  # smtp/headers.SUBJECT_LIMIT: the characters of a Subject read


def hostile_subject_message(size: int = 250_000) -> bytes:
    """A message whose Subject is ``size`` octets of folded encoded-words of an unknown charset."""
    line = b" " + HOSTILE_WORD + b" " + HOSTILE_WORD + b"\r\n"
    return (b"From: a@remote.test\r\nTo: alice@example.test\r\nSubject: s\r\n" + line * (size // len(line))
            + b"Message-ID: <hostile-subject@remote.test>\r\n\r\nbody\r\n")


def hostile_from_message(size: int = 240_000) -> tuple[bytes, bytes]:
    """A message whose From is ``size`` characters of ``@`` (folded), and one whose Sender is a
    list of ``size`` characters of commented, quoted mailboxes after a first plain one."""
    ats = b"\r\n ".join([b"@" * 900] * (size // 900))
    mailboxes = b"".join([b' "q\\"x" (c (n) ) <a@b.c>,\r\n'] * (size // 27))
    return (b"From: " + ats + b"\r\nTo: alice@example.test\r\nSubject: hostile from\r\n\r\nbody\r\n",
            b"Sender: x@remote.test,\r\n" + mailboxes + b" z@y.test\r\nFrom: a@remote.test\r\n"
            b"To: alice@example.test\r\nSubject: hostile sender\r\n\r\nbody\r\n")


def bounded(read, *args):
    """read(*args) after checking it takes under MAX_SECONDS and traces under MAX_TRACED."""
    start = time.perf_counter()
    read(*args)
    took = time.perf_counter() - start
    assert took < MAX_SECONDS, f"{read.__name__} took {took:.2f} s"
    tracemalloc.start()
    try:
        result = read(*args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_TRACED, f"{read.__name__} peaked at {peak / 2**20:.0f} MB"
    return result


def test_a_hostile_subject_is_read_in_bounded_time_and_memory() -> None:
    data = hostile_subject_message()
    assert len(data) > 240_000
    message_id, _, subject, author = bounded(header_fields, data)
    assert (message_id, author) == ("<hostile-subject@remote.test>", "a@remote.test")
    assert subject.startswith("s a\ufffd=a\ufffd=") and len(subject) <= SUBJECT_LIMIT
    unfolded = " ".join(["s"] + [HOSTILE_WORD.decode()] * 30_000)
    assert bounded(decoded_subject, unfolded) == subject


def test_a_hostile_from_or_sender_is_read_in_bounded_time_and_memory() -> None:
    ats, sender_list = hostile_from_message()
    assert len(ats) > 240_000 and len(sender_list) > 240_000
    assert bounded(header_fields, ats)[3] == ""  # no address: the envelope sender stands in
    assert bounded(header_fields, sender_list)[3] == "x@remote.test"  # the first of the Sender field
    assert bounded(author_address, "", "@" * 240_000) == ""
    assert bounded(author_address, "", "(" * 120_000 + "a@b" + ")" * 120_000) == ""


def test_ordinary_fields_read_as_before_and_long_ones_from_their_start() -> None:
    """Within the limits nothing changes; over them, what is wholly in the first characters is
    read (a long list of authors still gives its first, a first mailbox cut off gives none)."""
    assert decoded_subject("=?UTF-8?Q?Gr=C3=BC=C3=9Fe?= aus Berlin") == "Grüße aus Berlin"
    assert decoded_subject("word " * 800) == ("word " * 800)  # 4000 characters, under the limit
    long = decoded_subject("=?UTF-8?Q?caf=C3=A9?= " + "x" * 10 + " word" * 2000)
    assert long.startswith("café xxxxxxxxxx word word") and long.endswith("word")
    assert len(long) <= SUBJECT_LIMIT
    assert author_address("", "Alice <alice@example.org>, bob@example.net") == "alice@example.org"
    assert author_address("", ", ".join(f"User {i} <u{i}@example.org>" for i in range(500))) == "u0@example.org"
    assert author_address("", '"' + "n" * 5000 + '" <a@example.org>') == ""
    assert author_address("Secretary <sec@example.org>", "a@example.org") == "sec@example.org"


def test_a_dsn_of_a_hostile_subject_is_built_in_bounded_time_and_memory() -> None:
    when = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    report = RecipientReport(address="alice@example.test", action="failed", status="5.1.1",
                             diagnostic="550 5.1.1 user unknown")

    def dsn_of(original: bytes) -> bytes:
        return build_dsn(reporting_mta="mta1.example.org", original_sender="a@remote.test",
                         original_message=original, recipients=[report], arrival_date=when, now=when)

    dsn = bounded(dsn_of, hostile_subject_message())
    subject = email.message_from_bytes(dsn, policy=email.policy.default)["Subject"]
    assert subject.startswith("Undeliverable: s a\ufffd=a\ufffd=") and subject.endswith("...")
    ordinary = dsn_of(b"From: a@remote.test\r\nSubject: Quarterly report\r\n\r\nhi\r\n")
    assert b"Subject: Undeliverable: Quarterly report\r\n" in ordinary


def peak_rss_mb(pid: int) -> float:
    match = re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    assert match, f"no VmHWM for {pid}"
    return int(match.group(1)) / 1024


def test_a_node_takes_hostile_header_fields_with_bounded_memory(make_node) -> None:
    """Over a real socket: the hostile Subject, From and Sender each get their 250, the queue has
    their subjects, and the receiving process (frontend.workers=1: the node) never grew past
    400 MB (it reached ~1.4 GB)."""
    node = make_node().start()
    assert node.proc is not None
    c = Raw(node.port, timeout=60)
    ehlo(c)
    ats, sender_list = hostile_from_message()
    for data in (hostile_subject_message(), ats, sender_list):
        r = send_one(c, "a@remote.test", ["alice@example.test"], data)
        assert re.fullmatch(r"250 2\.0\.0 Ok: queued as \d+", r), r
    assert_reply(c.cmd("QUIT"), 221, "2.0.0")
    peak = peak_rss_mb(node.proc.pid)
    print(f"node VmHWM {peak:.0f} MB")
    assert peak < 400, f"the node peaked at {peak:.0f} MB"
    subjects = sorted(m["subject"] for m in messages(node))
    assert subjects[:2] == ["hostile from", "hostile sender"] and subjects[2].startswith("s a\ufffd=")
    assert node.alive


def test_a_long_author_list_is_cut_between_two_addresses() -> None:
    """A From over the limit is cut at its last comma between two addresses, never inside a quoted
    name or a comment that holds one: newer Pythons' ``getaddresses`` (strict mode) fail the whole
    parse of a field cut there, and the author, whole at its start, was lost."""
    from transportd.smtp.headers import _last_top_level_comma
    assert _last_top_level_comma('"Doe, John" <j@x.test>, b@x.test') == 22
    assert _last_top_level_comma('J (a, comment) <j@x.test>') == -1
    assert _last_top_level_comma('"a \\" b, c" <j@x.test>') == -1  # an escaped quote stays inside
    assert _last_top_level_comma('<a,b@x.test>') == -1
    for pad in range(12):
        quoted = ", ".join(f'"Doe, John {"x" * pad} {i}" <j{i}@x.test>' for i in range(200))
        commented = ", ".join(f"J{i} (a, comment {'x' * pad}) <j{i}@x.test>" for i in range(200))
        assert author_address("", quoted) == author_address("", commented) == "j0@x.test"
