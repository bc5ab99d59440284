"""The webhook outbox: what every store keeps of the deliveries it owes.

An event a webhook takes gets a row per webhook (`webhook_outbox`: the webhook's name,
the event's number, its type and its JSON as the event streams give it), written by the
store in the same transaction as the event's own row, whichever write carries the event
(a turn's checkpoint, its result, a queued event): a crash keeps both or neither, so a
delivery is never lost between the event and the outbox, and never made up. Which
webhooks take an event is asked of the route the daemon sets (`set_webhook_route`),
when the event is handed to the store.

A row is `pending` until a 2xx comes back (`delivered`) or it is given up (`failed`: the
receiver refused it, its attempts ran out, or the webhook's outbox was full); a pending
row is due at `next_at`. On a store several daemons share, a node takes the due rows it
will send with a lease (`claimed_by`, `claim_until`), so one node sends each delivery;
one killed while sending leaves its rows to another once the lease ends. Delivered and
failed rows are kept a while for status, then deleted (`webhook_prune`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from turnkeeper.events import Event

PENDING = "pending"
DELIVERED = "delivered"
FAILED = "failed"

# Which webhooks (by name) take an event: asked once per stored event.
WebhookRoute = Callable[[Event], Sequence[str]]

OUTBOX_COLUMNS = "(webhook, seq, type, body, created_at, next_at, updated_at)"


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery owed: a webhook and the event it takes (`body` is the event's JSON,
    sent as it is); `attempts` made so far."""

    webhook: str
    seq: int
    type: str
    body: str
    attempts: int
    created_at: float


@dataclass(frozen=True, slots=True)
class Backlog:
    """A webhook's outbox: deliveries by state, the oldest pending one's time."""

    pending: int = 0
    delivered: int = 0
    failed: int = 0
    oldest_pending_at: float | None = None
    last_error: str | None = None


def outbox_params(event: Event, webhooks: Iterable[str]) -> list[tuple[Any, ...]]:
    """The rows of `event` for each of `webhooks`, in `OUTBOX_COLUMNS` order."""
    body = event.encoded()
    return [(name, event.seq, event.type, body, event.ts, event.ts, event.ts)
            for name in webhooks]


def backlog_of(rows: Iterable[Sequence[Any]]) -> dict[str, Backlog]:
    """Rows of (webhook, state, count, oldest created_at, last error) as each webhook's
    backlog."""
    out: dict[str, dict[str, Any]] = {}
    for webhook, state, count, oldest, error in rows:
        entry = out.setdefault(webhook, {})
        if state in (PENDING, DELIVERED, FAILED):
            entry[state] = int(count)
        if state == PENDING:
            entry["oldest_pending_at"] = None if oldest is None else float(oldest)
        if error and (state == FAILED or (state == PENDING and "last_error" not in entry)):
            entry["last_error"] = str(error)  # a failure, else a pending retry's reason
    return {name: Backlog(**fields) for name, fields in out.items()}


class Outbox(Protocol):
    """What the webhook sender asks of the store (every backend has it)."""

    def set_webhook_route(self, route: WebhookRoute | None) -> None:
        """Events stored from now on get an outbox row for each webhook `route` names;
        None: no webhook takes any."""
        ...

    async def webhook_due(self, webhook: str, *, now: float, limit: int,
                          skip: Collection[int] = (), lease_s: float = 60.0
                          ) -> list[Delivery]:
        """Up to `limit` pending deliveries of `webhook` due at `now` (oldest first),
        but those numbered in `skip` (in flight here). On a shared store they are
        claimed for `lease_s`: no other node gets them until the lease ends."""
        ...

    async def webhook_settle(self, webhook: str, seq: int, *, state: str, attempts: int,
                             next_at: float, error: str | None, now: float) -> None:
        """A delivery's attempt is over: it is `state` now (pending again, due at
        `next_at`; delivered; failed), its claim released. Durable on return."""
        ...

    async def webhook_release(self) -> None:
        """Hand back the deliveries this daemon holds (it stops): on a shared store
        another node may send them at once instead of after their lease."""
        ...

    async def webhook_give_up(self, webhook: str, *, count: int, error: str,
                              now: float) -> int:
        """The `count` oldest pending deliveries of `webhook` failed with `error` (its
        outbox is full); how many were."""
        ...

    async def webhook_backlog(self) -> dict[str, Backlog]:
        """Every webhook's outbox, by name (webhooks with no row are absent)."""
        ...

    async def webhook_prune(self, *, delivered_before: float, failed_before: float,
                            limit: int = 1000) -> int:
        """Delete up to `limit` delivered rows settled before `delivered_before` and
        failed ones settled before `failed_before`; how many went."""
        ...


