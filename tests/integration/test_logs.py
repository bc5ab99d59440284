"""`GET /v1/logs` and `turnkeeper logs`: the daemon's recent log lines, one turn's."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.integration.harness import Daemon


def cli(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "turnkeeper", "--socket", str(d.socket),
                           *args], capture_output=True, text=True, timeout=30, check=False)


def test_a_turn_s_log_lines_come_from_the_daemon(start: Any) -> None:
    d = start()
    one = d.run("first")["id"]
    other = d.run("second")["id"]
    status, data = d.get(f"/v1/logs?turn={one}")
    assert status == 200
    events = [line["event"] for line in data["lines"]]
    assert "turn.queued" in events and "turn.finished" in events
    assert {line["turn"] for line in data["lines"]} == {one}
    out = cli(d, "logs", other)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]  # not a TTY: JSON lines
    assert lines and {x["turn"] for x in lines} == {other}
    assert lines[-1]["event"] == "turn.finished"
    assert len(cli(d, "logs", "-n", "1").stdout.splitlines()) == 1


def test_a_limit_out_of_range_is_refused(start: Any) -> None:
    d = start()
    status, data = d.get("/v1/logs?limit=0")
    assert (status, data["field"]) == (400, "limit")
    assert cli(d, "logs", "-n", "0").returncode == 2
