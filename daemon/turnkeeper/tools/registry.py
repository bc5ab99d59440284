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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from anyio.abc import TaskGroup
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from turnkeeper.config import ConfigError, ToolConfig
from turnkeeper.messages import ToolSpec
from turnkeeper.policy.agents import EVERY_TOOL, ToolSelection
from turnkeeper.policy.classify import CallFailure, Redactor
from turnkeeper.policy.mcp_state import McpServerState
from turnkeeper.policy.tool_traits import NAME_SEPARATOR
from turnkeeper.tools.builtin import BUILTIN_SPECS
from turnkeeper.tools.http import call_http
from turnkeeper.tools.mcp import McpServer
from turnkeeper.tools.mcp_tool import McpTool
from turnkeeper.tools.outcome import MAX_RESULT_CHARS, ToolOutcome, truncate

__all__ = ["MAX_RESULT_CHARS", "ArgumentProblem", "ToolBox", "ToolOutcome"]

_truncate = truncate
BUILTIN_NAMES = frozenset(b.name for b in BUILTIN_SPECS)

# A secret shorter than this is not looked for in tool results: a placeholder key ("x",
# "none", "dummy") would blank out ordinary words, and hides nothing.
MIN_SECRET_CHARS = 8


# The echo tool's answer: json.dumps(args, ensure_ascii=False, sort_keys=True), with the
# encoder built once (json.dumps with options builds one per call).
_ECHO = json.JSONEncoder(ensure_ascii=False, sort_keys=True)


