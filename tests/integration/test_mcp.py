"""Tools from MCP servers: real servers written with the SDK
(tests/integration/mcp_servers/), run for real as stdio subprocesses of the daemon and as
a streamable-HTTP server on 127.0.0.1, driven through the real daemon over its socket.

Each server leaves traces in a work directory the test owns (pids, a ledger of effects,
markers of started and cancelled calls), so the tests see what the server really did.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import Daemon, script_file
from tests.integration.test_observability import scrape, value
from turnkeeper.policy.effects import effect_key

SERVERS = Path(__file__).parent / "mcp_servers"
STDIO_SERVER = SERVERS / "stdio_server.py"
HTTP_SERVER = SERVERS / "http_server.py"


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _kill_pid(pid: int) -> None:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"mcp_servers" in cmdline:  # ours, not a recycled pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """The servers' work directory; every server process that wrote its pid here is
    killed at the end (a stdio server outlives a daemon killed with -9)."""
    work = tmp_path / "mcp-work"
    work.mkdir()
    yield work
    pids = work / "pids"
    if pids.exists():
        for entry in pids.iterdir():
            _kill_pid(int(entry.name))


def server_pids(work: Path) -> list[int]:
    pids = work / "pids"
    return sorted(int(p.name) for p in pids.iterdir()) if pids.exists() else []


def ledger(work: Path) -> list[str]:
    path = work / "ledger"
    return path.read_text().splitlines() if path.exists() else []


def stdio_server(name: str, work: Path, extra: str = "") -> str:
    return f"""
[[tools]]
name = "{name}"
kind = "mcp"
command = "{sys.executable}"
args = ["{STDIO_SERVER}"]
env = {{ MCP_TEST_DIR = "{work}", MCP_NAME = "{name}", TOKEN = "env:MCP_TEST_TOKEN" }}
{extra}
"""


def config(tmp_path: Path, script: str, tools: str, extra: str = "") -> str:
    path = script_file(tmp_path / "script.toml", script)
    return f"""
[retry]
base_delay = 0.01
max_delay = 0.05

[[providers]]
name = "scripted"
kind = "scripted"
script = "{path}"
{extra}
{tools}
"""


def tool_results(d: Daemon, turn_id: str) -> list[dict[str, Any]]:
    return [e for e in d.events(turn_id) if e["type"] == "tool.result"]


def mcp_status(d: Daemon, server: str) -> dict[str, Any]:
    status, data = d.get("/v1/status")
    assert status == 200
    return data["mcp_servers"][server]  # type: ignore[no-any-return]


def offer_notes(d: Daemon, turn_id: str) -> list[str]:
    return [r["note"] for r in d.log_records()
            if r.get("event") == "tool.offer_changed" and r.get("turn") == turn_id]


SHARED = """
[[scenarios]]
match = "sum"
[[scenarios.steps]]
tool_calls = [{ name = "picky__add", arguments = { a = 2, b = 40 } },
              { name = "picky__whoami", arguments = {} }]
[[scenarios.steps]]
reply = "sum and token: $last_tool_result"

[[scenarios]]
match = "hidden"
[[scenarios.steps]]
tool_calls = [{ name = "picky__secret_admin", arguments = {} }]
[[scenarios.steps]]
reply = "after: $last_tool_result"

[[scenarios]]
match = "bad args"
[[scenarios.steps]]
tool_calls = [{ name = "picky__add", arguments = { a = "two" } }]
[[scenarios.steps]]
reply = "after: $last_tool_result"

[[scenarios]]
match = "transient"
[[scenarios.steps]]
tool_calls = [{ name = "calc__fail", arguments = { message = "upstream temporarily unavailable" } }]
[[scenarios.steps]]
reply = "gave up: $last_tool_result"

[[scenarios]]
match = "wrong"
[[scenarios.steps]]
tool_calls = [{ name = "calc__fail", arguments = { message = "no such city: Atlantis" } }]
[[scenarios.steps]]
reply = "gave up: $last_tool_result"

[[scenarios]]
match = "loop"
[[scenarios.steps]]
tool_calls = [{ name = "calc__fail", arguments = { message = "no such city: Atlantis" } }]

