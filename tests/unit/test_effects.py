"""The rule for non-idempotent calls: at most once, and an unknown outcome is never
guessed away."""

from __future__ import annotations

import json

import pytest

from turnkeeper.policy.classify import FailureClass, classify
from turnkeeper.policy.effects import (
    EffectLedger,
    EffectOutcome,
    Refuse,
    Send,
    effect_key,
    unknown_after_status,
)
from turnkeeper.policy.loops import action_key


def _send(plan: object) -> Send:
    assert isinstance(plan, Send), plan
    return plan


def test_first_call_key_names_turn_tool_action_and_ordinal_one() -> None:
    ledger = EffectLedger("t1")
    key = _send(ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False)).key
    turn, tool, digest, ordinal = key.split(".")
    assert (turn, tool, ordinal) == ("t1", "create_ticket", "1")
    assert len(digest) == 12


def test_same_action_after_unknown_gets_the_same_key_when_the_tool_dedupes() -> None:
    ledger = EffectLedger("t1")
    first = _send(ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=True))
    ledger.record("create_ticket", {"title": "x"}, "unknown")
    again = _send(ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=True))
    assert again.key == first.key
    assert again.repeat


def test_same_action_after_unknown_is_refused_without_dedupes_keys() -> None:
    ledger = EffectLedger("t1")
    ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False)
    ledger.record("create_ticket", {"title": "x"}, EffectOutcome.UNKNOWN)
    plan = ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False)
    assert isinstance(plan, Refuse)
    assert "outcome unknown; not repeated; verify first" in plan.failure.describe()
    assert classify(plan.failure) is FailureClass.DETERMINISTIC


def test_refusal_lasts_until_a_known_outcome() -> None:
    ledger = EffectLedger("t1")
    ledger.record("create_ticket", {"title": "x"}, "unknown")
    for _ in range(3):
        assert isinstance(ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False),
                          Refuse)


def test_same_action_after_success_gets_the_next_key() -> None:
    ledger = EffectLedger("t1")
    first = _send(ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False))
    ledger.record("create_ticket", {"title": "x"}, "ok")
    second = _send(ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False))
    assert first.key.endswith(".1") and second.key.endswith(".2")
    assert first.key[:-2] == second.key[:-2]
    assert not second.repeat


def test_same_action_after_a_failure_keeps_its_key() -> None:
    """Only a success advances the ordinal: a failed charge sent again is the same charge
    (and a server that dedupes says so only if it sees the same key)."""
    ledger = EffectLedger("t1")
    first = _send(ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False))
    for _ in range(5):
        ledger.record("create_ticket", {"title": "x"}, "failed")
        again = _send(ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False))
        assert again.key == first.key and not again.repeat
    ledger.record("create_ticket", {"title": "x"}, "ok")
    assert _send(ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False)).key \
        .endswith(".2")


def test_a_failure_after_an_unknown_outcome_lets_the_action_be_sent_with_its_key() -> None:
    ledger = EffectLedger("t1")
    first = _send(ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=True))
    ledger.record("create_ticket", {"title": "x"}, "unknown")
    ledger.record("create_ticket", {"title": "x"}, "failed")  # the server's word on the key
    again = _send(ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False))
    assert again.key == first.key


@pytest.mark.parametrize(("status", "unknown"), [
    (408, True), (500, True), (502, True), (503, True), (504, True), (529, True),
    (501, False), (400, False), (404, False), (409, False), (422, False), (429, False),
    (200, False), (302, False)])
def test_a_timeout_or_a_gateway_status_leaves_the_outcome_unknown(status: int,
                                                                   unknown: bool) -> None:
    assert unknown_after_status(status) is unknown


def test_a_trail_written_before_failures_kept_the_key_restores_as_it_was_written() -> None:
    """Lines of a turn in flight across the upgrade: `k` was any known outcome then,
    and what those turns sent stays as sent."""
    action = action_key("create_ticket", {"title": "x"})
    restored = EffectLedger.restore({"turn": "t1"}, ["k" + action, "k" + action])
    assert _send(restored.plan("create_ticket", {"title": "x"}, dedupes_keys=False)).key \
        .endswith(".3")


def test_known_outcome_after_unknown_reopens_the_action() -> None:
    ledger = EffectLedger("t1")
    ledger.record("create_ticket", {"title": "x"}, "unknown")
    ledger.record("create_ticket", {"title": "x"}, "ok")
    assert _send(ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False)).key \
        .endswith(".2")


