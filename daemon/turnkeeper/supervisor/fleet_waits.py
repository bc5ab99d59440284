"""Retry-After windows shared by a fleet: a peer that asked one node to wait is not
called by any node until the window ends.

A node's Retry-After memory (`policy/retry_after.py`) tells each window it opens; this
room sends it to the store at once (`share_retry_after`: the longest window wins, and
NOTIFY tells every node with the seconds left, applied as heard). A node reads every
open window at start, and again each second in case a notice was missed. Windows travel
as seconds left, by the database's clock, so the nodes' clocks need not agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import structlog

from turnkeeper.policy.retry_after import WindowOpened
from turnkeeper.store.base import StoreError
from turnkeeper.store.fleet import FleetStore, read_breaker_notice

if TYPE_CHECKING:
    from turnkeeper.supervisor.core import SupervisorCore

log = structlog.get_logger("turnkeeper.fleet")


class FleetWaits:
    def __init__(self, core: SupervisorCore, store: FleetStore) -> None:
        self.core = core
        self.store = store
        self.due = False  # a notice that could not be applied as heard: read the table
        # Windows this node opened and has not published yet: name -> end (local clock).
        self._pending: dict[str, float] = {}
        self._flush_due = anyio.Event()

    def opened(self, window: WindowOpened) -> None:
        """A peer asked this node to wait: publish it to the fleet now."""
        until = self.core.clock.monotonic() + window.for_s
        self._pending[window.name] = max(until, self._pending.get(window.name, until))
        self._flush_due.set()

    async def run(self, stopping: Callable[[], bool]) -> None:
        """Publish as soon as a window opens; after a failed publish, again each second."""
        while not stopping():
            with self.core.clock.move_on_after(1.0):
                await self._flush_due.wait()
            self._flush_due = anyio.Event()
            if self._pending:
                await self.flush()

    async def flush(self) -> None:
        taken, self._pending = self._pending, {}
        for name, until in taken.items():
            left = until - self.core.clock.monotonic()
            if left <= 0:
                continue  # over before it could be told: nothing to share
            try:
                await self.store.share_retry_after(name, left)
            except StoreError as exc:
                log.warning("fleet.retry_after_share_failed", node=self.store.node_id,
                            peer=name, error=str(exc))
                self._pending[name] = max(until, self._pending.get(name, until))
                continue
            log.info("fleet.retry_after_shared", node=self.store.node_id, peer=name,
                     wait_s=round(left, 3))

    def heard(self, payload: str) -> None:
        """A node of the fleet (this one too) shared a window: keep it here."""
        name, left = read_breaker_notice(payload)
        if left is None:
            self.due = True
            return
        self._apply(name, left, self.core.clock.monotonic())

    async def read(self) -> None:
        """Apply every window the fleet holds open (at start, and each second)."""
        self.due = False
        try:
            windows = await self.store.shared_retry_after()
        except StoreError as exc:
            log.warning("fleet.retry_after_read_failed", node=self.store.node_id,
                        error=str(exc))
            return
        now = self.core.clock.monotonic()
        for name, left in windows.items():
            self._apply(name, left, now)

    def _apply(self, name: str, left: float, now: float) -> None:
        if self.core.shared.retry_after.remember(name, now + left, now=now):
            log.info("fleet.retry_after_from_peer", node=self.store.node_id, peer=name,
                     wait_s=round(left, 3))
