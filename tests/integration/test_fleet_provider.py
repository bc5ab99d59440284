"""A provider outage met by a fleet: three real daemons on one real PostgreSQL database,
a primary model provider that answers 503 to every request for the whole run and a
fallback that answers, both real HTTP servers on 127.0.0.1 (tests/integration/
fault_server.py). What the fleet shares is the breaker's state, so the nodes that meet
the outage after one node opened the primary's breaker send the primary nothing: the
fleet costs the dead provider no more than one daemon would."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.fault_server import FaultServer, fail, ok
from tests.integration.fleet_helpers import (  # noqa: F401 - fleet_db: the `db` fixture
    fleet_db,
    query,
    wait_finished,
)
from tests.integration.harness import Daemon

SLOTS = 6  # daemon.max_concurrent_turns of each node
THRESHOLD = 3  # circuit_breaker.failure_threshold
STEPS = 3  # model calls of a turn: two calls of the echo tool, then the answer


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    try:
        yield server
    finally:
        server.stop()


def node_config(faults: FaultServer, db: str, node: str, *, slots: int = SLOTS,
                threshold: int = THRESHOLD, retry_delay: float = 0.01,
                jitter: str = "full") -> str:
    providers = "".join(f"""
[[providers]]
name = "{name}"
kind = "openai"
base_url = "{faults.base_url(name)}"
model = "model-{name}"
stream = false
timeout = 10.0
""" for name in ("primary", "fallback"))
    return f"""
[daemon]
max_concurrent_turns = {slots}
max_queued_turns = 1000
shutdown_timeout = 10.0

[store]
url = "{db}"

[fleet]
node_id = "{node}"
lease_seconds = 6.0

[retry]
base_delay = {retry_delay}
max_delay = {retry_delay * 4}
jitter = "{jitter}"

[circuit_breaker]
failure_threshold = {threshold}
cooldown = 600.0

