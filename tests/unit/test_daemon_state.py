"""The daemon's and an MCP server connection's state tables: every listed move is taken,
every other one names itself, and what each daemon state lets through."""

from __future__ import annotations

import itertools

import pytest

from turnkeeper.policy.daemon_state import DaemonState
from turnkeeper.policy.mcp_state import McpServerState
from turnkeeper.policy.turn_state import IllegalTransition

D = DaemonState
M = McpServerState

DAEMON_MOVES = {(D.STARTING, D.READY), (D.STARTING, D.STOPPING), (D.READY, D.RELOADING),
                (D.READY, D.STOPPING), (D.RELOADING, D.READY), (D.RELOADING, D.STOPPING)}
MCP_MOVES = {(M.STOPPED, M.STARTING), (M.STARTING, M.UP), (M.STARTING, M.DOWN),
             (M.STARTING, M.STOPPED), (M.UP, M.DOWN), (M.UP, M.STOPPED),
             (M.DOWN, M.STARTING), (M.DOWN, M.STOPPED)}


@pytest.mark.parametrize(("old", "new"), list(itertools.product(D, D)))
def test_the_daemon_moves_only_as_its_table_says(old: DaemonState, new: DaemonState) -> None:
    if old is new or (old, new) in DAEMON_MOVES:
        assert old.to(new) is new
    else:
        with pytest.raises(IllegalTransition, match=f"the daemon cannot move from {old} "
                                                    f"to {new}"):
            old.to(new)


@pytest.mark.parametrize(("old", "new"), list(itertools.product(M, M)))
def test_an_mcp_server_moves_only_as_its_table_says(old: McpServerState,
                                                     new: McpServerState) -> None:
    if old is new or (old, new) in MCP_MOVES:
        assert old.to(new) is new
    else:
        with pytest.raises(IllegalTransition, match="an MCP server cannot move"):
            old.to(new)


def test_what_each_daemon_state_lets_through() -> None:
    assert [s for s in D if s.takes_submits] == [D.READY, D.RELOADING]
    assert [s for s in D if s.draining] == [D.RELOADING, D.STOPPING]


def test_the_wire_values_are_unchanged() -> None:
    assert [s.value for s in D] == ["starting", "ready", "reloading", "stopping"]
    assert [s.value for s in M] == ["stopped", "starting", "up", "down"]
    assert f"{D.RELOADING}; 0 running" == "reloading; 0 running"  # STATUS= reads the value
