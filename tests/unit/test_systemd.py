"""sd_notify, the watchdog and socket activation against real sockets, no systemd needed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from turnkeeper.lifecycle.systemd import (
    Notifier,
    asking_for_time,
    extend_timeout_loop,
    listen_fds,
    status_loop,
    take_unix_listener,
    watchdog_interval,
    watchdog_loop,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket standing in for systemd's notify socket, at a file path."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    yield sock, path
    sock.close()


def received(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_notifier_sends_each_message_as_one_exact_datagram(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})

    assert notifier.ready("ready: 0 running, 0 queued, policy 1")
    assert notifier.status("reloading")
    assert notifier.stopping()
    assert notifier.watchdog()
    assert notifier.extend_timeout(2.5)
    assert notifier.notify(ERRNO=0, status="two\nlines")

    assert received(sock) == "READY=1\nSTATUS=ready: 0 running, 0 queued, policy 1"
    assert received(sock) == "STATUS=reloading"
    assert received(sock) == "STOPPING=1"
    assert received(sock) == "WATCHDOG=1"
    assert received(sock) == "EXTEND_TIMEOUT_USEC=2500000"
    assert received(sock) == "ERRNO=0\nSTATUS=two lines"
    assert (notifier.sent, notifier.errors) == (6, 0)


def test_reloading_carries_the_monotonic_clock_in_microseconds(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    notifier = Notifier(path)
    before = time.monotonic_ns() // 1000
    notifier.reloading("reloading")
    after = time.monotonic_ns() // 1000

    lines = received(sock).split("\n")
    assert lines[0] == "RELOADING=1"
    key, value = lines[1].split("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after
    assert lines[2] == "STATUS=reloading"


def test_abstract_socket_address_starts_with_at() -> None:
    name = f"turnkeeper-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    try:
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.enabled
        assert notifier.ready()
        assert received(sock) == "READY=1"
    finally:
        sock.close()


def test_from_env_unsets_notify_socket_so_children_do_not_inherit_it(
    monkeypatch: pytest.MonkeyPatch, listener: tuple[socket.socket, str]
) -> None:
    _sock, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)

    notifier = Notifier.from_env()

    assert notifier.enabled
    assert "NOTIFY_SOCKET" not in os.environ
    env = {"NOTIFY_SOCKET": path}
    Notifier.from_env(env, unset=False)
    assert env == {"NOTIFY_SOCKET": path}


@pytest.mark.parametrize("value", [None, "", "vsock:2:1234", "@"])
def test_notifier_without_a_usable_socket_is_a_silent_no_op(value: str | None) -> None:
    notifier = Notifier.from_env({} if value is None else {"NOTIFY_SOCKET": value})

    assert not notifier.enabled
    assert notifier.ready() is False
    assert (notifier.sent, notifier.errors) == (0, 0)


def test_a_lost_datagram_is_counted_never_raised(tmp_path: Path) -> None:
    notifier = Notifier(str(tmp_path / "nobody-listens.sock"))

    assert notifier.ready() is False
    assert notifier.watchdog() is False
    assert (notifier.sent, notifier.errors) == (0, 2)
    assert notifier.last_error is not None and "FileNotFoundError" in notifier.last_error


def test_notifier_recovers_when_the_socket_comes_back(tmp_path: Path) -> None:
    path = str(tmp_path / "late.sock")
    notifier = Notifier(path)
    assert not notifier.ready()

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    try:
        assert notifier.ready()
        assert received(sock) == "READY=1"
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}, 0.5),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "x"}, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec_for_this_process(
    env: dict[str, str], expected: float | None
) -> None:
    assert watchdog_interval(dict(env)) == expected


def test_watchdog_interval_unsets_its_variables() -> None:
    env = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid()), "OTHER": "1"}

    assert watchdog_interval(env) == 1.0
    assert env == {"OTHER": "1"}


@pytest.mark.anyio
async def test_watchdog_loop_pings_from_the_event_loop(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    notifier = Notifier(path)

    with anyio.move_on_after(0.055):
        await watchdog_loop(notifier, 0.02)

    assert notifier.sent >= 3
    assert [received(sock) for _ in range(notifier.sent)] == ["WATCHDOG=1"] * notifier.sent


@pytest.mark.anyio
async def test_a_drain_asks_for_three_steps_of_time_at_every_step(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    notifier = Notifier(path)

    with anyio.move_on_after(0.055):
        await extend_timeout_loop(notifier, 0.02)

    assert notifier.sent >= 2  # at 0, 0.02 (and 0.04) s
    assert [received(sock) for _ in range(notifier.sent)] == [
        "EXTEND_TIMEOUT_USEC=60000"] * notifier.sent


@pytest.mark.anyio
async def test_a_long_start_up_step_asks_for_time_and_a_short_one_sends_nothing(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    notifier = Notifier(path)

    async def quick() -> str:
        return "opened"

    async def slow() -> str:
        await anyio.sleep(0.35)
        return "migrated"

    assert await asking_for_time(notifier, quick, status="migrating", after_s=0.1,
                                 every_s=0.1) == "opened"
    assert notifier.sent == 0
    assert await asking_for_time(notifier, slow, status="migrating", after_s=0.1,
                                 every_s=0.1) == "migrated"
    sent = notifier.sent
    assert sent >= 2  # the status at 0.1 s, then a request for 0.3 s every 0.1 s
    assert [received(sock) for _ in range(sent)] == [
        "STATUS=migrating", *["EXTEND_TIMEOUT_USEC=300000"] * (sent - 1)]
    await anyio.sleep(0.25)
    assert notifier.sent == sent  # nothing once the step is over

    async def failing() -> str:
        raise OSError("state directory is not writable")

    # The step's error comes out as it is (the daemon tells a store error by its type).
    with pytest.raises(OSError, match="not writable"):
        await asking_for_time(notifier, failing, status="migrating")


@pytest.mark.anyio
async def test_status_loop_sends_status_only_when_it_changed(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    notifier = Notifier(path)
    notifier.ready("ready; 0 running")  # what READY=1 said counts as sent
    lines = ["ready; 0 running", "ready; 2 running", "ready; 2 running", "ready; 1 running"]
    asked = 0

    with anyio.CancelScope() as scope:
        def status() -> str:
            nonlocal asked
            asked += 1
            if asked == len(lines):
                scope.cancel()  # takes effect at the loop's next sleep
            return lines[asked - 1]

        await status_loop(notifier, status, every_s=0.001)

    assert [received(sock) for _ in range(notifier.sent)] == [
        "READY=1\nSTATUS=ready; 0 running", "STATUS=ready; 2 running",
        "STATUS=ready; 1 running"]


@pytest.mark.anyio
async def test_status_loop_without_systemd_returns_at_once() -> None:
    with anyio.fail_after(1):
        await status_loop(Notifier(None), lambda: "x", every_s=100)


def test_listen_fds_ignores_a_request_for_another_process() -> None:
    env = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "control"}

    assert listen_fds(env) == []
    assert env == {}


@pytest.mark.parametrize("env", [{}, {"LISTEN_PID": "x", "LISTEN_FDS": "1"}])
def test_listen_fds_without_activation_is_empty(env: dict[str, str]) -> None:
    assert listen_fds(env) == []


# The child plays systemd's part after fork: the listeners at fds 3 and 4, LISTEN_PID = its own
# pid; then it is the daemon: takes its listener and answers one connection on it.
CHILD = """
import json, os, socket, sys
from turnkeeper.lifecycle.systemd import take_unix_listener
os.dup2(int(sys.argv[1]), 3, inheritable=True)
os.dup2(int(sys.argv[2]), 4, inheritable=True)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="2", LISTEN_FDNAMES=sys.argv[3])
sock = take_unix_listener("control")
report = {
    "fd": sock.fileno(),
    "address": sock.getsockname(),
    "inheritable": [os.get_inheritable(3), os.get_inheritable(4)],
    "env": sorted(k for k in os.environ if k.startswith("LISTEN_")),
}
print(json.dumps(report), flush=True)
conn, _ = sock.accept()
conn.sendall(b"hello from the activated daemon")
conn.close()
"""


@pytest.mark.parametrize(
    ("names", "order", "expected_fd", "expected_name"),
    [
        ("other:control", ("other", "control"), 4, "control"),
        ("control:other", ("control", "other"), 3, "control"),
        ("", ("other", "control"), 3, "other"),  # no names: the first listener
    ],
)
def test_take_unix_listener_prefers_the_socket_named_control(
    tmp_path: Path,
    names: str,
    order: tuple[str, str],
    expected_fd: int,
    expected_name: str,
) -> None:
    listeners: dict[str, socket.socket] = {}
    for name in order:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(tmp_path / f"{name}.sock"))
        sock.listen()
        listeners[name] = sock
    fds = [listeners[name].fileno() for name in order]
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, *map(str, fds), names],
            pass_fds=fds,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        report = json.loads(child.stdout.readline())
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(5.0)
        client.connect(report["address"])
        greeting = client.recv(100)
        client.close()
        assert child.wait(timeout=10) == 0
    finally:
        for sock in listeners.values():
            sock.close()

    assert report["fd"] == expected_fd
    assert report["address"] == str(tmp_path / f"{expected_name}.sock")
    assert report["inheritable"] == [False, False]
    assert report["env"] == []
    assert greeting == b"hello from the activated daemon"


def test_take_unix_listener_skips_sockets_that_are_not_unix_stream_listeners() -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    connected, _peer = socket.socketpair()
    try:
        chosen = take_unix_listener(
            "control", [(udp.fileno(), "control"), (connected.fileno(), "unknown")]
        )
        assert chosen is None
        # Not chosen means not closed: the fds still belong to their owners.
        assert udp.fileno() != -1 and os.fstat(udp.fileno())
        assert os.fstat(connected.fileno())
    finally:
        udp.close()
        connected.close()
        _peer.close()


def test_take_unix_listener_without_activation_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LISTEN_PID", raising=False)
    monkeypatch.delenv("LISTEN_FDS", raising=False)

    assert take_unix_listener() is None
