"""Admission in a fleet: `daemon.max_queued_turns` bounds the turns the fleet holds
unclaimed, whichever node took them, not each node's own queue (which a node with free
slots empties by claiming)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.fleet_helpers import (  # noqa: F401 - fixtures `db`, `server`
    fleet_db,
    fleet_server,
    query,
    wait_finished,
)
from tests.integration.harness import Daemon
from tests.integration.test_fleet import fleet_config
from tests.integration.tool_server import ToolServer

MAX_QUEUED = 4
UNCLAIMED = ("SELECT count(*) FROM turns WHERE owner IS NULL AND state NOT IN"
             " ('completed', 'partial', 'failed', 'blocked', 'cancelled')")


def settle(db: str, daemons: list[Daemon], timeout: float = 10.0) -> None:
    """Until every node admits against the fleet's queue as it stands in the database
    (each has read it at a claim tick since the last submit)."""
    deadline = time.monotonic() + timeout
    while True:
        [(unclaimed,)] = query(db, UNCLAIMED)
        seen = [d.get("/v1/status")[1]["fleet"]["waiting"] for d in daemons]
        if seen == [unclaimed] * len(daemons):
            return
        assert time.monotonic() < deadline, (unclaimed, seen)
        time.sleep(0.1)


def burst(daemon: Daemon, n: int, tag: str) -> list[int]:
    return [daemon.post("/v1/turns", {"message": f"work {tag}{i}"})[0] for i in range(n)]


@pytest.mark.slow
def test_max_queued_turns_bounds_the_fleets_queue_not_each_nodes(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    server.hold("/effect")  # every claimed turn stays in its first tool call
    daemons = []
    for i in range(2):
        config = fleet_config(tmp_path, server, db, f"n{i}").replace(
            "max_concurrent_turns = 32", "max_concurrent_turns = 1").replace(
            "max_queued_turns = 1000", f"max_queued_turns = {MAX_QUEUED}")
        daemons.append(Daemon(tmp_path, config, name=f"n{i}"))
    for d in daemons:
        d.start()
    try:
        first = burst(daemons[0], 12, "a")
        server.wait_for_calls("/effect", 2)  # both nodes' one slot is taken
        settle(db, daemons)
        second = burst(daemons[1], 12, "b")
        settle(db, daemons)
        last = burst(daemons[0], 2, "c") + burst(daemons[1], 2, "d")
        [(unclaimed,)] = query(db, UNCLAIMED)
        status = subprocess.run([sys.executable, "-m", "turnkeeper", "--socket",
                                 str(daemons[1].socket), "status"], capture_output=True,
                                text=True, timeout=30, check=False)
    finally:
        server.release("/effect")
    try:
        accepted = sum(code == 202 for code in first + second)
        assert set(first + second) <= {202, 503}, (first, second)
        # Two turns run (one slot a node), the fleet's queue holds MAX_QUEUED: every
        # other submit was refused, on either node, and the last ones on both.
        assert accepted == MAX_QUEUED + 2, (first, second)
        assert unclaimed == MAX_QUEUED
        assert last == [503] * 4
        assert f"queue        {MAX_QUEUED} waiting in the fleet of {MAX_QUEUED} allowed" \
            in status.stdout, status.stdout
        wait_finished(db, accepted, timeout=120)
    finally:
        for d in daemons:
            d.kill()
