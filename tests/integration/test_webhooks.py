"""Webhooks on the real daemon: a receiver on 127.0.0.1 gets each chosen event POSTed,
signed as the Standard Webhooks specification says (checked here with HMAC code of the
test's own), retried with one `webhook-id` until it answers 2xx; a delivery pending when
the daemon is killed is delivered after the restart, once; a receiver that hangs holds
no turn up, and status shows the backlog."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import Daemon, running, script_file, scripted_provider
from tests.integration.test_observability import scrape, value
from tests.integration.tool_server import Call, Reply, ToolServer

KEY = b"a key of the test's own, 32 byte"
SECRET = "whsec_" + base64.b64encode(KEY).decode()
ENV = {"APP_WEBHOOK_SECRET": SECRET}
SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
reply = "done: $message"
"""


def config(tmp: Path, receiver: ToolServer, *, extra: str = "") -> str:
    script = script_file(tmp / "script.toml", SCRIPT)
    return f"""
[[webhooks]]
name = "app"
url = "{receiver.url('/hook')}"
events = ["turn.finished", "webhook.failed"]
secret_env = "APP_WEBHOOK_SECRET"
timeout = 5.0
{extra}
""" + scripted_provider(script)


def verify(call: Call, key: bytes = KEY) -> None:
    """The Standard Webhooks check a receiver makes: HMAC-SHA256 under the key of
    `{webhook-id}.{webhook-timestamp}.{body}`, base64, after `v1,`."""
    msg_id = call.headers["webhook-id"]
    ts = call.headers["webhook-timestamp"]
    signed = f"{msg_id}.{ts}.".encode() + call.raw
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    versions = call.headers["webhook-signature"].split(" ")
    assert f"v1,{expected}" in versions, (call.headers, call.raw)
    assert abs(int(ts) - time.time()) < 300


def poll(what: Callable[[], Any], timeout: float = 30.0) -> Any:
    """`what()` once it is truthy, within `timeout` (a guard against a hang only)."""
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout} s: {what()!r}")
        time.sleep(0.02)


def hook_status(d: Daemon, name: str = "app") -> dict[str, Any]:
    status, data = d.get("/v1/status")
    assert status == 200
    return data["webhooks"].get(name) or {}  # type: ignore[no-any-return]


def finished_event(d: Daemon, turn_id: str) -> dict[str, Any]:
    [ev] = [e for e in d.events(turn_id) if e["type"] == "turn.finished"]
    return ev


def test_a_5xx_is_retried_with_one_webhook_id_and_every_attempt_is_signed(
        tmp_path: Path, tool_server: ToolServer) -> None:
    tool_server.respond("/hook", Reply(500), Reply(200))
    with running(tmp_path, config(tmp_path, tool_server), env=ENV) as d:
        turn = d.run("hello")
        assert turn["state"] == "completed"
        first, second = tool_server.wait_for_calls("/hook", 2)
        finished = finished_event(d, turn["id"])
        assert first.headers["webhook-id"] == second.headers["webhook-id"] \
            == f"msg_{finished['seq']}"
        for call in (first, second):
            verify(call)
            assert call.method == "POST"
            assert json.loads(call.raw) == finished  # the event as the stream gives it
        with pytest.raises(AssertionError):
            verify(first, key=b"another key")
        done = poll(lambda: (s := hook_status(d)).get("delivered") == 1 and s)
        assert done["pending"] == 0 and done["failed"] == 0
        samples = scrape(d)
        assert value(samples, "turnkeeper_webhook_deliveries_total",
                     webhook="app", outcome="retried") == 1
        assert value(samples, "turnkeeper_webhook_deliveries_total",
                     webhook="app", outcome="delivered") == 1
        assert value(samples, "turnkeeper_webhook_pending", webhook="app") == 0
        assert len(tool_server.calls("/hook")) == 2


def test_a_refusal_is_given_up_kept_visible_and_reported(
        tmp_path: Path, tool_server: ToolServer) -> None:
    tool_server.respond("/hook", Reply(410), Reply(200))
    with running(tmp_path, config(tmp_path, tool_server), env=ENV) as d:
        turn = d.run("unwanted")
        failed = poll(lambda: (s := hook_status(d)).get("failed") == 1 and s)
        assert "HTTP 410" in failed["last_error"] and failed["pending"] == 0
        # `webhook.failed` is itself delivered (the webhook takes it), once
        [_, report] = tool_server.wait_for_calls("/hook", 2)
        verify(report)
        body = json.loads(report.raw)
        assert body["type"] == "webhook.failed" and body["webhook"] == "app"
        assert body["event_seq"] == finished_event(d, turn["id"])["seq"]
        assert "HTTP 410" in body["error"]


