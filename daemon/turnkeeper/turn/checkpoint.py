"""A turn's state and its checkpoint, both ways: the state a turn's run begins with, fresh
(its first step) or read back from its checkpoint, and the checkpoint written from the
state as it is now. `TurnContext.new` and `TurnContext.restore` (turn/context.py) are
built from `fresh` and `restored`; `whole` and `as_stored` write what `restored` reads.

A checkpoint written to the store holds the conversation's counts, not its messages
(those go as rows, each written once), and the trail's tail (see `turn/trail.py`).
Older checkpoints are read too: one from before the trail holds the partial work inline
(and no loop guard or ledger lines), one from before the effect ledger has none. A
checkpoint this code cannot read (damaged, or written by an incompatible version) does
not leave the turn hanging: it starts afresh with `restore_error` set, ends `internal`,
and its result still reports the partial work that could be read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from turnkeeper.policy.backoff import Rand
from turnkeeper.policy.budget import BudgetGuard
from turnkeeper.policy.chain import ProviderChain
from turnkeeper.policy.effects import EffectLedger
from turnkeeper.policy.extension import Extension
from turnkeeper.policy.failure_loop import FailureLoop
from turnkeeper.policy.loops import LoopDetector
from turnkeeper.policy.outcome import Stop
from turnkeeper.settings import failure_loop, loop_detector
from turnkeeper.turn.conversation import Conversation
from turnkeeper.turn.limits_in_force import LimitsInForce
from turnkeeper.turn.record import TurnRecord
from turnkeeper.turn.terms import Terms
from turnkeeper.turn.trail import Lists, Trail
from turnkeeper.turn.trail import read as read_trail

# What reading a checkpoint this code cannot make sense of raises.
_UNREADABLE = (KeyError, TypeError, ValueError, AttributeError)


@dataclass(slots=True)
class TurnStart:
    """The state a turn's run begins with: `TurnContext` takes each field as its own."""

    conv: Conversation
    guard: BudgetGuard
    # The guard that watches the real limits of a budget that does not enforce them.
    watch: BudgetGuard | None
    loops: LoopDetector
    failures: FailureLoop
    chain: ProviderChain
    partial: list[str]
    effects: EffectLedger
    trail: Trail
    # The one source of the limits in force, and the extensions earned by progress
    # that are part of them (with the agent's plan, applied by the runner).
    limits: LimitsInForce
    extension: Extension
    open_issues: list[str] = field(default_factory=list)
    waiting_since: float | None = None
    recover_until: float | None = None
    # A guard's stop decided after a step's tools, held for the step boundary.
    pending_stop: Stop | None = None
    # Read back only: the decisions on the step's calls held for approval (call id ->
    # decision) and the checkpoint's last event number (see `TurnContext.replaying`).
    decided: dict[str, dict[str, Any]] = field(default_factory=dict)
    events_after: int | None = None
    resumed: bool = False
    # Why the checkpoint could not be read (the turn then ends `internal`).
    restore_error: str | None = None


def _limits(terms: Terms) -> tuple[LimitsInForce, Extension]:
    """The limits in force from the terms, with the extension they are extended by (none
    granted yet). A budget in warn or observe mode enforces only the step backstop and
    the clock limits; its real limits are watched by a second guard, which records what
    would have stopped."""
    extension = Extension.from_config(terms.guards.budget.extension)
    return LimitsInForce(terms.base_limits, enforce=terms.modes["budget"] == "enforce",
                         extension=extension), extension


def fresh(terms: Terms, record: TurnRecord, history: list[dict[str, Any]], rand: Rand,
          *, salvaged: list[str] | None = None, error: str | None = None) -> TurnStart:
    """The turn from its first step (`salvaged`: what an unreadable checkpoint's partial
    work could still tell, `error`: why it could not be read)."""
    limits, extension = _limits(terms)
    watched = limits.for_watch()
    loops = loop_detector(terms.guards.loop_detection)
    effects = EffectLedger(record.id)
    partial = salvaged if salvaged is not None else []
    return TurnStart(
        conv=Conversation.start(history, record.message),
        guard=BudgetGuard(limits.for_guard()),
        watch=None if watched is None else BudgetGuard(watched),
        loops=loops, failures=failure_loop(terms.guards.failure_loop),
        chain=terms.chain.new_chain(rand), partial=partial, effects=effects,
        trail=Trail((partial, loops.lines, effects.lines)),
        limits=limits, extension=extension, restore_error=error)


def restored(terms: Terms, record: TurnRecord, checkpoint: dict[str, Any],
             history: list[dict[str, Any]], rand: Rand) -> TurnStart:
    """The turn as its checkpoint left it. One that holds no conversation yet starts
    fresh; one that cannot be read starts fresh too, with `restore_error` set."""
    if not checkpoint.get("conversation"):
        return fresh(terms, record, history, rand)
    try:
        start = _read(terms, record, checkpoint, rand)
    except _UNREADABLE as exc:
        return fresh(terms, record, history, rand, salvaged=_salvaged_partial(checkpoint),
                     error=f"checkpoint unreadable: {type(exc).__name__}: {exc}")
    # The decisions on the step's calls held for approval (kept until the step's tools
    # ran: a crash before then runs them again as decided), the extensions earned, and
    # the last event number when the checkpoint was taken (see `TurnContext.replaying`).
    start.decided = dict(checkpoint.get("approvals") or {})
    start.extension.restore_state(checkpoint.get("extension"))
    start.events_after = checkpoint.get("event_seq")
    start.resumed = True
    return start


