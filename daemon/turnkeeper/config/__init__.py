"""Configuration: TOML file + `TURNKEEPER_SECTION__KEY` environment overrides, validated by
pydantic, frozen into an immutable `PolicyVersion` snapshot.

Every turn runs under exactly one policy version; a reload builds a new one and swaps it
atomically. Unknown keys are errors: a typo in a limit must not silently fall back to a
default.

The models live in `sections.py` (the daemon and the turn's rules), `peers.py`
(providers and tools) and `agents.py` (named agents); this module assembles them into
`Config`, freezes a `PolicyVersion`, reads files and answers where the socket and state
live.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from turnkeeper.config import agents as agents_config
from turnkeeper.config import explain
from turnkeeper.config.agents import AgentName, NamedAgentConfig
from turnkeeper.config.env import ENV_PREFIX, env_names, env_override_errors
from turnkeeper.config.peers import (
    DEFAULT_PROVIDERS,
    DEFAULT_TOOLS,
    MCP_INSTALL_HINT,
    ProviderConfig,
    ProviderSecrets,
    RestartBackoffConfig,
    ToolConfig,
    ToolOverride,
    mcp_available,
)
from turnkeeper.config.redact import REDACTED, redact_url, redact_urls
from turnkeeper.config.sections import (
    BUILTIN_TOOL_NAMES,
    DEFAULT_SYSTEM_PROMPT,
    AdaptiveConcurrencyConfig,
    AgentConfig,
    ApprovalsConfig,
    BudgetConfig,
    BudgetExtensionConfig,
    BudgetExtensionOverride,
    BudgetProfile,
    CircuitBreakerConfig,
    ClarifyConfig,
    ConfigError,
    DaemonConfig,
    FailureLoopConfig,
    FailureLoopOverride,
    FleetConfig,
    GuardConfig,
    LoopDetectionConfig,
    LoopDetectionOverride,
    MetricsConfig,
    Mode,
    ModelConfig,
    ModelName,
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    ProfileName,
    RetryBudgetConfig,
    RetryConfig,
    SessionsConfig,
    StoreConfig,
    ToolsRetryConfig,
    _overrides,
)
from turnkeeper.config.tracing import OTEL_INSTALL_HINT, TracingConfig, otel_available
from turnkeeper.config.webhooks import WebhookConfig, check_webhook_secrets
from turnkeeper.paths import config_search, default_socket_path, default_state_dir

if TYPE_CHECKING:
    from turnkeeper.policy.agents import AgentDefinition

__all__ = [
    "BUILTIN_TOOL_NAMES",
    "DEFAULT_PROVIDERS",
    "DEFAULT_SYSTEM_PROMPT",
    "DEFAULT_TOOLS",
    "MCP_INSTALL_HINT",
    "OTEL_INSTALL_HINT",
    "RESTART_KEYS",
    "AdaptiveConcurrencyConfig",
    "AgentConfig",
    "ApprovalsConfig",
    "BudgetConfig",
    "BudgetExtensionConfig",
    "BudgetExtensionOverride",
    "BudgetProfile",
    "CircuitBreakerConfig",
    "ClarifyConfig",
    "Config",
    "ConfigError",
    "DaemonConfig",
    "FailureLoopConfig",
    "FailureLoopOverride",
    "FleetConfig",
    "GuardConfig",
    "LoopDetectionConfig",
    "LoopDetectionOverride",
    "MetricsConfig",
    "Mode",
    "ModelConfig",
    "ModelName",
    "NonNegFloat",
    "NonNegInt",
    "PolicyVersion",
    "PositiveFloat",
    "PositiveInt",
    "ProfileName",
    "ProviderConfig",
    "ProviderSecrets",
    "RestartBackoffConfig",
    "RetryBudgetConfig",
    "RetryConfig",
    "SessionsConfig",
    "StoreConfig",
    "ToolConfig",
    "ToolOverride",
    "ToolsRetryConfig",
    "TracingConfig",
    "WebhookConfig",
    "build_config",
    "check_provider_keys",
    "config_path_from_env",
    "env_override_errors",
    "keep_restart_keys",
    "load_config",
    "mcp_available",
    "otel_available",
    "read_config_file",
    "redact_url",
    "socket_path",
    "state_dir",
]


class Config(BaseSettings):
    """The whole validated configuration. Immutable."""

    model_config = SettingsConfigDict(env_prefix="TURNKEEPER_", env_nested_delimiter="__",
                                      extra="forbid", frozen=True, case_sensitive=False)

    daemon: DaemonConfig = DaemonConfig()
    agent: AgentConfig = AgentConfig()
    retry: RetryConfig = RetryConfig()
    retry_budget: RetryBudgetConfig = RetryBudgetConfig()
    adaptive_concurrency: AdaptiveConcurrencyConfig = AdaptiveConcurrencyConfig()
    tools_retry: ToolsRetryConfig = ToolsRetryConfig()
    circuit_breaker: CircuitBreakerConfig = CircuitBreakerConfig()
    failure_loop: FailureLoopConfig = FailureLoopConfig()
    budget: BudgetConfig = BudgetConfig()
    loop_detection: LoopDetectionConfig = LoopDetectionConfig()
    clarify: ClarifyConfig = ClarifyConfig()
    approvals: ApprovalsConfig = ApprovalsConfig()
    sessions: SessionsConfig = SessionsConfig()
    metrics: MetricsConfig = MetricsConfig()
    store: StoreConfig = StoreConfig()
    fleet: FleetConfig = FleetConfig()
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    providers: tuple[ProviderConfig, ...] = DEFAULT_PROVIDERS
    tools: tuple[ToolConfig, ...] = DEFAULT_TOOLS
    models: dict[ModelName, ModelConfig] = Field(default_factory=dict)
    webhooks: tuple[WebhookConfig, ...] = ()
    agents: dict[AgentName, NamedAgentConfig] = Field(default_factory=dict)

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
        for kind, items in (("providers", self.providers), ("tools", self.tools),
                            ("webhooks", self.webhooks)):
            seen: set[str] = set()
            for item in items:
                if item.name in seen:
                    raise ValueError(f"{kind}: name {item.name!r} appears twice")
                seen.add(item.name)
        providers = {p.name for p in self.providers}
        for name, model in self.models.items():
            if name in providers:
                raise ValueError(f"models.{name}: the name is a provider's; a submit naming "
                                 "it would be ambiguous, so an alias needs a name of its own")
            unknown = [p for p in model.chain if p not in providers]
            if unknown:
                raise ValueError(f"models.{name}.chain: {', '.join(map(repr, unknown))} "
                                 f"is not a configured provider (configured: "
                                 f"{', '.join(sorted(providers))})")
        return self

    @model_validator(mode="after")
    def _agents_known_names(self) -> Config:
        agents_config.check_agents(self.agents, tools=self.tools, models=self.model_names(),
                                   profiles=sorted(self.budget.profiles))
        return self

    def agent_definitions(self) -> tuple[AgentDefinition, dict[str, AgentDefinition]]:
        """The default agent (`[agent]`) and every named one resolved over it."""
        return agents_config.definitions(self.agent, self.agents, tools=self.tools)

    def model_chain(self, model: str | None) -> tuple[str, ...]:
        """The providers a turn of `model` walks, primary first: an alias's chain
        (`[models.NAME]`), a single provider named by itself, or (None) the default chain,
        every provider in order. Raises KeyError for a name the policy does not know."""
        if model is None:
            return tuple(p.name for p in self.providers)
        if model in self.models:
            return self.models[model].chain
        if any(p.name == model for p in self.providers):
            return (model,)
        raise KeyError(model)

    def model_names(self) -> list[str]:
        """Every name a submit's `model` may take: the aliases, then the providers."""
        return [*sorted(self.models), *(p.name for p in self.providers)]

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
            self.budget.model_copy(update={
                **_overrides(p),
                "extension": self.budget.extension.model_copy(update=_overrides(p.extension))}),
            self.loop_detection.model_copy(update=_overrides(p.loop_detection)),
            self.failure_loop.model_copy(update=_overrides(p.failure_loop)))

    def redacted(self, *, as_written: bool = False) -> dict[str, Any]:
        """The effective config as JSON, secrets replaced: literal header (and provider
        query) values and MCP server env values (an `env:NAME` reference is shown, never
        its value), and the credentials inside any URL (`redact_url`). `as_written`
        keeps of each provider and tool only the keys its file gave (and its name and
        kind): the others, filled in by kind, would be refused if read back."""
        data = self.model_dump(mode="json")
        data["store"]["url"] = redact_url(self.store.url)
        if as_written:
            for key, items in (("providers", self.providers), ("tools", self.tools)):
                data[key] = [{k: v for k, v in dumped.items()
                              if k in item.model_fields_set or k in ("name", "kind")}
                             for dumped, item in zip(data[key], items, strict=True)]
        for provider in data["providers"]:
            for key in ("headers", "query"):
                if key in provider:
                    provider[key] = {k: (v if v.startswith("env:") else REDACTED)
                                     for k, v in provider[key].items()}
        for tool in data["tools"]:
            for key in ("headers", "env"):
                if key in tool:
                    tool[key] = {k: (v if v.startswith("env:") else REDACTED)
                                 for k, v in tool[key].items()}
        shown: dict[str, Any] = redact_urls(data)
        return shown


