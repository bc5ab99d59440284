"""What a ToolBox offers: the built-ins, the configured tools and the tools of every MCP
server that is up, whole or as one agent's selection, and the note that tells an agent
when MCP tools left or came back.

The offer follows the servers' state, so the runner asks for it at every model call: it
is the same tuple until a server's offer changes (providers cache the encoded tools by
identity), and so is each agent's selection of it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from turnkeeper.messages import ToolSpec
from turnkeeper.policy.agents import EVERY_TOOL, ToolSelection
from turnkeeper.policy.mcp_state import McpServerState
from turnkeeper.policy.tool_traits import NAME_SEPARATOR
from turnkeeper.policy.usage import item_tokens
from turnkeeper.tools.mcp import McpServer


def spec_texts(spec: ToolSpec) -> list[str]:
    """What a provider is sent of a tool spec: its name, description and JSON schema."""
    return [spec.name, spec.description,
            json.dumps(spec.parameters, separators=(",", ":"), ensure_ascii=False)]


class Offer:
    """The tool specs offered now, from `static` (built-ins first) and `servers`."""

    def __init__(self, static: tuple[ToolSpec, ...], builtins: frozenset[str],
                 servers: Mapping[str, McpServer]) -> None:
        self._static = static
        self._builtins = builtins
        self._servers = servers
        self._specs = static
        self._key: tuple[int, ...] | None = None
        # Per agent's selection, the last offer made to it and its names: a tuple and a
        # set a step otherwise.
        self._selected: dict[ToolSelection, tuple[tuple[ToolSpec, ...],
                                                  tuple[ToolSpec, ...]]] = {}
        self._offered: dict[ToolSelection, tuple[tuple[ToolSpec, ...], frozenset[str]]] = {}
        # Per agent's selection, the last offer made to it and its size (`tokens_for`).
        self._sized: dict[ToolSelection, tuple[tuple[ToolSpec, ...], int]] = {}

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        """What is offered now: built-ins, configured tools, and the tools of every MCP
        server that is up. The same tuple until an offer changes."""
        if not self._servers:
            return self._static
        key = tuple(s.generation for s in self._servers.values())
        if key != self._key:
            self._specs = self._static + tuple(
                t.spec for s in self._servers.values() for t in s.offered())
            self._key = key
        return self._specs

    def specs_for(self, tools: ToolSelection) -> tuple[ToolSpec, ...]:
        """What is offered to an agent that may call `tools`: the built-ins and the
        tools of `specs` it selects. The same tuple while the offer does not change."""
        specs = self.specs if self._servers else self._static  # no servers: no call
        if tools.every:
            return specs
        known = self._selected.get(tools)
        if known is None or known[0] is not specs:
            known = self._selected[tools] = (specs, tuple(
                s for s in specs if s.name in self._builtins or tools.allows(s.name)))
        return known[1]

    def tokens_for(self, tools: ToolSelection) -> int:
        """The input tokens `specs_for(tools)` adds to a request (`policy.usage`'s
        estimate of each spec's texts), worked out once per offer."""
        specs = self.specs_for(tools)
        known = self._sized.get(tools)
        if known is None or known[0] is not specs:
            known = self._sized[tools] = (
                specs, sum(item_tokens(spec_texts(s)) for s in specs))
        return known[1]

    def note(self, previous: frozenset[str] | None,
             tools: ToolSelection = EVERY_TOOL) -> tuple[frozenset[str], str | None]:
        """The names offered now to an agent that may call `tools`, and a note for it
        when MCP tools left or came back since `previous` (None: the turn's first look,
        which reports servers that are down). Servers the agent has no tool of are not
        its business."""
        specs = self.specs_for(tools)
        known = self._offered.get(tools)
        if known is None or known[0] is not specs:  # the offer changed (or a first look)
            known = self._offered[tools] = (specs, frozenset(s.name for s in specs))
        current = known[1]
        if previous == current:
            return current, None
        notes: list[str] = []
        for server in self._servers.values():
            if not tools.every and all(s != server.name for s, _ in tools.servers):
                continue
            notes.extend(_server_notes(server, previous, current))
        return current, " ".join(notes) or None


def _server_notes(server: McpServer, previous: frozenset[str] | None,
                  current: frozenset[str]) -> list[str]:
    """What an agent is told of one MCP server's tools since `previous`."""
    if previous is None:
        if server.state is not McpServerState.UP:
            return [f"The tools of MCP server {server.name} are unavailable right now "
                    f"({server.down_reason()}); they are offered again when it is back."]
        return []
    prefix = server.name + NAME_SEPARATOR
    gone = _names(n for n in previous - current if n.startswith(prefix))
    back = _names(n for n in current - previous if n.startswith(prefix))
    notes: list[str] = []
    if gone and server.state is not McpServerState.UP:
        notes.append(f"MCP server {server.name} went down "
                     f"({server.down_reason()}); these tools are not offered "
                     f"until it is back: {gone}. Do not call them now.")
    elif gone:
        notes.append(f"MCP server {server.name} no longer offers: {gone}.")
    if back:
        notes.append(f"MCP server {server.name} offers these tools (again): {back}.")
    return notes


def _names(names: Iterable[str], *, most: int = 20) -> str:
    """Tool names for a note, sorted; a long list is cut short."""
    ordered = sorted(names)
    if len(ordered) <= most:
        return ", ".join(ordered)
    return ", ".join(ordered[:most]) + f" and {len(ordered) - most} more"
