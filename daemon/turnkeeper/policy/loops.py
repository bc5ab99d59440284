"""Loop detection: the rules that stop a turn going round in circles (repeated actions,
state cycles, steps without progress); the failure loop beside it is `failure_loop.py`.

Three different ways to loop, three different counters, never shared:

- `repeats` (`LoopDetector.before_action`): the same call, same arguments, again. Checked
  before the call runs, so the call that would reach `max_repeats` never executes.
- `state_revisits` and `no_progress` (`LoopDetector.after_step`): the turn goes round in
  circles (its actions repeat and so do the states they lead to), or keeps trying new
  things that find nothing new. A state seen before, reached by an action the turn had
  never taken (a new search answering the same empty list), is the second: no progress,
  not a cycle.
- `failure_streak` (`FailureLoop`, in `failure_loop.py`): the same call failing the same
  way in a row.

A repeat right after a retryable or unknown failure of the same call is a retry, not a
loop: the failure loop's (higher) retryable threshold governs it, so a tool going through
a short outage is not mistaken for an agent stuck in a rut.

Keys are hashes of canonical JSON, so `{"a":1,"b":2}` and `{"b":2,"a":1}` are one action:
argument order cannot hide a repeat.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from turnkeeper.policy.classify import FailureClass
from turnkeeper.policy.outcome import Stop, StopCode
from turnkeeper.values import value_class


class LoopSettings(Protocol):
    """What `LoopDetector.from_config` reads (`[loop_detection]` fits). A protocol, so
    that `policy/` does not import the config layer."""

    @property
    def warn_repeats(self) -> int: ...
    @property
    def max_repeats(self) -> int: ...
    @property
    def max_state_revisits(self) -> int: ...
    @property
    def max_no_progress(self) -> int: ...

_RETRY_CLASSES = frozenset({FailureClass.RETRYABLE, FailureClass.UNKNOWN})

_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _not_json(value: object) -> object:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# The C encoder behind `_CANONICAL`, built once: `json.dumps` and `JSONEncoder.encode`
# build a new one on every call, which made the action key most of the guards' CPU per
# step (bench/bench_guards.py). Without circular-reference markers: arguments come from
# `json.loads` and cannot be circular. None where the C accelerator is missing.
_C_MAKE_ENCODER = getattr(json.encoder, "c_make_encoder", None)
_C_CANONICAL = None if _C_MAKE_ENCODER is None else _C_MAKE_ENCODER(
    None, _not_json, json.encoder.encode_basestring, None, ":", ",", True, False, True)


def canonical_json(value: object) -> str:
    """One spelling for one value: sorted keys, no whitespace, UTF-8 kept as is; the
    same text as `json.dumps(value, sort_keys=True, separators=(",", ":"),
    ensure_ascii=False)`.

    Raises TypeError for values JSON cannot hold; tool arguments arrive parsed from JSON,
    so that is a bug at the caller, not a case to paper over."""
    if _C_CANONICAL is not None:
        return "".join(_C_CANONICAL(value, 0))
    return _CANONICAL.encode(value)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def action_key(tool: str, arguments: object) -> str:
    """sha256 hex of the tool name and the canonical JSON of its arguments. A newline
    separates them; tool names cannot contain one (ToolConfig's name pattern)."""
    return _sha256(f"{tool}\n{canonical_json(arguments)}")


def observation_key(text: str) -> str:
    return _sha256(text)


def state_key(observations: Sequence[str]) -> str:
    """The hash of one step's observations, order ignored: the same results of calls the
    model happened to list in another order are the same state."""
    return _state_of_keys([observation_key(o) for o in observations])


# What the detector keeps of each key: the first 64 bits of the sha256, in hex. Every
# key it keeps is a line of the turn's trail (below), a few a step; within one turn's few
# thousand keys a 64-bit collision has odds of about 1e-13. A full key from an older
# checkpoint shortens to the same prefix.
KEPT_KEY_CHARS = 16

# The detector's lines, each a tag and a kept key: an action counted as a repeat, a
# state visited, an observation new to the turn. Replayed in order they rebuild its
# counts, so its snapshot holds only what is bounded and the lines are appended once.
_REPEAT, _VISIT, _SEEN = "r", "v", "o"


def _kept(key: str) -> str:
    return key[:KEPT_KEY_CHARS]


def _state_of_keys(keys: Sequence[str]) -> str:
    if len(keys) == 1:  # the common step: one call, its observation is the state
        return keys[0]
    return _sha256("\n".join(sorted(keys)))  # hex digests: no newline inside


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _times(n: int) -> str:
    return "1 time" if n == 1 else f"{n} times"


@value_class
class Action:
    """One tool call as loop detection sees it. `polling` comes from the tool's config:
    a status poll legitimately repeats itself."""

    tool: str
    key: str
    polling: bool = False

    @classmethod
    def of(cls, tool: str, arguments: object, *, polling: bool = False) -> Action:
        return cls(tool=tool, key=action_key(tool, arguments), polling=polling)


@dataclass(frozen=True, slots=True)
class LoopWarning:
    """A note for the agent: it is repeating itself and the next repeats stop the turn."""

    code: str
    message: str
    count: int
    limit: int


class LoopDetector:
    """Repeated actions, state cycles and steps without progress, for one turn.

    - `before_action`: the n-th identical (non-polling) action of the turn; from
      `warn_repeats` on, every further repeat gets a `LoopWarning` (each is the agent
      ignoring the last note); at `max_repeats` the turn stops before the call runs.
      A repeat whose previous occurrence ended in a retryable or unknown failure is a
      retry and is not counted.
    - `after_step`: a step makes progress when it observes something new to the turn
      in a state it has not been in; `max_no_progress` consecutive steps without
      progress stop the turn (`loop.no_progress`). A state seen again for the
      `max_state_revisits`-th time or more stops it as a cycle (`loop.state_cycle`,
      checked first, being the more specific diagnosis) only when the step took no
      action new to the turn (every call in it had been made before): the actions
      cycle too. A revisit reached by a new action is a step without progress, never a
      cycle: the agent is trying new things and the tools answer nothing new.
      Steps without observations (a final answer) and steps made only of polling calls
      are not recorded: they neither count nor reset.

    What grows with the turn (the keys it has counted) is kept as `lines`, appended
    once each; `snapshot()` holds the rest, which stays small. `restore(snapshot,
    lines)` rebuilds the detector from both.
    """

    def __init__(self, *, warn_repeats: int = 2, max_repeats: int = 3,
                 max_state_revisits: int = 2, max_no_progress: int = 5) -> None:
        for name, value in (("warn_repeats", warn_repeats), ("max_repeats", max_repeats),
                            ("max_state_revisits", max_state_revisits),
                            ("max_no_progress", max_no_progress)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.warn_repeats = warn_repeats
        self.max_repeats = max_repeats
        self.max_state_revisits = max_state_revisits
        self.max_no_progress = max_no_progress
        self._repeats: dict[str, int] = {}
        self._last_outcome: dict[str, FailureClass | None] = {}
        self._state_visits: dict[str, int] = {}
        self._seen: set[str] = set()
        self._no_progress = 0
        # The kept keys of this step's actions that the turn had never taken (and that
        # did not fail): a revisit they lead to is no progress, not a cycle.
        self._fresh: set[str] = set()
        self._lines: list[str] = []
        # The checkpoint asks for a snapshot several times a step; rebuilt only after a
        # change (a new dict each time, never mutated: callers may keep it).
        self._snapshot: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return (f"LoopDetector(warn_repeats={self.warn_repeats}, "
                f"max_repeats={self.max_repeats}, max_state_revisits="
                f"{self.max_state_revisits}, max_no_progress={self.max_no_progress}, "
                f"actions={len(self._repeats)}, states={len(self._state_visits)}, "
                f"observations={len(self._seen)}, no_progress={self._no_progress})")

    @classmethod
    def from_config(cls, config: LoopSettings) -> LoopDetector:
        return cls(warn_repeats=config.warn_repeats, max_repeats=config.max_repeats,
                   max_state_revisits=config.max_state_revisits,
                   max_no_progress=config.max_no_progress)

    def repeats(self, key: str) -> int:
        """How many times the action with this key has counted as a repeat this turn."""
        return self._repeats.get(_kept(key), 0)

    @property
    def no_progress(self) -> int:
        """The current streak of steps without a new observation."""
        return self._no_progress

    @property
    def observations_seen(self) -> int:
        """Distinct observations this turn has seen: grows with every step that finds
        something new (progress, as a budget extension reads it)."""
        return len(self._seen)

    @property
    def states_seen(self) -> int:
        """Distinct states this turn has been in."""
        return len(self._state_visits)

    @property
    def lines(self) -> list[str]:
        """Every key counted this turn, as the lines `restore` replays, oldest first
        (appended to, never changed: read it, do not modify it)."""
        return self._lines

    def before_action(self, action: Action) -> Stop | LoopWarning | None:
        """Call before the tool call runs. A Stop means: do not run it, end the turn."""
        if action.polling:
            return None
        key = action.key[:KEPT_KEY_CHARS]  # `_kept`, written out: every call
        if self._last_outcome.get(key) in _RETRY_CLASSES:
            return None
        count = self._repeats.get(key, 0) + 1
        self._repeats[key] = count
        self._lines.append(_REPEAT + key)
        if count == 1:
            self._fresh.add(key)
            self._snapshot = None
        if count >= self.max_repeats:
            return Stop(StopCode.LOOP_REPEATED_ACTION,
                        f"{action.tool} called with the same arguments {count} times "
                        f"(limit {self.max_repeats})",
                        value=count, limit=self.max_repeats)
        if count >= self.warn_repeats:
            return LoopWarning(
                code=StopCode.LOOP_REPEATED_ACTION.value,
                message=(f"Loop note: this is the {_ordinal(count)} call to {action.tool} with "
                         f"these same arguments in this turn. The {_ordinal(self.max_repeats)} "
                         "identical call will stop the turn: try something different, answer "
                         "with what you have, or call report_blocked."),
                count=count, limit=self.max_repeats)
        return None

    def after_action(self, action: Action, outcome: FailureClass | None) -> None:
        """Record how the call ended (None = success); a retry is judged by it."""
        if action.polling:
            return
        # Only failures are kept: a success and no record judge the next repeat alike,
        # and the common step (a success) then leaves the snapshot as it was.
        key = action.key[:KEPT_KEY_CHARS]  # `_kept`, written out: every call
        if outcome is not None and key in self._fresh:  # led nowhere: reached no state
            self._fresh.discard(key)
            self._snapshot = None
        if outcome is None:
            if self._last_outcome.pop(key, None) is not None:
                self._snapshot = None
        elif self._last_outcome.get(key) is not outcome:
            self._last_outcome[key] = outcome
            self._snapshot = None

    def after_step(self, observations: Sequence[str], *, state: str | None = None,
                   polling_only: bool = False) -> Stop | None:
        """Call after the step's tool calls, with their results. `state` is the value a
        tool declared for the step, if any; otherwise the observations make the state."""
        fresh = bool(self._fresh)
        if fresh:
            self._fresh.clear()
            self._snapshot = None
        if polling_only or not observations:
            return None
        self._snapshot = None
        obs_keys = [_sha256(o)[:KEPT_KEY_CHARS] for o in observations]
        key = (_sha256("state\n" + state) if state is not None
               else _state_of_keys(obs_keys))[:KEPT_KEY_CHARS]  # `_kept`
        visits = self._state_visits.get(key, 0) + 1
        self._state_visits[key] = visits
        lines, seen = self._lines, self._seen
        lines.append(_VISIT + key)
        new_observation = False
        for k in obs_keys:
            if k not in seen:
                seen.add(k)
                lines.append(_SEEN + k)
                new_observation = True
        revisits = visits - 1
        # A state declared by a tool may come back with new observations in it: the tool
        # says they do not make it another state, so they are no progress either.
        progress = new_observation and revisits == 0
        self._no_progress = 0 if progress else self._no_progress + 1
        if revisits >= self.max_state_revisits and not fresh:
            return Stop(StopCode.LOOP_STATE_CYCLE,
                        f"the same state came back {_times(revisits)}, by actions taken "
                        f"before (limit {self.max_state_revisits})",
                        value=revisits, limit=self.max_state_revisits)
        if self._no_progress >= self.max_no_progress:
            return Stop(StopCode.LOOP_NO_PROGRESS,
                        f"{self._no_progress} steps in a row found nothing new "
                        f"(limit {self.max_no_progress})",
                        value=self._no_progress, limit=self.max_no_progress)
        return None

    def snapshot(self) -> dict[str, Any]:
        """What `lines` does not hold: the failing calls' last outcomes, the current
        streak without progress and, within a step, its actions new to the turn."""
        if self._snapshot is None:
            self._snapshot = {
                "last_outcome": {k: (None if v is None else v.value)
                                 for k, v in self._last_outcome.items()},
                "no_progress": self._no_progress,
            }
            if self._fresh:  # only between a step's calls (a suspend cut the step)
                self._snapshot["fresh"] = sorted(self._fresh)
        return self._snapshot

    @classmethod
    def restore(cls, data: Mapping[str, Any], lines: Sequence[str] = (), *,
                warn_repeats: int = 2, max_repeats: int = 3, max_state_revisits: int = 2,
                max_no_progress: int = 5) -> LoopDetector:
        """The detector of `snapshot()` and `lines`. A snapshot written before the lines
        existed holds the counts themselves ("repeats", "state_visits", "seen"): they
        become lines, so the turn's next checkpoint writes them as such."""
        det = cls(warn_repeats=warn_repeats, max_repeats=max_repeats,
                  max_state_revisits=max_state_revisits, max_no_progress=max_no_progress)
        det._last_outcome = {_kept(str(k)): FailureClass(v)
                             for k, v in data.get("last_outcome", {}).items() if v is not None}
        det._no_progress = int(data.get("no_progress", 0))
        det._fresh = {_kept(str(k)) for k in data.get("fresh", ())}
        older = [*(_REPEAT + _kept(str(k)) for k, n in data.get("repeats", {}).items()
                   for _ in range(int(n))),
                 *(_VISIT + _kept(str(k)) for k, n in data.get("state_visits", {}).items()
                   for _ in range(int(n))),
                 *(_SEEN + _kept(str(k)) for k in data.get("seen", ()))]
        for line in (*older, *lines):
            det._replay(line)
        return det

    def _replay(self, line: str) -> None:
        tag, key = line[:1], _kept(line[1:])
        if tag == _REPEAT:
            self._repeats[key] = self._repeats.get(key, 0) + 1
        elif tag == _VISIT:
            self._state_visits[key] = self._state_visits.get(key, 0) + 1
        elif tag == _SEEN:
            self._seen.add(key)
        else:
            raise ValueError(f"not a loop detector line: {line!r}")
        self._lines.append(tag + key)
