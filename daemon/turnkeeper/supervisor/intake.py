"""Intake room: what comes in from clients (a new turn, a message to a running one, a
cancel, a replay of a dead letter), checked and made durable before it is acknowledged."""

from __future__ import annotations

from typing import Any

import structlog

from turnkeeper import event_types as ev
from turnkeeper.policy.admission import inbox_full
from turnkeeper.policy.outcome import Stop, StopCode, TurnResult, goes_to_dead_letters
from turnkeeper.policy.replay import resume_state
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.supervisor.core import (
    InboxFull,
    IntakeRefused,
    LiveTurn,
    NotWaiting,
    SupervisorCore,
    TurnFinished,
    UnknownModel,
    UnknownProfile,
    UnknownTurn,
    log_context,
    new_turn_id,
)
from turnkeeper.turn.record import TurnRecord

log = structlog.get_logger("turnkeeper.supervisor")


class Intake:
    def __init__(self, core: SupervisorCore) -> None:
        self.core = core

    async def submit(self, *, message: str, session: str | None, budget: dict[str, Any],
                     deadline: float | None, replay_of: str | None = None,
                     profile: str | None = None, model: str | None = None) -> TurnRecord:
        core = self.core
        try:
            chain = core.config.model_chain(model)
        except KeyError:
            known = ", ".join(core.config.model_names())
            raise UnknownModel(f"model: no model or provider {model!r} (known: {known})"
                               ) from None
        if profile is not None and profile not in core.config.budget.profiles:
            known = ", ".join(sorted(core.config.budget.profiles)) or "none are configured"
            raise UnknownProfile(f"profile: no budget profile {profile!r} (known: {known})")
        if core.state in ("starting", "stopping"):
            raise IntakeRefused(f"the daemon is {core.state}", retry_after_s=5)
        self.refuse_while_unwritable()
        refusal = core.scheduler.refusal()
        if refusal is not None:
            raise IntakeRefused(refusal.reason, retry_after_s=refusal.retry_after_s)
        now = core.clock.time()
        turn_id = new_turn_id()
        record = TurnRecord(id=turn_id, session=session or turn_id, message=message,
                            created_at=now, updated_at=now, state=TurnState.QUEUED,
                            policy_version=core.policy.version, budget=budget,
                            deadline=deadline, replay_of=replay_of, profile=profile,
                            model=model, provider=chain[0])
        live = LiveTurn(record=record)
        # Registered before the write so a concurrent GET sees it; queued and answered
        # once it is on disk with its `turn.queued` event (a turn started earlier would
        # not know its seq, which orders its session's history).
        core.live[turn_id] = live
        queued = core.bus.prepare(ev.TurnQueued(session=record.session, message=message[:2000],
                                                policy_version=record.policy_version),
                                  turn=turn_id)
        try:
            record.seq = await core.store.insert_turn(record.to_json(), {}, events=[queued])
        except BaseException:
            core.live.pop(turn_id, None)
            raise
        if turn_id in core.live:  # not cancelled while the write ran
            core.scheduler.enqueue(turn_id, record.session)
        core.bus.deliver(queued)
        log.info("turn.queued", **log_context(record), queued=len(core.queue))
        core.scheduling.dispatch()
        return record

    def refuse_while_unwritable(self) -> None:
        """Nothing is accepted that could not be kept: while the store fails its writes a
        submit or a replay is refused (507) rather than left waiting on the disk."""
        outage = self.core.store.outage
        if outage.degraded:
            raise IntakeRefused(f"the state store cannot be written: {outage.last_error}",
                                retry_after_s=outage.retry_after_s(), status=507)

    async def post_message(self, turn_id: str, *, kind: str, text: str,
                           redirect: bool) -> dict[str, Any]:
        core = self.core
        live = core.live.get(turn_id)
        if live is None:
            if await core.store.get_turn(turn_id) is None:
                raise UnknownTurn(turn_id)
            raise TurnFinished(turn_id)
        record = live.record
        if record.result is not None or record.terminal:
            raise TurnFinished(turn_id)  # its result is being written: nobody would read it
        if kind == "answer" and record.question is None:
            raise NotWaiting(f"turn {turn_id} is {record.state} and asked no question; "
                             "send a steer instead")
        limit = core.config.daemon.max_pending_messages
        if inbox_full(len(record.inbox), max_pending_messages=limit):
            raise InboxFull(f"turn {turn_id} holds {len(record.inbox)} messages its next "
                            f"step has not taken (daemon.max_pending_messages = {limit})")
        now = core.clock.time()
        message = {"kind": kind, "text": text, "redirect": redirect, "at": now}
        record.inbox.append(message)
        record.updated_at = now
        event = core.bus.prepare(ev.TurnMessage(kind=kind, text=text[:2000], redirect=redirect),
                                 turn=turn_id)
        await core.store.append_message(turn_id, message, updated_at=now, events=[event])
        core.bus.deliver(event)
        log.info("turn.message", **log_context(record), kind=kind, redirect=redirect)
        live.control.message_arrived(redirect=redirect)
        return {"turn": turn_id, "accepted": kind}

    async def cancel(self, turn_id: str, *, now: bool = False) -> dict[str, Any]:
        """A running turn ends `cancelled` at once, except that a side effect in flight
        finishes first; `now` cuts that too (its outcome is then unknown)."""
        core = self.core
        live = core.live.get(turn_id)
        if live is None:
            data = await core.store.get_turn(turn_id)
            if data is None:
                raise UnknownTurn(turn_id)
            return {"turn": turn_id, "state": data["state"]}
        if live.running:
            live.control.cancel(now=now)
        else:
            core.scheduler.dequeue(turn_id)
            await core.scheduling.finish(live, TurnResult(stopped_because=Stop(
                StopCode.CANCELLED, "cancelled before it started")))
        return {"turn": turn_id, "state": "cancelling" if live.running else "cancelled"}

    async def replay(self, turn_id: str) -> TurnRecord:
        """Resume a dead letter from its last checkpoint: the same turn, its journal and
        its history, under the policy in force now, with a fresh start for the guard that
        stopped it (see `policy/replay.py`). It leaves the dead-letter list at once."""
        core = self.core
        if core.state in ("starting", "stopping"):
            raise IntakeRefused(f"the daemon is {core.state}", retry_after_s=5)
        self.refuse_while_unwritable()
        if turn_id in core.live:
            raise TurnFinished(f"turn {turn_id} is not a dead letter: it is live")
        data = await core.store.get_turn(turn_id)
        if data is None:
            raise UnknownTurn(turn_id)
        if not goes_to_dead_letters(data.get("result")):
            raise TurnFinished(f"turn {turn_id} is not a dead letter")
        code = StopCode(data["result"]["stopped_because"]["code"])
        TurnState(data["state"]).to(TurnState.QUEUED)  # the table allows it, or raises
        checkpoint = await core.store.get_checkpoint(turn_id) or {}
        if turn_id in core.live:  # replayed by another request while we read
            raise TurnFinished(f"turn {turn_id} is not a dead letter: it is live")
        rec_json, checkpoint = resume_state(code, data, checkpoint, now=core.clock.time())
        rec_json.pop("replayed_by", None)
        rec_json["replay_of"] = turn_id  # a replay of itself: the marker clients know
        record = TurnRecord.from_json(rec_json)
        if record.profile is not None and record.profile not in core.config.budget.profiles:
            record.profile = None
        live = LiveTurn(record=record, checkpoint=checkpoint)
        core.live[turn_id] = live
        replayed = core.bus.prepare(ev.TurnReplayed(previous=data["result"],
                                                    policy_version=core.policy.version),
                                    turn=turn_id)
        try:
            await core.store.requeue_turn(record.to_json(), checkpoint, events=[replayed])
        except BaseException:
            core.live.pop(turn_id, None)
            raise
        if turn_id in core.live:  # not cancelled while the write ran
            core.scheduler.enqueue(turn_id, record.session)
        core.bus.deliver(replayed)
        log.info("turn.replayed", **log_context(record), code=code.value)
        core.scheduling.dispatch()
        return record
