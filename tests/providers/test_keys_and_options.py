"""Providers configured the way SDK users do: keys from the SDK's variables, a file or a
systemd credential; body options, headers and query parameters; the output-limit field
the model family takes. Each checked on the wire, against a server on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from turnkeeper.config import ConfigError, ProviderConfig
from turnkeeper.providers.base import Message, ProviderError
from turnkeeper.runtime import make_provider

pytestmark = pytest.mark.anyio

Serve = Callable[[Callable[[web.Request], Awaitable[web.StreamResponse]]], Awaitable[str]]
OPENAI_REPLY = {"model": "m", "choices": [{"message": {"content": "hi"},
                                           "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
ANTHROPIC_REPLY = {"type": "message", "model": "m", "stop_reason": "end_turn",
                   "content": [{"type": "text", "text": "hi"}],
                   "usage": {"input_tokens": 3, "output_tokens": 1}}


class Recorder:
    """A server that answers every POST with one JSON reply and keeps what it was sent."""

    def __init__(self, reply: dict[str, Any], status: int = 200) -> None:
        self.reply = reply
        self.status = status
        self.requests: list[tuple[web.Request, dict[str, Any]]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request, await request.json()))
        return web.json_response(self.reply, status=self.status)

    @property
    def last(self) -> tuple[web.Request, dict[str, Any]]:
        return self.requests[-1]


@pytest.fixture
async def build() -> AsyncIterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(**fields: Any) -> Any:
        fields.setdefault("name", "p")
        fields.setdefault("stream", False)
        provider = make_provider(ProviderConfig(**fields))
        made.append(provider)
        return provider

    yield make
    for p in made:
        await p.aclose()


@pytest.fixture(autouse=True)
def _no_sdk_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY",
                 "ANTHROPIC_BASE_URL", "CREDENTIALS_DIRECTORY", "GEMINI_API_KEY",
                 "GOOGLE_API_KEY", "GOOGLE_GEMINI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)


async def ask(provider: Any, make_request: Callable[..., Any]) -> Any:
    return await provider.complete(make_request([Message(role="user", content="x")],
                                                tools=()))


# -- keys ---------------------------------------------------------------------------------


async def test_openai_reads_the_sdk_key_and_base_url_variables(
        web_server: Serve, build, make_request, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(OPENAI_REPLY)
    url = await web_server(rec.handle)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-sdk-variable")
    monkeypatch.setenv("OPENAI_BASE_URL", url + "/v1")
    p = build(kind="openai", model="gpt-4.1-mini")
    await ask(p, make_request)
    request, _ = rec.last
    assert request.path == "/v1/chat/completions"
    assert request.headers["Authorization"] == "Bearer sk-from-the-sdk-variable"


async def test_anthropic_reads_the_sdk_key_and_base_url_variables(
        web_server: Serve, build, make_request, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(ANTHROPIC_REPLY)
    url = await web_server(rec.handle)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-from-the-sdk-variable")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", url)
    p = build(kind="anthropic", model="claude-haiku-4-5")
    await ask(p, make_request)
    request, _ = rec.last
    assert request.path == "/v1/messages"
    assert request.headers["x-api-key"] == "sk-ant-from-the-sdk-variable"


RESPONSES_REPLY = {"object": "response", "status": "completed", "model": "m", "output": [
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}],
    "usage": {"input_tokens": 3, "output_tokens": 1}}
GEMINI_REPLY = {"candidates": [{"content": {"role": "model", "parts": [{"text": "hi"}]},
                                "finishReason": "STOP"}],
                "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 1}}


async def test_openai_responses_reads_the_openai_sdk_variables_and_takes_headers_and_query(
        web_server: Serve, build, make_request, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(RESPONSES_REPLY)
    url = await web_server(rec.handle)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-sdk-variable")
    monkeypatch.setenv("OPENAI_BASE_URL", url + "/openai")
    p = build(kind="openai-responses", model="o3-pro", query={"api-version": "preview"},
              headers={"OpenAI-Organization": "org-1"}, options={"reasoning": {"effort": "high"}})
    reply = await ask(p, make_request)
    request, body = rec.last
    assert request.path == "/openai/responses"
    assert request.query["api-version"] == "preview"
    assert request.headers["Authorization"] == "Bearer sk-from-the-sdk-variable"
    assert request.headers["OpenAI-Organization"] == "org-1"
    assert body["reasoning"] == {"effort": "high"} and body["store"] is False
    assert reply.text == "hi"


@pytest.mark.parametrize(("env", "sent"), [
    ({"GEMINI_API_KEY": "gemini-key-0123456789"}, "gemini-key-0123456789"),
    ({"GOOGLE_API_KEY": "google-key-0123456789"}, "google-key-0123456789"),
    # google-genai prefers GOOGLE_API_KEY when both are set
    ({"GEMINI_API_KEY": "gemini-key-0123456789", "GOOGLE_API_KEY": "google-key-0123456789"},
     "google-key-0123456789")])
async def test_gemini_reads_the_sdk_key_variables_into_x_goog_api_key(
        web_server: Serve, build, make_request, monkeypatch: pytest.MonkeyPatch,
        env: dict[str, str], sent: str) -> None:
    rec = Recorder(GEMINI_REPLY)
    url = await web_server(rec.handle)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", url)  # the host, as google-genai takes it
    p = build(kind="gemini", model="models/gemini-2.5-pro")
    reply = await ask(p, make_request)
    request, body = rec.last
    assert request.path == "/v1beta/models/gemini-2.5-pro:generateContent"
    assert request.headers["x-goog-api-key"] == sent
    assert "Authorization" not in request.headers
    assert body["contents"] == [{"role": "user", "parts": [{"text": "x"}]}]
    assert reply.text == "hi" and reply.usage.input_tokens == 3


def test_without_a_base_url_the_vendor_endpoint_is_used() -> None:
    assert ProviderConfig(name="o", kind="openai").base_url == "https://api.openai.com/v1"
    assert ProviderConfig(name="a", kind="anthropic").base_url == "https://api.anthropic.com"
    assert ProviderConfig(name="r", kind="openai-responses").base_url == \
        "https://api.openai.com/v1"
    assert ProviderConfig(name="g", kind="gemini").base_url == \
        "https://generativelanguage.googleapis.com"


def test_the_gemini_endpoint_without_a_key_is_a_config_error_naming_both_variables() -> None:
    cfg = ProviderConfig(name="g", kind="gemini", model="gemini-2.5-flash")
    with pytest.raises(ConfigError, match="GOOGLE_API_KEY or GEMINI_API_KEY"):
        cfg.api_key()


def test_the_vendor_endpoint_without_any_key_is_a_config_error_naming_the_variable() -> None:
    cfg = ProviderConfig(name="o", kind="openai", model="gpt-4.1")
    with pytest.raises(ConfigError, match="OPENAI_API_KEY"):
        cfg.api_key()


async def test_a_local_server_without_the_sdk_variable_gets_no_auth(
        web_server: Serve, build, make_request) -> None:
    rec = Recorder(OPENAI_REPLY)
    url = await web_server(rec.handle)
    await ask(build(kind="openai", base_url=url + "/v1", model="llama3"), make_request)
    assert "Authorization" not in rec.last[0].headers


async def test_api_key_env_empty_means_no_auth_even_when_the_sdk_variable_is_set(
        web_server: Serve, build, make_request, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(OPENAI_REPLY)
    url = await web_server(rec.handle)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-this-server")
    await ask(build(kind="openai", base_url=url + "/v1", api_key_env=""), make_request)
    assert "Authorization" not in rec.last[0].headers


async def test_the_key_is_read_from_a_file_without_its_newline(
        web_server: Serve, build, make_request, tmp_path: Path) -> None:
    rec = Recorder(OPENAI_REPLY)
    url = await web_server(rec.handle)
    key = tmp_path / "openai.key"
    key.write_text("sk-from-a-file\n")
    await ask(build(kind="openai", base_url=url + "/v1", api_key_file=str(key)), make_request)
    assert rec.last[0].headers["Authorization"] == "Bearer sk-from-a-file"


async def test_the_key_is_read_from_the_systemd_credentials_directory(
        web_server: Serve, build, make_request, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(ANTHROPIC_REPLY)
    url = await web_server(rec.handle)
    (tmp_path / "anthropic-key").write_text("sk-ant-from-a-credential")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    await ask(build(kind="anthropic", base_url=url, api_key_credential="anthropic-key"),
              make_request)
    assert rec.last[0].headers["x-api-key"] == "sk-ant-from-a-credential"


@pytest.mark.parametrize("fields, named", [
    ({"api_key_file": "/nonexistent/turnkeeper.key"}, "api_key_file"),
    ({"api_key_credential": "missing"}, "api_key_credential"),
    ({"headers": {"api-key": "env:TK_TEST_UNSET_HEADER"}}, "TK_TEST_UNSET_HEADER"),
])
def test_a_key_source_that_gives_nothing_is_a_config_error_naming_it(
        fields: dict[str, Any], named: str) -> None:
    cfg = ProviderConfig(name="p", kind="openai", base_url="http://127.0.0.1:1/v1", **fields)
    with pytest.raises(ConfigError, match=named):
        cfg.secrets()


def test_at_most_one_key_source_and_secrets_never_in_repr(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at most one"):
        ProviderConfig(name="p", kind="openai", api_key_env="X", api_key_file="/k")
    key = tmp_path / "k"
    key.write_text("sk-very-secret-value")
    secrets = ProviderConfig(name="p", kind="openai", api_key_file=str(key)).secrets()
    assert "sk-very" not in repr(secrets)


# -- options, headers, query, the output-limit field ----------------------------------------


async def test_options_are_passed_into_the_body_as_given(
        web_server: Serve, build, make_request) -> None:
    rec = Recorder(OPENAI_REPLY)
    url = await web_server(rec.handle)
    options = {"temperature": 0.2, "top_p": 0.9, "stop": ["END"], "seed": 7,
               "tool_choice": "auto", "parallel_tool_calls": False,
               "vendor_field": {"nested": [1, 2]}}
    await ask(build(kind="openai", base_url=url + "/v1", options=options), make_request)
    body = rec.last[1]
    assert {k: body[k] for k in options} == options
    assert body["max_tokens"] == 256


async def test_anthropic_options_are_passed_into_the_body(
        web_server: Serve, build, make_request) -> None:
    rec = Recorder(ANTHROPIC_REPLY)
    url = await web_server(rec.handle)
    options = {"temperature": 0.0, "top_k": 5, "metadata": {"user_id": "u1"}}
    await ask(build(kind="anthropic", base_url=url, options=options), make_request)
    assert {k: rec.last[1][k] for k in options} == options


@pytest.mark.parametrize("reserved", ["model", "messages", "max_tokens", "stream"])
def test_options_may_not_replace_what_the_adapter_writes(reserved: str) -> None:
    with pytest.raises(ValueError, match=reserved):
        ProviderConfig(name="p", kind="openai", options={reserved: 1})


@pytest.mark.parametrize("model, field", [
    ("o3-mini", "max_completion_tokens"), ("gpt-5-mini", "max_completion_tokens"),
    ("o1", "max_completion_tokens"), ("openai/o4-mini", "max_completion_tokens"),
    ("gpt-4.1-mini", "max_tokens"), ("llama3", "max_tokens")])
async def test_reasoning_models_get_max_completion_tokens(
        web_server: Serve, build, make_request, model: str, field: str) -> None:
    rec = Recorder(OPENAI_REPLY)
    url = await web_server(rec.handle)
    await ask(build(kind="openai", base_url=url + "/v1", model=model), make_request)
    body = rec.last[1]
    other = "max_tokens" if field == "max_completion_tokens" else "max_completion_tokens"
    assert body[field] == 256 and other not in body


async def test_max_tokens_field_can_be_set(web_server: Serve, build, make_request) -> None:
    rec = Recorder(OPENAI_REPLY)
    url = await web_server(rec.handle)
    await ask(build(kind="openai", base_url=url + "/v1", model="my-reasoner",
                    max_tokens_field="max_completion_tokens"), make_request)
    assert rec.last[1]["max_completion_tokens"] == 256 and "max_tokens" not in rec.last[1]


async def test_azure_openai_gets_its_api_key_header_and_api_version_query(
        web_server: Serve, build, make_request, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(OPENAI_REPLY)
    url = await web_server(rec.handle)
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", "azure-secret-key-0123")
    p = build(kind="openai", base_url=url + "/openai/deployments/gpt-4o-mini",
              model="gpt-4o-mini", api_key_env="",
              headers={"api-key": "env:AZURE_OPENAI_API_KEY"},
              query={"api-version": "2024-10-21"})
    await ask(p, make_request)
    request, _ = rec.last
    assert request.path == "/openai/deployments/gpt-4o-mini/chat/completions"
    assert request.query["api-version"] == "2024-10-21"
    assert request.headers["api-key"] == "azure-secret-key-0123"
    assert "Authorization" not in request.headers


async def test_a_secret_header_value_never_appears_in_a_failure(
        web_server: Serve, build, make_request, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", "azure-secret-key-0123")
    rec = Recorder({"error": {"type": "invalid_request_error",
                              "message": "bad key azure-secret-key-0123"}}, status=401)
    url = await web_server(rec.handle)
    p = build(kind="openai", base_url=url + "/v1", api_key_env="",
              headers={"api-key": "env:AZURE_OPENAI_API_KEY"})
    with pytest.raises(ProviderError) as info:
        await ask(p, make_request)
    assert "azure-secret-key-0123" not in info.value.failure.describe()
    assert "[redacted]" in info.value.failure.message


def test_loading_a_file_whose_key_file_is_missing_exits_78_naming_the_key(
        tmp_path: Path) -> None:
    from turnkeeper.config import load_config
    f = tmp_path / "c.toml"
    f.write_text('[[providers]]\nname = "p"\nkind = "openai"\nmodel = "m"\n'
                 f'api_key_file = "{tmp_path / "nope.key"}"\n')
    with pytest.raises(ConfigError) as err:
        load_config(f)
    assert err.value.exit_code == 78
    assert "providers.p.api_key_file" in str(err.value)


def test_config_show_redacts_literal_provider_headers_and_query() -> None:
    from turnkeeper.config import Config
    config = Config(providers=(ProviderConfig(
        name="p", kind="openai", base_url="http://127.0.0.1:1/v1", api_key_env="",
        headers={"api-key": "literal-secret", "X-Ref": "env:SOME_KEY"},
        query={"code": "literal-code"}),))
    shown = config.redacted()["providers"][0]
    assert shown["headers"] == {"api-key": "<redacted>", "X-Ref": "env:SOME_KEY"}
    assert shown["query"] == {"code": "<redacted>"}


async def test_a_reload_keeps_a_provider_whose_secrets_did_not_change_and_rebuilds_the_rest(
        tmp_path: Path) -> None:
    from turnkeeper.config import Config, PolicyVersion
    from turnkeeper.runtime import Runtime
    key = tmp_path / "k"
    key.write_text("sk-one")
    config = Config(providers=(
        ProviderConfig(name="filed", kind="openai", base_url="http://127.0.0.1:1/v1",
                       api_key_file=str(key)),
        ProviderConfig(name="local", kind="openai", base_url="http://127.0.0.1:1/v1",
                       api_key_env="")))

    def policy(version: int) -> PolicyVersion:
        return PolicyVersion(version=version, config=config, source_path=None, content_hash="")

    first = Runtime.build(policy(1))
    same = Runtime.build(policy(2), first)
    assert same.providers == first.providers
    key.write_text("sk-two")
    rotated = Runtime.build(policy(3), same)
    assert rotated.providers["filed"] is not same.providers["filed"]
    assert rotated.providers["local"] is same.providers["local"]
    assert same.retired_by(rotated) == [same.providers["filed"]]
    assert "sk-one" not in repr(rotated) and "sk-two" not in repr(rotated)
