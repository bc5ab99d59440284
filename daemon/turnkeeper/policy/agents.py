"""Named agents: which tools an agent may call, and what a named agent takes from the
default one.

One daemon hosts several agents (`[agents.NAME]`), each with its own system prompt and
its own tools. The rules here are pure, fed the names of the configured tools:

- An agent's `tools` are entries, each the name of a configured tool, or
  `server.PATTERN` for the tools of one MCP server (`server.*`: every tool it offers;
  `server.read_*`: those whose name after `server__` matches the shell-style pattern).
  An MCP server's tools are known only once it is up, so the pattern is what is kept,
  and a tool it offers later is selected by it too. An entry that names nothing
  configured is refused: a typo must not leave an agent silently without a tool.
- No `tools` at all: every tool. Built-in tools (report_blocked, clarify, update_plan)
  are offered to every agent whatever its list says: an agent can always say it is
  blocked or ask the user.
- A tool an agent is not offered does not exist for it: the model is not told of it,
  and a call naming it is answered as a call of an unknown tool is.
- A key a named agent does not set comes from the default agent (`[agent]`), which is
  also the agent of a submit that names none.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from turnkeeper.policy.approvals import ApprovalSetting
from turnkeeper.policy.tool_traits import NAME_SEPARATOR as MCP_SEPARATOR

# What an agent's name may be: it is a TOML key, a JSON value and a CLI argument.
AGENT_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
APPROVAL_MODES = ("never", "always", "effects")


def agent_name_problem(name: str) -> str | None:
    """Why `name` cannot name an agent, or None when it can."""
    if AGENT_NAME.fullmatch(name):
        return None
    return (f"{name!r} is not a valid agent name: 1 to 64 letters, digits, '_' or '-'")


@dataclass(frozen=True, slots=True)
class ToolSelection:
    """The tools an agent is offered. `names`: configured tools by name (None: every
    tool); `servers`: (MCP server, pattern) pairs; `builtins`: always offered."""

    names: frozenset[str] | None = None
    servers: tuple[tuple[str, str], ...] = ()
    builtins: frozenset[str] = frozenset()
    # Whether it is every tool (`names` None), and its hash: worked out once, as the
    # offer reads both at every step (a property and a dataclass's hash are a call each).
    every: bool = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "every", self.names is None)
        object.__setattr__(self, "_hash", hash((self.names, self.servers, self.builtins)))

    def __hash__(self) -> int:
        return self._hash

    def allows(self, tool: str) -> bool:
        """Whether the agent may be offered (and may call) the tool named `tool`."""
        if self.names is None or tool in self.builtins or tool in self.names:
            return True
        for server, pattern in self.servers:
            prefix = server + MCP_SEPARATOR
            if tool.startswith(prefix) and fnmatch.fnmatchcase(tool[len(prefix):], pattern):
                return True
        return False

    def entries(self) -> list[str]:
        """The selection as it is written in a config (None: every tool)."""
        if self.names is None:
            return ["*"]
        return [*sorted(self.names), *(f"{s}.{p}" for s, p in self.servers)]


EVERY_TOOL = ToolSelection()


def select_tools(entries: Iterable[str], *, tools: Iterable[str], servers: Iterable[str],
                 builtins: Iterable[str]) -> ToolSelection:
    """The selection `entries` make among the configured `tools` (by name), the MCP
    `servers` and the `builtins`. Raises ValueError naming the first entry that selects
    nothing configured."""
    known, mcp, always = frozenset(tools), frozenset(servers), frozenset(builtins)
    names: set[str] = set()
    patterns: list[tuple[str, str]] = []
    for entry in entries:
        if entry in known or entry in always:
            names.add(entry)
            continue
        server, dot, pattern = entry.partition(".")
        if dot and server in mcp and pattern:
            if (server, pattern) not in patterns:
                patterns.append((server, pattern))
            continue
        raise ValueError(_unknown_entry(entry, known, mcp))
    return ToolSelection(frozenset(names), tuple(patterns), always)


def _unknown_entry(entry: str, known: frozenset[str], mcp: frozenset[str]) -> str:
    server, dot, _ = entry.partition(".")
    if entry in mcp:
        return (f"{entry!r} is an MCP server: name its tools as '{entry}.*' (all of them) "
                f"or '{entry}.PATTERN'")
    if dot and server not in mcp:
        servers = ", ".join(sorted(mcp)) or "none are configured"
        return f"{entry!r}: {server!r} is not a configured MCP server (MCP servers: {servers})"
    configured = ", ".join(sorted(known)) or "none"
    return f"{entry!r} is not a configured tool (configured: {configured})"


@dataclass(frozen=True, slots=True)
class AgentDefinition:
    """One agent, resolved: what a turn of it is sent and offered. `name` None is the
    default agent (`[agent]`). `output_schema` and `approval` are carried for the
    structured-output and approval rules to read; `approval` maps a tool entry (a tool's
    name, or `server.PATTERN`) to "never", "always" or "effects"."""

    name: str | None
    system_prompt: str
    tools: ToolSelection = EVERY_TOOL
    model: str | None = None
    profile: str | None = None
    output_schema: Mapping[str, Any] | None = None
    approval: Mapping[str, ApprovalSetting] = field(default_factory=dict)

    def __repr__(self) -> str:
        return (f"AgentDefinition({self.name or '(default)'}, tools={self.tools.entries()}, "
                f"model={self.model}, profile={self.profile})")

    def approval_for(self, tool: str) -> ApprovalSetting | None:
        """This agent's approval override for `tool`, or None: an entry naming the tool
        itself first, then the first `server.PATTERN` entry that matches it."""
        if tool in self.approval:
            return self.approval[tool]
        for entry, mode in self.approval.items():
            server, dot, pattern = entry.partition(".")
            prefix = server + MCP_SEPARATOR
            if dot and tool.startswith(prefix) and fnmatch.fnmatchcase(
                    tool[len(prefix):], pattern):
                return mode
        return None


def define(name: str, defaults: AgentDefinition, *, system_prompt: str | None = None,
           tools: ToolSelection | None = None, model: str | None = None,
           profile: str | None = None, output_schema: Mapping[str, Any] | None = None,
           approval: Mapping[str, ApprovalSetting] | None = None) -> AgentDefinition:
    """The named agent: each key it sets (not None), else the default agent's. The
    approval overrides are the default's with the agent's own over them."""
    return AgentDefinition(
        name=name,
        system_prompt=defaults.system_prompt if system_prompt is None else system_prompt,
        tools=defaults.tools if tools is None else tools,
        model=defaults.model if model is None else model,
        profile=defaults.profile if profile is None else profile,
        output_schema=defaults.output_schema if output_schema is None else output_schema,
        approval={**defaults.approval, **(approval or {})})


def turn_choice(submitted: str | None, agent: str | None) -> str | None:
    """A turn's model or profile: the submit's own when it gives one, else its agent's
    (the submit wins)."""
    return submitted if submitted is not None else agent