@dataclass(frozen=True, slots=True)
class ArgumentProblem:
    failure: CallFailure


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
        self._validators: dict[str, Draft202012Validator] = {}
        # The tools whose schema is plain enough to check without jsonschema (most are):
        # arguments that pass it are valid; any others go to the full validator, which
        # also words the error.
        self._plain: dict[str, Callable[[Any], bool]] = {}
        self._mcp_plain: dict[str, tuple[Draft202012Validator, Callable[[Any], bool]]] = {}
        for t in static:
            try:
                Draft202012Validator.check_schema(t.parameters)
            except SchemaError as exc:
                raise ConfigError(f"tools.{t.name}.parameters: not a valid JSON schema: "
                                  f"{exc.message}") from None
        # The built-ins' arguments are checked like any tool's: a malformed report_blocked
        # is the model's mistake to correct, not a reason to end the turn with raw text.
        for name, schema in (*((b.name, b.parameters) for b in BUILTIN_SPECS),
                             *((t.name, t.parameters) for t in static)):
            self._validators[name] = Draft202012Validator(schema)
            check = plain_check(schema)
            if check is not None:
                self._plain[name] = check
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
        # Per agent's selection, the last offer made to it and its names: a tuple and a
        # set a step otherwise.
        self._selected: dict[ToolSelection, tuple[tuple[ToolSpec, ...],
                                                  tuple[ToolSpec, ...]]] = {}
        self._offered: dict[ToolSelection, tuple[tuple[ToolSpec, ...], frozenset[str]]] = {}
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"ToolBox({sorted(self._tools)}, mcp={sorted(self._servers)})"

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        """What is offered now: built-ins, configured tools, and the tools of every MCP
        server that is up. The same tuple until an offer changes (providers cache the
        encoded tools by identity)."""
        if not self._servers:
            return self._static_specs
        key = tuple(s.generation for s in self._servers.values())
        if key != self._specs_key:
            self._specs = self._static_specs + tuple(
                t.spec for s in self._servers.values() for t in s.offered())
            self._specs_key = key
        return self._specs

    def specs_for(self, tools: ToolSelection) -> tuple[ToolSpec, ...]:
        """What is offered to an agent that may call `tools`: the built-ins and the
        tools of `specs` it selects. The same tuple while the offer does not change."""
        specs = self.specs
        if tools.every:
            return specs
        known = self._selected.get(tools)
        if known is None or known[0] is not specs:
            known = self._selected[tools] = (specs, tuple(
                s for s in specs if s.name in BUILTIN_NAMES or tools.allows(s.name)))
        return known[1]

    def get(self, name: str) -> ToolConfig | McpTool | None:
        tool = self._tools.get(name)
        if tool is not None:
            return tool
        server_name, sep, _ = name.partition(NAME_SEPARATOR)
        server = self._servers.get(server_name) if sep else None
        return server.lookup(name) if server is not None else None

    @staticmethod
    def parse_arguments(name: str, arguments: str
                        ) -> tuple[dict[str, Any], None] | tuple[None, ArgumentProblem]:
        """A call's arguments as the JSON object they must be, whatever tool `name` is
        (none at all, for a call the journal answers after its tool went)."""
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
        return args, None

    def check_arguments(self, name: str, arguments: str
                        ) -> tuple[dict[str, Any], None] | tuple[None, ArgumentProblem]:
        """Parse and validate before anything is sent."""
        args, problem = self.parse_arguments(name, arguments)
        if problem is not None:
            return None, problem
        assert args is not None
        plain = self._plain.get(name)
        if plain is not None and plain(args):
            return args, None
        validator = self._validators.get(name)
        if validator is None:
            tool = self.get(name)
            validator = tool.validator if isinstance(tool, McpTool) else None
            if validator is not None and self._mcp_check(name, validator)(args):
                return args, None
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

    def _mcp_check(self, name: str, validator: Draft202012Validator
                   ) -> Callable[[Any], bool]:
        """The plain check of an MCP tool's schema, made once per schema it announces."""
        known = self._mcp_plain.get(name)
        if known is None or known[0] is not validator:
            known = self._mcp_plain[name] = (validator,
                                             plain_check(validator.schema) or _NEVER)
        return known[1]

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

    # -- MCP servers: offer changes, status, lifecycle ---------------------------------

    def offer_note(self, previous: frozenset[str] | None,
                   tools: ToolSelection = EVERY_TOOL) -> tuple[frozenset[str], str | None]:
        """The names offered now to an agent that may call `tools`, and a note for it
        when MCP tools left or came back since `previous` (None: the turn's first look,
        which reports servers that are down). Servers the agent has no tool of are not
        its business."""
        specs = self.specs_for(tools)
        known = self._offered.get(tools)
        if known is None or known[0] is not specs:  # the offer changed (or a first look)
            known = self._offered[tools] = (specs, frozenset(s.name for s in specs))
        current = known[1]
        if previous == current:
            return current, None
        notes: list[str] = []
        for server in self._servers.values():
            if not tools.every and all(s != server.name for s, _ in tools.servers):
                continue
            prefix = server.name + NAME_SEPARATOR
            if previous is None:
                if server.state is not McpServerState.UP:
                    notes.append(f"The tools of MCP server {server.name} are unavailable "
                                 f"right now ({server.down_reason()}); they are offered "
                                 "again when it is back.")
                continue
            gone = _names(n for n in previous - current if n.startswith(prefix))
            back = _names(n for n in current - previous if n.startswith(prefix))
            if gone and server.state is not McpServerState.UP:
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
                    timeout_s: float, traceparent: str | None) -> ToolOutcome:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=200), auto_decompress=True)
        return await call_http(self._session, tool, args, idempotency_key=idempotency_key,
                               timeout_s=timeout_s, traceparent=traceparent)


# -- a plain schema, checked without jsonschema ----------------------------------------

# Keywords that never reject an instance (annotations; `format` is not asserted: the
# validators are built without a format checker).
_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment",
                          "$schema", "format", "deprecated", "readOnly", "writeOnly"})
