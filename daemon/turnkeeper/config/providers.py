"""`[[providers]]`: the model endpoints a turn talks to, where each one's key comes from,
and the checks that make a bad entry an error at load time."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from turnkeeper.config.redact import redact_url
from turnkeeper.config.secrets import (
    CREDENTIAL_NAME,
    read_credential,
    read_secret,
    resolve_env_refs,
    secret_values,
)
from turnkeeper.config.sections import (
    ConfigError,
    NonNegFloat,
    PositiveFloat,
    PositiveInt,
    _Section,
)

# What the official SDKs read when the config does not say: the key (the first variable
# set, in the SDK's order: google-genai prefers GOOGLE_API_KEY when both are), the
# endpoint, and the endpoint's default. The vendor endpoints always need a key; any other
# server may not.
SDK_KEY_ENV: dict[str, tuple[str, ...]] = {
    "openai": ("OPENAI_API_KEY",), "openai-responses": ("OPENAI_API_KEY",),
    "anthropic": ("ANTHROPIC_API_KEY",), "gemini": ("GOOGLE_API_KEY", "GEMINI_API_KEY")}
SDK_BASE_URL_ENV = {"openai": "OPENAI_BASE_URL", "openai-responses": "OPENAI_BASE_URL",
                    "anthropic": "ANTHROPIC_BASE_URL", "gemini": "GOOGLE_GEMINI_BASE_URL"}
SDK_BASE_URL = {"openai": "https://api.openai.com/v1",
                "openai-responses": "https://api.openai.com/v1",
                "anthropic": "https://api.anthropic.com",
                "gemini": "https://generativelanguage.googleapis.com"}

# Body fields the adapters write themselves: an `options` entry may not replace them (the
# output limit is `max_output_tokens`, bounded by the turn's budget).
RESERVED_OPTIONS = frozenset({"model", "messages", "system", "tools", "stream",
                              "stream_options", "max_tokens", "max_completion_tokens",
                              "input", "instructions", "max_output_tokens", "contents",
                              "systemInstruction", "system_instruction"})
_HTTP_ONLY = ("base_url", "api_key_env", "api_key_file", "api_key_credential", "options",
              "headers", "query", "max_tokens_field", "cache", "structured_output")


@dataclass(frozen=True, slots=True, repr=False)
class ProviderSecrets:
    """What a provider sends that may be secret, read at the moment the provider is built:
    the API key and the resolved `headers` and `query` values. Never printed (its repr
    says nothing); `digest` tells whether a reload brought other secrets, without keeping
    them around to compare."""

    api_key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    query: Mapping[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return "ProviderSecrets(<redacted>)"

    def digest(self) -> str:
        text = json.dumps([self.api_key, sorted(self.headers.items()),
                           sorted(self.query.items())])
        return hashlib.sha256(text.encode()).hexdigest()

    def values(self) -> tuple[str, ...]:
        """Every value worth redacting from a server's error text."""
        out = [self.api_key] if self.api_key else []
        out.extend(v for v in (*self.headers.values(), *self.query.values()) if len(v) >= 8)
        return tuple(out)


