"""The daemon runs, takes turns over its control socket and answers them.

Every test starts the real daemon as a subprocess with a real config file, SQLite file
and Unix socket, and drives it over HTTP.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.integration.harness import ECHO_TOOL, script_file, scripted_provider, wait_until
from turnkeeper.control.client import Client

SLOW_SCRIPT = """
[[scenarios]]
match = "slow"
[[scenarios.steps]]
delay = 1.0
tool_calls = [{ name = "echo", arguments = { text = "working" } }]
[[scenarios.steps]]
delay = 0.2
reply = "slow done: $message"

[[scenarios]]
[[scenarios.steps]]
delay = 0.02
reply = "answer to: $message"
"""


def scripted(tmp_path: Path, body: str = SLOW_SCRIPT, extra: str = "") -> str:
    script = script_file(tmp_path / "script.toml", body)
    return scripted_provider(script) + ECHO_TOOL + extra


def test_embedded_demo_turn_completes_with_a_tool_round_trip(start: Any) -> None:
    d = start()
    turn = d.run("hello")
    assert turn["state"] == "completed"
    result = turn["result"]
    assert result["status"] == "completed"
    assert result["stopped_because"]["code"] == "completed"
    assert "hello" in result["answer"]
    assert turn["counters"]["steps"] == 2
    assert turn["usage"]["total_tokens"] > 0
    types = [e["type"] for e in d.events(turn["id"])]
    assert types[0] == "turn.queued"
    for t in ("turn.started", "step.started", "model.request", "model.response",
              "tool.call", "tool.result", "turn.finished"):
        assert t in types, t
    assert types[-1] == "turn.finished"
    seqs = [e["seq"] for e in d.events(turn["id"])]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_status_answers_the_spec_shape(start: Any) -> None:
    d = start()
    status, data = d.get("/v1/status")
    assert status == 200
    for key in ("state", "policy_version", "config_path", "pending_restart",
                "last_reload_error", "turns", "breakers", "uptime_s", "version"):
        assert key in data, key
    assert data["state"] == "ready"
    assert set(data["turns"]) == {"queued", "running", "recovering", "waiting", "suspended"}
    assert data["breakers"] == {"scripted": "closed"}


def test_curl_over_the_unix_socket_works(start: Any) -> None:
    d = start()
    out = subprocess.run(["curl", "-s", "--unix-socket", str(d.socket),
                          "http://turnkeeper/v1/status"], capture_output=True, text=True,
                         timeout=10, check=False)
    if out.returncode == 127:  # pragma: no cover - curl missing on the machine
        return
    assert json.loads(out.stdout)["state"] == "ready"


def test_a_session_s_next_turn_sees_the_earlier_ones(start: Any, tmp_path: Path) -> None:
    script = """
[[scenarios]]
[[scenarios.steps]]
reply = "seen $last_user with history"
"""
    d = start(scripted(tmp_path, script))
    first = d.run("first message", session="s1")
    assert first["session"] == "s1"
    second = d.submit("second message", session="s1")
    d.wait(second["id"])
    events = d.events(second["id"])
    request = next(e for e in events if e["type"] == "model.request")
    assert request["messages"] == 3  # first user + first answer + second user


def test_a_long_session_carries_only_the_newest_history_that_fits(start: Any,
                                                                    tmp_path: Path) -> None:
    """Each past turn here is about 8 + (100 + 33) / 4 = 41 estimated tokens: a bound of
    100 keeps the newest two, however long the session grows."""
    script = """
