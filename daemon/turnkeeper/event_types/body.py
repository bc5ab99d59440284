"""What every event body shares: the envelope's keys, the wire JSON in and out.

Readers must survive another daemon version: `from_json` keeps fields it does not know
in `extra` (and `to_json` writes them back), and the package's `parse` answers None for
a type it does not know, so the caller shows it generically instead of crashing. Two
wire names are Python keywords (`class`, `from`): their attributes are `class_` and
`from_`, and the JSON keeps the wire names.

An event is treated as a value: nothing in the daemon changes one once built, by
convention, not enforcement. The classes are not frozen dataclasses because a frozen
one's `__init__` sets each field through `object.__setattr__`, twice the cost of building
a plain one, and a step builds five.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, cast

ENVELOPE = ("seq", "ts", "turn", "type")

# Attribute name -> wire name, for the fields whose wire name is a Python keyword.
_WIRE = {"class_": "class", "from_": "from"}
# Fields written only when set: `tool.result` carries a different set for each outcome.
_OPTIONAL = "optional"
OMIT_NONE = {_OPTIONAL: True}


@dataclass(slots=True, kw_only=True)
class EventBody:
    """The fields of one event, without its envelope. Subclasses set `TYPE`."""

    TYPE = ""
    # Fields a newer sender wrote that this version does not know (None: there were none).
    extra: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The wire fields (without `type`), unknown ones kept from `from_json` last."""
        cls = type(self)
        writer = _TO_JSON.get(cls)
        if writer is None:
            writer = _TO_JSON[cls] = _to_json_of(cls)
        return writer(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EventBody:
        """The event from its wire fields (the envelope keys are ignored). Fields this
        version does not know go to `extra`; one it expects and the sender did not write
        (an older daemon) takes its default, or None: a reader must not crash on it."""
        known: dict[str, Any] = {}
        spec = _spec(cls)
        for name, wire, _optional, required in spec:
            if wire in data:
                known[name] = data[wire]
            elif required:
                known[name] = None
        wire_names = {wire for _name, wire, _optional, _required in spec}
        extra = {k: v for k, v in data.items() if k not in wire_names and k not in ENVELOPE}
        return cls(**known, extra=extra or None)


# Per class: (attribute, wire name, written only when set, has no default), computed once;
# `dataclasses.fields()` on every event was a measurable part of a step.
_SPECS: dict[type[EventBody], tuple[tuple[str, str, bool, bool], ...]] = {}


def _spec(cls: type[EventBody]) -> tuple[tuple[str, str, bool, bool], ...]:
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = tuple(
            (f.name, _WIRE.get(f.name, f.name), bool(f.metadata.get(_OPTIONAL)),
             f.default is MISSING and f.default_factory is MISSING)
            for f in fields(cls) if f.name != "extra")
    return spec


# Per class: its `to_json`, written out field by field the first time an event of the
# class is encoded. A loop over the fields with `getattr` cost 1.0 us for `tool.result`,
# the function 0.3; the CLI, which imports this module to read events, never builds one.
_TO_JSON: dict[type[EventBody], Callable[[Any], dict[str, Any]]] = {}


def _to_json_of(cls: type[EventBody]) -> Callable[[Any], dict[str, Any]]:
    """`to_json` for `cls`: the fields always written in one dict display, then each
    optional one when set, then `extra`. Its source is built from the class's own field
    names (identifiers) and wire names (written with `repr`), nothing from outside."""
    spec = _spec(cls)
    always = ", ".join(f"{wire!r}: self.{name}" for name, wire, optional, _ in spec
                       if not optional)
    lines = ["def to_json(self):", f"    out = {{{always}}}"]
    for name, wire, optional, _ in spec:
        if optional:
            lines += [f"    if self.{name} is not None:", f"        out[{wire!r}] = self.{name}"]
    lines += ["    if self.extra:", "        out.update(self.extra)", "    return out"]
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), namespace)
    return cast(Callable[[Any], dict[str, Any]], namespace["to_json"])

