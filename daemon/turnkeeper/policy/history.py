"""How much of a session's past a new turn carries.

Each new turn of a session starts with the session's earlier turns (their messages and
answers) before its own message. Unbounded, a long session makes every turn dearer than
the last: 2,000 turns reached 55,000 input tokens a turn. `bound_history` keeps the newest
turns whose estimated size fits `max_tokens`, dropping the oldest ones first, whole turns
only (a message without its answer would mislead the model), the same way the runner
compacts after a context overflow: the oldest history goes first.

Sizes are the daemon's own estimate, four characters a token, as for an overflow error
that does not give its numbers: what matters is that the bound holds, not its exactness.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

CHARS_PER_TOKEN = 4
# A turn's framing (roles, separators) on the wire, in tokens, beyond its text.
TURN_OVERHEAD_TOKENS = 8

T = TypeVar("T", bound=Mapping[str, Any])


def turn_tokens(turn: Mapping[str, Any]) -> int:
    """The estimated tokens a past turn adds to the conversation: its message and its
    answer (or the line saying how it ended)."""
    result = turn.get("result") or {}
    answer = result.get("answer") or ""
    chars = len(str(turn.get("message") or "")) + len(str(answer))
    return TURN_OVERHEAD_TOKENS + chars // CHARS_PER_TOKEN


def bound_history(turns: Sequence[T], *, max_tokens: int) -> list[T]:
    """The newest of `turns` (oldest first, as given) whose estimated tokens sum to at most
    `max_tokens`, still oldest first. 0 keeps none."""
    kept: list[T] = []
    total = 0
    for turn in reversed(turns):
        total += turn_tokens(turn)
        if total > max_tokens:
            break
        kept.append(turn)
    kept.reverse()
    return kept