[[scenarios]]
match = "slow"
[[scenarios.steps]]
tool_calls = [{ name = "calc__slow", arguments = { seconds = 30 } }]
[[scenarios.steps]]
reply = "after: $last_tool_result"
"""


class Shared:
    """One daemon with two stdio servers for the tests that do not stop or reload it:
    `calc` (every tool; overrides) and `picky` (include / exclude)."""

    def __init__(self, d: Daemon, work: Path) -> None:
        self.d = d
        self.calc = work / "calc"
        self.picky = work / "picky"


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    tmp = tmp_path_factory.mktemp("mcp-shared")
    work = tmp / "mcp-work"
    calc = stdio_server("calc", work / "calc",
                        "timeout = 20.0\n"
                        "overrides = { slow = { idempotent = true, polling = true }, "
                        "lookup = { destructive = true } }")
    picky = stdio_server("picky", work / "picky",
                         'include = ["add", "whoami", "s*"]\nexclude = ["secret_*"]')
    d = Daemon(tmp, config(tmp, SHARED, calc + picky, extra="[agent]\napi_max_retries = 2"),
               env={"MCP_TEST_TOKEN": "s3cret"}, name="shared")
    try:
        d.start()
        yield Shared(d, work)
    finally:
        d.kill()
        for sub in (work / "calc", work / "picky"):
            for pid in server_pids(sub):
                _kill_pid(pid)


def test_a_stdio_server_s_tools_are_offered_prefixed_and_called_through_the_daemon(
        shared: Shared) -> None:
    d = shared.d
    srv = mcp_status(d, "picky")
    assert srv["state"] == "up" and srv["transport"] == "stdio"
    # include, then exclude: secret_admin matches s* but is excluded
    assert [t["name"] for t in srv["tools"]] == ["picky__add", "picky__whoami", "picky__slow"]

    turn = d.run("sum please")
    assert turn["state"] == "completed", turn["result"]
    results = tool_results(d, turn["id"])
    assert [(r["tool"], r["ok"], r["content"]) for r in results] == [
        ("picky__add", True, "42"), ("picky__whoami", True, "s3cret")]
    assert turn["result"]["answer"] == "sum and token: s3cret"
    calls = [e for e in d.events(turn["id"]) if e["type"] == "tool.call"]
    assert calls[0]["arguments"] == {"a": 2, "b": 40}

    # An excluded tool does not exist for the agent: an unknown tool, never sent.
    hidden = d.run("hidden tool")
    result = tool_results(d, hidden["id"])[0]
    assert result["ok"] is False and result["class"] == "deterministic"
    assert "UnknownTool" in result["error"]
    # Arguments are checked against the server's input schema before anything is sent.
    bad = d.run("bad args")
    result = tool_results(d, bad["id"])[0]
    assert result["class"] == "deterministic" and "SchemaViolation" in result["error"]
    assert d.get("/v1/status")[1]["breakers"]["tool:picky"] == "closed"


def test_a_tool_that_requires_mcp_tasks_is_not_offered_and_the_log_says_why(
        shared: Shared) -> None:
    d = shared.d
    offered = {t["remote"] for t in mcp_status(d, "calc")["tools"]}
    assert "long_job" not in offered and "quiet" in offered
    said = [r for r in d.log_records() if r.get("event") == "mcp.tools_need_tasks"]
    assert said and said[0]["server"] == "calc" and said[0]["tools"] == ["long_job"]
    assert "MCP tasks" in said[0]["reason"]


def test_because_names_the_hints_a_server_gave_and_destructive_wins(shared: Shared) -> None:
    tools = mcp_status(shared.d, "calc")["tools"]
    traits = {t["remote"]: (t["idempotent"], t["destructive"], t["because"]) for t in tools}
    assert traits["quiet"] == (False, False, "readOnlyHint=false, destructiveHint=false, "
                                             "idempotentHint=false: not idempotent")
    assert traits["wipe"] == (False, True, "destructiveHint (over idempotentHint)")


def test_annotations_and_overrides_decide_retries(shared: Shared) -> None:
    d = shared.d
    tools = mcp_status(d, "calc")["tools"]
    traits = {t["remote"]: (t["idempotent"], t["destructive"], t["because"]) for t in tools}
    assert traits["add"] == (True, False, "readOnlyHint")
    assert traits["put"] == (True, False, "idempotentHint")
    assert traits["charge"] == (False, True, "destructiveHint")
    assert traits["boom"] == (False, True, "no hint: not idempotent")
    assert traits["slow"] == (True, True, "override idempotent")
    assert traits["lookup"] == (False, True, "override destructive")
    assert {t["remote"] for t in tools if t["polling"]} == {"slow"}

    # isError that reads transient: retryable, and `fail` is read-only, so it is retried
    # (api_max_retries = 2: three attempts), under one idempotency key.
    turn = d.run("transient please")
    events = d.events(turn["id"])
    retries = [e for e in events if e["type"] == "tool.retry_scheduled"]
    assert [e["attempt"] for e in retries] == [2, 3]
    assert {e["key"] for e in retries} == {f"{turn['id']}.1.0"}
    result = next(e for e in events if e["type"] == "tool.result")
    assert result["class"] == "retryable" and "temporarily unavailable" in result["error"]

    # isError otherwise: deterministic, never retried; twice in a row stops the turn.
    turn = d.run("wrong please")
    events = d.events(turn["id"])
    assert not [e for e in events if e["type"] == "tool.retry_scheduled"]
    assert next(e for e in events if e["type"] == "tool.result")["class"] == "deterministic"
    looping = d.run("loop forever")
    assert looping["result"]["stopped_because"]["code"] == "failure.deterministic"


def test_a_slow_tool_is_cut_by_the_turn_s_time_budget_and_cancelled_on_the_server(
        shared: Shared) -> None:
    d, work = shared.d, shared.calc
    (work / "slow.cancelled").unlink(missing_ok=True)
    turn = d.run("slow one", budget={"max_seconds": 1.0})
    stop = turn["result"]["stopped_because"]
    assert stop["code"] == "budget.seconds" and turn["state"] == "partial"
    result = tool_results(d, turn["id"])[0]
    assert result["class"] == "retryable" and "RequestTimeout" in result["error"]
    # The call's timeout was what was left of the turn's second, not the tool's 20 s.
    within = re.search(r"did not answer within ([0-9.e-]+) s", result["error"])
    assert within and 0 < float(within[1]) <= 1.0, result["error"]
    # The SDK told the server, which cancelled the tool's work.
    wait_for(lambda: (work / "slow.cancelled").exists(), 5, "the server to cancel")


def test_cancelling_a_turn_cancels_its_in_flight_mcp_request(shared: Shared) -> None:
    d, work = shared.d, shared.calc
    for marker in ("slow.started", "slow.cancelled"):
        (work / marker).unlink(missing_ok=True)
    turn = d.submit("slow one")
    wait_for(lambda: (work / "slow.started").exists(), 10, "the call to start")
    status, _ = d.post(f"/v1/turns/{turn['id']}/cancel")
    assert status == 202
    done = d.wait(turn["id"], timeout=10)
    assert done["state"] == "cancelled"
    wait_for(lambda: (work / "slow.cancelled").exists(), 5, "the server to cancel")
    assert mcp_status(d, "calc")["state"] == "up"


CRASH = """
[[scenarios]]
match = "crash"
[[scenarios.steps]]
tool_calls = [{ name = "calc__boom", arguments = {} }]
[[scenarios.steps]]
tool_calls = [{ name = "calc__add", arguments = { a = 1, b = 2 } }]
[[scenarios.steps]]
reply = "after the crash: $last_tool_result"

