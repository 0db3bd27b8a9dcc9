"""The operator command line against real nodes: queue, message, tracking, config.

Every read command is checked against a running daemon and again after the
daemon stopped, with ``--config`` and with ``--data-dir``. Operator actions
(suspend, resume, retry, remove) are checked to reach a running daemon within
about a second, and to be picked up by a stopped one when it starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from click.testing import CliRunner

from conftest import free_port, queued_id, swaks, wait_for, wait_port, write_toml
from helpers import assert_one_error_line, run_cli
from transportd import config as config_mod
from transportd.cli import cli as transportd_cli

REPO = Path(__file__).resolve().parent.parent
SHIPPED_CONFIG = REPO / "config" / "single-node.toml"
LONG_RETRY = {"delivery": {"transient_failure_retry_interval": 300,
                           "outbound_connection_failure_retry_interval": 300}}
BOTH = (False, True)  # use_data_dir


# ------------------------------------------------------------------------------ helpers
#
# ``run_cli`` / ``node.cli`` start a real ``python -m transportd`` process (exit codes, stderr lines).
# ``invoke`` / ``cli``/``cli_json``/``track`` run the same click command in this process: the same code on
# the same queue database and MSGTRK files, without ~0.5 s of interpreter start-up per call.

def invoke(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    r = CliRunner().invoke(transportd_cli, list(args), catch_exceptions=False)
    res = subprocess.CompletedProcess(list(args), r.exit_code, r.stdout, r.stderr)
    if check and r.exit_code != 0:
        raise AssertionError(f"transportd {' '.join(args)} exited {r.exit_code}:\n{r.stdout}\n{r.stderr}")
    return res


def cli(node, *args: str, use_data_dir: bool = False, check: bool = True) -> subprocess.CompletedProcess:
    where = ["--data-dir", str(node.data_dir)] if use_data_dir else ["--config", str(node.config_path)]
    return invoke(*args, *where, check=check)


def cli_json(node, *args: str, use_data_dir: bool = False) -> list[dict]:
    out = cli(node, *args, "--json", use_data_dir=use_data_dir).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def track(node, use_data_dir: bool = False, **filters: str) -> list[dict]:
    args = ["tracking", "search"]
    for k, v in filters.items():
        args += [f"--{k.replace('_', '-')}", v]
    return cli_json(node, *args, use_data_dir=use_data_dir)


def send(node, to: str, sender: str = "bob@remote.test", *extra: str) -> int:
    return queued_id(swaks(node.port, "--to", to, "--from", sender, *extra))


def smarthost(sink) -> str:
    return f"smarthost:{sink.address}"


def queue_by_identity(node, identity: str, use_data_dir: bool = False) -> dict | None:
    for q in cli_json(node, "queue", "list", use_data_dir=use_data_dir):
        if q["identity"] == identity:
            return q
    return None


def message_ids(node, *args: str, use_data_dir: bool = False) -> list[int]:
    return [m["id"] for m in cli_json(node, "message", "list", *args, use_data_dir=use_data_dir)]


def in_retry(node, identity: str, count: int):
    def check():
        q = queue_by_identity(node, identity)
        return q if q and q["state"] == "Retry" and q["message_count"] == count else None
    return check


def parse_iso(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def table_line(output: str, *needles: str) -> str | None:
    """The first line of a table holding every needle."""
    for line in output.splitlines():
        if all(n in line for n in needles):
            return line
    return None


# ------------------------------------------------------------------------------ 1. queue list

def test_queue_list_shows_retry_queue_running_and_stopped(make_node, sink):
    node = make_node(smart_host=sink.address, overrides=LONG_RETRY).start()  # sink never started
    ident = smarthost(sink)
    send(node, "carol@foreign.test")
    wait_for(in_retry(node, ident, 1), timeout=10, what="smart host queue in Retry")
    send(node, "dave@foreign.test")
    wait_for(in_retry(node, ident, 2), timeout=10, what="two messages in the Retry queue")

    for phase in ("running", "stopped"):
        if phase == "stopped":
            assert node.stop() == 0
        for use_data_dir in BOTH:
            q = queue_by_identity(node, ident, use_data_dir=use_data_dir)
            assert q is not None, phase
            assert q["delivery_type"] == "SmartHostConnectorDelivery"
            assert q["state"] == "Retry" and q["message_count"] == 2, q
            nxt = parse_iso(q["next_retry_at"])
            assert nxt > datetime.now(timezone.utc) + timedelta(seconds=200), q
            assert q["last_error"].startswith("451 4.4.0") and sink.address in q["last_error"], q

            out = node.cli("queue", "list", use_data_dir=use_data_dir).stdout
            assert out.splitlines()[0].split()[:3] == ["identity", "delivery", "type"], out
            line = table_line(out, ident, "Retry")
            assert line is not None, out
            assert "SmartHostConnectorDelivery" in line and " 2 " in line and "451 4.4.0" in line, line
            assert not out.lstrip().startswith("{"), "table output expected without --json"


# ------------------------------------------------------------------------------ 2. message list/show

def test_message_list_and_show(make_node, sink):
    node = make_node(smart_host=sink.address, overrides=LONG_RETRY).start()  # sink never started
    ident = smarthost(sink)
    m1 = send(node, "carol@foreign.test", "bob@remote.test", "--header", "Subject: first cli message")
    wait_for(in_retry(node, ident, 1), timeout=10, what="first message deferred")
    m2 = send(node, "dave@foreign.test", "eve@remote.test", "--header", "Subject: second cli message")
    # A bifurcated message: the local copy is delivered, the foreign one waits.
    m3 = send(node, "alice@example.test,frank@foreign.test", "bob@remote.test")
    wait_for(lambda: node.maildir_files("alice@example.test"), what="local copy of the bifurcated message")
    wait_for(lambda: track(node, event_id="DEFER"), what="DEFER logged")

    for phase in ("running", "stopped"):
        if phase == "stopped":
            assert node.stop() == 0
        for use_data_dir in BOTH:
            rows = cli_json(node, "message", "list", use_data_dir=use_data_dir)
            by_id = {r["id"]: r for r in rows}
            assert set(by_id) == {m1, m2, m3}, rows
            assert by_id[m1]["from"] == "bob@remote.test" and by_id[m1]["subject"] == "first cli message"
            assert by_id[m2]["from"] == "eve@remote.test"
            assert by_id[m1]["queues"] == [ident]
            assert "451 4.4.0" in by_id[m1]["last_error"]
            assert message_ids(node, "--queue", ident, use_data_dir=use_data_dir) == [m1, m2, m3]
            # --limit says when it cut the list; ids named and not queued are named, exit 1.
            cut = cli(node, "message", "list", "--limit", "2", "--json", use_data_dir=use_data_dir)
            assert [json.loads(ln)["id"] for ln in cut.stdout.splitlines()] == [m1, m2]
            assert "only the first 2 message(s) are listed" in cut.stderr, cut.stderr
            assert "only the first" not in cli(node, "message", "list", "--limit", "3", use_data_dir=use_data_dir).stderr
            named = cli(node, "message", "list", str(m2), "9999", "--json", check=False, use_data_dir=use_data_dir)
            assert named.returncode == 1 and "no queued message 9999" in named.stderr, named.stderr
            assert [json.loads(ln)["id"] for ln in named.stdout.splitlines()] == [m2]
            # The queue's message count and the per-queue message list agree.
            for q in cli_json(node, "queue", "list", use_data_dir=use_data_dir):
                listed = message_ids(node, "--queue", q["identity"], use_data_dir=use_data_dir)
                assert len(listed) == q["message_count"], (q, listed)
            out = cli(node, "message", "list", use_data_dir=use_data_dir).stdout
            assert table_line(out, str(m1), "bob@remote.test", "first cli message") is not None, out

            shown = cli_json(node, "message", "show", str(m1), use_data_dir=use_data_dir)
            assert len(shown) == 1
            m = shown[0]
            assert m["id"] == m1 and m["sender"] == "bob@remote.test"
            assert [r["address"] for r in m["recipients"]] == ["carol@foreign.test"]
            r = m["recipients"][0]
            assert r["queue"] == ident and r["status"] == "Retry" and r["attempts"] >= 1
            assert r["last_error"].startswith("451 4.4.0") and r["next_retry_at"]
            assert "Subject: first cli message" in m["headers"]
            assert "body" not in m and "data" not in m
            events = [e["event-id"] for e in m["tracking"]]
            assert events[0] == "RECEIVE" and "DEFER" in events, events
            assert all(e["internal-message-id"] == str(m1) for e in m["tracking"])

            m = cli_json(node, "message", "show", str(m3), use_data_dir=use_data_dir)[0]
            status = {r["address"]: (r["queue"], r["status"]) for r in m["recipients"]}
            assert status == {"alice@example.test": ("mailbox:local", "Delivered"),
                              "frank@foreign.test": (ident, "Ready")} or \
                status == {"alice@example.test": ("mailbox:local", "Delivered"),
                           "frank@foreign.test": (ident, "Retry")}, status
            assert {"RECEIVE", "DELIVER"} <= {e["event-id"] for e in m["tracking"]}

            out = cli(node, "message", "show", str(m1), use_data_dir=use_data_dir).stdout
            for needle in ("bob@remote.test", "Recipients:", "Headers:", "Subject: first cli message",
                           "Tracking events:"):
                assert needle in out, (needle, out)
            assert table_line(out, "carol@foreign.test", ident, "Retry") is not None, out
            assert table_line(out, "RECEIVE") and table_line(out, "DEFER"), out


def test_messages_waiting_in_a_queue_in_retry_are_shown_and_filtered_as_retry(make_node, sink):
    """The next hop down, three messages: the first is tried and deferred, the queue goes to Retry
    and the other two wait for its next retry (nothing tries them before it). ``message list``,
    ``message show`` and ``--filter state=deferred`` show all three as Retry (as Get-Message shows a
    queue in Retry, as Postfix's deferred queue holds the mail for a dead destination), so
    ``message remove --filter state=deferred`` (``postsuper -d ALL deferred``) takes all three;
    ``state=ready`` none. What the scheduler does is unchanged: they stay untried."""
    node = make_node(smart_host=sink.address, overrides=LONG_RETRY).start()  # sink never started
    ident = smarthost(sink)
    first = send(node, "carol@foreign.test")
    wait_for(in_retry(node, ident, 1), timeout=10, what="first message deferred, the queue in Retry")
    others = [send(node, "dave@foreign.test"), send(node, "erin@foreign.test")]
    wait_for(in_retry(node, ident, 3), timeout=10, what="three messages in the Retry queue")
    ids = [first, *others]
    q = queue_by_identity(node, ident)

    for phase in ("running", "stopped"):
        if phase == "stopped":
            assert node.stop() == 0
        for use_data_dir in BOTH:
            rows = {r["id"]: r for r in cli_json(node, "message", "list", use_data_dir=use_data_dir)}
            assert {i: rows[i]["status"] for i in ids} == {i: "Retry" for i in ids}, rows
            # Each waits for the queue's next retry: that is the time shown.
            assert {rows[i]["next_retry_at"] for i in others} == {q["next_retry_at"]}, (rows, q)
            for state in ("deferred", "Retry", "status=retry"):
                term = state if "=" in state else f"state={state}"
                listed = message_ids(node, "--filter", term, use_data_dir=use_data_dir)
                assert listed == ids, (term, listed)
            assert message_ids(node, "--filter", "state=ready", use_data_dir=use_data_dir) == []
            assert message_ids(node, "--filter", "state!=deferred", use_data_dir=use_data_dir) == []
            for mid in others:
                m = cli_json(node, "message", "show", str(mid), use_data_dir=use_data_dir)[0]
                assert m["status"] == "Retry", m
                r = m["recipients"][0]
                assert (r["queue"], r["status"], r["attempts"]) == (ident, "Retry", 0), r
                assert r["next_retry_at"] == q["next_retry_at"], (r, q)
                out = cli(node, "message", "show", str(mid), use_data_dir=use_data_dir).stdout
                assert "status Retry" in out and table_line(out, ident, "Retry", q["next_retry_at"]), out
            out = cli(node, "message", "list", use_data_dir=use_data_dir).stdout
            assert all(table_line(out, str(i), "Retry") for i in ids), out
    # postsuper -d ALL deferred: every message for the dead next hop, not only the one tried.
    removed = cli_json(node, "message", "remove", "--filter", "state=deferred")
    assert sorted(r["id"] for r in removed) == ids, removed
    assert cli_json(node, "message", "list") == []


def test_message_export_writes_the_queued_octets_and_show_names_the_dsn_parameters(make_node, sink, tmp_path):
    """Export-Message: the message as queued (our Received field first, the client's octets
    after), to standard output or a file, with the envelope as X-Sender/X-Receiver on request;
    ``message show`` lists the RFC 3461 parameters the sender gave."""
    import smtplib
    node = make_node(smart_host=sink.address, overrides=LONG_RETRY).start()  # sink never started
    body = "Subject: export me\r\nX-Tag: 8e1f\r\n\r\nline one\r\n.dotted\r\n"  # smtplib sends ..dotted
    with smtplib.SMTP("127.0.0.1", node.port, timeout=20) as s:
        s.ehlo("client.test")
        s.mail("bob@remote.test", ["RET=HDRS", "ENVID=E77"])
        assert s.rcpt("carol@foreign.test", ["NOTIFY=SUCCESS,FAILURE"])[0] == 250
        code, resp = s.data(body.encode())
        assert code == 250, resp
    mid = int(resp.decode().rsplit(" ", 1)[1])
    wait_for(in_retry(node, smarthost(sink), 1), timeout=10, what="message deferred")

    raw = subprocess.run([sys.executable, "-m", "transportd", "message", "export", str(mid), "--config",
                          str(node.config_path)], capture_output=True, timeout=60, check=True).stdout
    assert raw.startswith(b"Received: from client.test"), raw[:200]
    assert raw.endswith(b"Subject: export me\r\nX-Tag: 8e1f\r\n\r\nline one\r\n.dotted\r\n"), raw[-120:]
    target = tmp_path / "export.eml"
    done = cli(node, "message", "export", str(mid), "-o", str(target), "--envelope")
    data = target.read_bytes()
    assert data == b"X-Sender: <bob@remote.test>\r\nX-Receiver: <carol@foreign.test>\r\n" + raw
    assert f"{len(data)} octets written" in done.stderr
    missing = cli(node, "message", "export", "999999", check=False)
    assert missing.returncode != 0 and "no message 999999" in missing.stderr
    nowhere = cli(node, "message", "export", str(mid), "-o", str(tmp_path / "no-such-dir" / "x.eml"), check=False)
    assert nowhere.returncode == 1 and "Traceback" not in nowhere.stderr, nowhere.stderr
    assert f"cannot write {tmp_path / 'no-such-dir' / 'x.eml'}: No such file or directory" in nowhere.stderr

    shown = cli(node, "message", "show", str(mid)).stdout
    assert "DSN (RFC 3461):" in shown and "RET=HDRS ENVID=E77" in shown, shown
    assert table_line(shown, "carol@foreign.test", "NOTIFY=SUCCESS,FAILURE") is not None, shown


# A control character that reaches a terminal raw (C0 but the line feed that ends a line, DEL, C1).
RAW_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def test_control_characters_from_the_mail_never_reach_the_terminal_raw(make_node, sink):
    """A Subject (and a header field) holding an ESC sequence that clears the screen and recolours
    it, a BEL, a backspace, a C1 CSI (U+009B) and a bare CR: every table and detail the operator
    reads shows them as escapes (``\\x1b[2J``), the text still readable; ``--json`` carries the
    exact value, with no raw control character on the line either."""
    import smtplib
    node = make_node(smart_host=sink.address, overrides=LONG_RETRY).start()  # sink never started
    subject = "alert \x1b[2J\x1b[1;31mred\x1b[0m \x07bell\x08 \x9bcsi"
    with smtplib.SMTP("127.0.0.1", node.port, timeout=20) as s:
        s.ehlo("client.test")
        s.mail("bob@remote.test")
        assert s.rcpt("carol@foreign.test")[0] == 250
        code, resp = s.data(b"From: <bob@remote.test>\r\nSubject: " + subject.encode() +
                            b"\r\nX-Note: \x1b]0;title\x07 hidden\rover\r\n\r\nbody\r\n")
        assert code == 250, resp
    mid = int(resp.decode().rsplit(" ", 1)[1])
    wait_for(in_retry(node, smarthost(sink), 1), timeout=10, what="message deferred")

    shown = r"alert \x1b[2J\x1b[1;31mred\x1b[0m \x07bell\x08 \x9bcsi"
    for cmd in (["message", "list"], ["message", "show", str(mid)], ["queue", "list"], ["tracking", "search"]):
        out = node.cli(*cmd).stdout
        assert not RAW_CONTROL.search(out), (cmd, out)
    listed = node.cli("message", "list").stdout
    assert table_line(listed, str(mid), "bob@remote.test", shown[:40]) is not None, listed
    detail = node.cli("message", "show", str(mid)).stdout
    assert f"Subject:             {shown}\n" in detail, detail
    assert f"  Subject: {shown}\n" in detail and r"  X-Note: \x1b]0;title\x07 hidden\rover" in detail, detail

    for cmd in (["message", "list"], ["message", "show", str(mid)]):
        res = node.cli(*cmd, "--json")
        assert not RAW_CONTROL.search(res.stdout), (cmd, res.stdout)
        m, = [json.loads(line) for line in res.stdout.splitlines()]
        assert m["subject"] == subject, m
    m = node.cli_json("message", "show", str(mid))[0]
    assert f"Subject: {subject}\r\nX-Note: \x1b]0;title\x07 hidden\rover" in m["headers"], m["headers"]


# ------------------------------------------------------------------------------ 3. suspend/resume

def test_suspend_and_resume_queue_and_message(make_node, sink):
    sink.start()
    node = make_node(smart_host=sink.address).start()
    ident = smarthost(sink)
    send(node, "carol@foreign.test")
    wait_for(lambda: len(sink.messages()) == 1, what="first message at the sink")

    res = node.cli("queue", "suspend", ident)
    assert "suspended" in res.stdout
    assert "was already suspended (nothing changed)" in cli(node, "queue", "suspend", ident).stdout
    held = send(node, "dave@foreign.test")
    # Retry-Queue of a suspended queue would deliver nothing: refused, back-off and state unchanged.
    refused = cli(node, "queue", "retry", ident, check=False)
    assert refused.returncode == 1 and f"queue {ident} is suspended" in refused.stderr, refused.stderr
    node.wait_passes(3)  # whole scheduler passes that saw the message due in a suspended queue
    assert len(sink.messages()) == 1, "a suspended queue delivered"
    q = queue_by_identity(node, ident, use_data_dir=True)
    assert q["state"] == "Suspended" and q["message_count"] == 1, q
    assert message_ids(node) == [held]
    node.cli("queue", "resume", ident, use_data_dir=True)
    wait_for(lambda: len(sink.messages()) == 2, timeout=2.5, what="delivery after queue resume")
    # (a queue named in any case: host and domain names are case-insensitive)
    assert f"queue {ident} was not suspended (nothing changed)" in cli(node, "queue", "resume", ident.upper()).stdout
    wait_for(lambda: message_ids(node) == [], timeout=2, what="queue empty")
    assert queue_by_identity(node, ident)["state"] == "Ready"

    # One message: hold it while its queue is suspended, then release the queue.
    cli(node, "queue", "suspend", ident)
    one = send(node, "erin@foreign.test")
    res = cli(node, "message", "suspend", str(one), use_data_dir=True)
    assert f"message {one} suspended" in res.stdout
    again = cli(node, "message", "suspend", str(one))
    assert "no message suspended: the 1 selected were already suspended" in again.stdout, again.stdout
    cli(node, "queue", "resume", ident)
    node.wait_passes(3)
    assert len(sink.messages()) == 2, "a suspended message was delivered"
    rows = cli_json(node, "message", "list")
    assert [(r["id"], r["status"]) for r in rows] == [(one, "Suspended")], rows
    assert cli_json(node, "message", "show", str(one))[0]["status"] == "Suspended"
    # ... and its recipient is shown held too (it was shown Ready, as if about to go)
    shown = cli(node, "message", "show", str(one)).stdout
    line, = [ln for ln in shown.splitlines() if ln.startswith("erin@foreign.test")]
    assert line.split()[1:3] == [ident, "Suspended"], shown
    assert f"suspended by an operator: nothing is delivered until 'transportd message resume {one}'" in shown
    cli(node, "message", "resume", str(one))
    # (the sink's file names sort by the second only, and a file may still be being written: look
    # for the message in all of them)
    wait_for(lambda: any(b"erin@foreign.test" in m for m in sink.messages()), timeout=2.5,
             what="delivery after message resume")
    assert len(sink.messages()) == 3


def test_suspend_while_stopped_is_honoured_on_start(make_node, sink):
    sink.start()
    node = make_node(smart_host=sink.address).start()
    ident = smarthost(sink)
    send(node, "carol@foreign.test")
    wait_for(lambda: len(sink.messages()) == 1, what="first message at the sink")
    cli(node, "queue", "suspend", ident)
    held = send(node, "dave@foreign.test")
    assert node.stop() == 0
    cli(node, "queue", "resume", ident, use_data_dir=True)
    cli(node, "message", "suspend", str(held), use_data_dir=True)
    node.start()
    node.wait_passes(3)
    assert len(sink.messages()) == 1, "a message suspended while the daemon was down was delivered"
    cli(node, "message", "resume", str(held))
    wait_for(lambda: len(sink.messages()) == 2, timeout=2.5, what="delivery after message resume")


# ------------------------------------------------------------------------------ 4. retry

def test_queue_retry_reaches_running_daemon(make_node, sink):
    node = make_node(smart_host=sink.address, overrides=LONG_RETRY).start()
    ident = smarthost(sink)
    send(node, "carol@foreign.test")
    wait_for(in_retry(node, ident, 1), timeout=10, what="queue in Retry")
    sink.start()
    node.wait_passes(3)
    assert sink.messages() == [], "delivered before its retry time: the test proves nothing"
    res = node.cli("queue", "retry", ident)
    assert res.stdout.startswith(f"queue {ident} will be retried now (1 recipient(s) due)")
    wait_for(lambda: sink.messages(), timeout=2.5, what="delivery after queue retry")
    wait_for(lambda: queue_by_identity(node, ident)["message_count"] == 0, timeout=2, what="queue empty")


def test_queue_retry_while_stopped(make_node, sink):
    node = make_node(smart_host=sink.address, overrides=LONG_RETRY).start()
    ident = smarthost(sink)
    send(node, "carol@foreign.test")
    wait_for(in_retry(node, ident, 1), timeout=10, what="queue in Retry")
    assert node.stop() == 0
    res = cli(node, "queue", "retry", ident, use_data_dir=True)
    # Not "now" (it said so, the node stopped): at the node's next start.
    assert f"queue {ident} will be retried when the node starts (it is not running)" in res.stdout
    q = queue_by_identity(node, ident, use_data_dir=True)
    assert q["state"] == "Ready" and q["next_retry_at"] is None and q["message_count"] == 1, q
    sink.start()
    node.start()
    wait_for(lambda: sink.messages(), timeout=3, what="delivery after restart")


# ------------------------------------------------------------------------------ 5. remove

def dsn_events_for(node, original_id: int) -> list[dict]:
    return [e for e in track(node, event_id="DSN")
            if f"original internal id {original_id};" in e["source-context"]]


def test_message_remove_and_ndr_running(make_node, sink):
    node = make_node(smart_host=sink.address, overrides=LONG_RETRY).start()  # sink never started
    ident = smarthost(sink)
    m1 = send(node, "carol@foreign.test", "zed@remote.test")
    m2 = send(node, "dave@foreign.test", "bob@example.test", "--header", "Subject: to be removed")
    wait_for(in_retry(node, ident, 2), timeout=10, what="two messages queued")

    res = node.cli("message", "remove", str(m1))
    assert f"message {m1} removed" in res.stdout
    assert message_ids(node) == [m2]
    # The daemon keeps writing tracking rows after the CLI's DROP: the DROP must survive.
    m3 = send(node, "alice@example.test", "yan@remote.test")
    wait_for(lambda: node.maildir_files("alice@example.test"), what="local delivery")
    wait_for(lambda: track(node, event_id="DELIVER", internal_message_id=str(m3)), what="DELIVER logged")
    drops = track(node, event_id="DROP")
    assert [d["internal-message-id"] for d in drops] == [str(m1)], drops
    assert drops[0]["recipient-address"] == "carol@foreign.test"
    assert drops[0]["sender-address"] == "zed@remote.test"
    assert track(node, event_id="RECEIVE", internal_message_id=str(m3))
    assert not dsn_events_for(node, m1), "an NDR without --ndr"
    node.wait_passes(2)
    assert node.maildir_files("zed@remote.test") == []

    res = node.cli("message", "remove", str(m2), "--ndr")
    assert "NDR" in res.stdout
    files = wait_for(lambda: node.maildir_files("bob@example.test"), timeout=3, what="NDR in bob's Maildir")
    ndr = files[0].read_bytes()
    assert b"dave@foreign.test" in ndr and b"5.2.0" in ndr, ndr[:2000]
    assert b"to be removed" in ndr
    assert message_ids(node) == []
    dsn = dsn_events_for(node, m2)
    assert len(dsn) == 1 and dsn[0]["recipient-address"] == "bob@example.test", dsn
    assert [d["internal-message-id"] for d in track(node, event_id="DROP")] == [str(m1), str(m2)]
    wait_for(lambda: track(node, event_id="DELIVER", recipient="bob@example.test"), what="NDR DELIVER logged")


@pytest.mark.parametrize("use_data_dir", BOTH, ids=["config", "data-dir"])
def test_message_remove_and_ndr_stopped(make_node, sink, use_data_dir):
    node = make_node(smart_host=sink.address, overrides=LONG_RETRY).start()  # sink never started
    ident = smarthost(sink)
    m1 = send(node, "carol@foreign.test", "zed@remote.test")
    m2 = send(node, "dave@foreign.test", "bob@example.test")
    wait_for(in_retry(node, ident, 2), timeout=10, what="two messages queued")
    assert node.stop() == 0

    cli(node, "message", "remove", str(m1), use_data_dir=use_data_dir)
    res = cli(node, "message", "remove", str(m2), "--ndr", use_data_dir=use_data_dir)
    assert "NDR" in res.stdout
    queued = cli_json(node, "message", "list", use_data_dir=use_data_dir)
    assert len(queued) == 1 and queued[0]["from"] is not None and queued[0]["from"] == "", queued
    assert queued[0]["queues"] == ["mailbox:local"], queued
    assert [d["internal-message-id"] for d in track(node, event_id="DROP")] == [str(m1), str(m2)]
    assert len(dsn_events_for(node, m2)) == 1 and not dsn_events_for(node, m1)

    node.start()
    files = wait_for(lambda: node.maildir_files("bob@example.test"), timeout=3, what="NDR in bob's Maildir")
    assert b"dave@foreign.test" in files[0].read_bytes()
    wait_for(lambda: message_ids(node) == [], timeout=3, what="NDR delivered")
    assert node.maildir_files("zed@remote.test") == []


# ------------------------------------------------------------------------------ 6. tracking search

def test_tracking_search_filters(make_node, sink):
    sink.start()
    node = make_node(smart_host=sink.address).start()
    a = send(node, "alice@example.test", "bob@remote.test", "--header", "Message-Id: <cli-track-1@remote.test>")
    b = send(node, "carol@foreign.test", "zed@remote.test", "--header", "Message-Id: <cli-track-2@remote.test>")
    wait_for(lambda: node.maildir_files("alice@example.test") and sink.messages(), what="both delivered")
    wait_for(lambda: track(node, event_id="SENDEXTERNAL"), what="SENDEXTERNAL logged")

    for phase in ("running", "stopped"):
        if phase == "stopped":
            assert node.stop() == 0
        for use_data_dir in BOTH:
            def search(*args: str) -> list[dict]:
                return cli_json(node, "tracking", "search", *args, use_data_dir=use_data_dir)

            everything = search()
            assert {e["internal-message-id"] for e in everything} == {str(a), str(b)}

            for mid in ("<cli-track-1@remote.test>", "cli-track-1@remote.test"):
                rows = search("--message-id", mid)
                assert rows and {r["internal-message-id"] for r in rows} == {str(a)}, rows
                assert {"RECEIVE", "DELIVER"} <= {r["event-id"] for r in rows}

            rows = search("--sender", "ZED@remote.test")
            assert rows and {r["sender-address"] for r in rows} == {"zed@remote.test"}
            assert {r["event-id"] for r in rows} == {"RECEIVE", "SENDEXTERNAL"}

            rows = search("--recipient", "alice@example.test")
            assert rows and all("alice@example.test" in r["recipient-address"] for r in rows)
            assert {r["internal-message-id"] for r in rows} == {str(a)}
            # Repeated, any of them (as -Recipients): both messages, not the last address only.
            rows = search("--recipient", "alice@example.test", "--recipient", "CAROL@foreign.test")
            assert {r["internal-message-id"] for r in rows} == {str(a), str(b)}, rows

            rows = search("--event-id", "deliver")
            assert [(r["event-id"], r["internal-message-id"]) for r in rows] == [("DELIVER", str(a))]

            times = sorted(parse_iso(e["date-time"]) for e in everything)
            first, last = times[0], times[-1]

            def fmt(t: datetime) -> str:
                return t.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"

            assert search("--end", fmt(first - timedelta(seconds=1))) == []
            assert search("--start", fmt(last + timedelta(seconds=1))) == []
            assert len(search("--start", fmt(first), "--end", fmt(last))) == len(everything)
            assert len(search("--start", fmt(first - timedelta(hours=1)))) == len(everything)
            backwards = cli(node, "tracking", "search", "--start", fmt(last), "--end", fmt(first),
                            check=False, use_data_dir=use_data_dir)
            assert backwards.returncode == 2 and "is before --start" in backwards.stderr, backwards.stderr
            # Combined filters are ANDed.
            assert search("--sender", "zed@remote.test", "--event-id", "DELIVER") == []

            out = cli(node, "tracking", "search", "--event-id", "SENDEXTERNAL", use_data_dir=use_data_dir).stdout
            assert out.splitlines()[0].startswith("date-time")
            assert table_line(out, "SENDEXTERNAL", str(b), "zed@remote.test") is not None, out

            for opt in ("--start", "--end"):
                res = cli(node, "tracking", "search", opt, "yesterday", check=False, use_data_dir=use_data_dir)
                assert res.returncode == 2, (res.stdout, res.stderr)
                assert opt in res.stderr and "yesterday" in res.stderr and "ISO" in res.stderr, res.stderr
                assert "Traceback" not in res.stderr and res.stdout == ""
    # The same from a real process.
    res = node.cli("tracking", "search", "--start", "2026-13-45", check=False, use_data_dir=True)
    assert res.returncode == 2 and "--start" in res.stderr and "2026-13-45" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    # A misspelt event id matches no row: refused (exit 2), not an empty table read as "nothing
    # was sent"; every event id of Exchange's logs is searched, in any case, even ones we never write.
    res = node.cli("tracking", "search", "--event-id", "SENDEXTRNAL", check=False, use_data_dir=True)
    line = assert_one_error_line(res, 2, "unknown event id 'SENDEXTRNAL'", "did you mean 'SENDEXTERNAL'?",
                                 "SENDEXTERNAL", "AGENTINFO", "NOTIFYMAPI")
    assert res.stdout == "" and "Traceback" not in res.stderr, line
    res = cli(node, "tracking", "search", "--event-id", "StoreDriver", check=False)
    assert res.returncode == 2 and "source" in res.stderr and "not an event id" in res.stderr, res.stderr
    for exchange_only in ("AGENTINFO", "notifymapi", "Submit", "INITMESSAGECREATED"):
        assert cli_json(node, "tracking", "search", "--event-id", exchange_only) == []
    # A row that cannot be read is skipped and counted on stderr, not silently dropped.
    log = max((node.data_dir / "msgtrk").glob("*.LOG"))
    with open(log, "a", encoding="utf-8") as f:
        f.write('2026-11-22T10:00:00.000Z,"unterminated\n')
    res = node.cli("tracking", "search", "--event-id", "DELIVER", "--json", use_data_dir=True)
    assert [json.loads(ln)["internal-message-id"] for ln in res.stdout.splitlines()] == [str(a)]
    assert "warning: 1 malformed tracking row(s) skipped" in res.stderr and log.name in res.stderr, res.stderr


# ------------------------------------------------------------------------------ 7. config

def test_config_show_shipped_file():
    data_dir = (SHIPPED_CONFIG.parent / "../data/single-node").resolve()
    existed = data_dir.exists()
    res = run_cli("config", "show", "--config", str(SHIPPED_CONFIG))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for key in config_mod.KEYS:
        line = next((ln for ln in lines if ln.startswith(key.dotted + " ")), None)
        assert line is not None, f"{key.dotted} missing from config show"
        if key.exchange:
            assert key.exchange in line, (key.dotted, line)
    assert table_line(res.stdout, "delivery.transient_failure_retry_interval", "5m",
                      "TransientFailureRetryInterval") is not None
    assert table_line(res.stdout, "frontend.max_message_size", "36MB", "MaxMessageSize") is not None
    assert table_line(res.stdout, "routing.smart_host", "127.0.0.1:2500", "SmartHosts") is not None

    rows = [json.loads(ln) for ln in run_cli("config", "show", "--config", str(SHIPPED_CONFIG),
                                             "--json").stdout.splitlines()]
    assert [r["key"] for r in rows] == [k.dotted for k in config_mod.KEYS]
    by_key = {r["key"]: r for r in rows}
    for key in config_mod.KEYS:
        assert by_key[key.dotted]["exchange_name"] == key.exchange
        assert by_key[key.dotted]["meaning"]
    assert by_key["delivery.message_expiration_timeout"]["value"] == "2d"
    assert by_key["shadow_redundancy.shadow_redundancy_enabled"]["value"] == "false"
    assert by_key["node.name"]["value"] == "node1.transportd.test"
    # --data-dir alone naming no folder: the defaults, and a note saying so (not silently)
    nowhere = run_cli("config", "show", "--data-dir", "/nonexistent/transportd")
    assert nowhere.returncode == 0 and "no folder /nonexistent/transportd: the defaults" in nowhere.stderr
    assert data_dir.exists() == existed, "config show created the data directory"


def test_config_show_prints_peers_mailbox_databases_and_send_connectors(tmp_path):
    """README: ``config show`` prints every key's effective value, the tables too: each peer, each
    mailbox database's node, each send connector with its address spaces as the node uses them
    (a U-label as its A-label); text and --json. The cluster secret stays masked."""
    path = tmp_path / "node1.toml"
    write_toml(path, {
        "node": {"name": "node1.transportd.test", "site": "site-a", "data_dir": str(tmp_path / "data")},
        "cluster": {"secret": "very-secret-value"},
        "transport": {"listen": "127.0.0.210:2901"},
        "peers": [{"name": "Node2.Transportd.Test", "site": "site-b", "transport": "127.0.0.211:2903"}],
        "mailbox_databases": {"MDB01": "node1.transportd.test", "MDB02": "node2.transportd.test"},
        "routing": {"mailbox_database": "MDB01"},
        "send_connectors": [{"name": "books", "address_spaces": ["bücher.test", "partner.example"],
                             "smart_hosts": "127.0.0.212:2904"}],
    })
    res = run_cli("config", "show", "--config", str(path))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert table_line(out, "peers.node2.transportd.test.site", "site-b") is not None, out
    assert table_line(out, "peers.node2.transportd.test.transport", "127.0.0.211:2903") is not None, out
    assert table_line(out, "mailbox_databases.MDB01", "node1.transportd.test") is not None, out
    assert table_line(out, "mailbox_databases.MDB02", "node2.transportd.test") is not None, out
    assert table_line(out, "send_connectors.books.address_spaces", "[xn--bcher-kva.test, partner.example]",
                      "AddressSpaces") is not None, out
    assert table_line(out, "send_connectors.books.smart_hosts", "127.0.0.212:2904", "SmartHosts") is not None, out
    assert table_line(out, "send_connectors.books.require_tls", "false") is not None, out
    assert "very-secret-value" not in out and table_line(out, "cluster.secret", "*** (set)") is not None

    shown = run_cli("config", "show", "--config", str(path), "--json")
    rows = {r["key"]: r for r in map(json.loads, shown.stdout.splitlines())}
    assert set(rows) >= {k.dotted for k in config_mod.KEYS}
    assert rows["peers.node2.transportd.test.transport"]["value"] == "127.0.0.211:2903"
    assert rows["mailbox_databases.MDB02"]["value"] == "node2.transportd.test"
    assert rows["send_connectors.books.address_spaces"]["value"] == "[xn--bcher-kva.test, partner.example]"
    assert rows["send_connectors.books.address_spaces"]["exchange_name"] == "AddressSpaces"
    assert rows["send_connectors.books.tls_auth_level"]["value"] == "EncryptionOnly"
    assert all(r["meaning"] for r in rows.values())
    assert "very-secret-value" not in shown.stdout


BAD_CONFIGS = {
    "bad-duration": ('[delivery]\nmessage_expiration_timeout = "soon"\n',
                     ("delivery.message_expiration_timeout", "soon")),
    "unknown-key": ("[delivery]\nretry_sometimes = 3\n", ("delivery.retry_sometimes", "unknown key")),
    "unknown-section": ("[deliveries]\nx = 1\n", ("[deliveries]", "unknown section")),
    "bad-size": ('[frontend]\nmax_message_size = "huge"\n', ("frontend.max_message_size", "huge")),
    "toml-syntax": ("[delivery\nmessage_expiration_timeout = 1\n", ("TOML",)),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_is_one_line_and_exit_2(tmp_path, case):
    text, needles = BAD_CONFIGS[case]
    path = tmp_path / "bad.toml"
    path.write_text(f'[node]\ndata_dir = "{tmp_path / "data"}"\n' + text)
    for cmd in (["config", "show"], ["queue", "list"], ["message", "list", "--json"],
                ["tracking", "search"], ["queue", "suspend", "x"], ["message", "remove", "1", "--ndr"]):
        res = invoke(*cmd, "--config", str(path))
        line = assert_one_error_line(res, 2, *needles)
        assert str(path) in line, line
    res = run_cli("serve", "--config", str(path))  # a real process, and the daemon's own start-up
    line = assert_one_error_line(res, 2, *needles)
    assert str(path) in line, line
    assert not (tmp_path / "data").exists(), "a bad config created the data directory"


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.toml"
    for cmd in (["config", "show"], ["queue", "list"], ["tracking", "search"]):
        res = invoke(*cmd, "--config", str(missing))
        assert_one_error_line(res, 2, str(missing), "no such config file")
    assert_one_error_line(run_cli("serve", "--config", str(missing)), 2, str(missing), "no such config file")
    assert not missing.exists()


def test_no_config_or_data_dir(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRANSPORTD_CONFIG"}
    res = subprocess.run([sys.executable, "-m", "transportd", "queue", "list"], capture_output=True,
                         text=True, timeout=30, env=env, cwd=tmp_path)
    assert_one_error_line(res, 2, "--config", "--data-dir")


# ------------------------------------------------------------------------------ 8. missing database

def test_missing_database(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    absent = tmp_path / "absent"
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[node]\ndata_dir = "{absent}"\n')
    commands = (["queue", "list"], ["queue", "list", "--json"], ["message", "list"], ["message", "show", "1"],
                ["queue", "retry", "smarthost:x"], ["queue", "suspend", "1"], ["message", "suspend", "1"],
                ["message", "remove", "1", "--ndr"])
    for where in (["--data-dir", str(empty)], ["--data-dir", str(absent)], ["--config", str(cfg)]):
        for cmd in commands:
            res = invoke(*cmd, *where)
            assert res.returncode != 0 and res.returncode != 2, (cmd, where, res.returncode, res.stderr)
            assert "no queue database" in res.stderr, (cmd, res.stderr)
            assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr
    res = run_cli("queue", "list", "--data-dir", str(empty))
    assert res.returncode == 1 and "no queue database" in res.stderr and str(empty) in res.stderr, res.stderr
    assert list(empty.iterdir()) == [], "the CLI created files in an empty data dir"
    assert not absent.exists(), "the CLI created a missing data dir"


# ------------------------------------------------------------------------------ 9. unknown names

def test_empty_idle_queues_are_removed_a_suspended_one_stays_and_mail_makes_them_again(make_node, sink):
    """Exchange's QueueMaxIdleTime: a delivery queue empty (its last message left the Safety Net)
    and idle for delivery.queue_max_idle_time leaves ``queue list``; one an operator suspended
    stays until resumed; new mail for the next hop makes the queue again and goes. ``queue
    suspend`` of a queue that is gone says so, and why."""
    sink.start()
    node = make_node(smart_host=sink.address, overrides={
        "delivery": {"queue_max_idle_time": 1}, "safety_net": {"safety_net_hold_time": 15}}).start()
    ident, local = smarthost(sink), "mailbox:local"
    send(node, "carol@foreign.test")
    send(node, "alice@example.test")
    wait_for(lambda: len(sink.messages()) == 1 and node.maildir_files("alice@example.test"), what="both delivered")
    assert {q["identity"] for q in cli_json(node, "queue", "list")} == {ident, local}
    cli(node, "queue", "suspend", local)

    # Their messages leave the Safety Net after 15 s; the queues' last attempts are older than 1 s.
    wait_for(lambda: queue_by_identity(node, ident) is None, timeout=60, interval=0.5,
             what=f"{ident} removed once empty and idle")
    wait_for(lambda: cli_json(node, "message", "list", "--all") == [], timeout=10, what="Safety Net purged")
    node.wait_passes(15)  # housekeeping (every 2 s here: 10 passes) has run again: the held queue stays
    assert [(q["identity"], q["state"], q["message_count"]) for q in cli_json(node, "queue", "list")] == \
        [(local, "Suspended", 0)]
    assert "empty delivery queue(s) idle for 1s removed" in node.log() and ident in node.log()

    # An operator acting on the queue that is gone is told, in one line, why it is not there.
    res = run_cli("queue", "suspend", ident, "--config", str(node.config_path))
    assert_one_error_line(res, 1, f"no queue {ident!r}", "delivery.queue_max_idle_time (1s)")

    # New mail for the same next hop makes its queue again (Ready, no back-off) and goes.
    send(node, "dave@foreign.test")
    wait_for(lambda: len(sink.messages()) == 2, what="mail to the removed queue's next hop delivered")
    # Active until the delivery's outcome is committed, a moment after the sink's 250.
    q = wait_for(lambda: (q := queue_by_identity(node, ident)) and q["state"] != "Active" and q, timeout=10,
                 what=f"{ident} past its delivery")
    assert q["state"] == "Ready" and q["retry_count"] == 0, q
    # The held queue, resumed, is empty and idle: it goes too.
    cli(node, "queue", "resume", local)
    wait_for(lambda: queue_by_identity(node, local) is None, timeout=20, interval=0.5,
             what=f"{local} removed once resumed")
    assert node.alive


def test_unknown_queue_and_message(make_node, sink):
    node = make_node(smart_host=sink.address, overrides=LONG_RETRY).start()
    ident = smarthost(sink)
    mid = send(node, "carol@foreign.test")
    wait_for(in_retry(node, ident, 1), timeout=10, what="queue in Retry")
    for phase in ("running", "stopped"):
        if phase == "stopped":
            assert node.stop() == 0
        for use_data_dir in BOTH:
            for cmd in (["queue", "suspend", "smarthost:nowhere:25"], ["queue", "resume", "nosuch"],
                        ["queue", "retry", "9999"], ["message", "list", "--queue", "nosuch"]):
                res = cli(node, *cmd, check=False, use_data_dir=use_data_dir)
                assert res.returncode == 1, (cmd, res.returncode, res.stderr)
                assert "no queue" in res.stderr and cmd[-1] in res.stderr, res.stderr
                assert "Traceback" not in res.stderr
            for cmd in (["message", "show", "9999"], ["message", "list", "9999"], ["message", "suspend", "9999"],
                        ["message", "resume", "9999"], ["message", "remove", "9999"],
                        ["message", "remove", "9999", "--ndr"]):
                res = cli(node, *cmd, check=False, use_data_dir=use_data_dir)
                assert res.returncode == 1, (cmd, res.returncode, res.stderr)
                assert "no " in res.stderr and "message 9999" in res.stderr, res.stderr
                assert "Traceback" not in res.stderr
            res = cli(node, "message", "show", "abc", check=False, use_data_dir=use_data_dir)
            assert res.returncode == 2 and "abc" in res.stderr
            for verb in ("retry", "suspend", "resume"):  # the Poison queue: its messages, one by one
                res = cli(node, "queue", verb, "poison", check=False, use_data_dir=use_data_dir)
                assert res.returncode == 1 and "the Poison queue is not retried" in res.stderr, res.stderr
        # The real ones are untouched by all that.
        assert message_ids(node) == [mid]
        assert queue_by_identity(node, ident)["state"] == "Retry"
    # The same from real processes.
    res = node.cli("queue", "retry", "nosuch", check=False)
    assert res.returncode == 1 and "no queue 'nosuch'" in res.stderr, res.stderr
    res = node.cli("message", "show", "9999", check=False, use_data_dir=True)
    assert res.returncode == 1 and "no message 9999" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------ 10. --watch

def test_queue_list_watch(make_node, sink):
    """--watch redraws in place (clear screen) on a terminal; piped, it prints plain refreshes."""
    import pty
    import threading

    node = make_node(smart_host=sink.address, overrides=LONG_RETRY).start()
    ident = smarthost(sink)
    send(node, "carol@foreign.test")
    wait_for(in_retry(node, ident, 1), timeout=10, what="queue in Retry")
    cmd = [sys.executable, "-m", "transportd", "queue", "list", "--watch", "--interval", "0.2",
           "--data-dir", str(node.data_dir)]

    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def reader() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    piped = node.registry.add(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    piped_chunks: list[bytes] = []  # each refresh is flushed: read as it comes

    def piped_reader() -> None:
        assert piped.stdout is not None
        while data := piped.stdout.read1(65536):
            piped_chunks.append(data)
    proc = node.registry.add(subprocess.Popen(cmd, stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL))
    os.close(slave)
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    tp = threading.Thread(target=piped_reader, daemon=True)
    tp.start()
    # Wait for output, not time: a loaded machine can take seconds to start a Python process, and
    # the one started first is not always the first to print.
    wait_for(lambda: b"".join(chunks).count(b"\x1b[H\x1b[2J") >= 3
             and b"".join(piped_chunks).count(b"transportd queue list") >= 2, timeout=30,
             what="three redraws on the terminal and two refreshes piped")
    assert proc.poll() is None and piped.poll() is None, "--watch exited by itself"
    os.kill(proc.pid, signal.SIGINT)   # Ctrl-C
    os.kill(piped.pid, signal.SIGTERM)
    err = proc.communicate(timeout=10)[1]
    piped.wait(timeout=10)
    tp.join(timeout=5)
    piped_out = b"".join(piped_chunks).decode()
    t.join(timeout=5)
    os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    assert text.count("\x1b[H\x1b[2J") >= 2, text
    assert ident in text and "Retry" in text
    assert proc.returncode == 0, (proc.returncode, err)
    assert b"Traceback" not in err, err
    assert piped_out.count("transportd queue list") >= 2 and ident in piped_out, piped_out
    # With --json, a stream of JSON lines and nothing else (no header, no clear screen), even on a terminal.
    master, slave = pty.openpty()
    streamed = node.registry.add(subprocess.Popen([*cmd, "--json"], stdout=slave, stderr=subprocess.PIPE,
                                                  stdin=subprocess.DEVNULL))
    os.close(slave)
    chunks.clear()
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    wait_for(lambda: b"".join(chunks).count(b"\n") >= 3, timeout=30, what="three JSON lines")
    os.kill(streamed.pid, signal.SIGINT)
    assert streamed.wait(timeout=10) == 0
    t.join(timeout=5)
    os.close(master)
    lines = [ln for ln in b"".join(chunks).decode().split("\n")[:-1] if ln.strip()]  # whole lines
    rows = [json.loads(ln) for ln in lines]
    assert all(r["identity"] == ident and r["time"] for r in rows), lines


# ------------------------------------------------------------------------------ 11. where the node options go

def test_node_options_before_or_after_the_command_and_the_environment(make_node, sink, tmp_path):
    """``transportd -c FILE queue list``, ``transportd queue list -c FILE`` and
    ``TRANSPORTD_CONFIG=FILE transportd queue list`` print the same; so do --data-dir and --json
    before the command. An option after the command wins over one before it."""
    node = make_node(smart_host=sink.address, overrides=LONG_RETRY).start()
    ident = smarthost(sink)
    send(node, "carol@foreign.test")
    wait_for(in_retry(node, ident, 1), timeout=10, what="queue in Retry")
    assert node.stop() == 0  # the output must not change between the calls
    env = {k: v for k, v in os.environ.items() if k != "TRANSPORTD_CONFIG"}

    def real(*args: str, **extra_env: str) -> str:
        res = subprocess.run([sys.executable, "-m", "transportd", *args], capture_output=True, text=True,
                             timeout=60, env={**env, **extra_env}, cwd=tmp_path, check=False)
        assert res.returncode == 0 and res.stderr == "", (args, res.returncode, res.stderr)
        return res.stdout

    cfg, data = str(node.config_path), str(node.data_dir)
    after = real("queue", "list", "-c", cfg)
    assert table_line(after, ident, "Retry") is not None, after
    assert real("-c", cfg, "queue", "list") == after
    assert real("--config", cfg, "queue", "list") == after
    assert real("queue", "list", TRANSPORTD_CONFIG=cfg) == after
    assert real("-d", data, "queue", "list") == after
    as_json = real("queue", "list", "--json", "-c", cfg)
    assert json.loads(as_json.splitlines()[0])["identity"] == ident
    assert real("--json", "-c", cfg, "queue", "list") == as_json
    assert real("--json", "queue", "list", TRANSPORTD_CONFIG=cfg) == as_json
    assert real("--json", "message", "list", "-d", data) == real("message", "list", "--json", "-c", cfg)

    # After the command wins: a config before it naming a missing file is not read.
    assert real("-c", str(tmp_path / "missing.toml"), "queue", "list", "-c", cfg) == after
    # --data-dir given: TRANSPORTD_CONFIG (another node's) is not used, the data dir's own config is.
    other = tmp_path / "other.toml"
    other.write_text(f'[node]\ndata_dir = "{tmp_path / "elsewhere"}"\n')
    assert real("queue", "list", "-d", data, TRANSPORTD_CONFIG=str(other)) == after
    res = subprocess.run([sys.executable, "-m", "transportd", "queue", "list"], capture_output=True, text=True,
                         timeout=60, env={**env, "TRANSPORTD_CONFIG": str(other)}, cwd=tmp_path, check=False)
    assert_one_error_line(res, 1, "no queue database", str(tmp_path / "elsewhere"))
    res = subprocess.run([sys.executable, "-m", "transportd", "-c", str(tmp_path / "nope.toml"), "queue", "list"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path, check=False)
    assert_one_error_line(res, 2, "nope.toml", "no such config file")


def test_shell_completion_is_clicks():
    """docs/operations.md: eval "$(_TRANSPORTD_COMPLETE=bash_source transportd)"."""
    env = {**os.environ, "_TRANSPORTD_COMPLETE": "bash_source"}
    script = subprocess.run([sys.executable, "-m", "transportd"], capture_output=True, text=True, timeout=30,
                            env=env, check=False).stdout
    assert "_transportd_completion" in script and "complete " in script, script[:300]
    env = {**os.environ, "_TRANSPORTD_COMPLETE": "bash_complete", "COMP_WORDS": "transportd message re",
           "COMP_CWORD": "2"}
    out = subprocess.run([sys.executable, "-m", "transportd"], capture_output=True, text=True, timeout=30,
                         env=env, check=False).stdout
    assert out.split() == ["plain,remove", "plain,resume"], out


@pytest.mark.parametrize("cmd", [["message", "show"], ["message", "export"], ["message", "remove"],
                                 ["message", "suspend"], ["message", "resume"], ["message", "list"]])
def test_a_message_id_past_sqlites_integers_is_one_line_and_exit_2(tmp_path, cmd):
    """An id no SQLite integer can hold was an OverflowError traceback out of the query."""
    path = tmp_path / "node.toml"
    path.write_text(f'[node]\ndata_dir = "{tmp_path / "data"}"\n')
    res = invoke(*cmd, "99999999999999999999999999", "--config", str(path))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res
    assert "99999999999999999999999999" in res.stderr, res.stderr  # (the real CLI: one line, as above)


def test_cluster_config_into_a_folder_that_cannot_be_made_is_one_line_and_exit_2(tmp_path):
    """A FileNotFoundError traceback before."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    res = invoke("cluster", "config", "--out", str(blocker / "cluster"))
    assert res.returncode == 2, res
    assert "cannot write the node configs" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_cluster_config_with_a_bad_set_writes_nothing(tmp_path):
    """A bad --set is refused before any file is written: no folder made, and a cluster's configs
    already there are left as they were (cluster up regenerates them in place)."""
    fresh = tmp_path / "fresh"
    res = invoke("cluster", "config", "--out", str(fresh), "--set", "frontend.bogus=1")
    assert res.returncode == 2 and "frontend.bogus: unknown key" in res.stderr, res.stderr
    assert not fresh.exists()
    existing = tmp_path / "existing"
    assert invoke("cluster", "config", "--out", str(existing)).returncode == 0
    before = {p.name: p.read_text() for p in existing.iterdir()}
    res = invoke("cluster", "config", "--out", str(existing), "--set", "frontend.listen=nope")
    assert res.returncode == 2 and "frontend.listen" in res.stderr and "nope" in res.stderr, res.stderr
    assert {p.name: p.read_text() for p in existing.iterdir()} == before


def test_cluster_config_with_a_toml_date_in_a_set_names_the_key(tmp_path):
    """A --set value TOML reads as a date (no config key takes one) was a TypeError traceback
    ("cannot write datetime.date(...) as TOML"); it is a string now, which the key's check judges."""
    res = invoke("cluster", "config", "--out", str(tmp_path / "c"), "--set", "frontend.max_message_size=1979-05-27")
    assert res.returncode == 2 and "frontend.max_message_size" in res.stderr and "1979-05-27" in res.stderr, res


def test_one_node_per_data_dir_and_the_cli_says_when_none_runs(make_node, sink, tmp_path):
    """A second ``serve`` on a data dir a node runs on stops at once naming the first one's pid
    (two daemons would deliver every message twice); after a kill -9 the next start takes it.
    With the node stopped, a removal says that its peers have not heard of it."""
    peer = {"name": "ghost.transportd.test", "site": "site-b", "transport": f"127.0.0.1:{free_port()}"}
    overrides = {**LONG_RETRY, "shadow_redundancy": {"shadow_redundancy_enabled": True},
                 "cluster": {"secret": "s3cret-for-the-test"}, "transport": {"listen": f"127.0.0.1:{free_port()}"}}
    node = make_node(smart_host=sink.address, overrides=overrides)
    write_toml(node.config_path, {**node.sections, "peers": [peer]})
    node.start()
    m1, m2 = send(node, "carol@foreign.test"), send(node, "dave@foreign.test")  # accepted unprotected
    second = make_node("second", overrides={"node": {"data_dir": str(node.data_dir), "name": node.name,
                                                      "site": "site-a", "log_level": "debug"}})
    second.start(wait=False)
    assert second.proc.wait(timeout=30) == 1
    assert (f"cannot start: node.data_dir {node.data_dir}: another transportd node runs on it "
            f"(pid {node.proc.pid})") in second.log(), second.log()
    assert node.alive

    running = cli(node, "message", "remove", str(m1))
    assert "not running" not in running.stderr, running.stderr
    node.proc.kill()
    node.proc.wait(timeout=10)
    stopped = cli(node, "message", "remove", str(m2))
    assert f"message {m2} removed" in stopped.stdout
    assert "the node is not running: its peers learn" in stopped.stderr, stopped.stderr
    node.start()  # the lock died with the killed process
    assert node.alive


def test_serve_takes_a_data_dir_as_the_other_commands_do(make_node, tmp_path):
    """``serve -d DIR`` alone starts again the node that ran there, with the config file it ran
    with; with a config, ``-d`` before or after the command replaces its node.data_dir (it was
    ignored: the node ran on the config's folder); a folder where no node ran is refused."""
    node = make_node(smart_host=f"127.0.0.1:{free_port()}", overrides=LONG_RETRY).start()  # mail stays queued
    mid = send(node, "carol@foreign.test")
    assert node.stop() == 0

    def serve(*args: str) -> subprocess.Popen:
        proc = node.registry.add(subprocess.Popen([sys.executable, "-m", "transportd", *args],
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_port("127.0.0.1", node.port, proc=proc)
        return proc

    def stop(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0

    proc = serve("serve", "-d", str(node.data_dir))
    assert [m["id"] for m in cli_json(node, "message", "list")] == [mid]  # the same queue, its config's port
    stop(proc)
    other = tmp_path / "other"
    for args in (("-d", str(other), "serve", "-c", str(node.config_path)),
                 ("serve", "-c", str(node.config_path), "--data-dir", str(other))):
        proc = serve(*args)
        assert (other / "queue.db").is_file()
        assert cli_json(node, "message", "list", "--data-dir", str(other)) == []
        stop(proc)
    nowhere = run_cli("serve", "-d", str(tmp_path / "nowhere"))
    assert_one_error_line(nowhere, 2, f"--data-dir {tmp_path / 'nowhere'}: no node has run there")
