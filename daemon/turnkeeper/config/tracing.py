"""`[tracing]`: OpenTelemetry spans of turns, model attempts and tool attempts, sent over
OTLP/HTTP. Off by default; on, it needs the `otel` extra (checked here, without
importing it, so a config that cannot run is exit 78 at load, not a failure mid-boot).

The collector's host is held to the rule the http tools follow: the daemon sends only
where it was told it may. A loopback address (127.0.0.0/8, ::1, `localhost`) is always
allowed; any other host must be listed in `allowed_hosts`, so a stray
`OTEL_EXPORTER_OTLP_ENDPOINT` in the environment cannot send prompts and tool arguments
to a host nobody configured.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import urllib.parse
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

OTEL_INSTALL_HINT = "pip install 'turnkeeper[otel]'"
# The variable OpenTelemetry's own exporters read: the collector's base URL.
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
DEFAULT_ENDPOINT = "http://127.0.0.1:4318"


def otel_available() -> bool:
    """Whether the OpenTelemetry SDK and its OTLP/HTTP exporter can be imported, without
    importing them."""
    try:
        return all(importlib.util.find_spec(name) is not None
                   for name in ("opentelemetry.sdk.trace",
                                "opentelemetry.exporter.otlp.proto.http"))
    except (ImportError, ValueError, AttributeError):  # a parent set to None in sys.modules
        return False


def default_endpoint() -> str:
    return os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT


def is_loopback(host: str) -> bool:
    """`localhost`, or an address of 127.0.0.0/8 or ::1."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(host: str, allowed_hosts: tuple[str, ...]) -> bool:
    """Whether the daemon may send to `host`: a loopback address always, another host
    only when `allowed_hosts` names it (the rule of the tracing endpoint and of every
    webhook: what the daemon knows leaves the machine only where the config says)."""
    return is_loopback(host) or host.lower() in {h.lower() for h in allowed_hosts}


class TracingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    # The collector's OTLP/HTTP base URL (`/v1/traces` is added, as OpenTelemetry does
    # with the variable); default: $OTEL_EXPORTER_OTLP_ENDPOINT, else the local collector.
    endpoint: str = Field(default_factory=default_endpoint)
    service_name: Annotated[str, Field(min_length=1, max_length=200)] = "turnkeeper"
    # The share of new traces recorded; a turn submitted with a traceparent follows the
    # caller's sampled flag (parent-based).
    sample_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    # Prompts, answers, tool arguments and results in the spans: never unless true.
    capture_content: bool = False
    # Hosts besides loopback the endpoint may name.
    allowed_hosts: tuple[str, ...] = ()

    @field_validator("endpoint")
    @classmethod
    def _url(cls, v: str) -> str:
        try:
            parts = urllib.parse.urlsplit(v)
            parts.port  # noqa: B018 - parsing the port raises ValueError when it is bad
        except ValueError as exc:
            raise ValueError(f"is not a valid URL ({exc}): {v!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http:// or https:// URL with a host, such as "
                             f"{DEFAULT_ENDPOINT!r} (got {v!r})")
        return v

    @model_validator(mode="after")
    def _usable(self) -> TracingConfig:
        """Checked when tracing is on: off, an endpoint from the environment (set for
        another program) is never used, so never refused."""
        if not self.enabled:
            return self
        host = urllib.parse.urlsplit(self.endpoint).hostname or ""
        if not host_allowed(host, self.allowed_hosts):
            source = "" if "endpoint" in self.model_fields_set else f" (from ${ENDPOINT_ENV})"
            raise ValueError(f"endpoint: host {host!r}{source} is neither loopback nor in "
                             "tracing.allowed_hosts; list it there to send spans to it")
        if not otel_available():
            raise ValueError("enabled: tracing needs the OpenTelemetry packages, which are "
                             f"not installed: {OTEL_INSTALL_HINT}")
        return self
