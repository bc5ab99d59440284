"""The intake room with the real supervisor and a real SQLite file, in fake time: a batch
is one store transaction, is checked whole before anything is taken, and the overload
guard fed with lag samples closes and reopens intake."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from tests.unit.test_supervisor import GatedModel, write_config

from turnkeeper.clock import FakeClock
from turnkeeper.config import PolicyVersion, load_config
from turnkeeper.lifecycle.systemd import Notifier
from turnkeeper.store.base import StoreError
from turnkeeper.store.sqlite import SQLiteStore
from turnkeeper.supervisor import IntakeRefused, Supervisor
from turnkeeper.supervisor.intake import BatchItemInvalid, SubmitRequest

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class H:
    sup: Supervisor
    store: SQLiteStore
    clock: FakeClock


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[H]:
    config_path = tmp_path / "turnkeeper.toml"
    write_config(config_path, max_concurrent=2, max_queued=10)
    with config_path.open("a") as f:  # the guard as by default: 2 samples of 0.5 s
        f.write("\n[budget.profiles.quick]\nmax_steps = 3\n")
    config, digest = load_config(config_path)
    policy = PolicyVersion(version=1, config=config, source_path=str(config_path),
                    content_hash=digest)
    clock, model = FakeClock(), GatedModel()
    store = SQLiteStore(tmp_path / "state.sqlite3")
    await store.open()
    sup = Supervisor(policy=policy, store=store, clock=clock, notifier=Notifier(None),
                     config_path=str(config_path))
    sup.runtime.providers["m"] = model
    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        await sup.start(tg)
        sup.scheduling.set_paused(True)  # the turns stay queued: only intake is tested
        yield H(sup, store, clock)
        await sup.stop()
        await store.close()
        tg.cancel_scope.cancel()


async def test_a_batch_is_written_in_one_store_transaction(h: H) -> None:
    # One submit first: the event numbers the bus reserves ahead (a write of their own,
    # once per block) are reserved before the batch is measured.
    await h.sup.submit(message="first", session=None, budget={}, deadline=None)
    await h.store.flush()
    before = h.store.commits
    results = await h.sup.intake.submit_batch(
        [SubmitRequest(message=f"m{i}", session="s" if i % 2 else None) for i in range(8)])
    assert h.store.commits == before + 1
    assert all(isinstance(r, dict) for r in results)
    turns = [r for r in results if isinstance(r, dict)]
    assert [t["message"] for t in turns] == [f"m{i}" for i in range(8)]
    assert [t["seq"] for t in turns] == sorted(t["seq"] for t in turns)  # in order sent
    stored = {t["id"] for t in await h.store.list_turns(limit=100)}
    assert {t["id"] for t in turns} <= stored
    assert len(h.sup.queue) == 9


async def test_an_unknown_profile_in_a_batch_takes_nothing(h: H) -> None:
    with pytest.raises(BatchItemInvalid) as bad:
        await h.sup.intake.submit_batch([SubmitRequest(message="a", profile="quick"),
                                         SubmitRequest(message="b", profile="slow")])
    assert bad.value.index == 1 and bad.value.field == "[1].profile"
    assert "no budget profile 'slow'" in str(bad.value)
    assert h.sup.live == {} and await h.store.list_turns(limit=10) == []


async def test_a_batch_over_the_queue_room_takes_nothing(h: H) -> None:
    await h.sup.intake.submit_batch([SubmitRequest(message=f"m{i}") for i in range(7)])
    with pytest.raises(IntakeRefused) as refused:
        await h.sup.intake.submit_batch([SubmitRequest(message=f"n{i}") for i in range(4)])
    assert "room for 3 more turns, not the 4" in str(refused.value)
    assert len(h.sup.queue) == 7 and len(h.sup.live) == 7
    await h.sup.intake.submit_batch([SubmitRequest(message=f"n{i}") for i in range(3)])
    assert len(h.sup.queue) == 10


async def test_lag_samples_close_intake_and_calm_ones_reopen_it(h: H) -> None:
    intake = h.sup.intake
    for _ in range(2):
        h.clock.advance(0.6)
        intake.observe_loop_lag(0.5)
    with pytest.raises(IntakeRefused) as refused:
        await h.sup.submit(message="late", session=None, budget={}, deadline=None)
    assert "daemon.overload_lag" in str(refused.value)
    with pytest.raises(IntakeRefused):
        await intake.submit_batch([SubmitRequest(message="late too")])
    assert h.sup.live == {}
    for _ in range(21):  # 0.1 s apart: 2 s of calm after the first
        h.clock.advance(0.1)
        intake.observe_loop_lag(0.001)
    assert not intake.overload.shedding
    assert intake.overload.snapshot()["refused"] == 2
    await h.sup.submit(message="on time", session=None, budget={}, deadline=None)
    assert len(h.sup.queue) == 1


async def test_a_batch_the_store_cannot_write_is_forgotten_and_answered_with_the_errors(
        h: H) -> None:
    await h.store.close()  # every write now fails: "state database is closed"
    results = await h.sup.intake.submit_batch([SubmitRequest(message=f"m{i}")
                                               for i in range(3)])
    assert [type(r).__name__ for r in results] == ["StoreError"] * 3
    assert "closed" in str(results[0])
    assert h.sup.live == {} and len(h.sup.queue) == 0  # nothing half-taken


async def test_a_message_the_store_cannot_write_leaves_the_inbox_as_it_was(h: H) -> None:
    record = await h.sup.submit(message="hello", session=None, budget={}, deadline=None)
    live = h.sup.live[record.id]
    await h.store.close()  # every write now fails: "state database is closed"
    with pytest.raises(StoreError, match="closed"):
        await h.sup.intake.post_message(record.id, kind="steer", text="and this",
                                        redirect=False)
    # The sender was told it was not taken: kept, the turn would act on it anyway.
    assert live.record.inbox == []
