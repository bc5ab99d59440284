"""Fleet room: several daemons share the turns of one PostgreSQL store.

A node runs only the turns it claimed. The claim loop takes runnable turns up to the
node's free slots (oldest first; the store keeps a session's turns in order across the
fleet) when a turn is submitted here or another node announces some (NOTIFY), when a
slot frees while more may be waiting, and every second when the fleet's queue holds
any (`policy/claims.py`), so a turn submitted on another node, handed back by one or
left by a dead one is picked up within a second. Each
claim is a lease the heartbeat renews every third of `lease_seconds`. When renewals fail
for too long (`policy/lease.py` says when, a margin before the lease can expire at the
database), the lease has lapsed: the node's turns go on, but a non-idempotent call waits
(neither sent nor failed) until a renewal confirms the lease, and the heartbeat keeps
trying. A renewal re-takes every claim whose epoch is still the turn's (no other node
claimed it meanwhile); the turns the database reports held by another node are
abandoned: the node writes nothing more for them and sends no call; the store refuses
any write that still comes (StaleLease). A clean stop suspends the running turns as a
reload would and hands every held turn back at once; a node that dies loses its turns
when their leases expire, and the node that claims one resumes it from its last
checkpoint with the crash rules (an idempotent call sent again with its key, a
non-idempotent one in flight reported as outcome unknown, never sent again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import structlog

from turnkeeper.policy.claims import ClaimPacer
from turnkeeper.policy.daemon_state import DaemonState
from turnkeeper.policy.lease import Lease, LeaseTiming
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.store.base import StoreError
from turnkeeper.store.fleet import (
    CHANNEL_BREAKERS,
    CHANNEL_MAIL,
    CHANNEL_RETRY_AFTER,
    FleetStore,
    StaleLease,
)
from turnkeeper.supervisor.core import LiveTurn, SupervisorCore
from turnkeeper.supervisor.fleet_breakers import FleetBreakers
from turnkeeper.supervisor.fleet_mail import FleetMail, Recipient
from turnkeeper.supervisor.fleet_waits import FleetWaits
from turnkeeper.turn.record import TurnRecord

log = structlog.get_logger("turnkeeper.fleet")

CLAIM_EVERY_S = 1.0


def _not_connected() -> None:
    raise RuntimeError("a fleet used before Fleet.connect()")


class Fleet:
    def __init__(self, core: SupervisorCore, store: FleetStore) -> None:
        self.core = core
        self.store = store
        self._dispatch: Callable[[], None] = _not_connected
        self.timing = LeaseTiming(store.lease_s)
        self._wake = anyio.Event()
        self._claim_lock = anyio.Lock()
        self.pacer = ClaimPacer()
        self._stopping = False
        self._mail_due = False
        self.mail = FleetMail(core, store)
        self.breakers = FleetBreakers(core, store)
        self.waits = FleetWaits(core, store)
        self.lease = Lease.starting(self.timing, core.clock.monotonic())
        core.shared.stalls.lease(self.lease.valid_until, now=core.clock.monotonic())
        self._renewed = anyio.Event()  # set (and replaced) by each confirming renewal
        # The fleet's queue: turns no node holds, as read at the last claim tick, and the
        # turns submitted here since (`waiting`): the bound `max_queued_turns` is on it.
        self._backlog = 0
        self._submitted = 0
        self.claimed_total = 0
        self.lost_total = 0
        self.released_total = 0
        # The fleet as last read from the database (`store.nodes()`), refreshed at the
        # heartbeat's pace so `status` costs no query; None until the first read.
        self._nodes: list[dict[str, Any]] | None = None
        self._nodes_read_at = 0.0  # local monotonic

    def connect(self, *, dispatch: Callable[[], None], intake: Recipient) -> None:
        """The rooms the fleet calls, built after it (each also calls the fleet): the
        dispatch that starts claimed turns, the intake that applies mail to them."""
        self._dispatch = dispatch
        self.mail.intake = intake

    @property
    def node_id(self) -> str:
        return self.store.node_id

    def wake(self, *, submitted: int = 0) -> None:
        """Claim now: `submitted` turns were submitted here, or a slot was freed."""
        self._submitted += submitted
        if submitted:
            self.pacer.heard()
        self._wake.set()

    def waiting(self) -> int:
        """The turns the fleet holds unclaimed, as of the last claim tick (a second at
        most) plus those submitted here since: what a submit on this node is admitted
        against, so `max_queued_turns` bounds the fleet's queue, not each node's."""
        return self._backlog + self._submitted

    async def read_backlog(self) -> int | None:
        """The fleet's queue now (None: not read)."""
        try:
            backlog = await self.store.backlog()
        except StoreError as exc:  # the last figure stands until the next tick
            log.debug("fleet.backlog_read_failed", node=self.node_id, error=str(exc))
            return None
        self._backlog, self._submitted = backlog, 0
        return backlog

    def status(self) -> dict[str, Any]:
        """This node, and every node as last read (`nodes_read_s_ago`): a node's
        `heartbeat_age_s` is its silence as the database's clock measured it at that
        read, plus the time since by ours. Never our wall clock against the database's
        timestamp: a node whose clock is skewed would show every heartbeat as 0 s old."""
        now = self.core.clock.monotonic()
        nodes = None if self._nodes is None else [
            {**n, "heartbeat_age_s": round(
                max(0.0, n["silent_s"] + now - self._nodes_read_at), 3)}
            for n in self._nodes]
        # The last renewal (or first claim) was sent when the leases' validity began.
        renewed = self.lease.valid_until - self.timing.valid_until(0.0)
        return {"node_id": self.node_id, "lease_seconds": self.timing.lease_s,
                "lease_renewed_s_ago": round(max(0.0, now - renewed), 3),
                "lease_lapsed": self.lease.lapsed(now),
                "held": len(self.store.claims), "waiting": self.waiting(),
                "claimed": self.claimed_total,
                "lost": self.lost_total, "released": self.released_total,
                "nodes": nodes,
                "nodes_read_s_ago": None if nodes is None
                else round(now - self._nodes_read_at, 3)}

    async def run(self) -> None:
        self.core.shared.observe_breakers(self.breakers.changed)
        await self.breakers.read()  # a node that starts keeps open what the fleet holds open
        self.core.shared.retry_after.observer = self.waits.opened
        await self.waits.read()  # and waits out the Retry-After windows the fleet heard
        await self.read_backlog()  # a node that starts admits against the fleet's queue
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.breakers.run, lambda: self._stopping, name="fleet breakers")
            tg.start_soon(self.waits.run, lambda: self._stopping, name="fleet retry-after")
            tg.start_soon(self._claim_loop, name="fleet claims")
            tg.start_soon(self._heartbeat_loop, name="fleet heartbeat")
            tg.start_soon(self._listen_loop, name="fleet listener")
            tg.start_soon(self._nodes_loop, name="fleet nodes")

    async def read_nodes(self) -> None:
        """Read the fleet's nodes now (`turnkeeper fleet`), and keep them for `status`."""
        self._nodes = await self.store.nodes()
        self._nodes_read_at = self.core.clock.monotonic()

    async def _nodes_loop(self) -> None:
        """Read the nodes at start, then at the heartbeat's pace; a failed read keeps
        the last list (`nodes_read_s_ago` says how old it is)."""
        while not self._stopping:
            try:
                await self.read_nodes()
            except StoreError as exc:
                log.debug("fleet.nodes_read_failed", node=self.node_id, error=str(exc))
            await self.core.clock.sleep(self.timing.renew_every_s)

    # -- claims ---------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        core = self.core
        while not self._stopping:
            with core.clock.move_on_after(CLAIM_EVERY_S) as tick:
                await self._wake.wait()
            self._wake = anyio.Event()
            # Mail is looked for when NOTIFY announced some, and every tick (a NOTIFY
            # missed while the listener reconnected): not at each submit or freed slot.
            if not core.stopping and (tick.cancelled_caught or self._mail_due):
                self._mail_due = False
                await self.mail.deliver()
            if not core.stopping and (tick.cancelled_caught or self.breakers.due):
                await self.breakers.read()
            if not core.stopping and (tick.cancelled_caught or self.waits.due):
                await self.waits.read()
            backlog = None
            if tick.cancelled_caught:
                backlog = await self.read_backlog()
            if (core.state is not DaemonState.READY or not core.intake_open
                    or core.scheduler.paused):
                continue
            # Parked turns (waiting, recovering) give their slot back, as on one daemon.
            free = core.config.daemon.max_concurrent_turns - core.active - len(core.queue)
            limit = self.pacer.limit(free=free, ticked=tick.cancelled_caught,
                                     backlog=backlog)
            if limit > 0:
                await self.claim(limit)

    async def claim(self, limit: int) -> int:
        core = self.core
        async with self._claim_lock:
            if self._stopping:
                return 0
            sent_at = core.clock.monotonic()
            token = self.pacer.sent()
            try:
                claimed = await self.store.claim(limit)
            except StoreError as exc:
                log.warning("fleet.claim_failed", node=self.node_id, error=str(exc))
                return 0
            self.pacer.claimed(token=token, asked=limit, got=len(claimed))
            if claimed and not self.store.claims.keys() - {c.record["id"] for c in claimed}:
                # The only claims held are these: their leases count from now.
                self.lease.after_claim(sent_at)
                core.shared.stalls.lease(self.lease.valid_until, now=core.clock.monotonic())
            for c in claimed:
                record = TurnRecord.from_json(c.record)
                if record.state != TurnState.QUEUED:
                    record.policy_version = core.policy.version
                core.live[record.id] = LiveTurn(record=record, checkpoint=dict(c.checkpoint))
                core.scheduler.enqueue(record.id, record.session)
        if claimed:
            self.claimed_total += len(claimed)
            log.info("fleet.claimed", node=self.node_id, turns=len(claimed),
                     resumed=sum(1 for c in claimed if c.record.get("state") != "queued"))
            self._dispatch()
        return len(claimed)

    async def _listen_loop(self) -> None:
        """NOTIFY wakes the claim loop at once (a turn to claim, mail for a turn); when
        the listening connection is lost the loop's one-second tick still finds both."""
        while not self._stopping:
            try:
                await self.store.listen(self._heard)
            except StoreError as exc:
                log.debug("fleet.listen_lost", node=self.node_id, error=str(exc))
            await self.core.clock.sleep(CLAIM_EVERY_S)

    def _heard(self, channel: str, payload: str) -> None:
        if channel == CHANNEL_RETRY_AFTER:
            self.waits.heard(payload)
            if self.waits.due:
                self.wake()  # not applied at once: read the table at the next pass
            return
        if channel == CHANNEL_BREAKERS:
            if not self.breakers.heard(payload):
                self.wake()  # not applied at once: read the table at the next pass
            return
        if channel == CHANNEL_MAIL:
            if payload not in self.store.claims:
                return
            self._mail_due = True
        else:  # turns to claim: submitted, handed back or requeued elsewhere
            self.pacer.heard()
        self.wake()

    # -- leases ---------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        core = self.core
        timing = self.timing
        while not self._stopping:
            await core.clock.sleep(timing.renew_every_s)
            if self._stopping:
                return
            if self.lease.lapsed(core.clock.monotonic()) and self.store.claims:
                # Paused (SIGSTOP, a long GC) or the database silent past the lease: the
                # claims hold until another node takes a turn, and the next renewal
                # that reaches the database re-takes the rest. Meanwhile no model
                # request or tool call leaves (`confirm_lease`).
                log.warning("fleet.lease_lapsed", node=self.node_id,
                            turns=len(self.store.claims))
            held = dict(self.store.claims)
            sent_at = core.clock.monotonic()
            renewed: dict[str, int] | None = None
            # A renewal that waits (for the rows a commit holds, over a slow link) is
            # given until the lease would lapse: its answer counts from when it was sent,
            # and one cut short and sent again would only start later.
            with core.clock.move_on_after(max(timing.renew_every_s,
                                              self.lease.valid_until - sent_at)):
                try:
                    renewed = await self.store.renew()
                except StoreError as exc:
                    log.warning("fleet.renew_failed", node=self.node_id, error=str(exc))
            if renewed is None:
                continue
            # Turns that ended while the renewal ran are no longer held: not lost.
            still = {t: e for t, e in held.items() if self.store.claims.get(t) == e}
            outcome = self.lease.after_renewal(still, renewed, sent_at=sent_at,
                                               now=core.clock.monotonic())
            if outcome.lost:
                self.abandon(outcome.lost, reason="claimed by another node")
            if outcome.confirmed:
                # Failures seen from here on count again (`policy/stall.py`).
                core.shared.stalls.lease(self.lease.valid_until, now=core.clock.monotonic())
                self._renewed.set()
                self._renewed = anyio.Event()
            await self.share_budgets()

    async def confirm_lease(self, turn_id: str) -> None:
        """Before a call of `turn_id` leaves the node (a model request, a tool call): wait
        while the lease has lapsed, until a renewal confirms it (the call is neither sent
        nor failed meanwhile: another node may hold the turn by then and make it again).
        StaleLease when the renewal finds the turn taken by another node."""
        core = self.core
        waited = False
        while True:
            if turn_id in self.store.lost:
                raise StaleLease(f"turn {turn_id}: node {self.node_id} lost its claim;"
                                 " the call is not sent")
            if turn_id not in self.store.claims or not self.lease.lapsed(
                    core.clock.monotonic()):
                if waited:
                    log.info("fleet.lease_confirmed", node=self.node_id, turn=turn_id)
                return
            if not waited:
                waited = True
                log.info("fleet.call_waits_for_lease", node=self.node_id, turn=turn_id)
            renewed = self._renewed
            with core.clock.move_on_after(self.timing.renew_every_s):
                await renewed.wait()

    async def share_budgets(self) -> None:
        """Each heartbeat: this node's retry budget counts out, the other nodes' in, so a
        provider's budget holds for the fleet (as fresh as the last heartbeat)."""
        budgets = self.core.shared.retry_budgets
        mine = {name: (b.requests_in_flight, b.retries_in_flight)
                for name, b in budgets.items()}
        try:
            peers = await self.store.share_budgets(mine)
        except StoreError as exc:
            log.warning("fleet.budget_share_failed", node=self.node_id, error=str(exc))
            return
        for name, budget in budgets.items():
            requests, retries = peers.get(name, (0, 0))
            budget.set_peers(requests=requests, retries=retries)

    def abandon(self, turn_ids: Any, *, reason: str) -> None:
        """Give up turns whose claim is lost: no write, no call. A running one is
        suspended at once (its writes are refused); a queued one leaves the queue."""
        core = self.core
        ids = list(turn_ids)
        if not ids:
            return
        self.store.abandon(ids)
        self.lost_total += len(ids)
        log.warning("fleet.lease_lost", node=self.node_id, turns=len(ids), reason=reason)
        for turn_id in ids:
            live = core.live.get(turn_id)
            if live is None:
                continue
            if live.running:
                live.control.suspend(now=True)
            else:
                core.scheduler.dequeue(turn_id)
                core.live.pop(turn_id, None)

    def is_lost(self, turn_id: str) -> bool:
        return turn_id in self.store.lost

    # -- stop -----------------------------------------------------------------------

    async def stop(self) -> None:
        """After the drain: no more claims, and every held turn handed back (queued ones
        as they are, running ones suspended with their checkpoint)."""
        async with self._claim_lock:
            self._stopping = True
            self._wake.set()
            if not self.store.claims:
                return
            try:
                released = await self.store.release()
            except StoreError as exc:
                log.warning("fleet.release_failed", node=self.node_id, error=str(exc))
                return
        self.released_total += released
        log.info("fleet.released", node=self.node_id, turns=released)
