"""The supervisor's turns in memory, indexed by state as they move: after any run of
submits, moves, replacements and removals, the counts and each state's turns are what a
walk over every turn would find, and no module writes a record's state around the
index."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

import turnkeeper
from turnkeeper.policy.turn_state import IllegalTransition, TurnState, moved
from turnkeeper.supervisor.core import LiveTurn
from turnkeeper.supervisor.live import LiveTurns
from turnkeeper.turn.record import LIVE_STATES, TurnRecord

PACKAGE = Path(turnkeeper.__file__).parent


def record(turn_id: str, seq: int, *, state: str = "queued", session: str = "s",
           created_at: float = 0.0) -> TurnRecord:
    return TurnRecord(id=turn_id, session=session, message="m", created_at=created_at,
                      updated_at=created_at, state=state, seq=seq)


def legal(old: str, new: str) -> bool:
    try:
        TurnState(old).to(new)
    except IllegalTransition:
        return False
    return True


def recount(live: LiveTurns) -> dict[str, int]:
    return {s: sum(1 for t in live.values() if t.record.state == s) for s in LIVE_STATES}


@pytest.mark.parametrize("seed", range(20))
def test_counts_equal_a_recount_after_random_moves(seed: int) -> None:
    rng = random.Random(seed)
    live = LiveTurns()
    gone: list[TurnRecord] = []  # records that left: their moves must not count
    for n in range(2000):
        roll = rng.random()
        ids = list(live)
        if roll < 0.25 or not ids:
            turn_id = f"t{rng.randrange(400)}"  # sometimes an id already in: replaced
            state = rng.choice([s.value for s in TurnState])
            live[turn_id] = LiveTurn(record=record(turn_id, n, state=state))
        elif roll < 0.85:
            rec = live[rng.choice(ids)].record
            targets = [s.value for s in TurnState if legal(rec.state, s)]
            rec.set_state(moved(rec.state, rng.choice(targets)))
        elif roll < 0.95:
            popped = live.pop(rng.choice(ids))
            assert popped is not None
            gone.append(popped.record)
        elif gone:
            rec = rng.choice(gone)  # a record kept by someone after it left memory
            rec.set_state(rng.choice([s.value for s in TurnState]))
        assert live.counts() == recount(live)
    for state in TurnState:
        assert {t.record.id for t in live.in_state(state)} == {
            t.record.id for t in live.values() if t.record.state == state}


def test_a_record_that_left_memory_is_no_longer_counted_or_told() -> None:
    live = LiveTurns()
    live["a"] = LiveTurn(record=record("a", 1))
    rec = live["a"].record
    assert live.pop("a") is not None
    assert rec.on_move is None
    rec.set_state("running")
    assert live.counts()["running"] == 0
    assert live.pop("a", None) is None
    with pytest.raises(KeyError):
        live.pop("a")


def test_a_replaced_turn_is_counted_once_in_its_new_state() -> None:
    live = LiveTurns()
    live["a"] = LiveTurn(record=record("a", 1, state="queued"))
    old = live["a"].record
    live["a"] = LiveTurn(record=record("a", 1, state="suspended"))
    old.set_state("running")  # the replaced record no longer moves the count
    assert live.counts() == {**dict.fromkeys(LIVE_STATES, 0), "suspended": 1}


def test_the_ways_around_the_index_are_refused() -> None:
    live = LiveTurns()
    live["a"] = LiveTurn(record=record("a", 1))
    for call in (live.clear, lambda: live.update({}), lambda: live.setdefault("b"),
                 live.popitem):
        with pytest.raises(TypeError):
            call()
    del live["a"]
    assert live.counts()["queued"] == 0


def test_newest_in_a_state_is_a_sort_of_its_turns_cut_at_the_limit() -> None:
    rng = random.Random(7)
    live = LiveTurns()
    for i in range(300):
        seq = rng.randrange(50)  # ties, as for turns not yet written (seq 0)
        live[f"t{i}"] = LiveTurn(record=record(
            f"t{i}", seq, state=rng.choice(["queued", "running"]),
            session=rng.choice(["a", "b"]), created_at=float(rng.randrange(10))))
    for session, since, before in ((None, None, None), ("a", 5.0, 30), ("b", None, 10)):
        expected = sorted((t.record for t in live.values() if t.record.state == "running"
                           and (session is None or t.record.session == session)
                           and (since is None or t.record.created_at >= since)
                           and (before is None or t.record.seq < before)),
                          key=lambda r: r.seq, reverse=True)[:20]
        got = live.newest_in("running", 20, session=session, since=since,
                             before_seq=before)
        assert [r.id for r in got] == [r.id for r in expected]


def state_writes(source: str, name: str) -> list[str]:
    """Every `<...>record.state = ...` in `source`: a write the index would miss."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign)
                   else [])
        for target in targets:
            for leaf in (target.elts if isinstance(target, ast.Tuple | ast.List)
                         else [target]):
                if (isinstance(leaf, ast.Attribute) and leaf.attr == "state"
                        and ast.unparse(leaf.value).split(".")[-1] in ("record", "rec")):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_no_module_writes_a_records_state_but_through_set_state() -> None:
    found = [w for path in sorted(PACKAGE.rglob("*.py"))
             for w in state_writes(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert not found, "move a record with record.set_state(...):\n" + "\n".join(found)


def test_the_checker_finds_a_state_written_directly() -> None:
    source = ("self.record.state = 'x'\nrecord.state, a = b\nctx.state = 1\n"
              "self.state = 2\nd[record.state] = 3\n")
    assert state_writes(source, "m.py") == ["m.py:1: self.record.state",
                                            "m.py:2: (record.state, a)"]
