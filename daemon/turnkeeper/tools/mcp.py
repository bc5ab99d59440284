"""Tools from MCP servers, through the official `mcp` SDK (the optional extra `mcp`).

One `McpServer` per `[[tools]]` entry of kind `mcp`: a stdio server the daemon starts
(`command`, `args`, `env`) or a streamable-HTTP server it connects to (`url`,
`headers`). Its connection is owned by one long-lived task in the daemon's task group
(`run`): the SDK's transports and `ClientSession` are async context managers, entered
there and held open; turns call `session.call_tool` from their own tasks, so cancelling
a turn cancels its request (the SDK sends the server a `notifications/cancelled`).

When the connection ends (the process exits, a ping or the HTTP transport fails), the
task tears it down, waits out `RestartSchedule` (the `restart_backoff` curve) and starts
it again. While it is down its tools leave the offer (`offered`), calls fail fast as
retryable, and the ToolBox tells the agent in a note. What the annotations mean and how
failures are classified is decided in `policy/tool_traits.py`.

This module is the supervision: when a connection is opened, how it is watched (pings,
relisting), when it is started again, and what is offered meanwhile. What is said over
one connection (the transport, the handshake, the listing, a call and its answer) is
`mcp_session.py`'s, and a tool as offered is `mcp_tool.py`'s.

The SDK is imported only when a server starts, so the rest of the daemon (and the CLI)
runs without it.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from anyio.abc import TaskGroup
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from turnkeeper.config import ToolConfig
from turnkeeper.policy.backoff import Backoff
from turnkeeper.policy.classify import CallFailure
from turnkeeper.policy.mcp_state import McpServerState
from turnkeeper.policy.tool_traits import (
    NAME_SEPARATOR,
    SERVER_DOWN,
    RestartSchedule,
    exposed_names,
    offered_without_tasks,
    selected,
    tool_traits,
)
from turnkeeper.tools.mcp_session import call_tool, list_tools, open_session
from turnkeeper.tools.mcp_tool import ConnectTimeout, McpTool, ServerGone, describe_error
from turnkeeper.tools.outcome import ToolOutcome

if TYPE_CHECKING:
    import mcp_types
    from mcp import ClientSession
    from mcp.client.session import IncomingMessage

log = structlog.get_logger("turnkeeper.mcp")


class McpServer:
    """One supervised MCP server connection. Its state (`stopped`, `starting`, `up`,
    `down`: waiting to restart) moves as `policy/mcp_state.py`'s table allows."""

    def __init__(self, cfg: ToolConfig, *,
                 rand: Callable[[float, float], float] = random.uniform) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.transport = "stdio" if cfg.command else "http"
        self.state = McpServerState.STOPPED
        self.tools: dict[str, McpTool] = {}
        self.generation = 0
        self.listed = False
        self._need_tasks: list[str] = []  # tools left out as they require MCP tasks
        self.last_error: str | None = None
        self.up_since: float | None = None
        self.next_restart_at: float | None = None
        self.started = False
        self.owner: object | None = None  # the ToolBox that closes it
        backoff = Backoff.from_config(cfg.restart_backoff)
        self.schedule = RestartSchedule(backoff,
                                        stable_after_s=max(1.0, backoff.max_delay_s))
        self._rand = rand
        self._session: ClientSession | None = None
        self._up_mono: float | None = None
        self._scope: anyio.CancelScope | None = None
        self._stopped: anyio.Event | None = None
        self._first_attempt: anyio.Event | None = None
        self._wake: anyio.Event | None = None
        self._suspect = False
        self._relist = False

    def __repr__(self) -> str:
        return (f"McpServer({self.name!r}, {self.transport}, state={self.state!r}, "
                f"tools={len(self.tools)}, restarts={self.schedule.restarts})")

    # -- what the ToolBox reads -----------------------------------------------------

    def offered(self) -> Iterable[McpTool]:
        return self.tools.values() if self.state is McpServerState.UP else ()

    def lookup(self, name: str) -> McpTool | None:
        """A tool by its offered name, also while the server is down (a call then fails
        retryable, not as an unknown tool). Before the first listing, a placeholder that
        is never idempotent: a call journalled before a crash resumes as `unknown`."""
        tool = self.tools.get(name)
        if tool is not None or self.listed:
            return tool
        remote = name[len(self.name) + len(NAME_SEPARATOR):]
        if not remote or not selected(remote, include=self.cfg.include,
                                      exclude=self.cfg.exclude):
            return None
        return McpTool(name=name, remote=remote, server=self.name, description=remote,
                       parameters={"type": "object"}, idempotent=False, destructive=True,
                       polling=False, timeout=self.cfg.timeout, because="not listed yet")

    def down_reason(self) -> str:
        if self.state is McpServerState.STARTING:
            return "it is starting"
        reason = f"it is down: {self.last_error}" if self.last_error else "it is down"
        if self.next_restart_at is not None:
            wait = max(0.0, self.next_restart_at - time.time())
            reason += f"; the next start is in {wait:.1f} s"
        return reason

    def status(self) -> dict[str, Any]:
        return {"state": self.state, "transport": self.transport,
                "tools": [t.to_json() for t in self.tools.values()],
                "restarts": self.schedule.restarts, "last_error": self.last_error,
                "up_since": self.up_since,
                "next_restart_at": (self.next_restart_at if self.state is McpServerState.DOWN
                                    else None)}

    # -- lifecycle --------------------------------------------------------------------

    def start(self, tg: TaskGroup) -> None:
        self.started = True
        self._scope = anyio.CancelScope()
        self._stopped = anyio.Event()
        self._first_attempt = anyio.Event()
        tg.start_soon(self.run, name=f"mcp server {self.name}")

    async def wait_first_attempt(self) -> None:
        """Until the first connection is up or has failed (bounded by connect_timeout)."""
        if self._first_attempt is not None:
            await self._first_attempt.wait()

    def cancel(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    async def aclose(self) -> None:
        self.cancel()
        if self._stopped is not None:
            with anyio.CancelScope(shield=True):
                await self._stopped.wait()

    async def run(self) -> None:
        assert self._scope is not None and self._stopped is not None
        try:
            with self._scope:
                while True:
                    self.state = self.state.to(McpServerState.STARTING)
                    self.next_restart_at = None
                    try:
                        await self._serve_once()
                    except Exception as exc:
                        self.last_error = describe_error(exc)
                    delay = self._went_down()
                    if self._first_attempt is not None:
                        self._first_attempt.set()
                    await anyio.sleep(delay)
        finally:
            self._session = None
            self.state = self.state.to(McpServerState.STOPPED)
            self.generation += 1
            if self._first_attempt is not None:
                self._first_attempt.set()
            self._stopped.set()
            log.info("mcp.server_stopped", server=self.name)

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _connection_ended(self) -> None:
        """The read stream ended: no new call may start on this session."""
        if self._session is not None:
            self._session = None
            self.state = self.state.to(McpServerState.DOWN)
            self.generation += 1
        self._poke()

    def _suspect_connection(self) -> None:
        self._suspect = True
        self._poke()

    async def _serve_once(self) -> None:
        ended = anyio.Event()

        def on_end() -> None:
            ended.set()
            self._connection_ended()

        async with open_session(self.cfg, on_end=on_end,
                                on_message=self._on_message) as (session, listing):
            self._went_up(session, listing)
            try:
                await self._watch(session, ended)
            finally:
                self._session = None

    async def _watch(self, session: ClientSession, ended: anyio.Event) -> None:
        """Hold the connection; relist on `tools/list_changed`; ping when idle or when a
        call saw the connection fail. Returns only by raising: the connection is over."""
        interval = self.cfg.ping_interval if self.cfg.ping_interval > 0 else math.inf
        while True:
            self._wake = anyio.Event()
            ping = self._suspect
            if not (ended.is_set() or self._suspect or self._relist):
                with anyio.move_on_after(interval) as idle:
                    await self._wake.wait()
                ping = ping or idle.cancelled_caught or self._suspect
            if ended.is_set():
                raise ServerGone("the server closed the connection")
            try:
                with anyio.fail_after(self.cfg.connect_timeout):
                    if self._relist:
                        self._relist = False
                        self._set_tools(await list_tools(session))
                    if ping:
                        self._suspect = False
                        await session.send_ping()
            except TimeoutError:
                raise ConnectTimeout(f"no answer to a ping within "
                                     f"{self.cfg.connect_timeout:g} s") from None

    async def _on_message(self, message: IncomingMessage) -> None:
        import mcp_types

        if isinstance(message, Exception):
            log.warning("mcp.transport_error", server=self.name,
                        error=describe_error(message))
        elif isinstance(message, mcp_types.ToolListChangedNotification):
            self._relist = True
            self._poke()

    def _set_tools(self, listing: list[mcp_types.Tool]) -> None:
        cfg = self.cfg
        picked = [t for t in listing if selected(t.name, include=cfg.include,
                                                 exclude=cfg.exclude)]
        chosen = [t for t in picked if offered_without_tasks(
            t.execution.task_support if t.execution else None)]
        need_tasks = sorted(t.name for t in picked if t not in chosen)
        if need_tasks != self._need_tasks:
            self._need_tasks = need_tasks
            if need_tasks:  # offered, they could never be called: say why they are not
                log.warning("mcp.tools_need_tasks", server=self.name, tools=need_tasks,
                            reason="these tools require MCP tasks (taskSupport: "
                            "required), which turnkeeper does not run: not offered")
        names = exposed_names(self.name, (t.name for t in chosen))
        tools: dict[str, McpTool] = {}
        for t in chosen:
            ann = t.annotations
            override = cfg.overrides.get(t.name)
            traits = tool_traits(
                read_only_hint=ann.read_only_hint if ann else None,
                destructive_hint=ann.destructive_hint if ann else None,
                idempotent_hint=ann.idempotent_hint if ann else None,
                override_idempotent=override.idempotent if override else None,
                override_destructive=override.destructive if override else None)
            schema = t.input_schema or {"type": "object", "properties": {}}
            validator: Draft202012Validator | None = None
            try:
                Draft202012Validator.check_schema(schema)
                validator = Draft202012Validator(schema)
            except SchemaError as exc:
                log.warning("mcp.tool_schema_invalid", server=self.name, tool=t.name,
                            error=exc.message[:300])
            name = names[t.name]
            tools[name] = McpTool(
                name=name, remote=t.name, server=self.name,
                description=(t.description or (ann.title if ann else None) or t.title
                             or t.name),
                parameters=schema, idempotent=traits.idempotent,
                destructive=traits.destructive,
                polling=bool(override.polling) if override else False,
                timeout=cfg.timeout, because=traits.because, validator=validator)
        unknown = sorted(set(cfg.overrides) - {t.name for t in listing})
        if unknown and not self.listed:
            log.warning("mcp.override_unknown_tool", server=self.name, tools=unknown)
        changed = [t.to_json() for t in tools.values()] != [
            t.to_json() for t in self.tools.values()]
        self.tools = tools
        self.listed = True
        if changed:
            self.generation += 1
            log.info("mcp.tools_listed", server=self.name, tools=list(tools),
                     hidden=len(listing) - len(chosen))

    def _went_up(self, session: ClientSession, listing: list[mcp_types.Tool]) -> None:
        self._set_tools(listing)
        self._session = session
        self.state = self.state.to(McpServerState.UP)
        self.up_since = time.time()
        self._up_mono = time.monotonic()
        self.generation += 1
        if self._first_attempt is not None:
            self._first_attempt.set()
        info = session.server_info
        log.info("mcp.server_up", server=self.name, transport=self.transport,
                 tools=len(self.tools), restarts=self.schedule.restarts,
                 server_name=info.name if info else None,
                 server_version=info.version if info else None)

    def _went_down(self) -> float:
        lived = time.monotonic() - self._up_mono if self._up_mono is not None else None
        self._up_mono = None
        self._session = None
        self.up_since = None
        self.state = self.state.to(McpServerState.DOWN)
        self.generation += 1
        delay = self.schedule.connection_ended(lived_s=lived, rand=self._rand)
        self.next_restart_at = time.time() + delay
        log.warning("mcp.server_down", server=self.name, error=self.last_error,
                    lived_s=None if lived is None else round(lived, 3),
                    restart_in=round(delay, 3), restarts=self.schedule.restarts)
        return delay

    # -- calls ------------------------------------------------------------------------

    async def call(self, tool: McpTool, args: dict[str, Any], *, idempotency_key: str,
                   timeout_s: float, traceparent: str | None = None) -> ToolOutcome:
        """One attempt, on the connection that is up (`call_tool`); while none is, a
        failure that never reached the server."""
        session = self._session
        if session is None:
            return ToolOutcome(content="", attempted=False, failure=CallFailure(
                exception=SERVER_DOWN,
                message=f"MCP server {self.name} is not available ({self.down_reason()})"))
        return await call_tool(session, tool, args, server=self.name,
                               idempotency_key=idempotency_key, timeout_s=timeout_s,
                               traceparent=traceparent, on_suspect=self._suspect_connection)
