"""What the supervisor refuses, each with the HTTP status the control API answers it
with (`turnkeeper.errors.Refused`)."""

from __future__ import annotations

from turnkeeper.errors import Refused


class IntakeRefused(Refused):
    """Submit refused: the queue is full or the daemon is starting or stopping (503), or
    the store cannot be written (507). Always with a Retry-After."""

    status = 503

    def __init__(self, reason: str, retry_after_s: int, *, status: int = 503) -> None:
        super().__init__(reason, status=status, retry_after_s=retry_after_s)


class UnknownProfile(Refused, ValueError):
    """A submit named a budget profile the policy does not define."""

    field = "profile"


class UnknownModel(Refused, ValueError):
    """A submit named a model that is neither a `[models.NAME]` alias nor a provider."""

    field = "model"


class UnknownAgent(Refused, ValueError):
    """A submit named an agent the policy does not define (`[agents.NAME]`)."""

    field = "agent"


class UnpricedCostLimit(Refused, ValueError):
    """A submit set a cost limit over a provider chain that holds a provider with no
    price: its calls would cost $0, so the limit could never stop the turn."""

    field = "budget.max_cost_usd"


class IdempotencyConflict(Refused, ValueError):
    """A submit's Idempotency-Key made another turn from a different submit (422)."""

    status = 422
    field = "idempotency_key"


class BatchItemInvalid(Refused, ValueError):
    """One item of a batch cannot be taken; nothing of the batch was."""

    def __init__(self, index: int, field: str, message: str, *, status: int = 400) -> None:
        super().__init__(f"[{index}].{field}: {message}", status=status,
                         field=f"[{index}].{field}", index=index)


class UnknownTurn(Refused):
    """No such turn (`what`: "dead letter" for a replay)."""

    status = 404

    def __init__(self, turn_id: str, *, what: str = "turn") -> None:
        super().__init__(f"no {what} {turn_id}")
        self.turn_id = turn_id


class TurnFinished(Refused):
    """A message to a turn that has ended, or a replay of a turn that is no dead letter."""

    status = 409


class InboxFull(Refused):
    """A message to a turn that holds `daemon.max_pending_messages` not yet taken."""

    status = 429
    field = "max_pending_messages"


class NotWaiting(Refused):
    """An answer to a turn that asked no question: kept, it would answer a later one."""

    status = 409


class NotPending(Refused):
    """A decision on a tool call the turn does not hold for approval: an unknown call, or
    one decided already (a second decision is refused, never applied)."""

    status = 409
    field = "call_id"


class BadArguments(Refused, ValueError):
    """Edited arguments of an approved call that the tool's input schema refuses."""

    field = "arguments"
