"""Durability: checkpoints every step, resume after a crash, the tool
call journal, no repeated side effects.

The real daemon is killed with SIGKILL or stopped with SIGTERM and started again on the
same state directory; tools are real HTTP endpoints on 127.0.0.1 that record every
request with its Idempotency-Key.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import (
    ECHO_TOOL,
    Daemon,
    script_file,
    scripted_provider,
    write_config,
)
from tests.integration.tool_server import Reply, ToolServer
from turnkeeper.control.client import Client, ClientError
from turnkeeper.policy.effects import effect_key

DB_NAME = "turnkeeper.sqlite3"
EX_IOERR = 74
TERMINAL = {"completed", "blocked", "partial", "failed", "cancelled"}


def config(tmp_path: Path, script: str, *, tools: ToolServer | None = None,
           extra: str = "") -> str:
    path = script_file(tmp_path / "script.toml", script)
    text = extra + scripted_provider(path) + ECHO_TOOL
    if tools is not None:
        text += f"""
[[tools]]
name = "lookup"
kind = "http"
description = "read something (safe to repeat)"
url = "{tools.url('/lookup')}"
idempotent = true
timeout = 5.0

[[tools]]
name = "send"
kind = "http"
description = "send something (not safe to repeat)"
url = "{tools.url('/send')}"
idempotent = false
timeout = 5.0
"""
    return text


def daemon(tmp_path: Path, daemons: list[Daemon], body: str, name: str = "d") -> Daemon:
    d = Daemon(tmp_path, body, name=name)
    daemons.append(d)
    return d


def wait_for(pred: Any, timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def turn_of(d: Daemon, turn_id: str) -> dict[str, Any]:
    status, data = d.get(f"/v1/turns/{turn_id}")
    assert status == 200, (status, data)
    return data["turn"]  # type: ignore[no-any-return]


def all_turns(d: Daemon) -> list[dict[str, Any]]:
    status, data = d.get("/v1/turns?limit=1000")
    assert status == 200, data
    return data["turns"]  # type: ignore[no-any-return]


def stored_turn_ids(state_dir: Path) -> set[str]:
    """What is on disk, read by SQLite itself (the daemon is dead when this runs)."""
    conn = sqlite3.connect(state_dir / DB_NAME)
    try:
        return {row[0] for row in conn.execute("SELECT id FROM turns")}
    finally:
        conn.close()


def of_type(events: list[dict[str, Any]], type_: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == type_]


# -- the crash loop ------------------------------------------------------------------

# Six steps: idempotent and non-idempotent http calls, one step with both.
CRASH_SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
delay = 0.15
tool_calls = [{ name = "lookup", arguments = { q = "$turn first" } }]
[[scenarios.steps]]
delay = 0.15
tool_calls = [{ name = "send", arguments = { to = "$turn" } },
              { name = "lookup", arguments = { q = "$turn second" } }]
[[scenarios.steps]]
delay = 0.15
tool_calls = [{ name = "send", arguments = { to = "$turn again" } }]
[[scenarios.steps]]
delay = 0.15
tool_calls = [{ name = "lookup", arguments = { q = "$turn third" } }]
[[scenarios.steps]]
delay = 0.15
tool_calls = [{ name = "send", arguments = { to = "$turn last" } }]
[[scenarios.steps]]
delay = 0.15
reply = "done $turn"
"""
CRASH_STEPS = 6
# (step, index) of each call in CRASH_SCRIPT.
LOOKUPS = ((1, 0), (2, 1), (4, 0))
SENDS = ((2, 0), (3, 0), (5, 0))
# The `to` argument of each send, after "$turn": a send's key comes from what it does.
SEND_TO = {(2, 0): "", (3, 0): " again", (5, 0): " last"}


def send_key(turn_id: str, step: int, index: int) -> str:
    return effect_key(turn_id, "send", {"to": turn_id + SEND_TO[step, index]}, 1)
TURNS = 100
KILLS = 30


class Submitter(threading.Thread):
    """Submits TURNS turns through whatever lives and dies: a submit that gets its 202 is
    accepted; one cut off by a kill is tried again (and may exist without a 202)."""

    def __init__(self, socket: Path, seed: int) -> None:
        super().__init__(name="submitter", daemon=True)
        self.client = Client(socket, timeout=10.0)
        self.rng = random.Random(seed)
        self.accepted: list[str] = []
        self.lock = threading.Lock()
        self.failures = 0
        self.stop = threading.Event()

    def snapshot(self) -> list[str]:
        with self.lock:
            return list(self.accepted)

    def run(self) -> None:
        n = 0
        while n < TURNS and not self.stop.is_set():
            try:
                status, data = self.client.request(
                    "POST", "/v1/turns", {"message": f"crash turn {n}",
                                          "session": f"s{n % 40}"})
            except (ClientError, OSError):
                status, data = 0, None
            if status == 202:
                with self.lock:
                    self.accepted.append(data["turn"]["id"])
                n += 1
                time.sleep(self.rng.uniform(0.03, 0.15))
            else:
                self.failures += 1
                time.sleep(0.03)


