"""Prometheus metrics, on a registry of this daemon's own (never the global one).

Nothing in the turn runner calls a metric. Counters are derived from the events the
runner and the supervisor already publish: `Metrics.on_event` is an EventBus listener,
called synchronously as each event is published. What it counts is summed in a plain
dict and added to the Prometheus counters when the registry is read (a scrape): a
Prometheus `inc` takes a lock and checks its argument, and a step's five events made
seven of them. State that already lives somewhere (turns by state, queue depth,
breakers, policy version) is read from the supervisor at scrape time by a custom
collector (`metrics_state.py`): derived, never stored twice.

Served as `GET /metrics` on the control socket and, when `[metrics] listen` is set, on
a TCP address for a Prometheus scrape. A small task measures event-loop lag (how late a
short sleep wakes up): a loop busy with CPU work, or blocked by a synchronous call,
shows up there before it shows up anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from turnkeeper import event_types as ev
from turnkeeper.clock import Clock
from turnkeeper.events import Event
from turnkeeper.metrics_state import StateCollector
from turnkeeper.policy.classify import FailureClass
from turnkeeper.policy.outcome import StopCode, status_of
from turnkeeper.supervisor import Supervisor

log = structlog.get_logger("turnkeeper.metrics")

LAG_INTERVAL_S = 0.1
# Fine between 10 ms and 1 s, where "busy" turns into "too slow": a p99 can be told
# from its neighbours (under 250 ms or not, under 500 ms or not).
LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25,
                 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)
# Attempt outcomes: success, each failure class, a context overflow (a rebuild, not a
# failure) and a call cut short by a redirect steer.
ATTEMPT_CLASSES = ("success", *(c.value for c in FailureClass), "context_overflow",
                   "redirected")
UNKNOWN_TOOL = "(unknown)"  # a tool name the model made up: not a label value of its own


class Metrics:
    """The daemon's metrics. Build it after the supervisor, add `on_event` to the bus's
    listeners, and mount `handle` (or call `install`) on a web app."""

    def __init__(self, supervisor: Supervisor, *, clock: Clock) -> None:
        self.supervisor = supervisor
        self.clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # Counts not yet added to their counters: (metric, label values) -> amount. The
        # registry reads its collectors in the order they were registered, so with this
        # one first a collection adds them before any counter is read: a scrape sees
        # every event published before it. Bounded as the metrics' own series are.
        self._pending: dict[tuple[Any, tuple[str, ...]], float] = {}
        r.register(_Pending(self))
        self._declare_turns(r)
        self._declare_tools(r)
        self._declare_daemon(r)
        r.register(StateCollector(supervisor, clock))
        # Series that exist from the first scrape, so rate() and absent() work at once.
        for code in StopCode:
            self.turns_finished.labels(status_of(code).value, code.value)
        for result in ("ok", "unchanged", "failed"):
            self.reloads.labels(result)
        self._label_providers()
        self._steps: dict[str, tuple[int, float]] = {}  # turn -> (step, monotonic start)
        self._errors_logged = 0

    def _declare_turns(self, r: CollectorRegistry) -> None:
        """Turns, model calls and their retries and failovers."""
        self.turns_submitted = Counter(
            "turnkeeper_turns_submitted", "Turns accepted by submit (replays included)",
            registry=r)
        self.turns_finished = Counter(
            "turnkeeper_turns_finished", "Turns ended, by status and stop code",
            ["status", "code"], registry=r)
        self.provider_requests = Counter(
            "turnkeeper_provider_requests", "Model calls sent, by provider",
            ["provider"], registry=r)
        self.provider_attempts = Counter(
            "turnkeeper_provider_attempts",
            "Model call attempts by provider and outcome class (success, retryable, "
            "deterministic, unknown, context_overflow, redirected)",
            ["provider", "class"], registry=r)
        self.retries_scheduled = Counter(
            "turnkeeper_retries_scheduled", "Model call retries scheduled (a backoff wait)",
            ["provider", "class"], registry=r)
        self.failovers = Counter(
            "turnkeeper_failovers", "Moves to the next provider of the chain",
            ["from", "to", "reason"], registry=r)
        self.recovery_cycles = Counter(
            "turnkeeper_recovery_cycles",
            "Recovery cycles started (the whole chain was exhausted; the turn parks)",
            registry=r)

    def _declare_tools(self, r: CollectorRegistry) -> None:
        """Tool calls and their retries, tokens and cost charged, guards' notes."""
        self.tool_calls = Counter(
            "turnkeeper_tool_calls",
            "Tool calls by tool and outcome (ok, a failure class, or outcome_unknown)",
            ["tool", "outcome"], registry=r)
        self.tool_outcomes_unknown = Counter(
            "turnkeeper_tool_outcomes_unknown",
            "Non-idempotent tool calls whose effect may have happened with no answer to "
            "say so (never retried; each is an open issue of its turn)",
            ["tool"], registry=r)
        self.tool_retries = Counter(
            "turnkeeper_tool_retries_scheduled", "Idempotent tool call retries scheduled",
            ["tool", "class"], registry=r)
        self.tokens = Counter(
            "turnkeeper_tokens", "Tokens charged to turns, by provider and direction",
            ["provider", "direction"], registry=r)
        self.cost = Counter(
            "turnkeeper_cost_usd", "Priced usage charged to turns, in US dollars",
            ["provider"], registry=r)
        self.guard_warnings = Counter(
            "turnkeeper_guard_warnings", "Notes given to the agent by a guard "
            "(budget soft limit, repeated action)", ["guard"], registry=r)

    def _declare_daemon(self, r: CollectorRegistry) -> None:
        """Reloads, steps, approvals and the event loop."""
        self.reloads = Counter(
            "turnkeeper_reloads", "Reloads by result (ok, unchanged, failed)", ["result"],
            registry=r)
        self.reload_duration = Histogram(
            "turnkeeper_reload_duration_seconds",
            "Duration of successful reloads, drain included",
            buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0), registry=r)
        self.step_duration = Histogram(
            "turnkeeper_step_duration_seconds",
            "Wall time of a step: model call(s), retries and tools, until the next step "
            "or the end of the turn",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                     300.0), registry=r)
        self.tool_approvals = Counter(
            "turnkeeper_tool_approvals",
            "Decisions on tool calls held for approval, by tool, decision (approve, deny) "
            "and who decided (operator, timeout)", ["tool", "decision", "by"], registry=r)
        self.approval_wait = Histogram(
            "turnkeeper_approval_wait_seconds",
            "Time a tool call held for approval waited for its decision",
            buckets=(1.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 14400.0,
                     43200.0, 86400.0, 259200.0), registry=r)
        self.loop_lag = Gauge(
            "turnkeeper_event_loop_lag_seconds",
            f"How late the last {LAG_INTERVAL_S:g} s sleep on the event loop woke up",
            registry=r)
        self.loop_lag_observed = Histogram(
            "turnkeeper_event_loop_lag_observed_seconds",
            "Every event-loop lag measurement",
            buckets=LAG_BUCKETS_S, registry=r)
        self.loop_held = Counter(
            "turnkeeper_loop_held",
            "Steps held for a later turn of the event loop because that turn's share for "
            "turn work was spent (a step may be held more than once)", registry=r)
        self.loop_waiting = Gauge(
            "turnkeeper_loop_waiting",
            "Steps waiting for a share of the event loop, at the last lag measurement",
            registry=r)
        self.overloaded = Gauge(
            "turnkeeper_overloaded",
            "1 while new submits are refused because the event loop's lag is over "
            "daemon.overload_lag, else 0", registry=r)

    def __repr__(self) -> str:
        return f"Metrics(open_steps={len(self._steps)})"

    def _label_providers(self) -> None:
        for p in self.supervisor.config.providers:
            self.provider_requests.labels(p.name)
            for cls in ATTEMPT_CLASSES:
                self.provider_attempts.labels(p.name, cls)

    def _inc(self, metric: Any, *values: str, amount: float = 1.0) -> None:
        """Count `amount` on `metric`'s `values` series, added at the next `flush`."""
        if amount < 0:
            raise ValueError(f"a counter only goes up (got {amount})")
        key = (metric, values)
        pending = self._pending
        pending[key] = pending.get(key, 0.0) + amount

    def flush(self) -> None:
        """Add the pending counts to their counters (every collection does it first)."""
        pending, self._pending = self._pending, {}
        for (metric, values), amount in pending.items():
            try:
                (metric.labels(*values) if values else metric).inc(amount)
            except Exception as exc:  # a scrape must not fail over one series
                if self._errors_logged < 10:
                    self._errors_logged += 1
                    log.error("metrics.count_failed", metric=repr(metric), labels=values,
                              error=f"{type(exc).__name__}: {exc}")

    # -- events in -----------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        """The EventBus listener. Never raises: a metrics bug must not touch a turn."""
        try:
            self._count(event)
        except Exception as exc:
            if self._errors_logged < 10:
                self._errors_logged += 1
                log.error("metrics.event_failed", event_type=event.type,
                          error=f"{type(exc).__name__}: {exc}")

    def _count(self, event: Event) -> None:
        # Looked up before the body is read: streamed text, the most frequent event,
        # counts nothing and is not worth parsing.
        handler = _HANDLERS.get(event.type)
        if handler is None:
            return
        body = event.typed or event.body
        if body is not None:
            handler(self, body, event.turn)

    def _model_request(self, e: ev.ModelRequest, turn: str | None) -> None:
        self._inc(self.provider_requests, e.provider)

    def _model_response(self, e: ev.ModelResponse, turn: str | None) -> None:
        self._inc(self.provider_attempts, e.provider, "success")
        usage = e.usage or {}
        self._inc(self.tokens, e.provider, "input", amount=usage.get("input_tokens", 0))
        self._inc(self.tokens, e.provider, "output", amount=usage.get("output_tokens", 0))
        cost = e.cost_usd or 0.0
        if cost > 0:
            self._inc(self.cost, e.provider, amount=cost)

    def _attempt_ended(self, e: ev.ModelAttemptFailed | ev.ModelRedirected,
                       turn: str | None) -> None:
        self._inc(self.provider_attempts, e.provider,
                  e.class_ if isinstance(e, ev.ModelAttemptFailed) else "redirected")

    def _retry_scheduled(self, e: ev.ModelRetryScheduled, turn: str | None) -> None:
        self._inc(self.retries_scheduled, e.provider, e.class_)

    def _failover(self, e: ev.ModelFailover, turn: str | None) -> None:
        self._inc(self.failovers, e.from_, e.to, e.reason)

    def _recovering(self, e: ev.TurnRecovering, turn: str | None) -> None:
        self._inc(self.recovery_cycles)

    def _tool_result(self, e: ev.ToolResult, turn: str | None) -> None:
        outcome = "ok" if e.ok else ("outcome_unknown" if e.ok is None
                                     else str(e.class_ or "unknown"))
        self._inc(self.tool_calls, self._tool_label(e.tool), outcome)

    def _outcome_unknown(self, e: ev.ToolOutcomeUnknown, turn: str | None) -> None:
        self._inc(self.tool_outcomes_unknown, self._tool_label(e.tool))

    def _tool_retry(self, e: ev.ToolRetryScheduled, turn: str | None) -> None:
        self._inc(self.tool_retries, self._tool_label(e.tool), e.class_)

    def _approval_decided(self, e: ev.ToolApprovalDecided, turn: str | None) -> None:
        self._inc(self.tool_approvals, self._tool_label(e.tool), e.decision, e.by)
        self.approval_wait.observe(max(0.0, float(e.waited_s)))

    def _guard_warning(self, e: ev.BudgetWarning | ev.LoopWarning, turn: str | None) -> None:
        self._inc(self.guard_warnings, "budget" if isinstance(e, ev.BudgetWarning) else "loop")

    def _step(self, e: ev.StepStarted, turn: str | None) -> None:
        if turn is not None:
            self._step_started(turn, int(e.step or 0))

    def _suspended(self, e: ev.TurnSuspended, turn: str | None) -> None:
        if turn is not None:
            self._step_ended(turn)

    def _finished(self, e: ev.TurnFinished, turn: str | None) -> None:
        if turn is not None:
            self._step_ended(turn)
            stop = e.result["stopped_because"]
            self._inc(self.turns_finished, e.result["status"], stop["code"])

    def _resumed(self, e: ev.TurnResumed, turn: str | None) -> None:
        # Its last step was cut by a suspend or a restart: wall time that includes the
        # daemon being down is not a step duration.
        if turn is not None:
            self._steps.pop(turn, None)

    def _queued(self, e: ev.TurnQueued, turn: str | None) -> None:
        self._inc(self.turns_submitted)

    def _reloaded(self, e: ev.DaemonReloaded, turn: str | None) -> None:
        self._inc(self.reloads, "unchanged" if e.unchanged else "ok")
        self.reload_duration.observe(float(e.duration_s or 0.0))
        self._label_providers()

    def _reload_failed(self, e: ev.DaemonReloadFailed, turn: str | None) -> None:
        self._inc(self.reloads, "failed")

    def _tool_label(self, name: str) -> str:
        return name if self.supervisor.runtime.toolbox.get(name) is not None else UNKNOWN_TOOL

    def _step_started(self, turn: str, step: int) -> None:
        now = self.clock.monotonic()
        current = self._steps.get(turn)
        if current is not None:
            if current[0] == step:
                return  # the same step started over (a redirect, a rebuild): one step
            self.step_duration.observe(max(0.0, now - current[1]))
        self._steps[turn] = (step, now)

    def _step_ended(self, turn: str) -> None:
        current = self._steps.pop(turn, None)
        if current is not None:
            self.step_duration.observe(max(0.0, self.clock.monotonic() - current[1]))

    # -- event-loop lag ------------------------------------------------------------

    async def watch_loop_lag(self, interval_s: float = LAG_INTERVAL_S) -> None:
        """Forever: sleep `interval_s` on the loop and record how late the wake-up was
        (and the steps held for the event loop's share: `runtime.LoopGate`).
        Each sample also feeds the intake's overload guard, which refuses new submits
        while the lag stays high, and the stall watch (`policy/stall.py`): a wake-up
        seconds late means the process did not run, and calls that failed across that
        time count against no peer."""
        intake = self.supervisor.intake
        stalls = self.supervisor.shared.stalls
        gate = self.supervisor.shared.loop_gate
        held = gate.held
        while True:
            start = self.clock.monotonic()
            stalled = stalls.tick(start, tick_s=interval_s)
            if stalled is not None:  # stopped, swapped out or blocked: not the peers' fault
                log.warning("daemon.stalled", seconds=round(stalled, 3))
            await anyio.sleep(interval_s)
            lag = max(0.0, self.clock.monotonic() - start - interval_s)
            self.loop_lag.set(lag)
            self.loop_lag_observed.observe(lag)
            intake.observe_loop_lag(lag)
            self.overloaded.set(1 if intake.overload.shedding else 0)
            if gate.held != held:
                self.loop_held.inc(gate.held - held)
                held = gate.held
            self.loop_waiting.set(gate.waiting)

    # -- exposition ----------------------------------------------------------------

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition the scraper asked for (Prometheus text by default,
        OpenMetrics when its Accept header says so) and its content type."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    async def handle(self, request: web.Request) -> web.Response:
        body, content_type = self.render(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type,
                                                "Cache-Control": "no-store"})

    def install(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self.handle)

    async def serve_tcp(self, host: str, port: int) -> web.AppRunner:
        """`/metrics` alone on a TCP address (no other route). Returns the runner to clean
        up at stop. Raises OSError when the address cannot be bound."""
        app = web.Application()
        self.install(app)
        runner = web.AppRunner(app, handle_signals=False, access_log=None,
                               shutdown_timeout=2.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except BaseException:
            await runner.cleanup()
            raise
        log.info("metrics.listening", address=f"{host}:{port}")
        return runner


class _Pending:
    """A collector that yields nothing (and so describes nothing): collected first, it
    adds the pending counts to their counters before the registry reads them."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> list[Any]:
        self._metrics.flush()
        return []


# What each event type counts, by its wire type; a type not listed counts nothing.
_BY_CLASS: dict[type[ev.EventBody], Callable[[Metrics, Any, str | None], None]] = {
    ev.ModelRequest: Metrics._model_request,
    ev.ModelResponse: Metrics._model_response,
    ev.ModelAttemptFailed: Metrics._attempt_ended,
    ev.ModelRedirected: Metrics._attempt_ended,
    ev.ModelRetryScheduled: Metrics._retry_scheduled,
    ev.ModelFailover: Metrics._failover,
    ev.TurnRecovering: Metrics._recovering,
    ev.ToolResult: Metrics._tool_result,
    ev.ToolRetryScheduled: Metrics._tool_retry,
    ev.ToolOutcomeUnknown: Metrics._outcome_unknown,
    ev.ToolApprovalDecided: Metrics._approval_decided,
    ev.BudgetWarning: Metrics._guard_warning,
    ev.LoopWarning: Metrics._guard_warning,
    ev.StepStarted: Metrics._step,
    ev.TurnSuspended: Metrics._suspended,
    ev.TurnFinished: Metrics._finished,
    ev.TurnResumed: Metrics._resumed,
    ev.TurnQueued: Metrics._queued,
    ev.DaemonReloaded: Metrics._reloaded,
    ev.DaemonReloadFailed: Metrics._reload_failed,
}
_HANDLERS = {cls.TYPE: handler for cls, handler in _BY_CLASS.items()}
