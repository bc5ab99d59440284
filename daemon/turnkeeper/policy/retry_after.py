"""What the peers asked for in their Retry-After, remembered for every turn.

A provider or a tool that answers ``429 Retry-After: 30`` has said something about the
next 30 seconds, not only about the request it refused: a later step of the same turn,
or another turn, asking within that window is refused the same way and adds load the
peer asked us not to add. So the daemon keeps one window per peer (named as its circuit
breaker is: ``provider:NAME``, ``tool:NAME``), shared by every turn and every policy
version, and the callers ask it before they send:

- the provider chain skips a provider inside its window, a hop with reason
  ``retry_after`` and no attempt (policy/chain.py `on_retry_after`);
- a tool call inside its tool's window is not sent: the agent is told how long the tool
  asked to wait, as a retryable failure with no request made.

Only a Retry-After the policy honours opens a window (`heard`): one above
``retry.max_retry_after`` says the peer is unavailable for longer than the daemon will
wait, which keeps its meaning (the chain fails over at once, the tool call fails) and is
not remembered: a gateway's ``Retry-After: 86400`` does not shut a provider out for a
day. A later Retry-After never shortens a window (the longest word wins, as a fleet
keeps the longest breaker opening). Several daemons sharing a store (a fleet) keep one
window per peer: `observer` hears each window this node opened, for the node to
publish; a window heard from another node comes in through `remember`.

Times are the caller's monotonic clock, in seconds; nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from turnkeeper.policy.classify import CallFailure


@dataclass(frozen=True, slots=True)
class WindowOpened:
    """A window this node opened: `name` is not to be asked for `for_s` seconds."""

    name: str
    for_s: float


class RetryAfterMemory:
    """The open Retry-After windows, per peer name: the monotonic time each ends."""

    def __init__(self) -> None:
        # Empty while no window is open, the usual case: a caller reads it first and asks
        # `window` only when it holds something (a call saved at every attempt).
        self.until: dict[str, float] = {}
        # Hears each window `heard` opened or lengthened (in a fleet: to share it).
        self.observer: Callable[[WindowOpened], None] | None = None

    def __repr__(self) -> str:
        return f"RetryAfterMemory({len(self.until)} windows)"

    def heard(self, name: str, retry_after_s: float | None, *, now: float,
              max_retry_after_s: float) -> float | None:
        """A peer answered with this Retry-After (None: without one). Returns the seconds
        remembered: None when the answer opens no window (no Retry-After, a zero or
        negative one, or one above `max_retry_after_s`, which keeps its meaning of
        "unavailable" and is not remembered)."""
        if retry_after_s is None or not 0 < retry_after_s <= max_retry_after_s:
            return None
        if self.remember(name, now + retry_after_s, now=now) and self.observer is not None:
            self.observer(WindowOpened(name, retry_after_s))
        return retry_after_s

    def remember(self, name: str, until: float, *, now: float) -> bool:
        """Keep `name` unasked until the monotonic time `until` (a window heard here, or
        from another node of a fleet). False when it changes nothing: a window already
        open as long, or one that has already passed."""
        if until <= now or until <= self.until.get(name, now):
            return False
        self.until[name] = until
        return True

    def window(self, name: str, now: float) -> float | None:
        """Seconds left of `name`'s window; None when it has none open (a window that
        has passed is forgotten)."""
        until = self.until.get(name)
        if until is None:
            return None
        if until <= now:
            del self.until[name]
            return None
        return until - now

    def forget(self, name: str) -> None:
        """A peer that is no longer the one that asked (its config changed, or it is
        gone): whatever it asked for does not carry over."""
        self.until.pop(name, None)

    def names(self) -> list[str]:
        return list(self.until)

    def windows(self, now: float) -> dict[str, float]:
        """Every open window: name -> seconds left."""
        return {name: until - now for name, until in self.until.items() if until > now}


def not_sent(name: str, window_s: float) -> CallFailure:
    """The failure a call refused inside its peer's window reports: retryable (the
    peer will take it later), with the wait left as its Retry-After, and words for the
    agent that say nothing was sent and how long to wait."""
    return CallFailure(
        exception=("RetryAfterWindow", "ConnectionError"), retry_after_s=window_s,
        message=(f"not sent: {name} asked (Retry-After) not to be called for "
                 f"{window_s:.1f} more seconds; try again after that, or do something "
                 "else meanwhile"))
