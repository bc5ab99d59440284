"""What every room of the supervisor shares: the daemon's state, the turns in memory,
and the names other modules import (`LiveTurn`, `new_turn_id`).

The supervisor is one object to the rest of the daemon, but its work is split into rooms
(scheduling, intake, queries, lifecycle), each a small class holding a reference to this
core. Composition rather than mixins: each room reads and writes the shared state by an
explicit `core.`, so where a field changes is visible, and a room's own bookkeeping (the
reload coalescing counters) stays in the room instead of on one wide class.
"""

from __future__ import annotations

import os
import secrets
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from turnkeeper.clock import Clock
from turnkeeper.config import Config, PolicyVersion
from turnkeeper.events import Event, EventBus
from turnkeeper.lifecycle.systemd import Notifier
from turnkeeper.policy.admission import FollowerBacklog
from turnkeeper.policy.daemon_state import DaemonState
from turnkeeper.policy.outcome import TurnResult
from turnkeeper.policy.scheduler import SessionScheduler
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.runtime import Runtime, Shared
from turnkeeper.store.base import Store
from turnkeeper.supervisor.live import LiveTurn as LiveTurn  # the name the rooms import
from turnkeeper.supervisor.live import LiveTurns
from turnkeeper.turn.record import TurnRecord

# Stores a message with its event: (message, at, event).
AppendMessage = Callable[[dict[str, Any], float, Event], Awaitable[None]]



def follower_backlog(config: Config) -> FollowerBacklog:
    """When the event bus drops a follower, from the policy in force."""
    return FollowerBacklog(max_bytes=config.daemon.max_follower_backlog_bytes,
                           stall_timeout_s=config.daemon.follower_stall_timeout)

class _Ids:
    """New turn ids: 8 random bytes in hex, from the system's CSPRNG read 4 KiB at a time
    (a read for each id cost 0.9 us, a slice of the pool 0.1)."""

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0
        # A forked child must not hand out the ids its parent has yet to.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._pool, self._at = b"", 0

    def __call__(self) -> str:
        at = self._at
        if at + 8 > len(self._pool):
            self._pool, at = secrets.token_bytes(4096), 0
        self._at = at + 8
        return "t_" + self._pool[at:at + 8].hex()


new_turn_id = _Ids()


def log_context(record: TurnRecord) -> dict[str, Any]:
    """What every log line of a turn carries, read when the line is written."""
    return {"turn": record.id, "session": record.session,
            "policy_version": record.policy_version, "provider": record.provider}


class SupervisorCore:
    """The shared state: what every room reads and writes. It knows no room: each room
    is handed the others it calls when `Supervisor` builds it."""

    def __init__(self, *, policy: PolicyVersion, store: Store, clock: Clock, notifier: Notifier,
                 config_path: str | None) -> None:
        self.policy = policy
        self.runtime = Runtime.build(policy)
        self.shared = Shared()
        self.shared.apply(policy.config)
        self.store = store
        self.clock = clock
        self.notifier = notifier
        self.config_path = config_path
        self.bus = EventBus(clock=clock, persist=store.append_event,
                            reserve=store.reserve_event_seqs)
        self.bus.follower_rule = follower_backlog(policy.config)
        self.state = DaemonState.STARTING
        self.started_at = clock.monotonic()
        self.live = LiveTurns()  # indexed by state as the turns move
        self.scheduler = SessionScheduler(
            max_concurrent=policy.config.daemon.max_concurrent_turns,
            max_queued=policy.config.daemon.max_queued_turns)
        self.intake_open = False
        self.pending_restart: tuple[str, ...] = ()
        self.last_reload_error: str | None = None
        self.reload_count = 0
        self.reload_failures = 0
        self.reload_unchanged = 0  # reloads that found the running policy
        self.tg: TaskGroup | None = None
        self.idle = anyio.Event()  # set (and replaced) each time the last task ends
        self.started_event = anyio.Event()
        self.stopping_event = anyio.Event()  # long polls and event streams end on it
        self.stop_requested_event = anyio.Event()
        self.on_turn_finished: list[Callable[[TurnRecord, TurnResult], None]] = []
        self.suspended_turns: list[str] = []  # suspended by a reload's drain, to requeue
        # Parked turns a reload's drain holds in their wait (turn -> the state it parked
        # in): `suspended` until the swap, then waiting on under the new policy.
        self.held: dict[str, TurnState] = {}

    def __repr__(self) -> str:
        return (f"Supervisor(state={self.state!r}, policy_version={self.policy.version}, "
                f"running={self.running}, queued={len(self.queue)})")

    @property
    def config(self) -> Config:
        return self.policy.config

    @property
    def queue(self) -> deque[str]:
        """Queued turn ids, next first (the scheduler's)."""
        return self.scheduler.queue

    @property
    def running(self) -> int:
        """Turns with a task, parked ones included (what a drain waits for)."""
        return self.scheduler.running

    @property
    def active(self) -> int:
        """Turns holding one of the concurrency slots."""
        return self.scheduler.active

    @property
    def stopping(self) -> bool:
        return self.state is DaemonState.STOPPING

    def move_to(self, state: DaemonState) -> None:
        """The daemon's state, moved as its table allows (`policy/daemon_state.py`)."""
        self.state = self.state.to(state)

    def status_line(self) -> str:
        """systemd's STATUS=: state, counts, policy version, and a failed reload's error."""
        parked = self.running - self.active
        outage = self.store.outage
        return (f"{self.state}; "
                + (f"STORE UNWRITABLE ({outage.last_error}); " if outage.degraded else "")
                + f"{self.active} running, "
                + (f"{parked} parked, " if parked else "")
                + f"{len(self.queue)} queued; policy v{self.policy.version}"
                + (f"; last reload failed: {self.last_reload_error}"
                   if self.last_reload_error else ""))