[[scenarios]]
[[scenarios.steps]]
reply = "an answer of thirty-three chars."
"""
    d = start(scripted(tmp_path, script, extra="[sessions]\nmax_history_tokens = 100\n"))
    for i in range(8):
        last = d.run(f"{i} " + "x" * 98, session="long")
        assert last["state"] == "completed"
    request = next(e for e in d.events(last["id"]) if e["type"] == "model.request")
    assert request["messages"] == 5  # two past turns (message + answer each) + its own


def test_turns_of_one_session_run_one_at_a_time_in_order(start: Any, tmp_path: Path) -> None:
    d = start(scripted(tmp_path))
    a = d.submit("slow a", session="same")
    b = d.submit("slow b", session="same")
    c = d.submit("fast c", session="other")
    tc = d.wait(c["id"])
    ta, tb = d.wait(a["id"]), d.wait(b["id"])
    assert tc["updated_at"] < ta["updated_at"]  # other sessions do not wait
    events_b = d.events(b["id"])
    started_b = next(e["ts"] for e in events_b if e["type"] == "turn.started")
    assert started_b >= ta["updated_at"]
    assert all(t["state"] == "completed" for t in (ta, tb, tc))


def test_list_and_filter_turns(start: Any, tmp_path: Path) -> None:
    d = start(scripted(tmp_path))
    t1 = d.run("one", session="x")
    d.run("two", session="y")
    status, data = d.get("/v1/turns?session=x")
    assert status == 200
    assert [t["id"] for t in data["turns"]] == [t1["id"]]
    status, data = d.get("/v1/turns?state=completed&limit=1")
    assert status == 200 and len(data["turns"]) == 1
    status, data = d.get("/v1/turns?limit=zero")
    assert status == 400 and data["field"] == "limit"


def test_cancel_a_running_turn_ends_it_cancelled(start: Any, tmp_path: Path) -> None:
    d = start(scripted(tmp_path))
    turn = d.submit("slow to cancel")
    wait_until(lambda: d.get(f"/v1/turns/{turn['id']}")[1]["turn"]["state"] == "running",
               what="the turn to run")
    status, _ = d.post(f"/v1/turns/{turn['id']}/cancel")
    assert status == 202
    done = d.wait(turn["id"], timeout=10)
    assert done["state"] == "cancelled"
    assert done["result"]["stopped_because"]["code"] == "cancelled"
    status, data = d.post(f"/v1/turns/{turn['id']}/messages", {"kind": "steer", "text": "x"})
    assert status == 409, data


def test_malformed_and_invalid_requests_get_400_naming_the_field(start: Any) -> None:
    d = start()
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(str(d.socket))
    body = b"{not json"
    conn.sendall(b"POST /v1/turns HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    reply = conn.recv(65536).decode()
    conn.close()
    assert reply.startswith("HTTP/1.1 400")
    assert '"field": "(body)"' in reply or '"field":"(body)"' in reply
    cases = [
        ({}, "message"),
        ({"message": ""}, "message"),
        ({"message": "hi", "budget": {"max_tokens": -1}}, "budget.max_tokens"),
        ({"message": "hi", "budget": {"max_tokenz": 5}}, "budget.max_tokenz"),
        ({"message": "hi", "bogus": 1}, "bogus"),
        ({"message": "hi", "session": "bad session!"}, "session"),
        ({"message": "hi", "deadline": "2026-01-01T00:00:00"}, "deadline"),
    ]
    for body_json, field in cases:
        status, data = d.post("/v1/turns", body_json)
        assert status == 400, (body_json, data)
        assert data["field"] == field, (body_json, data)
    status, data = d.post("/v1/turns", ["a list"])
    assert status == 400
    status, data = d.post("/v1/turns/t_nope/messages", {"kind": "shout", "text": "x"})
    assert status == 400 and data["field"] == "kind"


def test_unknown_turn_is_404(start: Any) -> None:
    d = start()
    assert d.get("/v1/turns/t_nope")[0] == 404
    assert d.post("/v1/turns/t_nope/cancel")[0] == 404
    assert d.post("/v1/turns/t_nope/messages", {"kind": "steer", "text": "x"})[0] == 404
    status, _ = d.client.request("GET", "/v1/turns/t_nope/events")
    assert status == 404
    assert d.get("/v1/nothing")[0] == 404


def test_body_over_one_mib_is_413_and_the_daemon_stays_up(start: Any) -> None:
    d = start()
    status, data = d.post("/v1/turns", {"message": "x" * (1024 * 1024 + 10)})
    assert status == 413, data
    assert "error" in data
    # A client announcing a huge body is answered from the header, not waited for.
    conn = socket.socket(socket.AF_UNIX)
    conn.settimeout(5)
    conn.connect(str(d.socket))
    conn.sendall(b"POST /v1/turns HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n{")
    assert conn.recv(100).startswith(b"HTTP/1.1 413")
    conn.close()
    assert d.run("still alive")["state"] == "completed"


def test_peer_with_another_uid_gets_403(start: Any) -> None:
    if os.getuid() != 0:  # pragma: no cover - needs root to drop to nobody
        return
    # A socket nobody can reach (pytest's tmp is 0700): the peer check is what refuses.
    public = Path(tempfile.mkdtemp(prefix="tk-peer-", dir="/tmp"))
    os.chmod(public, 0o755)
    d = start(socket=public / "run" / "control.sock")
    os.chmod(d.socket.parent, 0o755)
    os.chmod(d.socket, 0o666)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, ask for status
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            status, data = Client(d.socket, timeout=5).request("GET", "/v1/status")
            os.write(write_fd, json.dumps([status, data]).encode())
        except BaseException as exc:
            os.write(write_fd, json.dumps([0, repr(exc)]).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    with os.fdopen(read_fd) as f:
        status, data = json.loads(f.read())
    assert status == 403, data
    assert "uid 65534" in data["error"]
    assert d.get("/v1/status")[0] == 200


def test_socket_is_created_0660_in_a_0750_directory(start: Any) -> None:
    d = start()
    assert oct(d.socket.stat().st_mode & 0o777) == oct(0o660)
    assert d.socket.parent.stat().st_mode & 0o027 == 0


def test_queue_full_answers_503_with_retry_after(start: Any, tmp_path: Path) -> None:
    d = start(scripted(tmp_path, extra="""
