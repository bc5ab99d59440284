"""The tools of one policy: specs to offer, argument checks, and one attempt of a call.

Argument problems are the model's failures and are classified deterministic before any
request is made: malformed JSON, an unknown tool, a schema violation (`arguments.py`).
Retrying, breakers and the journal live in the runner; a call here is one attempt.

Tools of kind `mcp` come from supervised MCP server connections (`tools/mcp.py`): the
offer (`specs`, `offer.py`) follows their state, so the runner asks for it at every model
call. A ToolBox owns the server tasks it starts (`start(tg)`, `aclose()`); a ToolBox
built on a reload reuses the servers whose config did not change.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import aiohttp
from anyio.abc import TaskGroup
from jsonschema import Draft202012Validator

from turnkeeper.config import ToolConfig
from turnkeeper.messages import ToolSpec
from turnkeeper.policy.agents import EVERY_TOOL, ToolSelection
from turnkeeper.policy.classify import CallFailure, Redactor
from turnkeeper.policy.tool_traits import NAME_SEPARATOR
from turnkeeper.tools.arguments import ArgumentChecker, ArgumentProblem, Checked, parse_arguments
from turnkeeper.tools.builtin import BUILTIN_SPECS
from turnkeeper.tools.http import call_http
from turnkeeper.tools.mcp import McpServer
from turnkeeper.tools.mcp_tool import McpTool
from turnkeeper.tools.offer import Offer
from turnkeeper.tools.outcome import MAX_RESULT_CHARS, ToolOutcome, truncate
from turnkeeper.tools.plain_schema import plain_check

__all__ = ["MAX_RESULT_CHARS", "ArgumentProblem", "ToolBox", "ToolOutcome", "plain_check"]

_truncate = truncate
BUILTIN_NAMES = frozenset(b.name for b in BUILTIN_SPECS)

# A secret shorter than this is not looked for in tool results: a placeholder key ("x",
# "none", "dummy") would blank out ordinary words, and hides nothing.
MIN_SECRET_CHARS = 8


# The echo tool's answer: json.dumps(args, ensure_ascii=False, sort_keys=True), with the
# encoder built once (json.dumps with options builds one per call).
_ECHO = json.JSONEncoder(ensure_ascii=False, sort_keys=True)


class ToolBox:
    def __init__(self, tools: tuple[ToolConfig, ...], *,
                 previous: ToolBox | None = None, secrets: Iterable[str] = ()) -> None:
        """`secrets`: the daemon's other secrets (the providers' keys and headers),
        removed from every tool's results with the tools' own (`secret_values`)."""
        static = tuple(t for t in tools if t.kind != "mcp")
        self._redactor = Redactor(
            (*secrets, *(v for t in tools for v in t.secret_values())),
            min_chars=MIN_SECRET_CHARS)
        self._tools = {t.name: t for t in static}
        self._arguments = ArgumentChecker(BUILTIN_SPECS, static)
        self._servers: dict[str, McpServer] = {}
        old = previous._servers if previous is not None else {}
        for t in tools:
            if t.kind == "mcp":
                reuse = old.get(t.name)
                self._servers[t.name] = (reuse if reuse is not None and reuse.cfg == t
                                         else McpServer(t))
        # No MCP server: the offer is the same for as long as this ToolBox serves.
        self.offer_fixed = not self._servers
        self._offer = Offer(BUILTIN_SPECS + tuple(
            ToolSpec(name=t.name, description=t.description or t.name,
                     parameters=t.parameters) for t in static), BUILTIN_NAMES, self._servers)
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"ToolBox({sorted(self._tools)}, mcp={sorted(self._servers)})"

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        """What is offered now: built-ins, configured tools, and the tools of every MCP
        server that is up. The same tuple until an offer changes (providers cache the
        encoded tools by identity)."""
        return self._offer.specs

    def specs_for(self, tools: ToolSelection) -> tuple[ToolSpec, ...]:
        """What is offered to an agent that may call `tools`: the built-ins and the
        tools of `specs` it selects. The same tuple while the offer does not change."""
        return self._offer.specs_for(tools)

    def specs_tokens(self, tools: ToolSelection) -> int:
        """The input tokens the offer to an agent that may call `tools` (`specs_for`)
        adds to a request, estimated on the large side: sized once per offer, for every
        turn, not at each model call."""
        return self._offer.tokens_for(tools)

    def offer_note(self, previous: frozenset[str] | None,
                   tools: ToolSelection = EVERY_TOOL) -> tuple[frozenset[str], str | None]:
        """The names offered now to an agent that may call `tools`, and a note for it
        when MCP tools left or came back since `previous` (None: the turn's first look,
        which reports servers that are down)."""
        return self._offer.note(previous, tools)

    def get(self, name: str) -> ToolConfig | McpTool | None:
        tool = self._tools.get(name)
        if tool is not None:
            return tool
        server_name, sep, _ = name.partition(NAME_SEPARATOR)
        server = self._servers.get(server_name) if sep else None
        return server.lookup(name) if server is not None else None

    @staticmethod
    def parse_arguments(name: str, arguments: str) -> Checked:
        """A call's arguments as the JSON object they must be, whatever tool `name` is
        (none at all, for a call the journal answers after its tool went)."""
        return parse_arguments(name, arguments)

    def check_arguments(self, name: str, arguments: str) -> Checked:
        """Parse and validate before anything is sent."""
        return self._arguments.check(name, arguments, self._mcp_validator)

    def _mcp_validator(self, name: str) -> Draft202012Validator | None:
        tool = self.get(name)
        return tool.validator if isinstance(tool, McpTool) else None

    async def call(self, name: str, args: dict[str, Any], *, idempotency_key: str,
                   timeout_s: float, traceparent: str | None = None) -> ToolOutcome:
        """One attempt of a call. What comes back holds no secret of the daemon's: a
        tool that echoes its Authorization header (or a key it was never given) has it
        replaced before anything stores, shows or sends the result. `traceparent` (W3C
        trace context) goes to an http tool as a header, to an MCP server in `_meta`."""
        outcome = await self._attempt(name, args, idempotency_key=idempotency_key,
                                      timeout_s=timeout_s, traceparent=traceparent)
        return outcome.redacted(self._redactor) if self._redactor else outcome

    async def _attempt(self, name: str, args: dict[str, Any], *, idempotency_key: str,
                       timeout_s: float, traceparent: str | None) -> ToolOutcome:
        tool = self.get(name)
        if isinstance(tool, McpTool):
            return await self._servers[tool.server].call(
                tool, args, idempotency_key=idempotency_key, timeout_s=timeout_s,
                traceparent=traceparent)
        if tool is None:
            return ToolOutcome(content="", failure=CallFailure(
                exception=("UnknownTool",), message=f"there is no tool named {name!r}"))
        if tool.kind == "echo":
            return ToolOutcome(content=_ECHO.encode(args))
        return await self._http(tool, args, idempotency_key=idempotency_key,
                                timeout_s=timeout_s, traceparent=traceparent)

    async def _http(self, tool: ToolConfig, args: dict[str, Any], *, idempotency_key: str,
                    timeout_s: float, traceparent: str | None) -> ToolOutcome:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=200), auto_decompress=True)
        return await call_http(self._session, tool, args, idempotency_key=idempotency_key,
                               timeout_s=timeout_s, traceparent=traceparent)

    # -- MCP servers: status, lifecycle ---------------------------------------------------

    def server_status(self) -> dict[str, Any]:
        return {name: s.status() for name, s in self._servers.items()}

    async def start(self, tg: TaskGroup, *, replacing: ToolBox | None = None) -> None:
        """Take over the MCP servers this ToolBox reuses, stop those of `replacing` (the
        ToolBox of the previous policy) that it does not, then start the new ones in the
        daemon's task group and wait until each has connected or failed once (bounded by
        its connect_timeout), so that turns do not start while their tools are listed."""
        for server in self._servers.values():
            server.owner = self
        if replacing is not None:
            await replacing._close_servers()
        new = [s for s in self._servers.values() if not s.started]
        for server in new:
            server.start(tg)
        for server in new:
            await server.wait_first_attempt()

    async def aclose(self) -> None:
        """Stop the MCP servers this ToolBox owns (not those a newer one took over) and
        close the HTTP session."""
        await self._close_servers()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _close_servers(self) -> None:
        owned = [s for s in self._servers.values() if s.owner is self]
        for server in owned:
            server.cancel()
        for server in owned:
            await server.aclose()
