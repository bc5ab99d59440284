"""Provider configs as people write them, run by the real daemon against a model server of
our own on 127.0.0.1: the six examples of docs/providers.md (the README's is one of
them), and a key rotated on reload."""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.integration.harness import Daemon, running

ROOT = Path(__file__).resolve().parents[2]


class ModelServer:
    """Answers Chat Completions and Messages requests (JSON or SSE) with one final text,
    and keeps every request's path, query, headers and body."""

    def __init__(self, tool_steps: int = 0) -> None:
        """`tool_steps`: how many first steps of a turn a Messages request is answered
        with a call of the echo tool (the text answer comes after)."""
        self.requests: list[dict[str, Any]] = []
        self.tool_steps = tool_steps
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                url = urlsplit(self.path)
                server.requests.append({"path": url.path, "query": parse_qs(url.query),
                                        "headers": dict(self.headers.items()),
                                        "body": body})
                anthropic = url.path.endswith("/v1/messages")
                stream = bool(body.get("stream")) or url.path.endswith(
                    ":streamGenerateContent")
                calls = sum(m["role"] == "assistant" for m in body.get("messages", ()))
                if anthropic and not stream and calls < server.tool_steps:
                    payload = _anthropic_tool_use(calls + 1)
                elif url.path.endswith("/responses"):
                    payload = _responses(stream)
                elif "GenerateContent" in url.path or "generateContent" in url.path:
                    payload = _gemini(stream)
                else:
                    payload = (_anthropic(stream) if anthropic else _openai(stream))
                self.send_response(200)
                self.send_header("Content-Type",
                                 "text/event-stream" if stream else "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                       name="model-server")
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _sse(events: list[Any], done: bool = False) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def _openai(stream: bool) -> bytes:
    usage = {"prompt_tokens": 20, "completion_tokens": 2}
    if not stream:
        return json.dumps({"model": "m", "usage": usage, "choices": [
            {"message": {"role": "assistant", "content": "done"},
             "finish_reason": "stop"}]}).encode()
    return _sse([{"model": "m", "choices": [{"index": 0, "delta": {"content": "done"},
                                             "finish_reason": None}]},
                 {"model": "m", "choices": [{"index": 0, "delta": {},
                                             "finish_reason": "stop"}]},
                 {"model": "m", "choices": [], "usage": usage}], done=True)


def _responses(stream: bool) -> bytes:
    final = {"object": "response", "status": "completed", "model": "m", "output": [
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "done"}]}],
        "usage": {"input_tokens": 20, "output_tokens": 2}}
    if not stream:
        return json.dumps(final).encode()
    return _sse([{"type": "response.output_text.delta", "output_index": 0, "delta": "done"},
                 {"type": "response.completed", "response": final}])


def _gemini(stream: bool) -> bytes:
    reply = {"candidates": [{"content": {"role": "model", "parts": [{"text": "done"}]},
                             "finishReason": "STOP"}],
             "usageMetadata": {"promptTokenCount": 20, "candidatesTokenCount": 2}}
    return _sse([reply]) if stream else json.dumps(reply).encode()


def _anthropic(stream: bool) -> bytes:
    usage = {"input_tokens": 20, "output_tokens": 2}
    if not stream:
        return json.dumps({"type": "message", "model": "m", "stop_reason": "end_turn",
                           "content": [{"type": "text", "text": "done"}],
                           "usage": usage}).encode()
    return _sse([{"type": "message_start", "message": {"model": "m", "usage": usage}},
                 {"type": "content_block_start", "index": 0,
                  "content_block": {"type": "text", "text": ""}},
                 {"type": "content_block_delta", "index": 0,
                  "delta": {"type": "text_delta", "text": "done"}},
                 {"type": "content_block_stop", "index": 0},
                 {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                  "usage": {"output_tokens": 2}},
                 {"type": "message_stop"}])


