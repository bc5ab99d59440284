"""Replays: a dead letter taken again. It resumes from its last checkpoint, the same turn
(its id, its journal, its history) under the policy in force now, with a fresh start for
the guard that stopped it (`policy/replay.py`); intake's checks (the daemon stopping,
the store unwritable) apply as to a submit."""

from __future__ import annotations

import structlog

from turnkeeper import event_types as ev
from turnkeeper.policy.outcome import StopCode, goes_to_dead_letters
from turnkeeper.policy.replay import resume_state
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.store.base import rows_of
from turnkeeper.supervisor.core import LiveTurn, SupervisorCore, log_context
from turnkeeper.supervisor.errors import IntakeRefused, TurnFinished, UnknownTurn
from turnkeeper.supervisor.fleet import Fleet
from turnkeeper.supervisor.intake import Intake
from turnkeeper.supervisor.scheduling import Scheduling
from turnkeeper.turn.record import TurnRecord

log = structlog.get_logger("turnkeeper.supervisor")


class Replays:
    def __init__(self, core: SupervisorCore, intake: Intake, *, scheduling: Scheduling,
                 fleet: Fleet | None) -> None:
        self.core = core
        self.intake = intake
        self.scheduling = scheduling
        self.fleet = fleet

    async def replay(self, turn_id: str) -> TurnRecord:
        """Resume a dead letter from its last checkpoint: the same turn, its journal and
        its history, under the policy in force now, with a fresh start for the guard that
        stopped it (see `policy/replay.py`). It leaves the dead-letter list at once."""
        core = self.core
        if not core.state.takes_submits:
            raise IntakeRefused(f"the daemon is {core.state}", retry_after_s=5)
        self.intake.refuse_while_unwritable()
        if turn_id in core.live:
            raise TurnFinished(f"turn {turn_id} is not a dead letter: it is live")
        data = await core.store.get_turn(turn_id)
        if data is None:
            raise UnknownTurn(turn_id, what="dead letter")
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
            # The checkpoint read back holds its messages and trail lines inline: they
            # go back as rows.
            stored, rows, lines = rows_of(checkpoint)
            await core.store.requeue_turn(record.to_json(), stored, messages=rows,
                                          trail=lines, events=[replayed])
        except BaseException:
            core.live.pop(turn_id, None)
            core.bus.withdraw(replayed)
            raise
        if self.fleet is not None:  # the fleet's: whichever node claims it runs it
            core.live.pop(turn_id, None)
            self.fleet.wake(submitted=1)
        elif turn_id in core.live:  # not cancelled while the write ran
            core.scheduler.enqueue(turn_id, record.session)
        core.bus.deliver(replayed)
        log.info("turn.replayed", **log_context(record), code=code.value)
        self.scheduling.dispatch()
        return record
