"""The fleet part of the PostgreSQL store: nodes, claims, leases, fencing, mail and
NOTIFY (what the nodes share, retry budgets, breakers and Retry-After windows, is
`postgres_shared.py`).

Several daemons share a database as a fleet (`supervisor/fleet.py`): each registers
its node id in `nodes` (a node id whose daemon still beats is refused, StoreInUse, exit
69) and runs only the turns it claimed. A claim (`claim`) is a lease with a fencing
epoch; while this node holds a turn, every write of it names the epoch and the database
refuses it once another node has claimed the turn (StaleLease), and a non-idempotent
call's intent is written only while the lease holds at the database's clock (see
`store/fleet.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import asyncpg

from turnkeeper.store.base import (
    TERMINAL_SQL,
    StoreError,
    StoreInUse,
    record_of,
    rows_by_turn,
    with_messages,
)
from turnkeeper.store.fleet import (
    CHANNEL_BREAKERS,
    CHANNEL_MAIL,
    CHANNEL_RETRY_AFTER,
    CHANNEL_TURNS,
    Claimed,
    EventCursor,
    StaleLease,
)
from turnkeeper.store.postgres_batch import Conn
from turnkeeper.store.postgres_conn import (
    CONNECT_TIMEOUT,
    DB_ERRORS,
    PgConnection,
    dumps,
)
from turnkeeper.store.postgres_writer import StepWriter
from turnkeeper.store.writer import MESSAGES, TRAIL

EVENT_BLOCK = 2**32
# The oldest transaction still running anywhere on the server: every one before it has
# committed or rolled back, so its rows are all there is ever going to be.
_SETTLED = "pg_snapshot_xmin(pg_current_snapshot())"
EVENT_BLOCK_LOCK = 0x746B_6576_7473  # "tk" "evts": one block taken at a time


# A renewal: the node's heartbeat, and the lease of every turn it holds under the epoch
# it holds (see `PgFleet.renew`).
RENEW = (
    "WITH n AS (UPDATE nodes SET heartbeat_at = now(), turns = $5"
    " WHERE node_id = $1 RETURNING 1),"
    " l AS MATERIALIZED (SELECT t.id FROM (SELECT count(*) FROM n) AS c,"
    " turns t JOIN unnest($2::text[], $3::bigint[]) AS h(id, epoch) ON t.id = h.id"
    " WHERE t.epoch = h.epoch AND t.owner = $1 ORDER BY t.id FOR UPDATE OF t)"
    " UPDATE turns t SET lease_until = now() + make_interval(secs => $4)"
    " FROM unnest($2::text[], $3::bigint[]) AS h(id, epoch)"
    " WHERE t.id = h.id AND t.id IN (SELECT id FROM l) AND t.epoch = h.epoch"
    " AND t.owner = $1 RETURNING t.id, t.epoch")


CLAIM = (
    "WITH c AS (SELECT t.id FROM turns t WHERE t.state NOT IN"
    f" {TERMINAL_SQL} AND (t.owner IS NULL OR t.lease_until < now())"
    " AND NOT t.id = ANY($4::text[])"
    " AND NOT EXISTS (SELECT 1 FROM turns e WHERE e.session = t.session"
    f" AND e.seq < t.seq AND e.state NOT IN {TERMINAL_SQL}"
    " AND e.owner IS DISTINCT FROM $1)"
    " ORDER BY t.seq LIMIT $2 FOR UPDATE SKIP LOCKED)"
    " UPDATE turns t SET owner = $1, epoch = t.epoch + 1,"
    " lease_until = now() + make_interval(secs => $3) FROM c"
    " WHERE t.id = c.id RETURNING t.id, t.seq, t.epoch, t.record,"
    " t.message, t.checkpoint")
# The claimed turns' messages (k 0) and trail (k 1) rows, each turn's in index order.
CLAIMED_ROWS = (
    f"SELECT 0 AS k, turn, idx, data FROM {MESSAGES} WHERE turn = ANY($1::text[])"
    f" UNION ALL SELECT 1, turn, idx, data FROM {TRAIL} WHERE turn = ANY($1::text[])"
    " ORDER BY k, turn, idx")
# Claimed turns handed back under the epoch of the claim (their rows could not be read).
HAND_BACK = (
    "WITH l AS MATERIALIZED (SELECT t.id FROM turns t JOIN unnest($2::text[],"
    " $3::bigint[]) AS h(id, epoch) ON t.id = h.id WHERE t.owner = $1"
    " AND t.epoch = h.epoch ORDER BY t.id FOR UPDATE OF t)"
    " UPDATE turns t SET owner = NULL, lease_until = NULL FROM l WHERE t.id = l.id")


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PgFleet:
    """A node of the fleet: the turns it holds, and the calls of `store/fleet.py` but
    what the nodes share (`postgres_shared.py`); reads through `db`, mail through the
    steps' `writer`."""

    def __init__(self, db: PgConnection, writer: StepWriter, lease_s: float) -> None:
        self.db = db
        self.writer = writer
        self.node_id = db.node_id
        self.lease_s = lease_s
        # The turns this node holds (turn -> the epoch of its claim), and those it lost:
        # writes of a held turn are fenced by its epoch, writes of a lost one refused.
        self.claims: dict[str, int] = {}
        self.lost: set[str] = set()
        self.event_base = 0  # where this node's event numbers start (event_block_start)

    async def register(self, conn: Conn) -> None:
        """This node in the nodes table. A node id whose daemon still beats (its
        heartbeat younger than a lease) is refused, unless that daemon ran on this host
        and its process is gone (a restart after a crash): two daemons under one name
        would take each other's turns for their own. A crashed predecessor's turns are
        handed back at once, for the claims to resume them."""
        host = socket.gethostname()
        async with conn.transaction():
            row = await conn.fetchrow(
                "SELECT pid, host, stopped_at IS NULL AND heartbeat_at >"
                " now() - make_interval(secs => $2) AS beating FROM nodes"
                " WHERE node_id = $1 FOR UPDATE", self.node_id, self.lease_s)
            if row is not None and row["beating"] and not (
                    row["host"] == host and not process_alive(row["pid"])):
                raise StoreInUse(
                    f"node id {self.node_id!r} is in use by a running turnkeeper (pid "
                    f"{row['pid']} on {row['host']}) on {self.db.where}; give each daemon "
                    "its own [fleet] node_id")
            await conn.execute(
                "INSERT INTO nodes (node_id, pid, host, started_at, heartbeat_at)"
                " VALUES ($1, $2, $3, now(), now()) ON CONFLICT (node_id) DO UPDATE SET"
                " pid = excluded.pid, host = excluded.host, started_at = now(),"
                " heartbeat_at = now(), stopped_at = NULL, turns = 0",
                self.node_id, os.getpid(), host)
            await conn.execute(
                "WITH l AS MATERIALIZED (SELECT id FROM turns WHERE owner = $1 ORDER BY id"
                " FOR UPDATE) UPDATE turns t SET owner = NULL, lease_until = NULL FROM l"
                " WHERE t.id = l.id AND t.owner = $1", self.node_id)

    def fence(self, turn_id: str) -> int | None:
        """The epoch a write of `turn_id` must carry (None: not a claimed turn); raises
        StaleLease for a turn this node lost."""
        if turn_id in self.lost:
            raise StaleLease(f"turn {turn_id}: node {self.node_id} lost its claim; "
                             "not written")
        return self.claims.get(turn_id)

    async def event_block_start(self) -> int:
        """Where this node's bus starts numbering: the start of a block of 2**32 numbers
        no other node has used or will use (each start takes the next block), so the
        events of several nodes never share a number."""
        async def reserve(conn: Conn) -> int:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", EVENT_BLOCK_LOCK)
                top = await conn.fetchval(
                    "SELECT GREATEST(COALESCE((SELECT max(seq) FROM events), 0),"
                    " COALESCE((SELECT value FROM meta WHERE key = 'event_seq_reserved'),"
                    " 0))")
                base = (int(top) // EVENT_BLOCK + 1) * EVENT_BLOCK
                await conn.execute(
                    "INSERT INTO meta (key, value) VALUES ('event_seq_reserved', $1)"
                    " ON CONFLICT (key) DO UPDATE SET value = excluded.value", base)
                return base

        self.event_base = await self.db.read(reserve)
        return self.event_base

    async def events_cursor(self) -> EventCursor:
        """Now: before every transaction still running (their rows are yet to come)."""
        rows = await self.db.fetch(f"SELECT {_SETTLED}::text")
        return EventCursor(int(rows[0][0]), 0)

    async def peer_events(self, *, after: EventCursor, turn: str | None = None,
                          limit: int = 1000) -> tuple[list[dict[str, Any]], EventCursor]:
        """Events the other nodes wrote after `after` (this node's own come from its
        bus), and the cursor to go on from. Only rows of transactions older than every
        one still running, in (transaction, position) order: any row that commits later
        sorts after every row read, so none is stepped over."""
        base = self.event_base
        sql = ("SELECT tx::text AS tx, pos, data FROM events WHERE tx >= $1::text::xid8"
               f" AND (tx > $1::text::xid8 OR pos > $2) AND tx < {_SETTLED}"
               " AND (seq < $3 OR seq >= $4)"
               + (" AND turn = $6" if turn is not None else "")
               + " ORDER BY tx, pos LIMIT $5")
        args: list[Any] = [str(after.tx), after.pos, base, base + EVENT_BLOCK, limit]
        if turn is not None:
            args.append(turn)
        rows = await self.db.fetch(sql, *args)
        if not rows:
            return [], after
        last = rows[-1]
        return ([json.loads(r["data"]) for r in rows],
                EventCursor(int(last["tx"]), int(last["pos"])))

    async def claim(self, limit: int) -> list[Claimed]:
        """Take up to `limit` runnable turns, oldest first, that no live node holds: each
        gets a lease and a new epoch. A session's turns are taken in order: a turn is not
        taken while an earlier unfinished turn of its session is held elsewhere or not
        held at all (this node's local scheduler orders the ones it holds). A turn this
        node holds is never taken again, even with its lease expired at the database:
        that claim is the renewal's to re-take, under the epoch the node's writes carry.

        The claim is one statement, its own transaction: a claim that finds nothing (the
        turns another node's submit announced, taken by that node) costs one round trip
        and no row. The turns it took come with their checkpoints, and their messages
        and trail rows are read by one more statement once it committed: from then on no
        other node's write of them can commit (their epoch is this claim's), so the
        rows read are the ones the checkpoint was written with. Should that read fail,
        the turns are handed back (or, the connection lost, left to their lease)."""
        if limit <= 0:
            return []
        held = list(self.claims)

        async def take(conn: Conn) -> tuple[list[asyncpg.Record], list[asyncpg.Record]]:
            turns = await conn.fetch(CLAIM, self.node_id, limit, self.lease_s, held)
            if not turns:
                return [], []
            ids = [t["id"] for t in turns]
            try:
                return turns, await conn.fetch(CLAIMED_ROWS, ids)
            except BaseException:
                with anyio.CancelScope(shield=True), contextlib.suppress(*DB_ERRORS):
                    with anyio.fail_after(CONNECT_TIMEOUT):
                        await conn.execute(HAND_BACK, self.node_id, ids,
                                           [t["epoch"] for t in turns])
                raise

        turns, both = await self.db.read(take)
        rows = rows_by_turn((r["turn"], r["data"]) for r in both if r["k"] == 0)
        lines = rows_by_turn((r["turn"], r["data"]) for r in both if r["k"] == 1)
        claimed = []
        for t in sorted(turns, key=lambda t: t["seq"]):
            self.claims[t["id"]] = t["epoch"]
            self.lost.discard(t["id"])
            claimed.append(Claimed(
                record=record_of(t["record"], t["message"]),
                checkpoint=with_messages(json.loads(t["checkpoint"]),
                                         rows.get(t["id"], ()), lines.get(t["id"], ())),
                epoch=t["epoch"]))
        return claimed

    async def backlog(self) -> int:
        """Unfinished turns no live node holds (never claimed, handed back, or their
        lease run out): the fleet's queue."""
        rows = await self.db.fetch(
            f"SELECT count(*) FROM turns WHERE state NOT IN {TERMINAL_SQL}"
            " AND (owner IS NULL OR lease_until < now())")
        return int(rows[0][0])

    async def renew(self) -> dict[str, int]:
        """Extend the lease of every turn this node holds, and beat the node's heartbeat:
        turn -> epoch of the claims the database renewed (a turn missing is lost). A
        claim is renewed only under the epoch the node holds, and then even after its
        lease expired at the database (the database was unreachable, the node paused):
        no other node claimed the turn meanwhile, so it is still this node's to run."""
        held = dict(self.claims)

        async def beat(conn: Conn) -> list[asyncpg.Record]:
            # One statement, its own transaction: one round trip on the renewal's own
            # connection. The node's row first (`l` reads the count of `n`, and sorts
            # before it locks), as a release locks it; then the turns, locked in id order
            # as the writer's batched update locks them (`postgres_batch.TURN_UPDATE`):
            # none of them ever waits for another's rows in the opposite order.
            return await conn.fetch(RENEW, self.node_id, list(held), list(held.values()),
                                    self.lease_s, len(held))

        return {r["id"]: r["epoch"] for r in await self.db.read(beat, on=self.db.lease_conn)}

    def abandon(self, turn_ids: Iterable[str]) -> None:
        """Turns whose claim is lost: every later write of them is refused here, before
        it reaches the database."""
        for turn_id in turn_ids:
            self.claims.pop(turn_id, None)
            self.lost.add(turn_id)

    async def release(self) -> int:
        """A clean stop: hand back every turn this node holds (their checkpoints are
        written), so another node takes them at once instead of after the lease."""
        held = list(self.claims)

        async def give_back(conn: Conn) -> str:
            async with conn.transaction():
                await conn.execute("UPDATE nodes SET stopped_at = now(), turns = 0"
                                   " WHERE node_id = $1", self.node_id)
                status = await conn.execute(
                    "WITH l AS MATERIALIZED (SELECT id FROM turns WHERE owner = $1 AND id ="
                    " ANY($2::text[]) ORDER BY id FOR UPDATE) UPDATE turns t SET owner ="
                    " NULL, lease_until = NULL FROM l WHERE t.id = l.id AND t.owner = $1",
                    self.node_id, held)
                await conn.execute("SELECT pg_notify($1, '')", CHANNEL_TURNS)
                return status

        status = await self.db.read(give_back)
        self.claims.clear()
        return int(status.split()[-1])

    async def post_mail(self, turn_id: str, kind: str, body: dict[str, Any]) -> None:
        """A message (steer, answer, cancel) for a turn another node runs, durable when
        this returns; the node holding the turn hears of it at once (NOTIFY)."""
        await self.writer.write([("INSERT INTO mail (turn, kind, body) VALUES ($1, $2, $3)",
                            (turn_id, kind, dumps(body))),
                           ("SELECT pg_notify($1, $2)", (CHANNEL_MAIL, turn_id))])

    async def pending_mail(self) -> list[tuple[int, str, str, dict[str, Any]]]:
        """Mail for the turns this node holds, oldest first: (id, turn, kind, body)."""
        if not self.claims:
            return []
        rows = await self.db.fetch("SELECT id, turn, kind, body FROM mail WHERE turn ="
                                 " ANY($1::text[]) ORDER BY id", list(self.claims))
        return [(r["id"], r["turn"], r["kind"], json.loads(r["body"])) for r in rows]

    async def drop_mail(self, mail_id: int) -> None:
        await self.writer.write([("DELETE FROM mail WHERE id = $1", (mail_id,))])

    async def listen(self, on_notify: Callable[[str, str], None]) -> None:
        """Hear NOTIFY on the fleet's channels until cancelled or the connection is lost
        (then it raises StoreError: the caller listens again)."""
        try:
            conn = await asyncpg.connect(self.db.url, timeout=CONNECT_TIMEOUT)
        except DB_ERRORS as exc:
            raise StoreError(f"listen: {type(exc).__name__}: {exc}") from exc
        lost = anyio.Event()

        def heard(_conn: Any, _pid: int, channel: str, payload: object) -> None:
            on_notify(channel, str(payload))

        try:
            conn.add_termination_listener(lambda _conn: lost.set())
            await conn.add_listener(CHANNEL_TURNS, heard)
            await conn.add_listener(CHANNEL_MAIL, heard)
            await conn.add_listener(CHANNEL_BREAKERS, heard)
            await conn.add_listener(CHANNEL_RETRY_AFTER, heard)
            await lost.wait()
            raise StoreError("listen: the connection was closed")
        except DB_ERRORS as exc:
            raise StoreError(f"listen: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.terminate()

    async def nodes(self) -> list[dict[str, Any]]:
        """The fleet as the database sees it: each node, its heartbeat and its turns."""
        rows = await self.db.fetch(
            "SELECT node_id, pid, host, extract(epoch FROM started_at) AS started_at,"
            " extract(epoch FROM heartbeat_at) AS heartbeat_at,"
            " extract(epoch FROM stopped_at) AS stopped_at,"
            " extract(epoch FROM now() - heartbeat_at) AS silent_s,"
            " (SELECT count(*) FROM turns t WHERE t.owner = n.node_id AND t.state NOT IN"
            f" {TERMINAL_SQL} AND t.lease_until > now()) AS turns"
            " FROM nodes n ORDER BY node_id")
        return [{"node_id": r["node_id"], "pid": r["pid"], "host": r["host"],
                 "started_at": float(r["started_at"]),
                 "heartbeat_at": float(r["heartbeat_at"]),
                 "stopped_at": None if r["stopped_at"] is None else float(r["stopped_at"]),
                 "silent_s": float(r["silent_s"]),
                 "alive": r["stopped_at"] is None and float(r["silent_s"]) < self.lease_s,
                 "turns": int(r["turns"])} for r in rows]