def _read(terms: Terms, record: TurnRecord, checkpoint: dict[str, Any], rand: Rand
          ) -> TurnStart:
    """The state proper of a checkpoint; raises when it cannot be read."""
    limits, extension = _limits(terms)
    watched = limits.for_watch()
    conv = Conversation.from_json(checkpoint["conversation"])
    guard = BudgetGuard.restore(checkpoint["budget"], limits=limits.for_guard())
    watch = None if watched is None else BudgetGuard.restore(
        checkpoint.get("budget_watch") or {"warned": []}, limits=watched)
    (partial, loop_lines, effect_lines), rows, spilled = _trail_of(checkpoint)
    loops = loop_detector(terms.guards.loop_detection, checkpoint["loops"], loop_lines)
    failures = failure_loop(terms.guards.failure_loop, checkpoint["failures"])
    chain = terms.chain.restore_chain(checkpoint.get("chain"), rand)
    partial = [str(x) for x in partial]
    open_issues = list(checkpoint.get("open_issues", ()))
    waiting_since, recover_until = checkpoint.get("waiting_since"), checkpoint.get(
        "recover_until")
    pending = checkpoint.get("pending_stop")
    # A guard's stop decided after a step's tools (loop detection) and not yet applied:
    # checkpointed, or a crash would let the turn run one step too many.
    pending_stop = Stop.from_json(pending) if pending else None
    effects = _ledger_of(checkpoint, effect_lines, record.id)
    return TurnStart(
        conv=conv, guard=guard, watch=watch, loops=loops, failures=failures, chain=chain,
        partial=partial, effects=effects,
        trail=Trail((partial, loops.lines, effects.lines), rows=rows, spilled=spilled),
        limits=limits, extension=extension, open_issues=open_issues,
        waiting_since=waiting_since, recover_until=recover_until, pending_stop=pending_stop)


def _trail_of(checkpoint: dict[str, Any]) -> tuple[Lists, int, tuple[int, ...]]:
    """The trail's three lists, its rows and how many lines of each list are in them. A
    checkpoint from before the trail existed holds the partial work itself (and no loop
    guard or ledger lines): its first save writes them as the trail's tail."""
    if "trail" in checkpoint:
        return read_trail(checkpoint["trail"])
    return (list(checkpoint.get("partial", ())), [], []), 0, (0, 0, 0)


def _ledger_of(checkpoint: dict[str, Any], lines: list[str], turn: str) -> EffectLedger:
    """The checkpoint's effect ledger; an empty one for a checkpoint from before the
    ledger existed."""
    effects = checkpoint.get("effects")
    return EffectLedger.restore(effects, lines) if effects else EffectLedger(turn)


def _salvaged_partial(checkpoint: dict[str, Any]) -> list[str]:
    """The partial-work lines of a checkpoint that cannot be restored, when they can be
    read on their own (none otherwise): what the turn's result still reports."""
    try:
        if "trail" in checkpoint:
            return [str(x) for x in read_trail(checkpoint["trail"])[0][0]]
        return [str(x) for x in checkpoint.get("partial") or ()]
    except _UNREADABLE:
        return []


class Checkpointed(Protocol):
    """What a checkpoint is written from: the state a run began with, as it is now (a
    `TurnContext` holds it)."""

    conv: Conversation
    trail: Trail
    guard: BudgetGuard
    watch: BudgetGuard | None
    loops: LoopDetector
    failures: FailureLoop
    chain: ProviderChain
    open_issues: list[str]
    waiting_since: float | None
    recover_until: float | None
    pending_stop: Stop | None
    effects: EffectLedger
    decided: dict[str, dict[str, Any]]
    extension: Extension


def whole(state: Checkpointed, event_seq: int) -> dict[str, Any]:
    """The whole state, messages and trail lines inline: what a resume from memory
    starts from (`event_seq`: the last event number now)."""
    conversation = state.conv.to_json()
    return as_stored(state, state.trail.to_json(), event_seq, conversation=conversation)


def as_stored(state: Checkpointed, trail: dict[str, Any], event_seq: int, *,
              conversation: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint as the store keeps it: the conversation's counts, not its
    messages, and the trail's part (`Trail.save`) (their rows go on their own).
    `whole` gives the conversation's part and the trail's whole instead."""
    # One dict, the conversation and trail parts first: not a dict of the rest merged
    # into another (a checkpoint is written 1.2 times a step).
    return {
        "conversation": state.conv.stored_json() if conversation is None else conversation,
        "trail": trail,
        "budget": state.guard.snapshot(),
        "budget_watch": state.watch.snapshot() if state.watch is not None else None,
        "loops": state.loops.snapshot(),
        "failures": state.failures.snapshot(),
        "chain": state.chain.snapshot(),
        "open_issues": list(state.open_issues),
        "waiting_since": state.waiting_since,
        "recover_until": state.recover_until,
        "pending_stop": state.pending_stop.to_json() if state.pending_stop else None,
        "effects": state.effects.snapshot(),
        "approvals": dict(state.decided),
        "extension": state.extension.snapshot(),
        "event_seq": event_seq,
    }
