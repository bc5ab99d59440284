"""What the daemon makes of the tools an MCP server declares, and of the ways a call to
one fails. Pure: the edge (`tools/mcp.py`, `tools/mcp_session.py`) feeds in what the SDK
reported.

Traits (a non-idempotent call is never retried automatically, and never re-run on
resume, because a second run could repeat its side effect). An MCP tool's annotations
are hints with defaults the MCP specification fixes (readOnlyHint false, destructiveHint
true, idempotentHint false). The daemon maps them, first rule that applies wins:

1. a per-server override in config (`overrides = { tool = { idempotent = ... } }`);
   `destructive = true` there means not idempotent;
2. `readOnlyHint: true` => idempotent (it changes nothing: retried, re-run on resume);
3. `destructiveHint: true`, stated by the server => never retried, journalled like a
   non-idempotent http tool (an outcome lost to a crash is reported unknown, never
   repeated);
4. `idempotentHint: true` => idempotent;
5. otherwise not idempotent: the safe default for a tool that says nothing.

So a tool whose server says both `destructiveHint: true` and `idempotentHint: true` is
not idempotent: rule 3 comes first (an idempotent effect that destroys something is
still not re-run without a person deciding). `because` names the rule, and for the
last one the hints the server gave (`readOnlyHint=false, idempotentHint=false: not
idempotent`), or that it gave none.

A tool that requires MCP tasks (`execution.taskSupport: "required"`) cannot be called
with a plain request, and the daemon does not run MCP tasks: it is not offered at all
(`offered_without_tasks`), and the edge logs which tools were left out and why.

Failures are mapped onto `CallFailure` exception names that `classify` already knows, the
most specific name first and a base that carries the class second (as `CircuitOpen,
ConnectionError` does for an open breaker):

- the server is down, the connection closed under the call, the call timed out:
  retryable (connection reset or refused and timeouts are transient by nature);
- a result with `isError: true`: the tool ran and said no. Deterministic (sending the
  same arguments again gives the same answer) unless its text reads as a transient
  condition (a timeout, "temporarily unavailable", a 429/503...), then retryable;
- JSON-RPC errors: invalid params / method not found / invalid request are
  deterministic; internal and parse errors, and codes nobody documented, are unknown.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from turnkeeper.policy.backoff import Backoff

NAME_SEPARATOR = "__"
MAX_TOOL_NAME = 64  # OpenAI: ^[a-zA-Z0-9_-]{1,64}$; Anthropic allows the same set
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9_\-]")

# JSON-RPC / MCP error codes (mcp_types.jsonrpc), repeated here so that policy does not
# import the SDK.
CONNECTION_CLOSED = -32000
REQUEST_TIMEOUT = -32001
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603

SERVER_DOWN = ("ServerDown", "ConnectionError")
CONNECTION_LOST = ("ConnectionClosed", "ConnectionError")
CALL_TIMED_OUT = ("RequestTimeout", "TimeoutError")
TOOL_ERROR = ("ToolError", "ValueError")
TRANSIENT_TOOL_ERROR = ("TransientToolError", "ConnectionError")

_TRANSIENT_TEXT = re.compile(
    r"timed? ?out|timeout|temporar(il)?y|unavailable|try again|too many requests|"
    r"rate.?limit|overloaded|connection (reset|refused|aborted|closed)|"
    r"ECONNRESET|ECONNREFUSED|ETIMEDOUT|EAI_AGAIN|"
    r"\b(status|HTTP|code)[ :=]*(408|425|429|500|502|503|504|529)\b",
    re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class ToolTraits:
    """`idempotent` decides retries and re-runs; `destructive` is what the server (or the
    operator) says about it, shown to operators; `because` names the rule that decided."""

    idempotent: bool
    destructive: bool
    because: str

    def __repr__(self) -> str:
        return (f"ToolTraits(idempotent={self.idempotent}, destructive={self.destructive}, "
                f"because={self.because!r})")


def tool_traits(*, read_only_hint: bool | None, destructive_hint: bool | None,
                idempotent_hint: bool | None, override_idempotent: bool | None = None,
                override_destructive: bool | None = None) -> ToolTraits:
    """The rules of the module docstring, in order."""
    stated_destructive = (False if read_only_hint else
                          destructive_hint if destructive_hint is not None else True)
    destructive = (override_destructive if override_destructive is not None
                   else stated_destructive)
    if override_idempotent is not None:
        return ToolTraits(override_idempotent, destructive, "override idempotent")
    if override_destructive:
        return ToolTraits(False, True, "override destructive")
    if read_only_hint:
        return ToolTraits(True, destructive, "readOnlyHint")
    if destructive_hint and override_destructive is None:
        return ToolTraits(False, True, "destructiveHint (over idempotentHint)"
                          if idempotent_hint else "destructiveHint")
    if idempotent_hint:
        return ToolTraits(True, destructive, "idempotentHint")
    given = [f"{name}={str(value).lower()}" for name, value in (
        ("readOnlyHint", read_only_hint), ("destructiveHint", destructive_hint),
        ("idempotentHint", idempotent_hint)) if value is not None]
    return ToolTraits(False, destructive, (", ".join(given) if given else "no hint")
                      + ": not idempotent")


def offered_without_tasks(task_support: str | None) -> bool:
    """Whether a tool can be offered while MCP tasks are not supported: every tool but
    one that requires them (`forbidden`, `optional` and unset run as plain calls)."""
    return task_support != "required"


def selected(tool: str, *, include: Iterable[str], exclude: Iterable[str]) -> bool:
    """`include` (empty = every tool) then `exclude`; shell-style patterns (`read_*`)."""
    inc = tuple(include)
    if inc and not any(fnmatch.fnmatchcase(tool, p) for p in inc):
        return False
    return not any(fnmatch.fnmatchcase(tool, p) for p in exclude)


def exposed_names(server: str, tools: Iterable[str]) -> dict[str, str]:
    """The name each of a server's tools is offered under: `server__tool`, with characters
    no provider accepts replaced by `_` and long names cut to 64 with a hash of the
    original, so that two tools never share a name. Stable for a given listing order."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    prefix = f"{server}{NAME_SEPARATOR}"
    for tool in tools:
        if tool in out:
            continue
        name = prefix + _NOT_ALLOWED.sub("_", tool)
        if len(name) > MAX_TOOL_NAME or name in taken:
            digest = hashlib.sha256(tool.encode("utf-8")).hexdigest()[:8]
            name = name[:MAX_TOOL_NAME - 9] + "_" + digest
        out[tool] = name
        taken.add(name)
    return out


