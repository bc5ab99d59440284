"""The one base of every exception turnkeeper raises on purpose, and the one kind of
error the control API answers.

A caller that wants "anything turnkeeper refused or could not do" catches
`TurnkeeperError`; anything else that escapes is a bug. An error that ends the process
carries its exit status (see `turnkeeper.exits`); a request the daemon refuses carries
its HTTP status, and one middleware (`control/http.py`) answers every `Refused` the same
way: `{"error", "field"?, "index"?}` and a `Retry-After` when it has one. A handler never
maps an exception to a status itself.

    TurnkeeperError                        exit_code: the process's status if it ends it
    ├── ConfigError          config/        78: a setting to fix
    ├── UnsafeSocketDir, UnsafeStateDir, StateDirUnusable    paths.py (78, 78, 74)
    ├── SocketError          control/server.py               69
    ├── BootError, StoreFatal               daemon.py
    ├── StoreError           store/         a write or read the store refused
    │   └── KeyTaken, StoreUnavailable, StoreInUse, WriteWithdrawn, StaleLease, MailTaken
    ├── ProviderError        providers/     a provider call that failed (classified)
    ├── ServerGone, ConnectTimeout          tools/mcp_tool.py
    ├── IllegalTransition    policy/        a state table refused a move: a bug
    ├── ChainError, RetryBudgetError        policy/: misuse of a rule object: a bug
    ├── UnknownEventType     events.py
    ├── UsageError           cli/           a command line that cannot run (exit 64)
    ├── ClientError          client/        what a program using the client catches
    └── Refused              here           a request refused: HTTP status, field
        ├── BadRequest       control/http.py    the body or query (400, 408, 413)
        └── supervisor/errors.py: IntakeRefused (503, 507), UnknownTurn (404),
            TurnFinished (409), NotWaiting (409), InboxFull (429), IdempotencyConflict
            (422), UnknownProfile, UnknownModel, UnknownAgent, UnpricedCostLimit,
            BatchItemInvalid (400)
"""

from __future__ import annotations

from turnkeeper import exits


class TurnkeeperError(Exception):
    """Base of turnkeeper's own errors. `exit_code`: the process's exit status when this
    error ends it."""

    exit_code: int = exits.FAIL


class Refused(TurnkeeperError):
    """A request the daemon refuses. `status`: the HTTP status it is answered with (a
    class sets its own; an instance may say another); `field`: the field at fault (a
    dotted path, `[3].message` for a batch item); `index`: the batch item at fault;
    `retry_after_s`: when asking again may succeed (sent as `Retry-After`)."""

    status: int = 400
    field: str | None = None

    def __init__(self, message: str, *, status: int | None = None,
                 field: str | None = None, index: int | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        if field is not None:
            self.field = field
        self.index = index
        self.retry_after_s = retry_after_s
