"""Lifecycle room: start (resume what was unfinished), reload, drain and stop.

A reload validates first and changes nothing when the file is bad; then drains: parked
turns are held in their wait (`suspended` until the swap, their tasks left waiting and
nothing written; suspended and requeued instead when the new policy bounds the waits
differently), running ones finish under their policy or, after `drain_timeout`, are
suspended: a model call cut (it has no effect), a tool call let finish first; then the
policy is swapped in one step, the held turns wait on under it (whichever wakes runs
under it) and the suspended turns go first in the queue. A stop that comes during a reload takes
over its drain and the new policy is dropped. A file that gives the running policy again
(a comment edited, a save the watcher already applied) drains nothing and makes no new
version. Every wait goes through the injected clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup

from turnkeeper import event_types as ev
from turnkeeper.config import Config, ConfigError, PolicyVersion, keep_restart_keys, load_config
from turnkeeper.lifecycle.systemd import extend_timeout_loop
from turnkeeper.policy.daemon_state import DaemonState
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.runtime import Runtime
from turnkeeper.supervisor.core import LiveTurn, SupervisorCore, follower_backlog
from turnkeeper.supervisor.fleet import Fleet
from turnkeeper.supervisor.retention import Retention
from turnkeeper.supervisor.scheduling import Scheduling
from turnkeeper.supervisor.webhooks import Webhooks
from turnkeeper.turn.record import TurnRecord

log = structlog.get_logger("turnkeeper.supervisor")



@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    ok: bool
    policy_version: int
    pending_restart: tuple[str, ...] = ()
    error: str | None = None
    duration_s: float = 0.0
    stopping: bool = False  # refused because the daemon is stopping, not for the config
    # The file read gives the policy already running: no drain, no new version.
    unchanged: bool = False

    def to_json(self) -> dict[str, Any]:
        if not self.ok:
            return {"error": self.error, "policy_version": self.policy_version}
        return {"policy_version": self.policy_version,
                "pending_restart": list(self.pending_restart),
                "duration_s": round(self.duration_s, 6), "unchanged": self.unchanged}


def waits_hold(running: Config, new: Config) -> bool:
    """Whether a reload to `new` leaves every parked wait's end where it is: the clarify
    timeout, the approval wait and the budgets (their wall clock bounds every wait) are
    the same. Then parked turns wait on through the reload; otherwise each is suspended
    and parks again under the new bounds."""
    return (running.clarify == new.clarify and running.approvals == new.approvals
            and running.budget == new.budget)


class Lifecycle:
    def __init__(self, core: SupervisorCore, *, scheduling: Scheduling, retention: Retention,
                 webhooks: Webhooks, fleet: Fleet | None) -> None:
        self.core = core
        self.scheduling = scheduling
        self.retention = retention
        self.webhooks = webhooks
        self.fleet = fleet
        # Reload triggers coalesce: a request numbered at most `_done_upto` is answered
        # by the reload that covered it (`_last`).
        self._lock = anyio.Lock()
        self._requests = 0
        self._done_upto = 0
        self._last: ReloadOutcome | None = None

    async def start(self, tg: TaskGroup) -> None:
        """Resume every unfinished turn from its checkpoint, then open intake."""
        core = self.core
        core.tg = tg
        await core.runtime.toolbox.start(tg)  # MCP servers: connected (or failed) once
        core.bus.start_at(await self.fleet.store.event_block_start() if self.fleet is not None
                          else await core.store.max_event_seq())
        resumed = 0
        # In a fleet the unfinished turns are the fleet's: each is claimed, not resumed.
        unfinished = [] if self.fleet is not None else await core.store.unfinished_turns()
        for record_json, checkpoint in unfinished:
            record = TurnRecord.from_json(record_json)
            if record.state != TurnState.QUEUED:
                record.policy_version = core.policy.version
            live = LiveTurn(record=record, checkpoint=checkpoint)
            core.live[record.id] = live
            core.scheduler.enqueue(record.id, record.session)
            resumed += 1
        if resumed:
            log.info("daemon.resuming", turns=resumed)
        tg.start_soon(self.retention.run, name="retention")
        tg.start_soon(self.webhooks.run, name="webhooks")
        core.move_to(DaemonState.READY)
        core.intake_open = True
        core.started_event.set()
        self.scheduling.dispatch()
        if self.fleet is not None:
            tg.start_soon(self.fleet.run, name="fleet")

    async def wait_started(self) -> None:
        """Until `start` has resumed the unfinished turns: what a request that arrives
        earlier (systemd's socket accepts them before we run) waits for. Once started,
        it returns without yielding: anyio's `Event.wait` yields even on a set event, and
        under load that cost every request one more turn of the event loop."""
        started = self.core.started_event
        if not started.is_set():
            await started.wait()

    async def reload(self, trigger: str, *, unless_hash: str | None = None) -> ReloadOutcome:
        """Every trigger comes here. Triggers that arrive while a reload runs coalesce
        into one more reload, which all of them wait for. A caller that goes away (a client
        hanging up) does not cut a reload short: once begun, it runs to its end.

        `unless_hash` (the file watcher's): no reload when the running policy was loaded
        from that content already (a SIGHUP sent right after saving got there first)."""
        core = self.core
        self._requests += 1
        mine = self._requests
        async with self._lock:
            if self._done_upto >= mine and self._last is not None:
                return self._last
            if unless_hash is not None and unless_hash == core.policy.content_hash \
                    and core.last_reload_error is None:
                return ReloadOutcome(ok=True, policy_version=core.policy.version,
                                     pending_restart=core.pending_restart)
            upto = self._requests
            with anyio.CancelScope(shield=True):
                outcome = await self._reload(trigger)
            self._done_upto = upto
            self._last = outcome
            return outcome

    def _stopping_outcome(self) -> ReloadOutcome:
        core = self.core
        return ReloadOutcome(ok=False, policy_version=core.policy.version,
                             error="the daemon is stopping", stopping=True)

    async def _reload(self, trigger: str) -> ReloadOutcome:
        core = self.core
        if core.stopping:
            return self._stopping_outcome()
        started = core.clock.monotonic()
        try:
            # A file without [[providers]] (an empty one: caught between its truncation
            # and its write) is refused there: never the demo provider by accident.
            config, digest = await anyio.to_thread.run_sync(load_config, core.config_path)
            runtime = Runtime.build(
                PolicyVersion(version=core.policy.version + 1, config=config,
                              source_path=core.config_path, content_hash=digest),
                core.runtime)
        except Exception as exc:  # ConfigError, or whatever building a provider raised
            return self._refused(trigger, exc)
        if core.stopping:  # a SIGTERM came while the file was read
            await self._discard(runtime)
            return self._stopping_outcome()
        pending = core.policy.pending_restart(config)
        applied = keep_restart_keys(core.policy.config, config)
        if self._same_policy(applied, pending, runtime):
            return await self._unchanged(trigger, runtime, digest, started)
        await self._drain_for(trigger, applied)
        if core.stopping:
            # A SIGTERM during the drain: the stop owns the turns now (what this drain
            # suspended resumes at the next start); the new policy is not applied.
            await self._discard(runtime)
            log.info("daemon.reload_abandoned", trigger=trigger,
                     policy_version=core.policy.version)
            return self._stopping_outcome()
        previous = core.runtime
        resumed = await self._swap(runtime, applied, pending, digest)
        duration = core.clock.monotonic() - started
        core.notifier.ready(core.status_line())
        core.bus.publish(ev.DaemonReloaded(
            trigger=trigger, policy_version=core.policy.version, content_hash=digest,
            pending_restart=pending, duration_s=round(duration, 6), resumed=resumed))
        log.info("daemon.reloaded", trigger=trigger, policy_version=core.policy.version,
                 content_hash=digest, pending_restart=pending, duration_s=round(duration, 6),
                 suspended=resumed)
        for provider in previous.retired_by(runtime):
            await provider.aclose()
        if previous.toolbox is not runtime.toolbox:
            await previous.toolbox.aclose()
        return ReloadOutcome(ok=True, policy_version=core.policy.version,
                             pending_restart=tuple(pending), duration_s=duration)

    def _refused(self, trigger: str, exc: Exception) -> ReloadOutcome:
        """The file (or a provider built from it) was refused: the running policy stays,
        the error is told to the caller, the log, the bus and systemd's STATUS=."""
        core = self.core
        error = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
        # The same refusal again (a bad save the watcher refused, then `turnkeeper
        # reload`) is one refused config, not two; each trigger still hears it.
        if error != core.last_reload_error:
            core.reload_failures += 1
        core.last_reload_error = error
        core.bus.publish(ev.DaemonReloadFailed(trigger=trigger, error=error,
                                               policy_version=core.policy.version))
        log.error("daemon.reload_failed", trigger=trigger, error=error,
                  policy_version=core.policy.version)
        core.notifier.status(core.status_line())
        return ReloadOutcome(ok=False, policy_version=core.policy.version, error=error)

    async def _drain_for(self, trigger: str, applied: Config) -> None:
        """RELOADING=1, intake closed (submits are queued), then the drain."""
        core = self.core
        core.move_to(DaemonState.RELOADING)
        core.notifier.reloading(core.status_line())
        core.bus.publish(ev.DaemonReloading(trigger=trigger,
                                            policy_version=core.policy.version))
        log.info("daemon.reloading", trigger=trigger, policy_version=core.policy.version,
                 running=core.active, parked=core.running - core.active,
                 queued=len(core.queue))
        core.intake_open = False
        self.scheduling.holding = waits_hold(core.policy.config, applied)
        try:
            await self._drain(core.config.daemon.drain_timeout, reason="reload")
        finally:
            self.scheduling.holding = False

    async def _swap(self, runtime: Runtime, applied: Config, pending: list[str],
                    digest: str) -> int:
        """Swap atomically: nothing runs under the old policy any more. The turns the
        drain suspended go first in the queue; how many."""
        core = self.core
        previous = core.runtime
        core.pending_restart = tuple(pending)
        version = PolicyVersion(version=runtime.policy.version, config=applied,
                                source_path=core.config_path, content_hash=digest)
        runtime.policy = version
        core.policy = version
        core.runtime = runtime
        core.shared.apply(version.config)
        self.webhooks.configure()
        if core.tg is not None:  # MCP servers whose config changed restart, drained
            await runtime.toolbox.start(core.tg, replacing=previous.toolbox)
        core.scheduler.set_limits(max_concurrent=applied.daemon.max_concurrent_turns,
                                  max_queued=applied.daemon.max_queued_turns)
        core.bus.follower_rule = follower_backlog(applied)
        kept = self.scheduling.let_go()
        suspended, core.suspended_turns = core.suspended_turns, []
        core.scheduler.enqueue_first((turn_id, core.live[turn_id].record.session)
                                     for turn_id in suspended if turn_id in core.live)
        if kept:
            log.info("daemon.parked_kept", turns=kept, policy_version=version.version)
        core.last_reload_error = None
        core.reload_count += 1
        core.move_to(DaemonState.READY)
        core.intake_open = True
        self.scheduling.dispatch()
        return len(suspended)

    def _same_policy(self, applied: Config, pending: list[str], runtime: Runtime) -> bool:
        """The reload would run what runs now: the same settings (a comment or the order
        of keys may differ), the same restart-only keys pending, and every provider kept
        (a rotated key or an edited script builds a new one, so that is a change)."""
        core = self.core
        running = core.runtime.providers
        return (applied == core.policy.config and tuple(pending) == core.pending_restart
                and runtime.providers.keys() == running.keys()
                and all(runtime.providers[name] is p for name, p in running.items()))

    async def _unchanged(self, trigger: str, runtime: Runtime, digest: str,
                         started: float) -> ReloadOutcome:
        """A reload that changes nothing makes no new version and drains nothing (a save
        the file watcher applied, then `turnkeeper reload`, is one version, not two). It
        still says RELOADING=1 then READY=1: systemd's reload waits for both. A refusal
        the file had earned is cleared: the file is good again."""
        core = self.core
        await self._discard(runtime)
        core.notifier.reloading(core.status_line())
        core.policy = replace(core.policy, content_hash=digest)
        core.runtime.policy = core.policy
        core.last_reload_error = None
        core.reload_unchanged += 1
        duration = core.clock.monotonic() - started
        core.notifier.ready(core.status_line())
        core.bus.publish(ev.DaemonReloaded(
            trigger=trigger, policy_version=core.policy.version, content_hash=digest,
            pending_restart=list(core.pending_restart), duration_s=round(duration, 6),
            resumed=0, unchanged=True))
        log.info("daemon.reload_unchanged", trigger=trigger,
                 policy_version=core.policy.version, content_hash=digest)
        return ReloadOutcome(ok=True, policy_version=core.policy.version,
                             pending_restart=core.pending_restart, duration_s=duration,
                             unchanged=True)

    async def _discard(self, runtime: Runtime) -> None:
        """Close what a reload built and will not use."""
        core = self.core
        for provider in runtime.retired_by(core.runtime):
            await provider.aclose()
        if runtime.toolbox is not core.runtime.toolbox:
            await runtime.toolbox.aclose()

    async def _drain(self, timeout_s: float, *, reason: str) -> None:
        """Let running turns finish up to `timeout_s`; parked turns are held where they
        wait (a reload that keeps their waits' bounds) or suspend at once, the rest
        suspend once the time is up. A reload then cuts what has no effect (a model call, a
        retry wait: asked again on resume under the new policy) and lets a tool call on
        the wire finish first; a stop cuts everything but a non-idempotent call on the
        wire. Either way the drain ends within `timeout_s` plus the longest tool timeout.

        While it lasts, systemd is told to extend its start/reload/stop timeout, a little
        at a time, so a drain longer than `TimeoutStopSec=` is not killed for it, while a
        wedged loop still is."""
        core = self.core
        if not core.running:
            return
        held = core.held
        holding = self.scheduling.holding and reason == "reload"

        def busy() -> int:
            """Tasks the drain waits for: a reload's held turns are left waiting."""
            return core.running - (len(held) if reason == "reload" else 0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(extend_timeout_loop, core.notifier, name="extend timeout")
            for live in list(core.live.values()):
                if not live.running:
                    continue
                if live.record.id in held:  # a stop that took over a reload's drain
                    live.control.suspend()
                elif TurnState(live.record.state).parked:
                    if holding:
                        self.scheduling.hold(live)
                    else:
                        live.control.suspend()
            with core.clock.move_on_after(timeout_s):
                while busy():
                    await core.idle.wait()
            if busy():
                log.info("daemon.drain_timeout", reason=reason, running=busy())
                for live in list(core.live.values()):
                    if live.running and live.record.id not in held:
                        live.control.suspend(now=reason == "stop",
                                             between_effects=reason == "reload")
                while busy():
                    await core.idle.wait()
            tg.cancel_scope.cancel()

    def request_stop(self) -> None:
        """SIGTERM / SIGINT. A second one while the stop drains does not wait any longer:
        every turn is suspended now (cut at once; it resumes from its last checkpoint at
        the next start), as an operator pressing Ctrl-C twice expects."""
        core = self.core
        if core.stop_requested_event.is_set() and core.stopping and core.running:
            log.warning("daemon.stop_now", running=core.running)
            for live in list(core.live.values()):
                if live.running:
                    live.control.suspend(now=True)
        core.stop_requested_event.set()

    async def wait_stop_requested(self) -> None:
        core = self.core
        await core.stop_requested_event.wait()

    async def stop(self) -> None:
        core = self.core
        if core.stopping:
            return
        core.move_to(DaemonState.STOPPING)
        core.intake_open = False
        core.notifier.stopping(core.status_line())
        core.bus.publish(ev.DaemonStopping(running=core.active,
                                           parked=core.running - core.active,
                                           queued=len(core.queue)))
        log.info("daemon.stopping", running=core.active, parked=core.running - core.active,
                 queued=len(core.queue))
        await self._drain(core.config.daemon.shutdown_timeout, reason="stop")
        if self.fleet is not None:  # hand the turns back: another node goes on at once
            await self.fleet.stop()
        await self.webhooks.stop()  # what was on the wire stays pending: sent again
        core.stopping_event.set()  # long polls answer now; live event streams end
        core.bus.close_subscribers()
        await core.runtime.toolbox.aclose()
        for provider in core.runtime.providers.values():
            await provider.aclose()
