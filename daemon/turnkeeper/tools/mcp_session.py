"""What the daemon says to an MCP server over one connection, through the SDK: the
transport opened (a stdio child, its stderr pumped line by line into the daemon's log,
or a streamable-HTTP client), the handshake and the paged tool listing, and one tool
call, its answer or its error read as a `ToolOutcome`.

Kept apart from `mcp.py`, which supervises the connection (when to open it, how it is
watched, when to start it again) and decides what is offered: nothing here outlives one
connection, and nothing is retried or restarted. The SDK is imported inside the
functions that use it, so the rest of the daemon (and the CLI) runs without it.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, cast

import anyio
import structlog
from anyio.abc import TaskGroup

from turnkeeper import __version__
from turnkeeper.config import ToolConfig
from turnkeeper.policy.classify import CallFailure, exception_names
from turnkeeper.policy.tool_traits import CALL_TIMED_OUT, rpc_error_names, tool_error_names
from turnkeeper.tools.mcp_tool import (
    IDEMPOTENCY_META_KEY,
    MAX_LIST_PAGES,
    STDERR_LINE_CHARS,
    ConnectTimeout,
    McpTool,
    WatchedStream,
    describe_error,
    result_text,
)
from turnkeeper.tools.outcome import ToolOutcome, truncate

if TYPE_CHECKING:
    import mcp_types
    from mcp import ClientSession
    from mcp.client.session import MessageHandlerFnT

log = structlog.get_logger("turnkeeper.mcp")


@asynccontextmanager
async def open_session(cfg: ToolConfig, *, on_end: Callable[[], None],
                       on_message: MessageHandlerFnT,
                       ) -> AsyncIterator[tuple[ClientSession, list[mcp_types.Tool]]]:
    """A connection to the server `cfg` names, its handshake done and its tools listed
    (both within `connect_timeout`), held open until the block ends. `on_end` is called
    the moment the server's stream ends; `on_message` receives what the server sends
    unasked (notifications, transport errors)."""
    from mcp import ClientSession
    from mcp_types import Implementation

    async with AsyncExitStack() as stack:
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        read, write = await _open(cfg, stack, tg)
        session = ClientSession(
            WatchedStream(read, on_end), write, message_handler=on_message,
            client_info=Implementation(name="turnkeeper", version=__version__))
        await stack.enter_async_context(session)
        try:
            with anyio.fail_after(cfg.connect_timeout):
                await session.initialize()
                listing = await list_tools(session)
        except TimeoutError:
            raise ConnectTimeout(f"no answer to the handshake within "
                                 f"{cfg.connect_timeout:g} s") from None
        yield session, listing


async def _open(cfg: ToolConfig, stack: AsyncExitStack, tg: TaskGroup) -> tuple[Any, Any]:
    if cfg.command:
        from mcp.client.stdio import StdioServerParameters, stdio_client

        params = StdioServerParameters(command=cfg.command, args=list(cfg.args),
                                       env=cfg.resolved_env() or None)
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        errlog = os.fdopen(write_fd, "w")
        try:
            streams = await stack.enter_async_context(stdio_client(params, errlog=errlog))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            errlog.close()  # the server holds its own copy
        tg.start_soon(_pump_stderr, cfg.name, read_fd, name=f"mcp server {cfg.name} stderr")
        return streams
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    client = httpx2.AsyncClient(headers=cfg.resolved_headers(),
                                timeout=httpx2.Timeout(cfg.connect_timeout, read=300.0))
    await stack.enter_async_context(client)
    return await stack.enter_async_context(
        streamable_http_client(cfg.url, http_client=client))


async def _pump_stderr(server: str, fd: int) -> None:
    """A stdio server's stderr, line by line into the daemon's log (attributed)."""
    pending = b""
    try:
        while True:
            await anyio.wait_readable(fd)
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            if len(pending) > 65536:
                lines.append(pending)
                pending = b""
            for line in lines:
                _log_stderr(server, line)
    finally:
        if pending:
            _log_stderr(server, pending)
        os.close(fd)


def _log_stderr(server: str, line: bytes) -> None:
    text = line.decode("utf-8", errors="replace").rstrip()
    if text:
        log.info("mcp.server_stderr", server=server, line=text[:STDERR_LINE_CHARS])


async def list_tools(session: ClientSession) -> list[mcp_types.Tool]:
    """Every tool the server lists, page after page (at most `MAX_LIST_PAGES`)."""
    from mcp_types import PaginatedRequestParams

    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    for _ in range(MAX_LIST_PAGES):
        result = await session.list_tools(
            params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools.extend(result.tools)
        cursor = result.next_cursor
        if not cursor:
            break
    return tools


async def call_tool(session: ClientSession, tool: McpTool, args: dict[str, Any], *,
                    server: str, idempotency_key: str, timeout_s: float,
                    on_suspect: Callable[[], None],
                    traceparent: str | None = None) -> ToolOutcome:
    """One attempt on a connection that is up. The idempotency key travels in the
    request's `_meta`, for servers that want to deduplicate, and so does the call's W3C
    `traceparent` when it has one. `on_suspect` is called when the error suggests the
    connection itself has failed, so that it is checked."""
    from mcp import MCPError

    meta: dict[str, Any] = {IDEMPOTENCY_META_KEY: idempotency_key}
    if traceparent is not None:
        meta["traceparent"] = traceparent
    try:
        with anyio.move_on_after(timeout_s) as scope:
            result = await session.call_tool(tool.remote, args, meta=cast(
                "mcp_types.RequestParamsMeta", meta))
    except MCPError as exc:
        names, suspect = rpc_error_names(exc.code, exc.message)
        if suspect:
            on_suspect()
        return ToolOutcome(content="", failure=CallFailure(
            exception=names, message=f"MCP server {server}: {exc.message}"[:1000]))
    except Exception as exc:
        return ToolOutcome(content="", failure=CallFailure(
            exception=exception_names(exc),
            message=f"MCP server {server}: {describe_error(exc)}"))
    if scope.cancelled_caught:
        # The request went out: a non-idempotent tool may have done it.
        return ToolOutcome(content="", unknown=not tool.idempotent, failure=CallFailure(
            exception=CALL_TIMED_OUT,
            message=f"{tool.name} did not answer within {timeout_s:.3g} s; "
                    "the request was cancelled"))
    text = result_text(result.content, result.structured_content)
    if result.is_error:
        return ToolOutcome(content=truncate(text), failure=CallFailure(
            exception=tool_error_names(text), message=text[:1000] or "isError"))
    structured = result.structured_content
    state = structured.get("state") if isinstance(structured, dict) else None
    return ToolOutcome(content=truncate(text),
                       state=None if state is None else json.dumps(state, sort_keys=True))
