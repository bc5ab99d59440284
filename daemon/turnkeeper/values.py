"""`value_class`: the decorator of the small value classes a step makes many of (messages,
model requests, a turn's rows, loop-detection actions, chain decisions).

A `value_class` class is a slotted dataclass, frozen for the type checker and not at run time.
A frozen dataclass's `__init__` sets each field through `object.__setattr__` (a C call
through a slot wrapper: about 0.5k instructions a field, where a plain slot store costs
a few dozen), and a step builds about fifty such fields. The guarantee a frozen class
gave holds where it is checked: mypy (strict, the whole package) refuses an assignment to
a field of a `value` class as it refused one to a frozen dataclass, and nothing assigns
one at run time. Everything else is the frozen dataclass's: the same `__init__`,
`__eq__`, `__repr__` and `__match_args__`, and the same `__hash__` (over the compared
fields: `unsafe_hash`), so a value is still a dict key or a set member as before;
`dataclasses.replace` and `fields` work as they did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def value_class(cls: type[T]) -> type[T]:
    """`@dataclass(frozen=True, slots=True)` as the type checker sees it; at run time
    `@dataclass(slots=True, unsafe_hash=True)`: see the module."""
    return dataclass(slots=True, unsafe_hash=True)(cls)
