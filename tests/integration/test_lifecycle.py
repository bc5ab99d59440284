"""Lifecycle: start, reload, stop and the watchdog as systemd sees them,
socket activation, every reload trigger, drains, parked turns, and reload under load.

Every test runs the real daemon; systemd is played by a real AF_UNIX datagram socket
handed to the daemon as NOTIFY_SOCKET (`NotifyListener`), signals are real signals, and
config changes are real file writes seen by the daemon's own watcher.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.fault_server import FaultServer, ok
from tests.integration.harness import (
    ECHO_TOOL,
    Daemon,
    NotifyListener,
    accepted_connections,
    script_file,
    scripted_provider,
    wait_until,
    write_config,
)
from tests.integration.test_observability import scrape, value
from turnkeeper.control.client import Client

SCRIPT = """
[[scenarios]]
match = "ASKLATE"
[[scenarios.steps]]
delay = 0.5
tool_calls = [{ name = "clarify", arguments = { question = "later: which colour for $message?" } }]
[[scenarios.steps]]
reply = "late answer: $last_tool_result"

[[scenarios]]
match = "ASKNOW"
[[scenarios.steps]]
tool_calls = [{ name = "clarify", arguments = { question = "which colour for $message?" } }]
[[scenarios.steps]]
delay = 0.3
reply = "answered: $last_tool_result"

[[scenarios]]
match = "HOLD"
[[scenarios.steps]]
delay = 2.0
reply = "held"

[[scenarios]]
match = "SLOW"
[[scenarios.steps]]
delay = 0.6
tool_calls = [{ name = "echo", arguments = { text = "working" } }]
[[scenarios.steps]]
delay = 0.6
reply = "slow done: $message"

[[scenarios]]
match = "OUTAGE"
[[scenarios.steps]]
fail = [{ status = 503, forever = true }]
reply = "never"

[[scenarios]]
[[scenarios.steps]]
delay = 0.02
reply = "answer to: $message"
"""


def scripted(tmp: Path, *, daemon: str = "", provider: str = "scripted", extra: str = "",
             script: str = SCRIPT, watch: bool = False) -> str:
    """A config with one scripted provider (the script written once) and the echo tool.
    The file watcher is off unless `watch`: these tests trigger reloads themselves."""
    path = tmp / "script.toml"
    if not path.exists():
        script_file(path, script)
    return f"""
[daemon]
watch_config = {"true" if watch else "false"}
{daemon}

[retry]
base_delay = 0.01
max_delay = 0.05

""" + scripted_provider(path, name=provider) + ECHO_TOOL + extra


def rewrite(d: Daemon, body: str) -> bytes:
    """Replace the config file as editors do (write a new file, rename it over the old one).
    Returns the new content."""
    nxt = write_config(d.dir / "next.toml.tmp", body, socket=d.socket, state_dir=d.state_dir)
    data = nxt.read_bytes()
    os.replace(nxt, d.config_path)
    return data


def replace_file(path: Path, data: bytes) -> None:
    """Exactly these bytes, atomically: the watcher never sees a file being written (an
    empty file, mid-write, is a valid config of defaults)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_in_place(path: Path, data: bytes) -> None:
    """Overwrite the file's bytes in place, in one write, without truncating it first."""
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate()


@pytest.fixture
def notify() -> Iterator[NotifyListener]:
    # AF_UNIX paths are short (108 bytes): not under pytest's long tmp_path.
    where = Path(tempfile.mkdtemp(prefix="tk-notify-", dir="/tmp"))
    listener = NotifyListener(where / "notify.sock")
    yield listener
    listener.close()
    shutil.rmtree(where, ignore_errors=True)


def states(listener: NotifyListener, after: int = 0) -> list[dict[str, str]]:
    """The messages that change what systemd thinks of the daemon: watchdog pings and
    STATUS=-only updates left out."""
    with listener._cond:
        messages = [m for _, m in listener.messages[after:]]
    return [m for m in messages if "WATCHDOG" not in m and set(m) != {"STATUS"}]


def settled(listener: NotifyListener, last: str, after: int) -> list[dict[str, str]]:
    """`states` once the message with key `last` has arrived (the listener's thread may
    lag behind the daemon, which sent it before answering or exiting)."""
    listener.wait_for(lambda m: last in m, after=after)
    return states(listener, after)


def keys(messages: list[dict[str, str]]) -> list[str]:
    return ["+".join(k for k in m if k not in ("STATUS", "MONOTONIC_USEC")) for m in messages]


def is_ready(m: dict[str, str]) -> bool:
    return m.get("READY") == "1"


def status_of(d: Daemon) -> dict[str, Any]:
    code, data = d.get("/v1/status")
    assert code == 200, data
    return data  # type: ignore[no-any-return]


def wait_daemon_state(d: Daemon, state: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while status_of(d)["state"] != state:
        if time.monotonic() > deadline:
            raise AssertionError(f"daemon not {state} in {timeout} s")
        time.sleep(0.01)


def records(d: Daemon, event: str) -> list[dict[str, Any]]:
    return [r for r in d.log_records() if r.get("event") == event]


# A drain_timeout (or a wait) no test lasts: a reload that comes back at all ended its
# drain because the turns were suspended, not because the time ran out.
AN_HOUR = 3600.0


def reload_cut_short(d: Daemon) -> None:
    """POST /v1/reload, which must come back (within a deadline that only guards a hang)
    with its drain ended by the turns, never by its drain_timeout."""
    code, data = d.post("/v1/reload", timeout=60)
    assert code == 200, data
    assert not records(d, "daemon.drain_timeout")


def exit_code(d: Daemon, timeout: float = 30.0) -> int:
    assert d.proc is not None
    return d.proc.wait(timeout)


class EventTap:
    """Every event of the daemon, in order, from GET /v1/events over a raw socket we can
    close when done."""

    def __init__(self, d: Daemon) -> None:
        self.events: list[dict[str, Any]] = []
        # The daemon ended the stream itself (its last, empty chunk came), rather than the
        # connection being dropped under it.
        self.ended_by_daemon = False
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(d.socket))
        self.sock.sendall(b"GET /v1/events HTTP/1.1\r\nHost: turnkeeper\r\n\r\n")
        self._thread = threading.Thread(target=self._read, daemon=True, name="event tap")
        self._thread.start()

    def _read(self) -> None:
        f = self.sock.makefile("rb")
        with contextlib.suppress(OSError, ValueError):
            while f.readline() not in (b"\r\n", b""):  # the headers
                pass
            while True:
                size_line = f.readline()  # chunked transfer encoding
                if not size_line:
                    return
                size = int(size_line.strip() or b"0", 16)
                if size == 0:
                    self.ended_by_daemon = True
                    return
                chunk = f.read(size)
                f.readline()
                for line in chunk.splitlines():
                    if line.strip():
                        self.events.append(json.loads(line))

    def wait_for(self, type_: str, turn: str | None = None, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(e["type"] == type_ and (turn is None or e.get("turn") == turn)
                      for e in list(self.events)):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {type_} event in {timeout} s")
            time.sleep(0.01)

    def close(self) -> list[dict[str, Any]]:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)
        return sorted(self.events, key=lambda e: e["seq"])


