"""Webhooks room: sends the deliveries of the store's outbox, in a task group of its own.

The store writes a delivery (an outbox row per webhook) in the same transaction as the
event it carries, asking `route` which webhooks take it; this room only reads what is
due and sends it, so a turn never waits on a receiver: a receiver that is down or hangs
only leaves rows pending. Each webhook has at most MAX_IN_FLIGHT deliveries on the wire;
an attempt is cut at the webhook's `timeout`. What an answer means (delivered, retried
after a jittered wait, given up) is `policy/webhooks.py`'s; here it becomes a store write
(`webhook_settle`), durable before the next attempt is made, so a delivery acknowledged
with a 2xx is never sent again, and one cut by a crash is sent again after the restart
(the same `webhook-id`, which is what a receiver deduplicates by).

A delivery given up is kept as failed (status shows it) and reported by an event
`webhook.failed` (never for the delivery of a `webhook.failed` event itself: a receiver
that refuses those would otherwise make one for each). A webhook's outbox holds at most
its `max_pending` waiting deliveries: past that the oldest are given up.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import aiohttp
import anyio
import structlog
from anyio.abc import TaskGroup

from turnkeeper import event_types as ev
from turnkeeper.config import ConfigError, WebhookConfig, redact_url
from turnkeeper.events import Event
from turnkeeper.policy import webhooks as rules
from turnkeeper.policy.backoff import Rand
from turnkeeper.policy.classify import parse_retry_after
from turnkeeper.policy.retention import prune_before
from turnkeeper.store.outbox import DELIVERED, FAILED, PENDING, Backlog, Delivery
from turnkeeper.supervisor.core import SupervisorCore

log = structlog.get_logger("turnkeeper.webhooks")

MAX_IN_FLIGHT = 8  # deliveries on the wire per webhook
POLL_S = 1.0  # how often the outbox is read when nothing wakes the sender
PRUNE_EVERY_S = 60.0
DELIVERED_KEEP_S = 3600.0  # a delivered row is kept this long, then deleted
OUTCOMES = ("delivered", "retried", "failed", "dropped")


class Webhooks:
    def __init__(self, core: SupervisorCore, *, rand: Rand = random.uniform) -> None:
        self.core = core
        self._rand = rand
        self._hooks: dict[str, WebhookConfig] = {}
        self._keys: dict[str, bytes] = {}
        self._patterns: list[tuple[str, Sequence[str]]] = []
        self._routes: dict[str, tuple[str, ...]] = {}
        self._in_flight: dict[str, set[int]] = {}
        self._wake = anyio.Event()
        self._scope: anyio.CancelScope | None = None
        self._next_prune = 0.0
        self._next_backlog = 0.0
        self.backlog: dict[str, Backlog] = {}
        self.deliveries: dict[tuple[str, str], int] = {}  # (webhook, outcome) -> count
        self.configure()

    def __repr__(self) -> str:
        return f"Webhooks({sorted(self._hooks)!r}, in_flight={self.in_flight})"

    @property
    def in_flight(self) -> int:
        return sum(len(s) for s in self._in_flight.values())

    def configure(self) -> None:
        """Take the webhooks of the policy in force (at start and after each reload):
        their secrets are read again, and events stored from now on are routed by
        them."""
        hooks = {h.name: h for h in self.core.config.webhooks}
        keys: dict[str, bytes] = {}
        for name, hook in hooks.items():
            try:
                keys[name] = hook.secret()
            except ConfigError as exc:  # checked at load: gone since (a file removed)
                log.error("webhook.secret_unreadable", webhook=name, error=str(exc))
            unknown = [p for p in hook.events
                       if not p.endswith("*") and p not in ev.EVENT_TYPES]
            if unknown:
                log.warning("webhook.unknown_event_type", webhook=name, events=unknown)
        self._hooks, self._keys = hooks, keys
        self._patterns = [(name, hook.events) for name, hook in hooks.items()]
        self._routes = {}
        self.core.store.set_webhook_route(self.route if hooks else None)
        self._wake.set()

    def route(self, event: Event) -> tuple[str, ...]:
        """The webhooks that take `event` (asked by the store for every stored event)."""
        names = self._routes.get(event.type)
        if names is None:
            names = self._routes[event.type] = rules.route(self._patterns, event.type)
        if names:
            self._wake.set()
        return names

    # -- the sender -------------------------------------------------------------------

    async def run(self) -> None:
        """Send what the outbox holds, as long as the daemon runs (until `stop`)."""
        with anyio.CancelScope() as scope:
            self._scope = scope
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                             raise_for_status=False) as session, \
                    anyio.create_task_group() as tg:
                while True:
                    woken = self._wake.is_set()
                    self._wake = anyio.Event()
                    try:
                        if woken:  # the rows that woke us commit with the next write
                            await self.core.store.flush()
                        await self._poll(tg, session)
                    except Exception as exc:  # the store failing: the next poll tries again
                        log.warning("webhook.poll_failed", error=f"{type(exc).__name__}: {exc}")
                    if not self._hooks and not self.in_flight:
                        await self._idle()  # nothing to send until a reload adds one
                        continue
                    with self.core.clock.move_on_after(POLL_S):
                        await self._wake.wait()

    async def _idle(self) -> None:
        """No webhook configured, nothing on the wire: the backlog read once more (what
        status shows stays as the store holds it), then nothing until a reload."""
        try:
            self.backlog = await self.core.store.webhook_backlog()
        except Exception as exc:  # the store failing: status keeps the last read
            log.warning("webhook.poll_failed", error=f"{type(exc).__name__}: {exc}")
        await self._wake.wait()

    async def stop(self) -> None:
        """Stop sending (the daemon stops): an attempt cut on the wire stays pending and
        is sent again after the restart, or at once by another node of a fleet (what
        this one held is handed back)."""
        if self._scope is not None:
            self._scope.cancel()
        if self._hooks:
            try:
                await self.core.store.webhook_release()
            except Exception as exc:  # the store failing: the leases run out instead
                log.warning("webhook.release_failed", error=f"{type(exc).__name__}: {exc}")

    async def _poll(self, tg: TaskGroup, session: aiohttp.ClientSession) -> None:
        core = self.core
        store = core.store
        now = core.clock.time()
        if now >= self._next_backlog:  # once a POLL_S, not at every wake
            self._next_backlog = now + POLL_S
            self.backlog = await store.webhook_backlog()
        for name, hook in self._hooks.items():
            excess = rules.over_cap(self.backlog.get(name, Backlog()).pending,
                                    hook.max_pending)
            if excess:
                dropped = await store.webhook_give_up(
                    name, count=excess, now=now,
                    error=f"outbox full: more than max_pending {hook.max_pending} waiting")
                self._count(name, "dropped", dropped)
                log.warning("webhook.outbox_full", webhook=name, dropped=dropped,
                            max_pending=hook.max_pending)
            flying = self._in_flight.setdefault(name, set())
            free = MAX_IN_FLIGHT - len(flying)
            if free <= 0 or name not in self._keys:
                continue
            due = await store.webhook_due(name, now=now, limit=free, skip=flying,
                                          lease_s=rules.lease_s(hook.timeout))
            for delivery in due:
                flying.add(delivery.seq)
                tg.start_soon(self._deliver, session, delivery,
                              name=f"webhook {name} #{delivery.seq}")
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_EVERY_S
            failed_before = prune_before(now, core.config.store.keep_finished_s)
            await store.webhook_prune(delivered_before=now - DELIVERED_KEEP_S,
                                      failed_before=-1.0 if failed_before is None
                                      else failed_before)

    async def _deliver(self, session: aiohttp.ClientSession, d: Delivery) -> None:
        try:
            await self._attempt(session, d)
        except Exception as exc:  # the store failing: the row stays pending, sent again
            log.warning("webhook.settle_failed", webhook=d.webhook, seq=d.seq,
                        error=f"{type(exc).__name__}: {exc}")
        finally:
            self._in_flight.get(d.webhook, set()).discard(d.seq)
            self._wake.set()

    async def _attempt(self, session: aiohttp.ClientSession, d: Delivery) -> None:
        hook, key = self._hooks.get(d.webhook), self._keys.get(d.webhook)
        if hook is None or key is None:
            return  # removed by a reload meanwhile: left pending
        clock = self.core.clock
        msg_id = rules.message_id(d.seq)
        body = d.body.encode()
        status: int | None = None
        error: str | None = None
        retry_after: float | None = None
        try:
            async with session.post(
                    hook.url, data=body, allow_redirects=False,
                    headers=rules.headers(key, msg_id, int(clock.time()), body),
                    timeout=aiohttp.ClientTimeout(total=hook.timeout)) as resp:
                status = resp.status
                retry_after = parse_retry_after(resp.headers.get("Retry-After"),
                                                now_epoch=clock.time())
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            error = type(exc).__name__ + (f": {exc}" if str(exc) else "")
        attempts = d.attempts + 1
        decision = rules.decide(status=status, attempts=attempts,
                                max_attempts=hook.max_attempts, retry_after_s=retry_after,
                                error=error, rand=self._rand)
        now = clock.time()
        store = self.core.store
        if isinstance(decision, rules.Delivered):
            await store.webhook_settle(d.webhook, d.seq, state=DELIVERED, attempts=attempts,
                                       next_at=now, error=None, now=now)
            self._count(d.webhook, "delivered")
        elif isinstance(decision, rules.RetryIn):
            await store.webhook_settle(d.webhook, d.seq, state=PENDING, attempts=attempts,
                                       next_at=now + decision.delay_s,
                                       error=decision.reason, now=now)
            self._count(d.webhook, "retried")
            log.info("webhook.retry_scheduled", webhook=d.webhook, webhook_id=msg_id,
                     attempts=attempts, delay_s=round(decision.delay_s, 3),
                     reason=decision.reason)
        else:
            await store.webhook_settle(d.webhook, d.seq, state=FAILED, attempts=attempts,
                                       next_at=now, error=decision.reason, now=now)
            self._count(d.webhook, "failed")
            log.warning("webhook.failed", webhook=d.webhook, webhook_id=msg_id,
                        attempts=attempts, error=decision.reason)
            if d.type != ev.WebhookFailed.TYPE:
                self.core.bus.publish(ev.WebhookFailed(
                    webhook=d.webhook, webhook_id=msg_id, event_seq=d.seq,
                    event_type=d.type, attempts=attempts, error=decision.reason))

    def _count(self, webhook: str, outcome: str, amount: int = 1) -> None:
        key = (webhook, outcome)
        self.deliveries[key] = self.deliveries.get(key, 0) + amount

    # -- what status shows ------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        """Every configured webhook (and any the outbox still holds rows of): its
        deliveries waiting, the age of the oldest, those on the wire, delivered and
        failed ones kept, and the last failure."""
        out: dict[str, Any] = {}
        for name in [*self._hooks, *(n for n in sorted(self.backlog) if n not in self._hooks)]:
            hook = self._hooks.get(name)
            b = self.backlog.get(name, Backlog())
            out[name] = {
                "url": redact_url(hook.url) if hook is not None else None,
                "configured": hook is not None,
                "pending": b.pending,
                "oldest_pending_age_s": (None if b.oldest_pending_at is None
                                         else round(max(0.0, now - b.oldest_pending_at), 3)),
                "in_flight": len(self._in_flight.get(name, ())),
                "delivered": b.delivered,
                "failed": b.failed,
                "last_error": b.last_error,
            }
        return out
