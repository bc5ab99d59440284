"""A reload meets parked turns: a turn waiting on a clarify answer, one waiting on an
approval and one waiting out a recovery cycle stay in their waits through the reload
(their tasks and checkpoints left as they are), and each runs under the new policy when
it wakes. An answer that comes while the drain still runs is kept.

The real daemon over its socket: the two policies name their scripted provider
differently (`p1`, then `p2`), so every model call says which policy made it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import sqlite3
from pathlib import Path
from typing import Any

from tests.integration.harness import Daemon, script_file, wait_until, write_config

AN_HOUR = 3600.0

# Under the first policy the provider is down for RECOVER; under the second it answers.
SCRIPT = """
[[scenarios]]
match = "ASK"
[[scenarios.steps]]
tool_calls = [{{ name = "clarify", arguments = {{ question = "which colour for $message?" }} }}]
[[scenarios.steps]]
reply = "$last_tool_result from $provider"

[[scenarios]]
match = "APPROVE"
[[scenarios.steps]]
tool_calls = [{{ name = "echo", arguments = {{ text = "approved" }} }}]
[[scenarios.steps]]
reply = "$last_tool_result from $provider"

[[scenarios]]
match = "SLOW"
[[scenarios.steps]]
delay = 1.0
reply = "slow from $provider"

[[scenarios]]
match = "RECOVER"
[[scenarios.steps]]
{recover}
"""
DOWN = 'fail = [{ status = 503, forever = true }]\nreply = "never"'
UP = 'reply = "recovered by $provider"'


def config(tmp: Path, provider: str, recover: str, extra: str = "") -> str:
    script = script_file(tmp / f"{provider}.toml", SCRIPT.format(recover=recover))
    return f"""{extra}
[daemon]
watch_config = false
drain_timeout = {AN_HOUR}

[agent]
api_max_retries = 0
recovery_schedule = [{AN_HOUR}]

[[providers]]
name = "{provider}"
kind = "scripted"
script = "{script}"

[[tools]]
name = "echo"
kind = "echo"
description = "echo"
idempotent = true
approval = "always"
"""


def reload_to(d: Daemon, body: str) -> dict[str, Any]:
    """Rename the new config over the old (as editors do) and reload it."""
    nxt = write_config(d.dir / "next.toml", body, socket=d.socket, state_dir=d.state_dir)
    os.replace(nxt, d.config_path)
    code, data = d.post("/v1/reload", timeout=60)
    assert code == 200, data
    return data  # type: ignore[no-any-return]


def stored(d: Daemon, ids: list[str]) -> dict[str, tuple[Any, ...]]:
    """Each turn's row as the store holds it: state, update time, record, checkpoint."""
    conn = sqlite3.connect(d.state_dir / "turnkeeper.sqlite3")
    try:
        return {row[0]: row[1:] for row in conn.execute(
            "SELECT id, state, updated_at, record, checkpoint FROM turns WHERE id IN "
            f"({','.join('?' * len(ids))})", ids)}
    finally:
        conn.close()


def turn(d: Daemon, turn_id: str) -> dict[str, Any]:
    code, data = d.get(f"/v1/turns/{turn_id}")
    assert code == 200, data
    return data["turn"]  # type: ignore[no-any-return]


def logged(d: Daemon, event: str, ids: list[str]) -> list[dict[str, Any]]:
    return [r for r in d.log_records() if r.get("event") == event and r.get("turn") in ids]


