"""Configuration: TOML file + `TURNKEEPER_SECTION__KEY` environment overrides, validated by
pydantic, frozen into an immutable `Policy` snapshot.

Every turn runs under exactly one Policy; a reload builds a new one and swaps it
atomically. Unknown keys are errors: a typo in a limit must not silently fall back to a
default.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from turnkeeper import exits
from turnkeeper.errors import TurnkeeperError
from turnkeeper.paths import default_socket_path, default_state_dir

BUILTIN_TOOL_NAMES = frozenset({"report_blocked", "clarify"})
DEFAULT_SYSTEM_PROMPT = (
    "You are an agent run by turnkeeper. Use the tools offered to do the user's task. "
    "When you are done, answer in plain text. If you cannot finish, call report_blocked "
    "with what you tried and what you found; if you need the user, call clarify."
)

PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]


class ConfigError(TurnkeeperError):
    """An invalid configuration; the message names each failing key."""

    exit_code = exits.CONFIG


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DaemonConfig(_Section):
    socket: str = ""
    socket_mode: str = "0660"
    allowed_uids: tuple[NonNegInt, ...] = ()
    allowed_gids: tuple[NonNegInt, ...] = ()
    state_dir: str = ""
    max_concurrent_turns: PositiveInt = 64
    max_queued_turns: NonNegInt = 1000
    drain_timeout: NonNegFloat = 30.0
    shutdown_timeout: NonNegFloat = 60.0
    watch_config: bool = True
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    # Control connections. 0 for max_connections: min(1024, a quarter of the descriptor
    # limit), read at start, so the socket alone can never exhaust the daemon's files.
    max_connections: NonNegInt = 0
    control_idle_timeout: Annotated[float, Field(gt=0)] = 30.0
    body_read_timeout: Annotated[float, Field(gt=0)] = 10.0
    max_followers_per_client: PositiveInt = 16
    max_message_bytes: PositiveInt = 256 * 1024

    @field_validator("socket_mode")
    @classmethod
    def _octal_mode(cls, v: str) -> str:
        try:
            mode = int(v, 8)
        except ValueError:
            raise ValueError("must be an octal file mode such as \"0660\"") from None
        if not 0 <= mode <= 0o777:
            raise ValueError("must be between 0000 and 0777")
        return v

    @property
    def socket_mode_int(self) -> int:
        return int(self.socket_mode, 8)


class AgentConfig(_Section):
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    api_max_retries: NonNegInt = 3
    max_restarts: NonNegInt = 3
    auto_recovery_cycles: NonNegInt = 5
    recovery_schedule: tuple[NonNegFloat, ...] = (15.0, 30.0, 60.0, 60.0, 60.0)
    recovery_jitter: Annotated[float, Field(ge=0, le=10)] = 0.2

    @field_validator("recovery_schedule")
    @classmethod
    def _non_empty(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if not v:
            raise ValueError("needs at least one wait")
        return v


class RetryConfig(_Section):
    base_delay: NonNegFloat = 0.5
    max_delay: NonNegFloat = 30.0
    jitter: Literal["full", "decorrelated"] = "full"
    max_retry_after: NonNegFloat = 120.0


class ToolsRetryConfig(_Section):
    """Attempts of one call of an idempotent tool, on retryable or unknown failures only.
    Model calls have their own count (`agent.api_max_retries`), never shared with this."""

    max_attempts: PositiveInt = 3


class RetryBudgetConfig(_Section):
    ratio: Annotated[float, Field(ge=0)] = 0.2
    min_concurrency: NonNegInt = 3


class CircuitBreakerConfig(_Section):
    failure_threshold: PositiveInt = 5
    cooldown: NonNegFloat = 30.0
    half_open_probes: PositiveInt = 1


# How a guard family acts on a stop: `enforce` stops the turn; `warn` tells the agent
# and emits the event; `observe` emits the event and logs only. Whatever the mode, the
# step backstop (max_steps) and an absolute deadline always enforce.
Mode = Literal["enforce", "warn", "observe"]
ProfileName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]


class FailureLoopConfig(_Section):
    deterministic: PositiveInt = 2
    unknown: PositiveInt = 3
    retryable: PositiveInt = 5
    mode: Mode = "enforce"


class LoopDetectionConfig(_Section):
    warn_repeats: PositiveInt = 2
    max_repeats: PositiveInt = 3
    max_state_revisits: PositiveInt = 2
    max_no_progress: PositiveInt = 5
    mode: Mode = "enforce"


class LoopDetectionOverride(_Section):
    warn_repeats: PositiveInt | None = None
    max_repeats: PositiveInt | None = None
    max_state_revisits: PositiveInt | None = None
    max_no_progress: PositiveInt | None = None
    mode: Mode | None = None


class FailureLoopOverride(_Section):
    deterministic: PositiveInt | None = None
    unknown: PositiveInt | None = None
    retryable: PositiveInt | None = None
    mode: Mode | None = None


class BudgetProfile(_Section):
    """`[budget.profiles.NAME]`: overrides of any `[budget]` key, and of
    `[loop_detection]` / `[failure_loop]` keys in sub-tables of the same names."""

    max_tokens: PositiveInt | None = None
    max_seconds: PositiveFloat | None = None
    max_steps: PositiveInt | None = None
    max_cost_usd: NonNegFloat | None = None
    soft_limit: Annotated[float, Field(gt=0, le=1)] | None = None
    mode: Mode | None = None
    loop_detection: LoopDetectionOverride = LoopDetectionOverride()
    failure_loop: FailureLoopOverride = FailureLoopOverride()


class BudgetConfig(_Section):
    max_tokens: PositiveInt = 200_000
    max_seconds: PositiveFloat = 300.0
    max_steps: PositiveInt = 40
    max_cost_usd: NonNegFloat = 0.0
    soft_limit: Annotated[float, Field(gt=0, le=1)] = 0.8
    mode: Mode = "enforce"
    profiles: dict[ProfileName, BudgetProfile] = Field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """The guards of one turn: the policy's sections with its profile applied."""

    profile: str | None
    budget: BudgetConfig
    loop_detection: LoopDetectionConfig
    failure_loop: FailureLoopConfig

    @property
    def modes(self) -> dict[str, str]:
        return {"budget": self.budget.mode, "loop_detection": self.loop_detection.mode,
                "failure_loop": self.failure_loop.mode}


