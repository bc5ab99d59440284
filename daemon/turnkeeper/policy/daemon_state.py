"""The daemon's own state and every move between it, in one table (as a turn's is in
`turn_state.py`). The values are those `/v1/status`, `STATUS=` and the
`turnkeeper_daemon_state` metric show.

    starting ──> ready <──> reloading
        │          │            │
        └──────────┴────────────┴──> stopping   (SIGTERM, SIGINT; nothing comes after)

What each state lets through is asked here too, so the rooms that admit submits or
park turns do not each keep a list of state names.
"""

from __future__ import annotations

from enum import StrEnum

from turnkeeper.policy.turn_state import IllegalTransition


class DaemonState(StrEnum):
    STARTING = "starting"    # resuming what the last run left unfinished
    READY = "ready"
    RELOADING = "reloading"  # draining for a new policy: submits are queued, not started
    STOPPING = "stopping"

    def to(self, new: DaemonState) -> DaemonState:
        """The state after moving to `new`; raises `IllegalTransition` for a move the
        table does not list. Staying put is allowed."""
        if new is not self and new not in _TRANSITIONS[self]:
            raise IllegalTransition(self, new, what="the daemon")
        return new

    @property
    def takes_submits(self) -> bool:
        """A submit (or a replay) is accepted: queued while a reload drains, refused
        (503) before the start has resumed the last run's turns and once stopping."""
        return self in (DaemonState.READY, DaemonState.RELOADING)

    @property
    def draining(self) -> bool:
        """A reload or a stop is draining: a turn that parks now is suspended at once."""
        return self in (DaemonState.RELOADING, DaemonState.STOPPING)


_TRANSITIONS: dict[DaemonState, frozenset[DaemonState]] = {
    DaemonState.STARTING: frozenset({DaemonState.READY, DaemonState.STOPPING}),
    DaemonState.READY: frozenset({DaemonState.RELOADING, DaemonState.STOPPING}),
    DaemonState.RELOADING: frozenset({DaemonState.READY, DaemonState.STOPPING}),
    DaemonState.STOPPING: frozenset(),
}