[daemon]
max_concurrent_turns = 1
max_queued_turns = 2
"""))
    accepted = [d.submit(f"slow {i}") for i in range(3)]  # 1 running + 2 queued
    wait_until(lambda: d.get("/v1/turns?state=running")[1]["turns"], what="one turn to run")
    status, data = d.post("/v1/turns", {"message": "one too many"})
    assert status == 503, data
    assert "queue is full" in data["error"]
    running = d.get("/v1/turns?state=running")[1]["turns"]
    queued = d.get("/v1/turns?state=queued")[1]["turns"]
    assert [t["id"] for t in running] == [accepted[0]["id"]]
    assert [t["id"] for t in queued] == [accepted[2]["id"], accepted[1]["id"]]  # newest first
    assert d.get("/v1/turns?state=queued&limit=1")[1]["turns"][0]["id"] == accepted[2]["id"]
    for t in accepted:
        assert d.wait(t["id"], timeout=30)["state"] == "completed"


def test_concurrent_turns_all_complete_none_lost_none_duplicated(start: Any,
                                                                 tmp_path: Path) -> None:
    d = start(scripted(tmp_path))
    n = 200

    def one(i: int) -> str:
        c = Client(d.socket, timeout=30)
        status, data = c.request("POST", "/v1/turns", {"message": f"fast {i}"})
        assert status == 202, data
        return str(data["turn"]["id"])

    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        ids = list(pool.map(one, range(n)))
    assert len(set(ids)) == n
    results = [d.wait(i, timeout=60) for i in ids]
    assert all(r["state"] == "completed" for r in results)
    assert sorted(r["result"]["answer"] for r in results) == sorted(
        f"answer to: fast {i}" for i in range(n))
    status, data = d.get(f"/v1/turns?limit={n + 10}")
    assert status == 200 and len(data["turns"]) == n
    finished = [e for e in d.log_records() if e.get("event") == "turn.finished"]
    assert sorted(e["turn"] for e in finished) == sorted(ids)  # exactly once each


def test_sigterm_lets_the_running_turn_finish_then_exits_0(start: Any, tmp_path: Path) -> None:
    d = start(scripted(tmp_path))
    turn = d.submit("slow but finishing")
    wait_until(lambda: d.get(f"/v1/turns/{turn['id']}")[1]["turn"]["state"] == "running",
               what="the turn to run")
    d.signal(signal.SIGTERM)
    assert d.proc is not None
    assert d.proc.wait(30) == 0
    d.start()
    done = d.wait(turn["id"], timeout=10)
    assert done["state"] == "completed"
    assert done["result"]["answer"] == "slow done: slow but finishing"
    # `show` works for a turn finished before the restart.
    out = subprocess.run([sys.executable, "-m", "turnkeeper", "show", turn["id"], "--socket",
                          str(d.socket)], capture_output=True, text=True, timeout=20,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "completed" in out.stdout and turn["id"] in out.stdout


def test_submit_while_stopping_answers_503(start: Any, tmp_path: Path) -> None:
    held = """
