"""docs/client.md: every Python example on the page runs as written against a daemon
(the socket found the way `Client()` finds it, TURNKEEPER_SOCKET here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import ECHO_TOOL, script_file, scripted_provider

PAGE = Path(__file__).resolve().parents[2] / "docs" / "client.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)

SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
delay = 0.02
tool_calls = [{ name = "echo", arguments = { text = "$message" } }]
[[scenarios.steps]]
reply = "You said: $message"
"""


def test_the_page_has_examples() -> None:
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_every_example_of_the_client_page_runs(start: Any, tmp_path: Path, example: str
                                               ) -> None:
    d = start(scripted_provider(script_file(tmp_path / "script.toml", SCRIPT)) + ECHO_TOOL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
    env["TURNKEEPER_SOCKET"] = str(d.socket)
    run = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert run.returncode == 0, f"{example}\n{run.stderr}"


def test_the_daemon_serves_docs_openapi_json_and_answers_as_it_describes(
        start: Any, tmp_path: Path) -> None:
    from jsonschema import Draft202012Validator

    d = start(scripted_provider(script_file(tmp_path / "script.toml", SCRIPT)) + ECHO_TOOL)
    sock = d.client
    status, doc = sock.request("GET", "/v1/openapi.json")
    assert status == 200
    assert doc == json.loads((PAGE.parent / "openapi.json").read_text(encoding="utf-8"))

    def check(name: str, value: Any) -> None:
        schema = {**doc["components"]["schemas"][name], "components": doc["components"]}
        Draft202012Validator(schema).validate(value)

    status, answer = sock.request("POST", "/v1/turns", {"message": "described"})
    assert status == 202
    check("TurnAnswer", answer)
    turn_id = answer["turn"]["id"]
    d.wait(turn_id)
    check("TurnAnswer", sock.request("GET", f"/v1/turns/{turn_id}")[1])
    for event in sock.stream(f"/v1/turns/{turn_id}/events"):
        check("Event", event)
    status, batch = sock.request("POST", "/v1/turns", [{"message": "a"}, {"message": "b"}])
    assert status == 202
    check("BatchAnswer", batch)
    for bad in ({"message": ""}, {"message": "x", "colour": "red"}, {"message": 5}):
        status, err = sock.request("POST", "/v1/turns", bad)
        assert status == 400
        check("Error", err)
        assert err["field"]
    # What the description forbids, the daemon refuses.
    body = doc["components"]["schemas"]["SubmitBody"]
    assert body["additionalProperties"] is False
