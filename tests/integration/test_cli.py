"""The `turnkeeper` command against the real daemon: what operators type, what it prints
and the exit status it ends with."""

from __future__ import annotations

import json
import os
import socket as socket_lib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import Daemon, script_file, scripted_provider
from turnkeeper.control.client import Client


def cli(*args: str, socket: Path | None = None, env: dict[str, str] | None = None,
        stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = [sys.executable, "-m", "turnkeeper"]
    if socket is not None:
        base += ["--socket", str(socket)]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
    # No config file of the machine's user is read by a test's command (a test that
    # wants one sets XDG_CONFIG_HOME itself).
    full_env["XDG_CONFIG_HOME"] = "/nonexistent/turnkeeper-tests"
    full_env.update(env or {})
    return subprocess.run([*base, *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=full_env, input=stdin)


def _serve_elsewhere(tmp_path: Path, extra: list[str], env: dict[str, str]) -> Path:
    """Start `serve` with a config naming one socket, told another; return the one used."""
    d = Daemon(tmp_path, name="moved")
    chosen = tmp_path / "chosen" / "control.sock"
    log = open(d.log_path, "ab")  # noqa: SIM115 - owned by the process
    d.proc = subprocess.Popen([sys.executable, "-m", "turnkeeper", "serve", "--config",
                               str(d.config_path), *[a.replace("CHOSEN", str(chosen))
                                                     for a in extra]],
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                              env={**d.env(), **{k: v.replace("CHOSEN", str(chosen))
                                                 for k, v in env.items()}})
    log.close()
    d.client = Client(chosen, timeout=30.0)
    try:
        d.wait_ready()
        assert not d.socket.exists()
        assert cli("status", socket=chosen).returncode == 0
    finally:
        d.stop()
    return chosen


def test_serve_listens_on_the_socket_option(tmp_path: Path) -> None:
    _serve_elsewhere(tmp_path, ["--socket", "CHOSEN"], {})


def test_serve_listens_on_turnkeeper_socket(tmp_path: Path) -> None:
    _serve_elsewhere(tmp_path, [], {"TURNKEEPER_SOCKET": "CHOSEN"})


def test_config_show_prints_the_paths_in_use(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[providers]]\nname = "offline"\nkind = "scripted"\n')
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "rt"), "XDG_STATE_HOME": str(tmp_path / "st")}
    out = cli("config", "show", "--config", str(cfg), env=env)
    assert out.returncode == 0, out.stderr
    daemon = json.loads(out.stdout)["daemon"]
    assert daemon["socket"] == str(tmp_path / "rt" / "turnkeeper" / "control.sock")
    assert daemon["state_dir"] == str(tmp_path / "st" / "turnkeeper")
    out = cli("--socket", "/x/y.sock", "config", "show", "--config", str(cfg), env=env)
    assert json.loads(out.stdout)["daemon"]["socket"] == "/x/y.sock"


