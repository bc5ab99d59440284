"""`Config`, the root of the configuration's models: every section of the file (and of
the environment's `TURNKEEPER_SECTION__KEY` overrides) in one immutable pydantic model,
with the checks that look across sections (names unique, a model alias's providers
configured, the names a named agent gives) and the views the daemon reads of it (a
model's chain, a profile's guards, the config shown with its secrets replaced).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from turnkeeper.config import agents as agents_config
from turnkeeper.config.agents import AgentConfig, AgentName, NamedAgentConfig
from turnkeeper.config.providers import DEFAULT_PROVIDERS, ProviderConfig
from turnkeeper.config.redact import REDACTED, redact_url, redact_urls
from turnkeeper.config.sections import (
    AdaptiveConcurrencyConfig,
    ApprovalsConfig,
    BudgetConfig,
    CircuitBreakerConfig,
    ClarifyConfig,
    DaemonConfig,
    FailureLoopConfig,
    FleetConfig,
    GuardConfig,
    LoopDetectionConfig,
    MetricsConfig,
    ModelConfig,
    ModelName,
    RetryBudgetConfig,
    RetryConfig,
    SessionsConfig,
    StoreConfig,
    ToolsRetryConfig,
    _overrides,
)
from turnkeeper.config.tools import DEFAULT_TOOLS, ToolConfig
from turnkeeper.config.tracing import TracingConfig
from turnkeeper.config.webhooks import WebhookConfig

if TYPE_CHECKING:
    from turnkeeper.policy.agents import AgentDefinition


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

