"""Fleet mail: a steer, an answer or a cancel for a turn another node runs.

Such a message is durable mail in the shared store; the node holding the turn (or the
next one to claim it) applies it within a second (NOTIFY wakes it at once). A message
is applied exactly once, even across a crash: it is taken from the mailbox in the
transaction that adds it to the turn's stored inbox; a cancel stays in the mailbox until
the turn's end commits (which takes it), so a node that dies first leaves it for the
next holder.
"""

from __future__ import annotations

from typing import Any, Protocol

import structlog

from turnkeeper.events import Event
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.store.base import StoreError
from turnkeeper.store.fleet import FleetStore, MailTaken
from turnkeeper.supervisor.core import AppendMessage, LiveTurn, SupervisorCore
from turnkeeper.supervisor.errors import NotWaiting, TurnFinished

log = structlog.get_logger("turnkeeper.fleet")


class Recipient(Protocol):
    """What applies mail to a turn this node runs: the intake, as for a request made
    here."""

    async def cancel(self, turn_id: str, *, now: bool = False) -> dict[str, Any]: ...

    async def take_message(self, live: LiveTurn, *, kind: str, text: str, redirect: bool,
                           write: AppendMessage | None = None,
                           extra: dict[str, Any] | None = None, **log_extra: Any) -> None: ...


class FleetMail:
    def __init__(self, core: SupervisorCore, store: FleetStore) -> None:
        self.core = core
        self.store = store
        # Applies mail to the turns this node runs; handed over by `Fleet.connect`.
        self.intake: Recipient | None = None

    @property
    def node_id(self) -> str:
        return self.store.node_id

    def _intake(self) -> Recipient:
        if self.intake is None:
            raise RuntimeError("fleet mail delivered before Fleet.connect()")
        return self.intake

    async def send_message(self, turn_id: str, data: dict[str, Any], *, kind: str, text: str,
                           redirect: bool) -> dict[str, Any]:
        """A steer or an answer for a turn this node does not run: durable mail the node
        holding it (or the next one to claim it) applies within a second."""
        if data.get("result") is not None or TurnState(data["state"]).terminal:
            raise TurnFinished(f"turn {turn_id} has finished")
        if kind == "answer" and data.get("question") is None:
            raise NotWaiting(f"turn {turn_id} is {data['state']} and asked no question; "
                             "send a steer instead")
        await self.store.post_mail(turn_id, "message", {"kind": kind, "text": text,
                                                        "redirect": redirect})
        return {"turn": turn_id, "accepted": kind}

    async def send_approval(self, turn_id: str, *, text: str, extra: dict[str, Any]
                            ) -> None:
        """A decision on a call held for approval, for a turn this node does not run
        (checked by the caller against the turn's stored record): mail, as an answer."""
        await self.store.post_mail(turn_id, "message", {"kind": "approval", "text": text,
                                                        "redirect": False, **extra})

    async def send_cancel(self, turn_id: str, data: dict[str, Any], *, now: bool
                          ) -> dict[str, Any]:
        if data.get("result") is not None or TurnState(data["state"]).terminal:
            return {"turn": turn_id, "state": data["state"], "finished": True}
        await self.store.post_mail(turn_id, "cancel", {"now": now})
        return {"turn": turn_id, "state": "cancelling"}

    async def deliver(self) -> None:
        """Apply the mail for the turns this node holds, each exactly once, even across a
        crash: a message is taken from the mailbox in the transaction that adds it to the
        turn's stored inbox; a cancel stays in the mailbox until the turn's end commits
        (which takes it), so a node that dies first leaves it for the next holder."""
        core = self.core
        try:
            mail = await self.store.pending_mail()
        except StoreError as exc:
            log.warning("fleet.mail_failed", node=self.node_id, error=str(exc))
            return
        for mail_id, turn_id, kind, body in mail:
            live = core.live.get(turn_id)
            if live is None or turn_id not in self.store.claims:
                continue
            try:
                if kind == "cancel":  # kept until the turn's end takes it: once a run
                    now = bool(body.get("now"))
                    if not live.control.cancel_requested or (
                            now and not live.control.cancel_now):
                        log.info("fleet.cancel_applied", node=self.node_id, turn=turn_id)
                        await self._intake().cancel(turn_id, now=now)
                else:
                    await self._apply(live, mail_id, body)
            except StoreError as exc:
                log.warning("fleet.mail_failed", node=self.node_id, turn=turn_id,
                            error=str(exc))

    async def _apply(self, live: LiveTurn, mail_id: int, body: dict[str, Any]) -> None:
        record = live.record
        kind, text, redirect = str(body["kind"]), str(body["text"]), bool(body["redirect"])
        extra = {k: v for k, v in body.items() if k not in ("kind", "text", "redirect")}
        if record.result is not None or record.terminal or (
                kind == "answer" and record.question is None) or (
                kind == "approval" and not any(p["call_id"] == extra.get("call_id")
                                               for p in record.pending_approvals)):
            log.warning("fleet.mail_dropped", node=self.node_id, turn=record.id, kind=kind,
                        state=record.state)
            await self.store.drop_mail(mail_id)
            return

        async def write(message: dict[str, Any], at: float, event: Event) -> None:
            await self.store.append_message(record.id, message, updated_at=at,
                                            events=[event], mail_id=mail_id)

        try:
            await self._intake().take_message(live, kind=kind, text=text, redirect=redirect,
                                              write=write, extra=extra or None,
                                              node=self.node_id, via="mail")
        except MailTaken:  # not written: applied already, or the turn's claim was lost
            return