def tool_error_names(text: str) -> tuple[str, ...]:
    """`isError: true`: deterministic unless the text reads as transient."""
    return TRANSIENT_TOOL_ERROR if _TRANSIENT_TEXT.search(text) else TOOL_ERROR


def rpc_error_names(code: int, message: str) -> tuple[tuple[str, ...], bool]:
    """A JSON-RPC error on a call: (exception names, whether the connection is suspect
    and should be checked). A streamable-HTTP server that lost its session (it was
    restarted) answers "Session terminated": a dead connection, not a wrong request."""
    if code == CONNECTION_CLOSED:
        return CONNECTION_LOST, True
    if code == REQUEST_TIMEOUT:
        return CALL_TIMED_OUT, False
    if code == INVALID_REQUEST and "session terminated" in message.lower():
        return CONNECTION_LOST, True
    if code in (INVALID_PARAMS, METHOD_NOT_FOUND, INVALID_REQUEST):
        return (_RPC_NAMES[code], "ValueError"), False
    return (_RPC_NAMES.get(code, f"RpcError{code}"),), False


_RPC_NAMES = {PARSE_ERROR: "ParseError", INVALID_REQUEST: "InvalidRequest",
              METHOD_NOT_FOUND: "MethodNotFound", INVALID_PARAMS: "InvalidParams",
              INTERNAL_ERROR: "InternalError"}


@dataclass(slots=True)
class RestartSchedule:
    """When to start a server again after its connection ended.

    The wait follows the backoff curve of `restart_backoff` over consecutive failed
    connections; a connection that stayed up at least `stable_after_s` proves the server
    healthy and starts the curve over. `restarts` counts every restart, for operators.
    """

    backoff: Backoff
    stable_after_s: float
    streak: int = 0
    previous_s: float | None = None
    restarts: int = 0

    def __repr__(self) -> str:
        return (f"RestartSchedule(streak={self.streak}, restarts={self.restarts}, "
                f"previous_s={self.previous_s}, stable_after_s={self.stable_after_s})")

    def connection_ended(self, *, lived_s: float | None,
                         rand: Callable[[float, float], float]) -> float:
        """Seconds to wait before the next start. `lived_s` is how long the connection
        was up (None: it never came up)."""
        if lived_s is not None and lived_s >= self.stable_after_s:
            self.streak = 0
            self.previous_s = None
        delay = self.backoff.delay(attempt=self.streak, previous_s=self.previous_s, rand=rand)
        if not math.isfinite(delay) or delay < 0:
            delay = self.backoff.max_delay_s
        self.streak += 1
        self.previous_s = delay
        self.restarts += 1
        return delay
