"""Room that follows progress: a turn still advancing when it reaches its step or time
limit may earn more of both, up to a ceiling; a turn that is not advancing gets none.

Progress is what the loop detector already measures, read as marks that only grow: the
number of distinct observations the turn has seen, the number of distinct states it has
been in, and the number of plan items it has marked done (`update_plan`). A step after
which any mark grew made progress. `Extension.decide` is asked when the budget's
`budget.steps` or `budget.seconds` stop is about to end the turn:

- the extension is on, fewer than `max_extensions` were granted, and the last step with
  progress is one of the last `window` steps: grant `steps` more steps and `seconds` more
  active seconds (a `Grant`);
- otherwise None: the stop ends the turn as it would without extensions, and names the
  base limit and the extended one.

The plan itself (`Plan`) is the agent's own checklist, kept here because its completed
items are progress; the result lists them as `done` and the open ones in `open_issues`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from turnkeeper.policy.budget import BudgetLimits, _num
from turnkeeper.policy.outcome import Stop, StopCode


class ExtensionSettings(Protocol):
    """What `Extension.from_config` reads (`[budget.extension]` fits). A protocol, so
    that `policy/` does not import the config layer."""

    @property
    def enabled(self) -> bool: ...
    @property
    def window(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    @property
    def max_extensions(self) -> int: ...

EXTENDABLE = frozenset({StopCode.BUDGET_STEPS, StopCode.BUDGET_SECONDS})
MAX_PLAN_ITEMS = 50
MAX_ITEM_CHARS = 300


@dataclass(frozen=True, slots=True)
class Grant:
    """One extension: `number` of `of`, with what it adds and a note for the agent."""

    number: int
    of: int
    steps: int
    seconds: float
    reason: str  # the limit that was reached: "steps" or "seconds"
    progress_step: int
    message: str


@dataclass(frozen=True, slots=True)
class PlanItem:
    text: str
    done: bool


class Plan:
    """The agent's checklist: the whole list, replaced by each `update_plan` call."""

    def __init__(self, items: Sequence[PlanItem] = ()) -> None:
        self.items: tuple[PlanItem, ...] = tuple(items)

    @staticmethod
    def parse(arguments: object) -> tuple[PlanItem, ...] | str:
        """The items of an `update_plan` call, or what is wrong with it (told to the
        agent, the plan unchanged)."""
        if not isinstance(arguments, Mapping) or not isinstance(arguments.get("items"), list):
            return "update_plan needs {\"items\": [{\"text\": ..., \"done\": true|false}]}"
        raw = arguments["items"]
        if len(raw) > MAX_PLAN_ITEMS:
            return f"a plan holds at most {MAX_PLAN_ITEMS} items, got {len(raw)}"
        items = []
        for n, item in enumerate(raw, 1):
            if not isinstance(item, Mapping) or not isinstance(item.get("text"), str) \
                    or not item["text"].strip():
                return f"item {n}: needs a non-empty \"text\""
            done = item.get("done", False)
            if not isinstance(done, bool):
                return f"item {n}: \"done\" must be true or false"
            items.append(PlanItem(" ".join(item["text"].split())[:MAX_ITEM_CHARS], done))
        return tuple(items)

    @property
    def done(self) -> tuple[str, ...]:
        return tuple(i.text for i in self.items if i.done)

    @property
    def open(self) -> tuple[str, ...]:
        return tuple(i.text for i in self.items if not i.done)

    def summary(self) -> str:
        return f"plan updated: {len(self.done)} of {len(self.items)} items done"

    def snapshot(self) -> list[dict[str, Any]]:
        return [{"text": i.text, "done": i.done} for i in self.items]

    @classmethod
    def restore(cls, data: Sequence[Mapping[str, Any]]) -> Plan:
        return cls([PlanItem(str(d["text"]), bool(d["done"])) for d in data])


