"""Side effects against the real daemon and a real tool server: a non-idempotent effect
happens at most once, an outcome nobody knows is said (never guessed, never retried),
tool retries have their own setting, and a cancel lets an effect in flight finish
unless told `--now`."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import ECHO_TOOL, Daemon, scripted_provider
from tests.integration.test_observability import scrape, value
from tests.integration.tool_server import Reply, ToolServer
from turnkeeper.policy.effects import effect_key

DB_NAME = "turnkeeper.sqlite3"

SCRIPT = """
[[scenarios]]
match = "^late"
[[scenarios.steps]]
tool_calls = [{ name = "create_ticket", arguments = { title = "printer on fire" } }]

[[scenarios]]
match = "^dedupe"
[[scenarios.steps]]
tool_calls = [{ name = "dedupe_ticket", arguments = { title = "printer on fire" } }]
[[scenarios.steps]]
tool_calls = [{ name = "dedupe_ticket", arguments = { title = "printer on fire" } }]
[[scenarios.steps]]
reply = "saw: $last_tool_result"

[[scenarios]]
match = "^twice"
[[scenarios.steps]]
tool_calls = [{ name = "note", arguments = { text = "hello" } }]
[[scenarios.steps]]
tool_calls = [{ name = "note", arguments = { text = "hello" } }]
[[scenarios.steps]]
reply = "noted twice"

[[scenarios]]
match = "^retries"
[[scenarios.steps]]
fail = [{ status = 503 }]
tool_calls = [{ name = "lookup", arguments = { q = "ada" } }]
[[scenarios.steps]]
reply = "looked up: $last_tool_result"

[[scenarios]]
match = "^pay gateway"
[[scenarios.steps]]
tool_calls = [{ name = "pay", arguments = { amount = 5 } }]
[[scenarios.steps]]
tool_calls = [{ name = "pay", arguments = { amount = 5 } }]
[[scenarios.steps]]
tool_calls = [{ name = "pay", arguments = { amount = 5 } }]
[[scenarios.steps]]
tool_calls = [{ name = "pay", arguments = { amount = 5 } }]
[[scenarios.steps]]
reply = "paid"

[[scenarios]]
match = "^pay dedupe"
[[scenarios.steps]]
tool_calls = [{ name = "pay_dedupe", arguments = { amount = 5 } }]
[[scenarios.steps]]
tool_calls = [{ name = "pay_dedupe", arguments = { amount = 5 } }]
[[scenarios.steps]]
reply = "saw: $last_tool_result"

[[scenarios]]
match = "^pay again"
[[scenarios.steps]]
tool_calls = [{ name = "pay", arguments = { amount = 7 } }]
[[scenarios.steps]]
tool_calls = [{ name = "pay", arguments = { amount = 7 } }]
[[scenarios.steps]]
reply = "paid"

[[scenarios]]
match = "^pay unimplemented"
[[scenarios.steps]]
tool_calls = [{ name = "pay", arguments = { amount = 9 } }]
[[scenarios.steps]]
tool_calls = [{ name = "pay", arguments = { amount = 9 } }]
[[scenarios.steps]]
tool_calls = [{ name = "pay", arguments = { amount = 9 } }]
[[scenarios.steps]]
reply = "paid"

[[scenarios]]
match = "^lookup unimplemented"
[[scenarios.steps]]
tool_calls = [{ name = "fetch", arguments = { q = "501" } }]
[[scenarios.steps]]
reply = "looked up"

[[scenarios]]
match = "^status page"
[[scenarios.steps]]
tool_calls = [{ name = "status_page", arguments = { q = "down?" } }]
[[scenarios.steps]]
reply = "checked"

[[scenarios]]
match = "^blocked cut"
[[scenarios.steps]]
tool_calls = [{ name = "report_blocked", arguments = '{"reason": "cannot reach", "tried": ["' }]
[[scenarios.steps]]
[[scenarios.steps.tool_calls]]
name = "report_blocked"
arguments = { reason = "cannot reach", tried = ["ping"], found = ["no route"] }

