"""The events of the daemon itself, about no one turn: a reload and its outcome, a
stop, a webhook delivery given up."""

from __future__ import annotations

from dataclasses import dataclass

from turnkeeper.event_types.body import EventBody

# -- the daemon ---------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class DaemonReloading(EventBody):
    TYPE = "daemon.reloading"
    trigger: str
    policy_version: int


@dataclass(slots=True, kw_only=True)
class DaemonReloadFailed(EventBody):
    TYPE = "daemon.reload_failed"
    trigger: str
    error: str
    policy_version: int


@dataclass(slots=True, kw_only=True)
class DaemonReloaded(EventBody):
    TYPE = "daemon.reloaded"
    trigger: str
    policy_version: int
    content_hash: str | None
    pending_restart: list[str]
    duration_s: float
    resumed: int
    unchanged: bool = False  # the running policy again: no drain, no new version


@dataclass(slots=True, kw_only=True)
class DaemonStopping(EventBody):
    TYPE = "daemon.stopping"
    running: int
    parked: int
    queued: int


# -- webhooks -----------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class WebhookFailed(EventBody):
    """A webhook delivery given up for good: the receiver refused it, its attempts ran
    out, or the webhook's outbox was full. It stays in the outbox as failed."""

    TYPE = "webhook.failed"
    webhook: str
    webhook_id: str  # the delivery's `webhook-id` header
    event_seq: int
    event_type: str
    attempts: int
    error: str