def _overrides(model: BaseModel) -> dict[str, Any]:
    return {k: v for k, v in model if v is not None and not isinstance(v, BaseModel)}


class ClarifyConfig(_Section):
    timeout: PositiveFloat = 3600.0


class MetricsConfig(_Section):
    """`/metrics` is always on the control socket; `listen` adds a TCP address for a
    Prometheus scrape ("" = off), e.g. "127.0.0.1:9464" or "[::1]:9464"."""

    listen: str = ""

    @field_validator("listen")
    @classmethod
    def _host_port(cls, v: str) -> str:
        if v:
            split_host_port(v)
        return v

    def address(self) -> tuple[str, int] | None:
        return split_host_port(self.listen) if self.listen else None


def split_host_port(value: str) -> tuple[str, int]:
    """ "HOST:PORT" (an IPv6 host in brackets) -> (host, port). Raises ValueError."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"must be HOST:PORT, such as \"127.0.0.1:9464\" (got {value!r})")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"port must be a number (got {port_text!r})") from None
    if not 0 < port < 65536:
        raise ValueError(f"port must be between 1 and 65535 (got {port})")
    return host, port


class ProviderConfig(_Section):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")]
    kind: Literal["openai", "anthropic", "scripted"]
    base_url: str = ""
    model: str = ""
    api_key_env: str = ""
    timeout: PositiveFloat = 60.0
    stream: bool = True
    max_output_tokens: PositiveInt = 4096
    price_input_per_mtok: NonNegFloat = 0.0
    price_output_per_mtok: NonNegFloat = 0.0
    max_connections: PositiveInt = 100
    script: str = ""  # scripted only: path of a script file; empty = the built-in demo

    @model_validator(mode="after")
    def _kind_needs(self) -> ProviderConfig:
        if self.kind in ("openai", "anthropic") and not self.base_url:
            raise ValueError(f"provider {self.name!r} of kind {self.kind} needs base_url")
        if self.kind != "scripted" and self.script:
            raise ValueError("script is only for providers of kind scripted")
        return self

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


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
        return _resolve_env_refs(self.headers)

    def resolved_env(self) -> dict[str, str]:
        """An MCP server's environment: values `env:NAME` read from the daemon's."""
        return _resolve_env_refs(self.env)


def _resolve_env_refs(values: Mapping[str, str]) -> dict[str, str]:
    return {k: os.environ.get(v[4:], "") if v.startswith("env:") else v
            for k, v in values.items()}


DEFAULT_PROVIDERS = (ProviderConfig(name="scripted", kind="scripted"),)
DEFAULT_TOOLS = (ToolConfig(name="echo", kind="echo",
                            description="Echo the arguments back (offline demo tool)",
                            parameters={"type": "object",
                                        "properties": {"text": {"type": "string"}}},
                            idempotent=True),)


class Config(BaseSettings):
    """The whole validated configuration. Immutable."""

    model_config = SettingsConfigDict(env_prefix="TURNKEEPER_", env_nested_delimiter="__",
                                      extra="forbid", frozen=True, case_sensitive=False)

    daemon: DaemonConfig = DaemonConfig()
    agent: AgentConfig = AgentConfig()
    retry: RetryConfig = RetryConfig()
    retry_budget: RetryBudgetConfig = RetryBudgetConfig()
    tools_retry: ToolsRetryConfig = ToolsRetryConfig()
    circuit_breaker: CircuitBreakerConfig = CircuitBreakerConfig()
    failure_loop: FailureLoopConfig = FailureLoopConfig()
    budget: BudgetConfig = BudgetConfig()
    loop_detection: LoopDetectionConfig = LoopDetectionConfig()
    clarify: ClarifyConfig = ClarifyConfig()
    metrics: MetricsConfig = MetricsConfig()
    providers: tuple[ProviderConfig, ...] = DEFAULT_PROVIDERS
    tools: tuple[ToolConfig, ...] = DEFAULT_TOOLS

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment overrides the file (passed as init values).
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _unique_names(self) -> Config:
        if not self.providers:
            raise ValueError("providers: at least one provider is needed")
        for kind, items in (("providers", self.providers), ("tools", self.tools)):
            seen: set[str] = set()
            for item in items:
                if item.name in seen:
                    raise ValueError(f"{kind}: name {item.name!r} appears twice")
                seen.add(item.name)
        return self

    def tool_max_attempts(self, tool: ToolConfig) -> int:
        """The attempts one call of `tool` may take: its own setting, else the section's."""
        return tool.max_attempts or self.tools_retry.max_attempts

    def guards(self, profile: str | None = None) -> GuardConfig:
        """The effective guard settings for a turn of `profile` (None: the plain
        sections). Raises KeyError for a profile the policy does not define."""
        if profile is None:
            return GuardConfig(None, self.budget, self.loop_detection, self.failure_loop)
        p = self.budget.profiles[profile]
        return GuardConfig(
            profile,
            self.budget.model_copy(update=_overrides(p)),
            self.loop_detection.model_copy(update=_overrides(p.loop_detection)),
            self.failure_loop.model_copy(update=_overrides(p.failure_loop)))

    def redacted(self) -> dict[str, Any]:
        """The effective config as JSON, secrets replaced: literal header and MCP server
        env values (an `env:NAME` reference is shown, never its value)."""
        data = self.model_dump(mode="json")
        for tool in data["tools"]:
            for key in ("headers", "env"):
                tool[key] = {k: (v if v.startswith("env:") else "<redacted>")
                             for k, v in tool[key].items()}
        return data