""" + "".join(f"""
[[scenarios]]
match = "^{name}$"
[[scenarios.steps]]
tool_calls = [{{ name = "{name}", arguments = {{ to = "ada" }} }}]
[[scenarios.steps]]
reply = "sent"
""" for name in ("mail", "mail_now", "mail_crash"))


def http_tool(server: ToolServer, name: str, *, idempotent: bool = False,
              timeout: float = 5.0, extra: str = "") -> str:
    return textwrap.dedent(f"""
        [[tools]]
        name = "{name}"
        kind = "http"
        url = "{server.url('/' + name)}"
        idempotent = {str(idempotent).lower()}
        timeout = {timeout}
        {extra}
        """)


def effects_config(tmp: Path, server: ToolServer) -> str:
    script = tmp / "script.toml"
    script.write_text(SCRIPT)
    tools = "".join([
        http_tool(server, "create_ticket", timeout=0.2),
        http_tool(server, "dedupe_ticket", timeout=0.2, extra="dedupes_keys = true"),
        http_tool(server, "note"),
        http_tool(server, "lookup", idempotent=True),
        http_tool(server, "mail"), http_tool(server, "mail_now"),
        http_tool(server, "mail_crash"),
        http_tool(server, "pay"), http_tool(server, "fetch", idempotent=True),
        http_tool(server, "status_page", idempotent=True),
        http_tool(server, "pay_dedupe", extra="dedupes_keys = true"),
    ])
    return """
[agent]
api_max_retries = 0
recovery_schedule = [0.05]
auto_recovery_cycles = 2

[tools_retry]
max_attempts = 2

[retry]
base_delay = 0.01
max_delay = 0.05

[circuit_breaker]
failure_threshold = 100
cooldown = 0.1

[budget]
max_steps = 10
""" + scripted_provider(script) + ECHO_TOOL + tools


@pytest.fixture(scope="module")
def server(module_tool_server: ToolServer) -> ToolServer:
    return module_tool_server


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory, server: ToolServer) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("effects")
    daemon = Daemon(tmp, effects_config(tmp, server), name="e").start()
    try:
        yield daemon
    finally:
        daemon.kill()


def of_type(events: list[dict[str, Any]], type_: str, **match: Any) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == type_
            and all(e.get(k) == v for k, v in match.items())]


def unknown_issues(turn: dict[str, Any]) -> list[str]:
    return [i for i in turn["result"]["open_issues"] if i.startswith("outcome unknown: ")]


def cli(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "turnkeeper", "--socket", str(d.socket),
                           *args], capture_output=True, text=True, timeout=30, check=False)


def state_of(d: Daemon, turn_id: str) -> str:
    status, data = d.get(f"/v1/turns/{turn_id}")
    assert status == 200, data
    return str(data["turn"]["state"])


# -- at most once ----------------------------------------------------------------------

def test_a_late_answer_is_an_unknown_outcome_and_the_effect_is_not_repeated(
        d: Daemon, server: ToolServer) -> None:
    server.respond("/create_ticket", Reply(201, {"ticket": 1}, delay=0.6))
    turn = d.run("late answer")
    calls = server.calls("/create_ticket")
    assert len(calls) == 1  # the model asked again; nothing more was sent
    key = effect_key(turn["id"], "create_ticket", {"title": "printer on fire"}, 1)
    assert calls[0].idempotency_key == key
    code = turn["result"]["stopped_because"]["code"]
    assert code != "failure.retryable", turn["result"]
    assert unknown_issues(turn) == [
        f'outcome unknown: create_ticket {{"title":"printer on fire"}} '
        f"(Idempotency-Key {key})"]
    events = d.events(turn["id"])
    [unknown] = of_type(events, "tool.outcome_unknown")
    assert (unknown["tool"], unknown["key"]) == ("create_ticket", key)
    assert unknown["arguments"] == {"title": "printer on fire"}
    assert "Timeout" in unknown["reason"]
    results = of_type(events, "tool.result", tool="create_ticket")
    assert results[0]["ok"] is None and results[0]["outcome"] == "unknown"
    # Every later call of the same action was refused, never retryable.
    assert {r.get("class") for r in results[1:]} == {"deterministic"}
    assert all("outcome unknown; not repeated; verify first" in r["error"]
               for r in results[1:])
    samples = scrape(d)
    assert value(samples, "turnkeeper_tool_outcomes_unknown_total",
                 tool="create_ticket") >= 1


def test_a_tool_that_dedupes_keys_gets_every_repeat_with_the_first_key(
        d: Daemon, server: ToolServer) -> None:
    server.respond("/dedupe_ticket", Reply(201, {"ticket": 1}, delay=0.6),
                   Reply(200, {"ticket": 1, "duplicate": True}))
    turn = d.run("dedupe")
    assert turn["state"] == "completed", turn["result"]
    key = effect_key(turn["id"], "dedupe_ticket", {"title": "printer on fire"}, 1)
    assert [c.idempotency_key for c in server.calls("/dedupe_ticket")] == [key, key]
    assert turn["result"]["answer"] == 'saw: {"ticket": 1, "duplicate": true}'


def test_a_deliberate_second_call_after_a_success_gets_a_new_key(
        d: Daemon, server: ToolServer) -> None:
    turn = d.run("twice")
    assert turn["state"] == "completed", turn["result"]
    keys = [c.idempotency_key for c in server.calls("/note")]
    assert keys == [effect_key(turn["id"], "note", {"text": "hello"}, n) for n in (1, 2)]
    assert not unknown_issues(turn)


# -- a gateway's answer -------------------------------------------------------------------

def keys_sent(server: ToolServer, path: str, turn_id: str) -> list[str | None]:
    return [c.idempotency_key for c in server.calls(path)
            if (c.idempotency_key or "").startswith(turn_id + ".")]


def journal(d: Daemon, turn_id: str) -> list[tuple[str, str | None]]:
    """The turn's journal as the store holds it: (key, outcome kind) per call."""
    conn = sqlite3.connect(f"file:{d.state_dir / DB_NAME}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT key, outcome FROM journal WHERE turn = ? ORDER BY key",
                            (turn_id,)).fetchall()
    finally:
        conn.close()
    return [(key, json.loads(outcome)["kind"] if outcome else None) for key, outcome in rows]


