"""Operational logs from real node processes.

- With ``--log-format json`` every line of the daemon's output is one JSON object, ``ts`` in UTC
  (``Z``), the event, queue, peer and client address as fields, the "ready" line included.
- Every log line about a message carries its internal and network message ids: as JSON fields
  with ``--log-format json`` / ``node.log_format = "json"``, as a ``[internal_message_id=...
  network_message_id=...]`` suffix in the readable text format. The ids must be the ones the
  SMTP reply and the tracking log give for that message.

(``transportd queue list --watch`` redrawing in place is tested in test_cli.py.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from conftest import queued_id, swaks, wait_for, wait_port

MESSAGE_LINE = re.compile(r"\bmessage (\d+)\b|\bnetwork id\b")


def json_lines(node) -> list[dict]:
    """Every line of the node's log, each one JSON object (anything else fails the test)."""
    out = []
    for line in node.log().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
    return out


# A local time zone 14 hours from UTC (POSIX form, no tz database needed): a timestamp written in
# local time cannot pass for UTC.
FAR_FROM_UTC = {"TZ": "XXX-14"}


def start_json_node(node) -> None:
    """serve --log-format json over a config that says text: the flag wins."""
    with open(node.log_path, "ab") as log:
        node.proc = node.registry.add(subprocess.Popen(
            [sys.executable, "-m", "transportd", "serve", "--config", str(node.config_path),
             "--log-format", "json"], stdout=log, stderr=subprocess.STDOUT, cwd=str(node.dir),
            env={**os.environ, **FAR_FROM_UTC}))
    wait_port("127.0.0.1", node.port, proc=node.proc)


def test_json_log_lines_about_messages_carry_both_ids(make_node, sink):
    sink.start(("-f", "RCPT"))  # the smart host refuses every recipient with a 5xx: FAIL and a DSN
    node = make_node(smart_host=sink.address, overrides={"node": {"log_format": "text"}})
    start_json_node(node)
    local = queued_id(swaks(node.port, "--to", "alice@example.test", "--from", "zed@example.test"))
    failed = queued_id(swaks(node.port, "--to", "carol@elsewhere.test", "--from", "zed@example.test"))
    wait_for(lambda: node.tracking(event_id="DSN"), timeout=20, what="the DSN for the refused recipient")
    wait_for(lambda: node.tracking(event_id="DELIVER", internal_message_id=str(local)), timeout=20,
             what="the local delivery")

    lines = json_lines(node)
    assert lines and all({"ts", "level", "logger", "message"} <= set(r) for r in lines)
    about_messages = [r for r in lines if MESSAGE_LINE.search(r["message"])]
    assert about_messages
    for r in about_messages:
        assert r.get("network_message_id"), r
        assert "internal_message_id" in r, r
        m = re.search(r"\bmessage (\d+)\b", r["message"])
        if m:
            assert r["internal_message_id"] == int(m.group(1)), r
        assert r["network_message_id"] in r["message"], r

    def netid(internal_id: int) -> str:
        return node.tracking(event_id="RECEIVE", internal_message_id=str(internal_id))[0]["network-message-id"]

    def events_for(internal_id: int) -> set[str]:
        return {r["message"].split()[0] for r in about_messages
                if r["internal_message_id"] == internal_id and r["network_message_id"] == netid(internal_id)}
    assert {"queued", "DELIVER"} <= events_for(local)
    assert {"queued", "FAIL"} <= events_for(failed)
    # The DSN is a message of its own: its line carries its ids and names the original.
    dsn = [r for r in about_messages if r["message"].startswith("DSN ")]
    assert len(dsn) == 1 and f"original internal id {failed}; network id {netid(failed)}" in dsn[0]["message"]
    assert dsn[0]["internal_message_id"] not in (local, failed)


