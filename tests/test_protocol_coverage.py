"""The sans-I/O protocol state machines are covered by their own tests: at least 95 % of the lines.

Runs the protocol tests (tests/test_redundancy_connection.py, tests/test_protocol.py: no sockets)
in a child pytest with pytest-cov over redundancy/connection.py and redundancy/protocol.py, and
fails under 95 %.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_protocol_state_machines_have_95_percent_line_coverage(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/test_redundancy_connection.py",
         "tests/test_protocol.py", "tests/test_nway.py", "--cov=transportd.redundancy.connection", "--cov=transportd.redundancy.protocol",
         "--cov-report=term-missing", "--cov-fail-under=95"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "COVERAGE_FILE": str(tmp_path / ".coverage")})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "transportd/redundancy/connection.py" in res.stdout and "Required test coverage of 95% reached" in res.stdout