@pytest.mark.parametrize("status", [504, 502, 500, 408])
def test_a_gateway_error_to_a_non_idempotent_call_is_an_unknown_outcome_never_repeated(
        d: Daemon, server: ToolServer, status: int) -> None:
    """The gateway answered; whether the payment went through, nobody knows. The model
    asks to pay again at every step: one charge reaches the server, not four."""
    server.respond("/pay", Reply(status, {"error": {"message": "upstream timed out"}}))
    turn = d.run(f"pay gateway {status}")
    key = effect_key(turn["id"], "pay", {"amount": 5}, 1)
    assert keys_sent(server, "/pay", turn["id"]) == [key]
    assert journal(d, turn["id"]) == [(key, "unknown")]
    assert unknown_issues(turn) == [
        f'outcome unknown: pay {{"amount":5}} (Idempotency-Key {key})']
    events = d.events(turn["id"])
    [unknown] = of_type(events, "tool.outcome_unknown")
    assert unknown["key"] == key and f"HTTP {status}" in unknown["reason"]
    results = of_type(events, "tool.result", tool="pay")
    assert results[0]["ok"] is None and results[0]["outcome"] == "unknown"
    assert len(results) > 1 and all(
        r["class"] == "deterministic" and "outcome unknown; not repeated" in r["error"]
        for r in results[1:])
    assert turn["result"]["stopped_because"]["code"] != "failure.retryable"


def test_a_gateway_error_to_a_tool_that_dedupes_keys_is_sent_again_with_the_same_key(
        d: Daemon, server: ToolServer) -> None:
    server.respond("/pay_dedupe", Reply(504), Reply(200, {"charged": 1, "duplicate": True}))
    turn = d.run("pay dedupe")
    assert turn["state"] == "completed", turn["result"]
    key = effect_key(turn["id"], "pay_dedupe", {"amount": 5}, 1)
    assert keys_sent(server, "/pay_dedupe", turn["id"]) == [key, key]
    assert turn["result"]["answer"] == 'saw: {"charged": 1, "duplicate": true}'
    [unknown] = of_type(d.events(turn["id"]), "tool.outcome_unknown")
    assert unknown["key"] == key and "HTTP 504" in unknown["reason"]
    assert journal(d, turn["id"]) == [(key, "ok")]


def test_a_failed_action_sent_again_carries_the_same_key(d: Daemon, server: ToolServer
                                                        ) -> None:
    """Only a success advances the key: the server that said 409 sees the same key."""
    server.respond("/pay", Reply(409, {"error": {"message": "busy"}}),
                   Reply(201, {"charged": 1}))
    turn = d.run("pay again")
    assert turn["state"] == "completed", turn["result"]
    key = effect_key(turn["id"], "pay", {"amount": 7}, 1)
    assert keys_sent(server, "/pay", turn["id"]) == [key, key]
    assert journal(d, turn["id"]) == [(key, "ok")]
    assert not unknown_issues(turn)