def test_parked_turns_wait_on_through_a_reload_and_wake_under_the_new_policy(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path, "p1", DOWN))
    asking = d.submit("ASK a")["id"]
    answered_in_drain = d.submit("ASK b")["id"]
    approving = d.submit("APPROVE c")["id"]
    recovering = d.submit("RECOVER d")["id"]
    parked = [asking, approving, recovering]
    for t in (asking, answered_in_drain, approving):
        d.wait_state(t, "waiting")
    d.wait_state(recovering, "recovering")
    [pending] = wait_until(lambda: turn(d, approving).get("pending_approvals"),
                           what="the echo call held for approval")
    before = {t: turn(d, t) for t in parked}
    rows = stored(d, parked)
    slow = d.submit("SLOW holds the drain open")["id"]
    d.wait_state(slow, "running")

    # The new policy: its provider is p2, and p2 is up.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reload = pool.submit(reload_to, d, config(tmp_path, "p2", UP))
        d.wait_state(answered_in_drain, "suspended")  # the drain holds it, SLOW runs on
        code, _ = d.post(f"/v1/turns/{answered_in_drain}/messages",
                         {"kind": "answer", "text": "red"})
        assert code == 202
        assert reload.result()["policy_version"] == 2
    assert d.wait(slow)["result"]["answer"] == "slow from p1"  # in flight: its policy

    # Still in the same waits, under the new version; nothing was written for them and
    # none of their tasks was suspended or resumed (their runners still wait).
    for t in parked:
        now = turn(d, t)
        assert now["state"] == before[t]["state"]
        assert now["policy_version"] == 2 and before[t]["policy_version"] == 1
        for key in ("question", "next_attempt_at", "pending_approvals", "counters"):
            assert now.get(key) == before[t].get(key), key
    assert stored(d, parked) == rows
    assert not logged(d, "turn.suspended", parked)
    assert not logged(d, "turn.resumed", parked)

    # Each wakes (an answer, an approval, a steer) and runs under the new policy.
    assert d.wait(answered_in_drain)["result"]["answer"] == "red from p2"
    code, _ = d.post(f"/v1/turns/{asking}/messages", {"kind": "answer", "text": "blue"})
    assert code == 202
    code, _ = d.post(f"/v1/turns/{approving}/approvals",
                     {"call_id": pending["call_id"], "decision": "approve"})
    assert code == 202
    code, _ = d.post(f"/v1/turns/{recovering}/messages",
                     {"kind": "steer", "text": "try again"})
    assert code == 202
    answers = {t: d.wait(t)["result"]["answer"] for t in parked}
    assert answers == {asking: "blue from p2", approving: '{"text": "approved"} from p2',
                       recovering: "recovered by p2"}
    for t in [*parked, answered_in_drain]:
        done = turn(d, t)
        assert done["state"] == "completed" and done["policy_version"] == 2
        events = d.events(t)
        providers = [e["provider"] for e in events if e["type"] == "model.request"]
        assert providers[-1] == "p2" and "p2" not in providers[:-1], providers
        # What followers read tells the same story as a suspension would: suspended,
        # then resumed under the new version, in the same wait.
        types = [(e["type"], e.get("policy_version")) for e in events]
        i = types.index(("turn.suspended", None))
        assert next(x for x in types[i:] if x[0] == "turn.resumed") == ("turn.resumed", 2)
        # ... once each, and a wait is announced again only while it still waits.
        after = [x[0] for x in types[i:]]
        assert after.count("turn.suspended") == after.count("turn.resumed") == 1, after
        assert after.count("turn.waiting") == (t == asking), after


def test_a_reload_that_shortens_the_clarify_timeout_ends_a_wait_it_would_outlast(
        start: Any, tmp_path: Path) -> None:
    """A wait the new policy bounds differently is not left to run out under the old
    bounds: the turn parks again under the new ones (here, at once past them)."""
    d = start(config(tmp_path, "p1", DOWN, extra=f"[clarify]\ntimeout = {AN_HOUR}\n"))
    asking = d.submit("ASK e")["id"]
    d.wait_state(asking, "waiting")
    assert reload_to(d, config(tmp_path, "p2", UP,
                               extra="[clarify]\ntimeout = 0.5\n"))["policy_version"] == 2
    done = d.wait(asking)
    assert done["result"]["stopped_because"]["code"] == "clarify.timeout"
    assert done["result"]["stopped_because"]["limit"] == 0.5
    assert done["policy_version"] == 2


def test_a_stop_during_a_reload_suspends_a_held_turn_once(start: Any, tmp_path: Path) -> None:
    """A SIGTERM that comes while a reload's drain holds a parked turn takes the drain
    over: the held turn, announced `suspended` already, is not announced twice."""
    d = start(config(tmp_path, "p1", DOWN))
    asking = d.submit("ASK f")["id"]
    d.wait_state(asking, "waiting")
    slow = d.submit("SLOW holds the drain open")["id"]
    d.wait_state(slow, "running")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reload = pool.submit(reload_to, d, config(tmp_path, "p2", UP))
        d.wait_state(asking, "suspended")  # held by the reload's drain
        d.signal(signal.SIGTERM)
        assert d.proc is not None
        assert d.proc.wait(30) == 0
        with contextlib.suppress(Exception):  # the stop may answer it or close the socket
            reload.result()
    d.start()
    d.wait_state(asking, "waiting")  # resumed in its wait at the next start
    code, _ = d.post(f"/v1/turns/{asking}/messages", {"kind": "answer", "text": "green"})
    assert code == 202
    assert d.wait(asking)["result"]["answer"] == "green from p2"
    types = [e["type"] for e in d.events(asking)]
    assert types.count("turn.suspended") == 1, types
