"""`turnkeeper.client` against the real daemon: submit and wait, a stream followed across
a daemon restart with no event lost or given twice, a 503 with Retry-After retried with
one Idempotency-Key, typed errors; the async client the same under asyncio (and trio
when anyio's trio backend is installed)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.integration.harness import ECHO_TOOL, Daemon, script_file, scripted_provider
from turnkeeper.client import (
    AsyncClient,
    Client,
    ClientError,
    Event,
    InvalidRequest,
    Overloaded,
    TurnNotFound,
    Unreachable,
)

QUICK = """
[[scenarios]]
[[scenarios.steps]]
delay = 0.02
reply = "answer to: $message"
"""

# Four steps of a second or so each, an echo call in each: long enough to restart the
# daemon in the middle of the turn's stream.
SLOW = """
[[scenarios]]
[[scenarios.steps]]
delay = 0.8
tool_calls = [{ name = "echo", arguments = { text = "one" } }]
[[scenarios.steps]]
delay = 0.8
tool_calls = [{ name = "echo", arguments = { text = "two" } }]
[[scenarios.steps]]
delay = 0.8
tool_calls = [{ name = "echo", arguments = { text = "three" } }]
[[scenarios.steps]]
delay = 0.8
reply = "done: $message"
"""


def config(tmp_path: Path, script: str = QUICK, extra: str = "") -> str:
    return scripted_provider(script_file(tmp_path / "script.toml", script)) + ECHO_TOOL + extra


def test_the_client_submits_waits_and_reads_typed_results(start: Any, tmp_path: Path
                                                          ) -> None:
    d = start(config(tmp_path))
    tk = Client(socket=d.socket)
    turn = tk.submit("hello", session="s-1", budget={"max_steps": 4})
    assert (turn.session, turn.state) == ("s-1", "queued")
    done = tk.wait(turn.id, timeout=30)
    assert done.finished and done.result is not None
    assert done.result.status == "completed"
    assert done.result.stopped_because.code == "completed"
    assert done.result.answer == "answer to: hello"
    assert tk.get(turn.id).id == turn.id
    assert [e.type for e in tk.events(turn.id)][-1] == "turn.finished"
    assert tk.status().state == "ready" and tk.health().ok


def test_the_client_sends_one_key_for_a_submit_and_the_daemon_makes_one_turn(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path))
    tk = Client(socket=d.socket)
    first = tk.submit("once", idempotency_key="app-42")
    again = tk.submit("once", idempotency_key="app-42")
    assert again.id == first.id
    with pytest.raises(InvalidRequest) as refused:
        tk.submit("twice", idempotency_key="app-42")
    assert (refused.value.status, refused.value.field) == (422, "idempotency_key")
    assert len(tk.turns()) == 1


def test_errors_are_typed_and_name_the_field(start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path))
    tk = Client(socket=d.socket)
    with pytest.raises(TurnNotFound):
        tk.get("t_0000000000000000")
    with pytest.raises(InvalidRequest) as bad:
        tk.submit("x", budget={"max_steps": 0})
    assert bad.value.field == "budget.max_steps"
    gone = Client(socket=tmp_path / "nothing.sock")
    with pytest.raises(ClientError):
        gone.submit("x", retry_for=0.3)


def test_a_submit_refused_503_is_sent_again_after_retry_after_and_makes_one_turn(
        start: Any, tmp_path: Path) -> None:
    full = config(tmp_path, extra="\n[daemon]\nmax_queued_turns = 0\n")
    d = start(full)
    tk = Client(socket=d.socket)
    retries: list[tuple[ClientError, float]] = []
    answer: list[Any] = []

    def submit() -> None:
        try:
            answer.append(tk.submit("after the 503", retry_for=60,
                                    on_retry=lambda e, s: retries.append((e, s))))
        except ClientError as exc:  # pragma: no cover - the assertion below says it
            answer.append(exc)

    worker = threading.Thread(target=submit)
    worker.start()
    deadline = time.monotonic() + 30
    while not retries:  # the first 503 came back
        assert time.monotonic() < deadline and worker.is_alive()
        time.sleep(0.02)
    error, delay = retries[0]
    assert isinstance(error, Overloaded) and error.status == 503
    assert error.retry_after == delay == 1.0
    d.set_config(config(tmp_path))  # room in the queue again
    assert d.post("/v1/reload")[0] == 200
    worker.join(60)
    [turn] = answer
    assert not isinstance(turn, Exception), turn
    assert tk.wait(turn.id, timeout=30).result.answer == "answer to: after the 503"
    assert len(tk.turns()) == 1
    # Given no time to wait, the 503 is raised with its Retry-After.
    d.set_config(full)
    assert d.post("/v1/reload")[0] == 200
    with pytest.raises(Overloaded) as refused:
        tk.submit("no room", retry_for=0)
    assert refused.value.retry_after == 1.0


def test_a_submit_made_while_the_daemon_is_down_is_taken_once_it_is_back(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path))
    d.kill()  # the socket file stays, refusing connections, until the daemon is back
    tk = Client(socket=d.socket)
    retries: list[ClientError] = []
    answer: list[Any] = []
    worker = threading.Thread(target=lambda: answer.append(tk.submit(
        "while down", retry_for=60, on_retry=lambda e, s: retries.append(e))))
    worker.start()
    deadline = time.monotonic() + 30
    while not retries:
        assert time.monotonic() < deadline and worker.is_alive()
        time.sleep(0.02)
    assert isinstance(retries[0], Unreachable)
    d.start()
    worker.join(60)
    [turn] = answer
    assert tk.wait(turn.id, timeout=30).result.answer == "answer to: while down"
    assert len(tk.turns()) == 1


def follow_across_a_restart(d: Daemon, collect: Any) -> list[Event]:
    """Run `collect(turn_id, seen)` in a thread, kill -9 and restart the daemon once the
    turn's second step has started, and return what it collected."""
    tk = Client(socket=d.socket)
    turn = tk.submit("restart me")
    seen: list[Event] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            collect(turn.id, seen)
        except BaseException as exc:  # pragma: no cover - reported below
            failure.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 30
    while not any(e.type == "step.started" and e.data.get("step") == 2 for e in seen):
        assert time.monotonic() < deadline and worker.is_alive(), (seen, failure)
        time.sleep(0.02)
    d.kill()
    d.start()
    worker.join(90)
    assert not failure, failure
    assert not worker.is_alive()
    return seen


