"""Stdio MCP servers under the daemon's sandbox, on the real kernel: a Node.js server (a
JIT, as every `npx` server is) runs under the shipped systemd unit's restrictions, and
where writable and executable memory is denied (PR_SET_MDWE, what systemd's
MemoryDenyWriteExecute=yes does on newer kernels) start-up and `config check` name the
server and the remedy.

The daemon is started through a shim that sets PR_SET_MDWE and execs it: the denial is
then the kernel's own, inherited by every child as it is under systemd."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.harness import Daemon, script_file

REPO = Path(__file__).resolve().parents[2]
NODE_SERVER = Path(__file__).parent / "mcp_servers" / "node_server.js"
UNIT = REPO / "systemd" / "turnkeeper.service"

# Deny writable and executable memory to this process and its children, then exec argv.
MDWE_SHIM = """
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE
    sys.exit("PR_SET_MDWE: " + os.strerror(ctypes.get_errno()))
os.execv(sys.argv[1], sys.argv[1:])
"""
MDWE = (sys.executable, "-c", MDWE_SHIM)

SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
tool_calls = [{ name = "js__echo", arguments = { text = "hello" } }]
[[scenarios.steps]]
reply = "$last_tool_result"
"""

pytestmark = [
    pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js"),
    pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_MDWE is Linux's"),
]


def mdwe_supported() -> bool:
    """Whether this kernel has PR_SET_MDWE (6.3 and later): asked of a child, which is
    left denied."""
    out = subprocess.run([*MDWE, sys.executable, "-c", "pass"], capture_output=True,
                         timeout=30, check=False)
    return out.returncode == 0


def unit_denies_write_execute() -> bool:
    return any(line.strip() == "MemoryDenyWriteExecute=yes"
               for line in UNIT.read_text().splitlines())


def node_config(tmp_path: Path) -> str:
    path = script_file(tmp_path / "script.toml", SCRIPT)
    return f"""
[[providers]]
name = "scripted"
kind = "scripted"
script = "{path}"

[[tools]]
name = "js"
kind = "mcp"
command = "{shutil.which("node")}"
args = ["{NODE_SERVER}"]
connect_timeout = 10.0
"""


def test_a_node_mcp_server_runs_under_the_shipped_units_restrictions(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    if unit_denies_write_execute() and not mdwe_supported():
        pytest.skip("the unit denies W+X memory and this kernel cannot do so (< 6.3)")
    d = Daemon(tmp_path, node_config(tmp_path),
               wrapper=MDWE if unit_denies_write_execute() else ())
    daemons.append(d)
    d.start()
    turn = d.run("say hello through node")
    assert turn["state"] == "completed", (turn["result"], d.log_text()[-3000:])
    assert "echoes: hello" in turn["result"]["answer"]
    assert not [r for r in d.log_records() if r.get("event") == "mcp.server_cannot_start"]


def test_where_write_execute_memory_is_denied_start_up_and_config_check_name_the_remedy(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    if not mdwe_supported():
        pytest.skip("this kernel has no PR_SET_MDWE (< 6.3)")
    d = Daemon(tmp_path, node_config(tmp_path), wrapper=MDWE)
    daemons.append(d)
    d.start(wait=False)
    deadline = time.monotonic() + 30
    while not (said := [r for r in d.log_records()
                        if r.get("event") == "mcp.server_cannot_start"]):
        assert time.monotonic() < deadline, d.log_text()[-3000:]
        time.sleep(0.05)
    assert said[0]["level"] == "warning"
    assert said[0]["error"].startswith(
        "MCP server 'js' (" + str(shutil.which("node")) + ") runs on Node.js, a JIT that "
        "cannot start here: PR_SET_MDWE is in effect")
    assert "MemoryDenyWriteExecute=no" in said[0]["error"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
    check = [sys.executable, "-m", "turnkeeper", "config", "check", str(d.config_path)]
    denied = subprocess.run([*MDWE, *check], env=env, capture_output=True, text=True,
                            timeout=60, check=False)
    assert denied.returncode == 0, denied.stderr  # the file is valid; the host is not
    assert "turnkeeper: warning: MCP server 'js'" in denied.stderr
    assert "MemoryDenyWriteExecute=no" in denied.stderr and "--jitless" in denied.stderr
    free = subprocess.run(check, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert free.returncode == 0 and "warning" not in free.stderr, free.stderr
    # What the warning is about: the server itself cannot start under the denial.
    crashed = subprocess.run([*MDWE, str(shutil.which("node")), "-e", "1"],
                             capture_output=True, timeout=60, check=False)
    assert crashed.returncode != 0
