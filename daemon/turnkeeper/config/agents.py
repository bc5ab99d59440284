"""The agents: `[agent]`, the default one, and `[agents.NAME]`, named agents, each with
its own system prompt, tools, model, budget profile, output schema and approval
overrides; a key a named agent does not set comes from `[agent]`. The rules (which
tools, what is inherited) are `policy/agents.py`; this module reads and checks the
tables.

A file a key names (`system_prompt_file`, `output_schema_file`) is relative to the
config file (`resolve_relative_files`, on loading) and read when the config is validated,
so `config check`, the start and every reload read it again, and a missing or unreadable
file is a config error naming the key. An output schema, given inline or as a file, is
checked the same way for every agent (`OutputSchema`, `OutputSchemaFile`,
`output_schema_in_force`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from turnkeeper.config.sections import (
    BUILTIN_TOOL_NAMES,
    NonNegFloat,
    NonNegInt,
    PositiveInt,
    _Section,
)
from turnkeeper.config.tools import ToolConfig
from turnkeeper.policy.agents import (
    EVERY_TOOL,
    AgentDefinition,
    ToolSelection,
    agent_name_problem,
    define,
    select_tools,
)
from turnkeeper.policy.approvals import ApprovalSetting
from turnkeeper.policy.output import schema_problem

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent run by turnkeeper. Use the tools offered to do the user's task. "
    "When you are done, answer in plain text. If you cannot finish, call report_blocked "
    "with what you tried and what you found; if you need the user, call clarify."
)


# -- the output schema, one way for every agent -------------------------------------------

def _read(path: str) -> str:
    """The text of the file at `path`; a ValueError names the path and what is wrong."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"{path} cannot be read: {reason}") from None


def read_output_schema(path: str) -> dict[str, Any]:
    """The JSON Schema in the file at `path` (made absolute against the config file's
    directory when the file is loaded), checked against its metaschema (the draft its
    `$schema` names, as for a submit's schema); a ValueError says what is wrong."""
    text = _read(path)
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc.msg} at line {exc.lineno}, "
                         f"column {exc.colno}") from None
    problem = schema_problem(schema)
    if problem is not None:
        raise ValueError(f"{path}: {problem}")
    assert isinstance(schema, dict)
    return schema


def _inline_schema(v: dict[str, Any] | None) -> dict[str, Any] | None:
    if v is not None:
        problem = schema_problem(v)
        if problem is not None:
            raise ValueError(problem)
    return v


def _schema_file(v: str | None) -> str | None:
    if v:
        read_output_schema(v)
    return v


# `output_schema` (a TOML table) and `output_schema_file` (a JSON file), each checked
# where it is read, so a bad schema is a config error naming its key, never a failure
# of the turns that use it.
OutputSchema = Annotated[dict[str, Any] | None, AfterValidator(_inline_schema)]
OutputSchemaFile = AfterValidator(_schema_file)


def output_schema_in_force(inline: dict[str, Any] | None,
                           file: str | None) -> dict[str, Any] | None:
    """The schema an agent gives either way (at most one), read once when the config
    is validated; None: it gives none."""
    if inline is not None and file:
        raise ValueError("output_schema and output_schema_file: set one, not both")
    return read_output_schema(file) if file else inline


class OutputSchemaFields(_Section):
    """`[agent]`'s schema a final answer must match, given inline (`output_schema`) or as
    a JSON file (`output_schema_file`, relative to the config file); at most one."""

    output_schema: OutputSchema = None
    output_schema_file: Annotated[str, OutputSchemaFile] = ""
    _output_schema: dict[str, Any] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_schema(self) -> OutputSchemaFields:
        self._output_schema = output_schema_in_force(self.output_schema,
                                                     self.output_schema_file)
        return self

    def schema_in_force(self) -> dict[str, Any] | None:
        """The schema given either way, read once when the config was; None: none."""
        return self._output_schema


class AgentConfig(OutputSchemaFields):
    """`[agent]`: the default agent, and what a named agent takes unless it says."""

    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    api_max_retries: NonNegInt = 3
    max_restarts: NonNegInt = 3
    auto_recovery_cycles: NonNegInt = 5
    recovery_schedule: tuple[NonNegFloat, ...] = (15.0, 30.0, 60.0, 60.0, 60.0)
    recovery_jitter: Annotated[float, Field(ge=0, le=10)] = 0.2
    # Times a final answer cut by the output cap is continued (joined into one answer)
    # before the turn ends `model.truncated`.
    max_continuations: NonNegInt = 1
    # Final answers checked against the output schema (the failing ones sent back to the
    # agent with what failed) before the turn stops `output.invalid`.
    max_output_attempts: PositiveInt = 3

    @field_validator("recovery_schedule")
    @classmethod
    def _non_empty(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if not v:
            raise ValueError("needs at least one wait")
        return v


# -- named agents ----------------------------------------------------------------------

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
    output_schema: OutputSchema = None
    output_schema_file: Annotated[str | None, OutputSchemaFile] = None
    approval: dict[str, ApprovalSetting] = Field(default_factory=dict)

    # What the files said, read once when the table is validated.
    _prompt_text: str | None = PrivateAttr(default=None)
    _schema: dict[str, Any] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _read_files(self) -> NamedAgentConfig:
        if self.system_prompt is not None and self.system_prompt_file is not None:
            raise ValueError("system_prompt and system_prompt_file: set one, not both")
        if self.system_prompt_file is not None:
            try:
                self._prompt_text = _read(self.system_prompt_file)
            except ValueError as exc:
                raise ValueError(f"system_prompt_file: {exc}") from None
        self._schema = output_schema_in_force(self.output_schema, self.output_schema_file)
        return self

    @property
    def prompt(self) -> str | None:
        """The system prompt this agent sets (its own text or its file's), or None."""
        return self.system_prompt if self.system_prompt is not None else self._prompt_text

    @property
    def resolved_schema(self) -> dict[str, Any] | None:
        """The output schema this agent sets (inline or its file's), or None."""
        return self._schema


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