class OutboxFront:
    """A store's outbox calls, each handed to its outbox part (`self.outbox`): what every
    backend's store class takes in, so that the `Store` is one object to its callers."""

    outbox: Outbox

    def set_webhook_route(self, route: WebhookRoute | None) -> None:
        self.outbox.set_webhook_route(route)

    async def webhook_due(self, webhook: str, *, now: float, limit: int,
                          skip: Collection[int] = (), lease_s: float = 60.0
                          ) -> list[Delivery]:
        return await self.outbox.webhook_due(webhook, now=now, limit=limit, skip=skip,
                                             lease_s=lease_s)

    async def webhook_settle(self, webhook: str, seq: int, *, state: str, attempts: int,
                             next_at: float, error: str | None, now: float) -> None:
        await self.outbox.webhook_settle(webhook, seq, state=state, attempts=attempts,
                                         next_at=next_at, error=error, now=now)

    async def webhook_release(self) -> None:
        await self.outbox.webhook_release()

    async def webhook_give_up(self, webhook: str, *, count: int, error: str,
                              now: float) -> int:
        return await self.outbox.webhook_give_up(webhook, count=count, error=error, now=now)

    async def webhook_backlog(self) -> dict[str, Backlog]:
        return await self.outbox.webhook_backlog()

    async def webhook_prune(self, *, delivered_before: float, failed_before: float,
                            limit: int = 1000) -> int:
        return await self.outbox.webhook_prune(delivered_before=delivered_before,
                                               failed_before=failed_before, limit=limit)


@dataclass(slots=True)
class _Row:
    delivery: Delivery
    state: str
    next_at: float
    updated_at: float
    error: str | None = None


class MemoryOutbox:
    """The outbox of the in-memory store (its part), with the SQLite store's semantics
    (one process: nothing is claimed, `skip` keeps what is in flight out)."""

    def __init__(self) -> None:
        self._route: WebhookRoute | None = None
        self._outbox: dict[tuple[str, int], _Row] = {}

    def set_webhook_route(self, route: WebhookRoute | None) -> None:
        self._route = route

    def add(self, event: Event) -> None:
        """`event`'s rows, as it is stored (the first row of a webhook and event stays)."""
        if self._route is None:
            return
        for name, seq, type, body, ts, _, _ in outbox_params(event, self._route(event)):
            self._outbox.setdefault((name, seq), _Row(
                Delivery(name, seq, type, body, 0, ts), PENDING, ts, ts))

    async def webhook_due(self, webhook: str, *, now: float, limit: int,
                          skip: Collection[int] = (), lease_s: float = 60.0
                          ) -> list[Delivery]:
        rows = sorted((r for (name, seq), r in self._outbox.items()
                       if name == webhook and r.state == PENDING and r.next_at <= now
                       and seq not in skip),
                      key=lambda r: (r.next_at, r.delivery.seq))
        return [r.delivery for r in rows[:max(0, limit)]]

    async def webhook_settle(self, webhook: str, seq: int, *, state: str, attempts: int,
                             next_at: float, error: str | None, now: float) -> None:
        row = self._outbox.get((webhook, seq))
        if row is None or row.state != PENDING:
            return
        d = row.delivery
        row.delivery = Delivery(d.webhook, d.seq, d.type, d.body, attempts, d.created_at)
        row.state, row.next_at, row.error, row.updated_at = state, next_at, error, now

    async def webhook_release(self) -> None:
        return None  # one process: nothing is claimed

    async def webhook_give_up(self, webhook: str, *, count: int, error: str,
                              now: float) -> int:
        oldest = sorted((seq for (name, seq), r in self._outbox.items()
                         if name == webhook and r.state == PENDING))[:max(0, count)]
        for seq in oldest:
            row = self._outbox[(webhook, seq)]
            row.state, row.error, row.updated_at = FAILED, error, now
        return len(oldest)

    async def webhook_backlog(self) -> dict[str, Backlog]:
        counts: dict[tuple[str, str], list[Any]] = {}
        for (name, _), r in sorted(self._outbox.items(), key=lambda kv: kv[1].updated_at):
            entry = counts.setdefault((name, r.state), [0, None, None])
            entry[0] += 1
            at = r.delivery.created_at
            entry[1] = at if entry[1] is None else min(entry[1], at)
            entry[2] = r.error or entry[2]
        return backlog_of((name, state, *values) for (name, state), values in counts.items())

    async def webhook_prune(self, *, delivered_before: float, failed_before: float,
                            limit: int = 1000) -> int:
        due = [key for key, r in self._outbox.items()
               if (r.state == DELIVERED and r.updated_at < delivered_before)
               or (r.state == FAILED and r.updated_at < failed_before)][:limit]
        for key in due:
            del self._outbox[key]
        return len(due)
