"""`[[tools]]`: a tool the agent may call (http, an MCP server, the built-in echo), with
the checks that make a bad entry an error at load time."""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from turnkeeper.config.secrets import resolve_env_refs, secret_values
from turnkeeper.config.sections import (
    BUILTIN_TOOL_NAMES,
    NonNegFloat,
    PositiveFloat,
    PositiveInt,
    _Section,
)


class ToolOverride(_Section):
    """Per-tool settings of an MCP server that win over the tool's own annotations."""

    idempotent: bool | None = None
    destructive: bool | None = None
    polling: bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ToolOverride:
        if self.idempotent and self.destructive:
            raise ValueError("idempotent = true and destructive = true contradict each "
                             "other: a destructive tool is never retried")
        return self


class RestartBackoffConfig(_Section):
    """The wait before an MCP server is started again after its connection ended."""

    base_delay: NonNegFloat = 0.5
    max_delay: NonNegFloat = 30.0
    jitter: Literal["full", "decorrelated"] = "decorrelated"


_MCP_ONLY = ("command", "args", "env", "include", "exclude", "overrides", "connect_timeout",
             "ping_interval", "restart_backoff")
_NOT_FOR_MCP = ("description", "method", "parameters", "idempotent", "polling",
                "dedupes_keys", "error_field", "follow_redirects", "max_response_bytes",
                "allowed_hosts")
MCP_INSTALL_HINT = "pip install 'turnkeeper[mcp]'"


def mcp_available() -> bool:
    """Whether the `mcp` SDK can be imported, without importing it (0.7 s)."""
    try:
        return importlib.util.find_spec("mcp") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["mcp"] is None
        return False


class ToolConfig(_Section):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
    kind: Literal["http", "echo", "mcp"] = "http"
    description: str = ""
    url: str = ""
    method: Literal["POST", "PUT", "PATCH", "GET", "DELETE"] = "POST"
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}})
    timeout: PositiveFloat = 10.0
    idempotent: bool = False
    polling: bool = False
    # Whose say a call needs before it is sent: never (default), always, or effects (a
    # call of a tool that is not idempotent or is destructive); see policy/approvals.py.
    # For an MCP server, every tool it offers.
    approval: Literal["never", "always", "effects"] = "never"
    headers: dict[str, str] = Field(default_factory=dict)
    max_attempts: PositiveInt | None = None  # None: [tools_retry] max_attempts
    # http only: how a non-idempotent call's effect and its answer are judged.
    dedupes_keys: bool = False
    error_field: Annotated[str, Field(pattern=r"^(/.*)?$")] = ""
    follow_redirects: bool = False
    max_response_bytes: PositiveInt = 1_048_576
    allowed_hosts: tuple[str, ...] = ()
    # kind = "mcp" only: one MCP server whose tools are offered as `<name>__<tool>`.
    command: str = ""
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    overrides: dict[str, ToolOverride] = Field(default_factory=dict)
    connect_timeout: PositiveFloat = 30.0
    ping_interval: NonNegFloat = 30.0
    restart_backoff: RestartBackoffConfig = RestartBackoffConfig()

    @model_validator(mode="after")
    def _kind_needs(self) -> ToolConfig:
        if self.kind == "http" and not self.url:
            raise ValueError(f"tool {self.name!r} of kind http needs url")
        if self.name in BUILTIN_TOOL_NAMES:
            raise ValueError(f"tool name {self.name!r} is reserved for a built-in tool")
        if self.kind == "mcp":
            self._mcp_needs()
        else:
            wrong = [k for k in _MCP_ONLY if k in self.model_fields_set]
            if wrong:
                raise ValueError(f"tool {self.name!r}: {', '.join(wrong)}: only for tools "
                                 "of kind mcp")
        return self

    def _mcp_needs(self) -> None:
        where = f"tool {self.name!r} (kind mcp)"
        wrong = [k for k in _NOT_FOR_MCP if k in self.model_fields_set]
        if wrong:
            raise ValueError(f"{where}: {', '.join(wrong)} cannot be set on an MCP server: "
                             "the server declares its tools; set idempotent, destructive "
                             "or polling per tool in overrides")
        if bool(self.command) == bool(self.url):
            raise ValueError(f"{where} needs either command (a stdio server) or url (a "
                             "streamable-HTTP server), not both")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"{where}: url must start with http:// or https://")
        if self.command and self.headers:
            raise ValueError(f"{where}: headers only apply to a server reached by url")
        if self.url and (self.args or self.env):
            raise ValueError(f"{where}: args and env only apply to a server started by "
                             "command")
        if "__" in self.name or len(self.name) > 40:
            raise ValueError(f"{where}: the name prefixes its tools as name__tool, so it "
                             "must be at most 40 characters without \"__\"")
        if not mcp_available():
            raise ValueError(f"{where}: kind = \"mcp\" needs the optional package mcp, "
                             f"which is not installed: {MCP_INSTALL_HINT}")

    @property
    def breaker(self) -> str:
        """The name of this tool's circuit breaker (one per MCP server)."""
        return f"tool:{self.name}"

    def resolved_headers(self) -> dict[str, str]:
        """Header values `env:NAME` are read from the environment at call time."""
        return resolve_env_refs(self.headers)

    def resolved_env(self) -> dict[str, str]:
        """An MCP server's environment: values `env:NAME` read from the daemon's."""
        return resolve_env_refs(self.env)

    def secret_values(self) -> tuple[str, ...]:
        """What this tool is given that may be secret, read now: the values of its
        headers and (MCP) env read from the daemon's environment (`env:NAME`) or named
        like a credential (Authorization, X-Api-Key, *_TOKEN, *_SECRET, *PASSWORD...),
        and the token alone of a value such as `Bearer <token>`. Other literal values
        (`Accept = "application/json"`) are settings, not secrets."""
        return (*secret_values(self.headers, self.resolved_headers()),
                *secret_values(self.env, self.resolved_env()))


DEFAULT_TOOLS = (ToolConfig(name="echo", kind="echo",
                            description="Echo the arguments back (offline demo tool)",
                            parameters={"type": "object",
                                        "properties": {"text": {"type": "string"}}},
                            idempotent=True),)
