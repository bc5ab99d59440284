"""What a turn's provider chain holds, and the form it takes in a checkpoint.

`ProviderChain` (policy/chain.py) is this state plus the events that move it. The
state is kept apart so that the rules read without the bookkeeping, and so that
everything a restart has to bring back sits in one place: the settings (checked once,
here), the counters, the current pass (where it started, the reason each provider was
left, the largest Retry-After, the soonest breaker reopening or Retry-After window's
end, the last backoff delay, whether a success ended it), and next to them the three
ways across a checkpoint: `snapshot`, `restore` and `carry_over`. A field added to the
chain is a field each of those must account for.

A snapshot carries a version (`SNAPSHOT_VERSION`); one of another version is refused,
never guessed at. Fields that older snapshots lack are optional: no `pass_reopen_s`
reads as no breaker reopening seen, no `pass_done` as a pass still open, no
`pass_start` as a pass that started at the primary. What was in
flight (a call, a retry sleep) died with the process, so a restored chain is ready for
`begin_call()`, unless it was parked in recovery or stopped: those it stays. `restore`
checks a snapshot against the chain it rebuilds (the same providers, exits that can
belong to a pass of them, a spent pass only when parked or stopped) before it sets a
single field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

from turnkeeper.policy.backoff import Backoff, Rand
from turnkeeper.policy.chain_decisions import REASONS as _REASONS
from turnkeeper.policy.chain_decisions import FailOverReason, Phase, WaitsFor

SNAPSHOT_VERSION = 1


class ChainState:
    """The settings, counters and current pass of one turn's provider chain, and their
    snapshot. Not used on its own: `ProviderChain` is this plus its events."""

    def __init__(self, providers: Sequence[str], *, max_attempts: int = 4,
                 backoff: Backoff | None = None, max_retry_after_s: float = 120.0,
                 recovery_schedule: Sequence[float] = (15.0, 30.0, 60.0, 60.0, 60.0),
                 recovery_jitter: float = 0.2, auto_recovery_cycles: int = 5,
                 rand: Rand | None = None) -> None:
        """`max_attempts` is ``agent.api_max_retries + 1``. `rand` is the default uniform
        source for events that are not given one (none at all: waits take their upper
        bound)."""
        if not providers:
            raise ValueError("a provider chain needs at least one provider")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not recovery_schedule:
            raise ValueError("recovery_schedule needs at least one wait")
        if any(not w >= 0 for w in recovery_schedule):
            raise ValueError(f"recovery_schedule waits must be >= 0: {recovery_schedule!r}")
        if not max_retry_after_s >= 0:
            raise ValueError(f"max_retry_after_s must be >= 0, got {max_retry_after_s!r}")
        if not recovery_jitter >= 0:
            raise ValueError(f"recovery_jitter must be >= 0, got {recovery_jitter!r}")
        if auto_recovery_cycles < 0:
            raise ValueError(f"auto_recovery_cycles must be >= 0, got {auto_recovery_cycles}")
        self.providers: tuple[str, ...] = tuple(providers)
        self.max_attempts = max_attempts
        self.backoff = backoff if backoff is not None else Backoff()
        self.max_retry_after_s = max_retry_after_s
        self.recovery_schedule: tuple[float, ...] = tuple(recovery_schedule)
        self.recovery_jitter = recovery_jitter
        self.auto_recovery_cycles = auto_recovery_cycles
        self._rand = rand
        self._phase = Phase.READY
        self._provider_attempts = 0
        self._recovery_cycles = 0
        # Where the pass started: the primary, or the provider that answered the turn's
        # last model call (a turn that failed over stays on its fallback).
        self._pass_start = 0
        self._pass_exits: list[FailOverReason] = []  # why each provider of the pass was left
        # The provider the turn is on, kept (`_moved`) as the pass moves: the turn asks
        # for it several times a step.
        self._current = self.providers[0]
        self._pass_retry_after_s: float | None = None
        # The soonest a provider skipped without an attempt can be asked again (its
        # breaker lets a probe through, its Retry-After window ends), and which it was.
        self._pass_reopen_s: float | None = None
        self._pass_reopen_by: WaitsFor | None = None
        self._previous_delay_s: float | None = None  # for decorrelated jitter
        self._pass_done = False  # a success ended the pass: the next call starts anew

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(phase={self._phase.value}, "
                f"current={self.current_provider!r}, "
                f"provider_attempts={self._provider_attempts}/{self.max_attempts}, "
                f"fallback_hops={self.fallback_hops}/{len(self.providers)}, "
                f"recovery_cycles={self._recovery_cycles}/{self.auto_recovery_cycles})")

    # -- reading ---------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def current_provider(self) -> str:
        """The provider the turn is on; once the pass is spent, the last one tried."""
        return self._current

    @property
    def next_provider(self) -> str:
        """The provider the next attempt goes to, unless its breaker or Retry-After
        window turns it away: the current one, or the primary for a chain waiting out a
        recovery cycle (the next pass starts there)."""
        if self._phase is Phase.RECOVERING:
            return self.providers[0]
        return self._current

    def _index(self) -> int:
        """A pass walks the list from where it started, wrapping round past the end,
        each provider once."""
        n = len(self.providers)
        return (self._pass_start + min(len(self._pass_exits), n - 1)) % n

    def _moved(self) -> None:
        """The pass started or left a provider: the current provider follows."""
        self._current = self.providers[self._index()]

    @property
    def provider_attempts(self) -> int:
        return self._provider_attempts

    @property
    def fallback_hops(self) -> int:
        return len(self._pass_exits)

    @property
    def recovery_cycles(self) -> int:
        return self._recovery_cycles

    def counters(self) -> tuple[int, int, int, str]:
        """`provider_attempts`, `fallback_hops`, `recovery_cycles` and the current
        provider, in one call: what a turn copies to its record before each write."""
        return (self._provider_attempts, len(self._pass_exits), self._recovery_cycles,
                self._current)

    @property
    def pass_exits(self) -> tuple[FailOverReason, ...]:
        """Why each provider of the current pass was left, in chain order."""
        return tuple(self._pass_exits)

    # -- checkpoints -----------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The chain's counters, JSON-able, for the turn's checkpoint. (The fields
        read directly, the phase's value as `_value_`: an enum's `value` and a property
        are Python calls each, and a turn checkpoints more than once a step.)"""
        return {"version": SNAPSHOT_VERSION, "providers": list(self.providers),
                "phase": self._phase._value_, "current_provider": self._current,
                "pass_start": self._pass_start,
                "provider_attempts": self._provider_attempts,
                "fallback_hops": len(self._pass_exits),
                "recovery_cycles": self._recovery_cycles,
                "pass_exits": list(self._pass_exits),
                "pass_retry_after_s": self._pass_retry_after_s,
                "pass_reopen_s": self._pass_reopen_s,
                "pass_reopen_by": self._pass_reopen_by,
                "previous_delay_s": self._previous_delay_s,
                "pass_done": self._pass_done}

    @classmethod
    def carry_over(cls, snapshot: dict[str, Any], providers: Sequence[str],
                   **settings: Any) -> Self:
        """A checkpointed chain brought to another provider list (a reload changed it).
        Positions in the old list mean nothing in the new one, so the pass starts over at
        the new primary; but the turn's history does not change with the list: its
        recovery cycles are kept, and a turn parked in recovery stays parked in the same
        cycle (its wake-up time lives in the turn's checkpoint). A stopped chain stays
        stopped. `settings` are the constructor's keyword arguments."""
        if snapshot.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"provider chain snapshot version {snapshot.get('version')!r} "
                             f"is not {SNAPSHOT_VERSION}")
        chain = cls(providers, **settings)
        phase = Phase(snapshot["phase"])
        chain._phase = phase if phase in (Phase.RECOVERING, Phase.STOPPED) else Phase.READY
        chain._recovery_cycles = int(snapshot["recovery_cycles"])
        return chain

    @classmethod
    def restore(cls, snapshot: dict[str, Any], providers: Sequence[str] | None = None, *,
                max_attempts: int = 4, backoff: Backoff | None = None,
                max_retry_after_s: float = 120.0,
                recovery_schedule: Sequence[float] = (15.0, 30.0, 60.0, 60.0, 60.0),
                recovery_jitter: float = 0.2, auto_recovery_cycles: int = 5,
                rand: Rand | None = None) -> Self:
        """A chain resumed from a checkpoint, built with the same arguments as the
        original (the turn keeps its policy). A turn parked in recovery stays parked in
        the same cycle (call `recovery_done()` when the wait is over); a call or a retry
        sleep that was in flight died with the process, so it resumes ready for
        `begin_call()`. A stopped chain stays stopped. `providers` defaults to the
        snapshot's; when given, it must match."""
        if providers is None:
            providers = [str(p) for p in snapshot["providers"]]
        chain = cls(providers, max_attempts=max_attempts, backoff=backoff,
                    max_retry_after_s=max_retry_after_s, recovery_schedule=recovery_schedule,
                    recovery_jitter=recovery_jitter,
                    auto_recovery_cycles=auto_recovery_cycles, rand=rand)
        if snapshot.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"provider chain snapshot version {snapshot.get('version')!r} "
                             f"is not {SNAPSHOT_VERSION}")
        if list(snapshot["providers"]) != list(chain.providers):
            raise ValueError(f"provider chain snapshot is for {snapshot['providers']!r}, "
                             f"not {list(chain.providers)!r}")
        exits = list(snapshot["pass_exits"])
        if len(exits) > len(chain.providers) or any(r not in _REASONS for r in exits):
            raise ValueError(f"provider chain snapshot has invalid pass_exits {exits!r}")
        phase = Phase(snapshot["phase"])
        if phase not in (Phase.RECOVERING, Phase.STOPPED):
            phase = Phase.READY
        start = int(snapshot.get("pass_start", 0))  # absent from older snapshots
        if not 0 <= start < len(chain.providers):
            raise ValueError(f"provider chain snapshot has invalid pass_start {start!r}")
        reopen_by = snapshot.get("pass_reopen_by")
        if reopen_by not in (None, "breaker", "retry_after"):
            raise ValueError(f"provider chain snapshot has invalid pass_reopen_by "
                             f"{reopen_by!r}")
        if len(exits) == len(chain.providers) and phase is Phase.READY:
            raise ValueError("provider chain snapshot: the pass is spent but the chain is "
                             "neither recovering nor stopped")
        chain._phase = phase
        chain._provider_attempts = int(snapshot["provider_attempts"])
        chain._recovery_cycles = int(snapshot["recovery_cycles"])
        chain._pass_start = start
        chain._pass_exits = exits
        chain._moved()
        ra = snapshot.get("pass_retry_after_s")
        chain._pass_retry_after_s = None if ra is None else float(ra)
        reopen = snapshot.get("pass_reopen_s")  # absent from older snapshots
        chain._pass_reopen_s = None if reopen is None else float(reopen)
        chain._pass_reopen_by = (None if chain._pass_reopen_s is None
                                 else reopen_by or "breaker")
        prev = snapshot.get("previous_delay_s")
        chain._previous_delay_s = None if prev is None else float(prev)
        chain._pass_done = bool(snapshot.get("pass_done", False))  # absent from older ones
        return chain
