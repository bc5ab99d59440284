"""Idempotent submits on the real daemon: a submit sent again with its Idempotency-Key
(header, body field or batch item) answers the turn the first one made, 200 and the
same id, across a kill -9 and across a fleet's nodes; the key with another body is a 422
naming it."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.fleet_helpers import (  # noqa: F401 - fixtures `db`, `server`
    fleet_db,
    fleet_server,
    query,
)
from tests.integration.harness import (
    ECHO_TOOL,
    Daemon,
    post_raw,
    script_file,
    scripted_provider,
)
from tests.integration.test_fleet import fleet_config
from tests.integration.tool_server import ToolServer
from turnkeeper.store import DB_NAME

SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
delay = 0.02
reply = "answer to: $message"
"""


def config(tmp_path: Path, extra: str = "") -> str:
    return scripted_provider(script_file(tmp_path / "script.toml", SCRIPT)) + ECHO_TOOL + extra


def post(sock_path: Path, body: Any, *, key: str | None = None) -> tuple[int, Any]:
    """POST /v1/turns, with an Idempotency-Key header when `key` is given."""
    status, _, data = post_raw(sock_path, "/v1/turns", body,
                               {"Idempotency-Key": key} if key is not None else None)
    return status, data


def turn_count(d: Daemon) -> int:
    status, data = d.get("/v1/turns?limit=1000")
    assert status == 200, data
    return len(data["turns"])


def test_the_same_key_and_body_twice_is_one_turn_answered_200_the_second_time(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path))
    body = {"message": "charge the card", "session": "s-1"}
    status, first = post(d.socket, body, key="order-17")
    assert status == 202, first
    status, again = post(d.socket, body, key="order-17")
    assert status == 200, again
    assert again["turn"]["id"] == first["turn"]["id"]
    # The key in the body is the same key.
    status, third = post(d.socket, {**body, "idempotency_key": "order-17"})
    assert (status, third["turn"]["id"]) == (200, first["turn"]["id"])
    assert turn_count(d) == 1
    assert d.wait(first["turn"]["id"])["result"]["answer"] == "answer to: charge the card"


def test_the_same_key_with_a_different_body_is_a_422_naming_the_key(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path))
    status, _ = post(d.socket, {"message": "one thing"}, key="k-1")
    assert status == 202
    status, data = post(d.socket, {"message": "another thing"}, key="k-1")
    assert status == 422, data
    assert data["field"] == "idempotency_key" and "k-1" in data["error"]
    status, data = post(d.socket, {"message": "one thing", "idempotency_key": "k-2"},
                        key="k-1")
    assert (status, data["field"]) == (400, "idempotency_key")
    assert turn_count(d) == 1


def test_a_key_still_answers_its_turn_after_a_kill_9(start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path))
    status, first = post(d.socket, {"message": "before the crash"}, key="crash-1")
    assert status == 202
    d.kill()
    d.start()
    status, again = post(d.socket, {"message": "before the crash"}, key="crash-1")
    assert (status, again["turn"]["id"]) == (200, first["turn"]["id"])
    status, other = post(d.socket, {"message": "something else"}, key="crash-1")
    assert status == 422, other
    assert turn_count(d) == 1


def test_concurrent_submits_with_one_key_make_one_turn(start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path))
    answers: list[tuple[int, Any]] = []

    def send() -> None:
        answers.append(post(d.socket, {"message": "once"}, key="race"))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s for s, _ in answers) == [200] * 7 + [202]
    assert len({a["turn"]["id"] for _, a in answers}) == 1
    assert turn_count(d) == 1


def test_batch_items_keep_their_keys_and_a_retried_batch_makes_no_new_turns(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path))
    items = [{"message": "a", "idempotency_key": "item-a"}, {"message": "b"}]
    status, first = post(d.socket, items, key="batch-1")
    assert status == 202, first
    status, again = post(d.socket, items, key="batch-1")
    assert status == 200, again
    assert [r["status"] for r in again["results"]] == [200, 200]
    assert [r["turn"]["id"] for r in again["results"]] == \
        [r["turn"]["id"] for r in first["results"]]
    # Item 1 is keyed `batch-1/1` by the header: it made "b", not "c".
    status, bad = post(d.socket, [{"message": "new"}, {"message": "c"}], key="batch-1")
    assert (status, bad["field"]) == (422, "[1].idempotency_key"), bad
    status, twice = post(d.socket, [{"message": "x", "idempotency_key": "dup"},
                                    {"message": "y", "idempotency_key": "dup"}])
    assert (status, twice["field"]) == (400, "[1].idempotency_key"), twice
    assert turn_count(d) == 2


def test_a_key_makes_one_turn_across_the_nodes_of_a_fleet(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    nodes = [Daemon(tmp_path, fleet_config(tmp_path, server, db, f"n{i}"), name=f"n{i}")
             for i in range(2)]
    try:
        for n in nodes:
            n.start()
        body = {"message": "fleet once"}
        answers: list[tuple[int, Any]] = []

        def send(n: Daemon) -> None:
            answers.append(post(n.socket, body, key="fleet-key"))

        threads = [threading.Thread(target=send, args=(nodes[i % 2],)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(s for s, _ in answers) == [200] * 5 + [202], answers
        assert len({a["turn"]["id"] for _, a in answers}) == 1
        status, other = post(nodes[1].socket, {"message": "not the same"}, key="fleet-key")
        assert (status, other["field"]) == (422, "idempotency_key")
        assert query(db, "SELECT count(*) FROM turns")[0][0] == 1
    finally:
        for n in nodes:
            n.kill()


@pytest.mark.slow  # waits out a 3 s window and a retention round
def test_a_key_past_the_window_makes_a_new_turn_and_retention_deletes_it(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path, '\n[daemon]\nidempotency_window = "3s"\n'
                               '\n[store]\nkeep_finished = "10s"\n'))
    status, first = post(d.socket, {"message": "short-lived"}, key="brief")
    assert status == 202
    deadline = time.monotonic() + 30
    while True:  # the same key answers the first turn until its window has passed
        status, again = post(d.socket, {"message": "short-lived"}, key="brief")
        if status == 202:
            break
        assert (status, again["turn"]["id"]) == (200, first["turn"]["id"])
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert again["turn"]["id"] != first["turn"]["id"]
    assert turn_count(d) == 2
    # The background retention (a round a second with this keep) deletes the expired
    # row; the live one stays.
    db = d.state_dir / DB_NAME
    while True:
        with sqlite3.connect(db) as conn:
            keys = conn.execute("SELECT key, turn FROM idempotency_keys").fetchall()
        if keys == [("brief", again["turn"]["id"])] or not keys:
            break
        assert time.monotonic() < deadline + 30, keys
        time.sleep(0.2)
    # Once its window passes too, nothing is kept of the key.
    while keys:
        with sqlite3.connect(db) as conn:
            keys = conn.execute("SELECT key FROM idempotency_keys").fetchall()
        assert time.monotonic() < deadline + 60, keys
        time.sleep(0.2)
