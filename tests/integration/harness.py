"""Start the real daemon as a subprocess on a temporary socket and talk to it over HTTP.

Nothing here mocks the daemon: it is `python -m turnkeeper serve` with a real config
file, a real SQLite file and a real Unix socket, stopped with real signals.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import socket as socket_mod
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from turnkeeper.control.client import Client

READY_TIMEOUT_S = 15.0

# Variables the test runner's own environment must not leak into the daemon: a stray
# NOTIFY_SOCKET would send our READY=1 to the runner's systemd, a JOURNAL_STREAM would put a
# `<N>` prefix on the JSON log lines.
SYSTEMD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS",
               "LISTEN_FDNAMES", "JOURNAL_STREAM")

# Run before the daemon in its own process, then exec'd over (same pid): moves a socket
# handed over with pass_fds to fd 3 (SD_LISTEN_FDS_START) and sets the variables named in
# _TK_PID_ENV to the process's own pid, as systemd sets LISTEN_PID and WATCHDOG_PID.
_EXEC_SHIM = """
import os, sys
fd = int(os.environ.pop("_TK_FD", "-1"))
if fd >= 0 and fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
for name in filter(None, os.environ.pop("_TK_PID_ENV", "").split(",")):
    os.environ[name] = str(os.getpid())
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


# A config file must name its providers (the demo runs only without a file): a test's
# config that names none runs on the offline scripted provider, said so explicitly.
OFFLINE_PROVIDER = '[[providers]]\nname = "scripted"\nkind = "scripted"\n'


def names_providers(text: str) -> bool:
    return "[[providers]]" in text or re.search(r"^\s*providers\s*=", text, re.M) is not None


def write_config(path: Path, body: str, *, socket: Path, state_dir: Path) -> Path:
    """A config file: the [daemon] paths first, then the test's own TOML (and the offline
    provider when it names none)."""
    text = textwrap.dedent(body).strip("\n")
    if not names_providers(text):
        text = f"{text}\n\n{OFFLINE_PROVIDER}"
    daemon_extra = ""
    if "[daemon]" in text:
        # Merge the test's [daemon] keys under ours.
        head, _, rest = text.partition("[daemon]")
        lines = rest.split("\n")
        keys = []
        while lines and not lines[0].lstrip().startswith("["):
            keys.append(lines.pop(0))
        daemon_extra = "\n".join(keys)
        text = head + "\n".join(lines)
    path.write_text(
        f'[daemon]\nsocket = "{socket}"\nstate_dir = "{state_dir}"\nlog_format = "json"\n'
        f"{daemon_extra}\n\n{text}\n")
    return path


