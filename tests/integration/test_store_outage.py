"""A full disk under the state directory, for real: a small tmpfs mounted for the test
(root only; elsewhere the test is skipped with its reason).

What must hold: nothing acknowledged that the store does not hold, no result the store
does not hold, `degraded` with the reason while it lasts, 507 for new submits, and a
recovery without a restart once space returns; past `store.fatal_after`, exit 74.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import ECHO_TOOL, Daemon, script_file, scripted_provider
from turnkeeper import exits

TERMINAL = {"completed", "blocked", "partial", "failed", "cancelled"}

# Three steps a turn, each a tool call after a short model wait: checkpoints every step.
SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
delay = 0.2
reply = "one"
tool_calls = [{ name = "echo", arguments = { text = "$turn 1" } }]
[[scenarios.steps]]
delay = 0.2
reply = "two"
tool_calls = [{ name = "echo", arguments = { text = "$turn 2" } }]
[[scenarios.steps]]
reply = "done $turn"
"""


@pytest.fixture
def small_disk() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tk-full-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs",
                              str(path)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        path.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or 'not root'}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        path.rmdir()


def fill(disk: Path) -> Path:
    """Take every free byte of `disk`: the file to delete to give them back."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 65536, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


def wait_for(pred: Any, *, timeout: float = 30.0, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def daemon_on(disk: Path, tmp_path: Path, daemons: list[Daemon], extra: str = "") -> Daemon:
    script = script_file(tmp_path / "script.toml", SCRIPT)
    d = Daemon(tmp_path, scripted_provider(script) + ECHO_TOOL + extra)
    d.state_dir = disk / "state"
    d.set_config(scripted_provider(script) + ECHO_TOOL + extra)
    daemons.append(d)
    return d.start()


def stored_turns(db: Path) -> dict[str, tuple[str, bool]]:
    conn = sqlite3.connect(db)
    try:
        return {r[0]: (r[1], r[2] is not None) for r in conn.execute(
            "SELECT id, state, json_extract(record, '$.result') FROM turns")}
    finally:
        conn.close()


@pytest.mark.slow
def test_a_full_disk_degrades_refuses_submits_with_507_and_recovers_by_itself(
        small_disk: Path, tmp_path: Path, daemons: list[Daemon]) -> None:
    d = daemon_on(small_disk, tmp_path, daemons)
    turns = [d.submit(f"before {i}")["id"] for i in range(20)]
    filler = fill(small_disk)
    # The running turns' next checkpoints cannot be written: they wait, and the store
    # says so.
    wait_for(lambda: d.get("/v1/status")[1]["store"]["writable"] is False,
             what="the store to report itself unwritable")
    status, health = d.get("/v1/health")
    assert status == 503
    assert any(p.startswith("store unwritable") for p in health["problems"]), health
    status, metrics = d.get("/metrics")  # not JSON: the client hands back its text
    assert "turnkeeper_store_writable 0.0" in metrics["error"]
    status, refused = d.post("/v1/turns", {"message": "while full"})
    assert status == 507, refused
    assert "cannot be written" in refused["error"]
    # Longer than a turn's two 0.2 s steps: turns that would have gone on go nowhere.
    time.sleep(0.5)
    seen = {t: d.get(f"/v1/turns/{t}")[1]["turn"] for t in turns}
    stuck = [t for t, turn in seen.items() if turn.get("result") is None]
    assert stuck, "every turn finished before the disk filled: the test proves nothing"
    # No result the store does not hold, and none in memory it could not write.
    held = stored_turns(d.state_dir / "turnkeeper.sqlite3")
    for turn_id, turn in seen.items():
        if turn.get("result") is not None:
            assert held[turn_id] == (turn["state"], True), (turn_id, held[turn_id])
    filler.unlink()
    wait_for(lambda: d.get("/v1/status")[1]["store"]["writable"] is True, timeout=30,
             what="the store to recover")
    for turn_id in turns:
        assert d.wait(turn_id)["state"] == "completed"
    assert d.run("after")["state"] == "completed"
    assert "turnkeeper_store_writable 1.0" in d.get("/metrics")[1]["error"]
    d.stop()
    held = stored_turns(d.state_dir / "turnkeeper.sqlite3")
    assert all(held[t] == ("completed", True) for t in turns)
    assert "store.unwritable" in d.log_text()
    assert "store.recovered" in d.log_text()


def test_a_submit_in_flight_when_the_disk_fills_is_answered_once_it_is_kept(
        small_disk: Path, tmp_path: Path, daemons: list[Daemon]) -> None:
    d = daemon_on(small_disk, tmp_path, daemons)
    filler = fill(small_disk)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(d.post, "/v1/turns", {"message": "in flight"})
        wait_for(lambda: d.get("/v1/status")[1]["store"]["writable"] is False,
                 what="the store to report itself unwritable")
        assert not pending.done()  # not acknowledged: it is not on disk
        filler.unlink()
        status, data = pending.result(timeout=30)
    assert status == 202, data
    assert d.wait(data["turn"]["id"])["state"] == "completed"


def test_a_submit_the_full_disk_cannot_keep_in_time_is_answered_507_and_never_runs(
        small_disk: Path, tmp_path: Path, daemons: list[Daemon]) -> None:
    """Answered within `submit_timeout` and withdrawn: once space returns the turn does
    not appear, run or call its tool. A client told 507 that retries would otherwise
    have two turns, or have its effects without ever being told it was accepted."""
    d = daemon_on(small_disk, tmp_path, daemons, "[daemon]\nsubmit_timeout = 1.0\n")
    before = d.run("before")
    filler = fill(small_disk)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(d.post, "/v1/turns", {"message": "in flight"})
        status, data = pending.result(timeout=30)
    assert status == 507, data
    assert "withdrawn" in data["error"]
    filler.unlink()
    wait_for(lambda: d.get("/v1/status")[1]["store"]["writable"] is True, timeout=30,
             what="the store to recover")
    after = d.run("after")
    assert after["state"] == "completed"
    status, listing = d.get("/v1/turns?limit=100")
    messages = [t.get("message") for t in listing["turns"]]
    assert "in flight" not in messages
    held = stored_turns(d.state_dir / "turnkeeper.sqlite3")
    assert set(held) == {before["id"], after["id"]}


@pytest.mark.slow
def test_a_disk_full_past_fatal_after_stops_the_daemon_with_74(
        small_disk: Path, tmp_path: Path, daemons: list[Daemon]) -> None:
    d = daemon_on(small_disk, tmp_path, daemons, "[store]\nfatal_after = 2.0\n")
    turns = [d.submit(f"before {i}")["id"] for i in range(5)]
    fill(small_disk)
    assert d.proc is not None
    assert d.proc.wait(60) == exits.IOERR
    assert "store.fatal" in d.log_text()
    # Whatever the store holds is what a restart resumes; nothing claims a result it lacks.
    held = stored_turns(d.state_dir / "turnkeeper.sqlite3")
    assert set(turns) <= set(held)
    assert all(has_result == (state in TERMINAL) for state, has_result in held.values())


@pytest.mark.slow
def test_the_clients_submit_retries_a_507_with_its_key_and_makes_one_turn(
        small_disk: Path, tmp_path: Path, daemons: list[Daemon]) -> None:
    """`turnkeeper.client` meets a 507 (the disk is full, for real) and sends the same
    submit again, with the same Idempotency-Key, until space returns: one turn, made
    once the store could keep it."""
    from turnkeeper.client import Client, StoreUnavailable

    d = daemon_on(small_disk, tmp_path, daemons)
    filler = fill(small_disk)
    status, refused = d.post("/v1/turns", {"message": "probe"})
    assert status == 507, refused
    refusals: list[tuple[str, float]] = []
    freed: list[bool] = []

    def on_retry(error: Exception, delay: float) -> None:
        refusals.append((type(error).__name__, delay))
        if len(refusals) == 2 and not freed:  # refused twice: give the space back
            filler.unlink()
            freed.append(True)

    with Client(socket=d.socket) as client:
        turn = client.submit("on a full disk", idempotency_key="full-disk-1",
                             retry_for=60.0, on_retry=on_retry)
        assert turn.message == "on a full disk"
        assert client.wait(turn.id, timeout=60).state == "completed"
        again = client.submit("on a full disk", idempotency_key="full-disk-1")
    assert again.id == turn.id  # the key answers the turn it made
    assert len(refusals) >= 2
    assert {name for name, _ in refusals} == {StoreUnavailable.__name__}
    listed = [t for t in d.get("/v1/turns")[1]["turns"] if t["message"] == "on a full disk"]
    assert [t["id"] for t in listed] == [turn.id]
