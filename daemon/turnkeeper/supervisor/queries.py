"""Queries room: reads of turns, the daemon's status and the limits report. Nothing here
changes a turn; a live turn is answered from memory, fresher than its last checkpoint."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio

from turnkeeper import __version__
from turnkeeper.config import BUILTIN_TOOL_NAMES
from turnkeeper.policy import limits
from turnkeeper.policy.store_outage import StoreOutage
from turnkeeper.policy.turn_state import LIVE_STATES
from turnkeeper.providers.prices import prices_status
from turnkeeper.supervisor.core import SupervisorCore
from turnkeeper.supervisor.errors import UnknownProfile, UnknownTurn
from turnkeeper.supervisor.fleet import Fleet
from turnkeeper.supervisor.webhooks import Webhooks

FLEET_WAIT_POLL_S = 0.25


class Queries:
    def __init__(self, core: SupervisorCore, *, fleet: Fleet | None,
                 webhooks: Webhooks) -> None:
        self.core = core
        self.fleet = fleet  # on a shared store: turns other nodes run, the fleet's status
        self.webhooks = webhooks

    async def get_turn(self, turn_id: str) -> dict[str, Any]:
        core = self.core
        live = core.live.get(turn_id)
        if live is not None:
            return live.record.to_json()
        data = await core.store.get_turn(turn_id)
        if data is None:
            raise UnknownTurn(turn_id)
        return data

    async def wait_turn(self, turn_id: str, timeout_s: float) -> dict[str, Any]:
        """The turn once it is terminal, or after `timeout_s`, or as the daemon stops (a
        long poll must not hold the shutdown up)."""
        core = self.core
        live = core.live.get(turn_id)
        if live is None and self.fleet is not None:
            return await self._wait_in_fleet(turn_id, timeout_s)
        if live is not None:
            with core.clock.move_on_after(timeout_s):
                async with anyio.create_task_group() as tg:
                    async def until(event: anyio.Event | asyncio.Event) -> None:
                        await event.wait()
                        tg.cancel_scope.cancel()

                    tg.start_soon(until, live.done)
                    tg.start_soon(until, core.stopping_event)
        return await self.get_turn(turn_id)

    async def _wait_in_fleet(self, turn_id: str, timeout_s: float) -> dict[str, Any]:
        """A turn another node runs (or none yet): its stored row, read again every
        quarter second until it has a result, the time is up or the daemon stops."""
        core = self.core
        data = await self.get_turn(turn_id)
        with core.clock.move_on_after(timeout_s):
            while data.get("result") is None and not core.stopping_event.is_set():
                await core.clock.sleep(FLEET_WAIT_POLL_S)
                data = await self.get_turn(turn_id)
        return data

    async def list_turns(self, *, state: str | None, session: str | None, limit: int,
                         since_s: float | None = None, before_seq: int | None = None
                         ) -> list[dict[str, Any]]:
        """Newest first, submitted in the last `since_s` seconds, numbered below
        `before_seq` (a page's cursor). Every unfinished turn is in memory (resumed at
        start), so a filter on a live state reads no store; otherwise the store's rows,
        each replaced by the live record while the turn runs (fresher than its last
        checkpoint)."""
        core = self.core
        since = None if since_s is None else core.clock.time() - since_s
        if state in LIVE_STATES:
            return [r.to_json() for r in core.live.newest_in(
                state, limit, session=session, since=since, before_seq=before_seq)]
        rows = await core.store.list_turns(state=state, session=session, limit=limit,
                                           since=since, before_seq=before_seq)
        return [core.live[r["id"]].record.to_json() if r["id"] in core.live else r
                for r in rows]

    async def limits_report(self, *, profile: str | None, since_s: float | None,
                            factor: float) -> dict[str, Any]:
        """What finished turns used, per profile, against the current limits."""
        core = self.core
        since = None if since_s is None else core.clock.time() - since_s
        usage = await core.store.finished_usage(since=since)
        known = {"default", *core.config.budget.profiles, *(t.profile for t in usage)}
        if profile is not None and profile not in known:
            # A typo must not read as "no data yet": name what there is.
            raise UnknownProfile(f"profile: no budget profile {profile!r} (known: "
                                 f"{', '.join(sorted(known))})")
        current: dict[str, dict[str, float]] = {}
        for name in ("default", *core.config.budget.profiles):
            b = core.config.guards(None if name == "default" else name).budget
            current[name] = {"max_tokens": b.max_tokens, "max_seconds": b.max_seconds,
                             "max_steps": b.max_steps, "max_cost_usd": b.max_cost_usd}
        # Tens of thousands of turns take the loop a second or more: off it, in a thread.
        reports = await anyio.to_thread.run_sync(_report, usage, profile, current, factor)
        return {"factor": factor, "since": since, "turns": sum(r.finished for r in reports),
                "profiles": [r.to_json() for r in reports],
                "toml": "\n\n".join(r.toml() for r in reports if r.completed),
                "sessions": {"max_history_tokens":
                             core.config.sessions.max_history_tokens}}

    def turn_counts(self) -> dict[str, int]:
        """Unfinished turns by state: kept as they move, not counted per request."""
        return self.core.live.counts()

    def status(self) -> dict[str, Any]:
        core = self.core
        now = core.clock.monotonic()
        return {
            "state": core.state,
            "paused": core.scheduler.paused,
            "policy_version": core.policy.version,
            "config_path": core.config_path,
            "pending_restart": list(core.pending_restart),
            "last_reload_error": core.last_reload_error,
            "turns": self.turn_counts(),
            "queue": {"depth": len(core.queue),
                      "max": core.config.daemon.max_queued_turns,
                      "max_concurrent": core.config.daemon.max_concurrent_turns},
            "breakers": self._breakers(now),
            "retry_after": {name.split(":", 1)[1] if name.startswith("provider:") else name:
                            round(left, 3)
                            for name, left in core.shared.retry_after.windows(now).items()},
            "in_flight": core.shared.gates.snapshot(),
            "reloads": {"count": core.reload_count, "failures": core.reload_failures,
                        "unchanged": core.reload_unchanged},
            "followers": core.bus.followers(),
            "mcp_servers": core.runtime.toolbox.server_status(),
            "agents": self.agents(),
            "store": store_status(core.store.outage, now=now),
            "prices": prices_status(core.runtime.config),
            "fleet": self.fleet.status() if self.fleet is not None else None,
            "webhooks": self.webhooks.status(core.clock.time()),
            "uptime_s": round(now - core.started_at, 3),
            "version": __version__,
        }

    def _breakers(self, now: float) -> dict[str, str]:
        return {name.split(":", 1)[1] if name.startswith("provider:") else name:
                b.state(now).value for name, b in self.core.shared.breakers.items()}

    def agents(self) -> dict[str, dict[str, Any]]:
        """Each named agent: how many tools it is offered now (built-ins aside; an MCP
        server's count while it is up), its model and its budget profile."""
        runtime = self.core.runtime
        return {name: {"tools": sum(1 for s in runtime.toolbox.specs_for(agent.tools)
                                    if s.name not in BUILTIN_TOOL_NAMES),
                       "model": agent.model, "profile": agent.profile}
                for name, agent in runtime.settings.agents.items()}

    def health(self) -> dict[str, Any]:
        """Ready, or degraded with every reason: see `health_problems`. Read from the
        parts of the status it looks at, not the whole status (agents, prices,
        webhooks, the fleet) built and dropped for each check."""
        core = self.core
        now = core.clock.monotonic()
        problems = health_problems({
            "state": core.state, "paused": core.scheduler.paused,
            "breakers": self._breakers(now),
            "mcp_servers": core.runtime.toolbox.server_status(),
            "store": store_status(core.store.outage, now=now),
            "last_reload_error": core.last_reload_error})
        return {"status": "degraded" if problems else "ok", "problems": problems}


def store_status(outage: StoreOutage, *, now: float) -> dict[str, Any]:
    return {"writable": not outage.degraded,
            "failing_for_s": round(outage.failing_for(now=now), 3),
            "last_error": outage.last_error, "fatal_after_s": outage.fatal_after_s}


def health_problems(status: dict[str, Any]) -> list[str]:
    """What keeps the daemon from being fully ready, read from its status: not ready
    (starting, reloading, stopping), paused by an operator, a breaker not closed, an MCP
    server not up, a store that cannot be written, or the last reload refused (the daemon
    runs an older policy than the file). Empty when all is well. A check for
    `status --check` and a load balancer."""
    out = []
    if status["state"] != "ready":
        out.append(f"state {status['state']}")
    if status.get("paused"):
        out.append("paused: queued turns do not start (turnkeeper resume)")
    for name, state in (status.get("breakers") or {}).items():
        if state != "closed":
            out.append(f"breaker {name} {state}")
    for name, srv in (status.get("mcp_servers") or {}).items():
        if srv.get("state") != "up":
            out.append(f"mcp server {name} {srv.get('state')}")
    store = status.get("store") or {}
    if store.get("writable") is False:
        out.append(f"store unwritable for {store.get('failing_for_s')} s: "
                   f"{store.get('last_error')}")
    if status.get("last_reload_error"):
        # The whole reason on one line: the head alone ends at a colon, before the key.
        head, *rest = str(status["last_reload_error"]).splitlines() or [""]
        reasons = ", ".join(line.strip() for line in rest if line.strip())
        out.append(f"last reload failed: {head}" + (f" {reasons}" if reasons else ""))
    return out


def _report(usage: list[limits.FinishedTurn], profile: str | None,
            current: dict[str, dict[str, float]], factor: float
            ) -> list[limits.ProfileReport]:
    if profile is not None:
        usage = [t for t in usage if t.profile == profile]
    return limits.report(usage, limits=current, factor=factor)
