"""When a failed tool call is tried again.

Only an idempotent tool is retried (the same Idempotency-Key on every attempt, so the
peer can deduplicate); a call with side effects gets exactly one attempt, because a
second one could do the thing twice. A deterministic failure is never retried: the same
request would fail the same way. A retry waits for the backoff, at least the peer's
Retry-After, and is given up when that wait exceeds the longest Retry-After the policy
honours or the time the turn has left.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnkeeper.policy.backoff import Backoff, Rand
from turnkeeper.policy.classify import FailureClass


def attempts_for(*, idempotent: bool, max_attempts: int) -> int:
    """The attempts one call gets: `max_attempts` for an idempotent tool, else 1."""
    return max_attempts if idempotent else 1


@dataclass(frozen=True, slots=True)
class ToolRetry:
    backoff: Backoff
    max_retry_after_s: float

    def next_delay(self, *, attempt: int, max_attempts: int, failure_class: FailureClass,
                   retry_after_s: float | None, remaining_s: float,
                   previous_s: float | None, rand: Rand) -> float | None:
        """Seconds to wait before attempt `attempt + 1`, or None to give up with the
        failure of attempt `attempt` (1-based). `previous_s` is the last wait of this
        call (for decorrelated jitter); `max_attempts` is what `attempts_for` gave."""
        if failure_class is FailureClass.DETERMINISTIC or attempt >= max_attempts:
            return None
        delay = self.backoff.delay(attempt=attempt - 1, previous_s=previous_s, rand=rand)
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        if delay > min(self.max_retry_after_s, remaining_s):
            return None
        return delay