def test_order_of_json_keys_does_not_matter() -> None:
    a = {"title": "x", "body": {"p": 1, "q": 2}}
    b = json.loads('{"body": {"q": 2, "p": 1}, "title": "x"}')
    assert effect_key("t1", "create_ticket", a, 1) == effect_key("t1", "create_ticket", b, 1)
    ledger = EffectLedger("t1")
    ledger.record("create_ticket", a, "unknown")
    assert isinstance(ledger.plan("create_ticket", b, dedupes_keys=False), Refuse)


def test_other_arguments_or_tool_or_turn_are_another_action() -> None:
    base = effect_key("t1", "create_ticket", {"title": "x"}, 1)
    assert effect_key("t1", "create_ticket", {"title": "y"}, 1) != base
    assert effect_key("t1", "close_ticket", {"title": "x"}, 1) != base
    assert effect_key("t2", "create_ticket", {"title": "x"}, 1) != base
    ledger = EffectLedger("t1")
    ledger.record("create_ticket", {"title": "x"}, "unknown")
    assert isinstance(ledger.plan("create_ticket", {"title": "y"}, dedupes_keys=False), Send)


def test_plan_alone_changes_nothing() -> None:
    ledger = EffectLedger("t1")
    first = ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False)
    assert ledger.plan("create_ticket", {"title": "x"}, dedupes_keys=False) == first


def test_snapshot_restore_round_trip_through_json() -> None:
    ledger = EffectLedger("t1")
    ledger.record("create_ticket", {"title": "x"}, "ok")
    ledger.record("create_ticket", {"title": "y"}, "unknown")
    ledger.record("create_ticket", {"title": "z"}, "failed")
    restored = EffectLedger.restore(json.loads(json.dumps(ledger.snapshot())),
                                    json.loads(json.dumps(ledger.lines)))
    assert restored.snapshot() == ledger.snapshot() and restored.lines == ledger.lines
    assert _send(restored.plan("create_ticket", {"title": "z"}, dedupes_keys=False)).key \
        .endswith(".1")
    assert _send(restored.plan("create_ticket", {"title": "x"}, dedupes_keys=False)).key \
        .endswith(".2")
    assert isinstance(restored.plan("create_ticket", {"title": "y"}, dedupes_keys=False),
                      Refuse)


def test_the_snapshot_stays_small_and_each_outcome_is_one_line() -> None:
    """What grows with the turn is in `lines`, one per outcome recorded, never
    rewritten: the snapshot names the turn and nothing else."""
    ledger = EffectLedger("t1")
    for n in range(50):
        ledger.record("create_ticket", {"title": str(n)}, "ok")
    ledger.record("create_ticket", {"title": "0"}, "unknown")
    assert ledger.snapshot() == {"turn": "t1"}
    assert len(ledger.lines) == 51 and ledger.lines[-1].startswith("u")
    first = list(ledger.lines[:10])
    ledger.record("create_ticket", {"title": "0"}, "ok")
    assert ledger.lines[:10] == first


def test_a_snapshot_from_before_the_lines_restores_the_same_ledger() -> None:
    """A checkpoint written before the trail existed held the actions themselves: the
    restored ledger plans the same keys, and holds them as lines for its next save."""
    ledger = EffectLedger("t1")
    ledger.record("create_ticket", {"title": "x"}, "ok")
    ledger.record("create_ticket", {"title": "x"}, "ok")
    ledger.record("create_ticket", {"title": "y"}, "unknown")
    ledger.record("create_ticket", {"title": "z"}, "ok")
    ledger.record("create_ticket", {"title": "z"}, "unknown")
    older = {"turn": "t1", "actions": {
        action_key("create_ticket", {"title": t}): [ordinal, unknown]
        for t, ordinal, unknown in (("x", 3, False), ("y", 1, True), ("z", 2, True))}}
    restored = EffectLedger.restore(older)
    for title in ("x", "y", "z"):
        for dedupes in (False, True):
            assert restored.plan("create_ticket", {"title": title}, dedupes_keys=dedupes) \
                == ledger.plan("create_ticket", {"title": title}, dedupes_keys=dedupes)
    assert sorted(restored.lines) == sorted(ledger.lines)


def test_a_line_that_is_not_the_ledgers_is_refused() -> None:
    with pytest.raises(ValueError, match="not an effect ledger line"):
        EffectLedger.restore({"turn": "t1"}, ["x123"])


def test_repr_names_turn_and_open_unknowns() -> None:
    ledger = EffectLedger("t1")
    ledger.record("create_ticket", {"title": "y"}, "unknown")
    assert repr(ledger) == "EffectLedger(turn='t1', actions=1, unknown=1)"
