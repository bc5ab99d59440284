"""A store that keeps nothing, for the benchmarks that measure the daemon's work without
its persistence: every write returns at once, every read finds nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from turnkeeper.events import Event
from turnkeeper.policy.idempotency import IdempotencyKey, StoredKey
from turnkeeper.policy.limits import FinishedTurn
from turnkeeper.policy.store_outage import StoreOutage
from turnkeeper.store.base import MessageRows, Store
from turnkeeper.store.outbox import MemoryOutbox


class DiscardStore(MemoryOutbox):
    """The Store interface with nothing behind it: every write returns at once (and is
    counted in `writes`); its webhook outbox stays empty."""

    def __init__(self) -> None:
        super().__init__()
        self._seq = 0
        self.writes = 0
        self.outage = StoreOutage()  # never degraded: nothing can fail

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def max_event_seq(self) -> int:
        return 0

    def reserve_event_seqs(self, upto: int) -> None:
        return None

    async def insert_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                          events: Sequence[Event] = (), within_s: float | None = None,
                          idempotency: IdempotencyKey | None = None) -> int:
        self._seq += 1
        self.writes += 1
        return self._seq

    async def save_turn(self, record: dict[str, Any],
                        checkpoint: dict[str, Any] | None = None, *,
                        messages: MessageRows | None = None,
                        trail: MessageRows | None = None,
                        events: Sequence[Event] = ()) -> None:
        self.writes += 1

    async def requeue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                           messages: MessageRows | None = None,
                           trail: MessageRows | None = None,
                           events: Sequence[Event] = ()) -> None:
        self.writes += 1

    async def append_message(self, turn_id: str, message: dict[str, Any], *,
                             updated_at: float, events: Sequence[Event] = ()) -> None:
        self.writes += 1

    async def get_turn(self, turn_id: str) -> dict[str, Any] | None:
        return None

    async def get_checkpoint(self, turn_id: str) -> dict[str, Any] | None:
        return None

    async def list_turns(self, *, state: str | None = None, session: str | None = None,
                         limit: int = 100, since: float | None = None,
                         before_seq: int | None = None) -> list[dict[str, Any]]:
        return []

    async def finished_usage(self, *, since: float | None = None,
                             limit: int = 100_000) -> list[FinishedTurn]:
        return []

    async def prune(self, *, finished_before: float, dead_letters: bool = False,
                    limit: int) -> int:
        return 0

    async def idempotency_key(self, key: str) -> StoredKey | None:
        return None

    async def prune_idempotency_keys(self, *, created_before: float, limit: int) -> int:
        return 0

    async def unfinished_turns(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return []

    async def session_history(self, session: str, *, before_seq: int
                              ) -> list[dict[str, Any]]:
        return []

    def append_event(self, event: Event) -> None:
        return None

    async def events(self, *, turn: str | None = None, after_seq: int = 0,
                     limit: int = 10_000) -> list[dict[str, Any]]:
        return []

    async def journal_intent(self, key: str, *, turn: str, tool: str, arguments: str,
                             idempotent: bool) -> None:
        self.writes += 1

    async def journal_outcome(self, key: str, outcome: dict[str, Any]) -> None:
        self.writes += 1

    async def journal_get(self, key: str) -> dict[str, Any] | None:
        return None

    async def dead_letters(self) -> list[dict[str, Any]]:
        return []

    async def mark_replayed(self, turn_id: str, new_turn_id: str) -> None:
        return None

    async def flush(self) -> None:
        return None


def discard_store() -> Store:
    """A `DiscardStore` typed as the store interface: a method the interface gains and
    the class lacks is a type error here, not a turn dying of a TypeError mid-benchmark."""
    return DiscardStore()
