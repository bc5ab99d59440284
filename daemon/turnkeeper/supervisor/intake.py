"""Intake room: what comes in from clients (a new turn, a message to a running one, a
cancel), checked and made durable before it is acknowledged; a dead letter taken again
goes through `replays.py`, a keyed submit through `keyed.py`.

Submits are cheap on purpose: a submit is checked, written with its `turn.queued` event
and answered; the turn runs later, in the scheduler's order. Submits that arrive together
(or come as one batch) share the store's group commit, so N of them cost one
transaction. While the event loop is behind (`policy/overload.py`, fed with loop-lag
samples) new submits are refused, so a daemon short of CPU keeps answering its control
socket instead of taking work it cannot run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from turnkeeper import event_types as ev
from turnkeeper.config import DaemonConfig
from turnkeeper.events import Event
from turnkeeper.policy.admission import inbox_full
from turnkeeper.policy.agents import turn_choice
from turnkeeper.policy.idempotency import IdempotencyKey
from turnkeeper.policy.outcome import Stop, StopCode, TurnResult
from turnkeeper.policy.overload import (
    Cleared,
    OverloadGuard,
    OverloadRefusal,
    OverloadSettings,
    Shed,
    batch_refusal,
)
from turnkeeper.policy.scheduler import Refusal, queue_full
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.providers.prices import unpriced_in
from turnkeeper.store.base import StoreError
from turnkeeper.supervisor.core import (
    AppendMessage,
    LiveTurn,
    SupervisorCore,
    log_context,
    new_turn_id,
)
from turnkeeper.supervisor.errors import (
    BatchItemInvalid,
    InboxFull,
    IntakeRefused,
    NotWaiting,
    TurnFinished,
    UnknownAgent,
    UnknownModel,
    UnknownProfile,
    UnknownTurn,
    UnpricedCostLimit,
)
from turnkeeper.supervisor.fleet import Fleet
from turnkeeper.supervisor.scheduling import Scheduling
from turnkeeper.turn.record import TurnRecord

log = structlog.get_logger("turnkeeper.supervisor")


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """One submit, validated by the control API."""

    message: str
    session: str | None = None
    budget: dict[str, Any] | None = None
    deadline: float | None = None
    profile: str | None = None
    model: str | None = None
    # The named agent (`[agents.NAME]`); None: the default agent.
    agent: str | None = None
    # The JSON Schema of the final answer (None: the agent's, if any).
    output_schema: dict[str, Any] | None = None
    # Not part of the submit's fingerprint: the key names the submit, it is not in it.
    idempotency_key: str | None = None
    # Not part of the fingerprint either: a retry may come from another span.
    traceparent: str | None = None


def overload_settings(daemon: DaemonConfig) -> OverloadSettings:
    return OverloadSettings(lag_threshold_s=daemon.overload_lag,
                            enter_samples=daemon.overload_samples,
                            clear_after_s=daemon.overload_clear_after)


class Intake:
    def __init__(self, core: SupervisorCore, *, scheduling: Scheduling,
                 fleet: Fleet | None) -> None:
        self.core = core
        self.scheduling = scheduling  # starts what is taken
        self.fleet = fleet  # on a shared store: its queue, and mail to other nodes' turns
        self._overload_of: DaemonConfig = core.config.daemon
        self.overload = OverloadGuard(overload_settings(self._overload_of))

    # -- overload -----------------------------------------------------------------

    def observe_loop_lag(self, lag_s: float) -> None:
        """One event-loop lag sample; intake closes or reopens as the guard decides."""
        daemon = self.core.config.daemon
        if daemon is not self._overload_of:  # a reload: the guard takes the new settings
            self._overload_of = daemon
            self._log_decision(self.overload.configure(overload_settings(daemon)))
        self._log_decision(self.overload.observe(lag_s, now=self.core.clock.monotonic()))

    def _log_decision(self, decision: Shed | Cleared | None) -> None:
        if isinstance(decision, Shed):
            log.warning("daemon.overloaded", lag_s=round(decision.lag_s, 4),
                        overload_lag=decision.threshold_s, samples=decision.samples,
                        queued=len(self.core.queue), running=self.core.running)
        elif isinstance(decision, Cleared):
            log.warning("daemon.overload_cleared", lag_s=round(decision.lag_s, 4),
                        shed_for_s=round(decision.shed_for_s, 3), refused=decision.refused)

    def _check_open(self, batch: int | None = None) -> None:
        """Raise `IntakeRefused` unless a submit (or a batch of `batch`) can be taken."""
        core = self.core
        if not core.state.takes_submits:
            raise IntakeRefused(f"the daemon is {core.state}", retry_after_s=5)
        self.refuse_while_unwritable()
        refusal: Refusal | OverloadRefusal | None
        # A fleet's queue is the turns no node holds yet, whichever node took them.
        queued = len(core.queue) if self.fleet is None else self.fleet.waiting()
        if batch is None:
            refusal = queue_full(queued, max_queued=core.scheduler.max_queued,
                                 running=core.running)
        else:
            refusal = batch_refusal(batch=batch, queued=queued,
                                    max_queued=core.scheduler.max_queued,
                                    running=core.running)
        if refusal is None:
            refusal = self.overload.refusal()
        if refusal is not None:
            raise IntakeRefused(refusal.reason, retry_after_s=refusal.retry_after_s)

    def refuse_while_unwritable(self) -> None:
        """Nothing is accepted that could not be kept: while the store fails its writes a
        submit or a replay is refused (507) rather than left waiting on the disk."""
        outage = self.core.store.outage
        if outage.degraded:
            raise IntakeRefused(f"the state store cannot be written: {outage.last_error}",
                                retry_after_s=outage.retry_after_s(), status=507)

    # -- submits ------------------------------------------------------------------

    def _check_profile(self, profile: str | None) -> str | None:
        """None when the profile is known (or none is named), else why not."""
        profiles = self.core.config.budget.profiles
        if profile is None or profile in profiles:
            return None
        known = ", ".join(sorted(profiles)) or "none are configured"
        return f"no budget profile {profile!r} (known: {known})"

    def _check_agent(self, agent: str | None) -> str | None:
        """None when the agent is defined (or none is named), else why not."""
        agents = self.core.runtime.settings.agents
        if agent is None or agent in agents:
            return None
        known = ", ".join(sorted(agents)) or "none are configured"
        return f"no agent {agent!r} (known: {known})"

    def _resolved(self, req: SubmitRequest) -> SubmitRequest:
        """`req` with its agent's model and profile where it gives none of its own (the
        submit wins), checked then like the submit's own. The agent must be known."""
        agent = self.core.runtime.settings.agent(req.agent)
        assert agent is not None
        if agent.model is None and agent.profile is None:
            return req  # the usual agent names neither: the submit as it is, no copy
        return replace(req, model=turn_choice(req.model, agent.model),
                       profile=turn_choice(req.profile, agent.profile))

    def _check_model(self, model: str | None) -> str | None:
        """None when the model (an alias or a provider's name) is known, else why not."""
        try:
            self.core.config.model_chain(model)
        except KeyError:
            return f"no model or provider {model!r} (known: " \
                f"{', '.join(self.core.config.model_names())})"
        return None

    def _check_cost(self, budget: dict[str, Any] | None, model: str | None) -> str | None:
        """Why a submit's cost limit cannot be: its chain holds an unpriced provider."""
        if not (budget or {}).get("max_cost_usd") or self._check_model(model) is not None:
            return None  # no cost limit (absent, None or 0), or the model is unknown
        return unpriced_in(self.core.config, self.core.config.model_chain(model))

    def _prepare(self, req: SubmitRequest, *, replay_of: str | None = None
                 ) -> tuple[LiveTurn, Event]:
        """A new turn's record, registered as live (so a concurrent GET sees it), and its
        `turn.queued` event, not yet published."""
        core = self.core
        now = core.clock.time()
        turn_id = new_turn_id()
        record = TurnRecord(id=turn_id, session=req.session or turn_id, message=req.message,
                            created_at=now, updated_at=now, state=TurnState.QUEUED,
                            policy_version=core.policy.version, budget=req.budget or {},
                            deadline=req.deadline, replay_of=replay_of, profile=req.profile,
                            model=req.model, agent=req.agent,
                            provider=core.config.model_chain(req.model)[0],
                            traceparent=req.traceparent,
                            output_schema=req.output_schema)
        live = LiveTurn(record=record)
        core.live[turn_id] = live
        queued = core.bus.prepare(ev.TurnQueued(session=record.session,
                                                message=req.message[:2000],
                                                policy_version=record.policy_version),
                                  turn=turn_id)
        return live, queued

    async def _write(self, live: LiveTurn, queued: Event,
                     idempotency: IdempotencyKey | None = None) -> dict[str, Any]:
        """The turn on disk with its `turn.queued` event, then queued and published (a
        turn started earlier would not know its seq, which orders its session's
        history). A failed write forgets the turn. Returns the record as written."""
        core = self.core
        record = live.record
        data = record.to_json()
        try:
            record.seq = await core.store.insert_turn(
                data, {}, events=[queued], within_s=core.config.daemon.submit_timeout,
                idempotency=idempotency)
        except BaseException:
            core.live.pop(record.id, None)
            core.bus.withdraw(queued)
            raise
        if self.fleet is not None:  # the fleet's: whichever node claims it runs it
            core.live.pop(record.id, None)
            self.fleet.wake(submitted=1)
        elif record.id in core.live:  # not cancelled while the write ran
            core.scheduler.enqueue(record.id, record.session)
        core.bus.deliver(queued)
        data["seq"] = record.seq
        return data

    async def submit(self, *, message: str, session: str | None, budget: dict[str, Any],
                     deadline: float | None, replay_of: str | None = None,
                     profile: str | None = None, model: str | None = None,
                     agent: str | None = None,
                     idempotency: IdempotencyKey | None = None,
                     traceparent: str | None = None,
                     output_schema: dict[str, Any] | None = None) -> TurnRecord:
        core = self.core
        if (unknown := self._check_agent(agent)) is not None:
            raise UnknownAgent(f"agent: {unknown}")
        req = self._resolved(SubmitRequest(message=message, session=session, budget=budget,
                                           deadline=deadline, profile=profile, model=model,
                                           agent=agent, traceparent=traceparent,
                                           output_schema=output_schema))
        profile, model = req.profile, req.model
        if (unknown := self._check_model(model)) is not None:
            raise UnknownModel(f"model: {unknown}")
        if (unknown := self._check_profile(profile)) is not None:
            raise UnknownProfile(f"profile: {unknown}")
        if (unpriced := self._check_cost(budget, model)) is not None:
            raise UnpricedCostLimit(f"budget.max_cost_usd: {unpriced}")
        self._check_open()
        live, queued = self._prepare(req, replay_of=replay_of)
        await self._write(live, queued, idempotency)
        log.info("turn.queued", **log_context(live.record), queued=len(core.queue))
        self.scheduling.dispatch()
        return live.record

    async def submit_batch(self, requests: Sequence[SubmitRequest],
                           keys: Sequence[IdempotencyKey | None] = ()
                           ) -> list[dict[str, Any] | Exception]:
        """Several submits taken together: all checked first (an unknown profile raises
        `BatchItemInvalid` naming its index; no room in the queue for all of them, or
        an overload, raises `IntakeRefused`: nothing is taken), then written at once so
        they share one store transaction. The answer is in the order of `requests`: each
        turn as written, or the error its write met (the others are taken all the same).
        `keys`: each request's Idempotency-Key row, written with its turn (none when shorter).
        """
        core = self.core
        for i, req in enumerate(requests):
            unknown = self._check_agent(req.agent)
            if unknown is not None:
                raise BatchItemInvalid(i, "agent", unknown)
        requests = [self._resolved(req) for req in requests]
        for i, req in enumerate(requests):
            for field, unknown in (
                    ("model", self._check_model(req.model)),
                    ("profile", self._check_profile(req.profile)),
                    ("budget.max_cost_usd", self._check_cost(req.budget, req.model))):
                if unknown is not None:
                    raise BatchItemInvalid(i, field, unknown)
        self._check_open(batch=len(requests))
        prepared = [self._prepare(req) for req in requests]
        results: list[dict[str, Any] | Exception] = [{} for _ in prepared]

        async def write(i: int, live: LiveTurn, queued: Event) -> None:
            try:
                results[i] = await self._write(live, queued,
                                               keys[i] if i < len(keys) else None)
            except Exception as exc:  # this one fails alone; its neighbours are taken
                results[i] = exc

        try:
            # Started together, the writes reach the store's writer in one batch: one
            # transaction for the lot. Bare asyncio tasks: an anyio task group spent 16 us
            # a task to start, gather 3 (each write catches its own error, so only a
            # cancellation comes out, and the writes it cut still commit).
            await asyncio.gather(*(write(i, live, queued)
                                   for i, (live, queued) in enumerate(prepared)))
        except BaseException:
            for live, _ in prepared:
                if not live.record.seq:
                    core.live.pop(live.record.id, None)
            raise
        taken = [live.record.id for live, _ in prepared if live.record.seq]
        log.info("turns.queued", turns=taken, refused=len(results) - len(taken),
                 queued=len(core.queue), policy_version=core.policy.version)
        self.scheduling.dispatch()
        return results

    async def post_message(self, turn_id: str, *, kind: str, text: str,
                           redirect: bool) -> dict[str, Any]:
        core = self.core
        live = core.live.get(turn_id)
        if live is None:
            data = await core.store.get_turn(turn_id)
            if data is None:
                raise UnknownTurn(turn_id)
            if self.fleet is not None:  # run by another node, or by none yet: mail it
                return await self.fleet.mail.send_message(turn_id, data, kind=kind,
                                                          text=text, redirect=redirect)
            raise TurnFinished(f"turn {turn_id} has finished")
        record = live.record
        if record.result is not None or record.terminal:
            # Its result is being written: nobody would read the message.
            raise TurnFinished(f"turn {turn_id} has finished")
        if kind == "answer" and record.question is None:
            raise NotWaiting(f"turn {turn_id} is {record.state} and asked no question; "
                             "send a steer instead")
        limit = core.config.daemon.max_pending_messages
        if inbox_full(len(record.inbox), max_pending_messages=limit):
            raise InboxFull(f"turn {turn_id} holds {len(record.inbox)} messages its next "
                            f"step has not taken (daemon.max_pending_messages = {limit})")
        await self.take_message(live, kind=kind, text=text, redirect=redirect)
        return {"turn": turn_id, "accepted": kind}

    async def take_message(self, live: LiveTurn, *, kind: str, text: str, redirect: bool,
                           write: AppendMessage | None = None,
                           extra: dict[str, Any] | None = None, **log_extra: Any) -> None:
        """A steer, an answer or an approval decision (its call, decision and edited arguments in
        `extra`) into the turn's inbox, durable with its `turn.message` event before the turn
        hears of it. `write` stores it (the store's `append_message` unless given: fleet mail
        takes its mail in the same transaction). A write that fails leaves the inbox as it was:
        the sender hears the message was not taken, and kept, the turn would act on a message the
        sender may well send again."""
        core = self.core
        record = live.record
        now = core.clock.time()
        message = {"kind": kind, "text": text, "redirect": redirect, "at": now,
                   **(extra or {})}
        record.inbox.append(message)
        record.updated_at = now
        event = core.bus.prepare(ev.TurnMessage(kind=kind, text=text[:2000], redirect=redirect),
                                 turn=record.id)
        try:
            if write is None:
                await core.store.append_message(record.id, message, updated_at=now,
                                                events=[event])
            else:
                await write(message, now, event)
        except StoreError:
            if message in record.inbox:
                record.inbox.remove(message)
            core.bus.withdraw(event)
            raise
        core.bus.deliver(event)
        log.info("turn.message", **log_context(record), kind=kind, redirect=redirect,
                 **log_extra)
        live.control.message_arrived(redirect=redirect)

    async def cancel(self, turn_id: str, *, now: bool = False) -> dict[str, Any]:
        """A running turn ends `cancelled` at once, except that a side effect in flight
        finishes first; `now` cuts that too (its outcome is then unknown)."""
        core = self.core
        live = core.live.get(turn_id)
        if live is None:
            data = await core.store.get_turn(turn_id)
            if data is None:
                raise UnknownTurn(turn_id)
            if self.fleet is not None:  # run by another node, or by none yet: mail it
                return await self.fleet.mail.send_cancel(turn_id, data, now=now)
            return {"turn": turn_id, "state": data["state"], "finished": True}
        if live.running:
            live.control.cancel(now=now)
        else:
            core.scheduler.dequeue(turn_id)
            await self.scheduling.finish(live, TurnResult(stopped_because=Stop(
                StopCode.CANCELLED, "cancelled before it started")))
        return {"turn": turn_id, "state": "cancelling" if live.running else "cancelled"}
