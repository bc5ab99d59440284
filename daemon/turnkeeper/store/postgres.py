"""The shared store: a PostgreSQL database (`[store] url = "postgresql://..."`).

The same calls and the same write semantics as the embedded SQLite store, over a
connection pool, riding out lost connections; claims, leases and fenced writes for a
fleet of daemons sharing the database. `PostgresStore` is the one class that answers
the store interface (`store/base.py`), the webhook outbox's (`store/outbox.py`) and the
fleet's (`store/fleet.py`); each call is handed to the part that makes it:

- `db` (`postgres_conn.py`): the pool, the writer's and the renewal's own connections,
  the outage state, reads that survive a lost connection;
- `writer` (`postgres_writer.py`): the steps' group commit, a batch as the set-based
  statements of `postgres_batch.py`; `intake` (`postgres_intake.py`): the submits' own;
- `writes` (`postgres_writes.py`): what each write call commits, fenced by the claims;
- `reads` (`postgres_reads.py`): turns, checkpoints with their rows, events, the journal;
- `fleet` (`postgres_fleet.py`): nodes, claims, leases, mail, NOTIFY; `shared`
  (`postgres_shared.py`): retry budgets, breakers and Retry-After windows;
- `outbox` (`postgres_outbox.py`): the webhook outbox's rows and claims.

The URL's password is never written to a log or an error: `redact_url` replaces it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import anyio

from turnkeeper.clock import Clock
from turnkeeper.config.redact import redact_url
from turnkeeper.events import Event
from turnkeeper.policy.idempotency import IdempotencyKey, StoredKey
from turnkeeper.policy.limits import FinishedTurn
from turnkeeper.policy.store_outage import StoreOutage
from turnkeeper.store.base import MessageRows, StoreError
from turnkeeper.store.fleet import Claimed, EventCursor
from turnkeeper.store.outbox import OutboxFront
from turnkeeper.store.postgres_conn import DB_ERRORS, POOL_SIZE, Dedicated, PgConnection
from turnkeeper.store.postgres_fleet import RENEW, PgFleet
from turnkeeper.store.postgres_fused import FUSED
from turnkeeper.store.postgres_intake import TURNS_INSERT, IntakeWriter
from turnkeeper.store.postgres_outbox import PgOutbox
from turnkeeper.store.postgres_reads import PgReads
from turnkeeper.store.postgres_schema import MIGRATIONS as MIGRATIONS
from turnkeeper.store.postgres_schema import SCHEMA_VERSION as SCHEMA_VERSION
from turnkeeper.store.postgres_schema import prepare
from turnkeeper.store.postgres_shared import SHARE_BUDGETS, PgShared
from turnkeeper.store.postgres_writer import StepWriter
from turnkeeper.store.postgres_writes import PgWrites


class PostgresStore(OutboxFront):
    """The store on PostgreSQL: its parts (see the module's docstring), and every call
    of the store, outbox and fleet interfaces handed to the one that makes it."""

    outbox: PgOutbox

    def __init__(self, url: str, *, clock: Clock | None = None, fatal_after: float = 300.0,
                 pool_size: int = POOL_SIZE, node_id: str | None = None,
                 lease_s: float = 15.0) -> None:
        self.db = PgConnection(url, clock=clock, fatal_after=fatal_after,
                               pool_size=pool_size, node_id=node_id)
        self.writer = StepWriter(self.db)
        # Submits: a group commit of their own, apart from the steps' writer.
        for conn in self.db.writer_conns:
            conn.warm = (FUSED,)
        self.db.lease_conn.warm = (RENEW, SHARE_BUDGETS)
        self.intake = IntakeWriter(self.db.clock, Dedicated(self.db.connect_one,
                                                            warm=(TURNS_INSERT,)),
                                   self.db.outage, self.db.where,
                                   lambda: self.db.pool is not None)
        self.fleet = PgFleet(self.db, self.writer, lease_s)
        self.shared = PgShared(self.db, lease_s)
        self.reads = PgReads(self.db)
        self.outbox = PgOutbox(self.db, self.writer)
        self.writes = PgWrites(self.db, self.writer, self.intake, self.fleet, self.outbox)
        self.clock = self.db.clock
        self.node_id = self.db.node_id
        self.lease_s = lease_s
        self.outage: StoreOutage = self.db.outage
        # The fleet part's own dict and set: the fleet interface names them.
        self.claims: dict[str, int] = self.fleet.claims
        self.lost: set[str] = self.fleet.lost

    def __repr__(self) -> str:
        return f"PostgresStore({self.where!r})"

    @property
    def url(self) -> str:
        return self.db.url

    @url.setter
    def url(self, url: str) -> None:
        """Another database before `open` (a test's database of its own)."""
        self.db.url = url
        self.db.where = redact_url(url)

    @property
    def where(self) -> str:
        return self.db.where

    # -- what the store counts (its writers' and its connections') ----------------

    @property
    def degraded(self) -> str | None:
        return self.db.degraded

    @property
    def durable_writes(self) -> int:
        return self.writer.durable_writes

    @property
    def failed_writes(self) -> int:
        return self.writer.failed_writes

    @property
    def superseded(self) -> int:
        return self.writer.superseded

    @property
    def commits(self) -> int:
        return self.writer.commits

    @property
    def reconnects(self) -> int:
        return self.db.reconnects

    @property
    def conflicts(self) -> int:
        return self.db.conflicts

    @property
    def event_base(self) -> int:
        return self.fleet.event_base

    # -- lifecycle ----------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """The steps' writer task, and the intake's beside it; both commit what is
        queued before they end (`close`)."""
        async with anyio.create_task_group() as tg:
            await tg.start(self.intake.run)
            await self.writer.run(task_status=task_status)

    async def open(self) -> None:
        try:
            pool = await self.db.connect(self.lease_s)
            async with pool.acquire() as conn:
                await prepare(conn, self.where)
                await self.fleet.register(conn)
            await self.db.open_dedicated(self.intake.connection)
        except BaseException as exc:
            await self.intake.connection.close()
            await self.db.close()
            if isinstance(exc, StoreError):
                raise
            if isinstance(exc, (*DB_ERRORS, ValueError)):
                raise StoreError(f"state database {self.where} cannot be opened: "
                                 f"{type(exc).__name__}: {exc}") from None
            raise

    async def close(self) -> None:
        await self.intake.stop()
        await self.writer.stop()
        pool = self.db.pool
        if pool is not None:  # the node stopped: its id is free for a restart
            with anyio.CancelScope(shield=True), contextlib.suppress(*DB_ERRORS):
                with anyio.fail_after(5):
                    await pool.execute("UPDATE nodes SET stopped_at = now()"
                                       " WHERE node_id = $1", self.node_id)
        await self.intake.connection.close()
        await self.db.close()

    async def flush(self) -> None:
        await self.writer.flush()

    # -- writes (`postgres_writes.py`) ---------------------------------------------

    async def insert_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                          events: Sequence[Event] = (), within_s: float | None = None,
                          idempotency: IdempotencyKey | None = None) -> int:
        return await self.writes.insert_turn(record, checkpoint, events=events,
                                             within_s=within_s, idempotency=idempotency)

    async def save_turn(self, record: dict[str, Any],
                        checkpoint: dict[str, Any] | None = None, *,
                        messages: MessageRows | None = None,
                        trail: MessageRows | None = None,
                        events: Sequence[Event] = ()) -> None:
        await self.writes.save_turn(record, checkpoint, messages=messages, trail=trail,
                                    events=events)

    def queue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                   messages: MessageRows | None = None,
                   trail: MessageRows | None = None) -> bool:
        return self.writes.queue_turn(record, checkpoint, messages=messages, trail=trail)

    async def append_message(self, turn_id: str, message: dict[str, Any], *,
                             updated_at: float, events: Sequence[Event] = (),
                             mail_id: int | None = None) -> None:
        await self.writes.append_message(turn_id, message, updated_at=updated_at,
                                         events=events, mail_id=mail_id)

    def append_event(self, event: Event) -> None:
        self.writes.append_event(event)

    def reserve_event_seqs(self, upto: int) -> None:
        self.writes.reserve_event_seqs(upto)

    async def journal_intent(self, key: str, *, turn: str, tool: str, arguments: str,
                             idempotent: bool) -> None:
        await self.writes.journal_intent(key, turn=turn, tool=tool, arguments=arguments,
                                         idempotent=idempotent)

    async def journal_outcome(self, key: str, outcome: dict[str, Any]) -> None:
        await self.writes.journal_outcome(key, outcome)

    async def requeue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                           messages: MessageRows | None = None,
                           trail: MessageRows | None = None,
                           events: Sequence[Event] = ()) -> None:
        await self.writes.requeue_turn(record, checkpoint, messages=messages, trail=trail,
                                       events=events)

    async def mark_replayed(self, turn_id: str, new_turn_id: str) -> None:
        await self.writes.mark_replayed(turn_id, new_turn_id)

    async def prune(self, *, finished_before: float, dead_letters: bool = False,
                    limit: int) -> int:
        return await self.writes.prune(finished_before=finished_before,
                                       dead_letters=dead_letters, limit=limit)

    async def prune_idempotency_keys(self, *, created_before: float, limit: int) -> int:
        return await self.writes.prune_idempotency_keys(created_before=created_before,
                                                        limit=limit)

    # -- reads (`postgres_reads.py`) -------------------------------------------------

    async def max_event_seq(self) -> int:
        return await self.reads.max_event_seq()

    async def get_turn(self, turn_id: str) -> dict[str, Any] | None:
        return await self.reads.get_turn(turn_id)

    async def get_checkpoint(self, turn_id: str) -> dict[str, Any] | None:
        return await self.reads.get_checkpoint(turn_id)

    async def list_turns(self, *, state: str | None = None, session: str | None = None,
                         limit: int = 100, since: float | None = None,
                         before_seq: int | None = None) -> list[dict[str, Any]]:
        return await self.reads.list_turns(state=state, session=session, limit=limit,
                                           since=since, before_seq=before_seq)

    async def unfinished_turns(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return await self.reads.unfinished_turns()

    async def session_history(self, session: str, *, before_seq: int
                              ) -> list[dict[str, Any]]:
        return await self.reads.session_history(session, before_seq=before_seq)

    async def events(self, *, turn: str | None = None, after_seq: int = 0,
                     limit: int = 10_000) -> list[dict[str, Any]]:
        return await self.reads.events(turn=turn, after_seq=after_seq, limit=limit)

    async def journal_get(self, key: str) -> dict[str, Any] | None:
        return await self.reads.journal_get(key)

    async def finished_usage(self, *, since: float | None = None,
                             limit: int = 100_000) -> list[FinishedTurn]:
        return await self.reads.finished_usage(since=since, limit=limit)

    async def dead_letters(self) -> list[dict[str, Any]]:
        return await self.reads.dead_letters()

    async def idempotency_key(self, key: str) -> StoredKey | None:
        return await self.reads.idempotency_key(key)

    # -- the fleet (`postgres_fleet.py`, `postgres_shared.py`) ----------------------

    async def event_block_start(self) -> int:
        return await self.fleet.event_block_start()

    async def events_cursor(self) -> EventCursor:
        return await self.fleet.events_cursor()

    async def peer_events(self, *, after: EventCursor, turn: str | None = None,
                          limit: int = 1000) -> tuple[list[dict[str, Any]], EventCursor]:
        return await self.fleet.peer_events(after=after, turn=turn, limit=limit)

    async def claim(self, limit: int) -> list[Claimed]:
        return await self.fleet.claim(limit)

    async def backlog(self) -> int:
        return await self.fleet.backlog()

    async def renew(self) -> dict[str, int]:
        return await self.fleet.renew()

    def abandon(self, turn_ids: Iterable[str]) -> None:
        self.fleet.abandon(turn_ids)

    async def release(self) -> int:
        return await self.fleet.release()

    async def nodes(self) -> list[dict[str, Any]]:
        return await self.fleet.nodes()

    async def post_mail(self, turn_id: str, kind: str, body: dict[str, Any]) -> None:
        await self.fleet.post_mail(turn_id, kind, body)

    async def pending_mail(self) -> list[tuple[int, str, str, dict[str, Any]]]:
        return await self.fleet.pending_mail()

    async def drop_mail(self, mail_id: int) -> None:
        await self.fleet.drop_mail(mail_id)

    async def listen(self, on_notify: Callable[[str, str], None]) -> None:
        await self.fleet.listen(on_notify)

    async def share_budgets(self, budgets: dict[str, tuple[int, int]]
                            ) -> dict[str, tuple[int, int]]:
        return await self.shared.share_budgets(budgets)

    async def open_breaker(self, name: str, for_s: float) -> None:
        await self.shared.open_breaker(name, for_s)

    async def add_breaker_failures(self, name: str, failures: int, *, reset: bool,
                                   threshold: int, cooldown_s: float
                                   ) -> tuple[int, float | None]:
        return await self.shared.add_breaker_failures(
            name, failures, reset=reset, threshold=threshold, cooldown_s=cooldown_s)

    async def shared_breakers(self) -> dict[str, tuple[int, float | None]]:
        return await self.shared.shared_breakers()

    async def share_retry_after(self, name: str, for_s: float) -> None:
        await self.shared.share_retry_after(name, for_s)

    async def shared_retry_after(self) -> dict[str, float]:
        return await self.shared.shared_retry_after()