# -- systemd notify: the exact messages ---------------------------------------------------


def test_start_sends_ready_with_status_once_the_socket_answers(
        start: Any, notify: NotifyListener) -> None:
    d = start(env=notify.env, wait=False)
    _, _, ready = notify.wait_for(is_ready)
    # READY=1 comes only when the control socket answers: ask at once, without retrying.
    assert Client(d.socket, timeout=5).request("GET", "/v1/status")[0] == 200
    d.wait_ready()
    assert ready["STATUS"] == "ready; 0 running, 0 queued; policy v1"
    assert states(notify) == [ready]  # one message, nothing before it


def test_reload_sends_reloading_with_monotonic_usec_then_ready(
        start: Any, notify: NotifyListener) -> None:
    d = start(env=notify.env)
    notify.wait_for(is_ready)
    mark = len(notify.messages)
    before_us = time.monotonic_ns() // 1000
    d.change_policy()
    d.signal(signal.SIGHUP)
    notify.wait_for(is_ready, after=mark)
    after_us = time.monotonic_ns() // 1000
    got = states(notify, mark)
    assert keys(got) == ["RELOADING", "READY"], got
    reloading, ready = got
    # CLOCK_MONOTONIC is one clock for the whole machine: the value is from the reload.
    assert before_us <= int(reloading["MONOTONIC_USEC"]) <= after_us
    assert reloading["STATUS"].startswith("reloading; ")
    assert ready["STATUS"] == "ready; 0 running, 0 queued; policy v2"
    assert status_of(d)["policy_version"] == 2


