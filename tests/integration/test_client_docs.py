"""docs/client.md: every Python example on the page runs as written against a daemon
(the socket found the way `Client()` finds it, TURNKEEPER_SOCKET here)."""

from __future__ import annotations

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
