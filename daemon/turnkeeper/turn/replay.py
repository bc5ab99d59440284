"""What a resumed turn had published before a stop or a crash cut it, so that the work it
does again publishes each event once.

A step's tools, run again from the journal after a resume (a stored outcome is reused,
not sent again), publish their events again. The events the turn logged after its
checkpoint (published, and kept by the store) are read first, and each event the work
publishes again the same, field for field, is left out: a follower reads every tool
call and result once, even across a restart.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from turnkeeper import jsonwire
from turnkeeper.event_types import EventBody
from turnkeeper.store.base import Store

# An event's envelope, around the fields its type gives it.
_ENVELOPE = frozenset({"seq", "ts", "turn", "type"})


class Replay:
    __slots__ = ("_after", "_store", "_turn", "logged")

    def __init__(self, store: Store, turn: str, after: int | None) -> None:
        self._store = store
        self._turn = turn
        # The last event number when the checkpoint the turn resumed from was taken
        # (None: the turn did not resume from one, nothing is replayed).
        self._after = after
        # While `around` the work: what the turn logged after its checkpoint and has not
        # published again yet.
        self.logged: list[tuple[str, Any]] = []

    @contextlib.asynccontextmanager
    async def around(self) -> AsyncIterator[None]:
        """Around work the turn does again: what it logged is read first, and left out
        of what the work publishes until the work is over."""
        if self._after is not None:
            logged = await self._store.events(turn=self._turn, after_seq=self._after)
            self.logged = [(e["type"], {k: v for k, v in e.items() if k not in _ENVELOPE})
                           for e in logged]
        try:
            yield
        finally:
            self.logged = []

    def was_logged(self, event: EventBody | str, data: dict[str, Any]) -> bool:
        """Whether `event` is one logged since the checkpoint (taken off the list)."""
        kind, fields = ((event.TYPE, event.to_json()) if isinstance(event, EventBody)
                        else (event, data))
        fields = jsonwire.loads(jsonwire.dumps(fields))  # as the store gives them back
        for i, (logged_kind, logged_fields) in enumerate(self.logged):
            if logged_kind == kind and logged_fields == fields:
                del self.logged[i]
                return True
        return False