class ProviderConfig(_Section):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")]
    kind: Literal["openai", "openai-responses", "anthropic", "gemini", "scripted"]
    base_url: str = ""  # "": the SDK's variable ($OPENAI_BASE_URL...), else the vendor's
    model: str = ""
    # Where the key comes from, at most one of the three. api_key_env unset: the SDK's
    # variable for the kind; "": no auth (a local server).
    api_key_env: str | None = None
    api_key_file: str = ""
    api_key_credential: Annotated[str, Field(pattern=CREDENTIAL_NAME)] = ""
    timeout: PositiveFloat = 60.0
    # The whole call, however the answer trickles in (a per-read timeout never cuts a
    # stream that sends a token now and then): a cut is a retryable failure.
    max_call_seconds: PositiveFloat = 600.0
    # A started stream that brings no progress (text, a tool call, a finish) for this
    # long, whatever keepalives it sends, is a retryable failure.
    idle_timeout: PositiveFloat = 60.0
    stream: bool = True
    max_output_tokens: PositiveInt = 4096
    max_tokens_field: Literal["auto", "max_tokens", "max_completion_tokens"] = "auto"
    options: dict[str, Any] = Field(default_factory=dict)
    headers: dict[str, str] = Field(default_factory=dict)
    query: dict[str, str] = Field(default_factory=dict)
    cache: Literal["auto", "off"] = "auto"
    # How a turn with an output schema asks this provider for it: "native" (the API's
    # own JSON Schema mode), "tool" (a forced answer tool whose input is the answer),
    # "prompt" (the schema in the system prompt); "auto" picks by kind
    # (`policy.output.AUTO_MODE`).
    structured_output: Literal["auto", "native", "tool", "prompt"] = "auto"
    # As configured; the prices in force (unset ones from the shipped price table, else 0;
    # unset cache prices from the table, else the input price) are providers/prices.py's.
    price_input_per_mtok: NonNegFloat = 0.0
    price_output_per_mtok: NonNegFloat = 0.0
    price_cache_read_per_mtok: NonNegFloat | None = None
    price_cache_write_per_mtok: NonNegFloat | None = None
    max_connections: PositiveInt = 100
    # Model calls in flight against this provider at once, across every turn (None: no
    # fixed cap; with [adaptive_concurrency] on, max_connections is the top).
    max_in_flight: PositiveInt | None = None
    script: str = ""  # scripted only: path of a script file; empty = the built-in demo

    @model_validator(mode="before")
    @classmethod
    def _sdk_base_url(cls, data: Any) -> Any:
        """An empty base_url takes what the vendor's SDK would: its variable, else the
        vendor's endpoint."""
        if isinstance(data, dict) and not data.get("base_url"):
            kind = data.get("kind")
            if kind in SDK_BASE_URL:
                data = {**data, "base_url": (os.environ.get(SDK_BASE_URL_ENV[kind])
                                             or SDK_BASE_URL[kind])}
        return data

    @model_validator(mode="after")
    def _kind_needs(self) -> ProviderConfig:
        where = f"provider {self.name!r}"
        if self.kind != "scripted" and self.script:
            raise ValueError("script is only for providers of kind scripted")
        if self.kind == "scripted":
            wrong = [k for k in _HTTP_ONLY if k in self.model_fields_set]
            if wrong:
                raise ValueError(f"{where}: {', '.join(wrong)}: not for kind scripted")
        sources = [k for k in ("api_key_env", "api_key_file", "api_key_credential")
                   if getattr(self, k)]
        if len(sources) > 1 or (sources and self.api_key_env == ""):
            raise ValueError(f"{where}: {', '.join(sorted(set(sources) | {'api_key_env'}))}"
                             ": set at most one source of the key")
        if self.max_tokens_field != "auto" and self.kind != "openai":
            raise ValueError(f"{where}: max_tokens_field is only for kind openai")
        reserved = sorted(RESERVED_OPTIONS & set(self.options))
        if reserved:
            raise ValueError(f"{where}: options may not set {', '.join(reserved)}: the "
                             "adapter writes them (the output limit is max_output_tokens)")
        try:
            json.dumps(self.options)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: options must be plain JSON values ({exc})") from None
        budget = self.thinking_budget_tokens
        if budget is not None and self.max_output_tokens <= budget:
            # Anthropic counts thinking in the output cap and rejects a cap at or below
            # the thinking budget: every request of this provider would be a 400.
            raise ValueError(f"{where}: max_output_tokens ({self.max_output_tokens}) must "
                             f"be above options.thinking.budget_tokens ({budget})")
        return self

    @property
    def thinking_budget_tokens(self) -> int | None:
        """The configured extended-thinking budget of an Anthropic provider
        (`options.thinking = {type = "enabled", budget_tokens = N}`); None without one."""
        thinking = self.options.get("thinking") if self.kind == "anthropic" else None
        if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
            return None
        budget = thinking.get("budget_tokens")
        return budget if isinstance(budget, int) and not isinstance(budget, bool) else None

    @property
    def key_env(self) -> str:
        """The variable the key is read from ("" = none): the configured one, else the
        SDK's for the kind (of several, the first one set, else the first)."""
        if self.api_key_env is not None:
            return self.api_key_env
        names = SDK_KEY_ENV.get(self.kind, ())
        return next((n for n in names if os.environ.get(n)), names[0] if names else "")

    def official_endpoint(self) -> bool:
        return self.base_url.rstrip("/") == SDK_BASE_URL.get(self.kind)

    def api_key(self) -> str | None:
        """The key, read now (a reload reads it again, so a rotated key takes effect).
        Raises ConfigError naming the key's source, never its value, when the configured
        source gives nothing. The SDK's variable unset is no auth, except on the vendor's
        own endpoint, which always needs a key."""
        where = f"providers.{self.name}"
        if self.api_key_file:
            return read_secret(Path(self.api_key_file), f"{where}.api_key_file")
        if self.api_key_credential:
            return read_credential(self.api_key_credential, f"{where}.api_key_credential")
        env = self.key_env
        if not env:
            return None
        value = os.environ.get(env)
        if value:
            return value
        if self.api_key_env is None:
            if not self.official_endpoint():
                return None
            names = " or ".join(SDK_KEY_ENV.get(self.kind, (env,)))
            raise ConfigError(f"{where}: {redact_url(self.base_url)} needs a key and the "
                              f"variable {names} is not set or is empty (or set api_key_env, "
                              "api_key_file or api_key_credential)")
        raise ConfigError(f"{where}.api_key_env: the variable {env} is not set or is empty")

    def secret_values(self, secrets: ProviderSecrets) -> tuple[str, ...]:
        """Of `secrets` (read for this provider), what a tool's result must never carry:
        the key, and the header and query values read from the environment or named
        like a credential. Other literal values (`anthropic-beta`, a date) are settings,
        which a tool may well answer."""
        return (*([secrets.api_key] if secrets.api_key else []),
                *secret_values(self.headers, secrets.headers),
                *secret_values(self.query, secrets.query))

    def secrets(self) -> ProviderSecrets:
        """The key and the `env:NAME` values of headers and query, read now. Raises
        ConfigError for a key source that gives nothing or an unset variable."""
        return ProviderSecrets(self.api_key(), self._refs("headers", self.headers),
                               self._refs("query", self.query))

    def _refs(self, key: str, values: Mapping[str, str]) -> dict[str, str]:
        out = resolve_env_refs(values)
        unset = [v[4:] for k, v in values.items() if v.startswith("env:") and not out[k]]
        if unset:
            raise ConfigError(f"providers.{self.name}.{key}: the variable "
                              f"{', '.join(unset)} is not set or is empty")
        return out


DEFAULT_PROVIDERS = (ProviderConfig(name="scripted", kind="scripted"),)
