"""The event catalogue: every type the daemon publishes is listed, round-trips through
its wire JSON, and reads an event from another daemon version without crashing."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

from turnkeeper import event_types as ev
from turnkeeper.clock import FakeClock
from turnkeeper.events import EventBus, UnknownEventType

DAEMON = Path(__file__).resolve().parents[2] / "daemon" / "turnkeeper"
# A type name published as a string literal: emit("x.y", ...), publish("x.y", ...),
# prepare("x.y", ...).
_PUBLISHED = re.compile(r"""\b(?:emit|publish|prepare)\(\s*["']([a-z_]+\.[a-z_]+)["']""")
# A catalogue class built by a publisher: ev.TurnQueued(...).
_BUILT = re.compile(r"\bev\.([A-Z][A-Za-z]+)\(")



def _sample(cls: type[ev.EventBody]) -> ev.EventBody:
    """An instance with every field set (optional ones too), from the annotations."""
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name == "extra":
            continue
        kind = str(f.type)
        if kind.startswith("dict"):
            values[f.name] = {"k": 1}
        elif kind.startswith("list"):
            values[f.name] = ["a"]
        elif "bool" in kind:
            values[f.name] = False
        elif "int" in kind:
            values[f.name] = 7
        elif "float" in kind:
            values[f.name] = 2.5
        else:
            values[f.name] = f"{f.name}-value"
    return cls(**values)


def test_every_type_the_daemon_publishes_is_in_the_catalogue() -> None:
    published: set[str] = set()
    for path in DAEMON.rglob("*.py"):
        text = path.read_text()
        published.update(_PUBLISHED.findall(text))
        published.update(getattr(ev, name).TYPE for name in _BUILT.findall(text)
                         if isinstance(getattr(ev, name, None), type))
    assert published, "the pattern found no publisher: update it"
    assert published <= set(ev.EVENT_TYPES), sorted(published - set(ev.EVENT_TYPES))


def test_registry_names_each_class_by_its_wire_type() -> None:
    assert len(ev.EVENT_TYPES) == 34
    for name, cls in ev.EVENT_TYPES.items():
        assert name == cls.TYPE


@pytest.mark.parametrize("cls", list(ev.EVENT_TYPES.values()), ids=list(ev.EVENT_TYPES))
def test_round_trip(cls: type[ev.EventBody]) -> None:
    event = _sample(cls)
    wire = event.to_json()
    assert "class_" not in wire and "from_" not in wire and "extra" not in wire
    assert cls.from_json(wire) == event
    assert ev.parse({"seq": 1, "ts": 2.0, "turn": "t_1", "type": cls.TYPE, **wire}) == event


def test_keyword_fields_keep_their_wire_names() -> None:
    wire = ev.ModelFailover(from_="a", to="b", reason="breaker_open").to_json()
    assert wire == {"from": "a", "to": "b", "reason": "breaker_open"}
    failed = ev.ModelAttemptFailed(provider="p", attempt=1, class_="retryable", status=503)
    assert failed.to_json()["class"] == "retryable"


def test_unknown_fields_are_kept_and_written_back() -> None:
    wire = {"type": "model.redirected", "seq": 4, "ts": 1.0, "provider": "p", "new": [1]}
    body = ev.parse(wire)
    assert isinstance(body, ev.ModelRedirected)
    assert body.provider == "p" and body.extra == {"new": [1]}
    assert body.to_json() == {"provider": "p", "new": [1]}


def test_missing_fields_and_unknown_types_do_not_crash() -> None:
    body = ev.parse({"type": "model.request", "provider": "p"})  # an older daemon
    assert isinstance(body, ev.ModelRequest)
    assert body.provider == "p" and body.attempt is None
    assert ev.parse({"type": "model.teleported", "x": 1}) is None
    assert ev.parse({}) is None


def test_tool_result_writes_only_the_fields_of_its_outcome() -> None:
    unknown = ev.ToolResult(tool="t", call_id="c", key="k", ok=None, outcome="unknown")
    assert unknown.to_json() == {"tool": "t", "call_id": "c", "key": "k", "ok": None,
                                 "outcome": "unknown"}
    failed = ev.ToolResult(tool="t", call_id="c", key="k", ok=False, class_="deterministic",
                           error="boom", failure_streak=1, limit=3)
    assert failed.to_json()["class"] == "deterministic" and "content" not in failed.to_json()


def test_a_publisher_must_give_every_field() -> None:
    # A publisher that forgets a field fails at once, not on the reader's side.
    with pytest.raises(TypeError):
        ev.ModelFailover(from_="a", to="b")  # type: ignore[call-arg]
    assert all(f.default is MISSING for f in fields(ev.ModelFailover) if f.name != "extra")


def test_bus_publishes_a_catalogue_event_as_its_wire_json() -> None:
    stored: list[dict[str, Any]] = []
    bus = EventBus(clock=FakeClock(), persist=lambda e: stored.append(e.to_json()))
    event = bus.publish(ev.ModelFailover(from_="a", to="b", reason="r"), turn="t_1")
    assert event.type == "model.failover" and event.data == {"from": "a", "to": "b",
                                                             "reason": "r"}
    assert stored[0]["from"] == "a" and stored[0]["turn"] == "t_1"
    assert event.body == ev.ModelFailover(from_="a", to="b", reason="r")
    # The older form, a type name and fields, still publishes the same JSON.
    old = bus.publish("model.failover", turn="t_1", **{"from": "a"}, to="b", reason="r")
    assert old.data == event.data


def test_bus_checks_a_type_name_against_the_catalogue() -> None:
    with pytest.raises(UnknownEventType):
        EventBus(clock=FakeClock(), strict=True).publish("model.teleported")
    lenient = EventBus(clock=FakeClock())  # the daemon's: a turn never fails over it
    event = lenient.publish("model.teleported", turn="t_1", x=1)
    assert event.type == "model.teleported" and lenient.unknown_types == 1


def test_catalogue_imports_nothing_heavy() -> None:
    import subprocess
    import sys

    code = ("import sys, turnkeeper.event_types; "
            "print(sorted(m for m in ('anyio', 'aiohttp', 'pydantic', 'structlog', 'rich') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
