"""A non-idempotent side effect happens at most once, even when its reply is lost.

This module serves non-idempotent tool calls only. An idempotent tool keeps the key
`<turn>.<step>.<index>` the turn runner builds itself: sending it twice is harmless, so
it needs no memory across steps.

For a non-idempotent call the key must survive the model re-issuing the same action in
a later step, because the server dedupes on the key: if the reply to a POST was lost
and the model asks again, only the same key lets the server say "already done". So the
key is derived from what the call *is* (turn, tool, canonical arguments) plus an
ordinal that advances only after the action succeeded (`ok`). Until then every repeat
carries the same key: after a failure (the server may still have done part of it, and
a server that dedupes must see the same key to say so) and after an unknown outcome.
After a success a new call of the same action is a deliberate second effect and gets
the next key.

An answer is not always a known outcome: a non-idempotent request answered 408 or 5xx
(except 501, "not implemented") came back from whatever stands between the daemon and
the server (a gateway, a proxy, a load balancer) as often as from the server itself,
and says nothing of whether the server did the work. Such an answer is `unknown`, like
a timeout (`unknown_after_status`).

A repeat of an action whose last outcome is unknown is sent again (same key) only when
the tool promises to dedupe keys; otherwise it is refused without being sent, as a
deterministic failure, so the failure loop stops a model that insists.

Wiring, per non-idempotent call: `plan()` before sending; on `Send(key)` send with that
key and then `record()` the attempt's `ToolOutcome.kind`; on `Refuse(failure)` send
nothing and report the failure as the call's result. A call cut by a cancel or a stop
while in flight is recorded "unknown". Each outcome recorded is also a line of `lines`,
appended once: the turn's trail keeps them, and `restore(snapshot, lines)` replays them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from turnkeeper.policy.classify import CallFailure
from turnkeeper.policy.loops import action_key

# Characters of the action hash kept in a key: enough to tell a turn's actions of one
# tool apart (48 bits), short enough to read in a server's log next to the tool name.
KEY_HASH_CHARS = 12

# The exception name a refusal carries; classify() counts it as deterministic.
REFUSAL_EXCEPTION = "OutcomeUnknown"
REFUSAL_MESSAGE = "outcome unknown; not repeated; verify first"


# The ledger's lines: a tag, then the action's hash. `k` is a success (or, in a trail
# written before failures kept the key, any known outcome): the ordinal advances; `f` a
# failure: the ordinal stays, the action is no longer unknown; `u` an unknown outcome.
_OK, _FAILED, _UNKNOWN = "k", "f", "u"


class EffectOutcome(StrEnum):
    OK = "ok"
    FAILED = "failed"
    UNKNOWN = "unknown"


_TAGS = {EffectOutcome.OK: _OK, EffectOutcome.FAILED: _FAILED,
         EffectOutcome.UNKNOWN: _UNKNOWN}


def unknown_after_status(status: int) -> bool:
    """Whether a non-idempotent request answered with this HTTP status has an unknown
    outcome: 408 (the request timed out somewhere on its way) and every 5xx but 501
    (which says the method is not implemented: nothing was done). A gateway's 502, 503
    or 504 is sent whether or not the server behind it did the work."""
    return status == 408 or (500 <= status < 600 and status != 501)


@dataclass(frozen=True, slots=True)
class Send:
    """Send the call with this Idempotency-Key. `repeat` is True when it is the same key
    as an earlier attempt whose outcome is unknown (the tool dedupes keys)."""

    key: str
    repeat: bool = False


@dataclass(frozen=True, slots=True)
class Refuse:
    """Do not send: the last attempt of this action has an unknown outcome and the tool
    does not dedupe keys. `failure` is what the model is told."""

    failure: CallFailure


Plan = Send | Refuse


@dataclass(slots=True)
class _Action:
    ordinal: int = 1
    unknown: bool = False


def effect_key(turn_id: str, tool: str, arguments: object, ordinal: int) -> str:
    """`<turn>.<tool>.<hash>.<ordinal>`: readable in the tool server's log (which turn,
    which tool, which nth time), stable across daemon restarts (no random part), and
    the same for the same action whatever the order of its JSON keys."""
    digest = action_key(tool, arguments)[:KEY_HASH_CHARS]
    return f"{turn_id}.{tool}.{digest}.{ordinal}"


class EffectLedger:
    """One turn's memory of its non-idempotent actions: their ordinal and whether the
    last attempt's outcome is unknown. Kept in the turn's checkpoint (`snapshot`, which
    names the turn) and its trail (`lines`: one per outcome recorded, a tag and the
    action's hash), so a resumed turn refuses the same repeats."""

    __slots__ = ("_actions", "_lines", "_turn_id")

    def __init__(self, turn_id: str) -> None:
        self._turn_id = turn_id
        self._actions: dict[str, _Action] = {}
        self._lines: list[str] = []

    def plan(self, tool: str, arguments: object, *, dedupes_keys: bool) -> Plan:
        """What to do with a call about to be sent. Pure: nothing changes until record()."""
        action = self._actions.get(action_key(tool, arguments))
        ordinal = action.ordinal if action else 1
        key = effect_key(self._turn_id, tool, arguments, ordinal)
        if action is None or not action.unknown:
            return Send(key)
        if dedupes_keys:
            return Send(key, repeat=True)
        return Refuse(CallFailure(
            exception=(REFUSAL_EXCEPTION,),
            message=f"{tool}: {REFUSAL_MESSAGE} (Idempotency-Key {key})"))

    def record(self, tool: str, arguments: object, outcome: EffectOutcome | str) -> None:
        """Only a success closes the action's ordinal (the next call of it is a new
        effect, with the next key). A failure keeps the key, so a repeat carries it
        again; an unknown outcome keeps it too, and the next plan() of the same action
        repeats the key or refuses."""
        self._apply(_TAGS[EffectOutcome(outcome)] + action_key(tool, arguments))

    def _apply(self, line: str) -> None:
        tag, key = line[:1], line[1:]
        if tag not in (_OK, _FAILED, _UNKNOWN) or not key:
            raise ValueError(f"not an effect ledger line: {line!r}")
        action = self._actions.setdefault(key, _Action())
        action.unknown = tag == _UNKNOWN
        if tag == _OK:
            action.ordinal += 1
        self._lines.append(line)

    @property
    def lines(self) -> list[str]:
        """Every outcome recorded this turn, oldest first, as `restore` replays them
        (appended to, never changed: read it, do not modify it)."""
        return self._lines

    def unknown_count(self) -> int:
        return sum(1 for a in self._actions.values() if a.unknown)

    def snapshot(self) -> dict[str, Any]:
        """JSON-safe: the turn (the actions are in `lines`)."""
        return {"turn": self._turn_id}

    @classmethod
    def restore(cls, snapshot: Mapping[str, Any], lines: Sequence[str] = ()) -> EffectLedger:
        """The ledger of `snapshot()` and `lines`. A snapshot written before the lines
        existed holds its actions (hash -> [ordinal, unknown]): they become lines that
        rebuild the same state, so the turn's next checkpoint writes them as such."""
        ledger = cls(str(snapshot["turn"]))
        older: list[str] = []
        for key, (ordinal, unknown) in dict(snapshot.get("actions") or {}).items():
            older += [_OK + str(key)] * (int(ordinal) - 1)
            if unknown:
                older.append(_UNKNOWN + str(key))
        for line in (*older, *lines):
            ledger._apply(line)
        return ledger

    def __repr__(self) -> str:
        return (f"EffectLedger(turn={self._turn_id!r}, actions={len(self._actions)}, "
                f"unknown={self.unknown_count()})")

