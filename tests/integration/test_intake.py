"""Intake under load, against the real daemon: batch submits (one request, one store
transaction, answers in order, all-or-nothing checks), and new submits refused with
503 + Retry-After while the event loop is behind."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from tests.integration.harness import (
    ECHO_TOOL,
    Daemon,
    post_raw,
    script_file,
    scripted_provider,
)

SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
delay = 0.02
reply = "answer to: $message"
"""


def config(tmp_path: Path, extra: str = "") -> str:
    return scripted_provider(script_file(tmp_path / "script.toml", SCRIPT)) + ECHO_TOOL + extra


def test_a_batch_is_answered_in_order_and_every_turn_runs(start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path))
    items = [{"message": f"item {i}"} for i in range(5)]
    items[2]["session"] = "batch-s"
    items[3]["budget"] = {"max_steps": 4}
    status, data = d.post("/v1/turns", items)
    assert status == 202, data
    results = data["results"]
    assert [r["status"] for r in results] == [202] * 5
    assert [r["turn"]["message"] for r in results] == [f"item {i}" for i in range(5)]
    assert results[2]["turn"]["session"] == "batch-s"
    assert results[3]["turn"]["budget"] == {"max_steps": 4}
    assert len({r["turn"]["id"] for r in results}) == 5
    for i, r in enumerate(results):
        done = d.wait(r["turn"]["id"])
        assert done["state"] == "completed"
        assert done["result"]["answer"] == f"answer to: item {i}"
    # One log line for the batch, naming every turn it queued.
    batch = [e for e in d.log_records() if e.get("event") == "turns.queued"]
    assert len(batch) == 1 and batch[0]["turns"] == [r["turn"]["id"] for r in results]


def test_a_malformed_item_refuses_the_whole_batch_naming_its_index_and_field(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path, """
[budget.profiles.quick]
max_steps = 3
"""))
    cases: list[tuple[Any, str, int | None]] = [
        ([{"message": "fine"}, {"message": "x", "budget": {"max_steps": "5"}}],
         "[1].budget.max_steps", 1),
        ([{"message": "fine"}, {"message": "fine"}, {"mesage": "typo"}], "[2].message", 2),
        ([{"message": "fine"}, {"message": "fine", "colour": "red"}], "[1].colour", 1),
        ([{"message": "fine"}, 7], "[1]", 1),
        ([{"message": "fine", "deadline": 1.0}], "[0].deadline", 0),
        ([{"message": "fine", "profile": "quick"}, {"message": "x", "profile": "deep"}],
         "[1].profile", 1),
        ([], "(body)", None),
        ([{"message": "m"}] * 1001, "(body)", None),
    ]
    for body, field, index in cases:
        status, data = d.post("/v1/turns", body)
        assert status == 400, (body, data)
        assert data["field"] == field, data
        assert data.get("index") == index, data
        if index is not None:
            assert data["error"].startswith(f"[{index}]"), data
    assert d.get("/v1/turns")[1]["turns"] == []  # nothing of any of them was queued


def test_an_oversized_message_in_a_batch_is_a_413_naming_its_index(start: Any,
                                                                   tmp_path: Path) -> None:
    d = start(config(tmp_path, "[daemon]\nmax_message_bytes = 100\n"))
    status, data = d.post("/v1/turns", [{"message": "ok"}, {"message": "é" * 51}])
    assert status == 413, data
    assert data["field"] == "[1].message" and data["index"] == 1
    assert "daemon.max_message_bytes" in data["error"]
    assert d.get("/v1/turns")[1]["turns"] == []


def test_a_batch_the_queue_cannot_hold_whole_is_refused_whole(start: Any,
                                                             tmp_path: Path) -> None:
    d = start(config(tmp_path, "[daemon]\nmax_queued_turns = 3\n"))
    assert d.post("/v1/intake", {"open": False})[0] == 200  # nothing leaves the queue
    assert d.post("/v1/turns", [{"message": "first"}])[0] == 202
    status, headers, data = post_raw(d.socket, "/v1/turns",
                                     [{"message": f"b{i}"} for i in range(3)])
    assert status == 503, data
    assert int(headers["retry-after"]) >= 1
    assert "room for 2 more turns, not the 3" in data["error"]
    assert len(d.get("/v1/turns")[1]["turns"]) == 1
    status, data = d.post("/v1/turns", [{"message": f"b{i}"} for i in range(2)])
    assert status == 202 and len(data["results"]) == 2
    assert d.get("/v1/status")[1]["queue"]["depth"] == 3


def test_a_single_submit_still_takes_an_object(start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path))
    status, data = d.post("/v1/turns", "just a string")
    assert status == 400 and data["field"] == "(body)"
    assert d.run("one")["state"] == "completed"


def metric(d: Daemon, name: str) -> float:
    status, data = d.get("/metrics")
    assert status == 200
    text = data["error"]  # not JSON: the client hands the text over as it is
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_submits_get_503_with_retry_after_while_the_loop_lags(start: Any,
                                                              tmp_path: Path) -> None:
    # A threshold low enough that bursts of batch submits (each a few tens of ms of
    # work on the loop) put the lag over it, for real.
    d = start(config(tmp_path, """
[daemon]
max_queued_turns = 1000000
overload_lag = 0.005
overload_samples = 1
overload_clear_after = 0.5
"""))
    assert d.post("/v1/intake", {"open": False})[0] == 200  # the turns wait: only intake
    assert d.get("/v1/status")[1]["overload"]["state"] == "accepting"
    stop = threading.Event()
    burst = [{"message": f"burst {i}"} for i in range(1000)]

    def hammer() -> None:
        while not stop.is_set():
            d.post("/v1/turns", burst)

    workers = [threading.Thread(target=hammer, daemon=True) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        refused: tuple[int, dict[str, str], Any] | None = None
        deadline = time.monotonic() + 60
        while refused is None and time.monotonic() < deadline:
            status, headers, data = post_raw(d.socket, "/v1/turns", {"message": "one more"})
            if status == 503:
                refused = (status, headers, data)
        assert refused is not None, "the burst never put the loop's lag over 5 ms"
        _, headers, data = refused
        assert "daemon.overload_lag" in data["error"], data
        assert int(headers["retry-after"]) >= 1
        overload = d.get("/v1/status")[1]["overload"]
        assert overload["spells"] >= 1 and overload["refused_total"] >= 1
        deadline = time.monotonic() + 60  # the gauge is set with each lag sample
        while metric(d, "turnkeeper_overloaded") != 1.0:
            assert time.monotonic() < deadline
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    # Calm again: intake reopens by itself (lag under half the threshold for 0.5 s).
    deadline = time.monotonic() + 60
    while d.get("/v1/status")[1]["overload"]["state"] != "accepting":
        assert time.monotonic() < deadline, d.get("/v1/status")[1]["overload"]
        time.sleep(0.1)
    assert d.post("/v1/turns", {"message": "after the storm"})[0] == 202
    records = d.log_records()
    assert any(e.get("event") == "daemon.overloaded" and e["overload_lag"] == 0.005
               for e in records)
    assert any(e.get("event") == "daemon.overload_cleared" for e in records)
