"""The shared ground of one turn: its state, its meters and the few things every room
does (emit an event, checkpoint, park, suspend, finish).

The rooms of a turn (the step loop in `runner`, the model call, the tool step, the
builtin tools) each hold this context and never each other's methods from below: they
meet here. The state is either fresh (a new turn) or restored from a checkpoint, and
`to_checkpoint()` is its exact inverse. A checkpoint written to the store holds the
conversation's counts, not its messages (those go as rows, each written once), and the
trail's tail (see `turn/trail.py`).
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, cast

import structlog

from turnkeeper import jsonwire
from turnkeeper.clock import Clock, to_micros
from turnkeeper.config import GuardConfig, ToolConfig
from turnkeeper.event_types import EventBody, GuardWouldStop, TurnAgentRemoved, TurnSuspended
from turnkeeper.events import EventBus
from turnkeeper.messages import ToolSpec
from turnkeeper.policy.agents import AgentDefinition
from turnkeeper.policy.budget import BudgetGuard, BudgetLimits, BudgetUsage
from turnkeeper.policy.effects import EffectLedger
from turnkeeper.policy.extension import Extension
from turnkeeper.policy.gate import ModeGate, WouldStop
from turnkeeper.policy.outcome import Stop, StopCode, TurnResult
from turnkeeper.policy.restarts import RestartCounter
from turnkeeper.policy.turn_state import TurnState, moved
from turnkeeper.runtime import Runtime, Shared
from turnkeeper.settings import ChainSettings, failure_loop, loop_detector
from turnkeeper.store.base import QueuesTurns, SavedCheckpoint, Store, queues_turns
from turnkeeper.tools.mcp_tool import McpTool
from turnkeeper.tracing import NO_SPAN, Span, Tracer
from turnkeeper.turn.control import TurnControl
from turnkeeper.turn.conversation import Conversation
from turnkeeper.turn.record import TurnRecord
from turnkeeper.turn.trail import Trail
from turnkeeper.turn.trail import read as read_trail

log = structlog.get_logger("turnkeeper.turn")


# An event's envelope, around the fields its type gives it.
_ENVELOPE = frozenset({"seq", "ts", "turn", "type"})


class Suspended(Exception):
    """Internal: the turn is to stop here and resume later from its checkpoint."""


class PolicyChanged(Suspended):
    """Internal: the turn woke from a wait a reload let it keep; its runner is to be
    built again under the policy in force (from its state in memory, without a write)."""


class Redirected(Exception):
    """Internal: a steer with redirect cut the model call; the step starts over."""


def _salvaged_partial(checkpoint: dict[str, Any]) -> list[str]:
    """The partial-work lines of a checkpoint that cannot be restored, when they can be
    read on their own (none otherwise): what the turn's result still reports."""
    try:
        if "trail" in checkpoint:
            return [str(x) for x in read_trail(checkpoint["trail"])[0][0]]
        return [str(x) for x in checkpoint.get("partial") or ()]
    except (KeyError, TypeError, ValueError, AttributeError):
        return []


