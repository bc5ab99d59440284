"""`value_class`: a frozen dataclass for the type checker, a plain slotted one at run
time that compares, hashes, prints and is replaced as the frozen one did."""

from __future__ import annotations

import dataclasses

from turnkeeper.messages import Message, ToolCall
from turnkeeper.values import value_class


@value_class
class Pair:
    a: int
    b: tuple[str, ...] = ()
    note: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenPair:
    a: int
    b: tuple[str, ...] = ()
    note: str = dataclasses.field(default="", compare=False)


def test_a_value_hashes_and_compares_as_the_frozen_dataclass_did() -> None:
    for args in ((1,), (2, ("x", "y")), (3, (), "ignored")):
        assert hash(Pair(*args)) == hash(FrozenPair(*args))
        assert Pair(*args) == Pair(*args)
    assert Pair(1, note="a") == Pair(1, note="b")  # a field left out of the comparison
    assert Pair(1) != Pair(2)
    assert len({Pair(1), Pair(1, note="other"), Pair(2)}) == 2


def test_a_value_keeps_slots_repr_match_args_and_replace() -> None:
    p = Pair(1, ("x",))
    assert not hasattr(p, "__dict__")
    assert repr(p) == "Pair(a=1, b=('x',), note='')"
    assert Pair.__match_args__ == FrozenPair.__match_args__
    assert dataclasses.replace(p, a=5) == Pair(5, ("x",))
    assert [f.name for f in dataclasses.fields(Pair)] == ["a", "b", "note"]


def test_the_conversation_values_are_dict_keys_as_before() -> None:
    call = ToolCall(id="c1", name="echo", arguments="{}")
    msg = Message("assistant", None, (call,))
    assert {msg: 1}[Message("assistant", None, (ToolCall("c1", "echo", "{}"),))] == 1
