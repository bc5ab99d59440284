"""The webhook outbox, the same on every store: a delivery's row is written with the
event it carries, in its transaction; due rows come oldest first, in-flight ones left
out; a settled row is never due again; the cap gives up the oldest; prune deletes what
was settled long ago."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tests.unit.test_store_conformance import event, every_store, record

from turnkeeper.events import Event
from turnkeeper.store.base import Store
from turnkeeper.store.outbox import DELIVERED, FAILED, PENDING, Backlog

__all__ = ["every_store"]

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def finished_only(e: Event) -> Sequence[str]:
    return ("a", "b") if e.type == "turn.finished" else ()


async def test_outbox_rows_are_written_with_the_event_in_every_write(store: Store) -> None:
    store.set_webhook_route(finished_only)
    a = record("t_a")
    await store.insert_turn(a, {}, events=[event(1, "t_a", "turn.queued")])
    await store.save_turn({**a, "state": "completed", "updated_at": 150.0},
                          events=[event(2, "t_a", "turn.finished")])
    store.append_event(event(3, None, "turn.finished"))
    await store.flush()
    due = await store.webhook_due("a", now=1e9, limit=10)
    assert [(d.seq, d.type, d.attempts) for d in due] == [(2, "turn.finished", 0),
                                                         (3, "turn.finished", 0)]
    assert due[0].body == event(2, "t_a", "turn.finished").encoded()
    assert [d.seq for d in await store.webhook_due("b", now=1e9, limit=10)] == [2, 3]
    backlog = await store.webhook_backlog()
    assert backlog["a"].pending == 2 and backlog["a"].oldest_pending_at == 3.0


async def test_no_route_writes_no_outbox_row(store: Store) -> None:
    store.append_event(event(1, None, "turn.finished"))
    store.set_webhook_route(finished_only)
    store.set_webhook_route(None)
    store.append_event(event(2, None, "turn.finished"))
    await store.flush()
    assert await store.webhook_due("a", now=1e9, limit=10) == []
    assert await store.webhook_backlog() == {}


async def test_due_rows_skip_in_flight_and_future_ones_and_settle_once(store: Store
                                                                       ) -> None:
    store.set_webhook_route(finished_only)
    for seq in (1, 2, 3):
        store.append_event(event(seq, None, "turn.finished"))
    await store.flush()
    due = await store.webhook_due("a", now=1e9, limit=10, skip={1})
    assert [d.seq for d in due] == [2, 3]
    await store.webhook_release()  # what this daemon held is due again
    await store.webhook_settle("a", 2, state=PENDING, attempts=1, next_at=500.0,
                               error="HTTP 500", now=10.0)
    await store.webhook_settle("a", 3, state=DELIVERED, attempts=1, next_at=10.0,
                               error=None, now=10.0)
    assert [d.seq for d in await store.webhook_due("a", now=100.0, limit=10)] == [1]
    later = await store.webhook_due("a", now=600.0, limit=10)
    assert [(d.seq, d.attempts) for d in later] == [(1, 0), (2, 1)]
    # a delivered row is never pending again, even if settled again by a late answer
    await store.webhook_settle("a", 3, state=PENDING, attempts=2, next_at=0.0,
                               error="late", now=20.0)
    assert [d.seq for d in await store.webhook_due("a", now=1e9, limit=10)] == [1, 2]
    backlog = await store.webhook_backlog()
    assert backlog["a"] == Backlog(pending=2, delivered=1, failed=0,
                                   oldest_pending_at=2.0, last_error="HTTP 500")


async def test_event_written_twice_gets_one_delivery(store: Store) -> None:
    store.set_webhook_route(finished_only)
    store.append_event(event(1, None, "turn.finished"))
    await store.flush()
    await store.webhook_settle("a", 1, state=DELIVERED, attempts=1, next_at=5.0,
                               error=None, now=5.0)
    store.append_event(event(1, None, "turn.finished"))
    await store.flush()
    assert await store.webhook_due("a", now=1e9, limit=10) == []


async def test_give_up_fails_the_oldest_pending_and_keeps_them_visible(store: Store
                                                                       ) -> None:
    store.set_webhook_route(finished_only)
    for seq in (1, 2, 3, 4):
        store.append_event(event(seq, None, "turn.finished"))
    await store.flush()
    assert await store.webhook_give_up("a", count=3, error="outbox full", now=50.0) == 3
    assert [d.seq for d in await store.webhook_due("a", now=1e9, limit=10)] == [4]
    backlog = await store.webhook_backlog()
    assert backlog["a"].failed == 3 and backlog["a"].pending == 1
    assert backlog["a"].last_error == "outbox full"
    assert backlog["b"].pending == 4


async def test_prune_deletes_settled_rows_past_their_keep(store: Store) -> None:
    store.set_webhook_route(finished_only)
    for seq in (1, 2, 3):
        store.append_event(event(seq, None, "turn.finished"))
    await store.flush()
    await store.webhook_settle("a", 1, state=DELIVERED, attempts=1, next_at=10.0,
                               error=None, now=10.0)
    await store.webhook_settle("a", 2, state=FAILED, attempts=1, next_at=10.0,
                               error="HTTP 410", now=10.0)
    assert await store.webhook_prune(delivered_before=11.0, failed_before=5.0) == 1
    assert await store.webhook_prune(delivered_before=11.0, failed_before=11.0) == 1
    backlog = await store.webhook_backlog()
    assert backlog["a"] == Backlog(pending=1, oldest_pending_at=4.0)
