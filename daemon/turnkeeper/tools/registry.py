"""The tools of one policy: specs to offer, argument checks, and one attempt of a call.

Argument problems are the model's failures and are classified deterministic before any
request is made: malformed JSON, an unknown tool, a schema violation. Retrying, breakers
and the journal live in the runner; a call here is one attempt.

Tools of kind `mcp` come from supervised MCP server connections (`tools/mcp.py`): the
offer (`specs`) follows their state, so the runner asks for it at every model call. A
ToolBox owns the server tasks it starts (`start(tg)`, `aclose()`); a ToolBox built on a
reload reuses the servers whose config did not change.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from anyio.abc import TaskGroup
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from turnkeeper.config import ConfigError, ToolConfig
from turnkeeper.messages import ToolSpec
from turnkeeper.policy.classify import CallFailure
from turnkeeper.policy.tool_traits import NAME_SEPARATOR
from turnkeeper.tools.builtin import BUILTIN_SPECS
from turnkeeper.tools.http import call_http
from turnkeeper.tools.mcp import McpServer
from turnkeeper.tools.mcp_tool import McpTool
from turnkeeper.tools.outcome import MAX_RESULT_CHARS, ToolOutcome, truncate

__all__ = ["MAX_RESULT_CHARS", "ArgumentProblem", "ToolBox", "ToolOutcome"]

_truncate = truncate


@dataclass(frozen=True, slots=True)
class ArgumentProblem:
    failure: CallFailure


class ToolBox:
    def __init__(self, tools: tuple[ToolConfig, ...], *,
                 previous: ToolBox | None = None) -> None:
        static = tuple(t for t in tools if t.kind != "mcp")
        self._tools = {t.name: t for t in static}
        self._validators: dict[str, Draft202012Validator] = {}
        for t in static:
            try:
                Draft202012Validator.check_schema(t.parameters)
            except SchemaError as exc:
                raise ConfigError(f"tools.{t.name}.parameters: not a valid JSON schema: "
                                  f"{exc.message}") from None
            self._validators[t.name] = Draft202012Validator(t.parameters)
        self._servers: dict[str, McpServer] = {}
        old = previous._servers if previous is not None else {}
        for t in tools:
            if t.kind == "mcp":
                reuse = old.get(t.name)
                self._servers[t.name] = (reuse if reuse is not None and reuse.cfg == t
                                         else McpServer(t))
        self._static_specs: tuple[ToolSpec, ...] = BUILTIN_SPECS + tuple(
            ToolSpec(name=t.name, description=t.description or t.name,
                     parameters=t.parameters) for t in static)
        self._specs = self._static_specs
        self._specs_key: tuple[int, ...] | None = None
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"ToolBox({sorted(self._tools)}, mcp={sorted(self._servers)})"

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        """What is offered now: built-ins, configured tools, and the tools of every MCP
        server that is up. The same tuple until an offer changes (providers cache the
        encoded tools by identity)."""
        key = tuple(s.generation for s in self._servers.values())
        if key != self._specs_key:
            self._specs = self._static_specs + tuple(
                t.spec for s in self._servers.values() for t in s.offered())
            self._specs_key = key
        return self._specs

    def get(self, name: str) -> ToolConfig | McpTool | None:
        tool = self._tools.get(name)
        if tool is not None:
            return tool
        server_name, sep, _ = name.partition(NAME_SEPARATOR)
        server = self._servers.get(server_name) if sep else None
        return server.lookup(name) if server is not None else None

    def check_arguments(self, name: str, arguments: str
                        ) -> tuple[dict[str, Any], None] | tuple[None, ArgumentProblem]:
        """Parse and validate before anything is sent."""
        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return None, ArgumentProblem(CallFailure(
                exception=("MalformedArguments",),
                message=f"arguments of {name} are not valid JSON: {exc.msg} at {exc.pos}"))
        if not isinstance(args, dict):
            return None, ArgumentProblem(CallFailure(
                exception=("MalformedArguments",),
                message=f"arguments of {name} must be a JSON object"))
        validator = self._validators.get(name)
        if validator is None:
            tool = self.get(name)
            validator = tool.validator if isinstance(tool, McpTool) else None
        if validator is not None:
            errors = sorted(validator.iter_errors(args), key=lambda e: list(e.path))
            if errors:
                e = errors[0]
                where = "/".join(str(p) for p in e.path) or "(arguments)"
                return None, ArgumentProblem(CallFailure(
                    exception=("SchemaViolation",),
                    message=f"arguments of {name} violate its schema at {where}: "
                            f"{e.message}"))
        return args, None

    async def call(self, name: str, args: dict[str, Any], *, idempotency_key: str,
                   timeout_s: float) -> ToolOutcome:
        tool = self.get(name)
        if isinstance(tool, McpTool):
            return await self._servers[tool.server].call(
                tool, args, idempotency_key=idempotency_key, timeout_s=timeout_s)
        if tool is None:
            return ToolOutcome(content="", failure=CallFailure(
                exception=("UnknownTool",), message=f"there is no tool named {name!r}"))
        if tool.kind == "echo":
            return ToolOutcome(content=json.dumps(args, ensure_ascii=False, sort_keys=True))
        return await self._http(tool, args, idempotency_key=idempotency_key,
                                timeout_s=timeout_s)

    # -- MCP servers: offer changes, status, lifecycle ---------------------------------

    def offer_note(self, previous: frozenset[str] | None
                   ) -> tuple[frozenset[str], str | None]:
        """The names offered now, and a note for the agent when MCP tools left or came
        back since `previous` (None: the turn's first look, which reports servers that
        are down)."""
        current = frozenset(s.name for s in self.specs)
        if previous == current:
            return current, None
        notes: list[str] = []
        for server in self._servers.values():
            prefix = server.name + NAME_SEPARATOR
            if previous is None:
                if server.state != "up":
                    notes.append(f"The tools of MCP server {server.name} are unavailable "
                                 f"right now ({server.down_reason()}); they are offered "
                                 "again when it is back.")
                continue
            gone = _names(n for n in previous - current if n.startswith(prefix))
            back = _names(n for n in current - previous if n.startswith(prefix))
            if gone and server.state != "up":
                notes.append(f"MCP server {server.name} went down "
                             f"({server.down_reason()}); these tools are not offered "
                             f"until it is back: {gone}. Do not call them now.")
            elif gone:
                notes.append(f"MCP server {server.name} no longer offers: {gone}.")
            if back:
                notes.append(f"MCP server {server.name} offers these tools (again): "
                             f"{back}.")
        return current, " ".join(notes) or None

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

    async def _http(self, tool: ToolConfig, args: dict[str, Any], *, idempotency_key: str,
                    timeout_s: float) -> ToolOutcome:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=200), auto_decompress=True)
        return await call_http(self._session, tool, args, idempotency_key=idempotency_key,
                               timeout_s=timeout_s)


def _names(names: Iterable[str], *, most: int = 20) -> str:
    """Tool names for a note, sorted; a long list is cut short."""
    ordered = sorted(names)
    if len(ordered) <= most:
        return ", ".join(ordered)
    return ", ".join(ordered[:most]) + f" and {len(ordered) - most} more"