class Extension:
    """The extensions of one turn and the progress they are judged on."""

    def __init__(self, *, enabled: bool = False, window: int = 3, steps: int = 10,
                 seconds: float = 60.0, max_extensions: int = 2) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if steps < 0 or seconds < 0 or max_extensions < 0:
            raise ValueError("steps, seconds and max_extensions must be 0 or more")
        self.enabled = enabled
        self.window = window
        self.steps = steps
        self.seconds = seconds
        self.max_extensions = max_extensions
        self.granted = 0
        self.last_progress_step = 0
        self._marks: tuple[int, ...] = ()
        self.plan = Plan()
        # The plan items done count: a third mark, kept with the plan.
        self._completed_seen: set[str] = set()
        # Asked for with every checkpoint (several a step); rebuilt only after a change.
        self._snapshot: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return (f"Extension(enabled={self.enabled}, window={self.window}, steps={self.steps},"
                f" seconds={self.seconds}, max_extensions={self.max_extensions}, "
                f"granted={self.granted}, last_progress_step={self.last_progress_step})")

    @classmethod
    def from_config(cls, config: ExtensionSettings) -> Extension:
        return cls(enabled=config.enabled, window=config.window, steps=config.steps,
                   seconds=config.seconds, max_extensions=config.max_extensions)

    @property
    def completed(self) -> int:
        """Distinct plan items ever marked done (a re-listed item counts once)."""
        return len(self._completed_seen)

    def update_plan(self, items: Sequence[PlanItem]) -> int:
        """Replace the plan; the number of items newly done (progress when > 0)."""
        self.plan = Plan(items)
        self._snapshot = None
        before = len(self._completed_seen)
        self._completed_seen.update(i.text for i in items if i.done)
        return len(self._completed_seen) - before

    def after_step(self, step: int, *, observations: int, states: int) -> bool:
        """Record the marks at the end of `step` (observations and states the turn has
        seen, from the loop detector; plan items done, from here). True when a mark grew
        since the last record: the step made progress."""
        marks = (observations, states, len(self._completed_seen))  # `completed`
        old = self._marks
        if marks == old:
            return False
        if len(old) == 3:  # written out: this runs every step
            grew = marks[0] > old[0] or marks[1] > old[1] or marks[2] > old[2]
        else:
            grew = bool(old) and any(a > b for a, b in zip(marks, old, strict=True))
        if not self._marks and any(marks):
            grew = True
        self._marks = marks
        self._snapshot = None
        if grew:
            self.last_progress_step = max(self.last_progress_step, step)
        return grew

    def progressing(self, steps: int) -> bool:
        """Whether progress was made in the last `window` steps of `steps` run."""
        return self.last_progress_step > 0 and steps - self.last_progress_step < self.window

    def decide(self, stop: Stop, *, steps: int) -> Grant | None:
        """A grant for this stop, or None (the stop stands)."""
        if not self.enabled or stop.code not in EXTENDABLE:
            return None
        if self.granted >= self.max_extensions or not self.progressing(steps):
            return None
        reason = "steps" if stop.code is StopCode.BUDGET_STEPS else "seconds"
        if (self.steps if reason == "steps" else self.seconds) <= 0:
            return None
        self.granted += 1
        self._snapshot = None
        message = (f"Budget note: you reached your {reason} limit while still making "
                   f"progress, so the turn was extended ({self.granted} of "
                   f"{self.max_extensions}): {self.steps} more steps and "
                   f"{_num(self.seconds)} more seconds. Finish the remaining work; keep "
                   "your plan up to date with update_plan.")
        return Grant(number=self.granted, of=self.max_extensions, steps=self.steps,
                     seconds=self.seconds, reason=reason,
                     progress_step=self.last_progress_step, message=message)

    def extended(self, limits: BudgetLimits) -> BudgetLimits:
        """`limits` (the base ones) with every grant so far added."""
        if self.granted == 0:
            return limits
        return replace(limits, max_steps=limits.max_steps + self.granted * self.steps,
                       max_seconds=limits.max_seconds + self.granted * self.seconds)

    def final_stop(self, stop: Stop, base: BudgetLimits) -> Stop:
        """The stop that ends an extended turn names both limits: the base one and the
        extended one it reached."""
        if self.granted == 0 or stop.code not in EXTENDABLE or stop.base_limit is not None:
            return stop
        if stop.code is StopCode.BUDGET_STEPS:
            base_limit: float = base.max_steps
            unit = "steps"
        else:
            base_limit = base.max_seconds
            unit = "s"
        times = "1 extension" if self.granted == 1 else f"{self.granted} extensions"
        message = (f"{stop.message} (base limit {_num(base_limit)} {unit}, extended to "
                   f"{_num(float(stop.limit or 0))} {unit} by {times})")
        return replace(stop, message=message, base_limit=base_limit)

    def snapshot(self) -> dict[str, Any]:
        if self._snapshot is None:
            self._snapshot = {
                "granted": self.granted, "last_progress_step": self.last_progress_step,
                "marks": list(self._marks), "plan": self.plan.snapshot(),
                "completed": sorted(self._completed_seen)}
        return self._snapshot

    def restore_state(self, data: Mapping[str, Any] | None) -> Extension:
        """This extension with the state of a checkpoint (None: a fresh turn)."""
        if data:
            self.granted = int(data.get("granted", 0))
            self.last_progress_step = int(data.get("last_progress_step", 0))
            self._marks = tuple(int(m) for m in data.get("marks", ()))
            self.plan = Plan.restore(data.get("plan", ()))
            self._completed_seen = {str(t) for t in data.get("completed", ())}
            self._snapshot = None
        return self
