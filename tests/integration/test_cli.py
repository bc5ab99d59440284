"""The `turnkeeper` command against the real daemon: what operators type, what it prints
and the exit status it ends with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.harness import Daemon
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


