"""The metrics read at scrape time: turns by state, the queue, breakers, in-flight
gates, MCP servers, webhooks and the policy, from the supervisor and the shared breakers. Derived,
never stored twice: nothing here counts; `metrics.py` holds the counters and serves."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from turnkeeper import __version__
from turnkeeper.clock import Clock
from turnkeeper.policy.breaker import BreakerState
from turnkeeper.policy.daemon_state import DaemonState
from turnkeeper.supervisor import Supervisor
from turnkeeper.turn.record import LIVE_STATES

DAEMON_STATES = tuple(DaemonState)


class StateCollector(Collector):
    """Read at scrape time from the supervisor and the shared breakers."""

    def __init__(self, supervisor: Supervisor, clock: Clock) -> None:
        self.supervisor = supervisor
        self.clock = clock

    def describe(self) -> list[Metric]:
        return []  # dynamic: no names reserved in the registry

    def collect(self) -> Iterator[Metric]:
        sup = self.supervisor
        info = InfoMetricFamily("turnkeeper", "The daemon's version")
        info.add_metric([], {"version": __version__})
        yield info
        state = GaugeMetricFamily("turnkeeper_daemon_state",
                                  "1 for the daemon's current state", labels=["state"])
        for daemon_state in DAEMON_STATES:
            state.add_metric([daemon_state], 1.0 if sup.state is daemon_state else 0.0)
        yield state
        yield GaugeMetricFamily("turnkeeper_policy_version",
                                "Version of the running policy", value=sup.policy.version)
        yield GaugeMetricFamily("turnkeeper_last_reload_failed",
                                "1 when the last reload was refused (the running policy "
                                "is older than the config file)",
                                value=1.0 if sup.last_reload_error else 0.0)
        yield from self._turns()
        yield from self._store()
        yield from self._breakers()
        yield from self._in_flight()
        yield from self._mcp_servers()
        yield from self._webhooks()
        yield from self._event_streams()

    def _turns(self) -> Iterator[Metric]:
        """Unfinished turns, held approvals, the queue and the slots."""
        sup = self.supervisor
        turns = GaugeMetricFamily("turnkeeper_turns", "Unfinished turns by state",
                                  labels=["state"])
        counts = sup.turn_counts()
        for name in LIVE_STATES:
            turns.add_metric([name], counts.get(name, 0))
        yield turns
        yield GaugeMetricFamily("turnkeeper_approvals_pending",
                                "Tool calls this node's turns hold for a person's approval "
                                "(turnkeeper approvals)",
                                value=sum(len(t.record.pending_approvals)
                                          for t in sup.live.values()))
        yield GaugeMetricFamily("turnkeeper_queue_depth", "Turns waiting to start (FIFO)",
                                value=len(sup.queue))
        yield GaugeMetricFamily("turnkeeper_queue_capacity", "daemon.max_queued_turns",
                                value=sup.config.daemon.max_queued_turns)
        yield GaugeMetricFamily("turnkeeper_turns_in_flight",
                                "Turns holding a slot of max_concurrent_turns now (parked "
                                "turns, waiting or recovering, give theirs back)",
                                value=sup.active)
        yield GaugeMetricFamily("turnkeeper_turns_in_flight_limit",
                                "daemon.max_concurrent_turns",
                                value=sup.config.daemon.max_concurrent_turns)

    def _store(self) -> Iterator[Metric]:
        """Whether the store takes writes, and for how long it has not."""
        sup = self.supervisor
        outage = sup.store.outage
        yield GaugeMetricFamily("turnkeeper_store_writable",
                                "1 while the store takes writes; 0 while they wait (a full "
                                "disk, an unreachable database) and submits get 507",
                                value=0.0 if outage.degraded else 1.0)
        yield GaugeMetricFamily("turnkeeper_store_failing_seconds",
                                "How long the store has failed every write (0 when it "
                                "takes them); the daemon exits 74 at store.fatal_after",
                                value=outage.failing_for(now=self.clock.monotonic()))

    def _event_streams(self) -> Iterator[Metric]:
        """The live event streams, what they hold, and the listeners' errors."""
        sup = self.supervisor
        followers = sup.bus.followers()
        yield GaugeMetricFamily("turnkeeper_event_followers", "Live event streams open",
                                value=followers["open"])
        yield GaugeMetricFamily("turnkeeper_event_follower_backlog_bytes",
                                "Bytes held for live event streams (events waiting, "
                                "their sockets' unsent bytes)",
                                value=followers["backlog_bytes"])
        yield CounterMetricFamily("turnkeeper_event_subscribers_dropped",
                                  "Event stream subscribers dropped for falling behind",
                                  value=sup.bus.dropped_subscribers)
        yield CounterMetricFamily("turnkeeper_event_listener_errors",
                                  "Errors raised by in-process event listeners",
                                  value=sup.bus.listener_errors)

    def _mcp_servers(self) -> Iterator[Metric]:
        servers = self.supervisor.runtime.toolbox.server_status()
        up = GaugeMetricFamily("turnkeeper_mcp_server_up",
                               "1 while an MCP server is connected and its tools offered",
                               labels=["server"])
        tools = GaugeMetricFamily("turnkeeper_mcp_server_tools",
                                  "Tools an MCP server offers now", labels=["server"])
        restarts = CounterMetricFamily("turnkeeper_mcp_server_restarts",
                                       "Times the daemon restarted an MCP server",
                                       labels=["server"])
        for name, status in sorted(servers.items()):
            is_up = status["state"] == "up"
            up.add_metric([name], 1.0 if is_up else 0.0)
            tools.add_metric([name], len(status["tools"]) if is_up else 0)
            restarts.add_metric([name], status["restarts"])
        yield up
        yield tools
        yield restarts

    def _webhooks(self) -> Iterator[Metric]:
        hooks = self.supervisor.webhooks
        deliveries = CounterMetricFamily(
            "turnkeeper_webhook_deliveries",
            "Webhook delivery attempts by outcome: delivered (a 2xx), retried (a 408, 429, "
            "5xx or no answer, tried again later), failed (given up), dropped (given up "
            "unsent: the outbox was full)", labels=["webhook", "outcome"])
        for (name, outcome), count in sorted(hooks.deliveries.items()):
            deliveries.add_metric([name, outcome], count)
        yield deliveries
        pending = GaugeMetricFamily("turnkeeper_webhook_pending",
                                    "Webhook deliveries waiting in the outbox",
                                    labels=["webhook"])
        oldest = GaugeMetricFamily("turnkeeper_webhook_oldest_pending_seconds",
                                   "Age of the oldest webhook delivery waiting",
                                   labels=["webhook"])
        for name, entry in hooks.status(self.clock.time()).items():
            pending.add_metric([name], entry["pending"])
            oldest.add_metric([name], entry["oldest_pending_age_s"] or 0.0)
        yield pending
        yield oldest

    def _in_flight(self) -> Iterator[Metric]:
        limit = GaugeMetricFamily("turnkeeper_provider_in_flight_limit",
                                  "Model calls each provider may have in flight now (its "
                                  "max_in_flight, or the adaptive limit)",
                                  labels=["provider"])
        in_flight = GaugeMetricFamily("turnkeeper_provider_in_flight",
                                      "Model calls in flight against each provider",
                                      labels=["provider"])
        waiting = GaugeMetricFamily("turnkeeper_provider_in_flight_waiting",
                                    "Model calls waiting for an in-flight slot",
                                    labels=["provider"])
        cuts = CounterMetricFamily("turnkeeper_provider_in_flight_decreases",
                                   "Times the adaptive limit was cut after a 429, 529 or "
                                   "Retry-After", labels=["provider"])
        for name, gate in sorted(self.supervisor.shared.gates.gates.items()):
            snap = gate.limit.snapshot()
            if snap["limit"] is not None:
                limit.add_metric([name], snap["limit"])
            in_flight.add_metric([name], snap["in_flight"])
            waiting.add_metric([name], gate.waiting)
            cuts.add_metric([name], snap["decreases"])
        yield limit
        yield in_flight
        yield waiting
        yield cuts

    def _breakers(self) -> Iterator[Metric]:
        now = self.clock.monotonic()
        state = GaugeMetricFamily("turnkeeper_breaker_state",
                                  "1 for the current state of each circuit breaker",
                                  labels=["kind", "name", "state"])
        failures = GaugeMetricFamily("turnkeeper_breaker_consecutive_failures",
                                     "Consecutive retryable/unknown failures counted by "
                                     "each circuit breaker", labels=["kind", "name"])
        for key, breaker in sorted(self.supervisor.shared.breakers.items()):
            kind, _, name = key.partition(":")
            current = breaker.state(now)
            for s in BreakerState:
                state.add_metric([kind, name, s.value], 1.0 if current is s else 0.0)
            failures.add_metric([kind, name], breaker.consecutive_failures)
        yield state
        yield failures