[[scenarios]]
[[scenarios.steps]]
delay = 30.0
reply = "never"
"""
    d = start(scripted(tmp_path, held, extra="[daemon]\nshutdown_timeout = 2.0\n"))
    d.submit("held in flight")
    d.signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while d.get("/v1/status")[1]["state"] != "stopping":  # the drain holds it here
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, data = d.post("/v1/turns", {"message": "late"})
    assert status == 503, data
    assert "stopping" in data["error"]
    assert d.proc is not None and d.proc.wait(30) == 0


def test_invalid_config_exits_78_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[budget]\nmax_tokens = -5\n[agent]\nmax_restartz = 1\n")
    out = subprocess.run([sys.executable, "-m", "turnkeeper", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 78
    assert "budget.max_tokens" in out.stderr
    assert "agent.max_restartz: unknown key" in out.stderr
    check = subprocess.run([sys.executable, "-m", "turnkeeper", "config", "check", str(cfg)],
                           capture_output=True, text=True, timeout=30, check=False)
    assert check.returncode == 78
    assert "budget.max_tokens" in check.stderr


def test_a_list_override_that_is_not_json_exits_78_naming_the_variable(
        tmp_path: Path) -> None:
    cfg = tmp_path / "ok.toml"
    cfg.write_text(f'[daemon]\nsocket = "{tmp_path}/c.sock"\nstate_dir = "{tmp_path}/s"\n'
                   '[[providers]]\nname = "offline"\nkind = "scripted"\n')
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")},
           "TURNKEEPER_AGENT__RECOVERY_SCHEDULE": "1,2"}
    for argv in (["serve", "--config", str(cfg)], ["config", "check", str(cfg)]):
        out = subprocess.run([sys.executable, "-m", "turnkeeper", *argv], env=env,
                             capture_output=True, text=True, timeout=30, check=False)
        assert out.returncode == 78, (argv, out.stderr)
        assert "Traceback" not in out.stderr
        assert ("TURNKEEPER_AGENT__RECOVERY_SCHEDULE: [agent] recovery_schedule is a list, "
                "read from the environment as JSON, e.g. TURNKEEPER_AGENT__RECOVERY_SCHEDULE="
                "'[15.0, 30.0, 60.0, 60.0, 60.0]'") in out.stderr, out.stderr


def test_config_show_redacts_secrets(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("""
[[providers]]
name = "offline"
kind = "scripted"

[[tools]]
name = "t"
url = "http://127.0.0.1:9/x"
headers = { Authorization = "Bearer literal-secret", X-Token = "env:MY_TOKEN" }
""")
    out = subprocess.run([sys.executable, "-m", "turnkeeper", "config", "show", "--config",
                          str(cfg)], capture_output=True, text=True, timeout=30, check=False,
                         env={**os.environ, "MY_TOKEN": "env-secret"})
    assert out.returncode == 0, out.stderr
    assert "literal-secret" not in out.stdout and "env-secret" not in out.stdout
    shown = json.loads(out.stdout)
    assert shown["tools"][0]["headers"] == {"Authorization": "<redacted>",
                                            "X-Token": "env:MY_TOKEN"}


def test_cli_submit_wait_and_follow(start: Any) -> None:
    d = start()
    base = [sys.executable, "-m", "turnkeeper", "--socket", str(d.socket)]
    out = subprocess.run([*base, "submit", "via cli", "--wait", "--json"],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["result"]["status"] == "completed"
    out = subprocess.run([*base, "submit", "follow me", "--follow"], capture_output=True,
                         text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert "tool.call" in out.stdout and "completed" in out.stdout
    out = subprocess.run([*base, "status"], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 0 and "ready" in out.stdout


def test_cli_without_a_daemon_says_so(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "turnkeeper", "--socket",
                          str(tmp_path / "none.sock"), "status"], capture_output=True,
                         text=True, timeout=30, check=False)
    assert out.returncode == 69
    assert "is the daemon running" in out.stderr


def test_a_second_daemon_on_the_same_socket_refuses_to_start(start: Any) -> None:
    d = start()
    other = subprocess.run([sys.executable, "-m", "turnkeeper", "serve", "--config",
                            str(d.config_path)], capture_output=True, text=True, timeout=30,
                           check=False)
    assert other.returncode == 69
    # The state directory's lock or the socket: whichever start-up meets first.
    assert "another turnkeeper" in other.stderr
    assert d.get("/v1/status")[0] == 200


def test_the_daemon_serves_with_the_tuned_gc_thresholds(start: Any) -> None:
    """A serving daemon's cyclic collector runs at `GC_THRESHOLD`, not CPython's default
    (700, 10, 10): its ready line says what the process itself reports."""
    from turnkeeper.daemon import GC_THRESHOLD

    d = start()
    deadline = time.monotonic() + 10
    # The socket answers as soon as the turns are resumed; the ready line follows.
    while not (ready := [r for r in d.log_records() if r.get("event") == "daemon.ready"]):
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.02)
    assert tuple(ready[0]["gc_threshold"]) == GC_THRESHOLD
    assert GC_THRESHOLD[0] > 700
