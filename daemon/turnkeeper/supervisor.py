"""The supervisor: one task group owns every turn. Intake, the FIFO queue, the in-flight
registry, drain, reload and stop all live here, and nowhere else.

Turns of one session run one at a time in submission order; turns of different sessions
run concurrently, at most `max_concurrent_turns` at once. A turn parked in `waiting` or
`recovering` gives its slot back (it keeps its session) and takes one again when it wakes,
before queued turns: parked turns, however many, never block new work.

A reload validates first and changes nothing when the file is bad; then drains:
parked turns are suspended at once, running ones finish under their policy or are
suspended at their next step boundary after `drain_timeout`; then the policy is swapped in
one step and the suspended turns go first in the queue. A stop that comes during a reload
takes over its drain and the new policy is dropped.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup

from turnkeeper import __version__
from turnkeeper import logging as tk_logging
from turnkeeper.clock import Clock
from turnkeeper.config import Config, ConfigError, Policy, keep_restart_keys, load_config
from turnkeeper.errors import TurnkeeperError
from turnkeeper.events import EventBus
from turnkeeper.lifecycle.systemd import Notifier, extend_timeout_loop
from turnkeeper.policy import limits
from turnkeeper.policy.outcome import Stop, StopCode, TurnResult, goes_to_dead_letters
from turnkeeper.policy.scheduler import SessionScheduler
from turnkeeper.policy.turn_state import LIVE_STATES, TurnState
from turnkeeper.runtime import Runtime, Shared
from turnkeeper.store.base import Store
from turnkeeper.turn.record import TurnRecord
from turnkeeper.turn.runner import TurnControl, TurnRunner

log = structlog.get_logger("turnkeeper.supervisor")

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class IntakeRefused(TurnkeeperError):
    """Submit refused: the queue is full or the daemon is stopping."""

    def __init__(self, reason: str, retry_after_s: int) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class UnknownProfile(TurnkeeperError, ValueError):
    """A submit named a budget profile the policy does not define."""


class UnknownTurn(TurnkeeperError):
    pass


class TurnFinished(TurnkeeperError):
    """A message to a turn that has ended."""


class NotWaiting(TurnkeeperError):
    """An answer to a turn that asked no question: kept, it would answer a later one."""


@dataclass(slots=True)
class LiveTurn:
    record: TurnRecord
    control: TurnControl = field(default_factory=TurnControl)
    checkpoint: dict[str, Any] = field(default_factory=dict)
    done: anyio.Event = field(default_factory=anyio.Event)
    running: bool = False  # it has a task (running, or parked: recovering / waiting)


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    ok: bool
    policy_version: int
    pending_restart: tuple[str, ...] = ()
    error: str | None = None
    duration_s: float = 0.0
    stopping: bool = False  # refused because the daemon is stopping, not for the config

    def to_json(self) -> dict[str, Any]:
        if not self.ok:
            return {"error": self.error, "policy_version": self.policy_version}
        return {"policy_version": self.policy_version,
                "pending_restart": list(self.pending_restart),
                "duration_s": round(self.duration_s, 6)}


def new_turn_id() -> str:
    return "t_" + secrets.token_hex(8)


class Supervisor:
    def __init__(self, *, policy: Policy, store: Store, clock: Clock, notifier: Notifier,
                 config_path: str | None) -> None:
        self.policy = policy
        self.runtime = Runtime.build(policy)
        self.shared = Shared()
        self.shared.apply(policy.config)
        self.store = store
        self.clock = clock
        self.notifier = notifier
        self.config_path = config_path
        self.bus = EventBus(clock=clock, persist=store.append_event,
                            reserve=store.reserve_event_seqs)
        self.state = "starting"
        self.started_at = clock.monotonic()
        self.live: dict[str, LiveTurn] = {}
        self.scheduler = SessionScheduler(
            max_concurrent=policy.config.daemon.max_concurrent_turns,
            max_queued=policy.config.daemon.max_queued_turns)
        self.intake_open = False
        self.pending_restart: tuple[str, ...] = ()
        self.last_reload_error: str | None = None
        self.reload_count = 0
        self.reload_failures = 0
        self._reload_lock = anyio.Lock()
        self._reload_requests = 0
        self._reload_done_upto = 0
        self._last_reload: ReloadOutcome | None = None
        self._tg: TaskGroup | None = None
        self._idle = anyio.Event()
        self._started = anyio.Event()
        self._stopping = anyio.Event()
        self._stop_requested = anyio.Event()
        self.on_turn_finished: list[Callable[[TurnRecord, TurnResult], None]] = []
        self._suspended: list[str] = []

    def __repr__(self) -> str:
        return (f"Supervisor(state={self.state!r}, policy_version={self.policy.version}, "
                f"running={self.running}, queued={len(self.queue)})")

    @property
    def config(self) -> Config:
        return self.policy.config

    @property
    def queue(self) -> deque[str]:
        """Queued turn ids, next first (the scheduler's)."""
        return self.scheduler.queue

    @property
    def running(self) -> int:
        """Turns with a task, parked ones included (what a drain waits for)."""
        return self.scheduler.running

    @property
    def active(self) -> int:
        """Turns holding one of the concurrency slots."""
        return self.scheduler.active

    # -- start ------------------------------------------------------------------------

    async def start(self, tg: TaskGroup) -> None:
        """Resume every unfinished turn from its checkpoint, then open intake."""
        self._tg = tg
        await self.runtime.toolbox.start(tg)  # MCP servers: connected (or failed) once
        self.bus.start_at(await self.store.max_event_seq())
        resumed = 0
        for record_json, checkpoint in await self.store.unfinished_turns():
            record = TurnRecord.from_json(record_json)
            if record.state != TurnState.QUEUED:
                record.policy_version = self.policy.version
            live = LiveTurn(record=record, checkpoint=checkpoint)
            self.live[record.id] = live
            self.scheduler.enqueue(record.id, record.session)
            resumed += 1
        if resumed:
            log.info("daemon.resuming", turns=resumed)
        self.state = "ready"
        self.intake_open = True
        self._started.set()
        self._dispatch()

    async def wait_started(self) -> None:
        """Until `start` has resumed the unfinished turns: what a request that arrives
        earlier (systemd's socket accepts them before we run) waits for."""
        await self._started.wait()

    def status_line(self) -> str:
        """systemd's STATUS=: state, counts, policy version, and a failed reload's error."""
        parked = self.running - self.active
        return (f"{self.state}; {self.active} running, "
                + (f"{parked} parked, " if parked else "")
                + f"{len(self.queue)} queued; policy v{self.policy.version}"
                + (f"; last reload failed: {self.last_reload_error}"
                   if self.last_reload_error else ""))

    # -- intake -----------------------------------------------------------------------

    async def submit(self, *, message: str, session: str | None, budget: dict[str, Any],
                     deadline: float | None, replay_of: str | None = None,
                     profile: str | None = None) -> TurnRecord:
        if profile is not None and profile not in self.config.budget.profiles:
            known = ", ".join(sorted(self.config.budget.profiles)) or "none are configured"
            raise UnknownProfile(f"profile: no budget profile {profile!r} (known: {known})")
        if self.state in ("starting", "stopping"):
            raise IntakeRefused(f"the daemon is {self.state}", retry_after_s=5)
        refusal = self.scheduler.refusal()
        if refusal is not None:
            raise IntakeRefused(refusal.reason, retry_after_s=refusal.retry_after_s)
        now = self.clock.time()
        turn_id = new_turn_id()
        record = TurnRecord(id=turn_id, session=session or turn_id, message=message,
                            created_at=now, updated_at=now, state=TurnState.QUEUED,
                            policy_version=self.policy.version, budget=budget,
                            deadline=deadline, replay_of=replay_of, profile=profile,
                            provider=self.config.providers[0].name)
        live = LiveTurn(record=record)
        # Registered before the write so a concurrent GET sees it; queued and answered
        # once it is on disk with its `turn.queued` event (a turn started earlier would
        # not know its seq, which orders its session's history).
        self.live[turn_id] = live
        queued = self.bus.prepare("turn.queued", turn=turn_id, session=record.session,
                                  message=message[:2000],
                                  policy_version=record.policy_version)
        try:
            record.seq = await self.store.insert_turn(record.to_json(), {}, events=[queued])
        except BaseException:
            self.live.pop(turn_id, None)
            raise
        if turn_id in self.live:  # not cancelled while the write ran
            self.scheduler.enqueue(turn_id, record.session)
        self.bus.deliver(queued)
        log.info("turn.queued", **_log_context(record), queued=len(self.queue))
        self._dispatch()
        return record

    def _dispatch(self) -> None:
        """Apply the scheduler's decision: wake the parked turns it gave a slot back to,
        start a task for each turn it took from the queue."""
        if self._tg is None:
            return
        plan = self.scheduler.dispatch(intake_open=self.intake_open)
        for turn_id in plan.woken:
            woken = self.live.get(turn_id)
            if woken is not None:
                woken.control.wake_up()
        for turn_id in plan.started:
            live = self.live.get(turn_id)
            if live is None:  # stale entry: nothing to run
                self.scheduler.finished(turn_id)
                continue
            live.running = True
            self._tg.start_soon(self._run_turn, live, name=f"turn {turn_id}")

    def _release_slot(self, live: LiveTurn) -> None:
        """A turn parks: its slot goes to the next turn (its session stays taken). A turn
        that parks while a reload or a stop drains is suspended at once, as parked turns
        are when the drain begins."""
        if self.state in ("reloading", "stopping"):
            live.control.suspend()
        if self.scheduler.release_slot(live.record.id):
            self._dispatch()

    async def _acquire_slot(self, live: LiveTurn) -> None:
        """A parked turn wakes: wait for a slot, or until it is asked to suspend."""
        turn_id = live.record.id
        if self.scheduler.holds_slot(turn_id):
            return
        self.scheduler.want_slot(turn_id)
        self._dispatch()
        try:
            while not self.scheduler.holds_slot(turn_id) \
                    and not live.control.suspend_requested:
                await live.control.wake.wait()
        finally:
            self.scheduler.stop_wanting(turn_id)

    async def _run_turn(self, live: LiveTurn) -> None:
        record = live.record
        tk_logging.bind_turn_context(lambda: _log_context(record))
        try:
            history: list[dict[str, Any]] = []
            # A turn submitted without a session is its own session (named after it): it
            # has no history to read, and the read cost ~18% of a 5-step turn's CPU.
            if not live.checkpoint.get("conversation") and record.session != record.id:
                history = await self.store.session_history(record.session,
                                                           before_seq=record.seq)
                # A replay repeats its dead letter's message: that turn is not history.
                history = [h for h in history if h["id"] != record.replay_of]
            if record.state in (TurnState.QUEUED, TurnState.SUSPENDED):
                record.policy_version = self.policy.version
            control = live.control
            control.release_slot = lambda: self._release_slot(live)
            control.acquire_slot = lambda: self._acquire_slot(live)
            runner = TurnRunner(record, live.control, runtime=self.runtime,
                                shared=self.shared, store=self.store, bus=self.bus,
                                clock=self.clock, checkpoint=live.checkpoint,
                                history=history)
            result = await runner.run()
            if result is None:
                live.checkpoint = runner.checkpoint_data()
                live.control = TurnControl()
                log.info("turn.suspended", turn=record.id, session=record.session,
                         policy_version=record.policy_version, **record.counters)
                if self.state != "stopping":
                    self._suspended.append(record.id)
                return
            await self._finish(live, result)
        except Exception as exc:  # the store failed under us: the turn stays resumable
            log.error("turn.supervisor_error", turn=record.id,
                      error=f"{type(exc).__name__}: {exc}")
        finally:
            live.running = False
            self.scheduler.finished(record.id)
            if self.running == 0:
                self._idle.set()
                self._idle = anyio.Event()
            self._dispatch()

    async def _finish(self, live: LiveTurn, result: TurnResult) -> None:
        record = live.record
        record.state = TurnState(record.state).to(result.status.value)
        record.result = result.to_json()
        record.next_attempt_at = None
        record.question = None
        record.updated_at = self.clock.time()
        # The result and its `turn.finished` event commit together: after any crash a
        # turn has both or neither (and then resumes), never one finish too many.
        finished = self.bus.prepare("turn.finished", turn=record.id, result=record.result)
        with anyio.CancelScope(shield=True):
            await self.store.save_turn(record.to_json(), events=[finished])
        stop = result.stopped_because
        self.bus.deliver(finished)
        log.info("turn.finished", turn=record.id, session=record.session,
                 policy_version=record.policy_version, provider=record.provider,
                 status=record.state, code=stop.code.value, counter=stop.counter,
                 value=stop.value, limit=stop.limit, message=stop.message, **record.counters,
                 tokens=record.usage["total_tokens"], seconds=record.usage["seconds"],
                 cost_usd=record.usage["cost_usd"])
        # An internal error was logged with its traceback where it happened.
        if goes_to_dead_letters(stop) and stop.code is not StopCode.INTERNAL:
            log.warning("turn.dead_letter", turn=record.id, code=stop.code.value,
                        last_error=record.last_error)
        for hook in self.on_turn_finished:
            hook(record, result)
        self.live.pop(record.id, None)
        live.done.set()

    # -- turns ------------------------------------------------------------------------

    async def get_turn(self, turn_id: str) -> dict[str, Any]:
        live = self.live.get(turn_id)
        if live is not None:
            return live.record.to_json()
        data = await self.store.get_turn(turn_id)
        if data is None:
            raise UnknownTurn(turn_id)
        return data

    async def wait_turn(self, turn_id: str, timeout_s: float) -> dict[str, Any]:
        """The turn once it is terminal, or after `timeout_s`, or as the daemon stops (a
        long poll must not hold the shutdown up)."""
        live = self.live.get(turn_id)
        if live is not None:
            with self.clock.move_on_after(timeout_s):
                async with anyio.create_task_group() as tg:
                    async def until(event: anyio.Event) -> None:
                        await event.wait()
                        tg.cancel_scope.cancel()

                    tg.start_soon(until, live.done)
                    tg.start_soon(until, self._stopping)
        return await self.get_turn(turn_id)

    async def list_turns(self, *, state: str | None, session: str | None,
                         limit: int) -> list[dict[str, Any]]:
        """Newest first. Every unfinished turn is in memory (resumed at start), so a
        filter on a live state reads no store; otherwise the store's rows, each replaced by
        the live record while the turn runs (fresher than its last checkpoint)."""
        if state in LIVE_STATES:
            records = sorted((t.record for t in self.live.values()
                              if t.record.state == state
                              and (session is None or t.record.session == session)),
                             key=lambda r: r.seq, reverse=True)
            return [r.to_json() for r in records[:limit]]
        rows = await self.store.list_turns(state=state, session=session, limit=limit)
        return [self.live[r["id"]].record.to_json() if r["id"] in self.live else r
                for r in rows]

    async def post_message(self, turn_id: str, *, kind: str, text: str,
                           redirect: bool) -> dict[str, Any]:
        live = self.live.get(turn_id)
        if live is None:
            if await self.store.get_turn(turn_id) is None:
                raise UnknownTurn(turn_id)
            raise TurnFinished(turn_id)
        record = live.record
        if record.result is not None or record.terminal:
            raise TurnFinished(turn_id)  # its result is being written: nobody would read it
        if kind == "answer" and record.question is None:
            raise NotWaiting(f"turn {turn_id} is {record.state} and asked no question; "
                             "send a steer instead")
        now = self.clock.time()
        message = {"kind": kind, "text": text, "redirect": redirect, "at": now}
        record.inbox.append(message)
        record.updated_at = now
        event = self.bus.prepare("turn.message", turn=turn_id, kind=kind, text=text[:2000],
                                 redirect=redirect)
        await self.store.append_message(turn_id, message, updated_at=now, events=[event])
        self.bus.deliver(event)
        log.info("turn.message", **_log_context(record), kind=kind, redirect=redirect)
        live.control.message_arrived(redirect=redirect)
        return {"turn": turn_id, "accepted": kind}

    async def cancel(self, turn_id: str) -> dict[str, Any]:
        live = self.live.get(turn_id)
        if live is None:
            data = await self.store.get_turn(turn_id)
            if data is None:
                raise UnknownTurn(turn_id)
            return {"turn": turn_id, "state": data["state"]}
        if live.running:
            live.control.cancel()
        else:
            self.scheduler.dequeue(turn_id)
            await self._finish(live, TurnResult(stopped_because=Stop(
                StopCode.CANCELLED, "cancelled before it started")))
        return {"turn": turn_id, "state": "cancelling" if live.running else "cancelled"}

    async def replay(self, turn_id: str) -> TurnRecord:
        data = await self.store.get_turn(turn_id)
        if data is None:
            raise UnknownTurn(turn_id)
        if not goes_to_dead_letters(data.get("result")):
            raise TurnFinished(f"turn {turn_id} is not a dead letter")
        profile = data.get("profile")
        record = await self.submit(message=data["message"], session=data["session"],
                                   budget=data.get("budget") or {},
                                   deadline=None, replay_of=turn_id,
                                   profile=profile if profile in self.config.budget.profiles
                                   else None)
        await self.store.mark_replayed(turn_id, record.id)
        return record

    async def limits_report(self, *, profile: str | None, since_s: float | None,
                            factor: float) -> dict[str, Any]:
        """What finished turns used, per profile, against the current limits."""
        since = None if since_s is None else self.clock.time() - since_s
        rows = await self.store.finished_turns(since=since)
        turns = [limits.TurnUsage(
            profile=r.get("profile") or "default", status=r["state"],
            code=r["result"]["stopped_because"]["code"],
            tokens=int(r["usage"]["total_tokens"]), seconds=float(r["usage"]["seconds"]),
            steps=int(r["counters"]["steps"]), cost_usd=float(r["usage"]["cost_usd"]),
            would_have_stopped=tuple(w["code"] for w in r.get("would_have_stopped") or ()))
            for r in rows if r.get("result")]
        if profile is not None:
            turns = [t for t in turns if t.profile == profile]
        current: dict[str, dict[str, float]] = {}
        for name in ("default", *self.config.budget.profiles):
            b = self.config.guards(None if name == "default" else name).budget
            current[name] = {"max_tokens": b.max_tokens, "max_seconds": b.max_seconds,
                             "max_steps": b.max_steps, "max_cost_usd": b.max_cost_usd}
        reports = limits.report(turns, limits=current, factor=factor)
        return {"factor": factor, "since": since, "turns": len(turns),
                "profiles": [r.to_json() for r in reports],
                "toml": "\n\n".join(r.toml() for r in reports if r.completed)}

    # -- status -----------------------------------------------------------------------

    def turn_counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in LIVE_STATES}
        for live in self.live.values():
            if live.record.state in counts:
                counts[live.record.state] += 1
        return counts

    def status(self) -> dict[str, Any]:
        now = self.clock.monotonic()
        return {
            "state": self.state,
            "policy_version": self.policy.version,
            "config_path": self.config_path,
            "pending_restart": list(self.pending_restart),
            "last_reload_error": self.last_reload_error,
            "turns": self.turn_counts(),
            "queue": {"depth": len(self.queue),
                      "max": self.config.daemon.max_queued_turns,
                      "max_concurrent": self.config.daemon.max_concurrent_turns},
            "breakers": {name.split(":", 1)[1] if name.startswith("provider:") else name:
                         b.state(now).value for name, b in self.shared.breakers.items()},
            "reloads": {"count": self.reload_count, "failures": self.reload_failures},
            "mcp_servers": self.runtime.toolbox.server_status(),
            "uptime_s": round(now - self.started_at, 3),
            "version": __version__,
        }

    # -- reload -----------------------------------------------------------------------

    async def reload(self, trigger: str, *, unless_hash: str | None = None) -> ReloadOutcome:
        """Every trigger comes here. Triggers that arrive while a reload runs coalesce
        into one more reload, which all of them wait for. A caller that goes away (a client
        hanging up) does not cut a reload short: once begun, it runs to its end.

        `unless_hash` (the file watcher's): no reload when the running policy was loaded
        from that content already (a SIGHUP sent right after saving got there first)."""
        self._reload_requests += 1
        mine = self._reload_requests
        async with self._reload_lock:
            if self._reload_done_upto >= mine and self._last_reload is not None:
                return self._last_reload
            if unless_hash is not None and unless_hash == self.policy.content_hash \
                    and self.last_reload_error is None:
                return ReloadOutcome(ok=True, policy_version=self.policy.version,
                                     pending_restart=self.pending_restart)
            upto = self._reload_requests
            with anyio.CancelScope(shield=True):
                outcome = await self._reload(trigger)
            self._reload_done_upto = upto
            self._last_reload = outcome
            return outcome

    def _stopping_outcome(self) -> ReloadOutcome:
        return ReloadOutcome(ok=False, policy_version=self.policy.version,
                             error="the daemon is stopping", stopping=True)

    async def _reload(self, trigger: str) -> ReloadOutcome:
        if self.state == "stopping":
            return self._stopping_outcome()
        started = self.clock.monotonic()
        try:
            config, digest = await anyio.to_thread.run_sync(load_config, self.config_path)
            if self.config_path and digest == EMPTY_SHA256:
                # Valid TOML (every default: the offline demo provider), but on a reload far
                # more likely a file caught between its truncation and its write.
                raise ConfigError(f"config file {self.config_path} is empty (half-written?); "
                                  "not applied. To run on the defaults, put a comment in it")
            candidate = Policy(version=self.policy.version + 1, config=config,
                               source_path=self.config_path, content_hash=digest)
            runtime = Runtime.build(candidate, self.runtime)
        except Exception as exc:  # ConfigError, or whatever building a provider raised
            error = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
            self.last_reload_error = error
            self.reload_failures += 1
            self.bus.publish("daemon.reload_failed", trigger=trigger, error=error,
                             policy_version=self.policy.version)
            log.error("daemon.reload_failed", trigger=trigger, error=error,
                      policy_version=self.policy.version)
            self.notifier.status(self.status_line())
            return ReloadOutcome(ok=False, policy_version=self.policy.version, error=error)
        if self.state == "stopping":  # a SIGTERM came while the file was read
            await self._discard(runtime)
            return self._stopping_outcome()
        self.state = "reloading"
        self.notifier.reloading(self.status_line())
        self.bus.publish("daemon.reloading", trigger=trigger,
                         policy_version=self.policy.version)
        log.info("daemon.reloading", trigger=trigger, policy_version=self.policy.version,
                 running=self.active, parked=self.running - self.active,
                 queued=len(self.queue))
        self.intake_open = False
        await self._drain(self.config.daemon.drain_timeout, reason="reload")
        if self.state == "stopping":
            # A SIGTERM during the drain: the stop owns the turns now (what this drain
            # suspended resumes at the next start); the new policy is not applied.
            await self._discard(runtime)
            log.info("daemon.reload_abandoned", trigger=trigger,
                     policy_version=self.policy.version)
            return self._stopping_outcome()
        # Swap atomically: nothing runs under the old policy any more.
        previous = self.runtime
        pending = self.policy.pending_restart(config)
        self.pending_restart = tuple(pending)
        applied = keep_restart_keys(self.policy.config, config)
        candidate = Policy(version=candidate.version, config=applied,
                           source_path=self.config_path, content_hash=digest)
        runtime.policy = candidate
        self.policy = candidate
        self.runtime = runtime
        self.shared.apply(candidate.config)
        if self._tg is not None:  # MCP servers whose config changed restart, drained
            await runtime.toolbox.start(self._tg, replacing=previous.toolbox)
        self.scheduler.set_limits(max_concurrent=applied.daemon.max_concurrent_turns,
                                  max_queued=applied.daemon.max_queued_turns)
        suspended, self._suspended = self._suspended, []
        self.scheduler.enqueue_first((turn_id, self.live[turn_id].record.session)
                                     for turn_id in suspended if turn_id in self.live)
        self.last_reload_error = None
        self.reload_count += 1
        self.state = "ready"
        self.intake_open = True
        self._dispatch()
        duration = self.clock.monotonic() - started
        self.notifier.ready(self.status_line())
        self.bus.publish("daemon.reloaded", trigger=trigger, policy_version=candidate.version,
                         content_hash=digest, pending_restart=pending,
                         duration_s=round(duration, 6), resumed=len(suspended))
        log.info("daemon.reloaded", trigger=trigger, policy_version=candidate.version,
                 content_hash=digest, pending_restart=pending, duration_s=round(duration, 6),
                 suspended=len(suspended))
        for provider in previous.retired_by(runtime):
            await provider.aclose()
        if previous.toolbox is not runtime.toolbox:
            await previous.toolbox.aclose()
        return ReloadOutcome(ok=True, policy_version=candidate.version,
                             pending_restart=tuple(pending), duration_s=duration)

    async def _discard(self, runtime: Runtime) -> None:
        """Close what a reload built and will not use."""
        for provider in runtime.retired_by(self.runtime):
            await provider.aclose()
        if runtime.toolbox is not self.runtime.toolbox:
            await runtime.toolbox.aclose()

    async def _drain(self, timeout_s: float, *, reason: str) -> None:
        """Let running turns finish up to `timeout_s`; parked turns suspend at once, the
        rest at their next step boundary once the time is up (a stop cuts them short).

        While it lasts, systemd is told to extend its start/reload/stop timeout, a little
        at a time, so a drain longer than `TimeoutStopSec=` is not killed for it, while a
        wedged loop still is."""
        if not self.running:
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(extend_timeout_loop, self.notifier, name="extend timeout")
            for live in list(self.live.values()):
                if live.running and TurnState(live.record.state).parked:
                    live.control.suspend()
            with self.clock.move_on_after(timeout_s):
                while self.running:
                    await self._idle.wait()
            if self.running:
                log.info("daemon.drain_timeout", reason=reason, running=self.running)
                for live in list(self.live.values()):
                    if live.running:
                        live.control.suspend(now=reason == "stop")
                while self.running:
                    await self._idle.wait()
            tg.cancel_scope.cancel()

    # -- stop -------------------------------------------------------------------------

    def request_stop(self) -> None:
        """SIGTERM / SIGINT. A second one while the stop drains does not wait any longer:
        every turn is suspended now (cut at once; it resumes from its last checkpoint at
        the next start), as an operator pressing Ctrl-C twice expects."""
        if self._stop_requested.is_set() and self.state == "stopping" and self.running:
            log.warning("daemon.stop_now", running=self.running)
            for live in list(self.live.values()):
                if live.running:
                    live.control.suspend(now=True)
        self._stop_requested.set()

    async def wait_stop_requested(self) -> None:
        await self._stop_requested.wait()

    async def stop(self) -> None:
        if self.state == "stopping":
            return
        self.state = "stopping"
        self.intake_open = False
        self.notifier.stopping(self.status_line())
        self.bus.publish("daemon.stopping", running=self.active,
                         parked=self.running - self.active, queued=len(self.queue))
        log.info("daemon.stopping", running=self.active, parked=self.running - self.active,
                 queued=len(self.queue))
        await self._drain(self.config.daemon.shutdown_timeout, reason="stop")
        self._stopping.set()  # long polls answer now; live event streams end
        self.bus.close_subscribers()
        await self.runtime.toolbox.aclose()
        for provider in self.runtime.providers.values():
            await provider.aclose()


def _log_context(record: TurnRecord) -> dict[str, Any]:
    """What every log line of a turn carries, read when the line is written."""
    return {"turn": record.id, "session": record.session,
            "policy_version": record.policy_version, "provider": record.provider}