[[tools]]
name = "echo"
kind = "echo"
description = "echo"
idempotent = true
{providers}"""


def breakers(daemons: list[Daemon]) -> list[str]:
    return [d.get("/v1/status")[1]["breakers"]["primary"] for d in daemons]


def wait_open(daemons: list[Daemon], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while breakers(daemons) != ["open"] * len(daemons):
        assert time.monotonic() < deadline, f"the primary's breakers: {breakers(daemons)}"
        time.sleep(0.05)


def status_text(d: Daemon) -> str:
    done = subprocess.run([sys.executable, "-m", "turnkeeper", "--socket", str(d.socket),
                           "status"], capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_a_dead_primary_costs_a_fleet_of_three_no_more_attempts_than_one_daemon(
        tmp_path: Path, faults: FaultServer, db: str) -> None:
    """The bound, from the config. One daemon whose breaker opens after THRESHOLD
    consecutive failures sends a provider that fails everything at most THRESHOLD + M - 1
    requests while the breaker's cooldown lasts (longer than this run: no half-open
    probe): THRESHOLD outcomes while closed, the last of which opens it, plus the calls
    already on the wire when it opened, at most M - 1, M being the most model calls in
    flight at once (one per running turn: SLOTS). Retries are attempts like any other, so
    the retry budget adds nothing to it: it only decides how soon the streak is reached.

    The fleet shares the breaker's state, not each node's failure streak: a node that
    meets the outage after another opened the breaker must send nothing. So n0 meets it
    first (n1 and n2 are paused, holding no turn, while n0 runs SLOTS turns into it);
    once the breaker is open on all three, the three nodes take 30 more turns together,
    their first model calls all due at the primary. Every turn must complete on the
    fallback, none of the 30 may have reached the primary, and the primary must have
    received at most THRESHOLD + SLOTS - 1 requests in all, one daemon's bound. With a
    breaker per node the wait for the breaker open on every node fails; without that
    wait, n1 and n2 each spend their own THRESHOLD failures (seen: 9 requests, over the
    bound of 8)."""
    faults.script("primary", then=fail(503))
    faults.script("fallback", then=ok("done", delay=0.2, tool_steps=STEPS - 1))
    daemons = [Daemon(tmp_path, node_config(faults, db, f"n{i}"), name=f"n{i}").start()
               for i in range(3)]
    try:
        for d in daemons[1:]:
            assert d.post("/v1/intake", {"open": False})[0] == 200
        first = [daemons[0].submit(f"first {i}")["id"] for i in range(SLOTS)]
        wait_open(daemons[:1])
        wait_open(daemons)  # n1 and n2 opened theirs from the database
        for d in daemons[1:]:
            assert d.post("/v1/intake", {"open": True})[0] == 200
        rest = [daemons[i % 3].submit(f"more {i}")["id"] for i in range(30)]
        wait_finished(db, len(first) + len(rest), timeout=180)
        after = breakers(daemons)
        deadline = time.monotonic() + 30
        while True:  # the node list a status shows is read at the heartbeat's pace
            shown = status_text(daemons[2])
            if "nodes        3 up of 3" in shown:
                break
            assert time.monotonic() < deadline, shown
            time.sleep(0.2)
    finally:
        for d in daemons:
            d.kill()
    rows = query(db, "SELECT id, state, owner, record FROM turns")
    assert collections.Counter(r["state"] for r in rows) == {"completed": SLOTS + 30}
    assert {json.loads(r["record"])["provider"] for r in rows} == {"fallback"}
    late = {r["owner"] for r in rows if r["id"] in set(rest)}
    assert late == {"n0", "n1", "n2"}, late  # all three met the outage
    # Not one call of the turns that came once the breaker was open fleet-wide...
    late_calls = [s.user_texts() for s in faults.requests("primary")
                  if not any(t.startswith("first") for t in s.user_texts())]
    assert late_calls == []
    # ...so the fleet stayed within one daemon's bound.
    assert faults.count("primary") <= THRESHOLD + SLOTS - 1, faults.count("primary")
    assert faults.count("primary") >= THRESHOLD  # the outage was met at all
    assert faults.count("fallback") == (SLOTS + 30) * STEPS
    assert after == ["open"] * 3  # still open: no probe went to the primary
    # `turnkeeper status` shows the fleet: this node, then every node with its turns.
    lines = shown.splitlines()
    assert any(line.startswith("fleet        node n2, holding ") for line in lines), shown
    rows_shown = {line.split()[0]: line for line in lines
                  if line.startswith(" " * 13) and line.split()[0] != "node"}
    assert set(rows_shown) == {"n0", "n1", "n2"}, shown
    assert all(" up " in line and "heartbeat" in line for line in rows_shown.values())
    assert "n2 *" in rows_shown["n2"]
    assert "breakers     primary OPEN" in shown


@pytest.mark.slow
def test_three_nodes_meeting_a_dead_primary_at_once_share_one_failure_streak(
        tmp_path: Path, faults: FaultServer, db: str) -> None:
    """The three nodes meet the outage at the same instant, each with its slots full, so
    none can wait for another's opening. They add their failures to one streak in the
    database, which opens the breaker for the fleet when the streak reaches the
    threshold and tells every node at once (NOTIFY). So the primary gets at most what
    one daemon with all the fleet's slots would send: THRESHOLD outcomes, plus the calls
    on the wire when it opened (M - 1, M = 3 nodes x slots), plus 2 for the time a
    failure takes to reach the database and the opening to come back. With a streak per
    node, each node sends its own THRESHOLD (seen: 10, 12, 11 requests for one bound).
    Retries wait 0.2 s at least here (decorrelated jitter; the defaults wait up to 0.5 s,
    with full jitter): an opening reaches the other nodes after a commit and a NOTIFY, a
    few milliseconds on a busy machine, and a retry sent sooner than that would be on
    the wire before any node could know."""
    slots, threshold = 2, 8
    bound = threshold + 3 * slots - 1 + 2
    faults.script("primary", then=fail(503))
    faults.script("fallback", then=ok("done", delay=0.2, tool_steps=STEPS - 1))
    daemons = [Daemon(tmp_path, node_config(faults, db, f"n{i}", slots=slots,
                                            threshold=threshold, retry_delay=0.2,
                                            jitter="decorrelated"),
                      name=f"n{i}").start()
               for i in range(3)]
    try:
        for d in daemons:
            assert d.post("/v1/intake", {"open": False})[0] == 200
        ids = [daemons[0].submit(f"first {i}")["id"] for i in range(3 * slots)]
        for d in daemons:  # each claims its slots' worth and meets the outage
            assert d.post("/v1/intake", {"open": True})[0] == 200
        wait_open(daemons)
        wait_finished(db, len(ids), timeout=180)
    finally:
        for d in daemons:
            d.kill()
    rows = query(db, "SELECT state, owner, record FROM turns")
    assert collections.Counter(r["state"] for r in rows) == {"completed": 3 * slots}
    assert {json.loads(r["record"])["provider"] for r in rows} == {"fallback"}
    assert {r["owner"] for r in rows} == {"n0", "n1", "n2"}  # all three met it
    print(f"primary requests: {faults.count('primary')} (bound {bound})")
    assert threshold <= faults.count("primary") <= bound, faults.count("primary")
    [(streak,)] = query(db, "SELECT failures FROM breakers WHERE name = 'provider:primary'")
    assert streak >= threshold


def test_a_retry_after_heard_by_one_node_keeps_every_node_from_the_provider(
        tmp_path: Path, faults: FaultServer, db: str) -> None:
    """n0 meets the primary's 429 Retry-After: 60 and fails over; n1, which ran nothing,
    holds the same window (shared through the database) and its turn skips the primary
    with no request: a hop with reason retry_after."""
    faults.script("primary", then=fail(429, retry_after="60"))
    faults.script("fallback", then=ok("done"))
    agent = "\n[agent]\napi_max_retries = 0\n"
    daemons = [Daemon(tmp_path, node_config(faults, db, f"n{i}") + agent,
                      name=f"n{i}").start() for i in range(2)]
    n0, n1 = daemons
    try:
        assert n1.post("/v1/intake", {"open": False})[0] == 200
        first = n0.run("first")
        assert first["state"] == "completed", first["result"]
        assert faults.count("primary") == 1
        deadline = time.monotonic() + 15
        while "primary" not in n1.get("/v1/status")[1]["retry_after"]:
            assert time.monotonic() < deadline, "n1 never heard the primary's Retry-After"
            time.sleep(0.05)
        assert n0.post("/v1/intake", {"open": False})[0] == 200
        assert n1.post("/v1/intake", {"open": True})[0] == 200
        second = n1.run("second")
        assert second["state"] == "completed", second["result"]
        events = n1.events(second["id"])
    finally:
        for d in daemons:
            d.kill()
    assert faults.count("primary") == 1
    [(owner,)] = query(db, "SELECT owner FROM turns WHERE id = $1", second["id"])
    assert owner == "n1"
    hops = [(e["from"], e["to"], e["reason"]) for e in events if e["type"] == "model.failover"]
    assert hops == [("primary", "fallback", "retry_after")]
    [(node, left)] = query(db, "SELECT node, extract(epoch FROM until - now()) FROM retry_after"
                               " WHERE name = 'provider:primary'")
    assert node == "n0" and 0 < left <= 60
