"""The tools of the test MCP servers, written with the official SDK (`MCPServer`). Each
tool leaves traces in a directory the test owns, so a test sees what the server did:
`pids/<pid>` for every server process, `ledger` for effects, `<tool>.started` /
`<tool>.cancelled` markers. Run by stdio_server.py and http_server.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import Tool, ToolAnnotations, ToolExecution

READ_ONLY = ToolAnnotations(read_only_hint=True)
IDEMPOTENT = ToolAnnotations(idempotent_hint=True, destructive_hint=False)
DESTRUCTIVE = ToolAnnotations(destructive_hint=True)
ALL_FALSE = ToolAnnotations(read_only_hint=False, destructive_hint=False,
                            idempotent_hint=False)
BOTH = ToolAnnotations(destructive_hint=True, idempotent_hint=True)
NEEDS_TASKS = {"long_job"}  # listed with execution.taskSupport = "required"


class _Server(MCPServer):
    """The SDK's server, listing the NEEDS_TASKS tools as requiring MCP tasks (its
    decorator has no argument for it)."""

    async def list_tools(self) -> list[Tool]:
        return [t.model_copy(update={"execution": ToolExecution(task_support="required")})
                if t.name in NEEDS_TASKS else t for t in await super().list_tools()]


def build(name: str, workdir: Path) -> MCPServer:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "pids").mkdir(exist_ok=True)
    (workdir / "pids" / str(os.getpid())).write_text(" ".join(sys.argv))
    server = _Server(name, log_level="WARNING")

    def mark(what: str) -> None:
        (workdir / what).write_text(str(os.getpid()))

    def record(line: str) -> None:
        with open(workdir / "ledger", "a") as f:
            f.write(line + "\n")

    async def hold() -> None:
        """While the test keeps a `hold` file, the call stays in flight."""
        while (workdir / "hold").exists():  # noqa: ASYNC110 - a file the test removes
            await anyio.sleep(0.02)

    def key(ctx: Context) -> str:
        meta = ctx.request_context.meta or {}
        return str(meta.get("turnkeeper/idempotency-key", ""))

    @server.tool(annotations=READ_ONLY)
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool(annotations=READ_ONLY)
    def pid() -> int:
        """The server's process id."""
        return os.getpid()

    @server.tool(annotations=READ_ONLY)
    def whoami(ctx: Context) -> str:
        """What the server was given: the Authorization header (HTTP) or $TOKEN (stdio)."""
        headers = ctx.headers or {}
        return str(headers.get("authorization") or os.environ.get("TOKEN", ""))

    @server.tool(annotations=IDEMPOTENT)
    async def put(k: str, v: str, ctx: Context) -> str:
        """Store a value (idempotent, not destructive)."""
        record(f"put {k}={v} {key(ctx)}")
        return "stored"

    @server.tool(annotations=DESTRUCTIVE)
    async def charge(account: str, amount: int, ctx: Context) -> str:
        """Charge an account (destructive: never to be repeated)."""
        record(f"charge {account} {amount} {key(ctx)}")
        await hold()
        return f"charged {account} {amount}"

    @server.tool(annotations=READ_ONLY)
    async def lookup(account: str, ctx: Context) -> str:
        """Read an account (read-only: safe to run again)."""
        record(f"lookup {account} {key(ctx)}")
        await hold()
        return f"account {account}: ok"

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleep, then answer. No annotations."""
        mark("slow.started")
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            mark("slow.cancelled")
            raise
        return f"slept {seconds}"

    @server.tool()
    def boom() -> str:
        """Crash the server in the middle of the call."""
        mark("boom")
        os._exit(3)

    @server.tool(annotations=READ_ONLY)
    def fail(message: str) -> str:
        """Answer with isError and the given text."""
        raise ToolError(message)

    @server.tool(annotations=ALL_FALSE)
    def quiet() -> str:
        """Every hint given, all false."""
        return "quiet"

    @server.tool(annotations=READ_ONLY)
    def trace_meta(ctx: Context) -> str:
        """The W3C traceparent the request carried in its `_meta` ("" without one)."""
        meta = ctx.request_context.meta or {}
        return str(meta.get("traceparent", ""))

    @server.tool(annotations=BOTH)
    def wipe() -> str:
        """Destructive and idempotent, as its server says."""
        return "wiped"

    @server.tool()
    def long_job() -> str:
        """Requires MCP tasks: never offered."""
        return "should never be called"

    @server.tool()
    def secret_admin() -> str:
        """A tool the operator excludes."""
        return "should never be called"

    return server
