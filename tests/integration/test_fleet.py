"""Three real daemons on one real PostgreSQL database and a real tool server that counts
each effect by its Idempotency-Key: every turn completes exactly once wherever it was
submitted, a node killed with SIGKILL loses its turns to the others once its leases
expire (no non-idempotent key sent twice), and a node stopped cleanly hands its turns
back at once."""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.fleet_helpers import (  # noqa: F401 - fixtures `db`, `server`
    fleet_db,
    fleet_server,
    query,
    wait_finished,
)
from tests.integration.harness import Daemon, accepted_connections, scripted_provider, wait_until
from tests.integration.tool_server import Reply, ToolServer

STEPS = 5  # 4 tool calls and the answer
SCRIPT = """
[[scenarios]]
match = "^work"
""" + "".join(f"""
[[scenarios.steps]]
tool_calls = [{{ name = "effect", arguments = {{ step = {n} }} }}]
""" for n in range(1, STEPS)) + """
[[scenarios.steps]]
reply = "done"
"""


def fleet_config(tmp: Path, server: ToolServer, db: str, node: str, *,
                 lease: float = 15.0, script_text: str = SCRIPT) -> str:
    script = tmp / "script.toml"
    script.write_text(script_text)
    return textwrap.dedent(f"""
        [daemon]
        max_concurrent_turns = 32
        max_queued_turns = 1000
        shutdown_timeout = 10.0

        [store]
        url = "{db}"

        [fleet]
        node_id = "{node}"
        lease_seconds = {lease}

        [budget]
        max_steps = 10

        [[tools]]
        name = "effect"
        kind = "http"
        url = "{server.url('/effect')}"
        idempotent = false
        timeout = 30.0
        """) + scripted_provider(script)


def start_fleet(tmp: Path, server: ToolServer, db: str, *, lease: float = 15.0,
                script_text: str = SCRIPT) -> list[Daemon]:
    daemons = [Daemon(tmp, fleet_config(tmp, server, db, f"n{i}", lease=lease,
                                        script_text=script_text),
                      name=f"n{i}") for i in range(3)]
    for d in daemons:
        d.start()
    return daemons


def effect_keys(server: ToolServer) -> collections.Counter[str]:
    return collections.Counter(str(c.idempotency_key) for c in server.calls("/effect"))


