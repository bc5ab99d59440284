"""What a config error points at (lines, suggestions, names), the config written back as
TOML, and where a config file is looked for."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from turnkeeper import paths
from turnkeeper.config import Config, ConfigError, build_config
from turnkeeper.config.explain import did_you_mean, key_lines, line_of, named_loc
from turnkeeper.config.toml_text import to_toml

TEXT = """# a comment
[daemon]
log_level = "info"

[budget.profiles.quick]
max_steps = 3
options = [
  1, 2,
]
after = 1

[[providers]]
name = "a"

[[providers]]
name = "b"
"kind" = "x"
"""


def test_every_key_and_table_is_found_at_its_line() -> None:
    lines = key_lines(TEXT)
    assert lines[("daemon",)] == 2 and lines[("daemon", "log_level")] == 3
    assert lines[("budget", "profiles", "quick", "max_steps")] == 6
    assert lines[("budget", "profiles", "quick", "after")] == 10  # past a multi-line value
    assert lines[("providers", 1)] == 15 and lines[("providers", 1, "kind")] == 17
    # A key not in the file is at the line of what holds it.
    assert line_of(lines, ("providers", 0, "model")) == 12
    assert line_of(lines, ("nowhere",)) is None


def test_a_list_item_is_named_by_its_name_else_its_index() -> None:
    data = {"providers": [{"name": "a"}, {"kind": "x"}]}
    assert named_loc(("providers", 0, "kind"), data) == "providers.a.kind"
    assert named_loc(("providers", 1, "kind"), data) == "providers.1.kind"
    assert named_loc((), data) == "(top level)"


def test_a_near_miss_is_suggested_and_a_far_one_is_not() -> None:
    assert did_you_mean("max_stpes", ["max_steps", "max_tokens"]) == "max_steps"
    assert did_you_mean("zzz", ["max_steps"]) is None


def test_a_typo_in_a_file_names_its_line_the_fix_and_the_provider() -> None:
    text = '[budget]\nmax_stpes = 3\n\n[[providers]]\nname = "p"\nkind = "antropic"\n'
    with pytest.raises(ConfigError) as err:
        build_config(tomllib.loads(text), "f.toml", text)
    assert "line 2: budget.max_stpes: unknown key (did you mean max_steps?)" in str(err.value)
    assert "line 6: providers.p.kind:" in str(err.value)
    assert "(did you mean anthropic?)" in str(err.value)


def test_the_effective_config_as_toml_reads_back_equal() -> None:
    config = build_config({
        "budget": {"max_steps": 7, "profiles": {"quick": {"max_steps": 3}}},
        "providers": [{"name": "p", "kind": "openai", "api_key_env": "",
                       "base_url": "http://127.0.0.1:9/v1",
                       "options": {"t": 0.5, "stop": ["a", "b"], "n": {"x": True}}}],
        "models": {"fast": {"chain": ["p"]}},
        "agent": {"system_prompt": 'say "hi"\nthen stop'}})
    text = to_toml(config.redacted(as_written=True))
    again = Config(**tomllib.loads(text))
    assert again == config


def test_numbers_toml_has_its_own_words_for_are_written_so() -> None:
    assert tomllib.loads(to_toml({"a": float("inf"), "b": -float("inf"), "c": 1e-9}))[
        "a"] == float("inf")
    assert to_toml({"t": {"a key": 1, "e": {}}}) == '[t]\n"a key" = 1\n\n[t.e]\n'


def test_the_config_is_looked_for_in_order(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    user = tmp_path / "xdg" / "turnkeeper" / "turnkeeper.toml"
    system = tmp_path / "etc" / "turnkeeper.toml"
    monkeypatch.setattr(paths, "SYSTEM_CONFIG", system)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TURNKEEPER_CONFIG", raising=False)
    assert paths.config_search(None) == (None, "embedded defaults")
    system.parent.mkdir(parents=True)
    system.write_text("")
    assert paths.config_search(None) == (str(system), "the system default")
    user.parent.mkdir(parents=True)
    user.write_text("")
    assert paths.config_search(None) == (str(user), "$XDG_CONFIG_HOME")
    monkeypatch.setenv("TURNKEEPER_CONFIG", "/x.toml")
    assert paths.config_search(None) == ("/x.toml", "TURNKEEPER_CONFIG")
    assert paths.config_search("/y.toml") == ("/y.toml", "--config")


def test_configuration_md_has_one_section_per_config_section_each_with_units() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for name, field in Config.model_fields.items():
        header = {"providers": "## `[[providers]]`", "tools": "## `[[tools]]`",
                  "models": "## `[models.NAME]`", "webhooks": "## `[[webhooks]]`",
                  "agents": "## `[agents.NAME]`"}.get(name, f"## `[{name}]`")
        assert text.count("\n" + header) == 1, (name, field)
    for line in text.splitlines():
        if line.startswith("| key | default |") and "applies to" not in line:
            assert "unit" in line, line
