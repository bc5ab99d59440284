"""Configuration: TOML + environment overrides, pointed errors, every key documented."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from turnkeeper.config import (
    Config,
    ConfigError,
    ProviderConfig,
    ToolConfig,
    build_config,
    keep_restart_keys,
    load_config,
    redact_url,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config" / "turnkeeper.toml"

OFFLINE = '[[providers]]\nname = "offline"\nkind = "scripted"\n\n'


def test_embedded_defaults_are_the_documented_defaults() -> None:
    config, digest = load_config(None)
    assert digest == ""
    assert config.agent.api_max_retries == 3
    assert config.agent.recovery_schedule == (15.0, 30.0, 60.0, 60.0, 60.0)
    assert config.budget.max_tokens == 200_000 and config.budget.max_steps == 40
    assert config.retry.max_retry_after == 120.0
    assert config.circuit_breaker.failure_threshold == 5
    assert config.daemon.socket_mode == "0660"
    assert [p.kind for p in config.providers] == ["scripted"]


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.toml"
    f.write_text(OFFLINE + "[budget]\nmax_tokens = 1000\nmax_steps = 7\n")
    monkeypatch.setenv("TURNKEEPER_BUDGET__MAX_TOKENS", "5000")
    config, _ = load_config(f)
    assert config.budget.max_tokens == 5000
    assert config.budget.max_steps == 7


def test_a_config_file_without_providers_is_invalid_and_says_how_to_ask_for_the_demo(
        tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[budget]\nmax_steps = 7\n")
    with pytest.raises(ConfigError) as err:
        load_config(f)
    assert err.value.exit_code == 78
    assert f"invalid configuration ({f}): no [[providers]]" in str(err.value)
    assert '[[providers]]\n  name = "offline"\n  kind = "scripted"' in str(err.value)
    f.write_text("")
    with pytest.raises(ConfigError, match=r"is empty \(half-written\?\)"):
        load_config(f)
    # Said explicitly, the demo runs from a file; without a file it needs no saying.
    f.write_text(OFFLINE + "[budget]\nmax_steps = 7\n")
    assert [p.kind for p in load_config(f)[0].providers] == ["scripted"]
    assert [p.kind for p in load_config(None)[0].providers] == ["scripted"]


def test_providers_from_the_environment_count_as_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[budget]\nmax_steps = 7\n")
    monkeypatch.setenv("TURNKEEPER_PROVIDERS", '[{"name": "env", "kind": "scripted"}]')
    assert [p.name for p in load_config(f)[0].providers] == ["env"]


def test_an_invalid_environment_value_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNKEEPER_RETRY__JITTER", "sometimes")
    with pytest.raises(ConfigError, match=r"retry\.jitter"):
        load_config(None)


def test_unknown_keys_and_bad_values_are_named(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[budget]\nmax_tokenz = 5\n[daemon]\nsocket_mode = \"999\"\n")
    with pytest.raises(ConfigError) as err:
        load_config(f)
    text = str(err.value)
    assert "budget.max_tokenz: unknown key" in text
    assert "daemon.socket_mode" in text
    assert ConfigError.exit_code == 78


def test_half_written_toml_is_an_error_naming_the_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[budget]\nmax_tokens = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_duplicate_provider_names_are_refused() -> None:
    with pytest.raises(ConfigError, match="appears twice"):
        build_config({"providers": [{"name": "a", "kind": "scripted"},
                                    {"name": "a", "kind": "scripted"}]})


def test_a_relative_script_is_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    f = tmp_path / "sub" / "c.toml"
    f.write_text('[[providers]]\nname = "s"\nkind = "scripted"\nscript = "s.toml"\n')
    config, _ = load_config(f)
    assert config.providers[0].script == str(tmp_path / "sub" / "s.toml")


def test_a_reload_does_not_apply_keys_that_need_a_restart() -> None:
    from turnkeeper.config import PolicyVersion

    old = build_config({"daemon": {"socket": "/run/a.sock"}})
    new = build_config({"daemon": {"socket": "/run/b.sock", "max_concurrent_turns": 3}})
    policy = PolicyVersion(version=1, config=old, source_path=None, content_hash="")
    assert policy.pending_restart(new) == ["daemon.socket"]
    applied = keep_restart_keys(old, build_config({
        "daemon": {"socket": "/run/b.sock", "state_dir": "/x", "max_concurrent_turns": 3},
        "metrics": {"listen": "127.0.0.1:9464"}}))
    assert (applied.daemon.socket, applied.daemon.state_dir) == ("/run/a.sock", "")
    assert applied.metrics.listen == ""
    assert applied.daemon.max_concurrent_turns == 3


def _keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel) and prefix == "":
            out.extend(_keys(ann, f"{name}."))
        else:
            out.append(prefix + name)
    return out


def test_the_example_config_documents_every_key_and_is_valid() -> None:
    data: dict[str, Any] = tomllib.loads(EXAMPLE.read_text())
    build_config(data, str(EXAMPLE))
    text = EXAMPLE.read_text()
    missing = []
    for key in _keys(Config):
        section, _, name = key.rpartition(".")
        if (section and f"[{section}]" not in text) or name not in text:
            missing.append(key)
    for model in (ProviderConfig, ToolConfig):
        missing.extend(f"{model.__name__}.{name}" for name in model.model_fields
                       if f"\n{name} = " not in text)
    assert not missing, f"undocumented keys in config/turnkeeper.toml: {missing}"


def _provider_file(tmp_path: Path, api_key_env: str) -> Path:
    f = tmp_path / "c.toml"
    f.write_text(f'[[providers]]\nname = "p"\nkind = "openai"\n'
                 f'base_url = "http://127.0.0.1:1/v1"\napi_key_env = "{api_key_env}"\n')
    return f


@pytest.mark.parametrize("value", [None, ""])
def test_a_provider_key_variable_unset_or_empty_is_a_config_error_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("TK_TEST_MISSING_KEY", raising=False)
    else:
        monkeypatch.setenv("TK_TEST_MISSING_KEY", value)
    with pytest.raises(ConfigError) as err:
        load_config(_provider_file(tmp_path, "TK_TEST_MISSING_KEY"))
    assert "providers.p.api_key_env" in str(err.value)
    assert "TK_TEST_MISSING_KEY" in str(err.value)
    assert err.value.exit_code == 78


def test_a_set_provider_key_loads_and_is_never_in_the_error_or_dump(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TK_TEST_KEY", "sk-secret-value")
    config, _ = load_config(_provider_file(tmp_path, "TK_TEST_KEY"))
    assert config.providers[0].api_key() == "sk-secret-value"
    assert "sk-secret-value" not in str(config.redacted())


def test_an_empty_api_key_env_means_no_auth_and_loads(tmp_path: Path) -> None:
    config, _ = load_config(_provider_file(tmp_path, ""))
    assert config.providers[0].api_key() is None


def test_tool_attempts_come_from_tools_retry_unless_the_tool_sets_its_own() -> None:
    config = build_config({"tools_retry": {"max_attempts": 5}, "tools": [
        {"name": "a", "url": "http://127.0.0.1:1/", "idempotent": True},
        {"name": "b", "url": "http://127.0.0.1:1/", "idempotent": True, "max_attempts": 2}]})
    a, b = config.tools
    assert (config.tool_max_attempts(a), config.tool_max_attempts(b)) == (5, 2)
    assert build_config({}).tools_retry.max_attempts == 3


def test_http_tool_effect_defaults() -> None:
    tool = ToolConfig(name="t", url="http://127.0.0.1:1/")
    assert (tool.dedupes_keys, tool.error_field, tool.follow_redirects,
            tool.max_response_bytes, tool.allowed_hosts) == (False, "", False, 1048576, ())


def test_error_field_must_be_a_json_pointer() -> None:
    with pytest.raises(ConfigError, match="error_field"):
        build_config({"tools": [{"name": "t", "url": "http://x/", "error_field": "error"}]})
    build_config({"tools": [{"name": "t", "url": "http://x/", "error_field": "/result/error"}]})


def test_an_unknown_key_in_an_override_is_blamed_on_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNKEEPER_BUDGET__MAX_STEPZ", "3")
    with pytest.raises(ConfigError) as err:
        load_config(None)
    assert "TURNKEEPER_BUDGET__MAX_STEPZ" in str(err.value)
    assert "did you mean TURNKEEPER_BUDGET__MAX_STEPS?" in str(err.value)


def test_a_typo_in_the_section_of_an_override_is_an_error_not_ignored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNKEEPER_BUDGT__MAX_STEPS", "3")
    with pytest.raises(ConfigError) as err:
        load_config(None)
    assert "TURNKEEPER_BUDGT__MAX_STEPS: there is no section 'budgt'" in str(err.value)
    assert "did you mean TURNKEEPER_BUDGET__MAX_STEPS?" in str(err.value)


def test_a_bad_value_from_the_environment_names_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNKEEPER_BUDGET__MAX_STEPS", "-3")
    with pytest.raises(ConfigError, match="from the environment variable "
                       "TURNKEEPER_BUDGET__MAX_STEPS"):
        load_config(None)


@pytest.mark.parametrize(("variable", "value", "named", "example"), [
    ("TURNKEEPER_AGENT__RECOVERY_SCHEDULE", "1,2", "[agent] recovery_schedule is a list",
     "TURNKEEPER_AGENT__RECOVERY_SCHEDULE='[15.0, 30.0, 60.0, 60.0, 60.0]'"),
    ("TURNKEEPER_DAEMON__ALLOWED_UIDS", "1000", "[daemon] allowed_uids is a list",
     "TURNKEEPER_DAEMON__ALLOWED_UIDS='[1, 2]'"),
    ("TURNKEEPER_BUDGET__PROFILES", "batch", "[budget] profiles is a table",
     """TURNKEEPER_BUDGET__PROFILES='{"name": "value"}'"""),
    ("TURNKEEPER_PROVIDERS", "primary", "providers is a list",
     """TURNKEEPER_PROVIDERS='[{"name": "value"}]'"""),
    ("TURNKEEPER_AGENT", "api_max_retries=1", "[agent] is a table",
     """TURNKEEPER_AGENT='{"name": "value"}'"""),
])
def test_a_list_or_table_override_that_is_not_json_names_the_variable_and_the_form(
        monkeypatch: pytest.MonkeyPatch, variable: str, value: str, named: str,
        example: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as err:
        load_config(None)
    text = str(err.value)
    assert err.value.exit_code == 78
    assert f"  {variable}: {named}, read from the environment as JSON, e.g. {example}" in text
    assert "Traceback" not in text


def test_a_list_override_in_json_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNKEEPER_AGENT__RECOVERY_SCHEDULE", "[1, 2.5]")
    monkeypatch.setenv("TURNKEEPER_BUDGET__PROFILES", '{"batch": {"max_steps": 9}}')
    config, _ = load_config(None)
    assert config.agent.recovery_schedule == (1.0, 2.5)
    assert config.budget.profiles["batch"].max_steps == 9


def test_a_table_override_that_is_not_json_does_not_show_its_value(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNKEEPER_MODELS", "sk-secret-looking-value")
    with pytest.raises(ConfigError) as err:
        load_config(None)
    assert "TURNKEEPER_MODELS" in str(err.value)
    assert "sk-secret" not in str(err.value)


def test_the_socket_and_config_variables_are_not_overrides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNKEEPER_SOCKET", "/x.sock")
    monkeypatch.setenv("TURNKEEPER_DAEMON__SOCKET", "/y.sock")
    config, _ = load_config(None)
    assert config.daemon.socket == "/y.sock"


def _two_providers(**models: Any) -> dict[str, Any]:
    return {"providers": [{"name": "a", "kind": "scripted"}, {"name": "b", "kind": "scripted"}],
            "models": models}


def test_a_model_alias_names_its_chain_and_a_provider_names_itself() -> None:
    config = build_config(_two_providers(fast={"chain": ["b", "a"]}))
    assert config.model_chain("fast") == ("b", "a")
    assert config.model_chain("a") == ("a",)
    assert config.model_chain(None) == ("a", "b")
    assert config.model_names() == ["fast", "a", "b"]
    with pytest.raises(KeyError):
        config.model_chain("nope")


@pytest.mark.parametrize(("models", "words"), [
    ({"fast": {"chain": ["b", "c"]}}, "models.fast.chain: 'c' is not a configured provider"),
    ({"fast": {"chain": []}}, "models.fast.chain"),
    ({"fast": {"chain": ["a", "a"]}}, "appears twice in the chain"),
    ({"a": {"chain": ["b"]}}, "models.a: the name is a provider's"),
    ({"fast": {"chain": ["a"], "extra": 1}}, "models.fast.extra: unknown key"),
])
def test_a_bad_model_alias_is_a_config_error_naming_it(models: dict[str, Any],
                                                       words: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config(_two_providers(**models))
    assert words in str(err.value)
    assert err.value.exit_code == 78


@pytest.mark.parametrize(("url", "shown"), [
    ("https://user:pa55@llm.example/v1", "https://<redacted>@llm.example/v1"),
    ("https://sk-abc@llm.example:8443/v1", "https://<redacted>@llm.example:8443/v1"),
    ("https://h.example/v1?api-version=2024-10-21&api_key=s3",
     "https://h.example/v1?api-version=2024-10-21&api_key=<redacted>"),
    ("https://b.blob.example/c?sv=2022&sig=abc%2Fdef&se=2030",
     "https://b.blob.example/c?sv=2022&sig=<redacted>&se=2030"),
    ("http://h/x?access_token=t&Client-Secret=c&password=p&X-Amz-Credential=AK&page=2",
     "http://h/x?access_token=<redacted>&Client-Secret=<redacted>&password=<redacted>"
     "&X-Amz-Credential=<redacted>&page=2"),
    ("postgresql://app:hunter2@db.internal:5432/turnkeeper?sslmode=require",
     "postgresql://<redacted>@db.internal:5432/turnkeeper?sslmode=require"),
    ("https://api.openai.com/v1", "https://api.openai.com/v1"),
    ("http://h/x?token=", "http://h/x?token="),
    ("see https://u:p@h for details", "see https://u:p@h for details"),
    ("gpt-4.1-mini", "gpt-4.1-mini"),
])
def test_redact_url_masks_userinfo_and_secret_query_values(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_config_show_masks_credentials_in_every_url() -> None:
    config = build_config({
        "providers": [{"name": "p", "kind": "openai", "api_key_env": "",
                       "base_url": "https://me:pa55word@llm.example/v1?api-key=k3y&v=1"}],
        "tools": [{"name": "t", "kind": "http", "description": "d",
                   "url": "https://tools.example/run?sig=s1gnature&x=1"}]})
    shown = config.redacted()
    text = str(shown)
    for secret in ("pa55word", "me:", "k3y", "s1gnature"):
        assert secret not in text
    assert shown["providers"][0]["base_url"] == \
        "https://<redacted>@llm.example/v1?api-key=<redacted>&v=1"
    assert shown["tools"][0]["url"] == "https://tools.example/run?sig=<redacted>&x=1"
    # The config itself keeps the real values: only what is shown is masked.
    assert config.providers[0].base_url.startswith("https://me:pa55word@")


INSTALLED = ROOT / "config" / "turnkeeper.example.toml"


def test_the_installed_example_loads_offline_and_leaves_the_paths_to_the_unit() -> None:
    config, digest = load_config(INSTALLED)
    assert digest
    assert [(p.name, p.kind) for p in config.providers] == [("offline", "scripted")]
    assert (config.daemon.socket, config.daemon.state_dir) == ("", "")
    # Its commented real providers are valid too, once uncommented.
    text = INSTALLED.read_text()
    blocks = [b.partition("\n\n")[0] for b in text.split("\n#\n")
              if b.startswith("# [[providers]]")]
    assert len(blocks) == 2
    for block in blocks:
        data = tomllib.loads("\n".join(line[2:] for line in block.splitlines()))
        build_config(data, "the commented provider")


def test_the_install_and_the_unit_name_the_installed_example() -> None:
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert ("install -m 640 -g turnkeeper config/turnkeeper.example.toml "
            "/etc/turnkeeper/turnkeeper.toml") in operations
    unit = (ROOT / "systemd" / "turnkeeper.service").read_text()
    assert "--config /etc/turnkeeper/turnkeeper.toml" in unit


def test_the_unit_lets_jit_based_mcp_servers_run_and_says_how_to_deny_them() -> None:
    # Every stdio MCP server inherits the unit's sandbox: with MemoryDenyWriteExecute=yes
    # a Node.js server (the README's `npx` example) aborts at start.
    unit = (ROOT / "systemd" / "turnkeeper.service").read_text()
    settings = [line for line in unit.splitlines() if line.startswith("MemoryDenyWriteExecute")]
    assert settings == []
    assert "#   MemoryDenyWriteExecute=yes" in unit  # the drop-in that turns it on
    assert "Node.js" in unit and "turnkeeper config check" in unit


# -- secrets a tool result must not carry ------------------------------------------------

def test_a_tools_secrets_are_its_env_read_and_credential_named_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TICKETS_AUTH", "Bearer tk-from-the-environment")
    monkeypatch.setenv("FS_TOKEN", "fs-token-from-env")
    tool = ToolConfig(name="tickets", url="http://127.0.0.1:1/t", headers={
        "Authorization": "env:TICKETS_AUTH", "X-Api-Key": "literal-key-123",
        "Accept": "application/json"})
    assert set(tool.secret_values()) == {"Bearer tk-from-the-environment",
                                         "tk-from-the-environment", "literal-key-123"}
    server = ToolConfig(name="fs", kind="mcp", command="fs-server", env={
        "FS_TOKEN": "env:FS_TOKEN", "API_KEY": "literal-api-key", "LOG_LEVEL": "debug"})
    assert set(server.secret_values()) == {"fs-token-from-env", "literal-api-key"}


def test_a_providers_secrets_for_tool_results_leave_its_plain_settings_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_KEY", "sk-the-provider-key")
    monkeypatch.setenv("LLM_ORG", "org-from-the-env")
    p = ProviderConfig(name="p", kind="openai", base_url="http://127.0.0.1:1/v1",
                       api_key_env="LLM_KEY",
                       headers={"OpenAI-Organization": "env:LLM_ORG",
                                "anthropic-beta": "prompt-caching-2024-07-31"},
                       query={"api-version": "2024-06-01", "sig": "signature-value"})
    assert set(p.secret_values(p.secrets())) == {"sk-the-provider-key", "org-from-the-env",
                                                 "signature-value"}


# -- structured output -------------------------------------------------------------------


def test_an_agents_output_schema_that_is_no_json_schema_is_exit_78_naming_the_key(
        tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text(OFFLINE + '[agent]\noutput_schema = { type = "objectt" }\n')
    with pytest.raises(ConfigError) as err:
        load_config(f)
    assert err.value.exit_code == 78
    assert "agent.output_schema: not a valid JSON Schema" in str(err.value)


def test_an_output_schema_file_is_read_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "a.json").write_text('{"type": "object", "required": ["x"]}')
    f = tmp_path / "t.toml"
    f.write_text(OFFLINE + '[agent]\noutput_schema_file = "schemas/a.json"\n')
    config, _ = load_config(f)
    assert config.agent.schema_in_force() == {"type": "object", "required": ["x"]}
    assert config.agent.output_schema_file == str(tmp_path / "schemas" / "a.json")


@pytest.mark.parametrize(("text", "says"), [
    ("{", "agent.output_schema_file: ", ),
    ('{"type": 5}', "not a valid JSON Schema"),
])
def test_an_output_schema_file_that_is_not_a_schema_is_exit_78(
        tmp_path: Path, text: str, says: str) -> None:
    (tmp_path / "a.json").write_text(text)
    f = tmp_path / "t.toml"
    f.write_text(OFFLINE + '[agent]\noutput_schema_file = "a.json"\n')
    with pytest.raises(ConfigError) as err:
        load_config(f)
    assert err.value.exit_code == 78 and says in str(err.value)
    assert "agent.output_schema_file" in str(err.value)


def test_an_output_schema_given_twice_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("{}")
    f = tmp_path / "t.toml"
    f.write_text(OFFLINE + '[agent]\noutput_schema_file = "a.json"\noutput_schema = {}\n')
    with pytest.raises(ConfigError,
                       match="output_schema and output_schema_file: set one, not both"):
        load_config(f)


def test_structured_output_is_a_closed_set_and_not_for_the_scripted_model() -> None:
    with pytest.raises(ConfigError, match="structured_output"):
        build_config({"providers": [{"name": "a", "kind": "openai", "api_key_env": "",
                                     "structured_output": "json"}]})
    with pytest.raises(ConfigError, match="structured_output: not for kind scripted"):
        build_config({"providers": [{"name": "a", "kind": "scripted",
                                     "structured_output": "tool"}]})
