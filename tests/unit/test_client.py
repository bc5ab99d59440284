"""The parts of `turnkeeper.client` that decide without a daemon: which answers become
which errors, when a submit is sent again and after how long, how a reopened stream
drops what it has seen; and that importing the blocking client stays light."""

from __future__ import annotations

import subprocess
import sys

from turnkeeper.client import (
    Conflict,
    InvalidRequest,
    Overloaded,
    StoreUnavailable,
    Turn,
    TurnNotFound,
    Unreachable,
)
from turnkeeper.client._wire import StreamState, retry_delay, type_filter
from turnkeeper.client.errors import APIError, error_for


def test_answers_become_errors_by_status_with_field_and_retry_after() -> None:
    e = error_for(400, {"error": "budget.max_steps: no", "field": "budget.max_steps"}, {})
    assert isinstance(e, InvalidRequest) and e.field == "budget.max_steps"
    assert isinstance(error_for(422, {"error": "k", "field": "idempotency_key"}, {}),
                      InvalidRequest)
    assert isinstance(error_for(404, {"error": "no turn t_1"}, {}), TurnNotFound)
    assert isinstance(error_for(409, {"error": "finished"}, {}), Conflict)
    busy = error_for(503, {"error": "full"}, {"retry-after": "7"})
    assert isinstance(busy, Overloaded) and busy.retry_after == 7.0
    disk = error_for(507, {"error": "disk"}, {"retry-after": "2"})
    assert isinstance(disk, StoreUnavailable) and disk.retry_after == 2.0
    other = error_for(500, "boom", {})
    assert type(other) is APIError and other.status == 500


def test_a_submit_is_sent_again_after_503_507_or_no_daemon_within_its_time() -> None:
    busy = Overloaded(503, "full", retry_after=3.0)
    assert retry_delay(busy, 0, left_s=10.0) == 3.0
    assert retry_delay(busy, 0, left_s=2.0) is None  # would wait past the time left
    assert retry_delay(StoreUnavailable(507, "disk", retry_after=1.0), 0, 5.0) == 1.0
    assert retry_delay(Unreachable("refused"), 0, 5.0) == 0.1
    assert retry_delay(Unreachable("refused"), 3, 5.0) == 0.8
    assert retry_delay(Unreachable("refused"), 20, 60.0) == 5.0
    assert retry_delay(InvalidRequest(400, "bad"), 0, 60.0) is None
    assert retry_delay(TurnNotFound(404, "no"), 0, 60.0) is None


def test_a_reopened_turn_stream_gives_no_event_twice_and_ends_at_turn_finished() -> None:
    state = StreamState("t_1", None)
    assert state.path(None) == "/v1/turns/t_1/events"
    assert [state.take({"seq": s, "type": "x"}) for s in (3, 4)] == [True, True]
    assert not state.ended
    assert [state.take({"seq": s, "type": "x"}) for s in (3, 4, 5)] == [False, False, True]
    state.take({"seq": 6, "type": "turn.finished"})
    assert state.ended


def test_every_events_stream_reopens_after_the_last_seq_seen() -> None:
    state = StreamState(None, None)
    assert state.path("turn.") == "/v1/events?type=turn."
    state.take({"seq": 41, "type": "turn.started"})
    assert state.path(None) == "/v1/events?after=41"
    assert not state.ended  # every event: only the caller ends it
    assert StreamState(None, 0).path(None) == "/v1/events?after=0"


def test_type_filters_read_as_the_daemon_reads_them() -> None:
    keep = type_filter("turn.,tool.call")
    assert keep("turn.finished") and keep("tool.call") and not keep("tool.result")
    assert type_filter(None)("anything")


def test_a_turn_reads_its_result_and_keeps_the_raw_json() -> None:
    raw = {"id": "t_1", "session": "s", "state": "partial", "created_at": 1, "updated_at": 2,
           "counters": {"steps": 3}, "usage": {"total_tokens": 9}, "extra": True,
           "result": {"status": "partial", "answer": None, "partial": ["a"],
                      "stopped_because": {"code": "budget.steps", "counter": "steps",
                                          "value": 3, "limit": 3}}}
    turn = Turn.from_json(raw)
    assert turn.finished and turn.usage.total_tokens == 9 and turn.raw["extra"]
    assert turn.result is not None and turn.result.stopped_because.limit == 3


def test_importing_the_blocking_client_loads_no_anyio_aiohttp_or_pydantic() -> None:
    code = ("import sys, turnkeeper.client; "
            "print(sorted(m for m in ('anyio', 'aiohttp', 'pydantic', 'asyncio') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_an_event_that_comes_after_a_later_numbered_one_is_still_given() -> None:
    """Live events are not always in seq order (a turn's `turn.queued` goes out once it
    is stored): one numbered lower than the last seen is new unless it was seen."""
    state = StreamState(None, None)
    assert [state.take({"seq": s, "type": "x"}) for s in (18, 17, 19, 17, 18)] == [
        True, True, True, False, False]
    assert state.path(None) == "/v1/events?after=19"


def test_a_dropped_stream_reopens_where_the_daemon_said_and_gives_nothing_twice() -> None:
    state = StreamState(None, None)
    for s in (5, 7, 8):
        assert state.take({"seq": s, "type": "x"})
    # Dropped for falling behind while seq 6 was still owed to it.
    assert not state.take({"type": "stream.dropped", "reason": "buffer", "after": 5})
    assert state.path(None) == "/v1/events?after=5"
    assert [state.take({"seq": s, "type": "x"}) for s in (6, 7, 8, 9)] == [
        True, False, False, True]
