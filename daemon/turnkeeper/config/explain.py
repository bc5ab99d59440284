"""What a config error says beyond pydantic's words: the line of the file it is on, the
key or value it was probably meant to be ("did you mean"), and a provider or tool named
by its `name` rather than its place in the list.

TOML parsers keep no positions, so the lines are found again in the file's text: every
table header and `key =` line is numbered under the table it belongs to. A key written
inline (`x = { a = 1 }`) or dotted is found as the line of its table or outer key, which
is still where to look.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError

from turnkeeper.config.env import ENV_PREFIX, env_names

Loc = tuple[str | int, ...]

_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"""^\s*("[^"]*"|'[^']*'|[A-Za-z0-9_-]+)\s*[.=]""")


def _name(part: str) -> str:
    part = part.strip()
    return part[1:-1] if part[:1] in "\"'" and part[-1:] == part[:1] else part


def key_lines(text: str) -> dict[Loc, int]:
    """Every table and key of a TOML text, by its place in the parsed data (an array of
    tables by index: `("providers", 1, "kind")`), with its line number (from 1)."""
    out: dict[Loc, int] = {}
    counts: dict[tuple[str, ...], int] = {}
    table: Loc = ()
    depth = 0  # inside a value spread over several lines ([ ... ] or { ... })
    for number, line in enumerate(text.splitlines(), 1):
        if depth:
            depth = max(0, depth + line.count("[") + line.count("{")
                        - line.count("]") - line.count("}"))
            continue
        m = _HEADER.match(line)
        if m:
            names = tuple(_name(p) for p in m.group(2).split("."))
            if m.group(1) == "[[":
                index = counts.get(names, 0)
                counts[names] = index + 1
                table = (*names, index)
            else:
                table = names
            out.setdefault(table, number)
            continue
        k = _KEY.match(line)
        if k:
            out.setdefault((*table, _name(k.group(1))), number)
            value = line.split("=", 1)[1] if "=" in line else ""
            depth = max(0, value.count("[") + value.count("{")
                        - value.count("]") - value.count("}"))
    return out


def line_of(lines: Mapping[Loc, int], loc: Sequence[str | int]) -> int | None:
    """The line of `loc`, or of the nearest table or key holding it."""
    for end in range(len(loc), 0, -1):
        found = lines.get(tuple(loc[:end]))
        if found is not None:
            return found
    return None


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    import difflib  # here: only a mistake needs it

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def expected_values(expected: str) -> list[str]:
    """The values pydantic lists in a literal error: `'a', 'b' or 'c'`."""
    return re.findall(r"'([^']*)'", expected)


def named_loc(loc: Sequence[str | int], data: Mapping[str, Any]) -> str:
    """`providers.primary.kind` for `("providers", 0, "kind")` when the first provider is
    named primary: a name is what the operator wrote and searches for; the index stays
    when the item has no name."""
    parts: list[str] = []
    node: Any = data
    for part in loc:
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            item = node[part]
            name = item.get("name") if isinstance(item, dict) else None
            parts.append(name if isinstance(name, str) and name else str(part))
            node = item
            continue
        parts.append(str(part))
        node = node.get(part) if isinstance(node, dict) else None
    return ".".join(parts) or "(top level)"


def _model_at(root: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The config model that holds the key at `loc` (its last part), or None."""
    model: Any = root
    item_key = False  # the next part is a list index or a dict key, not a field
    for part in loc[:-1]:
        if item_key or isinstance(part, int):
            item_key = False
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = field.annotation
        origin = get_origin(model)
        if origin in (tuple, list, dict):
            item_key = True
            model = [a for a in get_args(model) if a is not Ellipsis][-1]
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _hint(root: type[BaseModel], e: Any) -> str:
    """` (did you mean X?)` for an unknown key or a misspelt value, or ""."""
    loc = e["loc"]
    if e["type"] == "extra_forbidden" and loc and isinstance(loc[-1], str):
        model = _model_at(root, loc)
        close = did_you_mean(loc[-1], model.model_fields if model else ())
    elif e["type"] == "literal_error" and isinstance(e.get("input"), str):
        close = did_you_mean(e["input"], expected_values(
            str((e.get("ctx") or {}).get("expected", ""))))
    else:
        return ""
    return f" (did you mean {close}?)" if close else ""


def format_errors(err: ValidationError, source: str, root: type[BaseModel],
                  data: Mapping[str, Any] | None = None, text: str | None = None) -> str:
    """A validation error of the config as an operator reads it: each key by its name
    (a provider or tool by `name`), at its line in the file, with "did you mean" for a
    misspelt key or value, or blamed on the environment variable that set it."""
    lines = [f"invalid configuration ({source}):"]
    env = env_names()
    where = key_lines(text) if text is not None else {}
    for e in err.errors():
        loc = named_loc(e["loc"], data or {})
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        msg += _hint(root, e)
        var = ENV_PREFIX + "__".join(str(p) for p in e["loc"]).upper()
        if var in env:  # the environment overrides the file: blame the variable
            msg += f" (from the environment variable {env[var]})"
        else:
            line = line_of(where, e["loc"])
            if line is not None:
                loc = f"line {line}: {loc}"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)
