"""The retry budget per provider, shared by every turn of the daemon.

Envoy's retry budget: retries in flight may not exceed

    max(min_concurrency, ratio * requests in flight)

so that a thousand turns seeing one outage do not become a thousand retry loops piling
onto a struggling provider. A retry the budget refuses is a failover, not a sleep (the
provider chain decides that; this object only counts).

What counts:
- a *request* is any attempt in flight, the first one or a retry: `begin_request()` when
  it is sent, `end_request()` when it ends, however it ends;
- a *retry* is in flight from its admission (`try_begin_retry()` returned True), through
  its backoff sleep, to the end of its attempt: `end_retry()` then, or when it is
  abandoned before its attempt.

The floor `min_concurrency` keeps a quiet daemon able to retry at all: with one request
in flight, `ratio * 1` would otherwise forbid every retry.
"""

from __future__ import annotations

from typing import Any, Protocol

from turnkeeper.errors import TurnkeeperError


class RetryBudgetError(TurnkeeperError, RuntimeError):
    """An end without a begin: a bookkeeping bug in the caller. The count stays at zero."""


class RetryBudgetSettings(Protocol):
    """What `RetryBudget.from_config` reads (`config.RetryBudgetConfig` fits)."""

    @property
    def ratio(self) -> float: ...
    @property
    def min_concurrency(self) -> int: ...


def _check(ratio: float, min_concurrency: int) -> None:
    if not ratio >= 0:  # also rejects NaN
        raise ValueError(f"ratio must be >= 0, got {ratio!r}")
    if min_concurrency < 0:
        raise ValueError(f"min_concurrency must be >= 0, got {min_concurrency}")


class RetryBudget:
    """Counts requests and retries in flight for one provider and admits retries."""

    def __init__(self, *, ratio: float = 0.2, min_concurrency: int = 3, name: str = "") -> None:
        _check(ratio, min_concurrency)
        self.name = name
        self.ratio = ratio
        self.min_concurrency = min_concurrency
        self._requests_in_flight = 0
        self._retries_in_flight = 0
        # The other daemons of a fleet sharing the provider, as last reported.
        self._peer_requests = 0
        self._peer_retries = 0

    @classmethod
    def from_config(cls, config: RetryBudgetSettings, *, name: str = "") -> RetryBudget:
        return cls(ratio=config.ratio, min_concurrency=config.min_concurrency, name=name)

    def __repr__(self) -> str:
        return (f"RetryBudget(name={self.name!r}, requests_in_flight="
                f"{self._requests_in_flight}, retries_in_flight={self._retries_in_flight}, "
                f"ratio={self.ratio}, min_concurrency={self.min_concurrency})")

    @property
    def requests_in_flight(self) -> int:
        return self._requests_in_flight

    @property
    def retries_in_flight(self) -> int:
        return self._retries_in_flight

    @property
    def limit(self) -> float:
        """``max(min_concurrency, ratio * requests_in_flight)``: retries admitted while
        fewer than this many are in flight (the fleet's, when peers report theirs)."""
        return max(float(self.min_concurrency),
                   self.ratio * (self._requests_in_flight + self._peer_requests))

    def set_peers(self, *, requests: int, retries: int) -> None:
        """What the other daemons sharing the work have in flight for this provider: the
        budget then holds for the fleet, not for each daemon alone."""
        self._peer_requests = max(0, requests)
        self._peer_retries = max(0, retries)

    def begin_request(self) -> None:
        self._requests_in_flight += 1

    def end_request(self) -> None:
        if self._requests_in_flight <= 0:
            self._requests_in_flight = 0
            raise RetryBudgetError(
                f"retry budget {self.name!r}: end_request() with no request in flight")
        self._requests_in_flight -= 1

    def try_begin_retry(self) -> bool:
        """Admit one retry if ``retries_in_flight < limit``; it counts from now."""
        if self._retries_in_flight + self._peer_retries < self.limit:
            self._retries_in_flight += 1
            return True
        return False

    def end_retry(self) -> None:
        if self._retries_in_flight <= 0:
            self._retries_in_flight = 0
            raise RetryBudgetError(
                f"retry budget {self.name!r}: end_retry() with no retry in flight")
        self._retries_in_flight -= 1

    def reconfigure(self, *, ratio: float | None = None,
                    min_concurrency: int | None = None) -> None:
        """New limits for a budget a reload keeps (None: unchanged). The counts carry
        over: the calls in flight are still in flight."""
        new_ratio = self.ratio if ratio is None else ratio
        new_min = self.min_concurrency if min_concurrency is None else min_concurrency
        _check(new_ratio, new_min)
        self.ratio = new_ratio
        self.min_concurrency = new_min

    def snapshot(self) -> dict[str, Any]:
        return {"name": self.name, "requests_in_flight": self._requests_in_flight,
                "retries_in_flight": self._retries_in_flight, "limit": self.limit,
                "ratio": self.ratio, "min_concurrency": self.min_concurrency}