[[scenarios]]
[[scenarios.steps]]
tool_calls = [{ name = "calc__add", arguments = { a = 1, b = 2 } }]
[[scenarios.steps]]
reply = "sum: $last_tool_result"
"""


@pytest.mark.slow
def test_a_server_that_crashes_mid_call_fails_it_retryable_and_comes_back(
        start: Any, tmp_path: Path, workdir: Path) -> None:
    tools = stdio_server("calc", workdir, "restart_backoff = { base_delay = 0.5, "
                                          "max_delay = 0.5, jitter = \"decorrelated\" }")
    d = start(config(tmp_path, CRASH, tools, extra="[agent]\napi_max_retries = 1"))
    first_pid = server_pids(workdir)
    assert len(first_pid) == 1

    turn = d.run("crash it")
    assert turn["state"] == "completed"
    boom, add = tool_results(d, turn["id"])
    assert boom["tool"] == "calc__boom" and boom["ok"] is False
    assert boom["class"] == "retryable" and "ConnectionClosed" in boom["error"]
    assert (workdir / "boom").exists()
    # The next step ran while the server was down: its tools left the offer, the agent
    # was told, and a call anyway fails fast as retryable without reaching anything.
    assert add["ok"] is False and add["class"] == "retryable"
    assert "ServerDown" in add["error"]
    notes = offer_notes(d, turn["id"])
    assert len(notes) == 1 and "MCP server calc went down" in notes[0]
    assert "calc__add" in notes[0]

    srv = wait_for(lambda: (s := mcp_status(d, "calc"))["state"] == "up" and s, 10,
                   "the server to come back")
    assert srv["restarts"] == 1 and "closed the connection" in srv["last_error"]
    samples = scrape(d)
    assert value(samples, "turnkeeper_mcp_server_restarts_total", server="calc") == 1
    assert value(samples, "turnkeeper_mcp_server_up", server="calc") == 1
    assert value(samples, "turnkeeper_mcp_server_tools", server="calc") == len(srv["tools"])
    assert len(server_pids(workdir)) == 2  # a new process
    # Only the crash reached the server: the breaker saw one failure and stays closed.
    assert d.get("/v1/status")[1]["breakers"]["tool:calc"] == "closed"
    again = d.run("add again")
    assert tool_results(d, again["id"])[0]["ok"] is True
    assert again["result"]["answer"] == "sum: 3"
    records = [r for r in d.log_records() if r.get("event") == "mcp.server_down"]
    assert records and records[0]["server"] == "calc" and records[0]["restart_in"] == 0.5


KILL = """
[[scenarios]]
match = "charge"
[[scenarios.steps]]
tool_calls = [{ name = "calc__charge", arguments = { account = "acme", amount = 100 } }]
[[scenarios.steps]]
reply = "charge: $last_tool_result"

