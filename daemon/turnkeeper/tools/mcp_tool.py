"""What an MCP server's tools look like to the daemon: `McpTool` (one tool as offered,
with its traits), the server's errors, and the helpers that render an MCP result or error
as text. Kept apart from `mcp.py`, which owns the connection, so the offer and the
rendering can be read (and tested) without the connection's lifecycle."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from jsonschema import Draft202012Validator

from turnkeeper.errors import TurnkeeperError
from turnkeeper.messages import ToolSpec

if TYPE_CHECKING:
    pass


log = structlog.get_logger("turnkeeper.mcp")

IDEMPOTENCY_META_KEY = "turnkeeper/idempotency-key"
MAX_LIST_PAGES = 100
STDERR_LINE_CHARS = 2000


class ServerGone(TurnkeeperError):
    """The server closed the connection (a stdio server exited)."""


class ConnectTimeout(TurnkeeperError):
    """The server did not answer the handshake or a ping in time."""


@dataclass(frozen=True, slots=True, eq=False)
class McpTool:
    """One tool of one MCP server as the daemon offers it: `name` is `server__tool`,
    `remote` the server's own name for it. Read by the runner like a ToolConfig
    (`idempotent`, `polling`, `timeout`, `breaker`)."""

    name: str
    remote: str
    server: str
    description: str
    parameters: dict[str, Any]
    idempotent: bool
    destructive: bool
    polling: bool
    timeout: float
    because: str
    validator: Draft202012Validator | None = field(default=None, repr=False)

    kind = "mcp"

    @property
    def breaker(self) -> str:
        return f"tool:{self.server}"

    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(name=self.name, description=self.description,
                        parameters=self.parameters)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "remote": self.remote, "idempotent": self.idempotent,
                "destructive": self.destructive, "polling": self.polling,
                "because": self.because}


class WatchedStream:
    """The transport's read stream, passed through to the session; tells the server task
    the moment it ends (the SDK's dispatcher otherwise ends its loop silently)."""

    def __init__(self, inner: Any, on_end: Callable[[], None]) -> None:
        self._inner = inner
        self._on_end = on_end

    @property
    def last_context(self) -> Any:
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_end()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> WatchedStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> WatchedStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc_val: BaseException | None, exc_tb: TracebackType | None) -> None:
        await self.aclose()


def describe_error(exc: BaseException) -> str:
    """One line for logs and status: the innermost exceptions of a group, type and text."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            leaves.append(e)

    walk(exc)
    parts = [f"{type(e).__name__}: {e}" if str(e) else type(e).__name__ for e in leaves[:2]]
    return "; ".join(parts)[:500] or type(exc).__name__


def result_text(content: Iterable[Any], structured: Any) -> str:
    """A tool result as the text the model reads: text blocks as they are, other blocks
    described; the structured result when there is no content at all."""
    parts: list[str] = []
    for block in content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(str(block.text))
        elif kind in ("image", "audio"):
            size = len(getattr(block, "data", "") or "") * 3 // 4
            parts.append(f"[{kind} {getattr(block, 'mime_type', '')}, about {size} bytes]")
        elif kind == "resource_link":
            parts.append(f"[resource {getattr(block, 'uri', '')}]")
        elif kind == "resource":
            res = getattr(block, "resource", None)
            text = getattr(res, "text", None)
            parts.append(str(text) if text is not None
                         else f"[resource {getattr(res, 'uri', '')}, binary]")
        else:
            parts.append(f"[{kind or 'unknown'} content]")
    if not parts and structured is not None:
        return json.dumps(structured, ensure_ascii=False, sort_keys=True)
    return "\n".join(parts)
