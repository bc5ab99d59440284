"""The control lane (`control/lane.py`): a `GET /v1/status` that closes its connection
is answered on the lane's thread from what the event loop last said, even while the
loop is busy; every other connection is handed to the loop untouched (its request
still to be read), and a change through the loop shows in the next answer."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from turnkeeper.control import lane as lane_module
from turnkeeper.control.lane import StatusLane, _is_status

STATUS = b"GET /v1/status HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"


@pytest.mark.parametrize("request_, answered", [
    (STATUS, True),
    (b"GET /v1/status HTTP/1.0\r\nHost: t\r\n\r\n", True),
    (b"GET /v1/status HTTP/1.1\r\nHost: t\r\nconnection:  Close \r\n\r\n", True),
    (b"GET /v1/status HTTP/1.1\r\nHost: t\r\n\r\n", False),  # kept alive
    (b"GET /v1/status HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", False),
    (b"GET /v1/status?x=1 HTTP/1.1\r\nConnection: close\r\n\r\n", False),
    (b"GET /v1/turns HTTP/1.1\r\nConnection: close\r\n\r\n", False),
    (b"POST /v1/status HTTP/1.1\r\nConnection: close\r\n\r\n", False),
    (b"GET /v1/status HTTP/1.1\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
     False),
    (STATUS + b"GET /v1/status HTTP/1.1\r\n\r\n", False),  # more than the one request
])
def test_which_requests_the_lane_answers(request_: bytes, answered: bool) -> None:
    end = request_.find(b"\r\n\r\n")
    assert _is_status(request_[:end], len(request_)) is answered


def _ask(path: Path, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


class _Lane:
    def __init__(self, tmp: Path, loop: asyncio.AbstractEventLoop) -> None:
        self.path = tmp / "c.sock"
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(self.path))
        self.listener.listen(16)
        self.state: dict[str, Any] = {"turns": 0}
        self.handed: list[socket.socket] = []
        self.two_handed = asyncio.Event()
        self.key = 1  # the daemon's state, policy version...
        self.lane = StatusLane(self.listener, loop=loop, status=lambda: dict(self.state),
                               hand_over=self._hand_over, allowed=lambda sock: True,
                               key=lambda: self.key)

    def _hand_over(self, sock: socket.socket) -> None:
        self.lane.took()
        self.handed.append(sock)
        if len(self.handed) == 2:
            self.two_handed.set()

    def __enter__(self) -> _Lane:
        self.lane.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lane.close()
        self.listener.close()
        for sock in self.handed:
            sock.close()


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


@pytest.fixture
def loop_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop taken as busy throughout, and no answer grows too old: the lane serves
    the loop's last answer."""
    monkeypatch.setattr(lane_module, "MAX_AGE_S", 3600.0)
    monkeypatch.setattr(lane_module, "BUSY_S", -1.0)
    monkeypatch.setattr(lane_module, "BUSY_FOR_S", 3600.0)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_status_is_answered_while_the_event_loop_is_busy(
        tmp_path: Path, loop_busy: None, anyio_backend: str) -> None:
    with _Lane(tmp_path, asyncio.get_running_loop()) as t:
        first = await _in_thread(_ask, t.path, STATUS)  # the loop answers it
        assert first.startswith(b"HTTP/1.1 200 OK\r\n")
        assert json.loads(first.split(b"\r\n\r\n", 1)[1]) == {"turns": 0}
        answers: list[bytes] = []

        def client() -> None:
            answers.append(_ask(t.path, STATUS))

        asker = threading.Thread(target=client)
        asker.start()
        asker.join(timeout=30)  # the loop's thread held here: only the lane can answer
        assert answers and answers[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"Connection: close" in answers[0]
        assert t.lane.answered == 2 and t.handed == []


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_other_requests_are_handed_over_unread(tmp_path: Path,
                                                     anyio_backend: str) -> None:
    kept_alive = b"GET /v1/status HTTP/1.1\r\nHost: t\r\n\r\n"
    submit = b"POST /v1/turns HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"
    with _Lane(tmp_path, asyncio.get_running_loop()) as t:
        clients = []
        for request in (kept_alive, submit):
            c = socket.socket(socket.AF_UNIX)
            c.connect(str(t.path))
            c.sendall(request)
            clients.append(c)
        await t.two_handed.wait()
        got = {sock.recv(65536) for sock in t.handed}
        assert got == {kept_alive, submit}  # what the lane peeked is still there
        for c in clients:
            c.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_change_through_the_loop_shows_in_the_next_answer(
        tmp_path: Path, loop_busy: None, anyio_backend: str) -> None:
    with _Lane(tmp_path, asyncio.get_running_loop()) as t:
        await _in_thread(_ask, t.path, STATUS)
        t.state["turns"] = 1  # a submit, say, then its answer sent
        t.lane.changed()
        answers: list[bytes] = []
        asker = threading.Thread(target=lambda: answers.append(_ask(t.path, STATUS)))
        asker.start()
        asker.join(timeout=30)  # the loop held: the answer is the one `changed` took
        assert json.loads(answers[0].split(b"\r\n\r\n", 1)[1]) == {"turns": 1}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_answer_taken_before_a_reload_does_not_serve_after_it(
        tmp_path: Path, loop_busy: None, anyio_backend: str) -> None:
    with _Lane(tmp_path, asyncio.get_running_loop()) as t:
        await _in_thread(_ask, t.path, STATUS)
        t.state["turns"] = 1  # a reload, say: no request through the loop
        t.key = 2
        got = await _in_thread(_ask, t.path, STATUS)
        assert json.loads(got.split(b"\r\n\r\n", 1)[1]) == {"turns": 1}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_while_the_loop_answers_quickly_the_answer_is_the_daemon_s_now(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: str) -> None:
    monkeypatch.setattr(lane_module, "MAX_AGE_S", 3600.0)
    monkeypatch.setattr(lane_module, "BUSY_S", 3600.0)  # the loop never taken as busy
    with _Lane(tmp_path, asyncio.get_running_loop()) as t:
        await _in_thread(_ask, t.path, STATUS)
        t.state["turns"] = 1  # a turn started: no request, the key the same
        got = await _in_thread(_ask, t.path, STATUS)
        assert json.loads(got.split(b"\r\n\r\n", 1)[1]) == {"turns": 1}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_lane_that_fails_gives_the_socket_back_to_the_event_loop(
        tmp_path: Path, anyio_backend: str) -> None:
    loop = asyncio.get_running_loop()
    path = tmp_path / "c.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(16)
    failed = asyncio.Event()

    def allowed(sock: socket.socket) -> bool:
        raise RuntimeError("a bug in the lane")

    lane = StatusLane(listener, loop=loop, status=lambda: {}, hand_over=lambda s: None,
                      allowed=allowed, failed=failed.set)
    lane.start()
    client = socket.socket(socket.AF_UNIX)
    try:
        client.connect(str(path))
        await asyncio.wait_for(failed.wait(), 10)  # called on the event loop
        # The listener is whole and still listening: the loop can serve it.
        server = await loop.create_server(asyncio.Protocol, sock=listener)
        server.close()
    finally:
        client.close()
        lane.close()
        listener.close()
