"""The blocking client: the standard library over AF_UNIX, one connection a request (the
daemon's answers are small; a stream holds its own), nothing heavier imported."""

from __future__ import annotations

import contextlib
import os
import socket as socket_mod
import time
from pathlib import Path

from turnkeeper.client import _wire
from turnkeeper.client.errors import ClientError, Unreachable, WaitTimedOut
from turnkeeper.client.models import (
    ApprovalDecision,
    DeadLetter,
    Event,
    Health,
    PendingApproval,
    Status,
    Turn,
)
from turnkeeper.control.client import _Response

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs start-up time
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any


def socket_path(socket: str | os.PathLike[str] | None) -> Path:
    """The path given, else where the `turnkeeper` command would look (TURNKEEPER_SOCKET,
    the config's daemon.socket, then the runtime directories)."""
    if socket is not None:
        return Path(socket)
    from turnkeeper.paths import client_socket_path

    return client_socket_path(None)


class Client:
    """A blocking client of one daemon's control socket.

    `Client()` finds the socket as the `turnkeeper` command does; `Client(socket=PATH)`
    uses PATH. `timeout` bounds each request's connect and each read (None: no bound)."""

    def __init__(self, socket: str | os.PathLike[str] | None = None, *,
                 timeout: float | None = 30.0) -> None:
        self.socket = socket_path(socket)
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"Client(socket={str(self.socket)!r})"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    # -- transport ------------------------------------------------------------------

    def _open(self, method: str, target: str, body: Any = None, *,
              headers: dict[str, str] | None = None, timeout: float | None = None
              ) -> tuple[socket_mod.socket, _Response]:
        payload = None if body is None else _wire.encode(body)
        sock = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
        try:
            sock.settimeout(timeout if timeout is not None else self.timeout)
            sock.connect(str(self.socket))
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(_wire.request_head(method, target, payload, headers)
                             + (payload or b""))
            fp = sock.makefile("rb")
            try:
                return sock, _Response(fp)
            except BaseException:
                fp.close()
                raise
        except (OSError, ValueError) as exc:
            sock.close()
            raise Unreachable(f"control socket {self.socket}: {exc}") from None

    def _call(self, method: str, target: str, body: Any = None, *,
              headers: dict[str, str] | None = None, timeout: float | None = None,
              ok_statuses: tuple[int, ...] = ()) -> tuple[int, Any]:
        sock, resp = self._open(method, target, body, headers=headers, timeout=timeout)
        try:
            raw = resp.read()
        except (OSError, ValueError) as exc:
            raise Unreachable(f"control socket {self.socket}: {exc}") from None
        finally:
            resp.close()
            sock.close()
        data = _wire.decode(raw)
        if resp.status in ok_statuses:
            return resp.status, data
        return resp.status, _wire.checked(resp.status, resp.headers, data)

    # -- turns ----------------------------------------------------------------------

    def submit(self, message: str, *, session: str | None = None,
               budget: dict[str, Any] | None = None, profile: str | None = None,
               model: str | None = None, deadline: float | str | None = None,
               idempotency_key: str | None = None, traceparent: str | None = None,
               agent: str | None = None,
               output_schema: dict[str, Any] | None = None,
               retry_for: float = _wire.SUBMIT_RETRY_FOR_S,
               on_retry: Callable[[ClientError, float], object] | None = None) -> Turn:
        """Submit a turn. Sent with an Idempotency-Key (`idempotency_key`, or one made
        here), it is sent again with the same key after a 503, a 507 or no daemon, for up
        to `retry_for` seconds: the daemon makes at most one turn of it. Raises the last
        error when time runs out. `on_retry(error, delay)` hears each retry before its wait.
        `traceparent` (W3C trace context): the turn joins the caller's trace. `agent`: a
        named agent (`[agents.NAME]`), None for the default one. `output_schema`: a JSON
        Schema the final answer must match; the result then carries it parsed
        (`Result.output`)."""
        body = _wire.submit_body(message, session=session, budget=budget, profile=profile,
                                 model=model, deadline=deadline, agent=agent,
                                 idempotency_key=idempotency_key
                                 or _wire.new_idempotency_key(), traceparent=traceparent,
                                 output_schema=output_schema)
        give_up_at = time.monotonic() + retry_for
        attempt = 0
        while True:
            try:
                return Turn.from_json(self._call("POST", "/v1/turns", body)[1]["turn"])
            except ClientError as exc:
                delay = _wire.retry_delay(exc, attempt, give_up_at - time.monotonic())
                if delay is None:
                    raise
                if on_retry is not None:
                    on_retry(exc, delay)
            attempt += 1
            time.sleep(delay)

    def get(self, turn_id: str) -> Turn:
        return Turn.from_json(self._call("GET", _wire.turn_path(turn_id))[1]["turn"])

    def turns(self, *, state: str | None = None, session: str | None = None,
              limit: int = 100) -> list[Turn]:
        from urllib.parse import urlencode

        query = urlencode({k: v for k, v in (("state", state), ("session", session),
                                             ("limit", limit)) if v is not None})
        return [Turn.from_json(t) for t in self._call("GET", f"/v1/turns?{query}")[1]["turns"]]

    def wait(self, turn_id: str, timeout: float | None = None) -> Turn:
        """The turn once it has ended. Long-polls the daemon, and goes on through a
        daemon restart; raises `WaitTimedOut` after `timeout` seconds (None: no limit)."""
        give_up_at = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while True:
            left = _wire.WAIT_PIECE_S if give_up_at is None else give_up_at - time.monotonic()
            piece = max(0.0, min(left, _wire.WAIT_PIECE_S))
            try:
                _, data = self._call("GET", _wire.turn_path(turn_id, f"?wait={piece:.3f}"),
                                     timeout=piece + 30.0)
                attempt = 0
            except Unreachable:
                data = None
                attempt += 1
            if data is not None:
                turn = Turn.from_json(data["turn"])
                if turn.finished:
                    return turn
            if give_up_at is not None and time.monotonic() >= give_up_at:
                raise WaitTimedOut(f"turn {turn_id} did not end within {timeout} s")
            if data is None:
                time.sleep(_wire.reconnect_delay(attempt))

    def events(self, turn_id: str | None = None, *, after: int | None = None,
               types: str | None = None,
               reconnect_for: float = _wire.RECONNECT_FOR_S) -> Iterator[Event]:
        """A turn's events (all of them, then live, ending with its `turn.finished`), or
        with no turn every event as it happens (after the event numbered `after` first,
        when given). A dropped connection (the daemon restarting) is opened again, for up
        to `reconnect_for` seconds, and goes on after the last `seq` seen: no event is
        given twice. `types`: only events of these types (`turn.*,tool.call`)."""
        state = _wire.StreamState(turn_id, after)
        keep = _wire.type_filter(types)
        reconnects = _wire.Reconnects(self.socket, reconnect_for)
        while True:
            try:
                for raw in self._stream(state.path(None if turn_id else types)):
                    reconnects.connected()
                    if state.take(raw) and keep(state.last_type):
                        yield Event.from_json(raw)
            except Unreachable:
                pass
            if state.ended:
                return
            time.sleep(reconnects.delay(time.monotonic()))

    def _stream(self, target: str) -> Iterator[dict[str, Any]]:
        sock, resp = self._open("GET", target, timeout=self.timeout)
        try:
            sock.settimeout(None)  # a live stream may be quiet for long
            if resp.status != 200:
                raw = resp.read()
                _wire.checked(resp.status, resp.headers, _wire.decode(raw))
            while True:
                try:
                    line = resp.readline()
                except (OSError, ValueError) as exc:
                    raise Unreachable(f"control socket {self.socket}: {exc}") from None
                if not line:
                    return
                line = line.strip()
                if line:
                    data = _wire.decode(line)
                    if isinstance(data, dict):
                        yield data
        finally:
            resp.close()
            sock.close()

    def cancel(self, turn_id: str, *, now: bool = False) -> dict[str, Any]:
        """End a turn; `now` cuts a side effect in flight too (its outcome unknown)."""
        return self._call("POST", _wire.turn_path(turn_id, "/cancel"),  # type: ignore[no-any-return]
                          {"now": now} if now else None)[1]

    def steer(self, turn_id: str, text: str, *, redirect: bool = False) -> dict[str, Any]:
        return self._message(turn_id, "steer", text, redirect)

    def answer(self, turn_id: str, text: str) -> dict[str, Any]:
        return self._message(turn_id, "answer", text, False)

    def _message(self, turn_id: str, kind: str, text: str, redirect: bool) -> dict[str, Any]:
        return self._call("POST", _wire.turn_path(turn_id, "/messages"),  # type: ignore[no-any-return]
                          {"kind": kind, "text": text, "redirect": redirect})[1]

    # -- approvals ------------------------------------------------------------------

    def approvals(self) -> list[PendingApproval]:
        """Every tool call waiting for a person's approval, oldest first."""
        return [PendingApproval.from_json(a)
                for a in self._call("GET", "/v1/approvals")[1]["approvals"]]

    def approve(self, turn_id: str, call_id: str, *,
                arguments: dict[str, Any] | None = None) -> ApprovalDecision:
        """Let a held call run once; `arguments` replace the call's (the tool's schema
        must accept them, else InvalidRequest with `field` "arguments")."""
        return ApprovalDecision.from_json(self._call(
            "POST", _wire.turn_path(turn_id, "/approvals"),
            _wire.approval_body(call_id, "approve", arguments=arguments))[1])

    def deny(self, turn_id: str, call_id: str, *, reason: str) -> ApprovalDecision:
        """Refuse a held call: it never runs; the agent reads the reason."""
        return ApprovalDecision.from_json(self._call(
            "POST", _wire.turn_path(turn_id, "/approvals"),
            _wire.approval_body(call_id, "deny", reason=reason))[1])

    # -- the daemon -----------------------------------------------------------------

    def status(self) -> Status:
        return Status.from_json(self._call("GET", "/v1/status")[1])

    def health(self) -> Health:
        """Ready or degraded (the daemon answers 503 with the reasons: not an error)."""
        return Health.from_json(self._call("GET", "/v1/health", ok_statuses=(503,))[1])

    def pause(self) -> dict[str, Any]:
        return self._call("POST", "/v1/intake", {"open": False})[1]  # type: ignore[no-any-return]

    def resume(self) -> dict[str, Any]:
        return self._call("POST", "/v1/intake", {"open": True})[1]  # type: ignore[no-any-return]

    def dead_letters(self) -> list[DeadLetter]:
        return [DeadLetter.from_json(d)
                for d in self._call("GET", "/v1/dead-letters")[1]["dead_letters"]]

    def replay(self, turn_id: str) -> Turn:
        """A dead letter resumed from its last checkpoint: the same turn, queued again."""
        path = f"/v1/dead-letters/{_wire.turn_path(turn_id)[len('/v1/turns/'):]}/replay"
        return Turn.from_json(self._call("POST", path)[1]["turn"])

