from __future__ import annotations

from turnkeeper.logging import RecentLines


def test_the_newest_lines_of_a_turn_come_back_oldest_first() -> None:
    r = RecentLines(maxlen=100)
    for i in range(10):
        r.keep(None, "info", {"event": f"e{i}", "turn": "a" if i % 2 else "b"})
    assert [x["event"] for x in r.lines(turn="a", limit=3)] == ["e5", "e7", "e9"]
    assert [x["event"] for x in r.lines(limit=2)] == ["e8", "e9"]


def test_the_window_drops_the_oldest_lines() -> None:
    r = RecentLines(maxlen=3)
    for i in range(5):
        r.keep(None, "info", {"event": f"e{i}"})
    assert [x["event"] for x in r.lines(limit=10)] == ["e2", "e3", "e4"]


def test_meta_keys_of_standard_library_lines_are_left_out() -> None:
    r = RecentLines(maxlen=3)
    r.keep(None, "warning", {"event": "x", "_record": object(), "_from_structlog": False})
    assert r.lines(limit=1) == [{"event": "x"}]
