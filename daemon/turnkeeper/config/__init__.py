"""Configuration: TOML file + `TURNKEEPER_SECTION__KEY` environment overrides, validated by
pydantic, frozen into an immutable `PolicyVersion` snapshot.

Every turn runs under exactly one policy version; a reload builds a new one and swaps it
atomically. Unknown keys are errors: a typo in a limit must not silently fall back to a
default.

The models live in `sections.py` (the daemon and the turn's rules), `providers.py`,
`tools.py` (with `secrets.py`, the keys and values they read), `agents.py` (`[agent]` and
named agents), `webhooks.py` and `tracing.py`; `root.py` assembles them into `Config`,
`loading.py` reads it from the file and the environment. This module names them all,
freezes a `PolicyVersion`, says which keys wait for a restart, and answers where the
socket and state live.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnkeeper.config.agents import DEFAULT_SYSTEM_PROMPT, AgentConfig
from turnkeeper.config.env import env_override_errors
from turnkeeper.config.loading import (
    build_config,
    check_provider_keys,
    config_path_from_env,
    load_config,
    read_config_file,
)
from turnkeeper.config.providers import DEFAULT_PROVIDERS, ProviderConfig, ProviderSecrets
from turnkeeper.config.redact import redact_url
from turnkeeper.config.root import Config
from turnkeeper.config.sections import (
    BUILTIN_TOOL_NAMES,
    AdaptiveConcurrencyConfig,
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
)
from turnkeeper.config.tools import (
    DEFAULT_TOOLS,
    MCP_INSTALL_HINT,
    RestartBackoffConfig,
    ToolConfig,
    ToolOverride,
    mcp_available,
)
from turnkeeper.config.tracing import OTEL_INSTALL_HINT, TracingConfig, otel_available
from turnkeeper.config.webhooks import WebhookConfig
from turnkeeper.paths import default_socket_path, default_state_dir

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

