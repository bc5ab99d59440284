"""Environment overrides (`TURNKEEPER_SECTION__KEY`), checked before pydantic-settings
reads them, so that a mistake in one is a config error naming the variable (exit 78)
rather than a key silently ignored or a traceback.

Two mistakes are caught here: a variable naming a section or key the config does not
have, and a list or table given in any form but JSON. pydantic-settings reads a list or
table from the environment only as JSON (`TURNKEEPER_AGENT__RECOVERY_SCHEDULE='[1, 2]'`);
`1,2` made it raise an error naming only the section, out of `Config()`, with a traceback.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ENV_PREFIX = "TURNKEEPER_"

_LISTS = (list, tuple, set, frozenset, Sequence)
_TABLES = (dict, Mapping)


def env_names() -> dict[str, str]:
    """The environment's TURNKEEPER_ variables, by upper-cased name (overrides are read
    without regard to case)."""
    return {k.upper(): k for k in os.environ if k.upper().startswith(ENV_PREFIX)}


def _did_you_mean(word: str, choices: Any, spelled: str) -> str:
    """` (did you mean X?)` with the closest choice put in `spelled` at `%s`, or ""."""
    import difflib  # here: only a mistake needs it

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {spelled % close[0].upper()}?)" if close else ""


def _unwrapped(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _shape(annotation: Any) -> str | None:
    """"list" or "table" when the environment must give this type as JSON, else None.
    A union with a plain member (`str | list[str]`) takes a plain value as it is."""
    annotation = _unwrapped(annotation)
    origin = get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        shapes = {_shape(a) for a in get_args(annotation) if a is not type(None)}
        return shapes.pop() if len(shapes) == 1 else None
    kind = origin or annotation
    if isinstance(kind, type):
        if issubclass(kind, BaseModel) or issubclass(kind, _TABLES):
            return "table"
        if issubclass(kind, _LISTS) and not issubclass(kind, str | bytes):
            return "list"
    return None


def _target(fields: Mapping[str, FieldInfo], parts: Sequence[str]) -> Any:
    """The type a variable's path of keys leads to; None when it leads nowhere known
    (`env_override_errors` reports those)."""
    field = fields.get(parts[0])
    annotation: Any = None if field is None else field.annotation
    for part in parts[1:]:
        annotation = _unwrapped(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            sub = annotation.model_fields.get(part)
            annotation = None if sub is None else sub.annotation
        elif get_origin(annotation) in (dict, Mapping):
            annotation = get_args(annotation)[1]
        else:
            return None
    return annotation


def _example(shape: str, field_default: Any, annotation: Any) -> str:
    """A value of the right form for the message: the key's own default when it is
    short, else a generic one of its type."""
    if isinstance(field_default, list | tuple | dict) and field_default:
        try:
            text = json.dumps(list(field_default) if isinstance(field_default, tuple)
                              else field_default)
        except TypeError:  # a default of models: not JSON as it is
            text = ""
        if text and len(text) <= 40:
            return text
    if shape == "table":
        return '{"name": "value"}'
    items = get_args(_unwrapped(annotation))
    if items and _unwrapped(items[0]) in (int, float):
        return "[1, 2]"
    if items and _shape(items[0]) == "table":
        return '[{"name": "value"}]'
    return '["a", "b"]'


def _default(fields: Mapping[str, FieldInfo], parts: Sequence[str]) -> Any:
    field = fields.get(parts[0])
    value: Any = None if field is None else field.get_default(call_default_factory=True)
    for part in parts[1:]:
        value = getattr(value, part, None) if isinstance(value, BaseModel) else None
    return value


def not_json_errors(fields: Mapping[str, FieldInfo]) -> list[str]:
    """Every TURNKEEPER_ variable that overrides a list or a table with a value that is
    not JSON, naming the variable and the form it takes (never the value: a table of
    headers may hold a secret)."""
    out = []
    for upper, name in sorted(env_names().items()):
        parts = upper[len(ENV_PREFIX):].lower().split("__")
        annotation = _target(fields, parts)
        shape = None if annotation is None else _shape(annotation)
        value = os.environ.get(name, "")
        if shape is None or not value:
            continue
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            problem = f"not JSON: {exc}"
        else:
            if isinstance(parsed, list if shape == "list" else dict):
                continue
            problem = f"JSON, but not a {'JSON array' if shape == 'list' else 'JSON object'}"
        where = (f"[{parts[0]}] {'.'.join(parts[1:])}" if len(parts) > 1
                 else f"[{parts[0]}]" if shape == "table" else parts[0])
        example = _example(shape, _default(fields, parts), annotation)
        out.append(f"  {name}: {where} is a {shape}, read from the environment as JSON, "
                   f"e.g. {name}='{example}' (this value is {problem})")
    return out


def env_override_errors(fields: Mapping[str, FieldInfo]) -> list[str]:
    """Every `TURNKEEPER_SECTION__KEY` variable naming a section or a key the config does
    not have, blamed on the variable; then every list or table given as anything but
    JSON. pydantic-settings reads only the names it knows, so a typo in the section
    (`TURNKEEPER_BUDGT__MAX_STEPS`) would otherwise be ignored in silence, and one in
    the key reported as if the file had it."""
    out = []
    for upper, name in sorted(env_names().items()):
        parts = upper[len(ENV_PREFIX):].lower().split("__")
        if len(parts) < 2:
            continue  # TURNKEEPER_SOCKET, TURNKEEPER_CONFIG, a whole section as JSON
        section, key, rest = parts[0], parts[1], parts[2:]
        field = fields.get(section)
        if field is None:
            tail = "__".join([key, *rest]).upper()
            out.append(f"  {name}: there is no section {section!r}" + _did_you_mean(
                section, fields, f"{ENV_PREFIX}%s__{tail}"))
            continue
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel) \
                and key not in model.model_fields:
            tail = "".join("__" + r.upper() for r in rest)
            out.append(f"  {name}: [{section}] has no key {key!r}" + _did_you_mean(
                key, model.model_fields, f"{ENV_PREFIX}{section.upper()}__%s{tail}"))
    return out + not_json_errors(fields)