def _anthropic_tool_use(step: int) -> bytes:
    return json.dumps({"type": "message", "model": "m", "stop_reason": "tool_use",
                       "content": [{"type": "tool_use", "id": f"toolu_{step}",
                                    "name": "echo", "input": {"text": f"step {step}"}}],
                       "usage": {"input_tokens": 20, "output_tokens": 2}}).encode()


@pytest.fixture
def server() -> Iterator[ModelServer]:
    s = ModelServer()
    yield s
    s.close()


def _toml_blocks(path: Path, heading: str) -> dict[str, str]:
    """The TOML blocks of one section of a page, by provider name."""
    text = path.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```toml\n(.*?)```", section, re.S)
    return {re.search(r'name = "([^"]+)"', b).group(1): b for b in blocks}  # type: ignore[union-attr]


def provider_examples() -> dict[str, str]:
    """The TOML blocks of the Examples section of docs/providers.md, by provider name."""
    return _toml_blocks(ROOT / "docs" / "providers.md", "Examples")


EXAMPLES = ["openai", "anthropic", "responses", "gemini", "local", "azure"]


def test_the_providers_page_shows_the_six_provider_examples() -> None:
    assert list(provider_examples()) == EXAMPLES


def test_the_readme_s_provider_is_the_providers_page_s_openai_example() -> None:
    """The README's one example is run by the test below as the page's `openai` one."""
    readme = _toml_blocks(ROOT / "README.md", "Connecting a real provider")
    assert readme == {"openai": provider_examples()["openai"]}


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_provider_example_runs_a_turn(tmp_path: Path, server: ModelServer,
                                                  name: str) -> None:
    block = provider_examples()[name]
    block = (block.replace("http://127.0.0.1:11434", server.url)
             .replace("https://my-resource.openai.azure.com", server.url))
    env = {"OPENAI_API_KEY": "sk-openai-test", "OPENAI_BASE_URL": server.url + "/v1",
           "ANTHROPIC_API_KEY": "sk-ant-test", "ANTHROPIC_BASE_URL": server.url,
           "AZURE_OPENAI_API_KEY": "azure-test-key", "GEMINI_API_KEY": "gemini-test-key",
           "GOOGLE_GEMINI_BASE_URL": server.url}
    with running(tmp_path, block, env=env) as d:
        turn = d.run("Say done.")
        assert turn["state"] == "completed", turn
    seen = server.requests[-1]
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    if name == "openai":
        assert seen["path"] == "/v1/chat/completions"
        assert headers["authorization"] == "Bearer sk-openai-test"
        assert seen["body"]["model"] == "gpt-4.1-mini"
        assert turn["usage"]["cost_usd"] > 0  # priced from the shipped table
    elif name == "anthropic":
        assert seen["path"] == "/v1/messages"
        assert headers["x-api-key"] == "sk-ant-test"
        assert seen["body"]["system"][0]["cache_control"] == {"type": "ephemeral"}
        assert turn["usage"]["cost_usd"] > 0
    elif name == "responses":
        assert seen["path"] == "/v1/responses"
        assert headers["authorization"] == "Bearer sk-openai-test"
        body = seen["body"]
        assert (body["model"], body["store"], body["reasoning"]) == (
            "gpt-5-pro", False, {"effort": "high"})
        assert body["include"] == ["reasoning.encrypted_content"]
        assert turn["usage"]["cost_usd"] > 0
    elif name == "gemini":
        assert seen["path"] == "/v1beta/models/gemini-2.5-flash:streamGenerateContent"
        assert seen["query"] == {"alt": ["sse"]}
        assert headers["x-goog-api-key"] == "gemini-test-key"
        config = seen["body"]["generationConfig"]
        assert config["thinkingConfig"] == {"thinkingBudget": 1024}
        assert config["maxOutputTokens"] > 0
        assert turn["usage"]["cost_usd"] > 0
    elif name == "local":
        assert "authorization" not in headers
        assert seen["body"]["temperature"] == 0.2
        assert turn["usage"]["cost_usd"] == 0
    else:
        assert seen["path"] == "/openai/deployments/my-gpt-4o-mini/chat/completions"
        assert seen["query"] == {"api-version": ["2024-10-21"]}
        assert headers["api-key"] == "azure-test-key"
        assert "authorization" not in headers


