"""The `turnkeeper` command against the real daemon: what operators type, what it prints
and the exit status it ends with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.integration.harness import Daemon, script_file, scripted_provider
from turnkeeper.control.client import Client


def cli(*args: str, socket: Path | None = None, env: dict[str, str] | None = None,
        stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = [sys.executable, "-m", "turnkeeper"]
    if socket is not None:
        base += ["--socket", str(socket)]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
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
    cfg.write_text("")
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "rt"), "XDG_STATE_HOME": str(tmp_path / "st")}
    out = cli("config", "show", "--config", str(cfg), env=env)
    assert out.returncode == 0, out.stderr
    daemon = json.loads(out.stdout)["daemon"]
    assert daemon["socket"] == str(tmp_path / "rt" / "turnkeeper" / "control.sock")
    assert daemon["state_dir"] == str(tmp_path / "st" / "turnkeeper")
    out = cli("--socket", "/x/y.sock", "config", "show", "--config", str(cfg), env=env)
    assert json.loads(out.stdout)["daemon"]["socket"] == "/x/y.sock"


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
