"""The database unreachable for longer than a lease, for real: a node reaches PostgreSQL
through a TCP proxy on 127.0.0.1 that the test cuts (every connection closed, new ones
refused) and restores, while the node's turns wait on a slow non-idempotent tool call,
and a real tool server counts each effect by its Idempotency-Key.

What must hold: the node's lease lapses but its claims are not given up; the call on
the wire keeps its outcome (never `outcome unknown`), no call is sent while the lease
is lapsed, the first renewal after the outage takes the claims again under the same
epoch, and every turn completes with each effect made exactly once. When another node
took the turns meanwhile, the node that was cut off gives them up and sends nothing
for them."""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.fleet_helpers import (  # noqa: F401 - fixtures `db`, `server`
    fleet_db,
    fleet_server,
    query,
    wait_finished,
)
from tests.integration.harness import Daemon, wait_until
from tests.integration.test_fleet import STEPS, effect_keys, fleet_config
from tests.integration.tool_server import ToolServer
from tests.pg import CuttableProxy

LEASE = 3.0
OUTAGE = 3 * LEASE  # the database unreachable for three leases


@pytest.fixture
def proxy(db: str) -> Iterator[CuttableProxy]:
    p = CuttableProxy(db).start()
    try:
        yield p
    finally:
        p.cut()


def open_issues(db: str) -> list[str]:
    return [issue for r in query(db, "SELECT record FROM turns")
            for issue in json.loads(r["record"])["result"]["open_issues"]]


@pytest.mark.slow
def test_an_outage_longer_than_the_lease_keeps_the_turns_and_their_calls_outcomes(
        tmp_path: Path, server: ToolServer, db: str, proxy: CuttableProxy) -> None:
    n = 4
    node = Daemon(tmp_path, fleet_config(tmp_path, server, proxy.url(), "n0",
                                         lease=LEASE), name="n0")
    server.hold("/effect")  # every turn's first call stays on the wire
    node.start()
    try:
        for i in range(n):
            node.submit(f"work {i}")
        server.wait_for_calls("/effect", n, timeout=30)
        epochs = dict(query(db, "SELECT id, epoch FROM turns"))
        proxy.cut()
        time.sleep(OUTAGE / 2)
        server.release("/effect")  # the calls answer while the database is away
        time.sleep(OUTAGE / 2)
        assert len(server.calls("/effect")) == n  # no call left while the lease lapsed
        status_during = node.get("/v1/status")[1]
        proxy.restore()
        wait_finished(db, n, timeout=60)
        after = dict(query(db, "SELECT id, epoch FROM turns"))
    finally:
        server.release("/effect")
        node.kill()
    rows = query(db, "SELECT state, owner FROM turns")
    assert collections.Counter(r["state"] for r in rows) == {"completed": n}
    keys = effect_keys(server)
    assert len(keys) == n * (STEPS - 1)
    assert set(keys.values()) == {1}, [k for k, c in keys.items() if c > 1]
    # The calls on the wire during the outage kept their outcome, and the claims were
    # renewed under their epochs, never claimed anew (by this node or any other).
    assert open_issues(db) == []
    assert after == epochs
    assert status_during["fleet"]["lease_lapsed"] is True
    log = node.log_text()
    assert "fleet.lease_lapsed" in log
    assert "fleet.lease_lost" not in log


@pytest.mark.slow
def test_turns_another_node_took_during_the_outage_are_given_up_without_a_call(
        tmp_path: Path, server: ToolServer, db: str, proxy: CuttableProxy) -> None:
    n = 4
    cut_off = Daemon(tmp_path, fleet_config(tmp_path, server, proxy.url(), "n0",
                                            lease=LEASE), name="n0")
    server.hold("/effect")
    cut_off.start()
    other: Daemon | None = None
    try:
        for i in range(n):
            cut_off.submit(f"work {i}")
        server.wait_for_calls("/effect", n, timeout=30)
        proxy.cut()
        # A node that reaches the database claims the turns once their leases expire.
        other = Daemon(tmp_path, fleet_config(tmp_path, server, db, "n1", lease=LEASE),
                       name="n1").start()
        deadline = time.monotonic() + 30
        while query(db, "SELECT 1 FROM turns WHERE owner = 'n0'"):
            assert time.monotonic() < deadline, "n1 never took n0's turns"
            time.sleep(0.2)
        sent_before = len(server.calls("/effect"))
        server.release("/effect")
        proxy.restore()
        wait_finished(db, n, timeout=60)

        def given_up() -> dict[str, Any] | None:  # n0 renews, finds the turns taken
            st: dict[str, Any] = cut_off.get("/v1/status")[1]
            return st if st["fleet"]["held"] == 0 and st["fleet"]["lost"] == n else None

        status = wait_until(given_up, timeout=10 * LEASE, what="n0 to give its turns up")
    finally:
        server.release("/effect")
        cut_off.kill()
        if other is not None:
            other.kill()
    rows = query(db, "SELECT state, owner FROM turns")
    assert collections.Counter(r["state"] for r in rows) == {"completed": n}
    assert {r["owner"] for r in rows} == {"n1"}
    keys = effect_keys(server)
    assert set(keys.values()) == {1}, [k for k, c in keys.items() if c > 1]
    # n0 sent no call after the outage: every later one came from n1.
    late = [c for c in server.calls("/effect")[sent_before:]]
    assert all(str(c.idempotency_key) not in {str(x.idempotency_key) for x in
                                              server.calls("/effect")[:sent_before]}
               for c in late)
    assert status["fleet"]["held"] == 0 and status["fleet"]["lost"] == n
    assert "fleet.lease_lost" in cut_off.log_text()
