"""A client for applications: `Client` (blocking, the standard library only) and
`AsyncClient` (anyio: asyncio or trio), typed results and typed errors.

    from turnkeeper.client import Client

    with Client() as tk:                       # the socket the `turnkeeper` command finds
        turn = tk.submit("summarise the report", budget={"max_steps": 8})
        done = tk.wait(turn.id, timeout=300)
        print(done.result.stopped_because.code, done.result.answer)

A submit carries an Idempotency-Key (given, or made by the client) and is sent again
with it after a 503, a 507 or no daemon, until `retry_for` runs out: the daemon makes one
turn of it however many times it is sent. `events()` follows a stream across a daemon
restart, from the last event seen. Importing this module loads neither anyio nor
aiohttp nor pydantic; `AsyncClient` loads anyio when first named.
"""

from __future__ import annotations

from turnkeeper.client._sync import Client
from turnkeeper.client.errors import (
    APIError,
    ClientError,
    Conflict,
    InvalidRequest,
    Overloaded,
    Retryable,
    StoreUnavailable,
    TurnNotFound,
    Unreachable,
    WaitTimedOut,
)
from turnkeeper.client.models import (
    ApprovalDecision,
    DeadLetter,
    Event,
    Health,
    PendingApproval,
    Result,
    Status,
    StoppedBecause,
    Turn,
    Usage,
)

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs start-up time
if TYPE_CHECKING:
    from turnkeeper.client._async import AsyncClient

__all__ = ["APIError", "ApprovalDecision", "AsyncClient", "Client", "ClientError",
           "Conflict", "DeadLetter", "Event", "Health", "InvalidRequest", "Overloaded",
           "PendingApproval", "Result", "Retryable",
           "Status", "StoppedBecause", "StoreUnavailable", "Turn", "TurnNotFound",
           "Unreachable", "Usage", "WaitTimedOut"]


def __getattr__(name: str) -> object:
    if name == "AsyncClient":  # anyio only for those who ask for it
        from turnkeeper.client._async import AsyncClient

        return AsyncClient
    raise AttributeError(f"module 'turnkeeper.client' has no attribute {name!r}")
