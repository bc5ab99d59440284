"""Event followers that read slowly or not at all cost the daemon bounded memory.

The real daemon on its real socket: clients that open `GET /v1/events` and never read
a byte while turns with long answers run. What the daemon holds for each follower
(`/v1/status` `followers`) stays under `daemon.max_follower_backlog_bytes`; each is
dropped once it is past it, and reopens its stream with `after=` the `seq` its last
line names, missing nothing stored; a follower that reads (through `turnkeeper.client`)
gets every event.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

from tests.integration.harness import Daemon, script_file, scripted_provider
from turnkeeper.client import Client as AppClient
from turnkeeper.control.client import Client

TURNS = 120
SILENT = 4  # followers that never read
BOUND = 128 * 1024
ANSWER = "x" * 6000  # each turn's finish carries it: ~6 KB a turn, 700 KB in all


def config(tmp_path: Path) -> str:
    script = script_file(tmp_path / "script.toml", f"""
        [[scenarios]]
        [[scenarios.steps]]
        reply = "{ANSWER} $turn"
        """)
    return (f"[daemon]\nmax_follower_backlog_bytes = {BOUND}\n"
            f"follower_stall_timeout = 600\n" + scripted_provider(script))


def followers(d: Daemon) -> dict[str, int]:
    status, data = d.get("/v1/status")
    assert status == 200, data
    return data["followers"]  # type: ignore[no-any-return]


def wait_for(pred: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


def silent_follower(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(str(path))
    s.sendall(b"GET /v1/events HTTP/1.1\r\nHost: turnkeeper\r\n\r\n")
    return s


def read_all(s: socket.socket) -> bytes:
    """What the daemon sent on `s` until it closed the connection."""
    s.settimeout(10)
    chunks = []
    while True:
        try:
            data = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def ndjson_lines(raw: bytes) -> list[dict[str, Any]]:
    """The complete JSON lines of a chunked HTTP answer, which may be cut anywhere."""
    _, _, body = raw.partition(b"\r\n\r\n")
    data = b""
    while body:
        size_line, sep, rest = body.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0:
            break
        data += rest[:size]
        body = rest[size + 2:]
    lines = data.split(b"\n")[:-1]  # the last piece is cut, or empty
    return [json.loads(line) for line in lines]


def test_followers_that_never_read_hold_bounded_bytes_are_dropped_and_resume(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path))
    seen: list[dict[str, Any]] = []
    done = threading.Event()

    def read() -> None:
        finished = 0
        # The application client: it gives an event numbered below one it gave already.
        for ev in AppClient(d.socket).events():
            seen.append({"seq": ev.seq, "type": ev.type})
            finished += ev.type == "turn.finished"
            if finished == TURNS:
                break
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    silent = [silent_follower(d.socket) for _ in range(SILENT)]
    try:
        wait_for(lambda: followers(d)["open"] == SILENT + 1, "every stream open")
        largest = 0
        got: list[dict[str, Any]] = []
        for i in range(0, TURNS, 10):
            status, data = d.post("/v1/turns", [{"message": f"turn {i + k}"}
                                                for k in range(10)])
            assert status == 202, data
            # The reader keeps up (one batch behind at most); the silent ones do not.
            wait_for(lambda i=i: sum(e["type"] == "turn.finished" for e in seen) >= i + 10,
                     "the reader to see the batch")
            now = followers(d)
            largest = max(largest, now["largest_backlog_bytes"])
            assert now["largest_backlog_bytes"] <= BOUND, now
            if now["dropped"] == SILENT and not got:
                # Dropped: one of them reads what reached it, the last line first.
                got = ndjson_lines(read_all(silent[0]))
        assert done.wait(30)
        # Every silent follower was dropped once past the bound; the reader never was.
        end = followers(d)
        assert end["dropped"] == SILENT, end
        assert end["open"] <= 1, end  # the reader's, until the daemon sees it closed
        assert largest > 0 and got, (largest, len(got))
        status, text = d.get("/metrics")  # not JSON: the client hands back the text
        assert status == 200
        assert f"turnkeeper_event_subscribers_dropped_total {float(SILENT)}" in text["error"]

        # The reader got every event the store holds, none twice (live, an event that
        # commits with its turn's row may come after one numbered later).
        stored = []
        for ev in Client(d.socket, timeout=60).stream("/v1/events?after=0"):
            stored.append(ev["seq"])
            if ev["seq"] >= max(e["seq"] for e in seen):
                break
        live = [e["seq"] for e in seen]
        assert len(live) == len(set(live))
        assert set(stored) <= set(live)

        # The dropped follower's stream ended with a line naming the seq to reopen it
        # after: between the two it has every stored event.
        assert got[-1]["type"] == "stream.dropped" and got[-1]["reason"] == "buffer", got[-1]
        after = got[-1]["after"]
        events = [e["seq"] for e in got[:-1]]
        assert after <= max(events) and len(events) < len(stored)
        resumed = []
        for ev in Client(d.socket, timeout=60).stream(f"/v1/events?after={after}"):
            resumed.append(ev["seq"])
            if ev["seq"] >= max(stored):
                break
        assert set(stored) <= set(events) | set(resumed)
    finally:
        for s in silent:
            s.close()
