"""What the daemon does while its store cannot be written (a full disk, an I/O error, a
database that does not answer).

A write that fails for a reason of the store's own (not of the write: a constraint) is
not reported to the turn that made it: the turn would end `failed` with a result the
store does not hold, and the store would resume it later to a second, different result.
The write is retried, after a backoff, until the store takes it; meanwhile the daemon is
degraded (status, health, new submits refused with 507) and its turns simply wait, as a
turn waits on a slow disk. Past `fatal_after_s` of failing without a single success, the
outage is fatal: writes fail at once and the daemon exits 74 for its service manager,
which a restart may cure (a remounted disk) and an operator must otherwise see.

`StoreOutage` is the decision, fed with failures and successes and a monotonic `now`;
the store's writer owns one and sleeps what it says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turnkeeper.policy.backoff import Backoff, Rand

# The writer's retries: quick at first (a transient error), then every few seconds.
STORE_BACKOFF = Backoff(base_delay_s=0.05, max_delay_s=5.0, jitter="full")
DEFAULT_FATAL_AFTER_S = 300.0


@dataclass(slots=True)
class StoreOutage:
    fatal_after_s: float = DEFAULT_FATAL_AFTER_S
    backoff: Backoff = field(default=STORE_BACKOFF)
    failing_since: float | None = None
    failures: int = 0
    last_error: str | None = None

    def __repr__(self) -> str:
        if self.failing_since is None:
            return "StoreOutage(ok)"
        return (f"StoreOutage(failing since {self.failing_since:.3f}, {self.failures} "
                f"failures, last: {self.last_error!r})")

    @property
    def degraded(self) -> bool:
        return self.failing_since is not None

    def failed(self, error: str, *, now: float, rand: Rand) -> float:
        """A write failed for the store's own reason: the seconds to wait before trying it
        again."""
        if self.failing_since is None:
            self.failing_since = now
        self.last_error = error
        delay = self.backoff.delay(attempt=min(self.failures, 64), rand=rand)
        self.failures += 1
        return delay

    def recovered(self) -> bool:
        """A write went through: True when that ended an outage."""
        was = self.failing_since is not None
        self.failing_since = None
        self.failures = 0
        self.last_error = None
        return was

    def failing_for(self, *, now: float) -> float:
        return 0.0 if self.failing_since is None else max(0.0, now - self.failing_since)

    def fatal(self, *, now: float) -> bool:
        """The store has failed every write for `fatal_after_s`: give up (exit 74)."""
        return self.failing_since is not None and \
            self.failing_for(now=now) >= self.fatal_after_s

    def retry_after_s(self) -> int:
        """What a refused submit tells its client: the backoff's next wait, at least 1 s."""
        return max(1, int(self.backoff.ceiling(min(self.failures, 64)) + 0.999))