def test_config_show_masks_credentials_inside_urls(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[providers]]\nname = "p"\nkind = "openai"\napi_key_env = ""\n'
                   'base_url = "https://me:pa55word@llm.example/v1?api_key=k3y&v=1"\n')
    out = cli("config", "show", "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    assert "pa55word" not in out.stdout and "k3y" not in out.stdout
    assert json.loads(out.stdout)["providers"][0]["base_url"] == \
        "https://<redacted>@llm.example/v1?api_key=<redacted>&v=1"


def test_config_show_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    r, w = os.pipe()
    os.close(r)
    try:
        out = subprocess.run([sys.executable, "-m", "turnkeeper", "config", "show"],
                             stdout=w, stderr=subprocess.PIPE, text=True, timeout=60,
                             check=False)
    finally:
        os.close(w)
    assert out.returncode == 0
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr




def test_turns_lists_with_a_header_and_says_when_there_are_none(start: Any) -> None:
    d = start()
    out = cli("turns", socket=d.socket)
    assert out.returncode == 0 and out.stdout.strip() == "no turns"
    assert cli("dead-letters", socket=d.socket).stdout.strip() == "no dead letters"
    turn = d.run("hello")
    out = cli("turns", socket=d.socket)
    header, row = out.stdout.splitlines()[:2]
    assert header.split()[:2] == ["ID", "STATE"]
    assert row.startswith(turn["id"]) and "completed" in row


def test_turns_pages_with_a_cursor_and_filters_by_since(start: Any) -> None:
    d = start()
    ids = [d.run(f"turn {i}")["id"] for i in range(5)]
    out = cli("turns", "--limit", "2", socket=d.socket)
    rows = out.stdout.splitlines()
    assert [r.split()[0] for r in rows[1:3]] == [ids[4], ids[3]]
    assert rows[-1].startswith("more: turnkeeper turns --before ")
    cursor = rows[-1].split("--before ")[1].split()[0]
    out = cli("turns", "--limit", "2", "--before", cursor, "--output", "json",
              socket=d.socket)
    page = json.loads(out.stdout)
    assert [t["id"] for t in page["turns"]] == [ids[2], ids[1]]
    last = json.loads(cli("turns", "--limit", "2", "--before", str(page["next"]),
                          "--output", "json", socket=d.socket).stdout)
    assert ([t["id"] for t in last["turns"]], last["next"]) == ([ids[0]], None)
    assert json.loads(cli("turns", "--since", "1h", "--output", "json",
                          socket=d.socket).stdout)["next"] is None
    time.sleep(0.3)  # time itself: every turn is older than the 0.2 s window below
    recent = json.loads(cli("turns", "--since", "0.2s", "--output", "json",
                            socket=d.socket).stdout)
    assert recent["turns"] == []
    assert cli("turns", "--since", "7x", socket=d.socket).returncode == 2
    assert d.get("/v1/turns?before=0")[1]["field"] == "before"


def test_turns_refuses_an_unknown_state_naming_the_valid_ones(start: Any) -> None:
    d = start()
    out = cli("turns", "--state", "bogus", socket=d.socket)
    assert out.returncode == 2
    assert "bogus" in out.stderr and "queued" in out.stderr and "completed" in out.stderr
    status, data = d.get("/v1/turns?state=bogus")
    assert status == 400 and data["field"] == "state" and "queued" in data["error"]


def test_turns_refuses_a_zero_or_negative_limit_alike(start: Any) -> None:
    d = start()
    for value in ("0", "-1"):
        out = cli("turns", "--limit", value, socket=d.socket)
        assert out.returncode == 2, out
        assert "at least 1" in out.stderr


def test_submit_takes_a_relative_deadline_and_refuses_a_past_one(start: Any) -> None:
    d = start()
    out = cli("submit", "x", "--deadline", "30m", "--json", socket=d.socket)
    assert out.returncode == 0, out.stderr
    out = cli("submit", "x", "--deadline", "2020-01-01T00:00:00Z", socket=d.socket)
    assert out.returncode == 2 and "already passed" in out.stderr


SLOW = """
[[scenarios]]
[[scenarios.steps]]
delay = 2.0
reply = "done: $message"
"""


def slow_config(tmp_path: Path) -> str:
    return scripted_provider(script_file(tmp_path / "slow.toml", SLOW))


def test_steer_and_answer_say_what_they_did(start: Any, tmp_path: Path) -> None:
    d = start(slow_config(tmp_path))
    turn = d.submit("hello")
    out = cli("steer", turn["id"], "also this", socket=d.socket)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{turn['id']}: steer queued")
    out = cli("answer", turn["id"], "yes", socket=d.socket)
    assert out.returncode == 1 and "asked no question" in out.stderr, out.stderr


@pytest.mark.slow
def test_pause_holds_queued_turns_and_resume_starts_them(start: Any, tmp_path: Path) -> None:
    d = start(slow_config(tmp_path))
    running = d.submit("first")
    out = cli("pause", socket=d.socket)
    assert out.returncode == 0 and out.stdout.startswith("paused"), out
    assert cli("pause", socket=d.socket).stdout.startswith("already paused")
    queued = cli("submit", "second", socket=d.socket)
    assert queued.returncode == 0, queued.stderr  # still accepted, and queued
    second = queued.stdout.strip()
    assert d.wait(running["id"])["state"] == "completed"  # the running one went on
    assert d.get(f"/v1/turns/{second}")[1]["turn"]["state"] == "queued"
    status = cli("status", socket=d.socket)
    assert "PAUSED" in status.stdout
    check = cli("status", "--check", socket=d.socket)
    assert check.returncode == 1 and "paused" in check.stdout
    code, health = d.get("/v1/health")
    assert code == 503 and health["status"] == "degraded"
    out = cli("resume", socket=d.socket)
    assert out.returncode == 0 and out.stdout.startswith("resumed"), out
    assert d.wait(second)["state"] == "completed"
    check = cli("status", "--check", socket=d.socket)
    assert check.returncode == 0 and check.stdout.strip() == "ok"
    assert d.get("/v1/health") == (200, {"status": "ok", "problems": []})


def test_intake_route_takes_only_a_boolean(start: Any) -> None:
    d = start()
    status, data = d.post("/v1/intake", {"open": "no"})
    assert status == 400 and data["field"] == "open"


def test_status_check_without_a_daemon_is_69(tmp_path: Path) -> None:
    out = cli("status", "--check", socket=tmp_path / "none.sock")
    assert out.returncode == 69


def test_status_check_is_69_when_the_socket_turns_the_connection_away(start: Any) -> None:
    """The socket's connection limit answers 503 before the daemon reads the request:
    nothing was learnt of the daemon's health, so it is unreachable, not degraded."""
    d = start("[daemon]\nmax_connections = 1\ncontrol_idle_timeout = 60.0\n")
    held = socket_lib.socket(socket_lib.AF_UNIX, socket_lib.SOCK_STREAM)
    held.connect(str(d.socket))
    try:
        held.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held.recv(65536).startswith(b"HTTP/1.1 200")  # the one slot is ours
        out = cli("status", "--check", socket=d.socket)
    finally:
        held.close()
    assert out.returncode == 69, out.stderr
    assert "too many control connections" in out.stderr


def test_a_socket_option_naming_a_file_that_is_not_a_socket_says_so(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("not a socket\n")
    out = cli("status", socket=plain)
    assert out.returncode == 69
    assert "is not a socket" in out.stderr


def test_an_after_beyond_any_seq_is_refused_naming_the_field(start: Any) -> None:
    d = start()
    status, data = d.get("/v1/events?after=" + "1" + "0" * 24)
    assert status == 400 and data["field"] == "after"
    assert d.get("/v1/status")[0] == 200


FAIL_SCRIPT = """
[[scenarios]]
match = "block"
[[scenarios.steps]]
tool_calls = [{ name = "report_blocked", arguments = { reason = "no access" } }]

[[scenarios]]
[[scenarios.steps]]
reply = "done: $message"
"""


def test_wait_exits_with_the_turn_s_status(start: Any, tmp_path: Path) -> None:
    d = start(scripted_provider(script_file(tmp_path / "s.toml", FAIL_SCRIPT)))
    ok = d.submit("fine")
    out = cli("wait", ok["id"], socket=d.socket)
    assert out.returncode == 0 and "completed" in out.stdout, out
    blocked = d.submit("block me")
    out = cli("wait", blocked["id"], socket=d.socket)
    assert out.returncode == 3, out  # blocked
    assert cli("wait", "t_unknown", socket=d.socket).returncode == 1


def test_retry_submits_a_finished_turn_s_input_again(start: Any) -> None:
    d = start()
    first = d.run("again please", budget={"max_steps": 7})
    out = cli("retry", first["id"], "--wait", "--json", socket=d.socket)
    assert out.returncode == 0, out.stderr
    again = json.loads(out.stdout)
    assert again["id"] != first["id"] and again["message"] == "again please"
    assert again["budget"]["max_steps"] == 7
    assert again["session"] != first["session"]  # its own session, as the first was
    assert cli("retry", "t_unknown", socket=d.socket).returncode == 1


def test_retry_of_an_unfinished_turn_is_refused(start: Any, tmp_path: Path) -> None:
    d = start(slow_config(tmp_path))
    turn = d.submit("slow")
    out = cli("retry", turn["id"], socket=d.socket)
    assert out.returncode == 1 and "not finished" in out.stderr


def test_submit_dash_reads_the_message_from_stdin(start: Any) -> None:
    d = start()
    out = cli("submit", "-", "--wait", "--json", socket=d.socket, stdin="line one\nline two\n")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["message"] == "line one\nline two"
    out = cli("submit", "-", socket=d.socket, stdin="")
    assert out.returncode == 2 and "empty" in out.stderr


def test_events_after_replays_the_store_then_filters(start: Any) -> None:
    d = start()
    first = d.run("one")
    second = d.run("two")
    seqs = [e["seq"] for e in d.events(first["id"])]
    proc = subprocess.Popen(
        [sys.executable, "-m", "turnkeeper", "--socket", str(d.socket), "events", "--json",
         "--after", str(seqs[0]), "--type", "turn.finished"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        got = [json.loads(proc.stdout.readline()) for _ in range(2)]
    finally:
        proc.kill()
        proc.wait()
    assert [e["turn"] for e in got] == [first["id"], second["id"]]
    assert all(e["type"] == "turn.finished" and e["seq"] > seqs[0] for e in got)
    status, _ = d.get("/v1/events?after=-1")
    assert status == 400
    out = cli("events", "--after", "-1", socket=d.socket)
    assert out.returncode == 2


def test_events_for_one_turn_replay_only_its_events(start: Any) -> None:
    d = start()
    first = d.run("one")
    d.run("two")
    proc = subprocess.Popen(
        [sys.executable, "-m", "turnkeeper", "--socket", str(d.socket), "events", "--json",
         "--after", "0", "--turn", first["id"]], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        got = []
        while not got or got[-1]["type"] != "turn.finished":
            got.append(json.loads(proc.stdout.readline()))
    finally:
        proc.kill()
        proc.wait()
    assert {e["turn"] for e in got} == {first["id"]}
    assert [e["seq"] for e in got] == [e["seq"] for e in d.events(first["id"])]


def test_completion_scripts_parse_and_complete_commands(tmp_path: Path) -> None:
    out = cli("completion", "bash")
    assert out.returncode == 0
    script = tmp_path / "c.bash"
    script.write_text(out.stdout)
    probe = subprocess.run(
        ["bash", "-c", f'source {script}; COMP_WORDS=(turnkeeper pa); COMP_CWORD=1; '
         '_turnkeeper; echo "${COMPREPLY[@]}"; '
         'COMP_WORDS=(turnkeeper --socket /x turns --state q); COMP_CWORD=5; '
         '_turnkeeper; echo "${COMPREPLY[@]}"'],
        capture_output=True, text=True, timeout=30, check=False)
    assert probe.stdout.splitlines() == ["pause", "queued"], probe
    zsh = cli("completion", "zsh")
    assert zsh.returncode == 0 and "bashcompinit" in zsh.stdout
    assert cli("completion", "tcsh").returncode == 2


def test_top_shows_every_live_turn_with_its_budget_use(start: Any, tmp_path: Path) -> None:
    d = start(slow_config(tmp_path))
    turn = d.submit("watch me", budget={"max_steps": 9})
    out = cli("top", "--once", socket=d.socket)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if turn["id"] in line)
    # The message is the last column, cut to the terminal's width ("watch …").
    assert "watch" in row and ("running" in row or "queued" in row)
    snap = json.loads(cli("top", "--json", socket=d.socket).stdout)
    assert [t["id"] for t in snap["turns"]] == [turn["id"]]
    d.wait(turn["id"])
    assert "no live turns" in cli("top", "--once", socket=d.socket).stdout
    assert cli("top", "--interval", "0", socket=d.socket).returncode == 2


def test_the_installed_example_config_starts_and_runs_a_turn_offline(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    # The file as installed, with the socket and the state directory from the environment
    # the unit gives the daemon.
    example = Path(__file__).resolve().parents[2] / "config" / "turnkeeper.example.toml"
    d = Daemon(tmp_path, name="installed")
    d.config_path = example
    d.env_extra = {"TURNKEEPER_SOCKET": str(d.socket), "STATE_DIRECTORY": str(d.state_dir)}
    daemons.append(d)
    d.start()
    out = cli("submit", "hello", "--wait", "--json", socket=d.socket)
    assert out.returncode == 0, out.stderr
    turn = json.loads(out.stdout)
    assert turn["state"] == "completed" and turn["provider"] == "offline"
    assert cli("config", "check", str(example)).returncode == 0


def test_listings_print_the_api_json_with_output_json_and_columns_with_table(
        start: Any) -> None:
    from tests.integration.fault_server import FaultServer, fail, ok

    faults = FaultServer().start()
    try:
        faults.script("good", then=ok("fine"))
        faults.script("bad", then=fail(401, error_type="authentication_error"))
        providers = "\n".join(
            f'[[providers]]\nname = "{n}"\nkind = "openai"\nbase_url = "{faults.base_url(n)}"\n'
            f'model = "m"\nstream = false\n' for n in ("good", "bad"))
        d = start(providers + '\n[models.broken]\nchain = ["bad"]\n')
        done = d.run("hello")
        dead = d.run("hello", model="broken")
        assert dead["result"]["stopped_because"]["code"] == "providers.rejected"

        for args, path in ((("turns",), "/v1/turns?limit=50"),
                           (("dead-letters",), "/v1/dead-letters"),
                           (("limits", "report"), "/v1/limits/report?factor=2.5")):
            out = cli(*args, "--output", "json", socket=d.socket)
            assert out.returncode == 0, out.stderr
            status, api = d.get(path)
            assert status == 200
            assert json.loads(out.stdout) == api, args
            assert cli(*args, "-o", "json", socket=d.socket).stdout == out.stdout
            assert cli(*args, "--json", socket=d.socket).stdout == out.stdout
            table = cli(*args, "--output", "table", socket=d.socket)
            assert table.returncode == 0 and table.stdout == cli(*args, socket=d.socket).stdout
            assert not table.stdout.lstrip().startswith(("{", "["))
            both = cli(*args, "--json", "--output", "table", socket=d.socket)
            assert both.returncode == 2 and "two formats" in both.stderr

        listed = json.loads(cli("turns", "-o", "json", socket=d.socket).stdout)["turns"]
        assert {t["id"] for t in listed} == {done["id"], dead["id"]}
        rows = cli("turns", "-o", "table", socket=d.socket).stdout.splitlines()
        assert rows[0].split()[:2] == ["ID", "STATE"] and len(rows) == 3
        letters = cli("dead-letters", "-o", "table", socket=d.socket).stdout.splitlines()
        assert len(letters) == 1 and letters[0].startswith(dead["id"])
        assert "providers.rejected" in letters[0]
        bad = cli("turns", "--output", "yaml", socket=d.socket)
        assert bad.returncode == 2 and "json" in bad.stderr and "table" in bad.stderr
    finally:
        faults.stop()