# Keys whose change cannot be applied without a restart.
RESTART_KEYS = (("daemon", "socket"), ("daemon", "socket_mode"), ("daemon", "state_dir"),
                ("daemon", "allowed_uids"), ("daemon", "allowed_gids"),
                ("daemon", "max_connections"), ("daemon", "control_idle_timeout"),
                ("metrics", "listen"))


def keep_restart_keys(running: Config, new: Config) -> Config:
    """`new` with the RESTART_KEYS of the running config: they change at the next
    restart, and are reported as `pending_restart` until then."""
    updates: dict[str, dict[str, Any]] = {}
    for section, key in RESTART_KEYS:
        updates.setdefault(section, {})[key] = getattr(getattr(running, section), key)
    return new.model_copy(update={section: getattr(new, section).model_copy(update=values)
                                  for section, values in updates.items()})


@dataclass(frozen=True, slots=True)
class Policy:
    """An immutable snapshot of the validated configuration, numbered by the daemon."""

    version: int
    config: Config
    source_path: str | None
    content_hash: str

    def pending_restart(self, new: Config) -> list[str]:
        out = []
        for section, key in RESTART_KEYS:
            if getattr(getattr(self.config, section), key) != getattr(getattr(new, section), key):
                out.append(f"{section}.{key}")
        return out


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def read_config_file(path: Path) -> tuple[dict[str, Any], str]:
    """The parsed TOML and the hash of its bytes. Raises ConfigError naming the file."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"invalid configuration ({path}): not valid TOML: {exc}") from None
    return data, hashlib.sha256(raw).hexdigest()


def build_config(data: Mapping[str, Any], source: str = "embedded defaults") -> Config:
    try:
        return Config(**data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None


def load_config(path: str | Path | None) -> tuple[Config, str]:
    """Load the config (file or embedded defaults) with environment overrides.
    Returns it with the hash of the file's content ("" for embedded defaults)."""
    if path is None or str(path) == "":
        config = build_config({})
        check_provider_keys(config, "embedded defaults")
        return config, ""
    p = Path(path)
    data, digest = read_config_file(p)
    _resolve_relative_scripts(data, p.parent)
    config = build_config(data, str(p))
    check_provider_keys(config, str(p))
    return config, digest


