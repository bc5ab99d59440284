"""`[[webhooks]]`: where the daemon POSTs the events an application wants to hear of,
signed with a secret of the webhook's own.

The secret comes from exactly one place, as a provider's key does: a variable
(`secret_env`), a file (`secret_file`) or a systemd credential (`secret_credential`,
under `$CREDENTIALS_DIRECTORY`); it is read when the config is loaded and again at every
reload, and never printed. A webhook reaches a loopback address, or a host its
`allowed_hosts` names, the rule the tracing endpoint follows (`host_allowed`): an event
stream of the daemon's turns is not sent anywhere by a typo.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, model_validator
from yarl import URL

from turnkeeper.config.secrets import CREDENTIAL_NAME, read_credential, read_secret
from turnkeeper.config.sections import ConfigError, PositiveFloat, PositiveInt, _Section
from turnkeeper.config.tracing import host_allowed
from turnkeeper.policy.webhooks import decode_secret, valid_pattern

# Events never stored (streamed text), so never in an outbox.
LIVE_ONLY = frozenset({"model.delta"})
_SOURCES = ("secret_env", "secret_file", "secret_credential")


class WebhookConfig(_Section):
    # The name in status, metrics and the outbox (default: the url's host and path).
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:/\-]*$", max_length=200)] = ""
    url: str
    events: tuple[str, ...] = ("turn.finished",)
    secret_env: str = ""
    secret_file: str = ""
    secret_credential: Annotated[str, Field(pattern=CREDENTIAL_NAME)] = ""
    timeout: PositiveFloat = 10.0
    max_attempts: PositiveInt = 8
    # Deliveries waiting at most; past it the oldest are given up (kept as failed).
    max_pending: PositiveInt = 10_000
    allowed_hosts: tuple[str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("name") and isinstance(data.get("url"), str):
            url = URL(data["url"]) if "://" in data["url"] else None
            if url is not None and url.host:
                host = f"{url.host}:{url.port}" if url.explicit_port else url.host
                data = {**data, "name": (host + url.path.rstrip("/"))[:200]}
        return data

    @model_validator(mode="after")
    def _checked(self) -> WebhookConfig:
        # pydantic's error names the webhook (`webhooks.NAME:` or its index): each
        # message starts with the key.
        url = URL(self.url) if self.url.startswith(("http://", "https://")) else None
        if url is None or not url.host:
            raise ValueError(f"url: {self.url!r} is not an http:// or https:// URL")
        if url.user or url.password:
            raise ValueError("url: credentials in the URL are not sent; the "
                             "signature is what a receiver checks")
        host = url.host.lower()
        if not host_allowed(host, self.allowed_hosts):
            raise ValueError(f"url: host {host} is not a loopback address; list it "
                             "in allowed_hosts to send this daemon's events there")
        sources = [k for k in _SOURCES if getattr(self, k)]
        if len(sources) != 1:
            raise ValueError("secret_env, secret_file, secret_credential: set exactly one "
                             f"(set: {', '.join(sources) or 'none'})")
        if not self.events:
            raise ValueError("events: name at least one event type")
        for pattern in self.events:
            if not valid_pattern(pattern):
                raise ValueError(f"events: {pattern!r} is not an event type (such "
                                 "as turn.finished) or a prefix ending in * (turn.*)")
            if pattern in LIVE_ONLY:
                raise ValueError(f"events: {pattern} is streamed live only, never "
                                 "stored, so it cannot be delivered")
        return self

    def secret(self) -> bytes:
        """The signing key, read now (a reload reads it again, so a rotated secret takes
        effect). Raises ConfigError naming the secret's source, never its value."""
        where = f"webhooks.{self.name}"
        if self.secret_env:
            key, text = f"{where}.secret_env", os.environ.get(self.secret_env, "")
            if not text:
                raise ConfigError(f"{key}: the variable {self.secret_env} is not set or is "
                                  "empty")
        elif self.secret_file:
            key = f"{where}.secret_file"
            text = read_secret(Path(self.secret_file), key)
        else:
            key = f"{where}.secret_credential"
            text = read_credential(self.secret_credential, key)
        try:
            return decode_secret(text)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None


def check_webhook_secrets(webhooks: tuple[WebhookConfig, ...]) -> list[str]:
    """The error of every webhook whose secret cannot be read or decoded."""
    out = []
    for hook in webhooks:
        try:
            hook.secret()
        except ConfigError as exc:
            out.append(f"  {exc}")
    return out
