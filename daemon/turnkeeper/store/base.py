"""The store interface. Everything the daemon persists goes through these calls, so a
shared PostgreSQL store can later let several daemons share the work.

Writes that the caller awaits are durable when the await returns (a submit answered 202
is on disk). `append_event` is the one write that is not awaited: events are batched
with the next durable write.
"""

from __future__ import annotations

from typing import Any, Protocol

from turnkeeper.events import Event

EX_IOERR = 74


class StoreError(Exception):
    """The store cannot be used: the message says why and where."""

    exit_code = EX_IOERR


class Store(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def max_event_seq(self) -> int: ...

    async def insert_turn(self, record: dict[str, Any], checkpoint: dict[str, Any]) -> int: ...

    async def save_turn(self, record: dict[str, Any],
                        checkpoint: dict[str, Any] | None = None) -> None: ...

    async def get_turn(self, turn_id: str) -> dict[str, Any] | None: ...

    async def get_checkpoint(self, turn_id: str) -> dict[str, Any] | None: ...

    async def list_turns(self, *, state: str | None = None, session: str | None = None,
                         limit: int = 100) -> list[dict[str, Any]]: ...

    async def unfinished_turns(self) -> list[tuple[dict[str, Any], dict[str, Any]]]: ...

    async def session_history(self, session: str, *, before_seq: int
                              ) -> list[dict[str, Any]]: ...

    def append_event(self, event: Event) -> None: ...

    async def events(self, *, turn: str | None = None, after_seq: int = 0,
                     limit: int = 10_000) -> list[dict[str, Any]]: ...

    async def journal_intent(self, key: str, *, turn: str, tool: str, arguments: str,
                             idempotent: bool) -> None: ...

    async def journal_outcome(self, key: str, outcome: dict[str, Any]) -> None: ...

    async def journal_get(self, key: str) -> dict[str, Any] | None: ...

    async def dead_letters(self) -> list[dict[str, Any]]: ...

    async def mark_replayed(self, turn_id: str, new_turn_id: str) -> None: ...

    async def flush(self) -> None: ...
