"""The shared ground of one turn: its state, its meters and the few things every room
does (emit an event, checkpoint, park, suspend, finish).

The rooms of a turn (the step loop in `runner`, the model call, the tool step, the
builtin tools) each hold this context and never each other's methods from below: they
meet here, and ask it (`ctx.begin_wait()`, `ctx.hold_stop(stop)`) instead of writing its
fields. It is built for a new turn (`TurnContext.new`) or from the turn's checkpoint
(`TurnContext.restore`): its terms from `turn/terms.py`, its state from
`turn/checkpoint.py`, which writes the checkpoint too (`to_checkpoint()` is the exact
inverse of `restore`).
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable
from typing import Any, NoReturn, cast

from turnkeeper.clock import Clock, to_micros
from turnkeeper.config import ToolConfig
from turnkeeper.event_types import EventBody, GuardWouldStop, TurnSuspended
from turnkeeper.events import EventBus
from turnkeeper.messages import ToolSpec
from turnkeeper.policy.backoff import Rand
from turnkeeper.policy.budget import BudgetLimits, BudgetUsage
from turnkeeper.policy.gate import ModeGate, WouldStop
from turnkeeper.policy.outcome import Stop, StopCode, TurnResult
from turnkeeper.policy.restarts import RestartCounter
from turnkeeper.policy.turn_state import TurnState, moved
from turnkeeper.runtime import Runtime, Shared
from turnkeeper.store.base import QueuesTurns, SavedCheckpoint, Store, queues_turns
from turnkeeper.tools.mcp_tool import McpTool
from turnkeeper.tracing import NO_SPAN, Span, Tracer
from turnkeeper.turn.checkpoint import TurnStart, as_stored, fresh, restored, whole
from turnkeeper.turn.control import TurnControl
from turnkeeper.turn.record import TurnRecord
from turnkeeper.turn.replay import Replay
from turnkeeper.turn.terms import Terms, terms_in_force, turn_log


class Suspended(Exception):
    """Internal: the turn is to stop here and resume later from its checkpoint."""


class PolicyChanged(Suspended):
    """Internal: the turn woke from a wait a reload let it keep; its runner is to be
    built again under the policy in force (from its state in memory, without a write)."""


class Redirected(Exception):
    """Internal: a steer with redirect cut the model call; the step starts over."""


class TurnContext:
    """Built by `new` (a fresh turn) or `restore` (one rebuilt from its checkpoint)."""

    def __init__(self, record: TurnRecord, control: TurnControl, *, runtime: Runtime,
                 shared: Shared, store: Store, bus: EventBus, clock: Clock, rand: Rand,
                 terms: Terms, start: TurnStart) -> None:
        self.record = record
        self.control = control
        self.runtime = runtime
        self.shared = shared
        self.store = store
        # The store's queued checkpoint, when it has one (see `checkpoint`).
        self._queue_turn = (cast(QueuesTurns, store).queue_turn if queues_turns(type(store))
                            else None)
        self.bus = bus
        self.clock = clock
        self.rand = rand
        self.settings = runtime.settings
        # The span of the turn's run here (`runner`), parent of its attempts' spans.
        self.span: Span = NO_SPAN
        self.modes = terms.modes
        self.mode_gate = ModeGate(terms.modes)
        self.restarts = RestartCounter(self.settings.max_restarts,
                                       count=record.counters.restarts)
        self.agent = terms.agent
        # The agent a reload removed from under the turn (reported when it starts).
        self.agent_removed = terms.agent_removed
        # The schema the final answer must match (None: free text), from one place.
        self.output_schema = self.settings.output_schema_for(record.output_schema, self.agent)
        self._take(start)
        self._active_since: float | None = None
        # Set when the turn answers: what its result's write stores with it (the
        # checkpoint, its message rows and its trail rows).
        self.result_checkpoint: SavedCheckpoint | None = None
        self.apply_limits()

    def _take(self, start: TurnStart) -> None:
        """The state the turn begins this run with, each part its own field (what each
        holds: `TurnStart`)."""
        self.conv = start.conv
        self.guard = start.guard
        self.watch = start.watch
        self.loops = start.loops
        self.failures = start.failures
        self.chain = start.chain
        self.partial = start.partial
        self.open_issues = start.open_issues
        self.waiting_since = start.waiting_since
        self.recover_until = start.recover_until
        self.pending_stop = start.pending_stop
        self.effects = start.effects
        self.trail = start.trail
        self.in_force = start.limits
        self.extension = start.extension
        self.decided = start.decided
        self._replay = Replay(self.store, self.record.id, start.events_after)
        self.resumed = start.resumed
        self.restore_error = start.restore_error

    @classmethod
    def new(cls, record: TurnRecord, control: TurnControl, *, runtime: Runtime,
            shared: Shared, store: Store, bus: EventBus, clock: Clock,
            history: list[dict[str, Any]], rand: Rand = random.uniform) -> TurnContext:
        """A turn from its first step (`history`: the session's earlier messages)."""
        terms = terms_in_force(record, runtime, clock)
        return cls(record, control, runtime=runtime, shared=shared, store=store, bus=bus,
                   clock=clock, rand=rand, terms=terms,
                   start=fresh(terms, record, history, rand))

    @classmethod
    def restore(cls, record: TurnRecord, control: TurnControl, checkpoint: dict[str, Any],
                *, runtime: Runtime, shared: Shared, store: Store, bus: EventBus,
                clock: Clock, history: list[dict[str, Any]], rand: Rand = random.uniform
                ) -> TurnContext:
        """A turn rebuilt from its checkpoint (`resumed`); one that holds no step yet, or
        cannot be read, begins as a new turn (the latter with `restore_error` set: the
        turn ends `internal` with what is known)."""
        terms = terms_in_force(record, runtime, clock)
        return cls(record, control, runtime=runtime, shared=shared, store=store, bus=bus,
                   clock=clock, rand=rand, terms=terms,
                   start=restored(terms, record, checkpoint, history, rand))

    @property
    def limits(self) -> BudgetLimits:
        """The turn's base limits, before any extension (see `in_force`)."""
        return self.in_force.base

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        """The tools offered to the turn's agent now: the built-ins and its own."""
        return self.runtime.toolbox.specs_for(self.agent.tools)

    def tool(self, name: str) -> ToolConfig | McpTool | None:
        """The tool `name` names for the turn's agent: None for one it is not offered,
        as for a tool that does not exist (a call naming it is answered the same)."""
        return self.runtime.toolbox.get(name) if self.agent.tools.allows(name) else None

    @functools.cached_property
    def log(self) -> Any:
        """The turn's logger, bound on first use: most turns write no line of their own,
        and a bind assembles a new structlog logger (building a turn's runner took 61 us
        with it, 30 without)."""
        return turn_log(self.record)

    def start_active(self) -> None:
        if self._active_since is None:
            self._active_since = self.clock.monotonic()
            self.record.active_since = self.clock.time()

    def stop_active(self) -> None:
        if self._active_since is not None:
            self.record.usage.seconds = to_micros(
                self.record.usage.seconds + self.clock.monotonic() - self._active_since)
            self._active_since = None
            self.record.active_since = None

    def usage(self) -> BudgetUsage:
        u = self.record.usage
        seconds = u.seconds
        if self._active_since is not None:
            seconds += self.clock.monotonic() - self._active_since
        # Built as a tuple (a named tuple's own constructor is a Python call), often.
        return tuple.__new__(BudgetUsage, (u.input_tokens + u.output_tokens, seconds,
                                           self.record.counters.steps, u.cost_usd))

    def remaining_s(self) -> float:
        """The time the turn has left, the least of its active time, its wall-clock
        budget and its deadline: what every wait, request, stream and tool call is
        bounded by."""
        return self.guard.remaining_seconds(self.usage(), now=self.clock.time())

    def time_spent(self) -> Stop | None:
        """The budget's stop when the active time, the wall clock or the deadline has
        run out."""
        return self.guard.check_time(self.usage(), now=self.clock.time())

    def emit(self, event: EventBody | str, **data: Any) -> None:
        """Publish one of this turn's events: a catalogue event, or (for the rooms not
        yet moved to the catalogue) a wire type with its fields. While `replaying`, an
        event the turn already logged is not published again."""
        if self._replay.logged and self._replay.was_logged(event, data):
            return
        self.bus.publish(event, turn=self.record.id, **data)

    def replaying(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Around work a resumed turn does again (a step's tools, from the journal): what
        it publishes again as it was logged is left out (see `turn/replay.py`)."""
        return self._replay.around()

    def sync_counters(self) -> None:
        c = self.record.counters
        (c.provider_attempts, c.fallback_hops, c.recovery_cycles,
         self.record.provider) = self.chain.counters()
        c.restarts = self.restarts.count

    def counter_values(self) -> dict[str, Any]:
        """The counters and meters, for a log line."""
        self.sync_counters()
        u = self.usage()
        return {**self.record.counters.to_json(), "tokens": u.tokens,
                "seconds": round(u.seconds, 3), "cost_usd": round(u.cost_usd, 6)}

    def to_checkpoint(self) -> dict[str, Any]:
        """The whole state, messages and trail lines inline: what a resume from memory
        starts from."""
        return whole(self, self.bus.last_seq)

    def checkpoint_with_result(self) -> None:
        """The checkpoint of a turn that has just answered, kept for the write of its
        result (`result_checkpoint`) instead of written on its own: the answer, the
        checkpoint and the result then commit in one transaction, and a crash keeps all
        three or none (the step is asked again)."""
        self.sync_counters()
        trail, lines = self.trail.save()
        self.result_checkpoint = (as_stored(self, trail, self.bus.last_seq),
                                  self.conv.unsaved_rows(), lines)

    def move(self, new: TurnState) -> None:
        """Change the turn's state through the transition table: an illegal move raises
        instead of leaving the turn in two places at once."""
        self.record.set_state(moved(self.record.state, new))

    async def checkpoint(self, state: TurnState | None = None, *, queued: bool = False
                         ) -> None:
        """Save the record and the checkpoint; durable on return, or with `queued` (and a
        store that queues checkpoints) only queued, to commit before the turn's next
        write. A queued checkpoint is for a point whose next durable write is awaited
        anyway: a crash before it commits runs the step again from the checkpoint
        before (see `QueuesTurns` in the store interface). An awaited checkpoint moves
        the live record to `state` once the store holds it: what a reader of the live
        turn sees in a parked or suspended state survives a crash."""
        new = None if state is None else moved(self.record.state, state)
        queue = self._queue_turn if queued else None
        if new is not None and queue is not None:
            self.record.set_state(new)
        self.sync_counters()
        if (since := self._active_since) is not None:  # active time so far to the record
            now, usage = self.clock.monotonic(), self.record.usage
            usage.seconds = to_micros(usage.seconds + now - since)
            self._active_since, self.record.active_since = now, self.clock.time()
        self.record.updated_at = self.clock.time()
        # The messages go as rows, only those not stored yet, and the checkpoint counts
        # them; the trail's lines ride in its tail until they make a row.
        rows, (trail, lines) = self.conv.unsaved_rows(), self.trail.save()
        record = self.record.to_json()
        saved = as_stored(self, trail, self.bus.last_seq)
        if queue is None or not queue(record, saved, messages=rows, trail=lines):
            if new is not None:
                record["state"] = new
            await self.store.save_turn(record, saved, messages=rows, trail=lines)
            if new is not None:
                self.record.set_state(new)
        self.conv.mark_saved()
        self.trail.mark_saved()

    # -- ways out -----------------------------------------------------------------------

    def finish(self, stop: Stop, *, answer: str | None = None,
               error_id: str | None = None, extra: dict[str, Any] | None = None
               ) -> TurnResult:
        return TurnResult(stopped_because=stop, answer=answer, partial=tuple(self.partial),
                          open_issues=tuple(self.open_issues), error_id=error_id,
                          extra=extra or {})

    def stop(self, stop: Stop) -> TurnResult:
        """End the turn early (or blocked, or completed) with the last thing it said."""
        if stop.code not in (StopCode.COMPLETED, StopCode.BLOCKED):
            self.open_issues.append(f"stopped early: {stop.message}")
        return self.finish(stop, answer=self.conv.last_assistant_text()
                           if stop.code is not StopCode.INTERNAL else None)

    async def suspend(self, *, parked: bool = False) -> NoReturn:
        """Stop here; the supervisor requeues the turn. A parked turn (waiting, recovering)
        was checkpointed when it parked and has not moved since: that checkpoint is what a
        resume needs, so only its state changes, in memory (after a crash the stored row
        resumes it the same way). A thousand parked turns then cost a reload no writes.
        One a reload's drain held is `suspended` and announced already."""
        self.stop_active()
        if parked:
            if self.record.state == TurnState.SUSPENDED.value:
                raise Suspended  # held by a reload's drain, announced then: not twice
            self.move(TurnState.SUSPENDED)
        else:
            await self.checkpoint(TurnState.SUSPENDED)
        self.emit(TurnSuspended(step=self.record.counters.steps))
        raise Suspended

    async def park(self, state: TurnState, *, until: float,
                   done: Callable[[], bool]) -> None:
        """Wait, not as active time and without a slot, until the wall-clock time `until`
        (never past the deadline or the wall-clock budget, which count every wait), until
        `done()` holds, or until a suspend. The turn is checkpointed in `state` first, so
        a crash resumes it in the same wait. A suspend raises `Suspended`; otherwise the
        turn is running again on return, whichever way the wait ended."""
        now = self.clock.time()
        wait_s = min(max(0.0, until - now), self.guard.clock_left(now))
        self.stop_active()
        await self.checkpoint(state)
        if not await self.control.wait_parked(self.clock, wait_s, done):
            await self.suspend(parked=True)
        if self.control.policy_changed:
            raise PolicyChanged
        self.move(TurnState.RUNNING)
        self.start_active()

    def gate(self, stop: Stop) -> Stop | None:
        """The stop, when its guard family enforces; else None, with the stop recorded
        once per code in `would_have_stopped` (and, in warn mode, told to the agent)."""
        decision = self.mode_gate.decide(
            stop, recorded={w["code"] for w in self.record.would_have_stopped})
        if not isinstance(decision, WouldStop):
            return decision
        entry: dict[str, Any] = {
            "code": stop.code.value, "counter": stop.counter, "value": stop.value,
            "limit": stop.limit, "step": self.record.counters.steps,
            "mode": decision.mode, "message": stop.message}
        self.record.would_have_stopped.append(entry)
        self.emit(GuardWouldStop(**entry))
        self.log.info("guard.would_stop", **entry, **self.counter_values())
        if decision.note is not None:
            self.conv.add_note(decision.note)
        return None

    def has_unread_steer(self) -> bool:
        return any(m["kind"] == "steer" for m in self.record.inbox)

    def absorb_messages(self) -> None:
        """Steers join the conversation at the step boundary. A user message is never
        charged to any counter; it resets `restarts`."""
        steers = [m for m in self.record.inbox if m["kind"] == "steer"]
        if not steers:
            return
        self.record.inbox = [m for m in self.record.inbox if m["kind"] != "steer"]
        for m in steers:
            self.conv.add_user(m["text"])
        # A steer ends a recovery wait the turn resumed in (a restart, a reload), as one
        # that comes during the wait does: the next call starts a new pass.
        self.recover_until = self.record.next_attempt_at = None
        self.user_message_arrived()
        self.control.redirect_requested = False
        self.pending_stop = None

    # -- the turn's own waits and holds, kept here (checkpointed with the turn) --------

    def begin_wait(self) -> float:
        """A clarify wait starts, or goes on after a resume: when it began."""
        if self.waiting_since is None:
            self.waiting_since = self.clock.time()
        return self.waiting_since

    def end_wait(self) -> float:
        """The clarify wait is over: how long it lasted."""
        began = self.begin_wait()
        self.waiting_since = None
        return self.clock.time() - began

    def begin_recovery(self, wait_s: float) -> float:
        """A recovery wait starts (`wait_s`), or goes on after a resume (what is left of
        the one it was in): when it ends."""
        if self.recover_until is None:
            self.recover_until = self.clock.time() + wait_s
        return self.recover_until

    def end_recovery(self) -> None:
        self.recover_until = None

    def hold_stop(self, stop: Stop) -> None:
        """A guard stopped the turn after this step's tool calls: the stop waits for the
        step boundary, where a steer that came meanwhile still cancels it."""
        self.pending_stop = stop

    def begin_span(self, tracer: Tracer) -> None:
        """The span of the turn's run here, parent of its attempts' spans."""
        self.span = tracer.turn(self.record, resumed=self.resumed)

    def apply_limits(self) -> None:
        """The guards and the record take the limits in force, each in its form (see
        `turn/limits_in_force.py`): when the turn is built, and after an extension."""
        self.guard.limits = self.in_force.for_guard()
        watched = self.in_force.for_watch()
        if self.watch is not None and watched is not None:
            self.watch.limits = watched
        self.record.limits = self.in_force.shown()

    def user_message_arrived(self) -> None:
        """A steer or an answer: the person changed the situation, so the rebuilds
        before it say nothing about what comes next."""
        self.restarts.reset()
        self.record.counters.restarts = 0
