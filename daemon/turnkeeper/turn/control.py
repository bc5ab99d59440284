"""What the outside world can do to a running turn: cancel it, suspend it, wake it,
steer it. The supervisor holds a `TurnControl` per live turn; the turn reads it at step
boundaries and while parked."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from turnkeeper.clock import Clock


@dataclass(slots=True)
class TurnControl:
    """What the outside world can do to a running turn. The supervisor holds it; the
    runner reads it at step boundaries and while parked. `wake` is a bare asyncio event
    (the daemon runs anyio on asyncio): an anyio one cost 3.2 us to make, every turn,
    and this 0.3."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    cancel_requested: bool = False
    suspend_requested: bool = False
    redirect_requested: bool = False
    parked: bool = False
    scope: anyio.CancelScope | None = None
    call_scope: anyio.CancelScope | None = None
    # A non-idempotent tool call is on the wire: a suspend that would cut the step short,
    # or a plain cancel, waits for it instead (bounded by the tool's own timeout), so its
    # outcome is journalled and never "unknown". The tool step suspends or ends the turn
    # right after it (`suspend_now`, `cancel_requested`). Only `cancel --now` cuts it.
    effect_in_flight: bool = False
    suspend_now: bool = False
    # A reload past its drain timeout: a model call in flight (or its retry wait) is cut
    # at once and the turn suspends at its step boundary; a tool call is never cut.
    cut_model_call: bool = False
    cancel_now: bool = False
    # A reload swapped the policy while the turn was parked and let it wait on: once
    # awake (its slot taken again) it goes on under the new policy, its runner built
    # again from its state by the supervisor, not under the one it parked with.
    policy_changed: bool = False
    # ... and the swap announced its resume (`turn.resumed` under the new version): the
    # runner built again does not announce it a second time.
    resume_announced: bool = False
    # A parked turn (recovering, waiting) gives its slot of max_concurrent_turns back and
    # takes one again when it wakes: a thousand turns waiting for answers must not block new
    # work. Set by the supervisor; None: no slot accounting.
    release_slot: Callable[[], None] | None = None
    acquire_slot: Callable[[], Awaitable[None]] | None = None
    # In a fleet: waits, before a model request or a tool call is sent, until the node's
    # lease on the turn is confirmed (it may have lapsed while the database was
    # unreachable, and another node may run the turn by now).
    confirm_lease: Callable[[], Awaitable[None]] | None = None

    def _wake(self) -> None:
        self.wake.set()
        self.wake = asyncio.Event()

    def wake_up(self) -> None:
        """Wake whatever the turn waits on, to look at this control again."""
        self._wake()

    def park(self) -> None:
        self.parked = True
        if self.release_slot is not None:
            self.release_slot()

    async def wait_parked(self, clock: Clock, wait_s: float, done: Callable[[], bool]
                          ) -> bool:
        """Park, and wait up to `wait_s` until `done()` holds or a suspend is asked; then
        take a slot again (`unpark`). False when the turn is to suspend instead."""
        self.park()
        try:
            with clock.move_on_after(wait_s):
                while not (done() or self.suspend_requested):
                    await self.wake.wait()
        except BaseException:  # cancelled: no slot to take back
            self.parked = False
            raise
        return await self.unpark()

    async def unpark(self) -> bool:
        """Take a slot again (waiting for one if need be). False when the turn is to suspend
        instead: a reload or a stop came while it was parked."""
        try:
            if self.acquire_slot is not None and not self.suspend_requested:
                await self.acquire_slot()
        finally:
            self.parked = False
        return not self.suspend_requested

    def message_arrived(self, *, redirect: bool) -> None:
        if redirect:
            self.redirect_requested = True
            if self.call_scope is not None:
                self.call_scope.cancel()
        self._wake()

    def cancel(self, *, now: bool = False) -> None:
        """End the turn `cancelled`. A side effect in flight finishes first (its real
        outcome is recorded) unless `now`: then it is cut, and recorded as unknown."""
        self.cancel_requested = True
        if now:
            self.cancel_now = True
        if self.scope is not None and (now or not self.effect_in_flight):
            self.scope.cancel()

    def suspend(self, *, now: bool = False, between_effects: bool = False) -> None:
        """At the next step boundary; a parked turn at once (it wakes and checkpoints as
        `suspended`, its question or recovery wait kept); with `now` (a stop), cut the step
        short but for an effect on the wire. With `between_effects` (a reload that waited
        its drain timeout), cut only what has no effect: a model call in flight, or its
        retry wait, is cut (it is asked again on resume, under the new policy), while a
        tool call on the wire finishes (bounded by its timeout) and the turn suspends
        right after it, before its next call."""
        self.suspend_requested = True
        if now or between_effects:
            self.suspend_now = True
        if between_effects:
            self.cut_model_call = True
            if self.call_scope is not None:
                self.call_scope.cancel()
        elif now and not self.parked and not self.effect_in_flight and self.scope is not None:
            self.scope.cancel()
        self._wake()

    @property
    def model_call_cut(self) -> bool:
        """A steer with redirect or a reload's suspend asks the model call to end now."""
        return self.redirect_requested or self.cut_model_call
