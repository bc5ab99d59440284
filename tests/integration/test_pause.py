"""A daemon paused (SIGSTOP) while its tool calls are out, for real: when it runs again
(SIGCONT) every call's timeout has passed and they all fail at once. Those failures are
the pause's, not the tool's: they count in no breaker streak. On one daemon its breaker
stays closed; on a fleet node paused past its lease, neither its breaker nor the
fleet's shared one (nor the other node's) opens."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.integration.fleet_helpers import (  # noqa: F401 - fixtures `db`, `server`
    fleet_db,
    fleet_server,
    query,
    wait_finished,
)
from tests.integration.harness import Daemon, scripted_provider
from tests.integration.test_fleet import fleet_config
from tests.integration.tool_server import ToolServer

LEASE = 3.0
TOOL_TIMEOUT = 5.0
PAUSE = 12.0  # past the lease and past every call's timeout
TURNS = 4  # more than the breaker's threshold
SCRIPT = """
[[scenarios]]
match = "^work"
[[scenarios.steps]]
tool_calls = [{ name = "effect", arguments = { step = 1 } }]
[[scenarios.steps]]
reply = "done"
"""
BREAKER = "\n[circuit_breaker]\nfailure_threshold = 3\ncooldown = 120.0\n"


def node(tmp: Path, server: ToolServer, db: str, name: str) -> Daemon:
    config = fleet_config(tmp, server, db, name, lease=LEASE, script_text=SCRIPT)
    assert "timeout = 30.0" in config
    return Daemon(tmp, config.replace("timeout = 30.0", f"timeout = {TOOL_TIMEOUT}")
                  + BREAKER, name=name)


def test_a_node_paused_past_its_lease_opens_no_breaker_when_it_resumes(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    paused, other = node(tmp_path, server, db, "n0"), node(tmp_path, server, db, "n1")
    server.hold("/effect")  # every call stays on the wire until its timeout
    try:
        for d in (paused, other):
            d.start()
        # The other node claims nothing: every turn runs on the paused one.
        assert other.post("/v1/intake", {"open": False})[0] == 200
        for i in range(TURNS):
            paused.submit(f"work {i}")
        server.wait_for_calls("/effect", TURNS, timeout=30)
        paused.signal(signal.SIGSTOP)
        try:
            time.sleep(PAUSE)  # the fault itself: the process does not run for this long
        finally:
            paused.signal(signal.SIGCONT)
        wait_finished(db, TURNS, timeout=60)
        states = {name: d.get("/v1/status")[1]["breakers"]["tool:effect"]
                  for name, d in (("n0", paused), ("n1", other))}
        log = paused.log_text()
    finally:
        server.release("/effect")
        for d in (paused, other):
            d.kill()
    assert states == {"n0": "closed", "n1": "closed"}
    shared = query(db, "SELECT failures, open_until FROM breakers WHERE name = 'tool:effect'")
    assert all(r["failures"] == 0 and r["open_until"] is None for r in shared), shared
    assert "daemon.stalled" in log
    assert log.count("tool.failure_not_counted") == TURNS
    rows = query(db, "SELECT state FROM turns")
    assert [r["state"] for r in rows] == ["completed"] * TURNS


def test_a_daemon_paused_while_its_calls_are_out_opens_no_breaker_when_it_resumes(
        tmp_path: Path, server: ToolServer) -> None:
    script = tmp_path / "script.toml"
    script.write_text(SCRIPT)
    config = f"""
[[tools]]
name = "effect"
kind = "http"
url = "{server.url('/effect')}"
idempotent = false
timeout = {TOOL_TIMEOUT}
""" + BREAKER + scripted_provider(script)
    d = Daemon(tmp_path, config)
    server.hold("/effect")
    try:
        d.start()
        ids = [d.submit(f"work {i}")["id"] for i in range(TURNS)]
        server.wait_for_calls("/effect", TURNS, timeout=30)
        d.signal(signal.SIGSTOP)
        try:
            time.sleep(PAUSE)  # the fault itself: the process does not run for this long
        finally:
            d.signal(signal.SIGCONT)
        finished = [d.wait(tid, timeout=60) for tid in ids]
        state = d.get("/v1/status")[1]["breakers"]["tool:effect"]
        log = d.log_text()
    finally:
        server.release("/effect")
        d.kill()
    assert state == "closed"
    assert "daemon.stalled" in log
    assert log.count("tool.failure_not_counted") == TURNS
    assert [t["state"] for t in finished] == ["completed"] * TURNS
