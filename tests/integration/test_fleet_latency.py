"""Two real nodes reach PostgreSQL through a proxy that delays every byte each way, with
leases renewed every 1.7 s and turns whose non-idempotent calls check their lease inside
the writer's transactions: renewals, claims and batched commits lock the same turn rows
all the time, and a transaction takes many round trips. (The race made certain, with
the rows taken in reverse orders, is in tests/unit/test_postgres_lock_order.py.)

What must hold: the server never has to break a deadlock (its own count for the
database, and no transaction the store had to send again), no node's lease lapses or is
lost, and every turn completes with each effect made once."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.fleet_helpers import (  # noqa: F401 - fixtures `db`, `server`
    fleet_db,
    fleet_server,
    query,
    wait_finished,
)
from tests.integration.harness import Daemon
from tests.integration.test_fleet import STEPS, effect_keys, fleet_config
from tests.integration.tool_server import ToolServer
from tests.pg import CuttableProxy, server_url
from tests.pg_wire import CountingProxy

DELAY = 0.01  # each way: a database 20 ms away, a round trip
LEASE = 5.0
TURNS = 120


@pytest.fixture
def proxy(db: str) -> Iterator[CuttableProxy]:
    p = CuttableProxy(db, delay=DELAY).start()
    try:
        yield p
    finally:
        p.cut()


def deadlocks(db: str) -> int:
    """The server's count of deadlocks it broke in the test's database, once every
    session of the nodes has ended (a backend reports its counts when it exits)."""
    name = db.rsplit("/", 1)[1]
    deadline = time.monotonic() + 30
    while query(server_url(), "SELECT 1 FROM pg_stat_activity WHERE datname = $1"
                " AND pid <> pg_backend_pid()", name):
        assert time.monotonic() < deadline, "the nodes' sessions never ended"
        time.sleep(0.1)
    [(n,)] = query(server_url(), "SELECT deadlocks FROM pg_stat_database WHERE datname = $1",
                   name)
    return int(n)


def test_renewals_and_batched_commits_over_a_slow_link_never_deadlock_or_lapse(
        tmp_path: Path, server: ToolServer, db: str, proxy: CuttableProxy) -> None:
    daemons = [Daemon(tmp_path, fleet_config(tmp_path, server, proxy.url(), f"n{i}",
                                             lease=LEASE), name=f"n{i}") for i in range(2)]
    try:
        for d in daemons:
            d.start()
        for i in range(0, TURNS, 10):
            status, _ = daemons[i // 10 % 2].post(
                "/v1/turns", [{"message": f"work {j}"} for j in range(i, i + 10)])
            assert status == 202
        wait_finished(db, TURNS, timeout=300)
        logs = [d.log_text() for d in daemons]
    finally:
        for d in daemons:
            d.kill()
    assert deadlocks(db) == 0
    for log in logs:
        assert "store.conflict_retried" not in log
        assert "fleet.lease_lapsed" not in log and "fleet.lease_lost" not in log
    rows = query(db, "SELECT state, owner FROM turns")
    assert collections.Counter(r["state"] for r in rows) == {"completed": TURNS}
    assert {r["owner"] for r in rows} == {"n0", "n1"}
    keys = effect_keys(server)
    assert len(keys) == TURNS * (STEPS - 1) and set(keys.values()) == {1}


SLOW_LEASE = 1.5  # renewed every 0.5 s, lapsed when none confirmed it for 1.2 s
SLOW_TURNS = 40


@pytest.mark.slow
def test_over_a_slow_link_leases_never_lapse_and_a_step_costs_few_round_trips(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    """Two nodes whose database is 10 ms away each way, with short leases: no lease
    lapses (the nodes' own log: a renewal neither waits for a pooled connection nor,
    for long, for the rows a commit holds), and counted on the wire (behind the
    delaying proxy) a step costs few round trips and transactions."""
    counter = CountingProxy(server_url()).start()
    link = CuttableProxy(counter.url(db), delay=DELAY).start()
    daemons = [Daemon(tmp_path, fleet_config(tmp_path, server, link.url(), f"n{i}",
                                             lease=SLOW_LEASE), name=f"n{i}")
               for i in range(2)]
    try:
        for d in daemons:
            d.start()
        before = counter.snapshot()
        for i in range(0, SLOW_TURNS, 10):
            status, _ = daemons[i // 10 % 2].post(
                "/v1/turns", [{"message": f"work {j}"} for j in range(i, i + 10)])
            assert status == 202
        wait_finished(db, SLOW_TURNS, timeout=300)
        sent = counter.snapshot() - before
        logs = [d.log_text() for d in daemons]
    finally:
        for d in daemons:
            d.kill()
        link.cut()
        counter.stop()
    steps = SLOW_TURNS * STEPS
    print(f"per step: {sent.round_trips / steps:.2f} round trips, {sent.statements / steps:.2f}"
          f" statements, {sent.commits / steps:.2f} commits, {sent.tags['RESET'] / steps:.2f}"
          f" pool resets; {dict(sent.tags)}")
    for log in logs:
        assert "fleet.lease_lapsed" not in log and "fleet.lease_lost" not in log
    # Counted on the wire: the steps' commits wait for few round trips (no pooled
    # connection's reset after each, a batch's intents in one statement, submits on
    # their own), and take few transactions of their own a step.
    assert sent.round_trips < 4 * steps
    assert sent.commits < steps
    rows = query(db, "SELECT state FROM turns")
    assert collections.Counter(r["state"] for r in rows) == {"completed": SLOW_TURNS}
    keys = effect_keys(server)
    assert len(keys) == SLOW_TURNS * (STEPS - 1) and set(keys.values()) == {1}
