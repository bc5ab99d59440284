"""How long to wait before the next attempt on the same provider.

Two shapes of jittered exponential backoff, both from the AWS architecture blog post
"Exponential Backoff And Jitter":

- full (the default): ``sleep = uniform(0, min(max_delay, base_delay * 2**attempt))``.
  Spreads a crowd of clients evenly over the whole window, so a thousand turns hit by
  the same outage do not come back in lock step.
- decorrelated: ``sleep = min(max_delay, uniform(base_delay, 3 * previous))`` with
  ``previous = base_delay`` for the first retry. Each wait grows from the last one
  rather than from the attempt number.

A Retry-After floor and the turn's remaining time are not applied here: the provider
chain (`chain.py`) owns those rules. This module only knows the curve.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

Jitter = Literal["full", "decorrelated"]

Rand = Callable[[float, float], float]
"""A uniform source: ``rand(a, b)`` returns a float in [a, b] (`random.uniform` in
production, a stub in tests). Randomness comes in as an argument so the rules stay pure."""


class RetrySettings(Protocol):
    """What `Backoff.from_config` reads (`turnkeeper.config.RetryConfig` fits). A protocol,
    so that `policy/` does not import the config layer."""

    @property
    def base_delay(self) -> float: ...
    @property
    def max_delay(self) -> float: ...
    @property
    def jitter(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Backoff:
    """The backoff curve of one policy. Immutable; one instance serves every turn."""

    base_delay_s: float = 0.5
    max_delay_s: float = 30.0
    jitter: Jitter = "full"

    def __post_init__(self) -> None:
        if not self.base_delay_s >= 0:  # also rejects NaN
            raise ValueError(f"base_delay_s must be >= 0, got {self.base_delay_s!r}")
        if not self.max_delay_s >= 0:
            raise ValueError(f"max_delay_s must be >= 0, got {self.max_delay_s!r}")
        if self.jitter not in ("full", "decorrelated"):
            raise ValueError(f"jitter must be 'full' or 'decorrelated', got {self.jitter!r}")

    @classmethod
    def from_config(cls, retry: RetrySettings) -> Backoff:
        jitter: Jitter
        if retry.jitter == "full":
            jitter = "full"
        elif retry.jitter == "decorrelated":
            jitter = "decorrelated"
        else:
            raise ValueError(f"retry.jitter must be 'full' or 'decorrelated', "
                             f"got {retry.jitter!r}")
        return cls(base_delay_s=retry.base_delay, max_delay_s=retry.max_delay, jitter=jitter)

    def ceiling(self, attempt: int) -> float:
        """The full-jitter window, ``min(max_delay, base_delay * 2**attempt)``.

        Overflow is clamped: ``2.0**attempt`` overflows a float near attempt 1024, and a
        window that large is ``max_delay`` anyway.
        """
        if attempt < 0:
            raise ValueError(f"attempt counts from 0 for the first retry, got {attempt}")
        if self.base_delay_s == 0:
            return 0.0
        try:
            grown = self.base_delay_s * 2.0**attempt
        except OverflowError:
            grown = math.inf
        return min(self.max_delay_s, grown)

    def delay(self, *, attempt: int, previous_s: float | None = None, rand: Rand) -> float:
        """Seconds to sleep before retry number ``attempt`` (0 for the first retry).

        full: ``uniform(0, min(max_delay, base_delay * 2**attempt))``; `previous_s` is
        ignored.
        decorrelated: ``min(max_delay, uniform(base_delay, 3 * previous))``, previous being
        the last delay this curve returned for the same call (None: ``base_delay``);
        `attempt` is ignored.

        The result is clamped into the window whatever `rand` returns, so a bad stub can
        not produce a negative or oversized sleep.
        """
        if self.jitter == "full":
            cap = self.ceiling(attempt)
            return min(cap, max(0.0, rand(0.0, cap)))
        previous = self.base_delay_s if previous_s is None else max(0.0, previous_s)
        high = max(self.base_delay_s, 3.0 * previous)
        drawn = min(high, max(self.base_delay_s, rand(self.base_delay_s, high)))
        return min(self.max_delay_s, drawn)