class Daemon:
    """One daemon process. `start()` waits until the socket answers /v1/status."""

    def __init__(self, tmp: Path, config: str = "", *, env: dict[str, str] | None = None,
                 name: str = "d", socket: Path | None = None,
                 pid_env: tuple[str, ...] = (), listen_fd: int | None = None,
                 nofile: int | None = None, wrapper: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = socket or self.dir / "run" / "control.sock"
        self.state_dir = self.dir / "state"
        self.config_path = self.dir / "turnkeeper.toml"
        self.log_path = self.dir / "daemon.log"
        self.env_extra = env or {}
        self.pid_env = pid_env
        self.listen_fd = listen_fd
        self.nofile = nofile  # RLIMIT_NOFILE of the daemon process, when set
        self.wrapper = wrapper  # a command the daemon runs under (a profiler), or none
        self.proc: subprocess.Popen[bytes] | None = None
        self.set_config(config)
        self.client = Client(self.socket, timeout=30.0)

    def set_config(self, body: str) -> None:
        write_config(self.config_path, body, socket=self.socket, state_dir=self.state_dir)

    def change_policy(self) -> None:
        """Make the next reload a new policy version. A reload of the policy that runs
        already drains nothing and makes no new version, so a test of what a reload does
        changes something first: `[daemon] body_read_timeout`, which these tests do not
        watch, one second more each time. Written whole and renamed over the file."""
        text = self.config_path.read_text()
        found = re.search(r"^body_read_timeout = (\d+)\.0\n", text, flags=re.M)
        seconds = int(found.group(1)) + 1 if found else 11
        if found:
            text = text.replace(found.group(0), "")
        text = text.replace("[daemon]\n", f"[daemon]\nbody_read_timeout = {seconds}.0\n", 1)
        tmp = self.config_path.with_name(self.config_path.name + ".next")
        tmp.write_text(text)
        os.replace(tmp, self.config_path)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
        for name in SYSTEMD_ENV:
            env.pop(name, None)
        env.update(self.env_extra)
        return env

    def start(self, *, wait: bool = True) -> Daemon:
        """Start `python -m turnkeeper serve`. With `pid_env` or `listen_fd`, through a shim
        that execs the daemon in its own process, so the pid it sees is the daemon's."""
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        cmd = [*self.wrapper, sys.executable, "-m", "turnkeeper", "serve", "--config",
               str(self.config_path)]
        env = self.env()
        pass_fds: tuple[int, ...] = ()
        if self.pid_env or self.listen_fd is not None:
            at = len(self.wrapper) + 1
            cmd[at:at] = ["-c", _EXEC_SHIM]
            env["_TK_PID_ENV"] = ",".join(self.pid_env)
            if self.listen_fd is not None:
                env["_TK_FD"] = str(self.listen_fd)
                pass_fds = (self.listen_fd,)
        nofile = self.nofile

        def limit() -> None:  # in the child, before exec
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     env=env, cwd=self.dir, pass_fds=pass_fds,
                                     preexec_fn=limit if nofile is not None else None)
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n"
                                     f"{self.log_text()[-4000:]}")
            with contextlib.suppress(Exception):
                status, data = self.client.request("GET", "/v1/status", timeout=2)
                if status == 200 and data["state"] == "ready":
                    return
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready in {timeout} s:\n{self.log_text()[-4000:]}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
        return out

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("daemon did not stop within "
                                 f"{timeout} s:\n{self.log_text()[-4000:]}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    # -- API helpers ------------------------------------------------------------------

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return self.client.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return self.client.request("POST", path, body, **kw)

    def submit(self, message: str, **fields: Any) -> dict[str, Any]:
        status, data = self.post("/v1/turns", {"message": message, **fields})
        assert status == 202, (status, data)
        return data["turn"]  # type: ignore[no-any-return]

    def wait_state(self, turn_id: str, state: str, timeout: float = 15.0) -> dict[str, Any]:
        """The turn once it is in `state`, polled (a deadline only fails a test that would
        otherwise hang)."""
        deadline = time.monotonic() + timeout
        while True:
            code, data = self.get(f"/v1/turns/{turn_id}")
            assert code == 200, data
            if data["turn"]["state"] == state:
                return data["turn"]  # type: ignore[no-any-return]
            assert time.monotonic() < deadline, \
                f"turn {turn_id} not {state} in {timeout} s: {data['turn']}"
            time.sleep(0.02)

    def wait(self, turn_id: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            status, data = self.get(f"/v1/turns/{turn_id}?wait={max(0.1, min(left, 10)):.2f}",
                                    timeout=left + 15)
            assert status == 200, (status, data)
            turn = data["turn"]
            if turn.get("result") is not None:
                return turn  # type: ignore[no-any-return]
            if time.monotonic() >= deadline:
                raise AssertionError(f"turn {turn_id} not finished in {timeout} s: {turn}")

    def run(self, message: str, timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        return self.wait(self.submit(message, **fields)["id"], timeout)

    def events(self, turn_id: str) -> list[dict[str, Any]]:
        return list(self.client.stream(f"/v1/turns/{turn_id}/events"))


def post_raw(sock_path: Path, path: str, body: Any,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """A POST sent byte by byte, with `headers` of the test's own (the harness's client
    sends none) and its answer's headers (the client keeps only the status)."""
    payload = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(str(sock_path))
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n{extra}"
                  f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                  .encode() + payload)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    answer_headers = {k.strip().lower(): v.strip()
                      for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), answer_headers, json.loads(rest) if rest else None


def wait_until(pred: Callable[[], Any], timeout: float = 15.0, what: str = "condition",
               every: float = 0.02) -> Any:
    """Poll `pred` until it gives something true, and return that; the deadline only turns
    a hang into a failure, it measures nothing."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def accepted_connections(d: Daemon) -> int:
    """Connections the daemon has accepted on its control socket and not yet closed (in
    /proc/net/unix an accepted socket carries the listener's path, in state 03; one
    still in the listen backlog has no inode yet)."""
    path = str(d.socket)
    count = 0
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == path and fields[5] == "03" \
                    and fields[6] != "0":
                count += 1
    return count


@contextlib.contextmanager
def running(tmp: Path, config: str = "", **kw: Any) -> Iterator[Daemon]:
    d = Daemon(tmp, config, **kw).start()
    try:
        yield d
    finally:
        d.kill()


ECHO_TOOL = """
[[tools]]
name = "echo"
kind = "echo"
description = "echo"
idempotent = true
"""


def scripted_provider(script: Path, *, name: str = "scripted", extra: str = "") -> str:
    """A `[[providers]]` table for the scripted provider reading `script`; `extra` adds
    keys to it. Tests put it (and usually ECHO_TOOL) after their own sections."""
    return f'\n[[providers]]\nname = "{name}"\nkind = "scripted"\nscript = "{script}"\n{extra}'


def script_file(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body).strip() + "\n")
    return path


class NotifyListener:
    """A real sd_notify endpoint: an AF_UNIX datagram socket the daemon gets as
    NOTIFY_SOCKET. A thread receives every datagram with its arrival time (monotonic)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._receive, name="notify listener",
                                        daemon=True)
        self._thread.start()

    @property
    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": str(self.path)}

    def _receive(self) -> None:
        while not self._closed:
            try:
                raw = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            at = time.monotonic()
            fields = dict(line.split("=", 1) for line in raw.decode().split("\n") if line)
            with self._cond:
                self.messages.append((at, fields))
                self._cond.notify_all()

    def snapshot(self, *, pings: bool = False) -> list[dict[str, str]]:
        """Every message so far; watchdog pings only when `pings`."""
        with self._cond:
            return [m for _, m in self.messages if pings or "WATCHDOG" not in m]

    def wait_for(self, pred: Callable[[dict[str, str]], bool], timeout: float = 15.0,
                 *, after: int = 0) -> tuple[int, float, dict[str, str]]:
        """The first message at index >= `after` that `pred` accepts: (index, time, fields)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i in range(after, len(self.messages)):
                    at, fields = self.messages[i]
                    if pred(fields):
                        return i, at, fields
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no such notify message in {timeout} s; got "
                                         f"{[m for _, m in self.messages][-20:]}")
                self._cond.wait(left)

    def close(self) -> None:
        self._closed = True
        self._thread.join(2)
        self.sock.close()
