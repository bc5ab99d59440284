"""The sections of the configuration that shape the daemon and each turn's rules: one
pydantic model per TOML table, unknown keys refused, every limit with its range."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from turnkeeper import exits
from turnkeeper.config.redact import redact_url
from turnkeeper.durations import parse_duration
from turnkeeper.errors import TurnkeeperError

BUILTIN_TOOL_NAMES = frozenset({"report_blocked", "clarify", "update_plan"})

PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
FiniteNonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
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
    # An event follower is dropped (its stream ends with a `stream.dropped` line naming
    # the seq to reopen it after) once the daemon holds more than this for it (events
    # waiting, bytes its socket has not sent), or more than half of it for
    # follower_stall_timeout seconds: a client that stops reading costs bounded memory.
    max_follower_backlog_bytes: PositiveInt = 1024 * 1024
    follower_stall_timeout: Annotated[float, Field(gt=0)] = 30.0
    max_message_bytes: PositiveInt = 256 * 1024
    # A submit whose turn the store cannot keep within this long (a full disk) is
    # answered 507 and its write withdrawn: never left hanging, never run unanswered.
    submit_timeout: Annotated[float, Field(gt=0)] = 5.0
    # How long a submit's Idempotency-Key answers the turn it made (a duration: "24h").
    idempotency_window: str = "24h"
    # Steers and answers a turn holds before its next step takes them: more are refused.
    max_pending_messages: PositiveInt = 32
    # Overload: new submits get 503 while the event loop's lag stays at or over
    # overload_lag seconds (overload_samples samples in a row); intake reopens once the
    # lag has stayed under half of it for overload_clear_after seconds. 0 = off.
    overload_lag: NonNegFloat = 0.5
    overload_samples: PositiveInt = 2
    overload_clear_after: NonNegFloat = 2.0

    @field_validator("idempotency_window")
    @classmethod
    def _window(cls, v: str) -> str:
        parse_duration(v)
        return v

    @property
    def idempotency_window_s(self) -> float:
        return parse_duration(self.idempotency_window)

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


class BudgetExtensionConfig(_Section):
    """`[budget.extension]`: a turn that reaches its step or time limit while it is still
    making progress (something new seen, a new state, a plan item done, within the last
    `window` steps) gets `steps` more steps and `seconds` more active seconds, at most
    `max_extensions` times."""

    enabled: bool = False
    window: PositiveInt = 3
    steps: NonNegInt = 10
    seconds: NonNegFloat = 60.0
    max_extensions: NonNegInt = 2


class BudgetExtensionOverride(_Section):
    enabled: bool | None = None
    window: PositiveInt | None = None
    steps: NonNegInt | None = None
    seconds: NonNegFloat | None = None
    max_extensions: NonNegInt | None = None


class AdaptiveConcurrencyConfig(_Section):
    """`[adaptive_concurrency]`: an additive-increase, multiplicative-decrease limit on
    the model calls in flight per provider, cut on 429/529 or a Retry-After, bounded by
    each provider's `max_in_flight` (else its `max_connections`)."""

    enabled: bool = False
    min: PositiveInt = 1
    increase: PositiveFloat = 1.0
    decrease: Annotated[float, Field(gt=0, lt=1)] = 0.5


class BudgetProfile(_Section):
    """`[budget.profiles.NAME]`: overrides of any `[budget]` key, and of
    `[loop_detection]` / `[failure_loop]` keys in sub-tables of the same names."""

    max_tokens: PositiveInt | None = None
    max_seconds: PositiveFloat | None = None
    max_steps: PositiveInt | None = None
    max_cost_usd: NonNegFloat | None = None
    max_wall_seconds: FiniteNonNegFloat | None = None
    soft_limit: Annotated[float, Field(gt=0, le=1)] | None = None
    mode: Mode | None = None
    loop_detection: LoopDetectionOverride = LoopDetectionOverride()
    failure_loop: FailureLoopOverride = FailureLoopOverride()
    extension: BudgetExtensionOverride = BudgetExtensionOverride()


