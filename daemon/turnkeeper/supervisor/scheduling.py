"""Scheduling room: applies the session scheduler's decisions, runs each turn's task and
writes its end.

Which turn runs next, how many at once and when a parked turn gets its slot back are
decided in `policy/scheduler.py`; here those decisions become tasks, wake-ups and the
final store write. A turn parked in `waiting` or `recovering` gives its slot back (it
keeps its session) and takes one again when it wakes, before queued turns.

A reload's drain holds parked turns where they are (`hold`): each is `suspended` until
the swap, without waking its task or writing anything, and an answer or a timer that
wakes it meanwhile waits for the swap. The swap (`let_go`) puts each back in its wait
under the new policy; the one that wakes then has its runner built again, under that
policy, from its state in memory.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import anyio
import structlog

from turnkeeper import event_types as ev
from turnkeeper import logging as tk_logging
from turnkeeper.events import Event
from turnkeeper.policy.daemon_state import DaemonState
from turnkeeper.policy.history import bound_history
from turnkeeper.policy.outcome import StopCode, TurnResult, goes_to_dead_letters
from turnkeeper.policy.turn_state import TurnState, moved
from turnkeeper.store.base import SavedCheckpoint
from turnkeeper.store.fleet import StaleLease
from turnkeeper.supervisor.core import LiveTurn, SupervisorCore, log_context
from turnkeeper.supervisor.fleet import Fleet
from turnkeeper.turn.runner import TurnControl, TurnRunner

log = structlog.get_logger("turnkeeper.supervisor")

# Turn tasks started per turn of the event loop (`Scheduling._start`).
START_CHUNK = 100


# The events that announce a wait, said again when a reload lets the turn wait on; an
# approval's wait is not announced again (its calls were, once).
_ANNOUNCEMENTS = frozenset({ev.TurnWaiting.TYPE, ev.TurnRecovering.TYPE,
                            ev.ToolApprovalRequested.TYPE})


class Scheduling:
    def __init__(self, core: SupervisorCore, *, fleet: Fleet | None) -> None:
        self.core = core
        self.fleet = fleet  # on a shared store: claims, leases
        # While a reload drains: parked turns are held in their wait (`hold`) rather than
        # suspended. Off when the new policy bounds the waits differently, and for a stop.
        self.holding = False
        self._woke_held: set[str] = set()  # held turns woken, waiting for the swap
        self._wanting: set[str] = set()  # woken parked turns waiting for a slot
        core.bus.listen(self._announced, types=_ANNOUNCEMENTS)

    def dispatch(self) -> None:
        """Apply the scheduler's decision: wake the parked turns it gave a slot back to,
        start a task for each turn it took from the queue."""
        core = self.core
        if core.tg is None:
            return
        plan = core.scheduler.dispatch(intake_open=core.intake_open)
        for turn_id in plan.woken:
            woken = core.live.get(turn_id)
            if woken is not None:
                woken.control.wake_up()
        starts = []
        for turn_id in plan.started:
            live = core.live.get(turn_id)
            if live is None:  # stale entry: nothing to run
                core.scheduler.finished(turn_id)
                continue
            live.running = True
            starts.append(live)
        self._start(starts, 0)

    def _start(self, starts: list[LiveTurn], at: int) -> None:
        """Start the tasks of `starts[at:]`, START_CHUNK of them a turn of the event loop:
        a queue of thousands let go at once (intake resumed, turns requeued after a
        reload, the resume at start-up) was one callback of 69-109 ms for 3,000, in
        which no request or timer could run. The turns count as running from the
        decision on (`live.running`): nothing starts them twice meanwhile."""
        core = self.core
        tg = core.tg
        if tg is None:  # stopped meanwhile: nothing is started any more
            return
        end = at + START_CHUNK
        for live in starts[at:end]:
            tg.start_soon(self.run_turn, live, name=f"turn {live.record.id}")
        if end < len(starts):
            asyncio.get_running_loop().call_soon(self._start, starts, end)

    def set_paused(self, paused: bool) -> bool:
        """Hold (or let go) the start of queued turns; True when that changed. Submits are
        still queued and running or parked turns go on: an operator pauses to take the
        load off a provider or a tool, not to lose work. Kept in memory only: a restart
        starts open."""
        core = self.core
        if core.scheduler.paused == paused:
            return False
        core.scheduler.paused = paused
        log.info("intake.paused" if paused else "intake.resumed", queued=len(core.queue))
        if not paused:
            self.dispatch()
        return True

    def release_slot(self, live: LiveTurn) -> None:
        """A turn parks: its slot goes to the next turn (its session stays taken). A turn
        that parks while a reload or a stop drains is held or suspended at once, as parked
        turns are when the drain begins."""
        core = self.core
        if core.state.draining:
            if self.holding and core.state is DaemonState.RELOADING:
                self.hold(live)
            else:
                live.control.suspend()
        if core.scheduler.release_slot(live.record.id):
            self.dispatch()

    async def acquire_slot(self, live: LiveTurn) -> None:
        """A parked turn wakes: wait for a slot, or until it is asked to suspend. One a
        reload's drain holds waits for the swap first: it goes on under the new policy."""
        core = self.core
        turn_id = live.record.id
        if core.scheduler.holds_slot(turn_id):
            return
        if turn_id in core.held:
            self._woke_held.add(turn_id)
            try:
                while turn_id in core.held and not live.control.suspend_requested:
                    await live.control.wake.wait()
            finally:
                self._woke_held.discard(turn_id)
            if live.control.suspend_requested:
                return
        core.scheduler.want_slot(turn_id)
        self._wanting.add(turn_id)
        self.dispatch()
        try:
            while not core.scheduler.holds_slot(turn_id) \
                    and not live.control.suspend_requested:
                await live.control.wake.wait()
        finally:
            core.scheduler.stop_wanting(turn_id)
            self._wanting.discard(turn_id)

    async def run_turn(self, live: LiveTurn) -> None:
        core = self.core
        record = live.record
        tk_logging.bind_turn_context(lambda: log_context(record))
        try:
            runner = await self._runner(live)
            result = await runner.run()
            while result is None and live.control.policy_changed \
                    and not live.control.suspend_requested:
                runner = await self._runner_again(live, runner)
                result = await runner.run()
            if self.fleet is not None and self.fleet.is_lost(record.id):
                core.live.pop(record.id, None)  # another node runs it now
                return
            if result is None:
                live.checkpoint = runner.checkpoint_data()
                live.control = TurnControl()
                log.info("turn.suspended", turn=record.id, session=record.session,
                         policy_version=record.policy_version, **record.counters.to_json())
                if not core.stopping:
                    core.suspended_turns.append(record.id)
                return
            await self.finish(live, result, checkpoint=runner.ctx.result_checkpoint)
        except StaleLease as exc:  # another node holds it now: nothing more is ours
            core.live.pop(record.id, None)
            fleet = self.fleet
            if fleet is not None and record.id in fleet.store.claims:
                # Nor its claim: renewals stop holding it. A turn given up already
                # (a renewal found it taken) is not counted or logged lost twice.
                fleet.abandon([record.id], reason="write refused")
            log.warning("turn.lease_lost", turn=record.id, error=str(exc))
        except Exception as exc:  # the store failed under us: the turn stays resumable
            log.error("turn.supervisor_error", turn=record.id,
                      error=f"{type(exc).__name__}: {exc}")
            if self.fleet is not None:  # let its lease run out: a node claims it again
                self.fleet.store.abandon([record.id])
                core.live.pop(record.id, None)
        finally:
            self._ran(live)

    async def _runner(self, live: LiveTurn) -> TurnRunner:
        """The turn's runner under the policy in force, with its session's history and
        the callbacks it gives its slot back and takes one again with."""
        core = self.core
        record = live.record
        history: list[dict[str, Any]] = []
        # A turn submitted without a session is its own session (named after it): it
        # has no history to read, and the read cost ~18% of a 5-step turn's CPU.
        if not live.checkpoint.get("conversation") and record.session != record.id:
            history = await core.store.session_history(record.session,
                                                       before_seq=record.seq)
            # A replay repeats its dead letter's message: that turn is not history.
            history = bound_history(
                [h for h in history if h["id"] != record.replay_of],
                max_tokens=core.config.sessions.max_history_tokens)
        if record.state in (TurnState.QUEUED, TurnState.SUSPENDED):
            record.policy_version = core.policy.version
        control = live.control
        control.release_slot = lambda: self.release_slot(live)
        control.acquire_slot = lambda: self.acquire_slot(live)
        fleet = self.fleet
        if fleet is not None:
            control.confirm_lease = lambda: fleet.confirm_lease(record.id)
        return TurnRunner(record, live.control, runtime=core.runtime, shared=core.shared,
                          store=core.store, bus=core.bus, clock=core.clock,
                          checkpoint=live.checkpoint, history=history)

    async def _runner_again(self, live: LiveTurn, runner: TurnRunner) -> TurnRunner:
        """A turn awake after a reload let it wait on goes on, in the same task, under the
        policy in force: a runner built from the state the last one left in memory.
        Decisions on held calls its wait took in are made durable first, as before any
        call of the step is sent."""
        live.control.policy_changed = False
        if runner.ctx.decided:
            await runner.ctx.checkpoint()
        live.checkpoint = runner.checkpoint_data()
        live.record.policy_version = self.core.policy.version
        return await self._runner(live)

    def _ran(self, live: LiveTurn) -> None:
        """The turn's task ends (finished, suspended, lost or failed): its slot is free."""
        core = self.core
        # The callbacks refer to `live`, which holds them: dropped, a finished turn is
        # freed at once instead of left to the cyclic collector, whose pauses grow with
        # the garbage (about 20 objects a turn).
        control = live.control
        control.release_slot = control.acquire_slot = control.confirm_lease = None
        live.running = False
        core.held.pop(live.record.id, None)
        core.scheduler.finished(live.record.id)
        self._settled()
        self.dispatch()
        if self.fleet is not None:  # a slot is free: claim the next turn
            self.fleet.wake()

    def _settled(self) -> None:
        """Every task has ended but for the turns a reload holds parked: what a drain
        waits for (`core.idle` is set, and replaced)."""
        core = self.core
        if core.running == len(core.held):
            core.idle.set()
            core.idle = anyio.Event()

    def _announced(self, event: Event) -> None:
        """Remember what announced a live turn's wait (an approval's: nothing to say
        again), for a reload that lets it wait on. A bus listener."""
        if event.type in _ANNOUNCEMENTS and event.turn is not None:
            live = self.core.live.get(event.turn)
            if live is not None:
                live.announced = (event.body if event.type != ev.ToolApprovalRequested.TYPE
                                  else None)

    def hold(self, live: LiveTurn) -> None:
        """A reload's drain holds a parked turn in its wait: `suspended` until the swap,
        as a suspended turn would be, but its task, its wait and its checkpoint (from
        when it parked: nothing has moved since) stay as they are."""
        core = self.core
        record = live.record
        parked_in = TurnState(record.state)
        if not parked_in.parked or record.id in core.held:
            return
        if record.id in self._wanting:  # awake already, about to run: it suspends
            live.control.suspend()
            return
        core.held[record.id] = parked_in
        record.set_state(moved(parked_in, TurnState.SUSPENDED))
        core.bus.publish(ev.TurnSuspended(step=record.counters.steps), turn=record.id)
        self._settled()

    def let_go(self) -> int:
        """The swap: every held turn waits on under the new policy, as if resumed from
        its checkpoint (`turn.resumed` with the new version, its wait announced again);
        whichever wakes builds its runner again under that policy. How many."""
        core = self.core
        held, core.held = core.held, {}
        version, now = core.policy.version, core.clock.time()
        kept = 0
        for turn_id, parked_in in held.items():
            live = core.live.get(turn_id)
            if live is None or not live.running:
                continue
            kept += 1
            record = live.record
            record.policy_version = version
            record.set_state(moved(record.state, parked_in))
            live.control.policy_changed = live.control.resume_announced = True
            core.bus.publish(ev.TurnResumed(state=TurnState.SUSPENDED,
                                            step=record.counters.steps,
                                            policy_version=version), turn=turn_id)
            again = _announced_again(live, parked_in, now)
            if again is not None:
                core.bus.publish(again, turn=turn_id)
            if turn_id in self._woke_held:
                live.control.wake_up()
        return kept

    async def finish(self, live: LiveTurn, result: TurnResult, *,
                     checkpoint: SavedCheckpoint | None = None) -> None:
        """Save the turn's result, with `checkpoint` (and its message and trail rows)
        when the runner left one for it, then tell everyone it finished."""
        core = self.core
        record = live.record
        before = (record.state, record.next_attempt_at, record.question, record.updated_at)
        record.set_state(moved(record.state, result.status.value))
        record.result = result_json = result.to_json()
        record.next_attempt_at = None
        record.question = None
        record.updated_at = core.clock.time()
        # The result and its `turn.finished` event commit together: after any crash a
        # turn has both or neither (and then resumes), never one finish too many.
        finished = core.bus.prepare(ev.TurnFinished(result=result_json), turn=record.id)
        stored, rows, lines = checkpoint if checkpoint is not None else (None, None, None)
        try:
            with anyio.CancelScope(shield=True):
                await core.store.save_turn(record.to_json(), stored, messages=rows,
                                           trail=lines, events=[finished])
        except BaseException:
            # Not kept, not shown: the turn reads as the store holds it, without a result.
            record.result = None
            record.set_state(before[0])
            _, record.next_attempt_at, record.question, record.updated_at = before
            core.bus.withdraw(finished)
            raise
        stop = result.stopped_because
        core.bus.deliver(finished)
        log.info("turn.finished", turn=record.id, session=record.session,
                 policy_version=record.policy_version, provider=record.provider,
                 status=record.state, code=stop.code.value, counter=stop.counter,
                 value=stop.value, limit=stop.limit, message=stop.message,
                 **record.counters.to_json(),
                 tokens=record.usage.total_tokens, seconds=record.usage.seconds,
                 cost_usd=record.usage.cost_usd)
        # An internal error was logged with its traceback where it happened.
        if goes_to_dead_letters(stop) and stop.code is not StopCode.INTERNAL:
            log.warning("turn.dead_letter", turn=record.id, code=stop.code.value,
                        last_error=record.last_error)
        for hook in core.on_turn_finished:
            hook(record, result)
        core.live.pop(record.id, None)
        live.done.set()


def _announced_again(live: LiveTurn, parked_in: TurnState, now: float) -> ev.EventBody | None:
    """The event that announced the turn's wait, as its resumed runner would say it again:
    a question as it was asked, a recovery wait with the time left of it. None when the
    last announcement is not of this wait (an approval's), or when the answer to a question
    came while the turn was held (that wait is over)."""
    said, record = live.announced, live.record
    if (parked_in is TurnState.WAITING and isinstance(said, ev.TurnWaiting)
            and said.question == record.question
            and not any(m["kind"] == "answer" for m in record.inbox)):
        return said
    if (parked_in is TurnState.RECOVERING and isinstance(said, ev.TurnRecovering)
            and said.next_attempt_at == record.next_attempt_at
            and said.next_attempt_at is not None):
        return replace(said, wait=round(max(0.0, said.next_attempt_at - now), 3))
    return None
