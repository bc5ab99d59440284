"""Idempotent submits: a client that retries a submit (its answer lost, a 503 or a 507)
sends the same `Idempotency-Key`, and gets the turn its first attempt made instead of a
second one.

A key is remembered with the turn it made, the fingerprint of what was submitted with
it, and when, for `[daemon] idempotency_window`. Within the window the same key with the
same submit is that turn again; with another submit it is an error naming the key (the
client reused a key for different work: guessing which one it meant would run the wrong
one). Past the window the key is free: a new submit with it makes a new turn and the
row of the old one is replaced.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_KEY_LENGTH = 255


@dataclass(frozen=True, slots=True)
class IdempotencyKey:
    """What the store writes with a new turn: the key, the submit's fingerprint, when,
    and the time before which a row of the same key has expired (it is replaced)."""

    key: str
    fingerprint: str
    created_at: float
    stale_before: float


@dataclass(frozen=True, slots=True)
class StoredKey:
    """A key as the store holds it."""

    key: str
    turn: str
    fingerprint: str
    created_at: float


@dataclass(frozen=True, slots=True)
class NewTurn:
    """No live key: the submit makes a turn, and the key is written with it."""


@dataclass(frozen=True, slots=True)
class SameTurn:
    """The key made this turn from the same submit: answer it again."""

    turn: str


@dataclass(frozen=True, slots=True)
class KeyConflict:
    """The key made `turn` from another submit: refused, naming the key."""

    turn: str
    key: str

    @property
    def message(self) -> str:
        return (f"idempotency_key: {self.key!r} was used for a different submit "
                f"(turn {self.turn}); use a new key for new work")


Decision = NewTurn | SameTurn | KeyConflict


def key_problem(key: str) -> str | None:
    """None when `key` can be a key, else why not: 1 to 255 printable ASCII characters
    (it travels in a header as well as in a body)."""
    if not key:
        return "must not be empty"
    if len(key) > MAX_KEY_LENGTH:
        return f"at most {MAX_KEY_LENGTH} characters, not {len(key)}"
    if not all(" " <= c <= "~" for c in key):
        return "printable ASCII characters only"
    return None


def fingerprint(fields: Mapping[str, Any]) -> str:
    """The submit's fields (None left out, so an explicit null is the same submit as an
    absent field) as canonical JSON, hashed."""
    kept = {k: v for k, v in fields.items() if v is not None and v != {}}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def expired_before(now: float, window_s: float) -> float:
    """A key written before this time has expired."""
    return now - window_s


def decide(stored: StoredKey | None, *, fingerprint: str, now: float,
           window_s: float) -> Decision:
    """What a submit with a key does, given the row the store holds for the key."""
    if stored is None or stored.created_at < expired_before(now, window_s):
        return NewTurn()
    if stored.fingerprint == fingerprint:
        return SameTurn(stored.turn)
    return KeyConflict(turn=stored.turn, key=stored.key)


def new_key(key: str, *, fingerprint: str, now: float, window_s: float) -> IdempotencyKey:
    return IdempotencyKey(key=key, fingerprint=fingerprint, created_at=now,
                          stale_before=expired_before(now, window_s))