def test_501_is_a_deterministic_failure_not_retried_and_not_unknown(
        d: Daemon, server: ToolServer) -> None:
    server.respond("/pay", Reply(501, {"error": {"message": "not implemented"}}))
    turn = d.run("pay unimplemented")
    stop = turn["result"]["stopped_because"]
    assert (stop["code"], stop["value"], stop["limit"]) == ("failure.deterministic", 2, 2)
    key = effect_key(turn["id"], "pay", {"amount": 9}, 1)
    assert keys_sent(server, "/pay", turn["id"]) == [key, key]
    assert not unknown_issues(turn)
    assert {r["class"] for r in of_type(d.events(turn["id"]), "tool.result", tool="pay")} \
        == {"deterministic"}
    # An idempotent tool gets no automatic retry of a 501 either ([tools_retry] is 2).
    server.respond("/fetch", Reply(501), Reply(200, {"name": "Ada"}))
    looked = d.run("lookup unimplemented")
    assert len(server.calls("/fetch")) == 1
    assert of_type(d.events(looked["id"]), "tool.retry_scheduled") == []


def test_a_kill_9_during_the_repeat_of_a_failed_action_resumes_as_unknown_not_as_the_failure(
        tmp_path: Path, server: ToolServer) -> None:
    """The repeat carries the key of the attempt that failed: the journal's row for that
    key says the repeat is in flight, not what the attempt before it answered."""
    daemon = Daemon(tmp_path, effects_config(tmp_path, server), name="again").start()
    try:
        # The repeat's answer would come long after the kill (pay's timeout is 5 s).
        server.respond("/pay", Reply(409, {"error": {"message": "busy"}}),
                       Reply(201, {"charged": 1}, delay=8.0))
        tid = daemon.submit("pay again")["id"]
        key = effect_key(tid, "pay", {"amount": 7}, 1)
        deadline = time.monotonic() + 10
        while keys_sent(server, "/pay", tid) != [key, key]:
            assert time.monotonic() < deadline, keys_sent(server, "/pay", tid)
            time.sleep(0.005)
        daemon.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        daemon.proc.wait()  # type: ignore[union-attr]
        daemon.start()
        turn = daemon.wait(tid)
        events = daemon.events(tid)
    finally:
        daemon.kill()
    assert keys_sent(server, "/pay", tid) == [key, key]
    assert unknown_issues(turn) == [
        f'outcome unknown: pay {{"amount":7}} (Idempotency-Key {key})']
    [unknown] = of_type(events, "tool.outcome_unknown")
    assert unknown["key"] == key and "daemon stopped" in unknown["reason"]


def test_a_statusless_temporarily_unavailable_is_a_retryable_failure_not_an_unknown(
        d: Daemon, server: ToolServer) -> None:
    """A 200 whose body says the service is temporarily unavailable: retried as a
    retryable failure ([tools_retry] max_attempts = 2), and counted as one."""
    server.respond("/status_page", Reply(200, {"error": "Service Temporarily Unavailable"}))
    turn = d.run("status page")
    assert len(keys_sent(server, "/status_page", turn["id"])) == 2
    [result] = of_type(d.events(turn["id"]), "tool.result", tool="status_page")
    assert result["class"] == "retryable" and "Temporarily Unavailable" in result["error"]


# -- built-ins ------------------------------------------------------------------------------

def test_a_cut_report_blocked_is_told_back_and_the_corrected_call_keeps_tried_and_found(
        d: Daemon) -> None:
    turn = d.run("blocked cut")
    assert turn["state"] == "blocked", turn["result"]
    assert turn["result"]["blocked"] == {"reason": "cannot reach", "tried": ["ping"],
                                         "found": ["no route"]}
    assert turn["result"]["stopped_because"]["message"] == "cannot reach"
    [failed] = of_type(d.events(turn["id"]), "tool.result", tool="report_blocked")
    assert failed["ok"] is False and failed["class"] == "deterministic"
    assert "not valid JSON" in failed["error"]


# -- retries -----------------------------------------------------------------------------

