"""Secrets the daemon holds never come back through a tool: a tool that hands back its
credentials (or a provider's key) has them replaced before its result is stored, shown
or sent to a model. The daemon, a model server and a tool server are real, on
127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.fault_server import ok
from tests.integration.fault_server import running as fault_server
from tests.integration.harness import Daemon
from tests.integration.test_effects import http_tool, of_type
from tests.integration.tool_server import Reply, ToolServer

TOOL_TOKEN = "tok-4f9c2a7e1b3d5f60"
PROVIDER_KEY = "sk-fault-8e1d2c3b4a596877"


def test_a_tool_that_echoes_its_credentials_has_them_redacted_everywhere(
        tmp_path: Path, tool_server: ToolServer) -> None:
    """The tool hands back its Authorization header and the provider's key: neither
    reaches the events, the stored turn, the state directory, the log or the next
    model request; the rest of the answer does."""
    tool_server.respond("/whoami", Reply(200, {"user": "ada", "leak": PROVIDER_KEY},
                                         echo_headers=("Authorization",)))
    with fault_server() as faults:
        faults.script("fault", ok("", tool_calls=(("whoami", {}),)), then=ok("done"))
        config = f"""
[[providers]]
name = "fault"
kind = "openai"
base_url = "{faults.base_url('fault')}"
model = "m"
api_key_env = "FAULT_KEY"
stream = false
""" + http_tool(tool_server, "whoami", idempotent=True,
                extra='headers = { Authorization = "env:WHOAMI_AUTH" }')
        daemon = Daemon(tmp_path, config, name="secrets",
                        env={"WHOAMI_AUTH": f"Bearer {TOOL_TOKEN}",
                             "FAULT_KEY": PROVIDER_KEY}).start()
        try:
            turn = daemon.run("who am I?")
            events = daemon.events(turn["id"])
            status, stored = daemon.get(f"/v1/turns/{turn['id']}")
            daemon.stop()
        finally:
            daemon.kill()
        second = faults.requests("fault")[1].body
    assert turn["state"] == "completed", turn["result"]
    [call] = tool_server.calls("/whoami")
    assert call.headers["Authorization"] == f"Bearer {TOOL_TOKEN}"  # it was sent
    [told] = [m["content"] for m in second["messages"] if m["role"] == "tool"]
    assert json.loads(told) == {"user": "ada", "leak": "[redacted]",
                                "headers": {"Authorization": "[redacted]"}}
    [result] = of_type(events, "tool.result", tool="whoami")
    assert result["content"] == told
    kept = [json.dumps(events), json.dumps(stored), daemon.log_text()]
    kept += [f.read_bytes().decode("utf-8", "replace")
             for f in daemon.state_dir.rglob("*") if f.is_file()]
    assert status == 200 and all(
        TOOL_TOKEN not in text and PROVIDER_KEY not in text for text in kept)