@pytest.mark.slow
def test_300_turns_of_5_steps_on_3_nodes_each_complete_exactly_once(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    daemons = start_fleet(tmp_path, server, db)
    try:
        ids = [daemons[i % 3].submit(f"work {i}")["id"] for i in range(300)]
        wait_finished(db, 300, timeout=300)
        # Any node answers for any turn.
        shown = [daemons[(i + 1) % 3].get(f"/v1/turns/{tid}")[1]["turn"]
                 for i, tid in enumerate(ids[:30])]
    finally:
        for d in daemons:
            d.kill()
    rows = query(db, "SELECT id, state, owner, record FROM turns")
    assert len(rows) == 300
    assert collections.Counter(r["state"] for r in rows) == {"completed": 300}
    assert {r["owner"] for r in rows} == {"n0", "n1", "n2"}  # the work was shared
    finished = query(db, "SELECT turn, count(*) AS n FROM events WHERE type ="
                         " 'turn.finished' GROUP BY turn")
    assert len(finished) == 300 and {r["n"] for r in finished} == {1}
    keys = effect_keys(server)
    assert len(keys) == 300 * (STEPS - 1) and set(keys.values()) == {1}
    assert all(t["state"] == "completed" for t in shown)


@pytest.mark.slow
def test_a_killed_node_loses_its_turns_to_the_others_after_its_lease(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    server.respond("/effect", Reply(200, delay=0.2))  # each answer differs
    daemons = start_fleet(tmp_path, server, db, lease=5.0)
    try:
        for i in range(60):
            daemons[i % 3].submit(f"work {i}")
        victim = daemons[0]
        deadline = time.monotonic() + 30
        while not query(db, "SELECT 1 FROM turns WHERE owner = 'n0' AND state = 'running'"):
            assert time.monotonic() < deadline, "n0 never ran a turn"
            time.sleep(0.05)

        def n0_calling() -> bool:  # n0 is in the middle of its turns' calls
            mine = {r["id"] for r in query(db, "SELECT id FROM turns WHERE owner = 'n0'"
                                               " AND state = 'running'")}
            return any(str(c.idempotency_key).split(".")[0] in mine
                       for c in server.calls("/effect"))

        wait_until(n0_calling, timeout=30, what="a call from a turn n0 runs")
        victim.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        victim.proc.wait()  # type: ignore[union-attr]
        wait_finished(db, 60, timeout=240)
        taken_over = query(db, "SELECT t.id FROM turns t WHERE EXISTS (SELECT 1 FROM"
                               " events e WHERE e.turn = t.id AND e.type = 'turn.resumed')")
        status = daemons[1].get("/v1/status")[1]
    finally:
        for d in daemons:
            d.kill()
    rows = query(db, "SELECT state, owner, record FROM turns")
    assert collections.Counter(r["state"] for r in rows) == {"completed": 60}
    assert {r["owner"] for r in rows} <= {"n0", "n1", "n2"}
    assert taken_over, "no turn of the killed node was resumed elsewhere"
    # The calls n0 had on the wire were not sent again: their turns say so.
    unknown = [r for r in rows if any(i.startswith("outcome unknown: ") for i in
                                      json.loads(r["record"])["result"]["open_issues"])]
    assert unknown
    keys = effect_keys(server)
    assert set(keys.values()) == {1}, [k for k, n in keys.items() if n > 1]
    assert status["fleet"]["node_id"] == "n1"


def test_a_node_stopped_cleanly_hands_its_turns_back_at_once(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    server.hold("/effect")
    daemons = start_fleet(tmp_path, server, db)
    try:
        for i in range(9):
            daemons[0].submit(f"work {i}")
        server.wait_for_calls("/effect", 1)
        held = query(db, "SELECT id FROM turns WHERE owner = 'n0'")
        assert held
        server.release("/effect")
        assert daemons[0].stop() == 0
        rows = query(db, "SELECT id, state FROM turns WHERE owner = 'n0' AND state NOT IN"
                         " ('completed', 'partial', 'failed', 'blocked', 'cancelled')")
        assert rows == []  # handed back, not left to expire
        wait_finished(db, 9, timeout=120)
        status, fleet = daemons[1].get("/v1/fleet")
        cli = subprocess.run([sys.executable, "-m", "turnkeeper", "--socket",
                              str(daemons[1].socket), "fleet"], capture_output=True,
                             text=True, timeout=30, check=False)
        status_text = subprocess.run([sys.executable, "-m", "turnkeeper", "--socket",
                                      str(daemons[2].socket), "status"],
                                     capture_output=True, text=True, timeout=30, check=False)
    finally:
        server.release("/effect")
        for d in daemons:
            d.kill()
    keys = effect_keys(server)
    assert set(keys.values()) == {1}
    assert status == 200 and fleet["node_id"] == "n1"
    nodes = {n["node_id"]: n for n in fleet["nodes"]}
    assert nodes["n0"]["stopped_at"] is not None and not nodes["n0"]["alive"]
    assert nodes["n1"]["alive"] and nodes["n2"]["alive"]
    assert cli.returncode == 0, cli.stderr
    assert "n0" in cli.stdout and "stopped" in cli.stdout and "n1 *" in cli.stdout
    assert "fleet        node n2" in status_text.stdout
    # Every log line of a node names it.
    for i, d in enumerate(daemons):
        lines = [r for r in d.log_records() if r.get("event") in ("daemon.ready",
                                                                    "turn.finished")]
        assert lines and {r.get("node") for r in lines} == {f"n{i}"}


@pytest.mark.slow
def test_a_node_paused_past_its_lease_is_fenced_and_sends_nothing_for_lost_turns(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    server.respond("/effect", Reply(200, delay=0.2))
    daemons = start_fleet(tmp_path, server, db, lease=4.0)
    paused = daemons[0]
    try:
        for i in range(30):
            daemons[i % 3].submit(f"work {i}")
        deadline = time.monotonic() + 30
        while not query(db, "SELECT 1 FROM turns WHERE owner = 'n0' AND state = 'running'"):
            assert time.monotonic() < deadline, "n0 never ran a turn"
            time.sleep(0.05)
        held = {r["id"] for r in query(db, "SELECT id FROM turns WHERE owner = 'n0' AND"
                                           " state NOT IN ('completed', 'partial',"
                                           " 'failed', 'blocked', 'cancelled')")}
        paused.signal(signal.SIGSTOP)
        try:
            # Until every turn n0 held is finished or held by another node.
            deadline = time.monotonic() + 60
            while query(db, "SELECT 1 FROM turns WHERE id = ANY($1::text[]) AND owner ="
                            " 'n0' AND state NOT IN ('completed', 'partial', 'failed',"
                            " 'blocked', 'cancelled')", list(held)):
                assert time.monotonic() < deadline, "n0's turns were never taken over"
                time.sleep(0.2)
        finally:
            paused.signal(signal.SIGCONT)
        wait_finished(db, 30, timeout=120)
        assert paused.get("/v1/status")[0] == 200  # it woke up and runs on
        # Its turns wait for a renewal before any call (the lease lapsed while it was
        # stopped); the renewal finds them taken and gives them up. The others may
        # finish everything before that renewal comes: wait for it, a few leases at most.
        deadline = time.monotonic() + 3 * 4.0
        while not ("fleet.lease_lost" in (log := paused.log_text())
                   or "turn.lease_lost" in log):
            assert time.monotonic() < deadline, "n0 never gave up the turns it lost"
            time.sleep(0.1)
    finally:
        for d in daemons:
            d.kill()
    rows = query(db, "SELECT state FROM turns")
    assert collections.Counter(r["state"] for r in rows) == {"completed": 30}
    keys = effect_keys(server)
    assert set(keys.values()) == {1}, [k for k, n in keys.items() if n > 1]
    finished = query(db, "SELECT turn, count(*) AS n FROM events WHERE type ="
                         " 'turn.finished' GROUP BY turn")
    assert len(finished) == 30 and {r["n"] for r in finished} == {1}


MESSAGES_SCRIPT = """
[[scenarios]]
match = "^ask"
[[scenarios.steps]]
tool_calls = [{ name = "clarify", arguments = { question = "which city?" } }]
[[scenarios.steps]]
reply = "going to $last_tool_result"

[[scenarios]]
match = "^steer"
[[scenarios.steps]]
tool_calls = [{ name = "effect", arguments = { step = 1 } }]
[[scenarios.steps]]
reply = "heard: $last_user"

[[scenarios]]
match = "^cancel"
[[scenarios.steps]]
tool_calls = [{ name = "effect", arguments = { step = 1 } }]
[[scenarios.steps]]
reply = "not cancelled"
"""


def owner_of(db: str, turn_id: str, state: str) -> str:
    deadline = time.monotonic() + 30
    while True:
        rows = query(db, "SELECT owner FROM turns WHERE id = $1 AND state = $2", turn_id,
                     state)
        if rows and rows[0]["owner"]:
            return str(rows[0]["owner"])
        assert time.monotonic() < deadline, f"{turn_id} never {state}"
        time.sleep(0.05)


@pytest.mark.slow
def test_answer_steer_and_cancel_reach_a_turn_through_a_node_that_does_not_run_it(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    daemons = start_fleet(tmp_path, server, db, script_text=MESSAGES_SCRIPT)
    by_id = {f"n{i}": d for i, d in enumerate(daemons)}
    try:
        asked = daemons[0].submit("ask")["id"]
        owner = owner_of(db, asked, "waiting")
        other = next(d for n, d in by_id.items() if n != owner)
        status, _ = other.post(f"/v1/turns/{asked}/messages",
                               {"kind": "answer", "text": "Lisbon"})
        assert status == 202
        done = other.wait(asked, timeout=30)
        assert done["state"] == "completed"
        assert done["result"]["answer"] == "going to Lisbon"

        server.hold("/effect")
        steered = daemons[1].submit("steer")["id"]
        server.wait_for_calls("/effect", 1)
        owner = owner_of(db, steered, "running")
        other = next(d for n, d in by_id.items() if n != owner)
        status, _ = other.post(f"/v1/turns/{steered}/messages",
                               {"kind": "steer", "text": "turn left"})
        assert status == 202
        deadline = time.monotonic() + 10
        while query(db, "SELECT 1 FROM mail"):  # taken in by the owner
            assert time.monotonic() < deadline, "the steer never reached the owner"
            time.sleep(0.05)
        followed: list[dict[str, Any]] = []
        follower = threading.Thread(target=lambda: followed.extend(other.events(steered)),
                                    name="follow through a non-owner")
        follower.start()
        server.release("/effect")
        done = other.wait(steered, timeout=30)
        assert done["result"]["answer"] == "heard: turn left"
        follower.join(30)
        assert not follower.is_alive(), "following through a non-owner never ended"
        types = [e["type"] for e in followed]
        assert types[0] == "turn.queued" and types[-1] == "turn.finished"
        assert "turn.message" in types and "tool.result" in types

        server.hold("/effect")
        cancelled = daemons[2].submit("cancel")["id"]
        server.wait_for_calls("/effect", 2)
        owner = owner_of(db, cancelled, "running")
        other = next(d for n, d in by_id.items() if n != owner)
        status, body = other.post(f"/v1/turns/{cancelled}/cancel", {})
        assert status == 202 and body["state"] == "cancelling"
        while not any(r.get("event") == "fleet.cancel_applied" and r.get("turn") == cancelled
                      for r in by_id[owner].log_records()):
            assert time.monotonic() < deadline + 20, "the cancel never reached the owner"
            time.sleep(0.05)
        assert [r["kind"] for r in query(db, "SELECT kind FROM mail")] == ["cancel"]
        server.release("/effect")
        done = other.wait(cancelled, timeout=30)
        assert done["state"] == "cancelled"
        assert query(db, "SELECT 1 FROM mail") == []  # taken by the turn's end
    finally:
        server.release("/effect")
        for d in daemons:
            d.kill()


@pytest.mark.slow
def test_connections_killed_mid_run_on_every_node_cost_no_turn(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    daemons = start_fleet(tmp_path, server, db)
    stop = threading.Event()
    killed: list[int] = []

    def keep_killing() -> None:
        while not stop.wait(0.1):
            [(n,)] = query(db, "SELECT count(pg_terminate_backend(pid)) FROM"
                               " pg_stat_activity WHERE datname = current_database() AND"
                               " pid <> pg_backend_pid() AND application_name LIKE"
                               " 'turnkeeper%'")
            killed.append(int(n))

    killer = threading.Thread(target=keep_killing, name="pg_terminate_backend")
    try:
        for i in range(90):
            daemons[i % 3].submit(f"work {i}")
        killer.start()
        wait_finished(db, 90, timeout=240)
    finally:
        stop.set()
        if killer.is_alive():
            killer.join()
        for d in daemons:
            d.kill()
    assert sum(killed) > 0
    rows = query(db, "SELECT state FROM turns")
    assert collections.Counter(r["state"] for r in rows) == {"completed": 90}
    keys = effect_keys(server)
    assert set(keys.values()) == {1}, [k for k, n in keys.items() if n > 1]
    finished = query(db, "SELECT turn, count(*) AS n FROM events WHERE type ="
                         " 'turn.finished' GROUP BY turn")
    assert len(finished) == 90 and {r["n"] for r in finished} == {1}


BREAKER_SCRIPT = """
[[scenarios]]
match = "^flaky"
[[scenarios.steps]]
tool_calls = [{ name = "effect", arguments = { step = 1 } }]
[[scenarios.steps]]
tool_calls = [{ name = "effect", arguments = { step = 2 } }]
[[scenarios.steps]]
reply = "gave up"
"""


def test_a_breaker_one_node_opens_is_open_on_every_node(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    server.respond("/effect", Reply(503))
    daemons = [Daemon(tmp_path, fleet_config(tmp_path, server, db, f"n{i}",
                                             script_text=BREAKER_SCRIPT)
                      + "\n[circuit_breaker]\nfailure_threshold = 2\ncooldown = 120.0\n",
                      name=f"n{i}") for i in range(3)]
    try:
        for d in daemons:
            d.start()
        tid = daemons[0].submit("flaky")["id"]
        daemons[0].wait(tid, timeout=60)
        [(owner,)] = query(db, "SELECT owner FROM turns WHERE id = $1", tid)

        def states() -> list[str]:
            return [d.get("/v1/status")[1]["breakers"]["tool:effect"] for d in daemons]

        deadline = time.monotonic() + 15
        while states() != ["open"] * 3:
            assert time.monotonic() < deadline, f"breakers {states()} (ran on {owner})"
            time.sleep(0.1)
        [(shared,)] = query(db, "SELECT count(*) FROM breakers WHERE name = 'tool:effect'"
                                " AND open_until > now()")
    finally:
        for d in daemons:
            d.kill()
    assert shared == 1


@pytest.mark.slow
def test_the_event_stream_of_one_node_carries_every_nodes_events(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    daemons = start_fleet(tmp_path, server, db)
    finished: set[str] = set()
    types: set[str] = set()

    def follow() -> None:
        for ev in daemons[0].client.stream("/v1/events?type=turn.,tool.result"):
            types.add(ev["type"])
            if ev["type"] == "turn.finished":
                finished.add(ev["turn"])
                if len(finished) == 12:
                    return

    follower = threading.Thread(target=follow, name="follow /v1/events on n0")
    try:
        wait_until(lambda: accepted_connections(daemons[0]) == 0, what="n0's idle socket")
        follower.start()
        # Subscribed (a turn missed here would fail the test, not pass it).
        wait_until(lambda: accepted_connections(daemons[0]) == 1, what="n0's stream")
        ids = {daemons[1 + i % 2].submit(f"work {i}")["id"] for i in range(12)}
        wait_finished(db, 12, timeout=120)
        follower.join(30)
        assert not follower.is_alive(), f"n0's stream saw {len(finished)} of 12 finishes"
        owners = {r["owner"] for r in query(db, "SELECT owner FROM turns")}
    finally:
        for d in daemons:
            d.kill()
    assert finished == ids
    assert owners - {"n0"}, "every turn ran on n0: nothing came from another node"
    assert {"turn.queued", "turn.started", "tool.result"} <= types
