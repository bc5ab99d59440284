"""The control plane holds against a hostile or careless local user: the socket's
directory, who may connect, how many may, how long they may dawdle, and what a body may
hold. Every test drives the real daemon over its real socket."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.fault_server import FaultServer, ok
from tests.integration.harness import ECHO_TOOL, Daemon, running, script_file, scripted_provider
from turnkeeper import exits

OTHER_UID = 4243
SUPPLEMENTARY_GID = 4242
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch users")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A fresh directory every user can reach (pytest's own tmp is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="tk-hardening-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _raw(sock_path: Path, timeout: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(sock_path))
    return s


def _connect_through_backlog(sock_path: Path) -> socket.socket:
    """A connection in a flood: the listen backlog may be full for a moment (EAGAIN)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return _raw(sock_path)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _read_all(s: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def _post_raw(sock_path: Path, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    with _raw(sock_path) as s:
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        response = _read_all(s)
    head, _, payload = response.partition(b"\r\n\r\n")
    return _status_of(head), json.loads(payload)


# --- the socket's directory ---------------------------------------------------------------

def test_a_shared_sticky_directory_keeps_its_mode(start: Any, shared_dir: Path) -> None:
    shared = shared_dir / "x"
    shared.mkdir()
    shared.chmod(0o1777)
    d = start(socket=shared / "tk.sock")
    assert d.get("/v1/status")[0] == 200
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777


def test_a_directory_others_can_write_without_the_sticky_bit_is_refused_with_78(
        start: Any, shared_dir: Path) -> None:
    wide = shared_dir / "wide"
    wide.mkdir()
    wide.chmod(0o777)
    d = start(socket=wide / "tk.sock", wait=False)
    assert d.proc.wait(30) == exits.CONFIG
    assert "sticky" in d.log_text()
    assert stat.S_IMODE(wide.stat().st_mode) == 0o777


def test_the_directory_the_daemon_creates_is_0750(start: Any, shared_dir: Path) -> None:
    start(socket=shared_dir / "made" / "tk.sock")
    assert stat.S_IMODE((shared_dir / "made").stat().st_mode) == 0o750


@needs_root
def test_the_daemon_refuses_a_directory_another_user_put_in_a_shared_place(
        start: Any, shared_dir: Path) -> None:
    shared_dir.chmod(0o1777)
    squatted = shared_dir / "turnkeeper-0"
    squatted.mkdir()
    os.chown(squatted, OTHER_UID, OTHER_UID)
    d = start(socket=squatted / "control.sock", wait=False)
    assert d.proc.wait(30) == exits.CONFIG
    assert f"uid {OTHER_UID}" in d.log_text()


# --- the state directory ------------------------------------------------------------------

def _state_dir_prepared(daemons: list[Daemon], tmp: Path, prepare: Any) -> Daemon:
    """A daemon whose state directory `prepare(dir)` set up before it starts."""
    d = Daemon(tmp, name="planted")
    daemons.append(d)
    d.state_dir.mkdir(mode=0o750)
    prepare(d.state_dir)
    return d.start(wait=False)


@needs_root
def test_a_state_directory_another_user_owns_is_refused_and_its_links_never_followed(
        daemons: list[Daemon], tmp_path: Path) -> None:
    victim = tmp_path / "root-owned"
    victim.write_text("precious\n")

    def plant(state: Path) -> None:
        os.symlink(victim, state / "turnkeeper.sqlite3.lock")
        os.chown(state, OTHER_UID, OTHER_UID)

    d = _state_dir_prepared(daemons, tmp_path, plant)
    assert d.proc is not None and d.proc.wait(30) == exits.CONFIG
    assert f"owned by uid {OTHER_UID}" in d.log_text()
    assert victim.read_text() == "precious\n"


def test_a_state_directory_others_can_write_is_refused_with_78(
        daemons: list[Daemon], tmp_path: Path) -> None:
    d = _state_dir_prepared(daemons, tmp_path, lambda state: state.chmod(0o777))
    assert d.proc is not None and d.proc.wait(30) == exits.CONFIG
    assert "chmod go-w" in d.log_text()


def test_a_link_where_the_store_keeps_its_lock_is_never_followed(
        daemons: list[Daemon], tmp_path: Path) -> None:
    victim = tmp_path / "elsewhere"
    victim.write_text("precious\n")
    d = _state_dir_prepared(
        daemons, tmp_path, lambda state: os.symlink(victim, state / "turnkeeper.sqlite3.lock"))
    assert d.proc is not None and d.proc.wait(30) != 0
    assert "turnkeeper.sqlite3" in d.log_text()
    assert victim.read_text() == "precious\n"


# --- peer credentials -------------------------------------------------------------------

def _status_as(sock_path: Path, uid: int, gid: int, groups: list[int]) -> int:
    """GET /v1/status from a forked child running as uid/gid with `groups`."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_end)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            with _raw(sock_path) as s:
                s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                os.write(write_end, str(_status_of(_read_all(s))).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return int(out)


@needs_root
def test_a_peer_in_an_allowed_supplementary_group_is_let_in(start: Any,
                                                             shared_dir: Path) -> None:
    d = start(f"[daemon]\nsocket_mode = \"0666\"\nallowed_gids = [{SUPPLEMENTARY_GID}]\n",
              socket=shared_dir / "tk.sock")
    sock = d.socket
    assert _status_as(sock, OTHER_UID, 65534, [65534, SUPPLEMENTARY_GID]) == 200
    assert _status_as(sock, OTHER_UID, 65534, [65534]) == 403


def _connections_as(sock_path: Path, uid: int, count: int) -> tuple[list[Any], int]:
    """A forked child running as `uid` opens `count` connections to the socket without
    sending a request and reads what each is answered (its status and error, or None:
    nothing within 2 s), while it holds all of them open. Returns those answers and the
    child's pid; the child keeps its connections until it is killed."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(uid)
            held, answers = [], []
            for _ in range(count):
                s = _raw(sock_path, timeout=2.0)
                held.append(s)
                try:
                    head, _, body = _read_all(s).partition(b"\r\n\r\n")
                    answers.append([_status_of(head), json.loads(body)["error"]])
                except (TimeoutError, IndexError, ValueError):
                    answers.append(None)
            os.write(write_end, json.dumps(answers).encode() + b"\n")
            os.close(write_end)
            while True:
                signal.pause()  # holding the connections until the test kills us
        finally:
            os._exit(1)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        line = f.readline()
    return json.loads(line), pid


@needs_root
def test_a_refused_peer_is_answered_403_at_accept_and_holds_no_connection(
        start: Any, shared_dir: Path) -> None:
    """A user who may not use the socket opens more connections than the daemon serves
    and keeps them open: each is answered 403 at once (with the setting that would admit
    it), and the operator's `status` still gets in."""
    d = start("[daemon]\nsocket_mode = \"0666\"\nmax_connections = 4\n"
              "control_idle_timeout = 60.0\n", socket=shared_dir / "tk.sock")
    answers, child = _connections_as(d.socket, OTHER_UID, 10)
    try:
        assert [a[0] for a in answers] == [403] * 10
        assert "allowed_uids" in answers[0][1]  # the setting that would admit it
        assert d.get("/v1/status")[0] == 200
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


@needs_root
def test_one_allowed_user_cannot_take_every_connection(start: Any, shared_dir: Path) -> None:
    d = start(f"[daemon]\nsocket_mode = \"0666\"\nmax_connections = 8\n"
              f"allowed_uids = [{OTHER_UID}]\ncontrol_idle_timeout = 60.0\n",
              socket=shared_dir / "tk.sock")
    answers, child = _connections_as(d.socket, OTHER_UID, 8)
    try:
        # Half the slots are that user's; the rest are answered 503 at once.
        assert answers[:4] == [None] * 4
        assert [a[0] for a in answers[4:]] == [503] * 4
        assert d.get("/v1/status")[0] == 200  # root gets in
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


def test_a_stopping_daemon_leaves_a_socket_another_daemon_bound_at_its_path(
        start: Any) -> None:
    """The daemon started after this one took the path: stopping this one must not
    unlink the newcomer's socket, or nobody could reach it."""
    d = start()
    d.socket.unlink()
    newcomer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    newcomer.bind(str(d.socket))
    newcomer.listen(1)
    try:
        identity = d.socket.stat().st_ino
        assert d.stop() == 0
        assert d.socket.exists(), "the stopping daemon removed the newcomer's socket"
        assert d.socket.stat().st_ino == identity
    finally:
        newcomer.close()


# --- descriptors: connections, idle and slow clients, followers ---------------------------

def test_a_connection_beyond_the_limit_gets_503_at_once(start: Any) -> None:
    d = start("[daemon]\nmax_connections = 2\n")
    held = [_raw(d.socket), _raw(d.socket)]
    try:
        for s in held:  # both served: each answers a request
            s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _status_of(s.recv(65536)) == 200
        with _raw(d.socket) as extra:
            response = _read_all(extra)  # no request sent: answered and closed anyway
        assert _status_of(response) == 503
        assert b"too many control connections" in response
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the slots come back once they close
        if d.get("/v1/status")[0] == 200:
            break
    assert d.get("/v1/status")[0] == 200


def test_an_idle_connection_is_closed(start: Any) -> None:
    d = start("[daemon]\ncontrol_idle_timeout = 0.3\n")
    with _raw(d.socket, timeout=20) as s:
        assert s.recv(1) == b""  # closed by the daemon, well before our own timeout


@pytest.mark.slow
def test_a_client_that_trickles_its_body_is_disconnected(start: Any) -> None:
    d = start("[daemon]\nbody_read_timeout = 0.3\n")
    with _raw(d.socket, timeout=20) as s:
        s.sendall(b"POST /v1/turns HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"message\": ")
        response = _read_all(s)
    assert _status_of(response) == 408


@pytest.mark.slow
def test_event_followers_are_capped_per_client(start: Any) -> None:
    d = start("[daemon]\nmax_followers_per_client = 1\n")
    with _raw(d.socket) as first:
        first.sendall(b"GET /v1/events HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _status_of(first.recv(65536)) == 200
        status, data = d.get("/v1/events")
        assert status == 429
        assert "max_followers_per_client" in data["error"]
    deadline = time.monotonic() + 10
    while d.get("/v1/turns/nope/events")[0] == 429 and time.monotonic() < deadline:
        pass
    assert d.get("/v1/turns/nope/events")[0] == 404  # the slot came back


@pytest.mark.slow
def test_a_descriptor_limit_of_256_holds_under_a_flood_while_turns_complete(
        start: Any) -> None:
    """400 idle connections and 300 followers against a daemon allowed 256 descriptors:
    the connections beyond its share are refused, and the turns still reach the model (a
    real HTTP server) and finish, with no descriptor error anywhere."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the test needs 2048 descriptors of its own (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    faults = FaultServer().start()
    flood: list[socket.socket] = []
    try:
        faults.script("p", then=ok("done", delay=0.05, tool_steps=2))
        d = start(f"""
[daemon]
control_idle_timeout = 1.0

[[providers]]
name = "p"
kind = "openai"
base_url = "{faults.base_url("p")}"
model = "m"
{ECHO_TOOL}""", nofile=256)
        limits = Path(f"/proc/{d.pid}/limits").read_text()
        assert any(line.startswith("Max open files") and line.split()[3:5] == ["256", "256"]
                   for line in limits.splitlines()), limits
        turns = [d.submit(f"turn {i}")["id"] for i in range(40)]
        for _ in range(400):
            flood.append(_connect_through_backlog(d.socket))
        for _ in range(300):
            s = _connect_through_backlog(d.socket)
            with contextlib.suppress(OSError):  # refused at once: it is closed already
                s.sendall(b"GET /v1/events HTTP/1.1\r\nHost: x\r\n\r\n")
            flood.append(s)
        deadline = time.monotonic() + 60
        states: dict[str, str] = {}
        while time.monotonic() < deadline and len(states) < len(turns):
            for turn_id in turns:
                if turn_id not in states:
                    with contextlib.suppress(Exception):  # 503 while the flood holds slots
                        status, data = d.get(f"/v1/turns/{turn_id}")
                        if status == 200 and data["turn"]["state"] == "completed":
                            states[turn_id] = "completed"
            time.sleep(0.1)
        assert len(states) == len(turns), f"{len(states)} of {len(turns)} completed"
        assert faults.count("p") >= 3 * len(turns)
    finally:
        for s in flood:
            s.close()
        faults.stop()
    assert d.proc is not None and d.proc.poll() is None
    assert "Too many open files" not in d.log_text()
    assert "EMFILE" not in d.log_text()


# --- strict bodies ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bodies_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the body checks: they are all refused, so they change nothing."""
    with running(tmp_path_factory.mktemp("bodies")) as d:
        yield d


@pytest.mark.parametrize(("body", "field"), [
    (b'{"message": "m", "deadline": Infinity}', "deadline"),
    (b'{"message": "m", "deadline": NaN}', "deadline"),
    (b'{"message": "m", "deadline": 1e999}', "deadline"),
    (b'{"message": "m", "deadline": true}', "deadline"),
    (b'{"message": "m", "deadline": "5"}', "deadline"),
    (b'{"message": "m", "deadline": 1000}', "deadline"),
    (b'{"message": "m", "budget": {"max_seconds": Infinity}}', "budget.max_seconds"),
    (b'{"message": "m", "budget": {"max_cost_usd": NaN}}', "budget.max_cost_usd"),
    (b'{"message": "m", "budget": {"max_steps": "5"}}', "budget.max_steps"),
    (b'{"message": "m", "budget": {"max_steps": true}}', "budget.max_steps"),
    (b'{"message": "m", "budget": {"max_tokens": 5.5}}', "budget.max_tokens"),
    (b'{"message": "m", "budget": {"max_seconds": "5"}}', "budget.max_seconds"),
])
def test_a_number_that_is_not_a_finite_json_number_is_400_naming_the_field(
        bodies_daemon: Daemon, body: bytes, field: str) -> None:
    d = bodies_daemon
    status, data = _post_raw(d.socket, "/v1/turns", body)
    assert (status, data.get("field")) == (400, field), data


def test_a_steer_with_a_string_for_redirect_is_400(bodies_daemon: Daemon) -> None:
    d = bodies_daemon
    status, data = d.post("/v1/turns/x/messages",
                          {"kind": "steer", "text": "t", "redirect": "yes"})
    assert (status, data["field"]) == (400, "redirect")


def test_json_nested_100000_deep_is_400(bodies_daemon: Daemon) -> None:
    d = bodies_daemon
    status, data = _post_raw(d.socket, "/v1/turns", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400, data
    status, data = _post_raw(d.socket, "/v1/turns",
                             b'{"message": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert status == 400, data


def test_a_client_leaving_mid_body_writes_no_traceback(start: Any) -> None:
    d = start()
    with _raw(d.socket) as s:
        s.sendall(b"POST /v1/turns HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"message\": \"half")
    deadline = time.monotonic() + 10
    while "control.client_left" not in d.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "control.client_left" in d.log_text()
    assert d.get("/v1/status")[0] == 200
    assert "Traceback" not in d.log_text()
    for line in d.log_text().splitlines():
        json.loads(line)  # every line is JSON, aiohttp's included


def test_a_message_over_max_message_bytes_is_413_naming_the_field(start: Any) -> None:
    d = start("[daemon]\nmax_message_bytes = 1000\n")
    status, data = d.post("/v1/turns", {"message": "é" * 501})  # 1002 bytes
    assert (status, data["field"]) == (413, "message")
    status, data = d.post("/v1/turns/x/messages", {"kind": "steer", "text": "x" * 1001})
    assert (status, data["field"]) == (413, "text")




def test_steers_beyond_max_pending_messages_are_429_naming_the_limit(
        start: Any, tmp_path: Path) -> None:
    script = script_file(tmp_path / "slow.toml", """
[[scenarios]]
[[scenarios.steps]]
delay = 30.0
reply = "slow"
""")
    d = start(scripted_provider(script) + "[daemon]\nmax_pending_messages = 3\n")
    turn = d.submit("a long step")["id"]
    accepted = [d.post(f"/v1/turns/{turn}/messages", {"kind": "steer", "text": f"s{i}"})[0]
                for i in range(3)]
    assert accepted == [202, 202, 202]
    status, data = d.post(f"/v1/turns/{turn}/messages", {"kind": "steer", "text": "s3"})
    assert (status, data["field"]) == (429, "max_pending_messages"), data
    assert "3 messages" in data["error"]
    assert len(d.get(f"/v1/turns/{turn}")[1]["turn"]["inbox"]) == 3
