"""The in-flight gate of each provider: model calls over the provider's current limit
wait their turn, first come first served, and each call's ending feeds the limit
(`policy/aimd.py` decides; this module only parks and wakes).

`ProviderGates.run(provider, call, wait_s, bound)` is the whole interface the model call
uses: it waits for a slot (at most `wait_s`, the time the turn's budget still allows),
starts the call's `bound` there, awaits `call`, and tells the limit how it ended. A wait
that runs out raises `ProviderError` with a local failure, so the breaker learns nothing
and the step's time check stops the turn with its budget's own code. With adaptation
on, a throttling answer (429, 529, Retry-After) cuts the limit and is passed on marked
local too: retried as before, but not counted against the provider's breaker, which
would otherwise take a provider that is up out of service for its whole cooldown.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import anyio

from turnkeeper.clock import Clock
from turnkeeper.config import Config
from turnkeeper.policy.aimd import InFlightLimit, is_overload
from turnkeeper.policy.classify import CallFailure
from turnkeeper.providers.base import ProviderError

T = TypeVar("T")
OnWait = Callable[[int, int, int], None]


class _Waiter:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = anyio.Event()


class ProviderGate:
    def __init__(self, name: str, limit: InFlightLimit) -> None:
        self.name = name
        self.limit = limit
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def wake(self) -> None:
        """Wake the first waiters, as many as there are free slots."""
        free = self.limit.limit - self.limit.in_flight
        for waiter in itertools.islice(self._waiters, max(0, free)):
            waiter.event.set()

    async def _acquire(self, clock: Clock, wait_s: float, on_wait: OnWait | None) -> int:
        """Wait in the queue for a slot: `run` found none free, or callers ahead."""
        waiter = _Waiter()
        self._waiters.append(waiter)
        if on_wait is not None:
            on_wait(self.limit.limit, self.limit.in_flight, len(self._waiters))
        try:
            with clock.move_on_after(max(0.0, wait_s)):
                while True:
                    await waiter.event.wait()
                    epoch = self.limit.try_acquire()
                    if epoch is not None:
                        return epoch
                    waiter.event = anyio.Event()  # taken meanwhile: wait again, in place
        finally:
            self._waiters.remove(waiter)
            self.wake()  # a wake this waiter did not use goes to the next
        raise ProviderError(CallFailure(
            exception=("InFlightWait", "TimeoutError"), local=True,
            message=(f"no in-flight slot for provider {self.name} (limit "
                     f"{self.limit.limit}) within the time the budget allows")))

    async def run(self, call: Coroutine[Any, Any, T], *, clock: Clock, wait_s: float,
                  on_wait: OnWait | None = None,
                  bound: tuple[anyio.CancelScope, float] | None = None) -> T:
        """Await `call` (a coroutine not yet started: closed unstarted when no slot is
        had) once a slot is had, and `bound`, (scope, seconds) of the clock's `scope()`,
        set then: `seconds` from there, the wait for a slot having its own."""
        # Nobody ahead: a free slot is taken at once, with no queue to join (and no
        # coroutine of `_acquire` made: a model call runs here every step).
        epoch = self.limit.try_acquire() if not self._waiters else None
        if epoch is None:
            try:
                epoch = await self._acquire(clock, wait_s, on_wait)
            except BaseException:
                call.close()
                raise
        success = overload = False
        try:
            if bound is not None:
                clock.set_deadline(*bound)
            result = await call
            success = True
            return result
        except ProviderError as exc:
            overload = is_overload(exc.failure.status, exc.failure.retry_after_s)
            if overload and self.limit.adaptive:
                # Throttling is this limit's to answer: the provider is up and asks for
                # fewer calls, so its breaker is not told (it would take the provider
                # out of service for its cooldown over what the limit already slows).
                # The call is retried as any other retryable failure.
                raise ProviderError(replace(exc.failure, local=True)) from exc
            raise
        finally:
            self.limit.release(epoch, success=success, overload=overload)
            if self._waiters:  # else nobody to wake
                self.wake()


class ProviderGates:
    """One gate per provider, kept across reloads (the limit learnt stays learnt)."""

    def __init__(self) -> None:
        self.gates: dict[str, ProviderGate] = {}

    def apply(self, config: Config) -> None:
        ac = config.adaptive_concurrency
        for p in config.providers:
            ceiling = p.max_in_flight
            if ceiling is None and ac.enabled:
                ceiling = p.max_connections  # the pool's size is the natural top
            gate = self.gates.get(p.name)
            if gate is None:
                self.gates[p.name] = ProviderGate(p.name, InFlightLimit(
                    ceiling=ceiling, adaptive=ac.enabled, minimum=ac.min,
                    increase=ac.increase, decrease=ac.decrease))
            else:
                gate.limit.reconfigure(ceiling=ceiling, adaptive=ac.enabled, minimum=ac.min,
                                       increase=ac.increase, decrease=ac.decrease)
                gate.wake()
        for gone in set(self.gates) - {p.name for p in config.providers}:
            del self.gates[gone]

    def run(self, provider: str, call: Coroutine[Any, Any, T], *, clock: Clock,
            wait_s: float, on_wait: OnWait | None = None,
            bound: tuple[anyio.CancelScope, float] | None = None) -> Awaitable[T]:
        """`call` within the provider's limit (`ProviderGate.run`), to be awaited;
        `on_wait(limit, in_flight, waiting)` is told once when the call has to wait for
        a slot. Not a coroutine itself: what it returns is the gate's (or, for a
        provider with no gate, the call with its bound set), with no frame around it."""
        gate = self.gates.get(provider)
        if gate is None:
            if bound is not None:
                clock.set_deadline(*bound)
            return call
        return gate.run(call, clock=clock, wait_s=wait_s, on_wait=on_wait, bound=bound)

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {name: {**gate.limit.snapshot(), "waiting": gate.waiting}
                for name, gate in self.gates.items()}
