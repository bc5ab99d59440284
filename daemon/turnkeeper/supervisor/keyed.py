"""Keyed submits: a submit (or a batch item) that carries an Idempotency-Key answers the
turn its key already made instead of making a second one; the rule is
`policy/idempotency.py`, and the key is written with the turn, in its transaction
(`Store.insert_turn`), so it holds across restarts and across a fleet's nodes.

The key is looked up before intake is checked: a client retrying a submit whose answer
it lost gets its turn even while the daemon now refuses new work. Two submits with one
key at once both find no key; the store lets one insert through and refuses the other
(`KeyTaken`), which then reads the key again and answers the turn that holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from turnkeeper.policy.idempotency import (
    IdempotencyKey,
    KeyConflict,
    NewTurn,
    decide,
    fingerprint,
    new_key,
)
from turnkeeper.store.base import KeyTaken, StoreError
from turnkeeper.supervisor.core import SupervisorCore
from turnkeeper.supervisor.errors import BatchItemInvalid, IdempotencyConflict
from turnkeeper.supervisor.intake import Intake, SubmitRequest


@dataclass(frozen=True, slots=True)
class Existing:
    """The turn a submit's key made before: answered 200, not 202."""

    turn: dict[str, Any]


def submit_fingerprint(req: SubmitRequest) -> str:
    fields = asdict(req)
    fields.pop("idempotency_key", None)
    fields.pop("traceparent", None)
    return fingerprint(fields)


class KeyedSubmits:
    def __init__(self, core: SupervisorCore, intake: Intake) -> None:
        self.core = core
        self.intake = intake

    def _key(self, req: SubmitRequest) -> IdempotencyKey | None:
        if req.idempotency_key is None:
            return None
        return new_key(req.idempotency_key, fingerprint=submit_fingerprint(req),
                       now=self.core.clock.time(),
                       window_s=self.core.config.daemon.idempotency_window_s)

    async def _existing(self, key: IdempotencyKey) -> dict[str, Any] | None:
        """The turn `key` made from the same submit, or None (no live key, or its turn
        was pruned); raises IdempotencyConflict for a key that made another submit's."""
        core = self.core
        stored = await core.store.idempotency_key(key.key)
        decision = decide(stored, fingerprint=key.fingerprint, now=core.clock.time(),
                          window_s=core.config.daemon.idempotency_window_s)
        if isinstance(decision, NewTurn):
            return None
        if isinstance(decision, KeyConflict):
            raise IdempotencyConflict(decision.message)
        live = core.live.get(decision.turn)
        if live is not None:
            return live.record.to_json()
        return await core.store.get_turn(decision.turn)

    async def submit(self, req: SubmitRequest) -> tuple[dict[str, Any], bool]:
        """The turn for `req` and whether it was made now (False: its key made it
        before). Without a key, a plain submit."""
        key = self._key(req)
        for _ in range(2):
            if key is not None:
                existing = await self._existing(key)
                if existing is not None:
                    return existing, False
            try:
                record = await self.intake.submit(
                    message=req.message, session=req.session, budget=req.budget or {},
                    deadline=req.deadline, profile=req.profile, model=req.model,
                    agent=req.agent, idempotency=key, traceparent=req.traceparent,
                    output_schema=req.output_schema)
            except KeyTaken:  # made by a submit with the same key meanwhile: read it
                continue
            return record.to_json(), True
        raise StoreError("the idempotency key was taken and released again while the "
                         "submit was written; send it again")

    async def submit_batch(self, requests: Sequence[SubmitRequest]
                           ) -> list[dict[str, Any] | Existing | Exception]:
        """`Intake.submit_batch` for the items no key of theirs made before; those that
        one did are answered as `Existing`. A key twice in the batch, or a key that
        made another submit's turn, refuses the batch (`BatchItemInvalid`)."""
        keys = [self._key(r) for r in requests]
        seen: dict[str, int] = {}
        out: list[dict[str, Any] | Existing | Exception | None] = [None] * len(requests)
        for i, key in enumerate(keys):
            if key is None:
                continue
            if key.key in seen:
                raise BatchItemInvalid(i, "idempotency_key", f"{key.key!r} is also the key "
                                       f"of item {seen[key.key]}: one key, one submit")
            seen[key.key] = i
            try:
                existing = await self._existing(key)
            except IdempotencyConflict as exc:
                raise BatchItemInvalid(i, "idempotency_key",
                                       str(exc).removeprefix("idempotency_key: "),
                                       status=422) from None
            if existing is not None:
                out[i] = Existing(existing)
        fresh = [i for i, o in enumerate(out) if o is None]
        if fresh:
            written = await self.intake.submit_batch([requests[i] for i in fresh],
                                                     [keys[i] for i in fresh])
            for i, result in zip(fresh, written, strict=True):
                out[i] = result
                key = keys[i]
                if isinstance(result, KeyTaken) and key is not None:
                    try:
                        existing = await self._existing(key)
                    except IdempotencyConflict as exc:
                        out[i] = exc
                    else:
                        out[i] = Existing(existing) if existing is not None else result
        return [o for o in out if o is not None]
