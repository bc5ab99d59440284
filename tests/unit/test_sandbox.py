"""Which stdio MCP servers cannot start where writable and executable memory is denied
(`lifecycle/sandbox.py`): the runtime a command starts, and this process's own state."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnkeeper.config import ToolConfig
from turnkeeper.lifecycle import sandbox
from turnkeeper.lifecycle.sandbox import jit_runtime, jit_server_problems


@pytest.mark.parametrize(("command", "args", "env", "runtime"), [
    ("npx", ["-y", "@modelcontextprotocol/server-filesystem", "/srv"], {}, "Node.js"),
    ("/usr/bin/node", ["server.js"], {}, "Node.js"),
    ("node20", ["server.js"], {}, "Node.js"),
    ("deno", ["run", "server.ts"], {}, "Deno"),
    ("bunx", ["some-server"], {}, "Bun"),
    ("java", ["-jar", "server.jar"], {}, "a JVM"),
    ("dotnet", ["server.dll"], {}, ".NET"),
    ("uvx", ["mcp-server-fetch"], {}, None),
    ("/usr/bin/python3.12", ["server.py"], {}, None),
    ("node", ["--jitless", "server.js"], {}, None),
    ("npx", ["-y", "server"], {"NODE_OPTIONS": "--max-old-space-size=512 --jitless"}, None),
])
def test_the_runtime_a_command_starts_is_named_unless_told_not_to_compile(
        command: str, args: list[str], env: dict[str, str], runtime: str | None) -> None:
    assert jit_runtime(command, args, env) == runtime


def test_only_stdio_servers_on_a_jit_are_reported_with_the_remedy() -> None:
    tools = [
        ToolConfig(name="fs", kind="mcp", command="npx", args=("-y", "server-fs", "/srv")),
        ToolConfig(name="fetch", kind="mcp", command="uvx", args=("mcp-server-fetch",)),
        ToolConfig(name="remote", kind="mcp", url="http://127.0.0.1:8931/mcp"),
        ToolConfig(name="quiet", kind="mcp", command="node", args=("s.js",),
                   env={"NODE_OPTIONS": "--jitless"}),
        ToolConfig(name="web", kind="http", url="http://127.0.0.1:9/x"),
    ]
    problems = jit_server_problems(tools, "PR_SET_MDWE is in effect")
    assert len(problems) == 1
    assert problems[0].startswith("MCP server 'fs' (npx) runs on Node.js, a JIT that cannot "
                                  "start here: PR_SET_MDWE is in effect.")
    assert "MemoryDenyWriteExecute=no" in problems[0] and "--jitless" in problems[0]


def test_this_process_is_not_denied_writable_and_executable_memory() -> None:
    # The test runner runs unconfined: the probe's mapping is granted (and released).
    if sandbox._mdwe_flags():
        pytest.skip("this test run itself is under PR_SET_MDWE")
    assert sandbox.write_execute_denied() is None


def test_the_seccomp_mode_is_read_from_proc() -> None:
    assert sandbox._seccomp_mode() in (0, 1, 2)
    assert sandbox._seccomp_mode(Path("/nonexistent")) == 0
