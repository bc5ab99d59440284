"""`[agents.NAME]`: named agents, each with its own system prompt, tools, model, budget
profile, output schema and approval overrides; a key one does not set comes from
`[agent]`, the default agent. The rules (which tools, what is inherited) are
`policy/agents.py`; this module reads and checks the tables.

A file a key names (`system_prompt_file`, `output_schema_file`) is relative to the
config file (`resolve_relative_files`, on loading) and read when the config is validated,
so `config check`, the start and every reload read it again, and a missing or unreadable
file is a config error naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from turnkeeper.config.peers import ToolConfig
from turnkeeper.config.sections import BUILTIN_TOOL_NAMES, AgentConfig
from turnkeeper.policy.agents import (
    EVERY_TOOL,
    AgentDefinition,
    ToolSelection,
    agent_name_problem,
    define,
    select_tools,
)
from turnkeeper.policy.approvals import ApprovalSetting


def _agent_name(name: str) -> str:
    problem = agent_name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name


AgentName = Annotated[str, AfterValidator(_agent_name)]
FILE_KEYS = ("system_prompt_file", "output_schema_file")


class NamedAgentConfig(BaseModel):
    """One `[agents.NAME]` table. Every key is optional: unset, it is `[agent]`'s (the
    tools: every tool)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    system_prompt: str | None = None
    system_prompt_file: str | None = None
    tools: tuple[str, ...] | None = None
    model: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    profile: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    output_schema: dict[str, Any] | None = None
    output_schema_file: str | None = None
    approval: dict[str, ApprovalSetting] = Field(default_factory=dict)

    # What the files said, read once when the table is validated.
    _prompt_text: str | None = PrivateAttr(default=None)
    _schema: dict[str, Any] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _read_files(self) -> NamedAgentConfig:
        if self.system_prompt is not None and self.system_prompt_file is not None:
            raise ValueError("system_prompt and system_prompt_file: set one, not both")
        if self.output_schema is not None and self.output_schema_file is not None:
            raise ValueError("output_schema and output_schema_file: set one, not both")
        if self.system_prompt_file is not None:
            self._prompt_text = _read("system_prompt_file", self.system_prompt_file)
        schema = self.output_schema
        if self.output_schema_file is not None:
            text = _read("output_schema_file", self.output_schema_file)
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"output_schema_file: {self.output_schema_file} is not "
                                 f"JSON: {exc.msg} at line {exc.lineno}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"output_schema_file: {self.output_schema_file} must hold "
                                 "a JSON object (a JSON Schema)")
        if schema is not None:
            key = "output_schema" if self.output_schema is not None else "output_schema_file"
            try:
                Draft202012Validator.check_schema(schema)
            except SchemaError as exc:
                where = "/".join(str(p) for p in exc.path)
                raise ValueError(f"{key}: not a valid JSON Schema"
                                 f"{f' at {where}' if where else ''}: {exc.message}") from None
        self._schema = schema
        return self

    @property
    def prompt(self) -> str | None:
        """The system prompt this agent sets (its own text or its file's), or None."""
        return self.system_prompt if self.system_prompt is not None else self._prompt_text

    @property
    def resolved_schema(self) -> dict[str, Any] | None:
        """The output schema this agent sets (inline or its file's), or None."""
        return self._schema


def _read(key: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{key}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"{key}: {path} cannot be read: {reason}") from None


def resolve_relative_files(data: dict[str, Any], base: Path) -> None:
    """A relative `system_prompt_file` or `output_schema_file` of `[agent]` or an
    `[agents.NAME]` table is relative to the config file (`base`, its directory)."""
    agents = data.get("agents")
    tables = [data.get("agent"), *(agents.values() if isinstance(agents, dict) else ())]
    for table in tables:
        if not isinstance(table, dict):
            continue
        for key in FILE_KEYS:
            value = table.get(key)
            if isinstance(value, str) and value and not Path(value).is_absolute():
                table[key] = str(base / value)


def _peers(tools: Sequence[ToolConfig]) -> dict[str, tuple[str, ...]]:
    """The names an agent's `tools` choose among: tools by name, MCP servers, built-ins."""
    return {"tools": tuple(t.name for t in tools if t.kind != "mcp"),
            "servers": tuple(t.name for t in tools if t.kind == "mcp"),
            "builtins": tuple(BUILTIN_TOOL_NAMES)}


def check_agents(agents: Mapping[str, NamedAgentConfig], *, tools: Sequence[ToolConfig],
                 models: Sequence[str], profiles: Sequence[str]) -> None:
    """Every name an agent gives must be configured: its tools, the tools of its
    approval table, its model (an alias or a provider) and its budget profile. Raises
    ValueError naming the key (`agents.NAME.tools`)."""
    peers = _peers(tools)
    for name, agent in agents.items():
        where = f"agents.{name}"
        try:
            if agent.tools is not None:
                select_tools(agent.tools, **peers)
        except ValueError as exc:
            raise ValueError(f"{where}.tools: {exc}") from None
        for entry in agent.approval:
            try:
                select_tools((entry,), tools=peers["tools"], servers=peers["servers"],
                             builtins=())
            except ValueError as exc:
                raise ValueError(f"{where}.approval: {exc}") from None
        if agent.model is not None and agent.model not in models:
            raise ValueError(f"{where}.model: no model or provider {agent.model!r} (known: "
                             f"{', '.join(models)})")
        if agent.profile is not None and agent.profile not in profiles:
            raise ValueError(f"{where}.profile: no budget profile {agent.profile!r} "
                             f"(known: {', '.join(profiles) or 'none'})")


def definitions(default_agent: AgentConfig, agents: Mapping[str, NamedAgentConfig], *,
                tools: Sequence[ToolConfig]
                ) -> tuple[AgentDefinition, dict[str, AgentDefinition]]:
    """The default agent (`[agent]`: every tool, the default chain and budget) and each
    named agent resolved over it: what turns read."""
    default = AgentDefinition(
        name=None, system_prompt=default_agent.system_prompt, tools=EVERY_TOOL,
        output_schema=default_agent.schema_in_force())
    peers = _peers(tools)
    out: dict[str, AgentDefinition] = {}
    for name, agent in agents.items():
        selection: ToolSelection | None = None
        if agent.tools is not None:
            selection = select_tools(agent.tools, **peers)
        out[name] = define(name, default, system_prompt=agent.prompt, tools=selection,
                           model=agent.model, profile=agent.profile,
                           output_schema=agent.resolved_schema, approval=dict(agent.approval))
    return default, out
