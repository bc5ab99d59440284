"""A person's decisions on the tool calls turns hold for approval: the list of every call
waiting, and a decision taken to the turn.

A decision travels like a clarify answer: into the turn's durable inbox (kind
`approval`) when this node holds the turn, or as fleet mail to the node that does (or
the next one to claim it). The turn takes it where it waits (`turn/approvals.py`). What
is checked here is what the person can fix: the turn, the call (it must be pending and
not decided already) and edited arguments (they must satisfy the tool's schema).
"""

from __future__ import annotations

import json
from typing import Any

from turnkeeper.policy.turn_state import TurnState
from turnkeeper.supervisor.core import SupervisorCore
from turnkeeper.supervisor.errors import BadArguments, NotPending, TurnFinished, UnknownTurn
from turnkeeper.supervisor.fleet import Fleet
from turnkeeper.supervisor.intake import Intake

# The fields of a pending call that `GET /v1/approvals` lists, with its turn.
LISTED = ("call_id", "tool", "arguments", "key", "requested_at")
# How many waiting turns a fleet node reads from the shared store for the list.
MAX_WAITING_LISTED = 10_000


def listed(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The pending calls of one turn's record, as the list shows them."""
    if record.get("result") is not None or TurnState(record["state"]).terminal:
        return []
    return [{"turn": record["id"], **{k: p.get(k) for k in LISTED}}
            for p in record.get("pending_approvals") or ()]


class Approvals:
    def __init__(self, core: SupervisorCore, *, intake: Intake, fleet: Fleet | None) -> None:
        self.core = core
        self.intake = intake  # a decision for a turn this node runs: into its inbox
        self.fleet = fleet  # on a shared store: other nodes' turns, and mail to them

    async def pending(self) -> list[dict[str, Any]]:
        """Every call waiting for a decision, oldest first. On a shared store the turns
        other nodes hold are read from it (their records as of their park)."""
        core = self.core
        records = {t.record.id: t.record.to_json() for t in core.live.values()
                   if t.record.pending_approvals}
        if self.fleet is not None:
            rows = await core.store.list_turns(state=TurnState.WAITING.value, session=None,
                                               limit=MAX_WAITING_LISTED)
            for row in rows:
                records.setdefault(row["id"], row)
        out = [p for r in records.values() for p in listed(r)]
        return sorted(out, key=lambda p: (p["requested_at"] or 0.0, p["turn"], p["call_id"]))

    async def decide(self, turn_id: str, *, call_id: str, decision: str, reason: str,
                     arguments: dict[str, Any] | None) -> dict[str, Any]:
        """Take a decision to the turn. Raises UnknownTurn, TurnFinished, NotPending or
        BadArguments."""
        core = self.core
        live = core.live.get(turn_id)
        if live is not None:
            record = live.record.to_json()
        else:
            data = await core.store.get_turn(turn_id)
            if data is None:
                raise UnknownTurn(turn_id)
            record = data
        if record.get("result") is not None or TurnState(record["state"]).terminal:
            raise TurnFinished(f"turn {turn_id} has finished")
        pending = next((p for p in record.get("pending_approvals") or ()
                        if p.get("call_id") == call_id), None)
        taken = any(m.get("kind") == "approval" and m.get("call_id") == call_id
                    for m in record.get("inbox") or ())
        if pending is None or taken:
            held = ", ".join(p["call_id"] for p in record.get("pending_approvals") or ())
            raise NotPending(
                f"turn {turn_id} holds no call {call_id!r} waiting for approval"
                + (" (it is decided already)" if taken else "")
                + (f"; waiting: {held}" if held and not taken else ""))
        if decision == "approve" and arguments is not None:
            self._check(str(pending["tool"]), arguments)
        extra = {"call_id": call_id, "decision": decision,
                 "arguments": arguments if decision == "approve" else None}
        if live is not None:
            await self.intake.take_message(live, kind="approval", text=reason,
                                           redirect=False, extra=extra)
        else:
            assert self.fleet is not None, "a live turn on a single node is in memory"
            await self.fleet.mail.send_approval(turn_id, text=reason, extra=extra)
        return {"turn": turn_id, "call_id": call_id, "decision": decision}

    def _check(self, tool: str, arguments: dict[str, Any]) -> None:
        toolbox = self.core.runtime.toolbox
        if toolbox.get(tool) is None:
            return  # the tool left (an MCP server down): the turn reports it as it runs
        args, problem = toolbox.check_arguments(tool, json.dumps(arguments))
        if args is None:
            assert problem is not None
            raise BadArguments(f"arguments: {problem.failure.describe()}")
