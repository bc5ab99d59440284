"""The offline `scripted` provider: which scenario answers a message, and a reload that
reads its script again."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnkeeper.config import PolicyVersion, build_config
from turnkeeper.messages import Message
from turnkeeper.providers.base import ModelRequest, ProviderError
from turnkeeper.providers.scripted import ScriptedProvider
from turnkeeper.runtime import Runtime

pytestmark = pytest.mark.anyio

TWO = """
[[scenarios]]
match = "^weather"
[[scenarios.steps]]
reply = "sunny"

[[scenarios]]
match = "^time"
[[scenarios.steps]]
reply = "noon"
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def request(message: str) -> ModelRequest:
    return ModelRequest(system="", messages=[Message(role="user", content=message)],
                        tools=(), max_output_tokens=100, timeout_s=5.0, turn_id="t1", step=1)


def provider(tmp_path: Path, script: str) -> ScriptedProvider:
    path = tmp_path / "script.toml"
    path.write_text(script)
    config = build_config({"providers": [{"name": "s", "kind": "scripted",
                                          "script": str(path)}]})
    return ScriptedProvider(config.providers[0])


async def test_a_message_no_scenario_matches_is_an_error_naming_it(tmp_path: Path) -> None:
    scripted = provider(tmp_path, TWO)
    assert (await scripted.complete(request("time please"))).text == "noon"
    with pytest.raises(ProviderError) as err:
        await scripted.complete(request("what news?"))
    failure = err.value.failure
    assert failure.status == 400 and failure.error_type == "no_matching_scenario"
    assert "matches the message 'what news?'" in failure.message
    assert str(tmp_path / "script.toml") in failure.message


async def test_a_script_of_one_scenario_answers_every_message(tmp_path: Path) -> None:
    scripted = provider(tmp_path, TWO.split("\n[[scenarios]]\nmatch = \"^time\"")[0])
    assert (await scripted.complete(request("what news?"))).text == "sunny"


def test_a_rebuild_reads_the_script_again_and_keeps_an_unchanged_one(tmp_path: Path) -> None:
    path = tmp_path / "script.toml"
    path.write_text(TWO)
    config = build_config({"providers": [{"name": "s", "kind": "scripted",
                                          "script": str(path)}]})
    first = Runtime.build(PolicyVersion(version=1, config=config, source_path=None,
                                 content_hash=""))
    same = Runtime.build(PolicyVersion(version=2, config=config, source_path=None,
                                content_hash=""), first)
    assert same.providers["s"] is first.providers["s"]
    path.write_text(TWO.replace("noon", "half past noon"))
    edited = Runtime.build(PolicyVersion(version=3, config=config, source_path=None,
                                  content_hash=""), same)
    assert edited.providers["s"] is not same.providers["s"]
    assert first.retired_by(edited) == [first.providers["s"]]
