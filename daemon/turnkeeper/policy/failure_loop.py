"""The failure loop: the same tool call failing the same way in a row (the
`failure_streak` counter), a concern of its own beside loop detection (`loops.py`).

Provider retries and auto-recovery never reach it: a turn backing off through a
provider outage keeps running; only tool failures are counted here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from turnkeeper.policy.classify import FailureClass
from turnkeeper.policy.loops import action_key
from turnkeeper.policy.outcome import Stop, StopCode


class FailureLoopSettings(Protocol):
    """What `FailureLoop.from_config` reads (`[failure_loop]` fits). A protocol, so
    that `policy/` does not import the config layer."""

    @property
    def deterministic(self) -> int: ...
    @property
    def unknown(self) -> int: ...
    @property
    def retryable(self) -> int: ...


_FAILURE_CODES = {
    FailureClass.DETERMINISTIC: StopCode.FAILURE_DETERMINISTIC,
    FailureClass.UNKNOWN: StopCode.FAILURE_UNKNOWN,
    FailureClass.RETRYABLE: StopCode.FAILURE_RETRYABLE,
}


class FailureLoop:
    """Consecutive identical tool failures (the `failure_streak` counter).

    Signature = tool + canonical arguments + failure class. A failure with the signature
    of the previous failure extends its streak; any other failure starts a new streak of
    1 (a different failure resets the others). A success of the same call (any class)
    resets it; successes of other calls do not. The turn stops when the streak reaches
    the threshold of its class: deterministic 2, unknown 3, retryable 5 by default.

    Only tool failures are recorded here: provider retries and auto-recovery never
    consume these thresholds."""

    def __init__(self, *, deterministic: int = 2, unknown: int = 3, retryable: int = 5) -> None:
        for name, value in (("deterministic", deterministic), ("unknown", unknown),
                            ("retryable", retryable)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.thresholds: dict[FailureClass, int] = {
            FailureClass.DETERMINISTIC: deterministic,
            FailureClass.UNKNOWN: unknown,
            FailureClass.RETRYABLE: retryable,
        }
        self._signature: str | None = None
        self._streak = 0

    def __repr__(self) -> str:
        t = self.thresholds
        return (f"FailureLoop(deterministic={t[FailureClass.DETERMINISTIC]}, "
                f"unknown={t[FailureClass.UNKNOWN]}, retryable={t[FailureClass.RETRYABLE]}, "
                f"signature={self._signature!r}, streak={self._streak})")

    @classmethod
    def from_config(cls, config: FailureLoopSettings) -> FailureLoop:
        return cls(deterministic=config.deterministic, unknown=config.unknown,
                   retryable=config.retryable)

    @staticmethod
    def signature(tool: str, arguments: object, failure_class: FailureClass) -> str:
        """`<action key>:<class>`: readable class, and the call's own key as a prefix so a
        success of that call finds its streak whatever the class."""
        return f"{action_key(tool, arguments)}:{FailureClass(failure_class).value}"

    @property
    def streak(self) -> int:
        """The current streak (of the last failure's signature); 0 after a reset."""
        return self._streak

    @property
    def current_signature(self) -> str | None:
        return self._signature

    def streak_of(self, tool: str, arguments: object, failure_class: FailureClass) -> int:
        sig = self.signature(tool, arguments, failure_class)
        return self._streak if sig == self._signature else 0

    def record_failure(self, tool: str, arguments: object,
                       failure_class: FailureClass) -> Stop | None:
        """Count one classified tool failure; a Stop when its streak hits the threshold."""
        cls_ = FailureClass(failure_class)
        sig = self.signature(tool, arguments, cls_)
        if sig == self._signature:
            self._streak += 1
        else:
            self._signature, self._streak = sig, 1
        limit = self.thresholds[cls_]
        if self._streak >= limit:
            return Stop(_FAILURE_CODES[cls_],
                        f"{tool} failed {self._streak} times in a row with the same arguments "
                        f"({cls_.value} failure, limit {limit})",
                        value=self._streak, limit=limit)
        return None

    def record_success(self, tool: str, arguments: object) -> None:
        """A success of this call clears its streak, whatever class it was failing with."""
        if self._signature is None:  # no streak: nothing to clear (and no key to hash)
            return
        if self._signature.startswith(action_key(tool, arguments) + ":"):
            self._signature, self._streak = None, 0

    def snapshot(self) -> dict[str, Any]:
        if self._signature is None:
            return {"signature": None, "streak": 0}
        return {"signature": self._signature, "streak": self._streak}

    @classmethod
    def restore(cls, data: Mapping[str, Any], *, deterministic: int = 2, unknown: int = 3,
                retryable: int = 5) -> FailureLoop:
        loop = cls(deterministic=deterministic, unknown=unknown, retryable=retryable)
        sig = data.get("signature")
        loop._signature = None if sig is None else str(sig)
        loop._streak = int(data.get("streak", 0)) if sig is not None else 0
        return loop
