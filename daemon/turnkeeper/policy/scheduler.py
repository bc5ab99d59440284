"""Who runs next: the session scheduler, as a pure object the supervisor applies.

Three rules live here and nowhere else:

- Turns of one session run one at a time, in submission order; turns of different
  sessions run beside each other. A session stays taken while its turn is parked.
- At most `max_concurrent` turns hold a slot. A parked turn (waiting on an answer or a
  recovery delay) gives its slot back and asks for one again when it wakes; woken turns
  get slots before queued ones, since they are in flight already, and intake being
  closed (a reload or a stop draining) does not hold them back.
- At most `max_queued` turns wait in the queue: past it a submit is refused, with a
  Retry-After that grows with the queue per running turn.
- While an operator has paused it, no queued turn starts; submits are still taken and
  queued, running and parked turns go on (a woken one still gets its slot back).

The object holds only turn ids and session names; the supervisor owns the turns, starts
their tasks and wakes them as `dispatch` says.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from turnkeeper.values import value_class

MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True, slots=True)
class Refusal:
    """A submit the queue cannot take: why, and when to try again."""

    reason: str
    retry_after_s: int


def queue_full(depth: int, *, max_queued: int, running: int) -> Refusal | None:
    """A submit is refused while `depth` turns wait and the limit is `max_queued` (one
    daemon's queue, or the turns a fleet holds unclaimed); Retry-After is the depth per
    running turn, 1 to 60 s."""
    if depth < max_queued:
        return None
    per_runner = depth // max(1, running)
    return Refusal(f"the queue is full ({depth} turns waiting)",
                   retry_after_s=max(1, min(MAX_RETRY_AFTER_S, per_runner)))


@value_class
class Dispatch:
    """What to do now: wake these parked turns (they have their slot), start these."""

    woken: tuple[str, ...] = ()
    started: tuple[str, ...] = ()


@dataclass(slots=True)
class SessionScheduler:
    max_concurrent: int
    max_queued: int
    queue: deque[str] = field(default_factory=deque)
    _session_of: dict[str, str] = field(default_factory=dict)
    _tasks: dict[str, str] = field(default_factory=dict)  # turn -> session, parked too
    # The sessions in `_tasks` (one turn each at most), kept as it changes: `dispatch`
    # runs on every submit and every finish, and building the set anew cost 221 us a
    # call with 5,000 turns running (2 us now).
    _busy: set[str] = field(default_factory=set)
    _slots: set[str] = field(default_factory=set)
    _waiters: deque[str] = field(default_factory=deque)
    paused: bool = False  # an operator's hold on starting queued turns

    def set_limits(self, *, max_concurrent: int, max_queued: int) -> None:
        """A reload's new limits: they apply from the next decision on."""
        self.max_concurrent, self.max_queued = max_concurrent, max_queued

    @property
    def running(self) -> int:
        """Turns with a task, parked ones included (what a drain waits for)."""
        return len(self._tasks)

    @property
    def active(self) -> int:
        """Turns holding a slot."""
        return len(self._slots)

    @property
    def running_sessions(self) -> frozenset[str]:
        return frozenset(self._busy)

    def holds_slot(self, turn: str) -> bool:
        return turn in self._slots

    def enqueue(self, turn: str, session: str) -> None:
        self._session_of[turn] = session
        self.queue.append(turn)

    def enqueue_first(self, turns: Iterable[tuple[str, str]]) -> None:
        """Put turns ahead of the queue, in the order given (suspended turns resume
        before new work)."""
        for turn, session in reversed(list(turns)):
            self._session_of[turn] = session
            self.queue.appendleft(turn)

    def dequeue(self, turn: str) -> bool:
        """Take a turn out of the queue (cancelled before it started)."""
        if turn not in self.queue:
            return False
        self.queue.remove(turn)
        self._session_of.pop(turn, None)
        return True

    # -- slots ----------------------------------------------------------------------

    def release_slot(self, turn: str) -> bool:
        """A turn parks: True when it gave a slot back (then dispatch again)."""
        if turn not in self._slots:
            return False
        self._slots.discard(turn)
        return True

    def want_slot(self, turn: str) -> None:
        """A parked turn woke and needs a slot back; `dispatch` grants it first."""
        if turn not in self._slots and turn not in self._waiters:
            self._waiters.append(turn)

    def stop_wanting(self, turn: str) -> None:
        if turn in self._waiters:
            self._waiters.remove(turn)

    def finished(self, turn: str) -> None:
        """A turn's task ended (finished, suspended or failed): its slot and its session
        are free."""
        self._slots.discard(turn)
        session = self._tasks.pop(turn, None)
        if session is not None:
            self._busy.discard(session)
        self._session_of.pop(turn, None)

    # -- the decision -----------------------------------------------------------------

    def dispatch(self, *, intake_open: bool) -> Dispatch:
        """Grant free slots: to woken parked turns first, then to queued turns whose
        session is free, in queue order (a session whose first queued turn cannot start
        holds back its later ones). The turns named are counted as started."""
        woken: list[str] = []
        while self._waiters and len(self._slots) < self.max_concurrent:
            turn = self._waiters.popleft()
            self._slots.add(turn)
            woken.append(turn)
        if not intake_open or self.paused:
            return Dispatch(woken=tuple(woken))
        busy = self._busy
        started: list[str] = []
        for turn in self.queue:
            if len(self._slots) + len(started) >= self.max_concurrent:
                break
            session = self._session_of.get(turn, turn)
            if session in busy:
                continue
            busy.add(session)
            started.append(turn)
        for turn in started:
            self.queue.remove(turn)
            self._tasks[turn] = self._session_of.get(turn, turn)
            self._slots.add(turn)
        return Dispatch(woken=tuple(woken), started=tuple(started))