def test_a_reload_of_the_running_policy_makes_no_new_version(
        start: Any, notify: NotifyListener, tmp_path: Path) -> None:
    """The file saved with only a comment added, then `turnkeeper reload`: systemd still
    hears RELOADING=1 then READY=1 (its reload waits for both), but nothing drains (a
    running turn finishes under v1 and is not waited for) and there is no v2."""
    d = start(scripted(tmp_path, daemon="drain_timeout = 10.0"), env=notify.env)
    notify.wait_for(is_ready)
    turn = d.submit("SLOW not drained")
    d.wait_state(turn["id"], "running")
    d.config_path.write_text(d.config_path.read_text() + "\n# a comment is no policy\n")
    mark = len(notify.messages)
    out = subprocess.run([sys.executable, "-m", "turnkeeper", "reload", "--socket",
                          str(d.socket)], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("reloaded: policy v1 unchanged (the file gives the "
                                  "running policy: no new version)")
    # Answered without draining: the slow turn is still on its first step.
    assert d.get(f"/v1/turns/{turn['id']}")[1]["turn"]["state"] == "running"
    assert keys(settled(notify, "READY", mark)) == ["RELOADING", "READY"]
    st = status_of(d)
    assert st["policy_version"] == 1
    assert st["reloads"] == {"count": 0, "failures": 0, "unchanged": 1}
    reloaded = records(d, "daemon.reload_unchanged")
    assert len(reloaded) == 1 and reloaded[0]["policy_version"] == 1
    assert d.wait(turn["id"])["policy_version"] == 1
    # A change after that is v2, as always.
    d.change_policy()
    code, data = d.post("/v1/reload")
    assert code == 200 and data["policy_version"] == 2 and data["unchanged"] is False


def test_failed_reload_sends_only_status_with_the_error_and_keeps_the_policy(
        start: Any, notify: NotifyListener) -> None:
    d = start("[daemon]\nwatch_config = false\n", env=notify.env)
    notify.wait_for(is_ready)
    mark = len(notify.messages)
    d.set_config("[daemon]\nwatch_config = false\n[budget]\nmax_tokens = -5\n")
    code, data = d.post("/v1/reload")
    assert code == 422, data
    assert "budget.max_tokens" in data["error"] and data["policy_version"] == 1
    _, _, msg = notify.wait_for(lambda m: "STATUS" in m, after=mark)
    assert set(msg) == {"STATUS"}  # no RELOADING=1, no READY=1: nothing was reloaded
    assert "policy v1" in msg["STATUS"] and "budget.max_tokens" in msg["STATUS"]
    assert "\n" not in msg["STATUS"]
    time.sleep(0.3)  # an absence: nothing else follows it (no state was left behind)
    assert states(notify, mark) == []
    st = status_of(d)
    assert st["state"] == "ready" and st["policy_version"] == 1
    assert "budget.max_tokens" in st["last_reload_error"]
    assert d.run("still serving")["state"] == "completed"


def test_stop_sends_stopping_then_exits_0(start: Any, notify: NotifyListener) -> None:
    d = start(env=notify.env)
    notify.wait_for(is_ready)
    mark = len(notify.messages)
    d.signal(signal.SIGTERM)
    assert exit_code(d) == 0
    got = settled(notify, "STOPPING", mark)
    assert keys(got) == ["STOPPING"], got
    assert got[0]["STATUS"].startswith("stopping; ")


def test_watchdog_pings_every_half_interval_from_the_daemon_itself(
        start: Any, notify: NotifyListener) -> None:
    # WATCHDOG_PID names the daemon's own pid, as systemd sets it.
    d = start(env={**notify.env, "WATCHDOG_USEC": "600000"}, pid_env=("WATCHDOG_PID",))
    first, _, _ = notify.wait_for(lambda m: m.get("WATCHDOG") == "1")

    def pings() -> list[float]:
        with notify._cond:
            return [at for at, m in notify.messages[first:] if m.get("WATCHDOG") == "1"]

    wait_until(lambda: len(pings()) >= 6, what="6 pings")
    gaps = [b - a for a, b in itertools.pairwise(pings()[:6])]
    # Half the 0.6 s interval: never much sooner (a sleep does not end early; the listener
    # may read one ping late and the next on time), and closer to half than to the whole
    # interval: 0.15 s of slack either way, room for a busy machine's late wake-ups.
    assert 0.24 <= statistics.median(gaps) < 0.45, gaps
    assert d.get("/v1/status")[0] == 200


def test_watchdog_of_another_pid_is_not_ours(start: Any, notify: NotifyListener) -> None:
    start(env={**notify.env, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"})
    notify.wait_for(is_ready)
    time.sleep(0.4)  # an absence: two periods and not one ping
    assert not [m for m in notify.snapshot(pings=True) if "WATCHDOG" in m]


def test_a_long_drain_asks_systemd_for_more_time(start: Any, notify: NotifyListener,
                                                 tmp_path: Path) -> None:
    d = start(scripted(tmp_path, daemon="drain_timeout = 10.0"), env=notify.env)
    notify.wait_for(is_ready)
    turn = d.submit("SLOW one")
    d.wait_state(turn["id"], "running")
    mark = len(notify.messages)
    d.change_policy()
    code, data = d.post("/v1/reload")
    assert code == 200, data
    got = settled(notify, "READY", mark)
    assert keys(got) == ["RELOADING", "EXTEND_TIMEOUT_USEC", "READY"], got
    assert int(got[1]["EXTEND_TIMEOUT_USEC"]) == 15_000_000
    # The turn finished under the policy it started with: the drain waited for it.
    done = d.wait(turn["id"])
    assert done["state"] == "completed" and done["policy_version"] == 1
    # A stop that drains asks too.
    second = d.submit("SLOW two")
    d.wait_state(second["id"], "running")
    mark = len(notify.messages)
    d.signal(signal.SIGTERM)
    assert exit_code(d) == 0
    assert keys(settled(notify, "EXTEND_TIMEOUT_USEC", mark)) == ["STOPPING",
                                                                  "EXTEND_TIMEOUT_USEC"]


def test_invalid_config_at_start_exits_78_and_says_why_in_status(
        start: Any, notify: NotifyListener) -> None:
    d = start("[budget]\nmax_steps = 0\n", env=notify.env, wait=False)
    assert exit_code(d) == 78
    notify.wait_for(lambda m: "STATUS" in m)
    got = notify.snapshot()
    assert [set(m) for m in got] == [{"STATUS"}], got
    assert got[0]["STATUS"].startswith("failed: ") and "budget.max_steps" in got[0]["STATUS"]
    assert "budget.max_steps" in d.log_text()


# -- socket activation ------------------------------------------------------------------


def test_listen_fds_hands_over_a_bound_socket(start: Any, notify: NotifyListener) -> None:
    where = Path(tempfile.mkdtemp(prefix="tk-sock-", dir="/tmp"))
    try:
        os.chmod(where, 0o750)
        path = where / "control.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(16)
        inode = path.stat().st_ino
        # As with systemd: a client connects before the daemon runs; it waits, not fails.
        early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        early.settimeout(20)
        early.connect(str(path))
        early.sendall(b"GET /v1/status HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        env = {**notify.env, "LISTEN_FDS": "1", "LISTEN_FDNAMES": "control"}
        d = start(env=env, socket=path, pid_env=("LISTEN_PID",),
                  listen_fd=listener.fileno())
        notify.wait_for(is_ready)
        reply = b""
        while chunk := early.recv(65536):
            reply += chunk
        early.close()
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        assert b'"state":"ready"' in reply.replace(b" ", b"")
        assert path.stat().st_ino == inode  # taken over, not bound again
        assert any(r.get("event") == "control.listening"
                   and "socket activation" in str(r.get("socket")) for r in d.log_records())
        assert d.run("over an inherited socket")["state"] == "completed"
        d.signal(signal.SIGTERM)
        assert exit_code(d) == 0
        # The socket is systemd's: still there, and the next daemon takes it over again.
        assert path.exists() and path.stat().st_ino == inode
        d.start()
        assert d.get("/v1/status")[1]["state"] == "ready"
        listener.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)


# -- reload triggers ----------------------------------------------------------------------


def test_saving_the_config_file_reloads_it_once_per_content_change(
        start: Any, notify: NotifyListener) -> None:
    d = start("[daemon]\nmax_queued_turns = 100\n", env=notify.env)
    notify.wait_for(is_ready)
    mark = len(notify.messages)
    rewrite(d, "[daemon]\nmax_queued_turns = 7\n")  # as an editor saves: rename over
    notify.wait_for(is_ready, after=mark)
    st = status_of(d)
    assert st["policy_version"] == 2 and st["queue"]["max"] == 7
    assert [r["trigger"] for r in records(d, "daemon.reloaded")] == ["config file changed"]
    # The same bytes again, a touch, a write in place of identical content: no reload.
    rewrite(d, "[daemon]\nmax_queued_turns = 7\n")
    os.utime(d.config_path)
    write_in_place(d.config_path, d.config_path.read_bytes())
    # A change written in place (not renamed) is seen too.
    write_in_place(d.config_path, d.config_path.read_bytes().replace(b"= 7", b"= 9"))
    notify.wait_for(lambda m: is_ready(m) and "policy v3" in m["STATUS"], after=mark)
    time.sleep(0.5)  # an absence: the touch and the identical writes bring no reload
    assert status_of(d)["policy_version"] == 3
    assert keys(states(notify, mark)) == ["RELOADING", "READY", "RELOADING", "READY"]


def test_a_kubernetes_configmap_update_reloads_it(daemons: list[Daemon], tmp_path: Path,
                                                  notify: NotifyListener) -> None:
    """A ConfigMap volume: turnkeeper.toml -> ..data/turnkeeper.toml, ..data -> a
    timestamped directory; an update writes a new directory and swaps ..data atomically."""
    d = Daemon(tmp_path, env=notify.env)
    daemons.append(d)
    volume = d.dir / "configmap"

    def publish(stamp: str, body: str) -> None:
        target = volume / f"..{stamp}"
        target.mkdir(parents=True)
        write_config(target / "turnkeeper.toml", body, socket=d.socket, state_dir=d.state_dir)
        (volume / "..data_tmp").symlink_to(target.name)
        os.replace(volume / "..data_tmp", volume / "..data")

    publish("2026_01_01", "[daemon]\nmax_queued_turns = 21\n")
    (volume / "turnkeeper.toml").symlink_to("..data/turnkeeper.toml")
    d.config_path = volume / "turnkeeper.toml"
    mark = len(notify.messages)
    d.start()
    notify.wait_for(is_ready, after=mark)
    assert status_of(d)["queue"]["max"] == 21
    mark = len(notify.messages)
    publish("2026_01_02", "[daemon]\nmax_queued_turns = 22\n")
    notify.wait_for(is_ready, after=mark)
    st = status_of(d)
    assert st["queue"]["max"] == 22 and st["policy_version"] == 2
    assert records(d, "daemon.reloaded")[-1]["trigger"] == "config file changed"


def test_a_sighup_with_the_new_file_is_not_followed_by_a_watcher_reload(
        start: Any, notify: NotifyListener) -> None:
    d = start("[daemon]\nmax_queued_turns = 100\n", env=notify.env)
    notify.wait_for(is_ready)
    # The watcher starts with READY=1 and first compares the file with the policy at once
    # (a change made before it watched has no event): let that pass, so that the SIGHUP
    # comes first, as it does when an operator saves the file and runs systemctl reload.
    # (That first comparison shows nothing outside: this wait is the one way to let it pass.)
    time.sleep(0.5)
    rewrite(d, "[daemon]\nmax_queued_turns = 8\n")
    d.signal(signal.SIGHUP)  # systemctl reload right after saving: one reload, not two
    notify.wait_for(lambda m: is_ready(m) and "policy v2" in m["STATUS"])
    time.sleep(0.6)  # an absence: the watcher has seen the change and reloads nothing
    assert status_of(d)["policy_version"] == 2
    assert len(records(d, "daemon.reloaded")) == 1


def test_turnkeeper_reload_waits_and_exits_nonzero_with_the_error(start: Any,
                                                                 tmp_path: Path) -> None:
    d = start(scripted(tmp_path, daemon="drain_timeout = 10.0"))
    cli = [sys.executable, "-m", "turnkeeper", "reload", "--socket", str(d.socket)]
    turn = d.submit("SLOW under reload")
    d.wait_state(turn["id"], "running")
    d.change_policy()
    t0 = time.monotonic()
    out = subprocess.run(cli, capture_output=True, text=True, timeout=30, check=False)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "reloaded: policy v2"
    # Synchronous: it came back after the drain, when the slow turn had finished.
    assert d.get(f"/v1/turns/{turn['id']}")[1]["turn"]["state"] == "completed"
    assert took >= 0.5
    d.change_policy()
    out = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 0 and json.loads(out.stdout)["policy_version"] == 3
    d.set_config(scripted(tmp_path, daemon="drain_timeout = 10.0",
                          extra="[agent]\nmax_restartz = 2\n"))
    out = subprocess.run(cli, capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 78, out
    assert "agent.max_restartz: unknown key" in out.stderr
    assert status_of(d)["policy_version"] == 3


def test_a_config_file_without_providers_never_runs_the_demo_provider(start: Any) -> None:
    """A file that names no [[providers]] (half-written, or written to change a limit) is
    refused: a reload keeps the real provider, and a start with it exits 78."""
    model = FaultServer().start()
    try:
        model.script("real", then=ok("from the real model"))
        d = start(f'''
[[providers]]
name = "real"
kind = "openai"
base_url = "{model.base_url("real")}"
model = "m"
api_key_env = ""
stream = false
''')
        assert d.run("before")["result"]["answer"] == "from the real model"
        partial = (f'[daemon]\nsocket = "{d.socket}"\nstate_dir = "{d.state_dir}"\n'
                   'log_format = "json"\n\n[budget]\nmax_steps = 9\n')
        replace_file(d.config_path, partial.encode())
        code, data = d.post("/v1/reload")
        assert code == 422, data
        assert "no [[providers]]" in data["error"] and 'kind = "scripted"' in data["error"]
        st = status_of(d)
        assert st["policy_version"] == 1 and "no [[providers]]" in st["last_reload_error"]
        after = d.run("after the refused reload")
        assert after["state"] == "completed", after["result"]
        assert after["result"]["answer"] == "from the real model"
        assert after["provider"] == "real" and len(model.requests("real")) == 2
        out = subprocess.run([sys.executable, "-m", "turnkeeper", "serve", "--config",
                              str(d.config_path)], capture_output=True, text=True,
                             timeout=30, check=False)
        assert out.returncode == 78, out.stderr
        assert "no [[providers]]" in out.stderr
    finally:
        model.stop()


def test_a_reload_reads_the_scripted_providers_script_again(start: Any,
                                                             tmp_path: Path) -> None:
    script = tmp_path / "versions.toml"
    version = '[[scenarios]]\n[[scenarios.steps]]\nreply = "{}"\n'
    script.write_text(version.format("first version"))
    d = start(f'[[providers]]\nname = "s"\nkind = "scripted"\nscript = "{script}"\n')
    assert d.run("which version?")["result"]["answer"] == "first version"
    script.write_text(version.format("second version"))  # the config file is the same
    code, data = d.post("/v1/reload")
    assert code == 200, data
    assert d.run("which version now?")["result"]["answer"] == "second version"


def test_a_message_no_scenario_matches_fails_naming_the_message(start: Any,
                                                                tmp_path: Path) -> None:
    script = script_file(tmp_path / "two.toml", """
[[scenarios]]
match = "^weather"
[[scenarios.steps]]
reply = "sunny"

[[scenarios]]
match = "^time"
[[scenarios.steps]]
reply = "noon"
""")
    d = start(f'[[providers]]\nname = "s"\nkind = "scripted"\nscript = "{script}"\n')
    assert d.run("time?")["result"]["answer"] == "noon"
    turn = d.run("what news?")
    assert turn["state"] == "failed", turn["result"]
    assert turn["result"]["stopped_because"]["code"] == "providers.rejected"
    assert "no scenario of" in json.dumps(turn["result"])
    assert "matches the message 'what news?'" in json.dumps(turn["result"])


@pytest.mark.slow
def test_a_bad_config_file_never_replaces_the_policy(start: Any,
                                                     notify: NotifyListener) -> None:
    """Invalid, missing, half-written, empty (caught between truncation and write) or
    undecodable: whatever the trigger (the watcher, a SIGHUP, the API), the running policy
    stays, the error is in /v1/status and STATUS=, there is no RELOADING=1, and the daemon
    serves on. The good file back clears the error; it is the running policy, so it makes
    no new version."""
    d = start("[daemon]\nmax_queued_turns = 11\n\n[budget]\nmax_steps = 12\n", env=notify.env)
    notify.wait_for(is_ready)
    text = d.config_path.read_text()
    failures = 0
    damages = ("invalid", "missing", "half-written", "empty", "not-utf8")
    for version, damage in enumerate(damages, 1):
        mark = len(notify.messages)
        if damage == "invalid":
            replace_file(d.config_path, text.replace("max_steps = 12", "max_steps = 0").encode())
            expect = "budget.max_steps"
        elif damage == "missing":
            d.config_path.rename(d.dir / "moved-away.toml")
            expect = "does not exist"
        elif damage == "half-written":  # cut inside the last table header
            replace_file(d.config_path, text[: text.index("[budget]") + 4].encode())
            expect = "not valid TOML"
        elif damage == "empty":
            replace_file(d.config_path, b"")
            expect = "is empty (half-written?)"
        else:
            replace_file(d.config_path, text.encode() + b"\n# \xff\xfe\n")
            expect = "not valid TOML"
        for trigger in ("config file changed", "SIGHUP", "api"):
            if trigger == "SIGHUP":
                d.signal(signal.SIGHUP)
            elif trigger == "api":
                code, data = d.post("/v1/reload")
                assert code == 422 and expect in data["error"], data
            failures += 1
            deadline = time.monotonic() + 10
            while len(records(d, "daemon.reload_failed")) < failures:
                assert time.monotonic() < deadline, (damage, trigger)
                time.sleep(0.02)
            assert records(d, "daemon.reload_failed")[-1]["trigger"] == trigger
        st = status_of(d)
        assert st["state"] == "ready" and st["policy_version"] == 1, damage
        # Refused by three triggers, the same file is one refused config.
        assert st["reloads"]["failures"] == version, damage
        assert expect in st["last_reload_error"], damage
        assert st["queue"]["max"] == 11
        assert states(notify, mark) == [], damage  # no RELOADING=1, ever
        assert all(expect in m["STATUS"] for m in notify.snapshot()[mark:]), damage
        assert d.run(f"still serving with a {damage} file")["state"] == "completed"
        # The good file back: the watcher reloads it and the error clears; it gives the
        # running policy, so no drain and no new version (RELOADING=1, READY=1 still).
        if damage == "missing":
            (d.dir / "moved-away.toml").rename(d.config_path)
        else:
            replace_file(d.config_path, text.encode())
        notify.wait_for(is_ready, after=mark)
        st = status_of(d)
        assert st["policy_version"] == 1 and st["last_reload_error"] is None
        assert st["reloads"]["unchanged"] == version and st["reloads"]["count"] == 0


def test_socket_and_state_dir_changes_wait_for_a_restart(start: Any, tmp_path: Path) -> None:
    d = start("[daemon]\nwatch_config = false\nmax_queued_turns = 50\n")
    first = d.run("before")
    text = d.config_path.read_text()
    moved = text.replace(str(d.socket), str(tmp_path / "elsewhere.sock")).replace(
        str(d.state_dir), str(tmp_path / "elsewhere-state"))
    d.config_path.write_text(moved.replace("max_queued_turns = 50", "max_queued_turns = 5"))
    code, data = d.post("/v1/reload")
    assert code == 200, data
    assert data["pending_restart"] == ["daemon.socket", "daemon.state_dir"]
    st = status_of(d)  # still on the old socket
    assert st["pending_restart"] == ["daemon.socket", "daemon.state_dir"]
    assert st["queue"]["max"] == 5  # the rest of the file was applied
    assert not (tmp_path / "elsewhere.sock").exists()
    assert not (tmp_path / "elsewhere-state").exists()
    second = d.run("after")
    code, listed = d.get("/v1/turns")
    assert {t["id"] for t in listed["turns"]} == {first["id"], second["id"]}
    # Put the old values back: nothing is pending any more.
    d.config_path.write_text(text)
    code, data = d.post("/v1/reload")
    assert code == 200 and data["pending_restart"] == []


def test_triggers_during_a_reload_coalesce_into_one_more(start: Any, notify: NotifyListener,
                                                        tmp_path: Path) -> None:
    d = start(scripted(tmp_path, daemon="drain_timeout = 10.0"), env=notify.env)
    notify.wait_for(is_ready)
    turn = d.submit("HOLD keeps the first reload draining")
    d.wait_state(turn["id"], "running")
    mark = len(notify.messages)
    d.change_policy()
    d.signal(signal.SIGHUP)
    wait_daemon_state(d, "reloading")
    d.change_policy()  # what the triggers below ask for: one more new version
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        api = [pool.submit(d.post, "/v1/reload") for _ in range(3)]
        cli = pool.submit(subprocess.run, [sys.executable, "-m", "turnkeeper", "reload",
                                           "--socket", str(d.socket)],
                          capture_output=True, text=True, timeout=30, check=False)
        for _ in range(10):
            d.signal(signal.SIGHUP)
            time.sleep(0.01)
        answers = [f.result() for f in api]
        out = cli.result()
    # Everyone who asked during the first reload got the one reload that followed it.
    assert answers == [(200, answers[0][1])] * 3
    assert answers[0][1]["policy_version"] == 3
    assert out.returncode == 0 and "policy v3" in out.stdout
    notify.wait_for(lambda m: is_ready(m) and "policy v3" in m["STATUS"], after=mark)
    time.sleep(0.3)  # an absence: no third reload follows
    assert keys(states(notify, mark)) == ["RELOADING", "EXTEND_TIMEOUT_USEC", "READY",
                                          "RELOADING", "READY"]
    assert status_of(d)["reloads"] == {"count": 2, "failures": 0, "unchanged": 0}
    assert d.wait(turn["id"])["policy_version"] == 1


# -- drains and parked turns --------------------------------------------------------------


def test_submits_during_a_reload_are_accepted_and_start_after_the_swap(
        start: Any, tmp_path: Path) -> None:
    d = start(scripted(tmp_path, daemon="drain_timeout = 10.0"))
    tap = EventTap(d)
    slow = d.submit("SLOW draining")
    tap.wait_for("turn.queued", slow["id"])
    d.wait_state(slow["id"], "running")
    d.change_policy()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reload = pool.submit(d.post, "/v1/reload")
        wait_daemon_state(d, "reloading")
        during = [d.submit(f"during {i}") for i in range(5)]  # 202, queued
        assert all(t["state"] == "queued" for t in during)
        assert status_of(d)["turns"]["queued"] == 5
        assert reload.result()[0] == 200
    done = [d.wait(t["id"]) for t in during]
    assert all(t["state"] == "completed" and t["policy_version"] == 2 for t in done)
    assert d.wait(slow["id"])["policy_version"] == 1
    events = tap.close()
    reloaded = next(e["seq"] for e in events if e["type"] == "daemon.reloaded")
    starts = [e for e in events if e["type"] == "turn.started"
              and e["turn"] in {t["id"] for t in during}]
    assert len(starts) == 5
    assert all(e["seq"] > reloaded and e["policy_version"] == 2 for e in starts)


def test_waiting_turns_are_suspended_at_once_and_come_back_waiting_under_the_new_policy(
        start: Any, tmp_path: Path) -> None:
    d = start(scripted(tmp_path, daemon=f"drain_timeout = {AN_HOUR}"))
    turns = [d.submit(f"ASKNOW {i}") for i in range(3)]
    before = [d.wait_state(t["id"], "waiting") for t in turns]
    d.change_policy()
    reload_cut_short(d)  # not the hour's drain_timeout
    for t, was in zip(turns, before, strict=True):
        now = d.wait_state(t["id"], "waiting")
        assert now["question"] == was["question"] == f"which colour for {t['message']}?"
        assert (was["policy_version"], now["policy_version"]) == (1, 2)
    for t in turns:
        code, _ = d.post(f"/v1/turns/{t['id']}/messages", {"kind": "answer", "text": "blue"})
        assert code == 202
    for t in turns:
        done = d.wait(t["id"])
        assert done["state"] == "completed" and done["result"]["answer"] == "answered: blue"
        assert done["policy_version"] == 2
        events = d.events(t["id"])
        types = [e["type"] for e in events]
        i = types.index("turn.suspended")
        assert types[i - 1:i + 3] == ["turn.waiting", "turn.suspended", "turn.resumed",
                                      "turn.waiting"]
        assert events[i + 1]["policy_version"] == 2


def test_a_turn_that_parks_during_a_drain_is_suspended_then(start: Any,
                                                            tmp_path: Path) -> None:
    d = start(scripted(tmp_path, daemon=f"drain_timeout = {AN_HOUR}"))
    turn = d.submit("ASKLATE")
    d.wait_state(turn["id"], "running")
    d.change_policy()
    reload_cut_short(d)  # the turn asks its question 0.5 s into the drain
    back = d.wait_state(turn["id"], "waiting")
    assert back["policy_version"] == 2 and back["question"].startswith("later: ")
    d.post(f"/v1/turns/{turn['id']}/messages", {"kind": "answer", "text": "green"})
    assert d.wait(turn["id"])["result"]["answer"] == "late answer: green"


def test_an_answer_that_comes_during_the_suspension_is_not_lost(start: Any,
                                                                tmp_path: Path) -> None:
    d = start(scripted(tmp_path, daemon="drain_timeout = 10.0"))
    slow = d.submit("SLOW holds the drain open")
    asking = d.submit("ASKNOW x")
    d.wait_state(asking["id"], "waiting")
    d.change_policy()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reload = pool.submit(d.post, "/v1/reload")
        d.wait_state(asking["id"], "suspended")
        code, _ = d.post(f"/v1/turns/{asking['id']}/messages",
                         {"kind": "answer", "text": "red"})
        assert code == 202
        assert reload.result()[0] == 200
    assert d.wait(asking["id"])["result"]["answer"] == "answered: red"
    assert d.wait(slow["id"])["state"] == "completed"


def test_a_recovering_turn_is_suspended_at_once_and_keeps_its_next_attempt(
        start: Any, tmp_path: Path) -> None:
    d = start(scripted(tmp_path, daemon=f"drain_timeout = {AN_HOUR}", extra=f"""
[agent]
api_max_retries = 0
recovery_schedule = [{AN_HOUR}]
"""))
    turn = d.submit("OUTAGE")
    before = d.wait_state(turn["id"], "recovering")
    d.change_policy()
    reload_cut_short(d)
    after = d.wait_state(turn["id"], "recovering")
    assert after["policy_version"] == 2
    assert after["next_attempt_at"] == before["next_attempt_at"]
    for counter in ("provider_attempts", "fallback_hops", "recovery_cycles", "restarts"):
        assert after["counters"][counter] == before["counters"][counter]  # not counted again
    d.post(f"/v1/turns/{turn['id']}/cancel")
    assert d.wait(turn["id"])["state"] == "cancelled"
    types = [e["type"] for e in d.events(turn["id"])]
    i = types.index("turn.suspended")
    assert types[i - 1:i + 2] == ["turn.recovering", "turn.suspended", "turn.resumed"]
    after_resume = types[i + 2:]  # back in its wait, without a model call
    assert "turn.recovering" in after_resume
    assert "model.request" not in after_resume[:after_resume.index("turn.recovering")]


def test_parked_turns_do_not_hold_slots_of_max_concurrent_turns(start: Any,
                                                               tmp_path: Path) -> None:
    d = start(scripted(tmp_path, daemon="max_concurrent_turns = 2"))
    tap = EventTap(d)
    asking = [d.submit(f"ASKNOW {i}") for i in range(6)]
    for t in asking:  # all six park, though only two may run
        d.wait_state(t["id"], "waiting")
    assert d.run("new work is not blocked by them")["state"] == "completed"
    st = status_of(d)
    assert st["turns"]["waiting"] == 6 and st["turns"]["running"] == 0
    samples = scrape(d)
    assert value(samples, "turnkeeper_turns_in_flight") == 0
    assert value(samples, "turnkeeper_turns", state="waiting") == 6
    for t in asking:
        d.post(f"/v1/turns/{t['id']}/messages", {"kind": "answer", "text": "pink"})
    for t in asking:
        assert d.wait(t["id"])["result"]["answer"] == "answered: pink"
    events = tap.close()
    # Woken turns take a slot again: never more than two model calls at once.
    open_calls: set[str] = set()
    most = 0
    for e in events:
        if e["type"] == "model.request":
            open_calls.add(e["turn"])
            most = max(most, len(open_calls))
        elif e["type"] in ("model.response", "turn.finished"):
            open_calls.discard(e["turn"])
    assert most == 2


# -- stop -------------------------------------------------------------------------------


def test_sigint_stops_like_sigterm(start: Any, notify: NotifyListener, tmp_path: Path) -> None:
    d = start(scripted(tmp_path), env=notify.env)
    turn = d.submit("SLOW finishing on SIGINT")
    d.wait_state(turn["id"], "running")
    mark = len(notify.messages)
    d.signal(signal.SIGINT)
    assert exit_code(d) == 0
    assert keys(settled(notify, "EXTEND_TIMEOUT_USEC", mark)) == ["STOPPING",
                                                                  "EXTEND_TIMEOUT_USEC"]
    # The drain let it finish before the exit: nothing is left to resume.
    [finished] = records(d, "turn.finished")
    assert finished["turn"] == turn["id"] and finished["status"] == "completed"
    assert not records(d, "turn.suspended")


def test_sigterm_during_a_reload_drain_stops_and_nothing_is_lost(
        start: Any, notify: NotifyListener, tmp_path: Path) -> None:
    d = start(scripted(tmp_path, daemon="drain_timeout = 30.0\nshutdown_timeout = 0.2"),
              env=notify.env)
    turn = d.submit("SLOW across a stop")
    waiting = d.submit("ASKNOW y")
    d.wait_state(waiting["id"], "waiting")
    d.wait_state(turn["id"], "running")
    mark = len(notify.messages)
    d.change_policy()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reload = pool.submit(d.post, "/v1/reload")
        wait_daemon_state(d, "reloading")
        d.signal(signal.SIGTERM)
        assert exit_code(d, 10) == 0
        code, data = reload.result()
    assert code == 503 and data["error"] == "the daemon is stopping", (code, data)
    got = keys(settled(notify, "STOPPING", mark))
    assert got[:3] == ["RELOADING", "EXTEND_TIMEOUT_USEC", "STOPPING"], got
    assert "READY" not in got  # the reload never announced itself done
    d.start()
    done = d.wait(turn["id"])
    assert done["state"] == "completed"
    back = d.wait_state(waiting["id"], "waiting")
    assert back["question"] == "which colour for ASKNOW y?"
    d.post(f"/v1/turns/{waiting['id']}/messages", {"kind": "answer", "text": "grey"})
    assert d.wait(waiting["id"])["result"]["answer"] == "answered: grey"
    finished = [r for r in d.log_records() if r.get("event") == "turn.finished"]
    assert sorted(r["turn"] for r in finished) == sorted([turn["id"], waiting["id"]])


def test_a_second_sigint_stops_without_waiting_out_the_drain(start: Any,
                                                             tmp_path: Path) -> None:
    d = start(scripted(tmp_path, daemon="shutdown_timeout = 60.0"))
    turn = d.submit("SLOW cut short")
    d.wait_state(turn["id"], "running")
    d.signal(signal.SIGINT)
    wait_daemon_state(d, "stopping")
    d.signal(signal.SIGINT)
    assert exit_code(d, 10) == 0
    # Cut, not drained: the turn did not finish before the exit (the first SIGINT alone
    # would have let it), and it resumes at the next start.
    assert records(d, "daemon.stop_now")
    assert not records(d, "turn.finished")
    d.start()
    done = d.wait(turn["id"])
    assert done["state"] == "completed" and done["result"]["answer"].startswith("slow done")
    assert "turn.resumed" in [e["type"] for e in d.events(turn["id"])]


def test_open_streams_and_long_polls_do_not_hold_a_stop_up(start: Any,
                                                            tmp_path: Path) -> None:
    d = start(scripted(tmp_path))
    asking = d.submit("ASKNOW z")
    d.wait_state(asking["id"], "waiting")
    everything = EventTap(d)  # GET /v1/events
    wait_until(lambda: accepted_connections(d) == 1, what="only the tap's connection open")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        poll = pool.submit(d.get, f"/v1/turns/{asking['id']}?wait=600", timeout=60)
        follow = pool.submit(d.events, asking["id"])  # a turn's stream, not finished
        wait_until(lambda: accepted_connections(d) == 3, what="both requests accepted")
        d.signal(signal.SIGTERM)
        assert exit_code(d) == 0
        # Answered by the daemon, with the turn as it was left: a long poll the stop left
        # to the server's own shutdown would have been cut, with no answer at all.
        code, data = poll.result(5)
        assert code == 200 and data["turn"]["state"] == "suspended"
        assert follow.result(5)[-1]["type"] == "turn.suspended"
    everything._thread.join(5)
    assert everything.ended_by_daemon  # its last chunk, not a connection dropped under it
    types = [e["type"] for e in everything.close()]
    assert types == ["daemon.stopping", "turn.suspended"]


# -- reload under load --------------------------------------------------------------------

LOAD_SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
delay = 0.15
tool_calls = [{ name = "echo", arguments = { text = "$message" } }]
[[scenarios.steps]]
delay = 0.15
reply = "done $message by $provider"
"""


@pytest.mark.slow
def test_reload_under_load_loses_nothing_and_mixes_no_policies(start: Any,
                                                              tmp_path: Path) -> None:
    """200 turns against a slow provider; 20 SIGHUPs while they run: most with a new
    valid file, every third with the file as it was (the running policy again: no new
    version; or the refused file again), three with an invalid, a half-written and a bogus
    one. Each valid config names its provider differently, so every model call says which
    policy served it."""
    daemon_keys = "max_concurrent_turns = 40\ndrain_timeout = 0.1"

    def config(tag: str) -> str:
        return scripted(tmp_path, daemon=daemon_keys, provider=tag, script=LOAD_SCRIPT,
                        watch=True)

    d = start(config("p0"))
    valid = {hashlib.sha256(d.config_path.read_bytes()).hexdigest(): "p0"}
    tap = EventTap(d)
    first = d.submit("turn 0")
    tap.wait_for("turn.queued", first["id"])
    ids = [first["id"]]
    accepted = threading.Event()

    def submit_all() -> None:
        client = Client(d.socket, timeout=30)
        for i in range(1, 200):
            code, data = client.request("POST", "/v1/turns", {"message": f"turn {i}"})
            assert code == 202, data
            ids.append(data["turn"]["id"])
            if i % 10 == 0:
                time.sleep(0.12)
        accepted.set()

    # At SIGHUP number i: (the file's new content, the provider it names when valid).
    full = write_config(d.dir / "full.toml", config("p9"), socket=d.socket,
                        state_dir=d.state_dir).read_bytes()
    half = full[: full.index(b"[[tools]]") + 5]  # a writer that stopped half way
    rewrites: dict[int, tuple[str | bytes, str | None]] = {
        i: (config(f"p{i}"), f"p{i}") for i in range(20) if i % 3 != 2}
    rewrites.update({
        7: (config("p7").replace("drain_timeout = 0.1", "drain_timeout = -1"), None),
        10: (half, None),
        17: (config("p17") + "\n[agent]\nbogus = 1\n", None)})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        submitter = pool.submit(submit_all)
        for i in range(20):
            if i in rewrites:
                body, tag = rewrites[i]
                if isinstance(body, bytes):
                    replace_file(d.config_path, body)
                else:
                    data = rewrite(d, body)
                    if tag is not None:
                        valid[hashlib.sha256(data).hexdigest()] = tag
            d.signal(signal.SIGHUP)
            time.sleep(0.12)
        submitter.result()
    assert accepted.is_set() and len(set(ids)) == 200
    turns = {i: d.wait(i, timeout=60) for i in ids}
    wait_until(lambda: {e["turn"] for e in list(tap.events) if e["type"] == "turn.finished"}
               == set(ids), what="every turn.finished on the event stream")
    st = status_of(d)
    events = tap.close()

    # Every turn completed, exactly once, with the answer of the policy it ended under.
    assert all(t["state"] == "completed" for t in turns.values())
    finished = [e["turn"] for e in events if e["type"] == "turn.finished"]
    assert sorted(finished) == sorted(ids)
    logged = [r["turn"] for r in records(d, "turn.finished")]
    assert sorted(logged) == sorted(ids)

    # Which provider (so which config) each policy version ran with. Invalid and half
    # written files never became a policy.
    version_tag = {1: "p0"}
    for e in events:
        if e["type"] == "daemon.reloaded":
            assert e["content_hash"] in valid, "an invalid config was applied"
            version_tag[e["policy_version"]] = valid[e["content_hash"]]
    assert sorted(version_tag) == list(range(1, st["policy_version"] + 1))
    assert len(set(version_tag.values())) == st["policy_version"] >= 4
    assert st["reloads"]["failures"] >= 2  # the invalid, half-written and bogus files
    assert st["reloads"]["count"] == st["policy_version"] - 1

    # A turn submitted during a reload starts after that reload's swap. (A turn dispatched
    # just before a reload began may say `turn.started` after it: it is in flight, under
    # the old policy.) Whatever starts or resumes runs under the policy of that moment; a
    # turn keeps one policy from each (re)start to its suspension or end, and its model
    # calls all go to that policy's provider.
    current = 1
    window: set[str] | None = None  # turns queued during the reload under way
    queued_in_reload = 0
    segments: dict[str, list[tuple[int, list[str]]]] = {i: [] for i in ids}
    for e in events:
        kind = e["type"]
        if kind == "daemon.reloading":
            window = set()
        elif kind == "daemon.reloaded":
            window, current = None, e["policy_version"]
        elif kind == "turn.queued" and window is not None:
            window.add(e["turn"])
            queued_in_reload += 1
        elif kind in ("turn.started", "turn.resumed"):
            assert window is None or e["turn"] not in window, e
            assert e["policy_version"] == current, e
            segments[e["turn"]].append((current, []))
        elif kind == "model.request":
            segments[e["turn"]][-1][1].append(e["provider"])
    suspended = 0
    for turn_id, segs in segments.items():
        assert segs, turn_id
        for version, providers in segs:
            assert providers and set(providers) == {version_tag[version]}, (turn_id, segs)
        t = turns[turn_id]
        assert t["policy_version"] == segs[-1][0]
        assert t["result"]["answer"] == f"done {t['message']} by {version_tag[segs[-1][0]]}"
        suspended += len(segs) > 1
    # The run exercised what it claims to: suspensions and submits during reloads.
    assert suspended >= 5 and queued_in_reload >= 5, (suspended, queued_in_reload)