[[scenarios]]
match = "look"
[[scenarios.steps]]
tool_calls = [{ name = "calc__lookup", arguments = { account = "acme" } }]
[[scenarios.steps]]
reply = "lookup: $last_tool_result"
"""


@pytest.mark.slow
def test_a_destructive_call_in_flight_at_kill_9_is_not_repeated_a_read_only_one_is(
        start: Any, tmp_path: Path, workdir: Path) -> None:
    d = start(config(tmp_path, KILL, stdio_server("calc", workdir, "timeout = 60.0")))
    (workdir / "hold").write_text("")  # both calls stay in flight
    charge = d.submit("charge it", session="a")
    look = d.submit("look it up", session="b")
    wait_for(lambda: len(ledger(workdir)) == 2, 10, "both calls to reach the server")
    d.kill()
    (workdir / "hold").unlink()
    d.start()
    charged, looked = d.wait(charge["id"]), d.wait(look["id"])

    lines = ledger(workdir)
    charges = [line for line in lines if line.startswith("charge")]
    lookups = [line for line in lines if line.startswith("lookup")]
    assert len(charges) == 1, lines  # never repeated
    assert len(lookups) == 2, lines  # read-only: run again on resume
    # ... with the same idempotency key, which travels in the request's _meta
    assert lookups[0].split()[-1] == lookups[1].split()[-1] == f"{look['id']}.1.0"
    assert charges[0].split()[-1] == effect_key(charge["id"], "calc__charge",
                                                {"account": "acme", "amount": 100}, 1)

    assert charged["state"] == "completed"
    assert any("outcome unknown: calc__charge" in issue
               for issue in charged["result"]["open_issues"])
    unknown = [e for e in d.events(charge["id"])
               if e["type"] == "tool.result" and e.get("outcome") == "unknown"]
    assert len(unknown) == 1
    assert looked["state"] == "completed"
    assert looked["result"]["answer"] == "lookup: account acme: ok"


RELOAD = """
[[scenarios]]
match = "pids"
[[scenarios.steps]]
tool_calls = [{ name = "one__pid", arguments = {} }, { name = "two__pid", arguments = {} }]
[[scenarios.steps]]
reply = "pids"