# Keys whose change cannot be applied without a restart.
RESTART_KEYS = (("daemon", "socket"), ("daemon", "socket_mode"), ("daemon", "state_dir"),
                ("daemon", "allowed_uids"), ("daemon", "allowed_gids"),
                ("daemon", "max_connections"), ("daemon", "control_idle_timeout"),
                ("metrics", "listen"), ("store", "url"), ("store", "fatal_after"),
                ("fleet", "node_id"), ("tracing", "enabled"), ("tracing", "endpoint"),
                ("tracing", "service_name"), ("tracing", "sample_ratio"),
                ("tracing", "capture_content"), ("tracing", "allowed_hosts"))


def keep_restart_keys(running: Config, new: Config) -> Config:
    """`new` with the RESTART_KEYS of the running config: they change at the next
    restart, and are reported as `pending_restart` until then."""
    updates: dict[str, dict[str, Any]] = {}
    for section, key in RESTART_KEYS:
        updates.setdefault(section, {})[key] = getattr(getattr(running, section), key)
    return new.model_copy(update={section: getattr(new, section).model_copy(update=values)
                                  for section, values in updates.items()})


@dataclass(frozen=True, slots=True)
class PolicyVersion:
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


def _read_config(path: Path) -> tuple[dict[str, Any], str, str]:
    """The parsed TOML, the hash of its bytes and its text. Raises ConfigError naming
    the file."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"invalid configuration ({path}): not valid TOML: {exc}") from None
    return data, hashlib.sha256(raw).hexdigest(), text


def read_config_file(path: Path) -> tuple[dict[str, Any], str]:
    """The parsed TOML and the hash of its bytes. Raises ConfigError naming the file."""
    data, digest, _ = _read_config(path)
    return data, digest


def build_config(data: Mapping[str, Any], source: str = "embedded defaults",
                 text: str | None = None) -> Config:
    """`text`: the file's, to point at the line of an error."""
    wrong = env_override_errors(Config.model_fields)
    if wrong:
        raise ConfigError("\n".join(["invalid environment override:", *wrong]))
    try:
        return Config(**data)
    except ValidationError as exc:
        raise ConfigError(explain.format_errors(exc, source, Config, data, text)) from None
    except SettingsError as exc:  # an override the checks above did not foresee
        cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
        raise ConfigError(f"invalid environment override: {exc}{cause}") from None


