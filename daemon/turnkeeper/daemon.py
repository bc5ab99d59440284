"""`turnkeeper serve`: start, run, reload and stop.

Start: load and validate config (exit 78 when invalid), open the store (exit 74 when
unusable), bind the control socket or take it from systemd, resume unfinished turns,
then READY=1. Signals only enqueue; one loop dispatches them (as gunicorn's arbiter).
"""

from __future__ import annotations

import cProfile
import gc
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import prometheus_client
import structlog
from aiohttp.web import AppRunner
from anyio.abc import TaskGroup

from turnkeeper import exits
from turnkeeper import logging as tk_logging
from turnkeeper.clock import Clock, SystemClock
from turnkeeper.config import (
    Config,
    ConfigError,
    PolicyVersion,
    config_path_from_env,
    load_config,
    socket_path,
    state_dir,
)
from turnkeeper.control.server import ControlServer, SocketError
from turnkeeper.errors import TurnkeeperError
from turnkeeper.lifecycle import sandbox, systemd
from turnkeeper.lifecycle.signals import signal_dispatcher
from turnkeeper.lifecycle.watch import ConfigChange, watch_config
from turnkeeper.metrics import Metrics
from turnkeeper.paths import (
    StateDirUnusable,
    UnsafeSocketDir,
    UnsafeStateDir,
    prepare_state_dir,
)
from turnkeeper.policy.collector import CollectorPace, Pass
from turnkeeper.store import open_store
from turnkeeper.store.base import Store, StoreError
from turnkeeper.supervisor import Supervisor

if TYPE_CHECKING:
    from turnkeeper.store.postgres import PostgresStore
    from turnkeeper.store.sqlite import SQLiteStore

log = structlog.get_logger("turnkeeper.daemon")


# The cyclic collector's thresholds while serving (CPython's default: 700, 10, 10). A
# daemon with thousands of live turns allocates containers at a high rate (event dicts,
# messages, coroutine frames): at the default thresholds a generation-0 collection ran
# every 700 of them and an older generation every 7,000 and 70,000, each walking more of
# the live turns: under 5,000 concurrent turns, pauses of hundreds of milliseconds.
# Measured with bench/bench_concurrency.py (5,000 turns x 3 steps, 200 ms model; rounds
# alternated, on 2 busy shared cores): against the default, 10,000 gave daemon CPU
# 0.79-0.87 ms a step instead of 1.05-1.12 (-22%), `status` p99 217-654 ms instead of
# 477-920. At 10,000 the collector still took 1.9-2.6 s of CPU a run (generation-1
# passes of 70-145 ms: each walks every turn's state promoted since the last); at 50,000
# it takes 0.4-0.6 s (generation-1 passes under 2 ms), daemon CPU 0.72-0.78 ms a step
# instead of 0.78-0.93, peak RSS the same (114-125 MiB). 100,000 then saved little more and
# made the longest generation-0 pass longer (170 ms). Since a finished turn no longer
# leaves a reference cycle behind (the collector found 6,000-12,000 objects of them a
# pass, now none), what it walks is live state, and a pass's length is set by how many
# young objects it walks: with all 5,000 turns in flight at once (batch submits),
# 200,000 against 50,000 summed its pauses over 10 ms to 0.45-0.49 s a run instead of
# 0.98-1.21 (the longest 204-211 ms instead of 333-339). Against 200,000, 100,000 halves
# each generation-0 pass for about the same total: the longest pause 132 ms instead of
# 221, `status` p99 193-221 ms instead of 298-341 and the loop's lag p99 <= 200-250 ms
# instead of <= 250-400 (five pairs alternated), daemon CPU 8.3-9.0 s against 7.9-9.1;
# with submits one at a time, lag p99 <= 75-150 ms instead of <= 200. While serving, the
# collector is paced by the clock (`pace_collector`, `policy/collector.py`): under load
# what the young generation holds is frozen every 50 ms, so the thresholds are only a
# floor for a burst that makes 100,000 objects within that time; while quiet they rule.
GC_THRESHOLD = (100_000, 20, 100)


# The interpreter's switch interval while serving (CPython's default: 5 ms): how long a
# thread that wants the GIL waits before it asks the one holding it to let go. The
# control lane's thread (`control/lane.py`) answers a status in one hold of the GIL, got
# from the event loop's thread busy with turns. Measured with bench/bench_concurrency.py
# (5,000 turns x 3 steps, 200 ms model, with the lane; rounds alternated, 2 busy shared
# cores): `status` p99 12-19 ms at 1 ms against 26-41 ms at 5 ms (p50 3.2-3.7 against
# 5.0-6.0), daemon CPU within 2-4% (6.85-6.97 s against 6.42-6.77 in batches, 7.98-8.42
# against 8.04-8.08 one submit at a time).
SWITCH_INTERVAL_S = 0.001