def assert_whole_stream(seen: list[Event]) -> None:
    seqs = [e.seq for e in seen]
    assert seqs == sorted(set(seqs)), "an event given twice or out of order"
    types = [e.type for e in seen]
    assert types[0] == "turn.queued" and types[-1] == "turn.finished"
    assert "turn.resumed" in types or types.count("turn.started") == 2, types
    assert seen[-1].data["result"]["answer"] == "done: restart me"


def test_events_follow_a_turn_across_a_daemon_restart(start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path, SLOW))

    def collect(turn_id: str, seen: list[Event]) -> None:
        for event in Client(socket=d.socket).events(turn_id):
            seen.append(event)

    assert_whole_stream(follow_across_a_restart(d, collect))


def test_the_async_client_follows_events_across_a_daemon_restart(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path, SLOW))

    def collect(turn_id: str, seen: list[Event]) -> None:
        async def main() -> None:
            async with AsyncClient(socket=d.socket) as tk:
                async for event in tk.events(turn_id):
                    seen.append(event)

        anyio.run(main)

    assert_whole_stream(follow_across_a_restart(d, collect))


ASYNC_SCRIPT = """
import sys
import anyio
from turnkeeper.client import AsyncClient, InvalidRequest, Overloaded

async def main(sock):
    async with AsyncClient(socket=sock) as tk:
        turn = await tk.submit("from async", idempotency_key="async-1")
        again = await tk.submit("from async", idempotency_key="async-1")
        assert again.id == turn.id
        done = await tk.wait(turn.id, timeout=30)
        assert done.result.answer == "answer to: from async", done
        types = [e.type async for e in tk.events(turn.id)]
        assert types[-1] == "turn.finished", types
        try:
            await tk.submit("other", idempotency_key="async-1")
        except InvalidRequest as exc:
            assert exc.field == "idempotency_key"
        else:
            raise AssertionError("a reused key was taken")
        assert (await tk.status()).state == "ready"
        await tk.pause()
        assert not (await tk.health()).ok
        await tk.resume()
        print("ok", turn.id)

anyio.run(main, sys.argv[1], backend=sys.argv[2])
"""


def backends() -> list[str]:
    out = ["asyncio"]
    try:
        import trio  # noqa: F401
    except ImportError:
        pass
    else:
        out.append("trio")
    return out


@pytest.mark.parametrize("backend", backends())
def test_the_async_client_submits_waits_and_streams(start: Any, tmp_path: Path,
                                                    backend: str) -> None:
    d = start(config(tmp_path))
    run = subprocess.run([sys.executable, "-c", ASYNC_SCRIPT, str(d.socket), backend],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ok t_")


def test_the_async_client_retries_a_503_with_one_key(start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path, extra="\n[daemon]\nmax_queued_turns = 0\n"))
    retries: list[float] = []

    async def main() -> Any:
        refused = anyio.Event()

        def heard(error: ClientError, delay: float) -> None:
            retries.append(getattr(error, "retry_after", -1))
            refused.set()

        async with AsyncClient(socket=d.socket) as tk:
            async with anyio.create_task_group() as tg:
                result: list[Any] = []

                async def submit() -> None:
                    result.append(await tk.submit("async after 503", retry_for=60,
                                                  on_retry=heard))

                tg.start_soon(submit)
                with anyio.fail_after(30):
                    await refused.wait()
                d.set_config(config(tmp_path))
                assert d.post("/v1/reload")[0] == 200
            return await tk.wait(result[0].id, timeout=30)

    done = anyio.run(main)
    assert retries[0] == 1.0
    assert done.result.answer == "answer to: async after 503"
    assert len(Client(socket=d.socket).turns()) == 1