def load_config(path: str | Path | None) -> tuple[Config, str]:
    """Load the config (file or embedded defaults) with environment overrides.
    Returns it with the hash of the file's content ("" for embedded defaults)."""
    if path is None or str(path) == "":
        config = build_config({})
        check_provider_keys(config, "embedded defaults")
        return config, ""
    p = Path(path)
    data, digest, text = _read_config(p)
    _resolve_relative_scripts(data, p.parent)
    agents_config.resolve_relative_files(data, p.parent)
    config = build_config(data, str(p), text)
    _check_providers_named(data, digest, p)
    check_provider_keys(config, str(p))
    return config, digest


EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def _check_providers_named(data: Mapping[str, Any], digest: str, path: Path) -> None:
    """A config file must say which providers run. The built-in demo provider is for a
    daemon nobody configured (no file at all): a file without `[[providers]]` is far more
    likely half-written, or written to change a few limits, than a wish to answer real
    turns with the demo's canned replies (a reload that applied one ran 32 turns to
    `completed` on them, their tool calls never made). `TURNKEEPER_PROVIDERS` in the
    environment names them as well as the file does."""
    if "providers" in data or ENV_PREFIX + "PROVIDERS" in env_names():
        return
    if digest == EMPTY_SHA256:
        raise ConfigError(f"config file {path} is empty (half-written?); a config file "
                          "must name its [[providers]]")
    raise ConfigError(
        f"invalid configuration ({path}): no [[providers]]. A config file must name the "
        "providers it runs; the built-in demo provider runs only without a config file. "
        "To run the offline demo from this file, say so:\n"
        '  [[providers]]\n  name = "offline"\n  kind = "scripted"')


def check_provider_keys(config: Config, source: str) -> None:
    """A provider whose key cannot be read (an unset or empty variable, a missing key file
    or credential, an `env:NAME` header or query value whose variable is unset) would fail
    every call with a 401 at run time, and a webhook whose secret cannot be read or is
    not a Standard Webhooks secret could sign nothing; refuse it now, naming where the
    key was to come from (never a value). Done on loading a file (config check, start-up,
    reload), not in the model, so a config can still be built and inspected where the
    secrets are not present; a reload reads every key again."""
    missing: list[str] = []
    for p in config.providers:
        if p.kind == "scripted":
            continue
        try:
            p.secrets()
        except ConfigError as exc:
            missing.append(f"  {exc}")
    missing.extend(check_webhook_secrets(config.webhooks))
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
    """The config file to read (`paths.config_search`), or None for the defaults."""
    return config_search(cli_value)[0]


def socket_path(config: Config, option: str | None = None) -> Path:
    """Where the daemon listens: `option` (serve --socket), then TURNKEEPER_SOCKET, then
    daemon.socket (the file or TURNKEEPER_DAEMON__SOCKET), then the per-user default: the
    order the CLI searches in, so a client given the same option or variable finds it.
    The option and the variable stay out of the config, so a reload of the file does not
    report the socket as changed."""
    chosen = option or os.environ.get("TURNKEEPER_SOCKET") or config.daemon.socket
    return Path(chosen) if chosen else default_socket_path()


def state_dir(config: Config) -> Path:
    return Path(config.daemon.state_dir) if config.daemon.state_dir else default_state_dir()