[[scenarios]]
match = "busy"
[[scenarios.steps]]
tool_calls = [{ name = "two__slow", arguments = { seconds = 0.6 } }]
[[scenarios.steps]]
reply = "busy: $last_tool_result"
"""


@pytest.mark.slow
def test_reload_restarts_only_changed_servers_after_their_turns_drain(
        start: Any, tmp_path: Path, workdir: Path) -> None:
    one, two = workdir / "one", workdir / "two"
    tools = stdio_server("one", one) + stdio_server("two", two)
    d = start(config(tmp_path, RELOAD, tools))

    def pids() -> list[str]:
        turn = d.run("pids please")
        return [r["content"] for r in tool_results(d, turn["id"])]

    before = pids()
    busy = d.submit("busy now")
    wait_for(lambda: (two / "slow.started").exists(), 10, "the slow call")
    d.set_config(config(tmp_path, RELOAD, stdio_server("one", one)
                        + stdio_server("two", two, "timeout = 9.0")))
    status, data = d.post("/v1/reload")
    assert status == 200, data
    # The turn using the changed server drained first: its call finished, not cut.
    finished = d.wait(busy["id"])
    assert finished["state"] == "completed"
    assert finished["result"]["answer"] == "busy: slept 0.6"
    assert not (two / "slow.cancelled").exists()
    after = pids()
    assert after[0] == before[0]  # unchanged: the same process
    assert after[1] != before[1]  # changed: restarted
    assert len(server_pids(one)) == 1 and len(server_pids(two)) == 2
    stopped = [r for r in d.log_records() if r.get("event") == "mcp.server_stopped"]
    assert [r["server"] for r in stopped] == ["two"]


HTTP = """
[[scenarios]]
[[scenarios.steps]]
tool_calls = [{ name = "remote__add", arguments = { a = 20, b = 22 } },
              { name = "remote__whoami", arguments = {} }]
[[scenarios.steps]]
reply = "remote: $last_tool_result"
"""


@pytest.fixture
def http_server(workdir: Path) -> Iterator[Callable[[int], tuple[subprocess.Popen[bytes], int]]]:
    """Start the streamable-HTTP test server on 127.0.0.1 (port 0: a free one, or the
    given one to restart on the same address)."""
    procs: list[subprocess.Popen[bytes]] = []

    def _start(port: int = 0) -> tuple[subprocess.Popen[bytes], int]:
        (workdir / "port").unlink(missing_ok=True)
        log = open(workdir / "http.log", "ab")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen([sys.executable, str(HTTP_SERVER), str(workdir)],
                                env={**os.environ, "MCP_PORT": str(port)},
                                stdout=log, stderr=log)
        log.close()
        procs.append(proc)
        port_text = wait_for(lambda: (workdir / "port").exists()
                             and (workdir / "port").read_text(), 15, "the HTTP server")
        return proc, int(port_text)

    yield _start
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_streamable_http_server_with_headers_from_the_environment(
        start: Any, tmp_path: Path, workdir: Path, http_server: Any) -> None:
    proc, port = http_server()
    tools = f"""