def test_tool_retries_follow_tools_retry_not_the_providers_api_max_retries(
        d: Daemon, server: ToolServer) -> None:
    server.respond("/lookup", Reply(503), Reply(200, {"name": "Ada"}))
    turn = d.run("retries")
    assert turn["state"] == "completed", turn["result"]
    assert turn["result"]["answer"] == 'looked up: {"name": "Ada"}'
    assert len(server.calls("/lookup")) == 2  # [tools_retry] max_attempts = 2
    events = d.events(turn["id"])
    assert [e["attempt"] for e in of_type(events, "tool.retry_scheduled")] == [2]
    assert turn["counters"]["tool_attempts"] == 2
    # api_max_retries = 0: the model's failed attempt was not retried on the provider.
    assert of_type(events, "model.retry_scheduled") == []
    assert len(of_type(events, "model.attempt_failed")) == 1


# -- cancel ------------------------------------------------------------------------------

def test_a_plain_cancel_lets_an_effect_in_flight_finish(d: Daemon, server: ToolServer
                                                        ) -> None:
    server.hold("/mail")
    try:
        tid = d.submit("mail")["id"]
        server.wait_for_calls("/mail", 1)
        status, data = d.post(f"/v1/turns/{tid}/cancel")
        assert status == 202, data
        time.sleep(0.3)  # an absence: the cancel does not end the turn while it waits
        assert state_of(d, tid) == "running"  # waiting for the effect's answer
    finally:
        server.release("/mail")
    turn = d.wait(tid)
    assert turn["state"] == "cancelled", turn["result"]
    assert len(server.calls("/mail")) == 1
    assert not unknown_issues(turn)
    events = d.events(tid)
    assert [r["ok"] for r in of_type(events, "tool.result", tool="mail")] == [True]
    assert of_type(events, "tool.outcome_unknown") == []


def test_cancel_now_cuts_an_effect_in_flight_and_says_its_outcome_is_unknown(
        d: Daemon, server: ToolServer) -> None:
    server.hold("/mail_now")
    try:
        tid = d.submit("mail_now")["id"]
        server.wait_for_calls("/mail_now", 1)
        out = cli(d, "cancel", tid, "--now")
        assert out.returncode == 0, out.stderr
        turn = d.wait(tid, timeout=3)
    finally:
        server.release("/mail_now")
    assert turn["state"] == "cancelled", turn["result"]
    key = effect_key(tid, "mail_now", {"to": "ada"}, 1)
    assert unknown_issues(turn) == [
        f'outcome unknown: mail_now {{"to":"ada"}} (Idempotency-Key {key})']
    [unknown] = of_type(d.events(tid), "tool.outcome_unknown")
    assert unknown["key"] == key and "--now" in unknown["reason"]


def test_a_cancel_body_is_strict(d: Daemon) -> None:
    tid = d.submit("twice")["id"]
    status, data = d.post(f"/v1/turns/{tid}/cancel", {"now": "yes"})
    assert status == 400 and data["field"] == "now", data
    status, data = d.post(f"/v1/turns/{tid}/cancel", {"later": True})
    assert status == 400 and data["field"] == "later", data
    d.wait(tid)


# -- crash -------------------------------------------------------------------------------

def test_a_kill_9_during_an_effect_gives_the_same_unknown_issue_on_resume(
        tmp_path: Path, server: ToolServer) -> None:
    daemon = Daemon(tmp_path, effects_config(tmp_path, server), name="crash").start()
    try:
        server.hold("/mail_crash")
        try:
            tid = daemon.submit("mail_crash")["id"]
            server.wait_for_calls("/mail_crash", 1)
            daemon.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            daemon.proc.wait()  # type: ignore[union-attr]
        finally:
            server.release("/mail_crash")
        daemon.start()
        turn = daemon.wait(tid)
        events = daemon.events(tid)
    finally:
        daemon.kill()
    assert turn["state"] == "completed", turn["result"]
    assert len(server.calls("/mail_crash")) == 1
    key = effect_key(tid, "mail_crash", {"to": "ada"}, 1)
    assert unknown_issues(turn) == [
        f'outcome unknown: mail_crash {{"to":"ada"}} (Idempotency-Key {key})']
    [unknown] = of_type(events, "tool.outcome_unknown")
    assert unknown["key"] == key and "daemon stopped" in unknown["reason"]
