"""Named agents, the pure rules: which tools an agent may call (by name, `server.*`
patterns, the built-ins always), agent names, what a named agent inherits from the
default one, and a submit's model and profile over its agent's."""

from __future__ import annotations

import re

import pytest

from turnkeeper.policy.agents import (
    EVERY_TOOL,
    AgentDefinition,
    ToolSelection,
    agent_name_problem,
    define,
    select_tools,
    turn_choice,
)

TOOLS = ("search", "create_ticket", "echo")
SERVERS = ("files", "git")
BUILTINS = ("report_blocked", "clarify", "update_plan")


def _select(*entries: str) -> ToolSelection:
    return select_tools(entries, tools=TOOLS, servers=SERVERS, builtins=BUILTINS)


def test_an_agent_may_call_only_the_tools_it_names_and_the_builtins() -> None:
    tools = _select("search")
    assert tools.allows("search")
    assert not tools.allows("create_ticket") and not tools.allows("echo")
    for builtin in BUILTINS:
        assert tools.allows(builtin)
    assert not tools.allows("files__read")  # an MCP server it does not name


def test_server_star_takes_every_tool_of_that_mcp_server_only() -> None:
    tools = _select("files.*")
    assert tools.allows("files__read") and tools.allows("files__write_file")
    assert not tools.allows("git__log")
    assert not tools.allows("search")
    # A name that only starts like the server's is not one of its tools.
    assert not tools.allows("filesystem__read") and not tools.allows("files_read")


def test_a_server_pattern_matches_the_name_after_the_prefix() -> None:
    tools = _select("files.read_*", "git.log")
    assert tools.allows("files__read_file") and not tools.allows("files__write_file")
    assert tools.allows("git__log") and not tools.allows("git__logs")


def test_no_tools_list_is_every_tool() -> None:
    assert EVERY_TOOL.every
    assert EVERY_TOOL.allows("anything__at_all") and EVERY_TOOL.allows("search")


def test_an_empty_tools_list_leaves_only_the_builtins() -> None:
    tools = _select()
    assert not tools.every
    assert tools.allows("clarify") and not tools.allows("search")


@pytest.mark.parametrize(("entry", "says"), [
    ("serch", "'serch' is not a configured tool (configured: create_ticket, echo, search)"),
    ("files", "'files' is an MCP server: name its tools as 'files.*'"),
    ("nope.*", "'nope' is not a configured MCP server (MCP servers: files, git)"),
    ("search.*", "'search' is not a configured MCP server"),
    ("files.", "'files.' is not a configured tool"),
])
def test_an_entry_that_selects_nothing_configured_is_refused_by_name(entry: str,
                                                                      says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        _select("search", entry)


def test_naming_a_builtin_is_allowed_and_changes_nothing() -> None:
    assert _select("clarify").allows("clarify")
    assert not _select("clarify").allows("search")


def test_selections_written_the_same_way_are_equal_and_hashable() -> None:
    assert _select("search", "files.*") == _select("search", "files.*", "files.*")
    assert len({_select("search"), _select("search")}) == 1
    assert _select("search", "files.*").entries() == ["search", "files.*"]
    assert EVERY_TOOL.entries() == ["*"]


@pytest.mark.parametrize("name", ["support", "triage-2", "A_b", "x" * 64])
def test_a_name_of_letters_digits_underscores_and_dashes_is_an_agent_name(name: str) -> None:
    assert agent_name_problem(name) is None


@pytest.mark.parametrize("name", ["", "has space", "dot.ted", "x" * 65, "é", "a/b"])
def test_any_other_name_is_refused_saying_what_a_name_may_hold(name: str) -> None:
    problem = agent_name_problem(name)
    assert problem is not None and repr(name) in problem and "letters, digits" in problem


DEFAULT = AgentDefinition(name=None, system_prompt="default prompt",
                          output_schema={"type": "object"}, approval={"search": "never"})


def test_a_named_agent_inherits_every_key_it_does_not_set() -> None:
    agent = define("plain", DEFAULT)
    assert agent.name == "plain"
    assert agent.system_prompt == "default prompt"
    assert agent.tools is EVERY_TOOL
    assert (agent.model, agent.profile) == (None, None)
    assert agent.output_schema == {"type": "object"}
    assert agent.approval == {"search": "never"}


def test_a_key_the_named_agent_sets_wins_over_the_default() -> None:
    tools = _select("search")
    agent = define("support", DEFAULT, system_prompt="support prompt", tools=tools,
                   model="cheap", profile="quick", output_schema={"type": "string"},
                   approval={"search": "always", "create_ticket": "effects"})
    assert agent.system_prompt == "support prompt" and agent.tools is tools
    assert (agent.model, agent.profile) == ("cheap", "quick")
    assert agent.output_schema == {"type": "string"}
    assert agent.approval == {"search": "always", "create_ticket": "effects"}


def test_an_empty_prompt_is_set_not_inherited() -> None:
    assert define("quiet", DEFAULT, system_prompt="").system_prompt == ""


def test_an_approval_override_is_found_by_name_then_by_server_pattern() -> None:
    agent = define("a", DEFAULT, approval={"files.write_*": "always", "files.*": "effects"})
    assert agent.approval_for("search") == "never"
    assert agent.approval_for("files__write_file") == "always"
    assert agent.approval_for("files__read") == "effects"
    assert agent.approval_for("git__log") is None


def test_the_submit_wins_over_its_agent_for_model_and_profile() -> None:
    assert turn_choice("fast", "cheap") == "fast"
    assert turn_choice(None, "cheap") == "cheap"
    assert turn_choice(None, None) is None


def test_a_definition_shows_what_it_offers() -> None:
    text = repr(define("support", DEFAULT, tools=_select("search"), model="cheap"))
    assert "support" in text and "['search']" in text and "cheap" in text