@pytest.mark.slow
def test_kill_9_at_random_moments_loses_nothing_and_repeats_no_side_effect(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    seed = int(os.environ.get("TK_CRASH_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    print(f"crash seed {seed} (TK_CRASH_SEED={seed} reproduces the kill schedule)")
    tools = ToolServer().start()
    tools.respond("/lookup", Reply(delay=0.02))
    tools.respond("/send", Reply(delay=0.1))  # a wide window to die in
    try:
        d = daemon(tmp_path, daemons, config(tmp_path, CRASH_SCRIPT, tools=tools, extra="""
[retry]
base_delay = 0.01
max_delay = 0.05
"""))
        submitter = Submitter(d.socket, seed)
        kills_in_flight = 0
        for k in range(KILLS):
            before = submitter.snapshot()
            d.start(wait=False)
            if k % 4 == 3:  # now and then during start-up and resume
                time.sleep(rng.uniform(0.05, 0.8))
            else:
                d.wait_ready()
                if k == 0:
                    submitter.start()
                # Nothing accepted before the last kill is missing after the restart.
                listed = all_turns(d)
                missing = set(before) - {t["id"] for t in listed}
                assert not missing, f"accepted turns lost after kill {k}: {missing}"
                kills_in_flight += any(t["state"] not in TERMINAL for t in listed)
                time.sleep(rng.uniform(0.3, 0.6))
            d.kill()

        # The last life: everything finishes.
        d.start()
        submitter.join(30)
        assert not submitter.is_alive()
        accepted = submitter.snapshot()
        assert len(accepted) == TURNS
        for turn_id in accepted:
            d.wait(turn_id, timeout=30)
        turns = all_turns(d)
        assert {t["state"] for t in turns} <= TERMINAL, "a turn in the store never ended"
        assert set(accepted) <= {t["id"] for t in turns}
        d.stop()
        d.start()  # one more restart resumes nothing and repeats nothing
        assert all(t["state"] in TERMINAL for t in all_turns(d))

        sent = collections.Counter(c.idempotency_key for c in tools.calls("/send"))
        looked = collections.Counter(c.idempotency_key for c in tools.calls("/lookup"))
        repeated = {k: n for k, n in sent.items() if n > 1}
        assert not repeated, f"non-idempotent calls sent twice: {repeated}"
        unknown_total = 0
        for t in turns:
            tid = t["id"]
            events = d.events(tid)
            finished = of_type(events, "turn.finished")
            assert len(finished) == 1, (tid, [e["type"] for e in events])
            assert len(of_type(events, "turn.queued")) == 1, tid
            result = t["result"]
            assert result["status"] == "completed", (tid, result)
            assert finished[0]["result"] == result
            # The step count progressed exactly through the script: no step skipped, no
            # completed step run twice.
            assert t["counters"]["steps"] == CRASH_STEPS, (tid, t["counters"])
            assert result["answer"] == f"done {tid}"
            issues = " ".join(result["open_issues"])
            for step, index in SENDS:
                key = send_key(tid, step, index)
                reported = f"(Idempotency-Key {key})" in issues
                unknown_total += reported
                assert sent[key] == 1 or reported, (
                    f"{key} neither reached the tool server nor was reported unknown")
            for step, index in LOOKUPS:
                assert looked[f"{tid}.{step}.{index}"] >= 1, (tid, step, index)
            # Every call and result reported once, however often the turn resumed.
            for kind in ("tool.call", "tool.result"):
                keys = collections.Counter(e["key"] for e in of_type(events, kind))
                assert max(keys.values()) == 1, (tid, kind, keys)
        expected_keys = ({f"{t['id']}.{s}.{i}" for t in turns for s, i in LOOKUPS}
                         | {send_key(t["id"], s, i) for t in turns for s, i in SENDS})
        assert set(sent) | set(looked) <= expected_keys, "a call with an unexpected key"

        # Logs: never two finishes for one turn (a kill between the result and its log
        # line may leave none), no internal error, no turn left behind by the supervisor.
        records = d.log_records()
        logged = collections.Counter(r.get("turn") for r in records
                                     if r.get("event") == "turn.finished")
        assert max(logged.values()) == 1
        bad = [r for r in records if r.get("event") in (
            "turn.internal_error", "turn.supervisor_error")]
        assert not bad, bad[:3]
        print(f"{KILLS} kills ({kills_in_flight} with turns unfinished), "
              f"{len(turns)} turns ({len(turns) - TURNS} unacknowledged submits), "
              f"{sum(sent.values())} sends, {sum(looked.values())} lookups "
              f"({sum(looked.values()) - len(looked)} idempotent re-runs), "
              f"{unknown_total} outcomes unknown, {submitter.failures} submits cut off")
        assert kills_in_flight >= KILLS // 3, "the kills missed the work"
    finally:
        tools.stop()


# -- graceful stop -------------------------------------------------------------------

STEPS_SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
delay = 0.25
tool_calls = [{ name = "echo", arguments = { text = "$turn one" } }]
[[scenarios.steps]]
delay = 0.25
tool_calls = [{ name = "echo", arguments = { text = "$turn two" } }]
[[scenarios.steps]]
delay = 0.25
tool_calls = [{ name = "echo", arguments = { text = "$turn three" } }]
[[scenarios.steps]]
delay = 0.25
reply = "finished $turn"
"""


def assert_steps_continue(events: list[dict[str, Any]], steps: int) -> None:
    """Step numbers only go up, except that the step a stop cut short starts again once,
    right after `turn.resumed`; every tool result of a completed step is there once."""
    seen: list[int] = []
    just_resumed = False
    for e in events:
        if e["type"] == "turn.resumed":
            just_resumed = True
        elif e["type"] == "step.started":
            n = e["step"]
            if seen and n <= seen[-1]:
                assert just_resumed and n == seen[-1], f"step {n} started again: {seen}"
            seen.append(n)
            just_resumed = False
    assert sorted(set(seen)) == list(range(1, steps + 1)), seen
    results = collections.Counter(e["key"] for e in of_type(events, "tool.result"))
    assert results and max(results.values()) == 1, results


def test_a_graceful_stop_with_turns_in_flight_continues_where_they_were(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    d = daemon(tmp_path, daemons, config(tmp_path, STEPS_SCRIPT, extra="""
[daemon]
shutdown_timeout = 0.1
"""))
    d.start()
    ids = [d.submit(f"turn {i}")["id"] for i in range(6)]
    wait_for(lambda: all(turn_of(d, t)["counters"]["steps"] >= 2 for t in ids),
             what="two steps of every turn")
    at_stop = {t: turn_of(d, t)["counters"]["steps"] for t in ids}
    assert d.stop() == 0
    # The stop did not wait for the turns: its drain ran out with them still running,
    # and each one resumes below (a turn the stop let finish would have no turn.resumed).
    cut = [r for r in d.log_records() if r.get("event") == "daemon.drain_timeout"]
    assert [(r["reason"], r["running"]) for r in cut] == [("stop", len(ids))], cut
    d.start()
    for t in ids:
        done = d.wait(t, timeout=20)
        assert done["state"] == "completed", done
        assert done["counters"]["steps"] == 4
        events = d.events(t)
        resumed = of_type(events, "turn.resumed")
        assert len(resumed) == 1 and resumed[0]["step"] >= at_stop[t] - 1, (resumed, at_stop)
        assert_steps_continue(events, 4)
        assert len(of_type(events, "turn.started")) == 1
        assert len(of_type(events, "turn.finished")) == 1


SEND_SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
tool_calls = [{ name = "send", arguments = { text = "$message" } },
              { name = "lookup", arguments = { q = "after" } }]
[[scenarios.steps]]
reply = "sent"
"""

SLOW_REPLY_SCRIPT = SEND_SCRIPT.replace('reply = "sent"', 'delay = 30.0\nreply = "sent"')


def tools_on_disk(d: Daemon, tid: str) -> tuple[int, int]:
    """How many of the turn's tool calls have their outcome, and how many `tool.result`
    events there are, on disk (the test runs one turn). An idempotent call's journal
    rows and every event are queued, not awaited: they reach the disk a moment after the
    call, in the writer's next commit."""
    conn = sqlite3.connect(d.state_dir / "turnkeeper.sqlite3")
    try:
        outcomes = conn.execute("SELECT COUNT(*) FROM journal WHERE turn = ? AND outcome"
                                " IS NOT NULL", (tid,)).fetchone()[0]
        results = conn.execute("SELECT COUNT(*) FROM events WHERE type = 'tool.result'"
                               ).fetchone()[0]
        return int(outcomes), int(results)
    finally:
        conn.close()


def killed_in_the_second_model_call(d: Daemon) -> str:
    """Start `d`, submit a SEND_SCRIPT turn and kill -9 the daemon during its second
    model call, once both tool calls of the first step have their outcome and result
    event on disk.
    Returns the turn's id."""
    d.start()
    tid = str(d.submit("one email")["id"])
    wait_for(lambda: turn_of(d, tid)["counters"]["steps"] == 2,
             what="the second model call under way")
    wait_for(lambda: tools_on_disk(d, tid) == (2, 2), what="both calls' outcomes on disk")
    d.kill()
    return tid


def restarted_and_sent_once(d: Daemon, tid: str, tool_server: ToolServer) -> dict[str, Any]:
    """Start `d` again and wait for the turn: it completes with nothing open, and each
    tool was sent its call once. Returns the finished turn."""
    d.start()
    done = d.wait(tid, timeout=20)
    assert done["state"] == "completed" and done["result"]["answer"] == "sent", done
    assert not done["result"]["open_issues"], done
    assert len(tool_server.calls("/send")) == 1
    assert len(tool_server.calls("/lookup")) == 1
    return done


def test_a_kill_during_the_next_model_call_runs_the_tools_again_from_the_journal_once(
        tmp_path: Path, daemons: list[Daemon], tool_server: ToolServer) -> None:
    """No checkpoint is taken between a step's tools and the next model call: a kill
    during that call resumes from the checkpoint before the tools, which run again from
    the journal. Nothing is sent twice, and every call and result is reported once."""
    d = daemon(tmp_path, daemons, config(tmp_path, SLOW_REPLY_SCRIPT, tools=tool_server))
    # The tools' events committed first: the replay must not report them again.
    tid = killed_in_the_second_model_call(d)
    conn = sqlite3.connect(d.state_dir / DB_NAME)
    try:
        logged = [row[0] for row in conn.execute(
            "SELECT json_extract(data, '$.type') FROM events ORDER BY seq")]
    finally:
        conn.close()
    assert logged.count("tool.result") == 2 and logged[-1] == "model.request", logged
    # Again quick: the second model call is not what this is about.
    script_file(tmp_path / "script.toml", SEND_SCRIPT)
    done = restarted_and_sent_once(d, tid, tool_server)
    events = d.events(tid)
    for kind in ("tool.call", "tool.result"):
        keys = collections.Counter(e["key"] for e in of_type(events, kind))
        assert len(keys) == 2 and set(keys.values()) == {1}, (kind, keys)
    assert [e["type"] for e in events if e["type"] in ("turn.resumed", "step.started")] \
        == ["step.started", "step.started", "turn.resumed", "step.started"]
    assert done["counters"]["steps"] == 2


def test_a_kill_then_a_policy_that_flips_the_tools_idempotent_flags_sends_nothing_twice(
        tmp_path: Path, daemons: list[Daemon], tool_server: ToolServer) -> None:
    """Killed during the model call after its tools, then restarted under a config that
    says `send` is idempotent and `lookup` is not: each call is still found in the
    journal under the key it was sent with, reported from it, and not sent again."""
    d = daemon(tmp_path, daemons, config(tmp_path, SLOW_REPLY_SCRIPT, tools=tool_server))
    tid = killed_in_the_second_model_call(d)
    lookup, send = (f'url = "{tool_server.url(p)}"\nidempotent = ' for p in ("/lookup", "/send"))
    flipped = config(tmp_path, SEND_SCRIPT, tools=tool_server)
    assert lookup + "true" in flipped and send + "false" in flipped
    flipped = flipped.replace(lookup + "true", lookup + "false").replace(
        send + "false", send + "true")
    write_config(d.config_path, flipped, socket=d.socket, state_dir=d.state_dir)
    restarted_and_sent_once(d, tid, tool_server)


def test_a_stop_lets_a_non_idempotent_call_in_flight_finish_so_its_outcome_is_known(
        tmp_path: Path, daemons: list[Daemon], tool_server: ToolServer) -> None:
    d = daemon(tmp_path, daemons, config(tmp_path, SEND_SCRIPT, tools=tool_server, extra="""
[daemon]
shutdown_timeout = 0.1
"""))
    d.start()
    tool_server.hold("/send")
    tid = d.submit("one email")["id"]
    tool_server.wait_for_calls("/send", 1)
    d.signal(signal.SIGTERM)
    # The shutdown_timeout has run out (the drain says so) and the stop still waits for
    # the effect.
    wait_for(lambda: [r for r in d.log_records() if r.get("event") == "daemon.drain_timeout"],
             what="the stop's drain to run out")
    assert d.proc is not None and d.proc.poll() is None
    tool_server.release("/send")
    assert d.proc.wait(10) == 0
    assert tool_server.calls("/lookup") == []  # the step stopped right after the effect
    d.start()
    done = d.wait(tid, timeout=20)
    assert done["state"] == "completed", done
    assert not [x for x in done["result"]["open_issues"] if "outcome unknown" in x]
    assert len(tool_server.calls("/send")) == 1
    assert len(tool_server.calls("/lookup")) == 1
    assert len(of_type(d.events(tid), "turn.suspended")) == 1


# -- parked turns --------------------------------------------------------------------

CLARIFY_SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
tool_calls = [{ name = "clarify", arguments = { question = "which city, $message?" } }]
[[scenarios.steps]]
reply = "going to $last_tool_result"
"""


def test_a_turn_waiting_on_clarify_survives_restarts_waiting_with_its_question(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    d = daemon(tmp_path, daemons, config(tmp_path, CLARIFY_SCRIPT))
    d.start()
    tid = d.submit("traveller")["id"]
    waiting = wait_for(lambda: (t := turn_of(d, tid))["state"] == "waiting" and t,
                       what="the clarify question")
    assert waiting["question"] == "which city, traveller?"
    d.kill()  # kill -9 while it waits
    d.start()
    again = wait_for(lambda: (t := turn_of(d, tid))["state"] == "waiting" and t,
                     what="waiting after kill -9")
    assert again["question"] == waiting["question"]
    assert again["counters"]["steps"] == 1
    assert d.stop() == 0  # and a graceful stop while it waits
    d.start()
    again = wait_for(lambda: (t := turn_of(d, tid))["state"] == "waiting" and t,
                     what="waiting after SIGTERM")
    assert again["question"] == waiting["question"]
    status, _ = d.post(f"/v1/turns/{tid}/messages", {"kind": "answer", "text": "Lisbon"})
    assert status == 202
    done = d.wait(tid)
    assert done["state"] == "completed"
    assert done["result"]["answer"] == "going to Lisbon"
    assert done["counters"]["steps"] == 2
    events = d.events(tid)
    waits = of_type(events, "turn.waiting")
    assert [w["question"] for w in waits] == [waiting["question"]] * 3
    if "timeout_at" in waits[0]:  # the clarify timeout runs from the first question
        assert len({w["timeout_at"] for w in waits}) == 1


# The provider is down until the user says "now".
RECOVERY_SCRIPT = """
[[scenarios]]
match_last_user = "^now$"
[[scenarios.steps]]
reply = "recovered: $last_user"

[[scenarios]]
[[scenarios.steps]]
fail = [{ status = 503, forever = true }]
"""
RECOVERY_CONFIG = """
[agent]
api_max_retries = 0
recovery_schedule = [30.0, 0.05]
recovery_jitter = 0.0
auto_recovery_cycles = 3
[retry]
base_delay = 0.01
"""


def test_a_turn_in_a_recovery_wait_survives_restarts_keeping_its_cycle(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    d = daemon(tmp_path, daemons, config(tmp_path, RECOVERY_SCRIPT, extra=RECOVERY_CONFIG))
    d.start()
    tid = d.submit("please")["id"]
    first = wait_for(lambda: (t := turn_of(d, tid))["state"] == "recovering" and t,
                     what="the first recovery wait")
    for stop in (d.kill, d.stop):  # kill -9, then a graceful stop
        stop()
        d.start()
        again = wait_for(lambda: (t := turn_of(d, tid))["state"] == "recovering" and t,
                         what="the recovery wait after a restart")
        assert again["next_attempt_at"] == pytest.approx(first["next_attempt_at"], abs=1e-6)
        assert again["counters"] == first["counters"]
        assert again["counters"]["steps"] == 1
    # A steer cuts the 30 s wait short; the next call succeeds.
    status, _ = d.post(f"/v1/turns/{tid}/messages", {"kind": "steer", "text": "now"})
    assert status == 202
    done = d.wait(tid, timeout=15)
    assert done["state"] == "completed", done
    assert done["result"]["answer"] == "recovered: now"
    assert done["counters"]["steps"] == 1
    cycles = [e["cycle"] for e in of_type(d.events(tid), "turn.recovering")]
    assert cycles == [1, 1, 1], cycles


def test_a_step_resumed_in_its_recovery_wait_names_the_primary_it_will_ask_next(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    """Both providers failed, the turn waits out a recovery cycle, the daemon restarts:
    the step goes on, and its `step.started` names the provider the next pass asks first
    (the primary), not the last one that failed (the fallback)."""
    path = script_file(tmp_path / "script.toml", RECOVERY_SCRIPT)
    body = (RECOVERY_CONFIG + scripted_provider(path, name="primary")
            + scripted_provider(path, name="fallback") + ECHO_TOOL)
    d = daemon(tmp_path, daemons, body)
    d.start()
    tid = d.submit("please")["id"]
    wait_for(lambda: turn_of(d, tid)["state"] == "recovering", what="the recovery wait")
    assert turn_of(d, tid)["provider"] == "fallback"  # the last one tried
    d.stop()
    d.start()
    wait_for(lambda: turn_of(d, tid)["state"] == "recovering",
             what="the recovery wait after a restart")
    status, _ = d.post(f"/v1/turns/{tid}/messages", {"kind": "steer", "text": "now"})
    assert status == 202
    done = d.wait(tid, timeout=15)
    assert done["result"]["answer"] == "recovered: now"
    events = d.events(tid)
    assert [(e["step"], e["provider"]) for e in of_type(events, "step.started")] == [
        (1, "primary"), (1, "primary")]
    assert [e["provider"] for e in of_type(events, "model.request")][-1] == "primary"


# -- steer messages ------------------------------------------------------------------

STEER_SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
delay = 0.6
tool_calls = [{ name = "echo", arguments = { text = "step one" } }]
[[scenarios.steps]]
reply = "heard: $last_user"
"""


def test_a_steer_accepted_before_a_kill_is_not_lost(tmp_path: Path,
                                                    daemons: list[Daemon]) -> None:
    d = daemon(tmp_path, daemons, config(tmp_path, STEER_SCRIPT))
    d.start()
    tid = d.submit("go")["id"]
    wait_for(lambda: turn_of(d, tid)["counters"]["steps"] == 1, what="step 1")
    status, _ = d.post(f"/v1/turns/{tid}/messages", {"kind": "steer", "text": "go left"})
    assert status == 202
    d.kill()
    d.start()
    done = d.wait(tid, timeout=15)
    assert done["result"]["answer"] == "heard: go left"
    messages = of_type(d.events(tid), "turn.message")
    assert [m["text"] for m in messages] == ["go left"]


STEER_RECOVERY_SCRIPT = """
[[scenarios]]
match_last_user = "first|second"
[[scenarios.steps]]
delay = 0.6
reply = "heard: $last_user"

[[scenarios]]
[[scenarios.steps]]
fail = [{ status = 503, forever = true }]
"""


def test_steers_taken_in_by_a_recovering_turn_survive_a_kill(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    """The first steer ends the recovery wait and joins the conversation; the second
    arrives during the next model call. Killed then, neither may be lost."""
    d = daemon(tmp_path, daemons, config(tmp_path, STEER_RECOVERY_SCRIPT,
                                         extra=RECOVERY_CONFIG))
    d.start()
    tid = d.submit("go")["id"]
    wait_for(lambda: turn_of(d, tid)["state"] == "recovering", what="the recovery wait")
    status, _ = d.post(f"/v1/turns/{tid}/messages", {"kind": "steer", "text": "first"})
    assert status == 202
    wait_for(lambda: turn_of(d, tid)["state"] == "running", what="the next attempt")
    status, _ = d.post(f"/v1/turns/{tid}/messages", {"kind": "steer", "text": "second"})
    assert status == 202
    d.kill()
    d.start()
    done = d.wait(tid, timeout=15)
    assert done["state"] == "completed", done
    assert done["result"]["answer"] == "heard: second"
    # The successful request carried the user's message and both steers.
    requests = of_type(d.events(tid), "model.request")
    assert requests[-1]["messages"] == 3, requests


# -- the 202 means on disk -----------------------------------------------------------

SLOW_SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
delay = 0.3
reply = "ok $turn"
"""


def _submit_many(socket: Path, accepted: list[str], some: threading.Event,
                 n: int = 8) -> None:
    client = Client(socket, timeout=5.0)
    for i in range(n):
        try:
            status, data = client.request("POST", "/v1/turns", {"message": f"m{i}"})
        except ClientError:
            break
        if status == 202:
            accepted.append(data["turn"]["id"])
            if len(accepted) >= 3:
                some.set()
    some.set()


@pytest.mark.slow
def test_an_accepted_submit_survives_an_immediate_kill_9(tmp_path: Path,
                                                         daemons: list[Daemon]) -> None:
    d = daemon(tmp_path, daemons, config(tmp_path, SLOW_SCRIPT))
    accepted: list[str] = []
    for _ in range(2):
        d.start()
        results: list[str] = []
        some = threading.Event()
        threads = [threading.Thread(target=_submit_many, args=(d.socket, results, some))
                   for _ in range(3)]
        for t in threads:
            t.start()
        some.wait(10)
        d.kill()  # right after a 202, while other submits are still in flight
        for t in threads:
            t.join(10)
        assert results
        on_disk = stored_turn_ids(d.state_dir)
        assert set(results) <= on_disk, set(results) - on_disk
        accepted += results
    d.start()
    for tid in accepted:
        turn = d.wait(tid, timeout=20)
        assert turn["state"] == "completed"
        events = d.events(tid)
        assert len(of_type(events, "turn.queued")) == 1
        assert len(of_type(events, "turn.finished")) == 1


# -- a store that cannot be trusted stops start-up ------------------------------------

def _garbage(db: Path) -> None:
    db.parent.mkdir(parents=True, exist_ok=True)
    db.write_bytes(b"this is not a database, it is a grocery list\n" * 200)


def _newer_schema(db: Path) -> None:
    db.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE turns (id TEXT PRIMARY KEY)")
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()


@pytest.mark.parametrize(("damage", "says"), [
    (_garbage, "cannot be opened"),
    (_newer_schema, "schema version 99, newer"),
])
def test_a_database_that_cannot_be_trusted_stops_start_up_with_74(
        tmp_path: Path, daemons: list[Daemon], damage: Any, says: str) -> None:
    d = daemon(tmp_path, daemons, config(tmp_path, SLOW_SCRIPT))
    db = d.state_dir / DB_NAME
    damage(db)
    before = db.read_bytes()
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(20) == EX_IOERR
    log = d.log_text()
    assert says in log and str(db) in log, log[-2000:]
    assert db.read_bytes() == before, "the store was touched"
    assert not d.socket.exists()


def test_a_database_with_damaged_pages_stops_start_up_with_74(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    d = daemon(tmp_path, daemons, config(tmp_path, """
[[scenarios]]
[[scenarios.steps]]
reply = "$message"
"""))
    d.start()
    for i in range(40):
        d.submit("x" * 2000 + str(i))
    wait_for(lambda: all(t["state"] == "completed" for t in all_turns(d)), what="turns")
    assert d.stop() == 0
    db = d.state_dir / DB_NAME
    raw = bytearray(db.read_bytes())
    page = 4096
    assert len(raw) > 8 * page
    rng = random.Random(7)
    for p in range(2, len(raw) // page):  # everything but the header page
        raw[p * page:p * page + 64] = bytes(rng.randrange(256) for _ in range(64))
    db.write_bytes(bytes(raw))
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(20) == EX_IOERR
    log = d.log_text()
    assert "corrupt" in log or "malformed" in log, log[-2000:]
    assert str(db) in log


def test_an_unusable_state_directory_stops_start_up_with_74(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the state directory should be\n")
    d = daemon(tmp_path, daemons, config(tmp_path, SLOW_SCRIPT))
    d.state_dir = blocker / "state"
    d.set_config(config(tmp_path, SLOW_SCRIPT))
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(20) == EX_IOERR
    assert "is not usable" in d.log_text()
    if os.geteuid() != 0:  # root writes anywhere: the permission case needs a user
        ro = tmp_path / "read-only"
        ro.mkdir(mode=0o500)
        d.state_dir = ro / "state"
        d.set_config(config(tmp_path, SLOW_SCRIPT))
        d.start(wait=False)
        assert d.proc.wait(20) == EX_IOERR


def test_a_second_daemon_on_the_same_state_directory_refuses_to_start(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    d = daemon(tmp_path, daemons, config(tmp_path, SLOW_SCRIPT))
    d.start()
    other = daemon(tmp_path, daemons, config(tmp_path, SLOW_SCRIPT), name="other")
    other.state_dir = d.state_dir  # the same store, another socket
    other.set_config(config(tmp_path, SLOW_SCRIPT))
    out = subprocess.run([sys.executable, "-m", "turnkeeper", "serve", "--config",
                          str(other.config_path)], capture_output=True, text=True,
                         timeout=30, check=False)
    assert out.returncode == 69, out.stderr
    assert "in use by another turnkeeper" in out.stderr
    assert f"pid {d.pid}" in out.stderr
    assert d.run("still here")["state"] == "completed"


def test_deleting_the_pid_file_does_not_let_a_second_daemon_share_the_store(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    """The lock is on the database file itself: the file beside it only names the holder."""
    d = daemon(tmp_path, daemons, config(tmp_path, SLOW_SCRIPT))
    d.start()
    (d.state_dir / "turnkeeper.sqlite3.lock").unlink()
    other = daemon(tmp_path, daemons, config(tmp_path, SLOW_SCRIPT), name="other")
    other.state_dir = d.state_dir
    other.set_config(config(tmp_path, SLOW_SCRIPT))
    out = subprocess.run([sys.executable, "-m", "turnkeeper", "serve", "--config",
                          str(other.config_path)], capture_output=True, text=True,
                         timeout=30, check=False)
    assert out.returncode == 69, out.stderr
    assert "in use by another turnkeeper" in out.stderr
    assert d.run("still here")["state"] == "completed"


def test_the_database_files_are_readable_by_their_owner_only(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    d = daemon(tmp_path, daemons, config(tmp_path, SLOW_SCRIPT))
    d.start()
    assert d.run("one")["state"] == "completed"
    files = sorted(d.state_dir.glob("turnkeeper.sqlite3*"))
    assert {f.name for f in files} >= {"turnkeeper.sqlite3", "turnkeeper.sqlite3-wal"}
    for f in files:
        assert f.stat().st_mode & 0o077 == 0, f"{f.name} is {oct(f.stat().st_mode)}"


# -- event numbers and schema migrations ------------------------------------------------

# Every step streams twenty words before its tool call: events between checkpoints.
BUSY_SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
delay = 0.05
reply = "one two three four five six seven eight nine ten a b c d e f g h i j"
tool_calls = [{ name = "echo", arguments = { text = "$turn $step" } }]
"""


def test_event_numbers_seen_live_are_never_reused_after_a_kill(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    """A follower dedupes by seq: events it saw that died with the process (and the
    live-only `model.delta`) must not lend their numbers to new events."""
    d = daemon(tmp_path, daemons, config(tmp_path, BUSY_SCRIPT, extra="""
[budget]
max_steps = 8
"""))
    d.start()
    seen: list[int] = []

    def follow() -> None:
        try:
            for event in Client(d.socket, timeout=None).stream("/v1/events"):
                seen.append(event["seq"])
        except (ClientError, OSError, ValueError):
            pass

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    for i in range(20):
        d.submit(f"busy {i}")
    wait_for(lambda: len(seen) > 50, what="events")
    # Another process holds the database's write lock (as a stalled disk would): events
    # still reach live followers, none reaches the disk. Then the daemon dies.
    db = d.state_dir / DB_NAME
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    stalled = len(seen)
    wait_for(lambda: len(seen) > stalled + 40, what="events while the disk stalls")
    d.kill()
    blocker.execute("ROLLBACK")
    blocker.close()
    follower.join(5)
    seen_live = max(seen)
    conn = sqlite3.connect(db)
    persisted = conn.execute("SELECT MAX(seq) FROM events").fetchone()[0]
    conn.close()
    assert persisted < seen_live  # the premise: numbers seen live died with the process
    d.start()
    d.submit("after the kill")
    wait_for(lambda: all(t["state"] in TERMINAL for t in all_turns(d)), timeout=30,
             what="every turn to end")
    d.stop()
    conn = sqlite3.connect(db)
    after = [r[0] for r in conn.execute("SELECT seq FROM events WHERE seq > ?", (persisted,))]
    conn.close()
    assert after and min(after) > seen_live, (min(after), seen_live)


# Fifty steps of an echo call: a turn's trail (its partial-work lines and loop guard
# keys, about 100 characters a step) spills a row of 4 KB before step 50.
LONG_STEPS = 50
LONG_SCRIPT = "[[scenarios]]\n" + """
[[scenarios.steps]]
delay = 0.03
tool_calls = [{ name = "echo", arguments = { text = "$turn step $step" } }]
""" * (LONG_STEPS - 1) + """
[[scenarios.steps]]
reply = "done $turn"
"""


def test_a_long_turn_killed_after_its_trail_spilled_a_row_resumes_with_every_line_once(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    """A checkpoint carries what grows with the turn only until it reaches 4 KB; then
    it is written as a row of the turn's trail. A `kill -9` after that loses none of it
    and repeats none of it: each turn ends with every step's partial line once."""
    d = daemon(tmp_path, daemons, config(tmp_path, LONG_SCRIPT))
    d.start()
    ids = [d.submit(f"long {i}", budget={"max_steps": LONG_STEPS + 10})["id"]
           for i in range(3)]
    db = d.state_dir / DB_NAME

    def spilled() -> bool:
        conn = sqlite3.connect(db)
        try:
            return bool(conn.execute("SELECT COUNT(DISTINCT turn_no) FROM trail").fetchone()[0]
                        == len(ids))
        finally:
            conn.close()

    wait_for(spilled, timeout=30, what="every turn's first trail row")
    assert any(turn_of(d, t)["state"] == "running" for t in ids)
    d.kill()
    d.start()
    for tid in ids:
        done = d.wait(tid, timeout=60)
        assert done["state"] == "completed" and done["counters"]["steps"] == LONG_STEPS
        steps = [int(line.split(":")[0].split()[1]) for line in done["result"]["partial"]]
        assert steps == list(range(1, LONG_STEPS + 1)), done["result"]["partial"]


def test_a_store_from_the_previous_schema_is_migrated_and_its_turns_resume(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    import json

    from turnkeeper.store.sqlite import SCHEMA_VERSION
    from turnkeeper.store.sqlite_schema import migrate
    from turnkeeper.turn.record import TurnRecord

    d = daemon(tmp_path, daemons, config(tmp_path, SLOW_SCRIPT))
    db = d.state_dir / DB_NAME
    db.parent.mkdir(parents=True)
    conn = sqlite3.connect(db)
    migrate(conn, to=1)  # the store as version 1 left it, with a queued turn
    now = time.time()
    record = TurnRecord(id="t_0000000000000001", session="s", message="from v1",
                        created_at=now, updated_at=now, seq=1, policy_version=1).to_json()
    conn.execute("INSERT INTO turns (id, seq, session, state, created_at, updated_at,"
                 " record) VALUES (?, 1, 's', 'queued', ?, ?, ?)",
                 (record["id"], now, now, json.dumps(record)))
    conn.commit()
    conn.close()
    d.start()
    done = d.wait("t_0000000000000001")
    assert done["state"] == "completed"
    assert done["result"]["answer"] == "ok t_0000000000000001"
    d.stop()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()


def test_a_row_that_is_not_json_stops_start_up_with_74_not_a_traceback(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    """A damaged row can pass SQLite's quick_check: the store names it and start-up ends
    with 74 (a crash loop under Restart=on-failure would follow a traceback's exit 1)."""
    d = daemon(tmp_path, daemons, config(tmp_path, SLOW_SCRIPT))
    d.start()
    turn = d.submit("to be damaged")["id"]
    d.kill()
    conn = sqlite3.connect(d.state_dir / DB_NAME)
    conn.execute("UPDATE turns SET record = '{\"id\": broken' WHERE id = ?", (turn,))
    conn.commit()
    conn.close()
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(20) == EX_IOERR
    assert "damaged row" in d.log_text()
    assert "Traceback" not in d.log_text()
