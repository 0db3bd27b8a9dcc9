"""Bad CLI arguments: one clear line on stderr and exit code 2, never a traceback.

Usage errors (unknown command or option, a missing or out-of-range value) from the real
``python -m transportd``, for the daemon, the operator commands, the cluster runner, the
sink and the chaos harness. Bad config files are in test_cli.py and test_config.py.
"""

from __future__ import annotations

import pytest
from helpers import assert_one_error_line, run_cli

CASES = {
    "unknown-command": (["frobnicate"], "No such command 'frobnicate'"),
    "serve-no-config": (["serve"], "Missing option '--config'"),
    "unknown-option": (["queue", "list", "--bogus"], "No such option '--bogus'"),
    "not-an-integer": (["message", "show", "notanumber", "--data-dir", "/nonexistent"], "not a valid integer"),
    "bad-log-format": (["serve", "--config", "x.toml", "--log-format", "xml"], "'xml' is not one of"),
    "cluster-nodes-range": (["cluster", "config", "--out", "/nonexistent/x", "--nodes", "0"], "--nodes"),
    "cluster-bad-set": (["cluster", "config", "--out", "/nonexistent/x", "--set", "novalue"], "--set"),
    # a --set that made the generated TOML invalid: "Cannot overwrite a value (at line 36, column 8)"
    "cluster-set-peers": (["cluster", "up", "--data-dir", "/nonexistent/x", "--set", "peers.name=x"],
                          "--set 'peers.name=x': the [[peers]] are generated"),
    "cluster-set-dotted-key": (["cluster", "up", "--data-dir", "/nonexistent/x", "--set", "node.name.x=1"],
                               "--set 'node.name.x=1'"),
    "sink-bad-listen": (["sink", "--listen", "nonsense"], "--listen"),
    # it said "sink cannot listen on ...: No such file or directory", exit 1: not the address's fault
    "sink-dir-cannot-be-made": (["sink", "--listen", "127.0.0.1:2790", "--dir", "/proc/nope"],
                                "--dir /proc/nope: cannot make the Maildir: No such file or directory"),
    "chaos-negative": (["chaos", "--messages", "-5"], "--messages"),
    "chaos-bad-seed": (["chaos", "--seed", "abc"], "--seed"),
    "chaos-ip-base": (["chaos", "--ip-base", "255"], "--ip-base"),
    "chaos-2010-shadow-copies": (["chaos", "--versions", "2010,2013,2013", "--shadow-copies", "2"],
                                 "Exchange 2010 nodes keep one shadow"),
    "filter-empty-subject": (["message", "list", "--data-dir", "/nonexistent", "--filter", "subject="],
                             "--filter 'subject=': empty subject pattern"),
    "tracking-bad-date": (["tracking", "search", "--data-dir", "/nonexistent", "--start", "yesterday-ish"],
                          "--start"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_cli_arguments_are_one_line_and_exit_2(case):
    args, needle = CASES[case]
    line = assert_one_error_line(run_cli(*args), 2, needle)
    assert line.startswith("transportd: error: "), line
