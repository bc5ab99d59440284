"""An MCP server connection's state and every move between it, in one table (as a turn's
is in `turn_state.py`). The values are those `/v1/status` shows under `mcp_servers`.

    stopped ──> starting ──> up
                 ^   │       │
                 │   v       v
                 └── down <──┘      (waiting out the restart backoff)

    any state ──> stopped           (the server is closed: a reload that dropped it, a stop)
"""

from __future__ import annotations

from enum import StrEnum

from turnkeeper.policy.turn_state import IllegalTransition


class McpServerState(StrEnum):
    STOPPED = "stopped"    # not started yet, or closed
    STARTING = "starting"  # connecting and listing its tools
    UP = "up"              # its tools are offered
    DOWN = "down"          # the connection failed or ended; a restart is scheduled

    def to(self, new: McpServerState) -> McpServerState:
        """The state after moving to `new`; raises `IllegalTransition` for a move the
        table does not list. Staying put is allowed (a connection that ended is `down`
        at once, and again when its session has been torn down)."""
        if new is not self and new not in _TRANSITIONS[self]:
            raise IllegalTransition(self, new, what="an MCP server")
        return new


_TRANSITIONS: dict[McpServerState, frozenset[McpServerState]] = {
    McpServerState.STOPPED: frozenset({McpServerState.STARTING}),
    McpServerState.STARTING: frozenset({McpServerState.UP, McpServerState.DOWN,
                                        McpServerState.STOPPED}),
    McpServerState.UP: frozenset({McpServerState.DOWN, McpServerState.STOPPED}),
    McpServerState.DOWN: frozenset({McpServerState.STARTING, McpServerState.STOPPED}),
}