_PLAIN_KEYWORDS = _ANNOTATIONS | {"type", "properties", "required",
                                  "additionalProperties", "items", "enum", "minLength",
                                  "maxLength", "minimum", "maximum"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# JSON Schema type -> a test that is True only for what the type certainly allows
# (`integer` also allows 2.0: such an instance goes to jsonschema instead).
_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: type(v) is int,
    "number": _is_number,
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def plain_check(schema: Any) -> Callable[[Any], bool] | None:
    """For a schema of the plain keywords only (types, properties, required,
    additionalProperties true or false, items, string enums, length and range bounds),
    a test that answers True only for an instance the schema accepts; False means "ask
    jsonschema", never "invalid". None for any other schema: jsonschema checks it all."""
    if schema is True or schema == {}:
        return lambda _v: True
    if not isinstance(schema, dict) or not set(schema) <= _PLAIN_KEYWORDS:
        return None
    tests: list[Callable[[Any], bool]] = []
    kind = schema.get("type")
    if kind is not None:
        kinds = [kind] if isinstance(kind, str) else kind
        if not isinstance(kinds, list) or not kinds or any(k not in _TYPES for k in kinds):
            return None
        if len(kinds) == 1:
            tests.append(_TYPES[kinds[0]])
        else:
            of = tuple(_TYPES[k] for k in kinds)
            tests.append(lambda v: any(t(v) for t in of))
    if "enum" in schema:
        enum = schema["enum"]
        if not isinstance(enum, list) or not all(isinstance(e, str) for e in enum):
            return None
        allowed = frozenset(enum)
        tests.append(lambda v: isinstance(v, str) and v in allowed)
    for word, bound_test in _BOUNDS.items():
        if word in schema:
            made = bound_test(schema[word])
            if made is None:
                return None
            tests.append(made)
    if "items" in schema:
        item = plain_check(schema["items"])
        if item is None:
            return None
        tests.append(lambda v: not isinstance(v, list) or all(item(x) for x in v))
    object_test = _plain_object(schema)
    if object_test is None:
        return None
    if object_test is not _ANY:
        tests.append(object_test)
    if len(tests) == 1:
        return tests[0]
    return lambda v: all(t(v) for t in tests)


def _ANY(_value: Any) -> bool:
    return True


def _NEVER(_value: Any) -> bool:
    return False


def _min_length(n: Any) -> Callable[[Any], bool] | None:
    if type(n) is not int:
        return None
    return lambda v: not isinstance(v, str) or len(v) >= n


def _max_length(n: Any) -> Callable[[Any], bool] | None:
    if type(n) is not int:
        return None
    return lambda v: not isinstance(v, str) or len(v) <= n


def _minimum(n: Any) -> Callable[[Any], bool] | None:
    if not _is_number(n):
        return None
    return lambda v: not _is_number(v) or v >= n


def _maximum(n: Any) -> Callable[[Any], bool] | None:
    if not _is_number(n):
        return None
    return lambda v: not _is_number(v) or v <= n


# The bound keywords: each applies to one kind of instance and passes any other.
_BOUNDS: dict[str, Callable[[Any], Callable[[Any], bool] | None]] = {
    "minLength": _min_length, "maxLength": _max_length,
    "minimum": _minimum, "maximum": _maximum}


def _plain_object(schema: dict[str, Any]) -> Callable[[Any], bool] | None:
    """The object keywords of a plain schema (they apply only to an object)."""
    properties = schema.get("properties", {})
    required = schema.get("required", [])
    extra = schema.get("additionalProperties", True)
    if (not isinstance(properties, dict) or not isinstance(required, list)
            or not all(isinstance(r, str) for r in required) or not isinstance(extra, bool)):
        return None
    checks: dict[str, Callable[[Any], bool]] = {}
    for key, sub in properties.items():
        check = plain_check(sub)
        if check is None:
            return None
        checks[key] = check
    if not checks and not required and extra is True:
        return _ANY
    needed = tuple(required)
    closed = extra is False

    def test(value: Any) -> bool:
        if not isinstance(value, dict):
            return True
        for key in needed:
            if key not in value:
                return False
        for key, item in value.items():
            check = checks.get(key)
            if check is None:
                if closed:
                    return False
            elif not check(item):
                return False
        return True

    return test


def _names(names: Iterable[str], *, most: int = 20) -> str:
    """Tool names for a note, sorted; a long list is cut short."""
    ordered = sorted(names)
    if len(ordered) <= most:
        return ", ".join(ordered)
    return ", ".join(ordered[:most]) + f" and {len(ordered) - most} more"
