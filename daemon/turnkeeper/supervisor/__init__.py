"""The supervisor: one task group owns every turn. Intake, the FIFO queue, the in-flight
registry, drain, reload and stop all live here, and nowhere else.

`Supervisor` is the one object the rest of the daemon holds. Its state is the core
(`core.py`), which knows no room; its work is done by rooms, each with one job and each
handed the rooms it calls in `Supervisor.__init__`, which reads as the rooms' graph:
`scheduling` (slots, dispatch, running and finishing a turn, as `policy/scheduler.py`
decides), `intake` (submit, messages, cancel), `keyed` (Idempotency-Key submits),
`replays` (dead letters resumed), `queries` (turns, status, the limits report),
`retention` (pruning), `webhooks` (sending the outbox's deliveries), `lifecycle` (start,
reload, drain, stop) and, on a store several daemons share, `fleet` (claims, leases,
mail). The methods below only hand each call to its room.
"""

from __future__ import annotations

from typing import Any

from anyio.abc import TaskGroup

from turnkeeper.clock import Clock
from turnkeeper.config import PolicyVersion
from turnkeeper.lifecycle.systemd import Notifier
from turnkeeper.store.base import Store
from turnkeeper.store.fleet import FleetStore
from turnkeeper.supervisor.approvals import Approvals
from turnkeeper.supervisor.core import LiveTurn, SupervisorCore, new_turn_id
from turnkeeper.supervisor.errors import (
    BadArguments,
    BatchItemInvalid,
    IdempotencyConflict,
    InboxFull,
    IntakeRefused,
    NotPending,
    NotWaiting,
    TurnFinished,
    UnknownAgent,
    UnknownModel,
    UnknownProfile,
    UnknownTurn,
    UnpricedCostLimit,
)
from turnkeeper.supervisor.fleet import Fleet
from turnkeeper.supervisor.intake import Intake
from turnkeeper.supervisor.keyed import KeyedSubmits
from turnkeeper.supervisor.lifecycle import Lifecycle, ReloadOutcome
from turnkeeper.supervisor.queries import Queries
from turnkeeper.supervisor.replays import Replays
from turnkeeper.supervisor.retention import Retention
from turnkeeper.supervisor.scheduling import Scheduling
from turnkeeper.supervisor.webhooks import Webhooks
from turnkeeper.turn.record import TurnRecord

__all__ = ["BadArguments", "BatchItemInvalid", "IdempotencyConflict", "InboxFull",
           "IntakeRefused", "LiveTurn", "NotPending", "NotWaiting",
           "ReloadOutcome",
           "Supervisor", "TurnFinished", "UnknownAgent", "UnknownModel", "UnknownProfile",
           "UnknownTurn",
           "UnpricedCostLimit",
           "new_turn_id"]


class Supervisor(SupervisorCore):
    def __init__(self, *, policy: PolicyVersion, store: Store, clock: Clock, notifier: Notifier,
                 config_path: str | None) -> None:
        super().__init__(policy=policy, store=store, clock=clock, notifier=notifier,
                         config_path=config_path)
        # The rooms, each handed the rooms it calls (top to bottom: what it needs is
        # built above it). On a store several daemons share, the fleet claims turns and
        # carries mail; it calls back into the two rooms built after it.
        self.fleet = Fleet(self, store) if isinstance(store, FleetStore) else None
        self.scheduling = Scheduling(self, fleet=self.fleet)
        self.intake = Intake(self, scheduling=self.scheduling, fleet=self.fleet)
        if self.fleet is not None:
            self.fleet.connect(dispatch=self.scheduling.dispatch, intake=self.intake)
        self.keyed = KeyedSubmits(self, self.intake)
        self.replays = Replays(self, self.intake, scheduling=self.scheduling,
                               fleet=self.fleet)
        self.retention = Retention(self)
        self.webhooks = Webhooks(self)
        self.approvals = Approvals(self, intake=self.intake, fleet=self.fleet)
        self.queries = Queries(self, fleet=self.fleet, webhooks=self.webhooks)
        self.lifecycle = Lifecycle(self, scheduling=self.scheduling,
                                   retention=self.retention, webhooks=self.webhooks,
                                   fleet=self.fleet)

    # -- lifecycle --------------------------------------------------------------------

    async def start(self, tg: TaskGroup) -> None:
        await self.lifecycle.start(tg)

    async def wait_started(self) -> None:
        await self.lifecycle.wait_started()

    async def reload(self, trigger: str, *, unless_hash: str | None = None) -> ReloadOutcome:
        return await self.lifecycle.reload(trigger, unless_hash=unless_hash)

    def request_stop(self) -> None:
        self.lifecycle.request_stop()

    async def wait_stop_requested(self) -> None:
        await self.lifecycle.wait_stop_requested()

    async def stop(self) -> None:
        await self.lifecycle.stop()

    # -- intake -----------------------------------------------------------------------

    async def submit(self, *, message: str, session: str | None, budget: dict[str, Any],
                     deadline: float | None, replay_of: str | None = None,
                     profile: str | None = None, model: str | None = None,
                     agent: str | None = None,
                     output_schema: dict[str, Any] | None = None) -> TurnRecord:
        return await self.intake.submit(message=message, session=session, budget=budget,
                                        deadline=deadline, replay_of=replay_of,
                                        profile=profile, model=model, agent=agent,
                                        output_schema=output_schema)

    async def post_message(self, turn_id: str, *, kind: str, text: str,
                           redirect: bool) -> dict[str, Any]:
        return await self.intake.post_message(turn_id, kind=kind, text=text,
                                              redirect=redirect)

    async def cancel(self, turn_id: str, *, now: bool = False) -> dict[str, Any]:
        return await self.intake.cancel(turn_id, now=now)

    async def replay(self, turn_id: str) -> TurnRecord:
        return await self.replays.replay(turn_id)

    async def prune(self, *, older_than_s: float, dead_letters: bool = False) -> int:
        return await self.retention.prune(older_than_s=older_than_s,
                                          dead_letters=dead_letters)

    # -- queries ----------------------------------------------------------------------

    async def get_turn(self, turn_id: str) -> dict[str, Any]:
        return await self.queries.get_turn(turn_id)

    async def wait_turn(self, turn_id: str, timeout_s: float) -> dict[str, Any]:
        return await self.queries.wait_turn(turn_id, timeout_s)

    async def list_turns(self, *, state: str | None, session: str | None, limit: int,
                         since_s: float | None = None, before_seq: int | None = None
                         ) -> list[dict[str, Any]]:
        return await self.queries.list_turns(state=state, session=session, limit=limit,
                                             since_s=since_s, before_seq=before_seq)

    async def limits_report(self, *, profile: str | None, since_s: float | None,
                            factor: float) -> dict[str, Any]:
        return await self.queries.limits_report(profile=profile, since_s=since_s,
                                                factor=factor)

    def turn_counts(self) -> dict[str, int]:
        return self.queries.turn_counts()

    def status(self) -> dict[str, Any]:
        return self.queries.status()
