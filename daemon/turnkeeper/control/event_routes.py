"""The event streams: one turn's (`/v1/turns/{id}/events`) and every turn's
(`/v1/events`), as NDJSON. A stream replays what the store holds before it goes live, so
a client that reconnects with the last `seq` it saw loses nothing; it subscribes before
reading the store and drops what it has already sent by `seq`, so nothing falls between
the two.

A follower that falls too far behind (its client reads too slowly, or not at all) is
dropped by the bus, as `FollowerBacklog` in `policy/admission.py` decides: its stream
stops at once, even in the middle of a write its client never takes, and ends with one
`stream.dropped` line that names the last `seq` it was sent, to reopen it with `after=`.
What the daemon holds for a follower is bounded: its queue by that rule, a write by
`MAX_BATCH_BYTES`, its socket's buffer by the transport's high-water mark (aiohttp
waits for it to drain past 64 KiB written).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import anyio
from aiohttp import web

from turnkeeper import jsonwire
from turnkeeper.control.http import SUPERVISOR, BadRequest, follower, too_many_followers
from turnkeeper.event_types import TurnReplayed
from turnkeeper.events import TERMINAL_EVENT, EventBus, Follower, Live
from turnkeeper.supervisor import (
    Supervisor,
)

# The largest seq a store can hold (a signed 64-bit integer in SQLite and PostgreSQL): a
# larger `after` is refused before the store is asked.
MAX_SEQ = 2**63 - 1
MAX_BATCH_EVENTS = 500  # events per write of an NDJSON stream
MAX_BATCH_BYTES = 64 * 1024  # bytes per write (a batch ends after the event that passes it)
DROPPED = "stream.dropped"  # the last line of a stream the daemon dropped
DROP_FLUSH_S = 5.0  # how long a dropped stream's last line may take to leave, then cut
REPLAY_PAGE = 1000  # stored events read at a time when a stream replays
FLEET_FOLLOW_POLL_S = 0.25  # how often a turn run by another node is read again


# A batch of lines for the socket and the seq of its last event (None: not a seq a
# stream can be reopened after, an event of another fleet node).
Batch = tuple[list[bytes], int | None]


async def _ndjson(request: web.Request, batches: AsyncGenerator[Batch, None],
                  live: Follower, bus: EventBus, sent: int) -> web.StreamResponse:
    """One write (one chunk, one send) per batch of encoded events: a follower of
    /v1/events under load got one send per event, ~10% of the daemon's CPU in
    bench_concurrency. A live event comes encoded already (once, for the store and every
    stream); a stored one is encoded here. `sent`: the seq a reopened stream would start
    after if it were dropped before it sent anything."""
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson",
                                       "Cache-Control": "no-store"})
    await resp.prepare(request)
    transport = request.transport
    if transport is not None:
        live.pending = transport.get_write_buffer_size
    with anyio.CancelScope() as writing:
        live.on_drop = writing.cancel
        try:
            async with aclosing(batches):
                async for lines, last in batches:
                    # In the socket's buffer before the write waits for it to drain: a
                    # drop during the wait has sent these lines already.
                    if last is not None:
                        sent = max(sent, last)
                    await resp.write(b"".join(lines))
            # Inside the try: a follower that left is only noticed here when the stream
            # ends with nothing more to send (the daemon stopping), and that is no error.
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            return resp
        finally:
            live.pending = live.on_drop = None
    if live.dropped is None:
        return resp
    after = bus.resume_point(sent, live.discard())
    line = jsonwire.dumps({"type": DROPPED, "reason": live.dropped, "after": after,
                           "error": f"this stream fell too far behind ({live.dropped}): "
                                    f"open it again with after={after}"})
    resp.force_close()  # the connection ends with the stream
    with bus.clock.move_on_after(DROP_FLUSH_S) as flush:
        try:
            await resp.write(line + b"\n")  # in the socket's buffer before the wait
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            return resp
    if flush.cancelled_caught and transport is not None:
        transport.abort()  # it reads nothing: let go of what its socket holds
    return resp


def _stored(events: list[dict[str, Any]]) -> Batch:
    return [jsonwire.dumps(ev) + b"\n" for ev in events], events[-1]["seq"]


def _ready(live: Follower, first: Live) -> list[Live]:
    """`first` and the events already waiting behind it (up to a bound in events and in
    bytes)."""
    batch = [first]
    size = len(first.line)
    while len(batch) < MAX_BATCH_EVENTS and size < MAX_BATCH_BYTES:
        try:
            item = live.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream):
            break
        batch.append(item)
        size += len(item.line)
    return batch


async def turn_events(request: web.Request) -> web.StreamResponse:
    sup = request.app[SUPERVISOR]
    turn_id = request.match_info["id"]
    await sup.get_turn(turn_id)  # raises UnknownTurn (404)
    with follower(request) as admitted:
        if not admitted:
            raise too_many_followers(request)
        with sup.bus.subscribe(turn=turn_id) as live:
            return await _ndjson(request, _turn_events(sup, turn_id, live), live,
                                 sup.bus, 0)


async def _turn_events(sup: Supervisor, turn_id: str, live: Follower
                       ) -> AsyncGenerator[Batch, None]:
    last = 0
    # Events are committed by the store's writer after they are published: one
    # published just before we subscribed may not be readable yet, and would be in
    # neither the history nor the live stream. The writer commits in order, so once
    # this flush is durable every such event is too.
    await sup.store.flush()
    stored = await sup.store.events(turn=turn_id)
    # A replayed dead letter finished once already: only a finish after its last
    # replay ends the stream.
    replayed_at = max((i for i, ev in enumerate(stored)
                       if ev["type"] == TurnReplayed.TYPE), default=-1)
    for i, ev in enumerate(stored):
        if ev["type"] == TERMINAL_EVENT and i > replayed_at:
            yield _stored(stored[:i + 1])
            return
    if stored:
        last = stored[-1]["seq"]
        yield _stored(stored)
    if turn_id not in sup.live:
        if sup.fleet is not None:  # run by another node: follow its stored rows
            async for rows in _stored_follow(sup, turn_id, stored):
                yield _stored(rows)
        return  # finished before we subscribed, and its events are all above
    async for first in live:
        batch: list[bytes] = []
        for event in _ready(live, first):
            if event.seq <= last:
                continue
            batch.append(event.line)
            last = event.seq
            if event.type == TERMINAL_EVENT:
                yield batch, last
                return
        if batch:
            yield batch, last


async def _stored_follow(sup: Supervisor, turn_id: str, stored: list[dict[str, Any]]
                         ) -> AsyncIterator[list[dict[str, Any]]]:
    """The events of a turn another node runs, as that node commits them: its stored
    rows, read again every quarter second, until the turn finishes or the daemon stops.
    Kept apart by `seq`, not ordered by it: each node numbers from its own block."""
    seen = {ev["seq"] for ev in stored}
    while not sup.stopping_event.is_set():
        await sup.clock.sleep(FLEET_FOLLOW_POLL_S)
        new = [ev for ev in await sup.store.events(turn=turn_id) if ev["seq"] not in seen]
        if not new:
            continue
        seen.update(ev["seq"] for ev in new)
        yield new
        if any(ev["type"] == TERMINAL_EVENT for ev in new):
            return


def type_filter(spec: str) -> Callable[[str], bool]:
    """`type=tool.call,turn.`: each an exact event type, or a prefix ending in a dot;
    empty: every type."""
    exact = {t for t in spec.split(",") if t and not t.endswith(".")}
    prefixes = tuple(t for t in spec.split(",") if t.endswith("."))
    if not exact and not prefixes:
        return lambda _type: True
    return lambda t: t in exact or t.startswith(prefixes)


async def all_events(request: web.Request) -> web.StreamResponse:
    """Every event, or one turn's (`turn=`), of some types (`type=`), live; with
    `after=SEQ` the stored events after that `seq` first (model text is live only)."""
    sup = request.app[SUPERVISOR]
    after = _after_param(request)
    turn = request.query.get("turn") or None
    keep = type_filter(request.query.get("type") or "")

    async def stream(live: Follower) -> AsyncGenerator[Batch, None]:
        last = -1
        if after is not None:
            last = after
            async for batch, read_upto in _history(sup, turn, after, keep):
                last = read_upto
                if batch is not None:
                    yield batch
        if sup.fleet is None:
            async for first in live:
                batch = _live_batch(live, first, last, keep)
                if batch is not None:
                    yield batch
            return
        async for batch in _fleet_live(sup, live, turn, last, keep):
            yield batch

    with follower(request) as admitted:
        if not admitted:
            raise too_many_followers(request)
        with sup.bus.subscribe(turn=turn) as live:
            # Dropped before it sent anything: it reopens after what it had asked for,
            # or after the last event published before it subscribed.
            start = after if after is not None else sup.bus.last_seq
            return await _ndjson(request, stream(live), live, sup.bus, start)


def _after_param(request: web.Request) -> int | None:
    """`after=SEQ`, a whole number a store can hold; raises BadRequest."""
    raw = request.query.get("after")
    if raw in (None, ""):
        return None
    try:
        after = int(str(raw))
    except ValueError:
        raise BadRequest("after must be a whole number (an event's seq)",
                         field="after") from None
    if not 0 <= after <= MAX_SEQ:
        raise BadRequest(f"after must be from 0 to {MAX_SEQ}", field="after")
    return after


async def _history(sup: Supervisor, turn: str | None, after: int,
                   keep: Callable[[str], bool]
                   ) -> AsyncGenerator[tuple[Batch | None, int], None]:
    """The stored events after `after`, a page at a time: each page's kept events (None
    when it kept none) and the last seq it read."""
    # As for one turn's stream: what was published before we subscribed is durable once
    # this flush is, so history and live leave no gap.
    await sup.store.flush()
    last = after
    while True:
        page = await sup.store.events(turn=turn, after_seq=last, limit=REPLAY_PAGE)
        if not page:
            return
        last = page[-1]["seq"]
        kept = [e for e in page if keep(e["type"])]
        yield (_stored(kept) if kept else None), last
        if len(page) < REPLAY_PAGE:
            return


def _live_batch(live: Follower, head: Live, last: int,
                keep: Callable[[str], bool]) -> Batch | None:
    """The live events ready with `head`, those after `last` of the kept types."""
    ready = _ready(live, head)
    lines = [event.line for event in ready if event.seq > last and keep(event.type)]
    return (lines, ready[-1].seq) if lines else None


async def _fleet_live(sup: Supervisor, live: Follower, turn: str | None, last: int,
                      keep: Callable[[str], bool]) -> AsyncGenerator[Batch, None]:
    """A node of a fleet: this node's events from its bus, the other nodes' from the
    database as they reach it (read every quarter second)."""
    assert sup.fleet is not None
    store = sup.fleet.store
    cursor = await store.events_cursor()
    while not sup.stopping_event.is_set():
        head: Live | None = None
        with sup.clock.move_on_after(FLEET_FOLLOW_POLL_S):
            try:
                head = await live.receive()
            except anyio.EndOfStream:
                return
        if head is not None:
            batch = _live_batch(live, head, last, keep)
            if batch is not None:
                yield batch
        peers, cursor = await store.peer_events(after=cursor, turn=turn)
        kept = [e for e in peers if keep(e["type"])]
        if kept:
            yield _stored(kept)[0], None