def test_text_log_lines_end_with_both_ids(make_node, sink):
    sink.start()
    node = make_node(smart_host=sink.address).start()  # node.log_format defaults to text
    mid = queued_id(swaks(node.port, "--to", "carol@elsewhere.test", "--from", "zed@example.test"))
    wait_for(lambda: node.tracking(event_id="SENDEXTERNAL"), timeout=20, what="the relay to the sink")
    netid = node.tracking(event_id="RECEIVE")[0]["network-message-id"]
    suffix = f"[internal_message_id={mid} network_message_id={netid}]"
    lines = [ln for ln in node.log().splitlines() if MESSAGE_LINE.search(ln)]
    assert any("queued message" in ln for ln in lines)
    assert any("SENDEXTERNAL message" in ln for ln in lines)
    for ln in lines:
        assert ln.endswith(suffix), ln
    assert not any(ln.lstrip().startswith("{") for ln in node.log().splitlines())


def test_every_line_of_a_json_log_is_json_in_utc_with_fields(make_node, sink):
    from datetime import UTC, datetime

    sink.start(("-f", "RCPT"))  # the smart host refuses every recipient: FAIL and a DSN
    node = make_node(smart_host=sink.address, overrides={"node": {"log_format": "text"}})
    start_json_node(node)
    failed = queued_id(swaks(node.port, "--to", "carol@elsewhere.test", "--from", "zed@example.test"))
    wait_for(lambda: node.tracking(event_id="DSN"), timeout=20, what="the DSN for the refused recipient")
    assert node.stop() == 0  # the shutdown lines too
    lines = json_lines(node)
    assert len(lines) >= 5
    now = datetime.now(UTC)
    for r in lines:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["ts"]), r
        assert abs((now - datetime.fromisoformat(r["ts"])).total_seconds()) < 600, (r["ts"], now)
    assert any(r["message"].endswith(f"ready on 127.0.0.1:{node.port}") for r in lines), "no JSON ready line"
    fail = [r for r in lines if r.get("event") == "FAIL"]
    assert len(fail) == 1, fail
    assert fail[0]["internal_message_id"] == failed and fail[0]["queue"] == f"smarthost:{sink.address}"
    assert fail[0]["client"] == "127.0.0.1" and fail[0]["network_message_id"]
    assert [r for r in lines if r.get("event") == "DSN"]
    queued = [r for r in lines if r["message"].startswith(f"queued message {failed} ")]
    assert len(queued) == 1 and queued[0]["client"] == "127.0.0.1", queued  # the accept path's context
    assert queued[0]["network_message_id"] == fail[0]["network_message_id"]


def test_text_log_timestamps_are_utc_with_z(make_node, sink):
    node = make_node(smart_host=sink.address)
    node.env.update(FAR_FROM_UTC)
    node.start()
    line = wait_for(lambda: next((ln for ln in node.log().splitlines() if "ready on" in ln), None), timeout=10,
                    what="the ready line")
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z INFO transportd: ", line)
    assert m, line
    from datetime import UTC, datetime
    ts = datetime.fromisoformat(m.group(1) + "Z")
    assert abs((datetime.now(UTC) - ts).total_seconds()) < 600, line


def test_a_node_name_that_is_not_fully_qualified_is_warned_about(make_node):
    node = make_node(overrides={"node": {"name": "shortname"}}).start()
    wait_for(lambda: "ready on" in node.log(), timeout=10, what="the ready line")
    assert re.search(r"WARNING transportd: node\.name 'shortname' is not fully qualified: next hops that check "
                     r"the EHLO name", node.log()), node.log()[-2000:]
    fqdn = make_node("node2").start()  # node2.transportd.test
    wait_for(lambda: "ready on" in fqdn.log(), timeout=10, what="node2's ready line")
    assert "not fully qualified" not in fqdn.log()


def test_a_node_that_cannot_start_says_why_in_json_when_asked(tmp_path):
    import json
    import subprocess
    import sys
    bad = tmp_path / "bad.toml"
    bad.write_text("[delivery]\nretry_intervall = 5\n")
    res = subprocess.run([sys.executable, "-m", "transportd", "serve", "--config", str(bad), "--log-format", "json"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and res.stdout == ""
    [line] = res.stderr.splitlines()
    record = json.loads(line)
    assert record["level"] == "error" and "delivery.retry_intervall: unknown key" in record["message"], record
    assert record["ts"].endswith("Z")
