"""Circuit breakers shared by a fleet: one failure streak per peer for every node.

Each node's breakers tell their changes (`policy/breaker.py`); `policy/breaker_share.py`
folds them and this room sends them to the store at once (`add_breaker_failures`): the
store adds every node's failures to one streak, a success on any node resets it, and
when the streak reaches the threshold the breaker opens for the fleet in the same
transaction, announced to every node (NOTIFY, with the seconds it stays open, applied
as heard). A node also publishes an opening of its own (a failed probe, a long
Retry-After), reads every shared breaker at start, and reads them again each second in
case a notice was missed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import structlog

from turnkeeper.policy.breaker import BreakerChange, CircuitBreaker
from turnkeeper.policy.breaker_share import StreakShare
from turnkeeper.store.base import StoreError
from turnkeeper.store.fleet import FleetStore, read_breaker_notice

if TYPE_CHECKING:
    from turnkeeper.supervisor.core import SupervisorCore

log = structlog.get_logger("turnkeeper.fleet")


class FleetBreakers:
    def __init__(self, core: SupervisorCore, store: FleetStore) -> None:
        self.core = core
        self.store = store
        self.due = False  # a notice that could not be applied as heard: read the table
        self._shared: dict[str, float] = {}  # name -> open until (local clock)
        self.streaks = StreakShare()  # this node's changes not yet in the store
        # Flushes begun and ended per breaker: a read that overlapped one may answer a
        # streak older than the flush's (a reset among them), and must not set it.
        self._flushes: dict[str, int] = {}
        self._flush_due = anyio.Event()

    @property
    def node_id(self) -> str:
        return self.store.node_id

    def heard(self, payload: str) -> bool:
        """A breaker opened somewhere in the fleet: open it here now. False when the
        notice does not say for how long (read the table instead)."""
        name, left = read_breaker_notice(payload)
        local = self.core.shared.breakers.get(name)
        if left is None or local is None:
            self.due = True
            return False
        self._open_from_peer(local, left, self.core.clock.monotonic())
        return True

    def _open_from_peer(self, local: CircuitBreaker, left: float, now: float) -> None:
        """Another node opened the peer's breaker for `left` more seconds: so here."""
        if local.open_from_peer(now, left):
            self._shared[local.name] = now + left  # not ours to publish again
            log.warning("fleet.breaker_opened_by_peer", node=self.node_id,
                        breaker=local.name, open_for_s=round(left, 3))

    def changed(self, change: BreakerChange) -> None:
        """A breaker's streak grew, broke or it opened: flush it to the store now."""
        self.streaks.record(change)
        self._flush_due.set()

    async def run(self, stopping: Callable[[], bool]) -> None:
        """Flush as soon as a breaker changes; after a failed flush, again each second."""
        while not stopping():
            with self.core.clock.move_on_after(1.0):
                await self._flush_due.wait()
            self._flush_due = anyio.Event()
            if self.streaks:
                await self.flush()

    async def flush(self) -> None:
        """Add this node's failures to the fleet's streaks (a success here resets them)
        and apply the fleet's answer: the streak to count on from, and the opening when
        the fleet's failures reached the threshold (the store tells every node at once).
        An opening of this node's own (a probe failed, a long Retry-After) is published
        as well, for every node to keep the peer's breaker open as long."""
        core = self.core
        for name, delta in self.streaks.take().items():
            breaker = core.shared.breakers.get(name)
            if breaker is None:
                continue
            if delta.reset or delta.failures:
                self._flushes[name] = self._flushes.get(name, 0) + 1
                try:
                    streak, left = await self.store.add_breaker_failures(
                        name, delta.failures, reset=delta.reset,
                        threshold=breaker.failure_threshold, cooldown_s=breaker.cooldown_s)
                except StoreError as exc:
                    log.warning("fleet.breaker_share_failed", node=self.node_id,
                                breaker=name, error=str(exc))
                    self.streaks.put_back(name, delta)
                    continue
                finally:
                    self._flushes[name] += 1
                now = core.clock.monotonic()
                if left is not None:
                    self._shared[name] = max(self._shared.get(name, 0), now + left)
                    if breaker.open_from_peer(now, left):
                        log.warning("fleet.breaker_opened_by_fleet", node=self.node_id,
                                    breaker=name, streak=streak, open_for_s=round(left, 3))
                else:
                    self._count_on(name, streak, now)
            if delta.opened_for_s is not None:
                await self._publish_opening(name)

    def _count_on(self, name: str, streak: int, now: float) -> None:
        """The local breaker counts on from the fleet's streak and this node's failures
        not yet added to it (none to count on from if a success here broke it since)."""
        breaker = self.core.shared.breakers.get(name)
        since = self.streaks.pending.get(name)
        if breaker is not None and (since is None or not since.reset):
            breaker.share_streak(streak + (since.failures if since else 0), now)

    async def _publish_opening(self, name: str) -> None:
        core = self.core
        breaker = core.shared.breakers.get(name)
        now = core.clock.monotonic()
        open_for = None if breaker is None else breaker.open_for(now)
        if open_for is None or now + open_for <= self._shared.get(name, 0) + 0.5:
            return  # not open, or the fleet holds it open as long already
        self._shared[name] = now + open_for
        try:
            await self.store.open_breaker(name, open_for)
        except StoreError as exc:
            log.warning("fleet.breaker_share_failed", node=self.node_id, breaker=name,
                        error=str(exc))
            return
        log.info("fleet.breaker_shared", node=self.node_id, breaker=name,
                 open_for_s=round(open_for, 3))

    async def read(self) -> None:
        """Apply the fleet's breakers here: an opening by another node (at start, on
        NOTIFY, and every second in case one was missed), and each streak."""
        self.due = False
        flushes = dict(self._flushes)
        try:
            shared = await self.store.shared_breakers()
        except StoreError as exc:
            log.warning("fleet.breaker_read_failed", node=self.node_id, error=str(exc))
            return
        now = self.core.clock.monotonic()
        for name, (streak, left) in shared.items():
            local = self.core.shared.breakers.get(name)
            if local is None:
                continue
            if left is None:
                # A flush under way (an odd count) or done since the read began: the
                # read may predate it, and the flush's own answer is the newer.
                before = flushes.get(name, 0)
                if self._flushes.get(name, 0) == before and before % 2 == 0:
                    self._count_on(name, streak, now)
            else:
                self._open_from_peer(local, left, now)
