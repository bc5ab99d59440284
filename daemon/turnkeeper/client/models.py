"""What the client's calls answer: frozen dataclasses read from the daemon's JSON.

Each keeps the whole JSON object it was read from as `raw`, so a field the daemon adds
later is there before these classes name it; the named fields are the ones an
application acts on (a turn's state and result, the stop code, an event's seq)."""

from __future__ import annotations

from dataclasses import dataclass, field

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs start-up time
if TYPE_CHECKING:
    from typing import Any

TERMINAL_STATES = frozenset({"completed", "blocked", "partial", "failed", "cancelled"})


@dataclass(frozen=True, slots=True)
class StoppedBecause:
    """Why a turn ended: the stop code, the counter that ended it, its value and limit."""

    code: str
    counter: str | None = None
    value: Any = None
    limit: Any = None
    message: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoppedBecause:
        return cls(code=str(data.get("code", "")), counter=data.get("counter"),
                   value=data.get("value"), limit=data.get("limit"),
                   message=str(data.get("message") or ""))


@dataclass(frozen=True, slots=True)
class Result:
    """A turn's one result."""

    status: str
    stopped_because: StoppedBecause
    answer: str | None
    partial: list[str]
    open_issues: list[str]
    raw: dict[str, Any] = field(repr=False)
    # The answer parsed, for a turn submitted with an output schema that it matched.
    output: Any = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Result:
        return cls(status=str(data.get("status", "")),
                   stopped_because=StoppedBecause.from_json(data.get("stopped_because") or {}),
                   answer=data.get("answer"), partial=list(data.get("partial") or []),
                   open_issues=list(data.get("open_issues") or []), raw=data,
                   output=data.get("output"))


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    seconds: float = 0.0
    cost_usd: float = 0.0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Usage:
        return cls(**{k: data[k] for k in ("input_tokens", "output_tokens", "total_tokens",
                                           "seconds", "cost_usd") if k in data})


@dataclass(frozen=True, slots=True)
class Turn:
    """A turn as the daemon last described it."""

    id: str
    session: str
    state: str
    message: str | None
    policy_version: int | None
    created_at: float
    updated_at: float
    provider: str | None
    counters: dict[str, int]
    usage: Usage
    result: Result | None
    raw: dict[str, Any] = field(repr=False)
    # The named agent the turn runs as (`[agents.NAME]`); None for the default agent.
    agent: str | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None or self.state in TERMINAL_STATES

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Turn:
        result = data.get("result")
        return cls(id=str(data["id"]), session=str(data.get("session", "")),
                   state=str(data.get("state", "")), message=data.get("message"),
                   policy_version=data.get("policy_version"),
                   created_at=float(data.get("created_at") or 0.0),
                   updated_at=float(data.get("updated_at") or 0.0),
                   provider=data.get("provider"), counters=dict(data.get("counters") or {}),
                   usage=Usage.from_json(data.get("usage") or {}),
                   result=Result.from_json(result) if isinstance(result, dict) else None,
                   raw=data, agent=data.get("agent"))


@dataclass(frozen=True, slots=True)
class Event:
    """One event: its number (`seq`: live, an event stored with its turn's state may
    come after one numbered later), time, type, turn (None for the daemon's own) and the
    rest of its fields in `data`."""

    seq: int
    ts: float
    type: str
    turn: str | None
    data: dict[str, Any]

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Event:
        data = {k: v for k, v in raw.items() if k not in ("seq", "ts", "type", "turn")}
        return cls(seq=int(raw.get("seq") or 0), ts=float(raw.get("ts") or 0.0),
                   type=str(raw.get("type", "")), turn=raw.get("turn"), data=data)


@dataclass(frozen=True, slots=True)
class Status:
    """The daemon's state (`ready`, `reloading`, `stopping`...), policy version, turns by
    state; everything else it reports in `raw`."""

    state: str
    policy_version: int | None
    version: str | None
    turns: dict[str, int]
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Status:
        return cls(state=str(data.get("state", "")),
                   policy_version=data.get("policy_version"), version=data.get("version"),
                   turns=dict(data.get("turns") or {}), raw=data)


@dataclass(frozen=True, slots=True)
class Health:
    """`ok` when the daemon is ready; otherwise `problems` says why it is degraded."""

    ok: bool
    status: str
    problems: list[Any]
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Health:
        status = str(data.get("status", ""))
        return cls(ok=status == "ok", status=status,
                   problems=list(data.get("problems") or []), raw=data)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A turn on the dead-letter list: what stopped it, its last error, and the replay
    that took it again, if any."""

    id: str
    session: str
    message: str | None
    stopped_because: StoppedBecause | None
    last_error: Any
    finished_at: float
    replayed_by: str | None
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeadLetter:
        stopped = data.get("stopped_because")
        return cls(id=str(data["id"]), session=str(data.get("session", "")),
                   message=data.get("message"),
                   stopped_because=StoppedBecause.from_json(stopped)
                   if isinstance(stopped, dict) else None,
                   last_error=data.get("last_error"),
                   finished_at=float(data.get("finished_at") or 0.0),
                   replayed_by=data.get("replayed_by"), raw=data)


@dataclass(frozen=True, slots=True)
class PendingApproval:
    """A tool call a turn holds for a person's approval (`GET /v1/approvals`): not sent
    until approved. `key` is the Idempotency-Key it will be sent with; `requested_at`
    epoch seconds."""

    turn: str
    call_id: str
    tool: str
    arguments: dict[str, Any]
    key: str | None
    requested_at: float
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PendingApproval:
        return cls(turn=str(data["turn"]), call_id=str(data["call_id"]),
                   tool=str(data["tool"]), arguments=dict(data.get("arguments") or {}),
                   key=data.get("key"), requested_at=float(data.get("requested_at") or 0.0),
                   raw=data)


@dataclass(frozen=True, slots=True)
class ApprovalDecision:
    """A decision the daemon took (202): the turn resumes once every call it holds is
    decided."""

    turn: str
    call_id: str
    decision: str
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ApprovalDecision:
        return cls(turn=str(data["turn"]), call_id=str(data["call_id"]),
                   decision=str(data["decision"]), raw=data)
