"""The states of a turn and every move between them, in one table.

Everything that changes a turn's state goes through `TurnState.to()`, so a move the table
does not list is a bug that names itself (`IllegalTransition: running -> queued`), not a
turn silently in two places at once. States are strings on the wire and in the store
(`TurnState` is a `StrEnum`), so `"running" == TurnState.RUNNING`.

    queued ──> running ──> recovering ─┐
      │  ^       │ ^ │ └──> waiting ───┤
      │  │       │ └─┴─────────────────┘ (back to running when the wait ends)
      │  └── suspended <── (a reload or a stop, from any live state but queued)
      └──────────> a terminal state: completed, blocked, partial, failed, cancelled
"""

from __future__ import annotations

from enum import StrEnum

from turnkeeper.errors import TurnkeeperError


class TurnState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    RECOVERING = "recovering"   # parked in an auto-recovery wait
    WAITING = "waiting"         # parked on a clarify question
    SUSPENDED = "suspended"     # checkpointed for a reload or a stop; resumes by itself
    COMPLETED = "completed"
    BLOCKED = "blocked"
    PARTIAL = "partial"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES

    @property
    def parked(self) -> bool:
        """Waiting on time or on a person, holding no slot."""
        return self in (TurnState.RECOVERING, TurnState.WAITING)

    def to(self, new: TurnState | str) -> TurnState:
        """The state after moving to `new`; raises `IllegalTransition` for a move the
        table does not allow. Staying put is always allowed (a checkpoint that keeps the
        state)."""
        target = TurnState(new)
        if target is not self and target not in _TRANSITIONS[self]:
            raise IllegalTransition(self, target)
        return target


class IllegalTransition(TurnkeeperError):
    """A move its state table does not list: a bug that names itself. `what`: whose state
    (a turn, the daemon, an MCP server)."""

    def __init__(self, old: StrEnum, new: StrEnum, what: str = "a turn") -> None:
        super().__init__(f"{what} cannot move from {old.value} to {new.value}")
        self.old, self.new = old, new


TERMINAL_STATES = frozenset({TurnState.COMPLETED, TurnState.BLOCKED, TurnState.PARTIAL,
                             TurnState.FAILED, TurnState.CANCELLED})
LIVE_STATES = (TurnState.QUEUED, TurnState.RUNNING, TurnState.RECOVERING,
               TurnState.WAITING, TurnState.SUSPENDED)

_ENDS = TERMINAL_STATES
_TRANSITIONS: dict[TurnState, frozenset[TurnState]] = {
    # A queued turn starts, or ends before it ran (cancelled, or an unreadable checkpoint).
    TurnState.QUEUED: frozenset({TurnState.RUNNING}) | _ENDS,
    TurnState.RUNNING: frozenset({TurnState.RECOVERING, TurnState.WAITING,
                                  TurnState.SUSPENDED}) | _ENDS,
    TurnState.RECOVERING: frozenset({TurnState.RUNNING, TurnState.SUSPENDED}) | _ENDS,
    TurnState.WAITING: frozenset({TurnState.RUNNING, TurnState.SUSPENDED}) | _ENDS,
    # A suspended turn is queued again, or resumes straight into its step (a parked one
    # back into its wait); it can be cancelled while it waits for a slot.
    TurnState.SUSPENDED: frozenset({TurnState.QUEUED, TurnState.RUNNING,
                                    TurnState.RECOVERING, TurnState.WAITING}) | _ENDS,
    # A dead letter replayed resumes its turn from the last checkpoint.
    TurnState.FAILED: frozenset({TurnState.QUEUED}),
    TurnState.PARTIAL: frozenset({TurnState.QUEUED}),
    TurnState.COMPLETED: frozenset(),
    TurnState.BLOCKED: frozenset(),
    TurnState.CANCELLED: frozenset(),
}

# Every allowed move as (from, to) -> to, as plain strings (a member is equal to its
# string and hashes as it does, so either finds a move): `moved` looks a move up once
# instead of making two members and reading a value (2.4 us, a checkpoint's).
_MOVES: dict[tuple[str, str], str] = {
    (old.value, new.value): new.value
    for old in TurnState for new in (old, *_TRANSITIONS[old])}


def moved(old: str, new: str) -> str:
    """`TurnState(old).to(new).value`: the state after the move, as a plain string;
    raises `IllegalTransition` for a move the table does not allow (ValueError for a
    name that is not a state)."""
    try:
        return _MOVES[old, new]
    except KeyError:
        return TurnState(old).to(new).value