def test_a_delivery_pending_at_kill_9_is_delivered_once_after_the_restart(
        tmp_path: Path) -> None:
    receiver = ToolServer()  # bound, not listening yet: every attempt is refused
    d = Daemon(tmp_path, config(tmp_path, receiver), env=ENV).start()
    try:
        turn = d.run("before the crash")
        pending = poll(lambda: (s := hook_status(d)).get("pending") == 1
                       and s.get("last_error") and s)
        assert "Connect" in pending["last_error"] or "refused" in pending["last_error"]
        d.kill()
        receiver.start()
        d.start()
        [call] = receiver.wait_for_calls("/hook", 1)
        verify(call)
        assert json.loads(call.raw)["turn"] == turn["id"]
        poll(lambda: hook_status(d).get("delivered") == 1)
        # a later event goes through the same outbox; the first is not sent again
        later = d.run("after the restart")
        calls = receiver.wait_for_calls("/hook", 2)
        poll(lambda: hook_status(d).get("delivered") == 2)
        assert [json.loads(c.raw)["turn"] for c in receiver.calls("/hook")] \
            == [turn["id"], later["id"]]
        assert len({c.headers["webhook-id"] for c in calls}) == 2
    finally:
        d.kill()
        receiver.stop()


def test_a_receiver_that_hangs_holds_no_turn_up_nor_the_stop_and_status_shows_backlog(
        tmp_path: Path, tool_server: ToolServer) -> None:
    tool_server.hold("/hook")
    with running(tmp_path, config(tmp_path, tool_server, extra="").replace(
            "timeout = 5.0", "timeout = 120.0"), env=ENV) as d:
        first = d.run("one")
        tool_server.wait_for_calls("/hook", 1)  # on the wire, unanswered
        more = [d.run(f"turn {i}") for i in range(3)]
        assert all(t["state"] == "completed" for t in [first, *more])
        backlog = poll(lambda: (s := hook_status(d)).get("pending") == 4 and s)
        assert backlog["in_flight"] >= 1 and backlog["delivered"] == 0
        assert backlog["oldest_pending_age_s"] >= 0
        assert value(scrape(d), "turnkeeper_webhook_pending", webhook="app") == 4
        # nor the stop: what was on the wire stays pending, sent again after the start
        assert d.stop() == 0
        tool_server.release("/hook")
        d.start()
        poll(lambda: hook_status(d).get("delivered") == 4)
        ids = [c.headers["webhook-id"] for c in tool_server.calls("/hook")]
        assert len(set(ids)) == 4


def test_a_reload_adds_changes_and_removes_webhooks(
        tmp_path: Path, tool_server: ToolServer) -> None:
    script = script_file(tmp_path / "script.toml", SCRIPT)
    plain = scripted_provider(script)
    with running(tmp_path, plain, env=ENV) as d:
        d.run("no webhook yet")
        assert hook_status(d) == {}
        d.set_config(config(tmp_path, tool_server))
        status, data = d.post("/v1/reload")
        assert status == 200, data
        turn = d.run("with a webhook")
        [call] = tool_server.wait_for_calls("/hook", 1)
        assert json.loads(call.raw)["turn"] == turn["id"]
        d.set_config(config(tmp_path, tool_server).replace("/hook", "/other"))
        assert d.post("/v1/reload")[0] == 200
        moved = d.run("to the changed url")
        [other] = tool_server.wait_for_calls("/other", 1)
        assert json.loads(other.raw)["turn"] == moved["id"]
        d.set_config(plain)
        assert d.post("/v1/reload")[0] == 200
        d.run("no webhook any more")
        poll(lambda: hook_status(d).get("delivered") == 2)
        assert len(tool_server.calls()) == 2


@pytest.mark.parametrize(("entry", "said"), [
    ('url = "http://example.com/hook"\nsecret_env = "APP_WEBHOOK_SECRET"',
     "webhooks.0: url: host example.com is not a loopback address"),
    ('url = "http://127.0.0.1:9/hook"',
     "webhooks.0: secret_env, secret_file, secret_credential: set exactly one"),
    ('url = "http://127.0.0.1:9/hook"\nsecret_env = "UNSET_WEBHOOK_SECRET"',
     "webhooks.127.0.0.1:9/hook.secret_env: the variable UNSET_WEBHOOK_SECRET is not set"),
    ('url = "http://127.0.0.1:9/hook"\nsecret_env = "APP_WEBHOOK_SECRET"\n'
     'events = ["turn.fin*"]', "webhooks.0: events: 'turn.fin*' is not an event type"),
])
def test_an_invalid_webhook_is_exit_78_naming_its_key(tmp_path: Path, entry: str,
                                                     said: str) -> None:
    script = script_file(tmp_path / "script.toml", SCRIPT)
    d = Daemon(tmp_path, f"[[webhooks]]\n{entry}\n" + scripted_provider(script), env=ENV)
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(30) == 78
    assert said in d.log_text()