def tune_gc() -> None:
    """At start-up, once the modules and the config are loaded: collect what loading
    left behind, move every object that survives into the permanent generation (the
    collector never walks it again: modules, classes, the parsed config) and raise the
    thresholds, so the collector spends its time on the objects that come and go."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


async def pace_collector(sup: Supervisor, clock: Clock) -> None:
    """Forever: every `every_s`, the cyclic collector's pass `policy/collector.py` says
    (the young generation frozen, or the whole heap thawed, collected and frozen again,
    or nothing)."""
    pace = CollectorPace(clock.monotonic())
    while True:
        await clock.sleep(pace.every_s)
        what = pace.look(clock.monotonic(), len(sup.live))
        if what is Pass.FULL:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
        elif what is Pass.FREEZE:
            gc.freeze()


class BootError(TurnkeeperError):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StoreFatal(TurnkeeperError):
    """The store failed every write for `store.fatal_after`: the daemon stopped, exit 74."""

    exit_code = exits.IOERR


async def _watch_store(store: Store, sup: Supervisor, clock: Clock,
                       fatal: list[str]) -> None:
    """Stop the daemon once the store has refused every write for `store.fatal_after`
    seconds: a service manager restart may cure it (a remounted disk); an operator must
    see it otherwise. Until then the daemon waits, degraded, and recovers by itself."""
    while not store.outage.fatal(now=clock.monotonic()):
        await clock.sleep(1.0)
    fatal.append(f"state store unwritable for {store.outage.fatal_after_s:.0f} s "
                 f"(store.fatal_after): {store.outage.last_error}")
    log.error("store.fatal", error=fatal[0])
    sup.request_stop()


async def _serve(policy: PolicyVersion, config_path: str | None, control: Path) -> None:
    config = policy.config
    clock = SystemClock()
    notifier = systemd.Notifier.from_env()
    store = await _open_store(config, clock, notifier)
    node_id = getattr(store, "node_id", None)
    if node_id is not None:  # a node of a fleet: every log line says which
        structlog.contextvars.bind_contextvars(node=node_id)
    try:
        sup = Supervisor(policy=policy, store=store, clock=clock, notifier=notifier,
                         config_path=config_path)
    except ConfigError as exc:
        await store.close()
        raise BootError(str(exc), exc.exit_code) from None
    if config.tracing.enabled:
        _start_tracing(sup, config, node_id)
    # `x_created` timestamps for every counter double the scrape for no operator value.
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    metrics = Metrics(sup, clock=clock)
    sup.bus.listeners.append(metrics.on_event)
    server, metrics_tcp = await _listen(sup, metrics, store, control)
    fatal: list[str] = []
    resume_error: StoreError | None = None
    async with anyio.create_task_group() as tg:
        await tg.start(store.run, name="store writer")
        tg.start_soon(metrics.watch_loop_lag, name="event-loop lag")
        tg.start_soon(pace_collector, sup, clock, name="collector pace")
        tg.start_soon(_watch_store, store, sup, clock, fatal, name="store outage watch")
        try:
            await sup.start(tg)
        except StoreError as exc:  # a damaged row met while resuming: exit 74, no traceback
            resume_error = exc
        else:
            await _run_until_stopped(tg, sup, notifier, server, config_path)
        await server.stop()
        if metrics_tcp is not None:
            await metrics_tcp.cleanup()
        await store.close()
        await sup.shared.tracer.aclose()  # the spans still buffered are sent
        log.info("daemon.stopped")
        tg.cancel_scope.cancel()
    if resume_error is not None:
        raise BootError(str(resume_error), resume_error.exit_code)
    if fatal:
        raise StoreFatal(fatal[0])


async def _open_store(config: Config, clock: Clock, notifier: systemd.Notifier
                      ) -> SQLiteStore | PostgresStore:
    """The state directory checked and the store opened (a schema migration may take
    minutes: systemd is asked for the time); a failure is a BootError with its status."""
    try:
        prepare_state_dir(state_dir(config))
        store = open_store(config, state_dir(config), clock=clock)
        await systemd.asking_for_time(notifier, store.open, status=(
            "opening the state store (a schema migration can take minutes)"))
    except (StoreError, StateDirUnusable, UnsafeStateDir) as exc:
        raise BootError(str(exc), exc.exit_code) from None
    return store


def _start_tracing(sup: Supervisor, config: Config, node_id: str | None) -> None:
    """The OpenTelemetry tracer: imported here, only when `[tracing] enabled` asks."""
    from turnkeeper.otel import OtelTracer

    tracing = config.tracing
    sup.shared.tracer = OtelTracer(
        endpoint=tracing.endpoint, service_name=tracing.service_name,
        sample_ratio=tracing.sample_ratio, capture_content=tracing.capture_content,
        node=node_id)
    log.info("tracing.enabled", endpoint=tracing.endpoint,
             sample_ratio=tracing.sample_ratio, capture_content=tracing.capture_content)


async def _listen(sup: Supervisor, metrics: Metrics, store: Store, control: Path
                  ) -> tuple[ControlServer, AppRunner | None]:
    """The control socket (bound, or systemd's), then the metrics' TCP listener when
    `metrics.listen` asks for one; a failure closes what was opened and is a BootError."""
    config = sup.config
    server = ControlServer(sup, path=control, mode=config.daemon.socket_mode_int,
                           inherited=systemd.take_unix_listener())
    try:
        await server.start(metrics.install)
    except (SocketError, UnsafeSocketDir, OSError) as exc:
        await store.close()
        raise BootError(f"control socket: {exc}",
                        getattr(exc, "exit_code", SocketError.exit_code)) from None
    address = config.metrics.address()
    if address is None:
        return server, None
    try:
        return server, await metrics.serve_tcp(*address)
    except OSError as exc:
        await server.stop()
        await store.close()
        raise BootError(f"metrics.listen {config.metrics.listen}: {exc.strerror or exc}",
                        SocketError.exit_code) from None


async def _run_until_stopped(tg: TaskGroup, sup: Supervisor, notifier: systemd.Notifier,
                             server: ControlServer, config_path: str | None) -> None:
    """Signals, the watchdog, the config watcher and STATUS= running; READY=1; then
    until a stop is asked for, and the stop."""
    config = sup.config

    async def on_reload_signal() -> None:
        tg.start_soon(sup.reload, "SIGHUP", name="reload (SIGHUP)")

    await tg.start(signal_dispatcher, {signal.SIGHUP: on_reload_signal,
                                       signal.SIGTERM: sup.request_stop,
                                       signal.SIGINT: sup.request_stop},
                   name="signal dispatcher")
    interval = systemd.watchdog_interval()
    if interval is not None:
        tg.start_soon(systemd.watchdog_loop, notifier, interval, name="watchdog")
    if config_path:
        tg.start_soon(_watch, sup, Path(config_path), name="config watcher")
    tg.start_soon(systemd.status_loop, notifier, sup.status_line, name="systemd status")
    notifier.ready(sup.status_line())
    log.info("daemon.ready", socket=str(server.path), policy_version=sup.policy.version,
             state_dir=str(state_dir(config)), store=repr(sup.store),
             providers=[p.name for p in config.providers],
             resumed=len(sup.live), gc_threshold=list(gc.get_threshold()))
    await sup.wait_stop_requested()
    await sup.stop()


async def _watch(sup: Supervisor, path: Path) -> None:
    async def on_change(change: ConfigChange) -> None:
        # Read at each change, so a reload can turn watching on or off. The content the
        # running policy was loaded from (a SIGHUP got there first) is no change.
        if sup.config.daemon.watch_config:
            await sup.reload("config file changed", unless_hash=change.sha256)

    await watch_config(path, on_change, initial_hash=sup.policy.content_hash or None)


def _run(policy: PolicyVersion, config_path: str | None, control: Path) -> None:
    """The event loop until the daemon stops. With TURNKEEPER_PROFILE=FILE set, under
    cProfile, its statistics written to FILE at the stop (for `python -m pstats`)."""
    profile_to = os.environ.get("TURNKEEPER_PROFILE")
    profiler = cProfile.Profile() if profile_to else None
    if profiler is not None:
        profiler.enable()
    try:
        anyio.run(_serve, policy, config_path, control, backend="asyncio",
                  backend_options={"use_uvloop": True})
    finally:
        if profiler is not None and profile_to:
            profiler.disable()
            profiler.dump_stats(profile_to)


def _warn_of_blocked_mcp_servers(config: Config) -> None:
    """A stdio MCP server that runs on a JIT cannot start where this process is denied
    writable and executable memory (its children inherit the denial): say so, with the
    remedy, before it dies and is restarted in a loop with nothing to say why."""
    if not any(t.kind == "mcp" and t.command for t in config.tools):
        return
    denied = sandbox.write_execute_denied()
    if denied is None:
        return
    for problem in sandbox.jit_server_problems(config.tools, denied):
        log.warning("mcp.server_cannot_start", error=problem)


def serve(config_option: str | None, socket_option: str | None = None) -> int:
    config_path = config_path_from_env(config_option)
    try:
        config, digest = load_config(config_path)
    except ConfigError as exc:
        print(f"turnkeeper: {exc}", file=sys.stderr)
        # `systemctl status` shows why; no READY=1 follows, the exit status (78) says the rest.
        systemd.Notifier.from_env().status(f"failed: {exc}")
        return exc.exit_code
    tk_logging.configure(log_format=config.daemon.log_format, log_level=config.daemon.log_level)
    _warn_of_blocked_mcp_servers(config)
    policy = PolicyVersion(version=1, config=config, source_path=config_path, content_hash=digest)
    tune_gc()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        _run(policy, config_path, socket_path(config, socket_option))
    except BootError as exc:
        log.error("daemon.boot_failed", error=str(exc), exit_code=exc.exit_code)
        print(f"turnkeeper: {exc}", file=sys.stderr)
        return exc.exit_code
    except StoreFatal as exc:
        print(f"turnkeeper: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return exits.OK
    return exits.OK
