"""The restart counter: how many times a turn's step was rebuilt automatically.

A rebuild (older history compacted after a context overflow, or a partially streamed
step redone for another provider) is a restart. A turn that keeps rebuilding is not
getting anywhere, so past `limit` rebuilds it stops with `restarts.exhausted`. A user
message resets the count: the person has changed the situation, so earlier rebuilds no
longer say anything about this one. This is the one place `max_restarts` is compared.
"""

from __future__ import annotations

from turnkeeper.policy.outcome import Stop, StopCode


class RestartCounter:
    def __init__(self, limit: int, *, count: int = 0) -> None:
        """`count` restores the counter of a resumed turn (it lives in the turn's
        counters, which are checkpointed)."""
        if limit < 0:
            raise ValueError(f"max_restarts must be >= 0, got {limit}")
        self.limit = limit
        self.count = count

    def __repr__(self) -> str:
        return f"RestartCounter({self.count}/{self.limit})"

    def restart(self, why: str) -> Stop | None:
        """Count one rebuild; the stop when it is one too many. `why` goes into nothing
        but the caller's log: the stop message says how many, which is what a user needs."""
        del why
        self.count += 1
        if self.count > self.limit:
            return self._exhausted(f"{self.count} automatic rebuilds, more than "
                                   f"max_restarts = {self.limit}")
        return None

    def nothing_to_compact(self) -> Stop:
        """The context overflowed and compaction freed nothing: no rebuild can help, so
        the turn stops now whatever the count."""
        return self._exhausted("the context overflowed and nothing more can be compacted")

    def reset(self) -> None:
        """A user message arrived."""
        self.count = 0

    def _exhausted(self, message: str) -> Stop:
        return Stop(StopCode.RESTARTS_EXHAUSTED, message, value=self.count, limit=self.limit)