class BudgetConfig(_Section):
    """`max_wall_seconds`: every second from the turn's first start, waits (retries,
    recovery, clarify) and suspensions included; 0 = off."""

    max_tokens: PositiveInt = 200_000
    max_seconds: PositiveFloat = 300.0
    max_steps: PositiveInt = 40
    max_cost_usd: NonNegFloat = 0.0
    max_wall_seconds: FiniteNonNegFloat = 0.0
    soft_limit: Annotated[float, Field(gt=0, le=1)] = 0.8
    mode: Mode = "enforce"
    extension: BudgetExtensionConfig = BudgetExtensionConfig()
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


ModelName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class ModelConfig(_Section):
    """`[models.NAME]`: a named provider chain (primary first, then its fallbacks, each
    a configured provider) that a submit chooses with `"model": "NAME"`."""

    chain: Annotated[tuple[str, ...], Field(min_length=1)]

    @field_validator("chain")
    @classmethod
    def _no_repeats(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            if v.count(name) > 1:
                raise ValueError(f"provider {name!r} appears twice in the chain")
        return v


class ClarifyConfig(_Section):
    timeout: PositiveFloat = 3600.0


class ApprovalsConfig(_Section):
    """How long a tool call held for a person's approval (`[[tools]] approval`) waits
    for a decision, and what its timeout does: `stop` ends the turn `approval.timeout`,
    `deny` denies the pending calls ("approval timed out") and the turn goes on.
    `timeout` takes seconds or a duration (`90s`, `30m`, `24h`, `7d`)."""

    timeout: PositiveFloat = 86400.0
    on_timeout: Literal["stop", "deny"] = "stop"

    @field_validator("timeout", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        return parse_duration(v) if isinstance(v, str) else v


class SessionsConfig(_Section):
    """A new turn of a session carries the session's earlier turns, newest kept, up to
    `max_history_tokens` (estimated at four characters a token; 0 = no history)."""

    max_history_tokens: NonNegInt = 32_000


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


STORE_URL_SCHEMES = ("postgresql", "postgres")


class StoreConfig(_Section):
    """Where and how the daemon keeps its state. `url` "" (the default) is the embedded
    SQLite file in daemon.state_dir; "postgresql://user@host:port/db" is a PostgreSQL
    database that several daemons can share. `keep_finished`: how long a finished turn
    is kept (a duration: "30d", "12h"; "0" keeps everything; dead letters are kept until
    replayed or pruned). `fatal_after`: seconds of failing every write (a full disk, an
    unreachable database) after which the daemon exits 74 for its service manager; until
    then it retries and reports itself degraded."""

    url: str = ""
    keep_finished: str = "30d"
    fatal_after: PositiveFloat = 300.0

    @field_validator("keep_finished")
    @classmethod
    def _duration(cls, v: str) -> str:
        parse_duration(v)
        return v

    @property
    def keep_finished_s(self) -> float:
        return parse_duration(self.keep_finished)

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, v: str) -> str:
        if not v:
            return v
        try:
            parts = urllib.parse.urlsplit(v)
            parts.port  # noqa: B018 - parsing the port raises ValueError when it is bad
        except ValueError as exc:
            raise ValueError(f"is not a valid URL ({exc}): {redact_url(v)}") from None
        if parts.scheme not in STORE_URL_SCHEMES:
            raise ValueError(
                "must be \"\" (the embedded SQLite file) or a PostgreSQL URL starting with "
                f"postgresql:// or postgres:// (got scheme {parts.scheme or 'none'!r})")
        return v

    @property
    def is_postgres(self) -> bool:
        return bool(self.url)

    def shown_url(self) -> str:
        return redact_url(self.url)


class FleetConfig(_Section):
    """This daemon among several on one shared store. `node_id` "" = the host name and
    a random suffix, made once and kept in the state directory. `lease_seconds`: how long
    a node's claim on a turn lasts without a heartbeat before another node may take it."""

    node_id: Annotated[str, Field(max_length=128, pattern=r"^[A-Za-z0-9._:@-]*$")] = ""
    lease_seconds: Annotated[float, Field(ge=1.0, le=3600.0)] = 15.0


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