def test_a_key_rotated_in_its_file_takes_effect_on_reload(tmp_path: Path,
                                                          server: ModelServer) -> None:
    key = tmp_path / "openai.key"
    key.write_text("sk-first\n")
    config = (f'[daemon]\nwatch_config = false\n\n[[providers]]\nname = "p"\n'
              f'kind = "openai"\nbase_url = "{server.url}/v1"\nmodel = "m"\n'
              f'api_key_file = "{key}"\n')
    d: Daemon
    with running(tmp_path, config) as d:
        assert d.run("one")["state"] == "completed"
        assert server.requests[-1]["headers"]["Authorization"] == "Bearer sk-first"
        key.write_text("sk-second\n")  # the config file itself does not change
        code, data = d.post("/v1/reload")
        assert code == 200, data
        assert d.run("two")["state"] == "completed"
        assert server.requests[-1]["headers"]["Authorization"] == "Bearer sk-second"
        assert "sk-first" not in d.log_text() and "sk-second" not in d.log_text()


def test_a_key_file_that_vanished_refuses_the_reload_and_keeps_the_running_key(
        tmp_path: Path, server: ModelServer) -> None:
    key = tmp_path / "openai.key"
    key.write_text("sk-kept")
    config = (f'[daemon]\nwatch_config = false\n\n[[providers]]\nname = "p"\n'
              f'kind = "openai"\nbase_url = "{server.url}/v1"\nmodel = "m"\n'
              f'api_key_file = "{key}"\n')
    with running(tmp_path, config) as d:
        key.unlink()
        code, data = d.post("/v1/reload")
        assert code != 200 and "api_key_file" in json.dumps(data)
        assert d.run("still")["state"] == "completed"
        assert server.requests[-1]["headers"]["Authorization"] == "Bearer sk-kept"


def _unmarked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages without their cache marks, a text message's one block as its text."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{k: v for k, v in b.items() if k != "cache_control"} for b in content]
            if len(content) == 1 and content[0]["type"] == "text" and m["role"] == "user":
                content = content[0]["text"]
        out.append({**m, "content": content})
    return out


def test_a_long_anthropic_turn_sends_its_history_whole_and_marked_once(tmp_path: Path
                                                                       ) -> None:
    """Twelve steps of tool calls, then the answer: from the eighth message on, each
    request joins the bytes kept from the requests before (the turn's message cache).
    Every request must still be the whole history, in order, each result after its
    call, and only its last message marked for the prompt cache."""
    server = ModelServer(tool_steps=12)
    try:
        config = (f'[[providers]]\nname = "a"\nkind = "anthropic"\nbase_url = "{server.url}"'
                  '\nmodel = "m"\nstream = false\n'
                  '\n[[tools]]\nname = "echo"\nkind = "echo"\ndescription = "echo"'
                  '\nidempotent = true\n')
        with running(tmp_path, config, env={"ANTHROPIC_API_KEY": "sk-ant-test"}) as d:
            turn = d.run("Call echo twelve times, then say done.")
        assert turn["state"] == "completed" and turn["counters"]["steps"] == 13, turn
        bodies = [r["body"] for r in server.requests]
        assert [len(b["messages"]) for b in bodies] == [1 + 2 * k for k in range(13)]
        for before, after in itertools.pairwise(bodies):
            assert _unmarked(after["messages"])[:len(before["messages"])] == \
                _unmarked(before["messages"])
        for body in bodies:
            messages = body["messages"]
            marks = [i for i, m in enumerate(messages) if "cache_control" in json.dumps(m)]
            assert marks == [len(messages) - 1]
            for call, result in zip(messages[1::2], messages[2::2], strict=True):
                assert result["role"] == "user"
                assert result["content"][0]["tool_use_id"] == call["content"][0]["id"]
        last = bodies[-1]["messages"]
        assert last[-1]["content"][0]["content"] == '{"text": "step 12"}'
    finally:
        server.close()
