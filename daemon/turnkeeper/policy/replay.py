"""What a replayed dead letter resumes with.

A replay continues the turn from its last checkpoint rather than starting it over: the
same turn id and journal, so a step whose tool calls succeeded is not run again and the
model sees its own history. Only the guard that stopped the turn gets a fresh start,
because the operator has dealt with its cause (the providers are back, the tool is
fixed); every other counter, the usage and the rest of the checkpoint are kept, so a
replay cannot be used to reset a budget.
"""

from __future__ import annotations

from typing import Any

from turnkeeper.policy.outcome import StopCode

# The stops whose failed step is run again under the same number: its model call never
# answered, so the step did nothing (and ran no tool) and counting it twice would spend
# the step budget on an outage.
_STEP_AGAIN = frozenset({StopCode.PROVIDERS_EXHAUSTED, StopCode.PROVIDERS_REJECTED})


def resume_state(code: StopCode, record: dict[str, Any], checkpoint: dict[str, Any], *,
                 now: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The record and checkpoint a dead letter stopped with `code` is queued again with.
    The result moves to `previous_results`; the stop that ended it is forgotten."""
    rec = dict(record)
    cp = dict(checkpoint)
    previous = [*(rec.get("previous_results") or []), rec.get("result")]
    counters = dict(rec.get("counters") or {})
    if code in _STEP_AGAIN:
        # The provider chain starts afresh: no recovery cycle spent, the primary first.
        cp["chain"] = None
        cp["recover_until"] = None
        counters["steps"] = max(0, int(counters.get("steps", 0)) - 1)
        counters.update(provider_attempts=0, fallback_hops=0, recovery_cycles=0)
    elif code is StopCode.FAILURE_DETERMINISTIC:
        # The failure loop's streak starts again: the tool has been fixed.
        cp["failures"] = {"signature": None, "streak": 0}
    elif code is StopCode.OUTPUT_INVALID:
        # The answers start counting again (the schema, the prompt or the model was
        # changed); the turn resumes from its checkpoint before the last answer.
        counters["output_attempts"] = 0
    cp["pending_stop"] = None
    # The wall clock starts again with the replay: an operator's replay comes hours or
    # days later, and time is no budget the turn spent (its tokens, cost and steps are).
    rec.pop("started_at", None)
    rec.update(state="queued", result=None, previous_results=previous, counters=counters,
               next_attempt_at=None, question=None, updated_at=now)
    return rec, cp
