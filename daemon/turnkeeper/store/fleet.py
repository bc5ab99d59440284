"""What the shared store needs to know about the fleet: the node's name, the claim a
node holds on a turn, and the error a write with a stale claim gets.

A claim is a lease with a fencing token: each claim of a turn raises its `epoch`, and
every write of a claimed turn names the epoch it was claimed with. The database refuses
a write whose epoch is no longer the turn's (StaleLease): a node that was paused past
its lease (SIGSTOP, a long GC, a partition) finds out at its first write and never
overwrites the work of the node that took the turn over.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

from turnkeeper.store.base import StoreError

NODE_ID_FILE = "node_id"
CHANNEL_TURNS = "turnkeeper_turns"  # NOTIFY: a turn to claim (submitted, requeued, handed back)
CHANNEL_MAIL = "turnkeeper_mail"  # NOTIFY: mail for a turn, the payload its id
CHANNEL_BREAKERS = "turnkeeper_breakers"  # NOTIFY: a circuit breaker opened
CHANNEL_RETRY_AFTER = "turnkeeper_retry_after"  # NOTIFY: a peer asked not to be called


def breaker_notice(name: str, open_for_s: float) -> str:
    """The NOTIFY payload of a breaker's opening (or of a Retry-After window): its name
    and the seconds it stays open, so a node applies it at once, without reading the
    table."""
    return f"{name} {open_for_s:.3f}"


def read_breaker_notice(payload: str) -> tuple[str, float | None]:
    """(name, seconds open, or None when the payload does not say)."""
    name, _, seconds = payload.rpartition(" ")
    try:
        return name, float(seconds)
    except ValueError:
        return payload, None


class StaleLease(StoreError):
    """A write for a turn this node no longer holds: another node claimed it after the
    lease expired (or the node gave it up). Nothing was written."""


class MailTaken(StoreError):
    """Mail that was no longer in the mailbox when a node went to apply it (an earlier
    delivery took it, or the node's claim of its turn no longer holds): nothing was
    written, and the message must not be applied."""


@dataclass(frozen=True, slots=True)
class Claimed:
    """A turn a claim gave this node: its record and checkpoint (messages and trail
    attached) and the epoch its writes carry."""

    record: dict[str, Any]
    checkpoint: dict[str, Any]
    epoch: int


class EventCursor(NamedTuple):
    """A follower's place in the events every node writes: the transaction that wrote the
    last row read, and that row's position. Read in this order, a row that commits after
    rows inserted later is never stepped over."""

    tx: int
    pos: int


@runtime_checkable
class FleetStore(Protocol):
    """A store several daemons share (PostgreSQL): what the fleet room calls on it."""

    node_id: str
    lease_s: float
    claims: dict[str, int]  # turn -> epoch of this node's claim
    lost: set[str]

    async def event_block_start(self) -> int: ...

    async def events_cursor(self) -> EventCursor:
        """Where a follower starts reading the other nodes' events: now."""
        ...

    async def peer_events(self, *, after: EventCursor, turn: str | None = None,
                          limit: int = 1000) -> tuple[list[dict[str, Any]], EventCursor]: ...

    async def claim(self, limit: int) -> list[Claimed]: ...

    async def backlog(self) -> int:
        """Unfinished turns no live node holds: those waiting for a claim."""
        ...

    async def renew(self) -> dict[str, int]: ...

    def abandon(self, turn_ids: Iterable[str]) -> None: ...

    async def release(self) -> int: ...

    async def nodes(self) -> list[dict[str, Any]]: ...

    async def post_mail(self, turn_id: str, kind: str, body: dict[str, Any]) -> None: ...

    async def pending_mail(self) -> list[tuple[int, str, str, dict[str, Any]]]: ...

    async def drop_mail(self, mail_id: int) -> None: ...

    async def append_message(self, turn_id: str, message: dict[str, Any], *,
                             updated_at: float, events: Any = (),
                             mail_id: int | None = None) -> None: ...

    async def listen(self, on_notify: Callable[[str, str], None]) -> None: ...

    async def open_breaker(self, name: str, for_s: float) -> None: ...

    async def share_budgets(self, budgets: dict[str, tuple[int, int]]
                            ) -> dict[str, tuple[int, int]]: ...

    async def add_breaker_failures(self, name: str, failures: int, *, reset: bool,
                                   threshold: int, cooldown_s: float
                                   ) -> tuple[int, float | None]: ...

    async def shared_breakers(self) -> dict[str, tuple[int, float | None]]: ...

    async def share_retry_after(self, name: str, for_s: float) -> None: ...

    async def shared_retry_after(self) -> dict[str, float]: ...


def default_node_id(state_dir: Path) -> str:
    """The host name and a random suffix, made once and kept in the state directory, so
    a daemon restarted on the same machine is the same node."""
    path = state_dir / NODE_ID_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        with os.fdopen(fd, encoding="utf-8") as f:
            kept = f.read(4096).strip()
    except FileNotFoundError:
        kept = ""
    except OSError as exc:
        raise StoreError(f"node id file {path} cannot be read: {exc.strerror or exc}"
                         ) from None
    if kept:
        return kept
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())
    node_id = f"{host[:100] or 'node'}-{secrets.token_hex(3)}"
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        tmp = path.with_name(f".{NODE_ID_FILE}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o640)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(node_id + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise StoreError(f"node id file {path} cannot be written: {exc.strerror or exc}"
                         ) from None
    return node_id
