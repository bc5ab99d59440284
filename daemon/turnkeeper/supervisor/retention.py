"""Retention room: deletes finished turns past `store.keep_finished`, in small batches,
in the background; and on request (`turnkeeper prune`). Submits' Idempotency-Keys past
`daemon.idempotency_window` go in the same rounds. The rule (what is due, how often
to look) is `policy/retention.py`; here it becomes store writes."""

from __future__ import annotations

import structlog

from turnkeeper.policy.idempotency import expired_before
from turnkeeper.policy.retention import PRUNE_BATCH, prune_before, prune_every_s
from turnkeeper.supervisor.core import SupervisorCore

log = structlog.get_logger("turnkeeper.supervisor")


class Retention:
    def __init__(self, core: SupervisorCore) -> None:
        self.core = core

    async def prune(self, *, older_than_s: float, dead_letters: bool = False) -> int:
        """Delete every turn that finished more than `older_than_s` ago (dead letters only
        when asked), a batch per transaction so running turns never wait long on the
        store. Returns how many went."""
        core = self.core
        before = core.clock.time() - older_than_s
        total = 0
        while True:
            n = await core.store.prune(finished_before=before, dead_letters=dead_letters,
                                       limit=PRUNE_BATCH)
            total += n
            if n < PRUNE_BATCH:  # each batch is one write: turns' writes go between
                break
        if total:
            log.info("store.pruned", turns=total, older_than_s=older_than_s,
                     dead_letters=dead_letters)
        return total

    async def prune_keys(self) -> int:
        """Delete the Idempotency-Keys past the window (a batch per transaction)."""
        core = self.core
        before = expired_before(core.clock.time(), core.config.daemon.idempotency_window_s)
        total = 0
        while True:
            n = await core.store.prune_idempotency_keys(created_before=before,
                                                        limit=PRUNE_BATCH)
            total += n
            if n < PRUNE_BATCH:
                break
        if total:
            log.info("store.keys_pruned", keys=total)
        return total

    async def run(self) -> None:
        """The background prune, as long as the daemon runs; the keep is read at each
        round, so a reload that changes it applies at the next one."""
        core = self.core
        while True:
            await core.clock.sleep(prune_every_s(core.config.store.keep_finished_s))
            try:
                await self.prune_keys()
            except Exception as exc:  # the store failing: the next round tries again
                log.warning("store.prune_failed", error=f"{type(exc).__name__}: {exc}")
            keep_s = core.config.store.keep_finished_s
            if prune_before(core.clock.time(), keep_s) is None:
                continue
            try:
                await self.prune(older_than_s=keep_s)
            except Exception as exc:  # the store failing: the next round tries again
                log.warning("store.prune_failed", error=f"{type(exc).__name__}: {exc}")