[[tools]]
name = "remote"
kind = "mcp"
url = "http://127.0.0.1:{port}/mcp"
headers = {{ Authorization = "env:MCP_TEST_AUTH" }}
ping_interval = 0.2
restart_backoff = {{ base_delay = 0.05, max_delay = 0.1 }}
"""
    d = start(config(tmp_path, HTTP, tools), env={"MCP_TEST_AUTH": "Bearer t0k3n"})
    assert mcp_status(d, "remote")["transport"] == "http"
    turn = d.run("remote sum")
    # whoami answers the Authorization header it got: the header was sent, and its value
    # (a secret read from the environment) is redacted from the result.
    assert [(r["tool"], r["content"]) for r in tool_results(d, turn["id"])] == [
        ("remote__add", "42"), ("remote__whoami", "[redacted]")]

    # The server dies: the daemon notices (ping), its tools leave the offer; it comes
    # back on the same address and the daemon reconnects by itself.
    proc.kill()
    proc.wait()
    wait_for(lambda: mcp_status(d, "remote")["state"] != "up", 5, "the daemon to notice")
    down = d.run("remote sum")
    assert all(r["ok"] is False and r["class"] == "retryable"
               for r in tool_results(d, down["id"]))
    assert any("unavailable right now" in n for n in offer_notes(d, down["id"]))
    http_server(port)
    wait_for(lambda: mcp_status(d, "remote")["state"] == "up", 10, "the reconnection")
    back = d.run("remote sum")
    assert back["result"]["answer"] == "remote: [redacted]"


NOWHERE = """
[[scenarios]]
[[scenarios.steps]]
tool_calls = [{ name = "gone__anything", arguments = {} }]
[[scenarios.steps]]
reply = "after: $last_tool_result"
"""


def test_a_server_that_cannot_start_leaves_the_daemon_up_and_the_agent_told(
        start: Any, tmp_path: Path) -> None:
    tools = """
[[tools]]
name = "gone"
kind = "mcp"
command = "/nonexistent/mcp-server"
restart_backoff = { base_delay = 5.0, max_delay = 5.0 }
"""
    d = start(config(tmp_path, NOWHERE, tools))
    srv = mcp_status(d, "gone")
    assert srv["state"] == "down" and srv["next_restart_at"] is not None
    assert "No such file" in srv["last_error"] or "FileNotFoundError" in srv["last_error"]
    out = subprocess.run([sys.executable, "-m", "turnkeeper", "status", "--socket",
                          str(d.socket)], capture_output=True, text=True, timeout=30,
                         check=False)
    line = next(x for x in out.stdout.splitlines() if x.startswith("mcp server"))
    assert "gone DOWN (stdio): FileNotFoundError" in line and "next start in" in line
    turn = d.run("try it")
    notes = offer_notes(d, turn["id"])
    assert notes and "MCP server gone are unavailable right now" in notes[0]
    result = tool_results(d, turn["id"])[0]
    assert result["class"] == "retryable" and "ServerDown" in result["error"]


def test_kind_mcp_without_the_package_is_a_config_error_naming_the_fix(
        tmp_path: Path) -> None:
    path = tmp_path / "tk.toml"
    path.write_text('[[providers]]\nname = "offline"\nkind = "scripted"\n\n'
                    '[[tools]]\nname = "fs"\nkind = "mcp"\ncommand = "mcp-server-fs"\n')
    without_mcp = ("import sys; sys.modules['mcp'] = None; "  # as if it were not installed
                   "from turnkeeper.cli import main; sys.exit(main(sys.argv[1:]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
    for argv in (["config", "check", str(path)], ["serve", "--config", str(path)]):
        out = subprocess.run([sys.executable, "-c", without_mcp, *argv], env=env,
                             capture_output=True, text=True, timeout=30, check=False)
        assert out.returncode == 78, (argv, out.stdout, out.stderr)
        text = out.stdout + out.stderr
        assert 'kind = "mcp"' in text and "pip install 'turnkeeper[mcp]'" in text, text
        assert "line 5: tools.fs:" in text, text  # by its name, at its table
    ok = subprocess.run([sys.executable, "-m", "turnkeeper", "config", "check", str(path)],
                        env=env, capture_output=True, text=True, timeout=30, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_config_show_redacts_literal_server_env_values(tmp_path: Path) -> None:
    path = tmp_path / "tk.toml"
    path.write_text('[[providers]]\nname = "offline"\nkind = "scripted"\n\n'
                    '[[tools]]\nname = "fs"\nkind = "mcp"\ncommand = "srv"\n'
                    'env = { API_KEY = "literal-secret", TOKEN = "env:FS_TOKEN" }\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
    out = subprocess.run([sys.executable, "-m", "turnkeeper", "config", "show", "--config",
                          str(path), "--json"], env=env, capture_output=True, text=True,
                         timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert "literal-secret" not in out.stdout
    tool = json.loads(out.stdout)["tools"][0]
    assert tool["env"] == {"API_KEY": "<redacted>", "TOKEN": "env:FS_TOKEN"}
