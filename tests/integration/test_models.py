"""Per-turn provider chains: `[models.NAME] chain = [...]` and `"model"` on a submit, run
by the real daemon against a fault server on 127.0.0.1 whose every provider has its own
path, so each request is counted where it arrived."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.fault_server import FaultServer, fail, ok
from tests.integration.harness import Daemon


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


def _config(server: FaultServer, models: dict[str, list[str]]) -> str:
    out = ["[retry]", "base_delay = 0.01", "max_delay = 0.04", ""]
    for name in ("a", "b", "c"):
        out += ["[[providers]]", f'name = "{name}"', 'kind = "openai"',
                f'base_url = "{server.base_url(name)}"', f'model = "model-{name}"',
                "stream = false", "timeout = 5.0", ""]
    for alias, chain in models.items():
        out += [f"[models.{alias}]", f"chain = {json.dumps(chain)}", ""]
    return "\n".join(out)


def _counts(server: FaultServer) -> tuple[int, int, int]:
    return server.count("a"), server.count("b"), server.count("c")


def test_a_turn_runs_the_chain_its_model_names(start: Any, faults: FaultServer) -> None:
    for name in ("a", "b", "c"):
        faults.script(name, then=ok(f"from {name}"))
    d = start(_config(faults, {"cheap": ["c", "b"]}))

    turn = d.run("hello", model="cheap")
    assert turn["result"]["answer"] == "from c"
    assert (turn["model"], turn["provider"]) == ("cheap", "c")
    assert _counts(faults) == (0, 0, 1)
    # The default chain still starts at the first provider.
    plain = d.run("hello")
    assert (plain["model"], plain["provider"]) == (None, "a")
    assert _counts(faults) == (1, 0, 1)
    # One provider named alone is a chain of one.
    alone = d.run("hello", model="b")
    assert alone["result"]["answer"] == "from b"
    assert _counts(faults) == (1, 1, 1)


def test_an_alias_fails_over_along_its_own_chain_only(start: Any,
                                                     faults: FaultServer) -> None:
    faults.script("c", then=fail(401, error_type="authentication_error"))
    faults.script("b", then=ok("from b"))
    faults.script("a", then=ok("from a"))
    d = start(_config(faults, {"cheap": ["c", "b"]}))
    turn = d.run("hello", model="cheap")
    assert turn["result"]["answer"] == "from b"
    assert turn["provider"] == "b" and turn["counters"]["fallback_hops"] == 1
    assert _counts(faults) == (0, 1, 1)
    # A second turn of the alias starts over at its primary.
    d.run("again", model="cheap")
    assert _counts(faults) == (0, 2, 2)


def test_an_unknown_model_is_refused_naming_the_field(start: Any,
                                                      faults: FaultServer) -> None:
    d = start(_config(faults, {"cheap": ["c", "b"]}))
    status, data = d.post("/v1/turns", {"message": "hello", "model": "nope"})
    assert status == 400 and data["field"] == "model"
    assert "'nope'" in data["error"] and "cheap" in data["error"]
    status, data = d.post("/v1/turns", {"message": "hello", "model": ""})
    assert status == 400 and data["field"] == "model"
    assert _counts(faults) == (0, 0, 0)
    status, data = d.get("/v1/turns")
    assert status == 200 and data["turns"] == []


def test_a_queued_turn_whose_alias_a_reload_removed_runs_the_default_chain(
        start: Any, faults: FaultServer) -> None:
    for name in ("a", "b", "c"):
        faults.script(name, then=ok(f"from {name}"))
    d: Daemon = start(_config(faults, {"cheap": ["c", "b"]}))
    assert d.post("/v1/intake", {"open": False})[0] == 200
    queued = d.submit("hello", model="cheap")
    assert queued["provider"] == "c"
    d.set_config(_config(faults, {}))
    status, data = d.post("/v1/reload")
    assert status == 200, data
    assert d.post("/v1/intake", {"open": True})[0] == 200
    turn = d.wait(queued["id"])
    assert turn["result"]["answer"] == "from a"
    assert (turn["model"], turn["provider"]) == (None, "a")
    assert _counts(faults) == (1, 0, 0)
    gone = [r for r in d.log_records() if r.get("event") == "turn.model_gone"]
    assert gone and gone[0]["model"] == "cheap" and gone[0]["turn"] == queued["id"]
    # The name is unknown to the new policy.
    status, data = d.post("/v1/turns", {"message": "hello", "model": "cheap"})
    assert status == 400 and data["field"] == "model"


def test_a_turn_parked_on_its_alias_resumes_on_it_after_a_reload(
        start: Any, faults: FaultServer) -> None:
    # The alias's only provider fails once; the turn waits out a recovery cycle, parked,
    # and a reload suspends it there. It resumes from its checkpoint on the alias's chain,
    # and its next model call (after a tool step) starts over at the alias's primary: the
    # default chain's primary is never called.
    faults.script("c", fail(503), then=ok("from c", tool_steps=1))
    faults.script("a", then=ok("from a"))
    body = _config(faults, {"cheap": ["c"]}).replace(
        "[retry]", "[agent]\napi_max_retries = 0\nrecovery_schedule = [1.0]\n\n[retry]")
    d: Daemon = start(body)
    turn = d.submit("hello", model="cheap")
    d.wait_state(turn["id"], "recovering")
    d.change_policy()
    status, data = d.post("/v1/reload")
    assert status == 200, data
    done = d.wait(turn["id"])
    assert done["result"]["answer"] == "from c"
    assert (done["model"], done["provider"]) == ("cheap", "c")
    assert _counts(faults) == (0, 0, 3)
    assert done["counters"]["steps"] == 2
    events = [e["type"] for e in d.events(turn["id"])]
    assert "turn.recovering" in events and "turn.suspended" in events


def test_a_config_whose_alias_names_no_provider_does_not_start(
        start: Any, faults: FaultServer) -> None:
    d: Daemon = start(_config(faults, {"cheap": ["c", "z"]}), wait=False)
    assert d.proc is not None
    assert d.proc.wait(timeout=30) == 78
    assert "models.cheap.chain: 'z' is not a configured provider" in d.log_text()


def test_submit_model_on_the_command_line_and_retry_keeps_it(start: Any,
                                                            faults: FaultServer) -> None:
    from tests.integration.test_cli import cli

    for name in ("a", "b", "c"):
        faults.script(name, then=ok(f"from {name}"))
    d = start(_config(faults, {"cheap": ["c", "b"]}))
    out = cli("submit", "hello", "--model", "cheap", "--wait", "--json", socket=d.socket)
    assert out.returncode == 0, out.stderr
    first = json.loads(out.stdout)
    assert (first["model"], first["provider"]) == ("cheap", "c")
    out = cli("retry", first["id"], "--wait", "--json", socket=d.socket)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"] == "cheap"
    assert _counts(faults) == (0, 0, 2)
    out = cli("submit", "hello", "--model", "nope", socket=d.socket)
    assert out.returncode != 0 and "model" in out.stderr and "nope" in out.stderr