class TurnContext:
    def __init__(self, record: TurnRecord, control: TurnControl, *, runtime: Runtime,
                 shared: Shared, store: Store, bus: EventBus, clock: Clock,
                 checkpoint: dict[str, Any], history: list[dict[str, Any]],
                 rand: Callable[[float, float], float] = random.uniform) -> None:
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
        guards = runtime.config.guards(self._profile_in_force())
        self.modes = guards.modes
        self.mode_gate = ModeGate(guards.modes)
        self.restarts = RestartCounter(self.settings.max_restarts,
                                       count=record.counters.restarts)
        if record.started_at is None:  # its first start: the wall clock begins
            record.started_at = clock.time()
        limits = BudgetLimits.from_config(guards.budget, overrides=record.budget,
                                          deadline=record.deadline,
                                          started_at=record.started_at)
        self.limits = limits
        record.limits = limits.snapshot()
        # A budget in warn/observe mode only enforces the backstop and the clock limits; its
        # real limits are watched by a second guard that records what would have stopped.
        enforced = limits if self.modes["budget"] == "enforce" else limits.backstop_only()
        chain_settings = self._chain_in_force()
        # A checkpoint this code cannot read (damaged, or written by an incompatible
        # version) ends the turn `internal` with what is known, never leaves it hanging.
        self.restore_error: str | None = None
        self.resumed = False
        if checkpoint.get("conversation"):
            try:
                self._restore(checkpoint, guards, enforced, chain_settings, rand)
                self.resumed = True
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                self.restore_error = f"checkpoint unreadable: {type(exc).__name__}: {exc}"
                checkpoint = {"partial": _salvaged_partial(checkpoint)}
        if not self.resumed:
            self._start(history, guards, enforced, chain_settings, rand,
                        salvaged=list(checkpoint.get("partial") or ())
                        if self.restore_error is not None else [])
        # The decisions on this step's calls held for approval (call id -> decision),
        # kept until the step's tools ran: a crash before then runs them again as decided.
        self.decided: dict[str, dict[str, Any]] = (
            dict(checkpoint.get("approvals") or {}) if self.resumed else {})
        # Extensions earned by progress, and the agent's plan (applied by the runner).
        self.extension = Extension.from_config(guards.budget.extension).restore_state(
            checkpoint.get("extension") if self.resumed else None)
        self._active_since: float | None = None
        # Set when the turn answers: what its result's write stores with it (the
        # checkpoint, its message rows and its trail rows).
        self.result_checkpoint: SavedCheckpoint | None = None
        # The last event number when the checkpoint this turn resumed from was taken, and
        # (while `replaying`) what the turn logged after it: see `replaying`.
        self._events_after: int | None = (checkpoint.get("event_seq") if self.resumed
                                          else None)
        self._logged: list[tuple[str, Any]] = []
        # The agent a reload removed from under the turn (reported when it starts).
        self.agent_removed: TurnAgentRemoved | None = None
        self.agent = self._agent()
        # The schema the final answer must match (None: free text), from one place.
        self.output_schema = self.settings.output_schema_for(record.output_schema, self.agent)

    def _profile_in_force(self) -> str | None:
        """The turn's budget profile; None when a reload removed it (the turn goes on
        under the plain sections, and says so)."""
        record = self.record
        if record.profile is not None and record.profile not in self.runtime.config.budget.profiles:
            self.log.warning("turn.profile_gone", profile=record.profile)
            record.profile = None
        return record.profile

    def _chain_in_force(self) -> ChainSettings:
        """The turn's provider chain; the default one when a reload removed the model it
        was submitted with (and it says so)."""
        record = self.record
        chain_settings = self.settings.chain_for(record.model)
        if chain_settings is None:
            self.log.warning("turn.model_gone", model=record.model)
            record.model = None
            chain_settings = self.settings.chain
        return chain_settings

    def _restore(self, checkpoint: dict[str, Any], guards: GuardConfig,
                 enforced: BudgetLimits, chain_settings: ChainSettings,
                 rand: Callable[[float, float], float]) -> None:
        """The turn as its checkpoint left it; raises when it cannot be read."""
        limits = self.limits
        self.conv = Conversation.from_json(checkpoint["conversation"])
        self.guard = BudgetGuard.restore(checkpoint["budget"], limits=enforced)
        self.watch = None if enforced is limits else BudgetGuard.restore(
            checkpoint.get("budget_watch") or {"warned": []}, limits=limits)
        # A checkpoint from before the trail existed holds the partial work, the loop
        # guard's counts and the ledger's actions itself: its first save writes them as
        # the trail's tail.
        (partial, loop_lines, effect_lines), rows, spilled = (
            read_trail(checkpoint["trail"]) if "trail" in checkpoint
            else ((list(checkpoint.get("partial", ())), [], []), 0, (0, 0, 0)))
        self.loops = loop_detector(guards.loop_detection, checkpoint["loops"], loop_lines)
        self.failures = failure_loop(guards.failure_loop, checkpoint["failures"])
        self.chain = chain_settings.restore_chain(checkpoint.get("chain"), rand)
        self.partial = [str(x) for x in partial]
        self.open_issues = list(checkpoint.get("open_issues", ()))
        self.waiting_since = checkpoint.get("waiting_since")
        self.recover_until = checkpoint.get("recover_until")
        pending = checkpoint.get("pending_stop")
        # A guard's stop decided after a step's tools (loop detection) and not yet
        # applied: checkpointed, or a crash would let the turn run one step too many.
        self.pending_stop = Stop.from_json(pending) if pending else None
        # A checkpoint from before the ledger existed starts an empty one.
        effects = checkpoint.get("effects")
        self.effects = (EffectLedger.restore(effects, effect_lines) if effects
                        else EffectLedger(self.record.id))
        self.trail = Trail((self.partial, self.loops.lines, self.effects.lines),
                           rows=rows, spilled=spilled)

    def _start(self, history: list[dict[str, Any]], guards: GuardConfig,
               enforced: BudgetLimits, chain_settings: ChainSettings,
               rand: Callable[[float, float], float], *, salvaged: list[str]) -> None:
        """The turn from its first step (`salvaged`: what an unreadable checkpoint's
        partial work could still tell)."""
        limits = self.limits
        self.conv = Conversation.start(history, self.record.message)
        self.guard = BudgetGuard(enforced)
        self.watch = None if enforced is limits else BudgetGuard(limits)
        self.loops = loop_detector(guards.loop_detection)
        self.failures = failure_loop(guards.failure_loop)
        self.chain = chain_settings.new_chain(rand)
        self.partial = salvaged
        self.open_issues = []
        self.waiting_since = None
        self.recover_until = None
        self.pending_stop = None
        self.effects = EffectLedger(self.record.id)
        self.trail = Trail((self.partial, self.loops.lines, self.effects.lines))

    def _agent(self) -> AgentDefinition:
        """The agent the turn runs as, as this policy defines it: kept for as long as
        the turn runs under this policy (a reload's new definition applies when the
        turn resumes under the next one, at a step boundary, as the policy does). An
        agent the policy no longer defines (a reload removed it) leaves the turn to the
        default agent, and the turn says so (`agent_removed`, its event)."""
        record = self.record
        agent = self.settings.agent(record.agent)
        if agent is not None:
            return agent
        self.log.warning("turn.agent_removed", agent=record.agent)
        self.agent_removed = TurnAgentRemoved(agent=str(record.agent),
                                              policy_version=record.policy_version)
        record.agent = None
        return self.settings.default_agent

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
        r = self.record
        return log.bind(turn=r.id, session=r.session, policy_version=r.policy_version)

    # -- time -----------------------------------------------------------------------

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
        return BudgetUsage(u.total_tokens, seconds,
                           self.record.counters.steps, u.cost_usd)

    def remaining_s(self) -> float:
        """The time the turn has left, the least of its active time, its wall-clock
        budget and its deadline: what every wait, request, stream and tool call is
        bounded by."""
        return self.guard.remaining_seconds(self.usage(), now=self.clock.time())

    def time_spent(self) -> Stop | None:
        """The budget's stop when the active time, the wall clock or the deadline has
        run out."""
        return self.guard.check_time(self.usage(), now=self.clock.time())

    # -- events, counters, checkpoints -------------------------------------------------

    def emit(self, event: EventBody | str, **data: Any) -> None:
        """Publish one of this turn's events: a catalogue event, or (for the rooms not
        yet moved to the catalogue) a wire type with its fields. While `replaying`, an
        event the turn already logged is not published again."""
        if self._logged and self._was_logged(event, data):
            return
        self.bus.publish(event, turn=self.record.id, **data)

    @contextlib.asynccontextmanager
    async def replaying(self) -> AsyncIterator[None]:
        """Around work a resumed turn does again that it had done before a stop or a
        crash cut it: a step's tools, run again from the journal (a stored outcome is
        reused, not sent again). What the turn logged after its checkpoint (events it
        published and the store kept) is read first, and each event the work publishes
        again the same, field for field, is left out: a follower reads every tool call
        and result once, even across a restart."""
        if self._events_after is not None:
            logged = await self.store.events(turn=self.record.id,
                                             after_seq=self._events_after)
            self._logged = [(e["type"], {k: v for k, v in e.items() if k not in _ENVELOPE})
                            for e in logged]
        try:
            yield
        finally:
            self._logged = []

    def _was_logged(self, event: EventBody | str, data: dict[str, Any]) -> bool:
        """Whether `event` is one logged since the checkpoint (taken off the list)."""
        kind, fields = ((event.TYPE, event.to_json()) if isinstance(event, EventBody)
                        else (event, data))
        fields = jsonwire.loads(jsonwire.dumps(fields))  # as the store gives them back
        for i, (logged_kind, logged_fields) in enumerate(self._logged):
            if logged_kind == kind and logged_fields == fields:
                del self._logged[i]
                return True
        return False

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
        return {"conversation": self.conv.to_json(), "trail": self.trail.to_json(),
                **self._checkpoint_rest()}

    def _stored_checkpoint(self, trail: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint as the store keeps it: the conversation's counts, not its
        messages, and the trail's part (`Trail.save`) (their rows go on their own)."""
        return {"conversation": self.conv.stored_json(), "trail": trail,
                **self._checkpoint_rest()}

    def checkpoint_with_result(self) -> None:
        """The checkpoint of a turn that has just answered, kept for the write of its
        result (`result_checkpoint`) instead of written on its own: the answer, the
        checkpoint and the result then commit in one transaction, and a crash keeps all
        three or none (the step is asked again)."""
        self.sync_counters()
        trail, lines = self.trail.save()
        self.result_checkpoint = (self._stored_checkpoint(trail), self.conv.unsaved_rows(),
                                  lines)

    def _checkpoint_rest(self) -> dict[str, Any]:
        return {
            "budget": self.guard.snapshot(),
            "budget_watch": self.watch.snapshot() if self.watch is not None else None,
            "loops": self.loops.snapshot(),
            "failures": self.failures.snapshot(),
            "chain": self.chain.snapshot(),
            "open_issues": list(self.open_issues),
            "waiting_since": self.waiting_since,
            "recover_until": self.recover_until,
            "pending_stop": self.pending_stop.to_json() if self.pending_stop else None,
            "effects": self.effects.snapshot(),
            "approvals": dict(self.decided),
            "extension": self.extension.snapshot(),
            "event_seq": self.bus.last_seq,
        }

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
        if self._active_since is not None:  # fold the running active time into the record
            self.stop_active()
            self.start_active()
        self.record.updated_at = self.clock.time()
        # The messages go as rows, only those not stored yet, and the checkpoint counts
        # them; the trail's lines ride in its tail until they make a row.
        rows, (trail, lines) = self.conv.unsaved_rows(), self.trail.save()
        record = self.record.to_json()
        checkpoint = self._stored_checkpoint(trail)
        if queue is None or not queue(record, checkpoint, messages=rows, trail=lines):
            if new is not None:
                record["state"] = new
            await self.store.save_turn(record, checkpoint, messages=rows, trail=lines)
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

    async def suspend(self, *, parked: bool = False) -> None:
        """Stop here; the supervisor requeues the turn. A parked turn (waiting, recovering)
        was checkpointed when it parked and has not moved since: that checkpoint is what a
        resume needs, so only its state changes, in memory (after a crash the stored row
        resumes it the same way). A thousand parked turns then cost a reload no writes."""
        self.stop_active()
        if parked:
            self.move(TurnState.SUSPENDED)
        else:
            await self.checkpoint(TurnState.SUSPENDED)
        self.emit(TurnSuspended(step=self.record.counters.steps))
        raise Suspended

    async def park(self, state: TurnState, *, until: float,
                   done: Callable[[], bool]) -> None:
        """Wait, not as active time and without a slot, until the wall-clock time `until`
        (never past the deadline or the wall-clock budget, which count every wait), until
        `done()` holds, or until
        a suspend. The turn is checkpointed in `state` first, so a crash resumes it in the
        same wait. A suspend raises `Suspended`; otherwise the turn is running again on
        return, whichever way the wait ended."""
        now = self.clock.time()
        wait_s = min(max(0.0, until - now), self.guard.clock_left(now))
        self.stop_active()
        await self.checkpoint(state)
        self.control.park()
        try:
            with self.clock.move_on_after(wait_s):
                while not (done() or self.control.suspend_requested):
                    await self.control.wake.wait()
        except BaseException:  # cancelled: no slot to take back
            self.control.parked = False
            raise
        if not await self.control.unpark():
            await self.suspend(parked=True)
        if self.control.policy_changed:
            raise PolicyChanged
        self.move(TurnState.RUNNING)
        self.start_active()

    # -- guards and user messages --------------------------------------------------------

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

    def set_limits(self, guard: BudgetLimits, watch: BudgetLimits | None,
                   shown: Mapping[str, Any] | None = None) -> None:
        """The limits in force (a budget extension grants more): the guard's, the
        watch's, and what the record shows (None: as it is)."""
        self.guard.limits = guard
        if self.watch is not None and watch is not None:
            self.watch.limits = watch
        if shown is not None:
            self.record.limits = dict(shown)

    def user_message_arrived(self) -> None:
        """A steer or an answer: the person changed the situation, so the rebuilds
        before it say nothing about what comes next."""
        self.restarts.reset()
        self.record.counters.restarts = 0
