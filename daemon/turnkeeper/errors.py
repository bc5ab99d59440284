"""The one base of every exception turnkeeper raises on purpose.

A caller that wants "anything turnkeeper refused or could not do" catches
`TurnkeeperError`; anything else that escapes is a bug. An error that ends the process
carries its exit status (see `turnkeeper.exits`).
"""

from __future__ import annotations

from turnkeeper import exits


class TurnkeeperError(Exception):
    """Base of turnkeeper's own errors. `exit_code`: the process's exit status when this
    error ends it."""

    exit_code: int = exits.FAIL