def check_provider_keys(config: Config, source: str) -> None:
    """A provider whose api_key_env names an unset or empty variable would fail every call
    with a 401 at run time; refuse it now, naming the variable (never a value). Done on
    loading a file (config check, start-up, reload), not in the model, so a config can
    still be built and inspected where the secrets are not present."""
    missing = [f"  providers.{p.name}.api_key_env: the variable {p.api_key_env} is not "
               "set or is empty" for p in config.providers
               if p.api_key_env and not os.environ.get(p.api_key_env)]
    if missing:
        raise ConfigError("\n".join([f"invalid configuration ({source}):", *missing]))


def _resolve_relative_scripts(data: dict[str, Any], base: Path) -> None:
    """A scripted provider's relative `script` is relative to the config file."""
    providers = data.get("providers")
    if not isinstance(providers, list):
        return
    for p in providers:
        if isinstance(p, dict) and isinstance(p.get("script"), str) and p["script"]:
            script = Path(p["script"])
            if not script.is_absolute():
                p["script"] = str(base / script)


def config_path_from_env(cli_value: str | None) -> str | None:
    return cli_value or os.environ.get("TURNKEEPER_CONFIG") or None


def socket_path(config: Config) -> Path:
    return Path(config.daemon.socket) if config.daemon.socket else default_socket_path()


def state_dir(config: Config) -> Path:
    return Path(config.daemon.state_dir) if config.daemon.state_dir else default_state_dir()
