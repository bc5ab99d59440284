"""Every exit status turnkeeper uses, in one place.

The daemon's statuses follow sysexits(3), so a supervisor (systemd, a container runtime)
can tell a bad config, which restarting will not fix, from a busy or broken machine. The
client's statuses add the outcome of a turn, so a script can branch on `submit --wait`.
"""

from __future__ import annotations

from typing import Final

OK: Final = 0
FAIL: Final = 1            # the request failed for a reason none of the codes below names
USAGE: Final = 64          # the command line was wrong (EX_USAGE)
UNAVAILABLE: Final = 69    # the daemon cannot be reached, or the store is held by another
IOERR: Final = 74          # the store cannot be used as it is (EX_IOERR)
CONFIG: Final = 78         # the configuration is invalid (EX_CONFIG)

# The exit status of `submit --wait`, `follow` and `wait` by the turn's final status.
TURN_STATUS: Final = {"completed": 0, "blocked": 3, "partial": 4, "failed": 5,
                      "cancelled": 6}
