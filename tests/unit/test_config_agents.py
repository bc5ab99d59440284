"""`[agents.NAME]` read from a config file: inheritance from `[agent]`, files relative to
the config file, and every name an agent gives checked (exit 78 naming the key)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from turnkeeper import exits
from turnkeeper.config import ConfigError, load_config
from turnkeeper.settings import TurnSettings

BASE = """
[agent]
system_prompt = "the default prompt"

[budget.profiles.quick]
max_steps = 3

[models.cheap]
chain = ["b"]

[[providers]]
name = "a"
kind = "scripted"

[[providers]]
name = "b"
kind = "scripted"

[[tools]]
name = "search"
kind = "echo"

[[tools]]
name = "tickets"
kind = "echo"
"""


def _load(tmp_path: Path, agents: str) -> TurnSettings:
    path = tmp_path / "turnkeeper.toml"
    path.write_text(textwrap.dedent(BASE) + textwrap.dedent(agents))
    config, _ = load_config(path)
    return TurnSettings.from_config(config)


def _refused(tmp_path: Path, agents: str) -> str:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, agents)
    assert caught.value.exit_code == exits.CONFIG == 78
    return str(caught.value)


def test_a_named_agent_takes_what_it_does_not_set_from_the_default_agent(
        tmp_path: Path) -> None:
    settings = _load(tmp_path, """
        [agents.plain]

        [agents.support]
        system_prompt = "you answer tickets"
        tools = ["tickets"]
        model = "cheap"
        profile = "quick"
        """)
    plain, support = settings.agents["plain"], settings.agents["support"]
    assert plain.system_prompt == "the default prompt" and plain.tools.every
    assert (plain.model, plain.profile) == (None, None)
    assert support.system_prompt == "you answer tickets"
    assert support.tools.allows("tickets") and not support.tools.allows("search")
    assert support.tools.allows("clarify") and support.tools.allows("report_blocked")
    assert (support.model, support.profile) == ("cheap", "quick")
    # The default agent is the one a submit naming none runs as.
    assert settings.agent(None) is settings.default_agent
    assert settings.default_agent.system_prompt == "the default prompt"
    assert settings.agent("support") is support and settings.agent("gone") is None


def test_a_prompt_or_schema_file_is_read_relative_to_the_config_file(
        tmp_path: Path) -> None:
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "support.md").write_text("you answer tickets\n")
    schema = {"type": "object", "properties": {"ticket": {"type": "string"}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    settings = _load(tmp_path, """
        [agents.support]
        system_prompt_file = "prompts/support.md"
        output_schema_file = "schema.json"
        approval = { tickets = "always", search = "never" }

        [agents.inline]
        output_schema = { type = "object", required = ["answer"] }
        """)
    support = settings.agents["support"]
    assert support.system_prompt == "you answer tickets\n"
    assert support.output_schema == schema
    assert support.approval == {"tickets": "always", "search": "never"}
    assert settings.agents["inline"].output_schema == {"type": "object",
                                                       "required": ["answer"]}


@pytest.mark.parametrize(("agents", "says"), [
    ('[agents."two words"]\n', "agents.two words"),
    ('[agents."a.b"]\n', "'a.b' is not a valid agent name"),
    ("[agents.x]\ntools = [\"serch\"]\n",
     "agents.x.tools: 'serch' is not a configured tool (configured: search, tickets)"),
    ("[agents.x]\nmodel = \"nope\"\n", "agents.x.model: no model or provider 'nope'"),
    ("[agents.x]\nprofile = \"slow\"\n", "agents.x.profile: no budget profile 'slow' "
                                         "(known: quick)"),
    ("[agents.x]\napproval = { serch = \"always\" }\n",
     "agents.x.approval: 'serch' is not a configured tool"),
    ("[agents.x]\napproval = { search = \"sometimes\" }\n", "agents.x.approval.search"),
    ("[agents.x]\nsystem_prompt = \"a\"\nsystem_prompt_file = \"p.txt\"\n",
     "system_prompt and system_prompt_file: set one, not both"),
    ("[agents.x]\nsystem_prompt_file = \"missing.txt\"\n",
     "agents.x: system_prompt_file: "),
    ("[agents.x]\noutput_schema = { type = \"nope\" }\n",
     "agents.x.output_schema: not a valid JSON Schema"),
    ("[agents.x]\noutput_schema_file = \"missing.json\"\n",
     "agents.x.output_schema_file: "),
    ("[agents.x]\ncolour = \"blue\"\n", "agents.x.colour"),
])
def test_an_invalid_agent_is_a_config_error_naming_its_key(tmp_path: Path, agents: str,
                                                           says: str) -> None:
    assert says in _refused(tmp_path, agents)


def test_a_missing_prompt_file_is_named_with_its_path(tmp_path: Path) -> None:
    text = _refused(tmp_path, '[agents.x]\nsystem_prompt_file = "missing.txt"\n')
    assert f"{tmp_path / 'missing.txt'} does not exist" in text


def test_a_schema_file_that_is_not_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "schema.json").write_text("{ not json")
    text = _refused(tmp_path, '[agents.x]\noutput_schema_file = "schema.json"\n')
    assert "output_schema_file" in text and "is not JSON" in text


def test_an_mcp_server_is_named_by_its_pattern(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    mcp = """
        [[tools]]
        name = "files"
        kind = "mcp"
        command = "true"
        """
    settings = _load(tmp_path, mcp + '\n[agents.x]\ntools = ["files.*", "search"]\n')
    tools = settings.agents["x"].tools
    assert tools.allows("files__read") and tools.allows("search")
    assert not tools.allows("tickets")
    assert "name its tools as 'files.*'" in _refused(
        tmp_path, mcp + '\n[agents.x]\ntools = ["files"]\n')
