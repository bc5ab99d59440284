"""The effective config written back as TOML (`turnkeeper config show -o toml`), so that
what the daemon runs with can be pasted into a file and read again as it is.

The standard library reads TOML but does not write it; the config's shape is small and
known (sections, sub-tables, arrays of tables, plain values), so a few lines do it.
A value TOML has no form for (None) is left out: the key then takes its default, which
is what None stands for in these models.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(name: str) -> str:
    return name if _BARE.match(name) else json.dumps(name, ensure_ascii=False)


def _value(v: Any) -> str:
    """A value on one line: strings, numbers, booleans, arrays and inline tables."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        inner = ", ".join(f"{_key(str(k))} = {_value(x)}" for k, x in v.items()
                          if x is not None)
        return "{" + (f" {inner} " if inner else "") + "}"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and bool(v) and all(isinstance(x, dict) for x in v)


def _table(path: list[str], data: dict[str, Any], out: list[str], *,
           header: str | None) -> None:
    """One table: its plain keys under `header`, then its sub-tables, then its arrays of
    tables (TOML wants a table's own keys before any header that follows)."""
    plain = [(k, v) for k, v in data.items() if v is not None and not isinstance(v, dict)
             and not _is_table_array(v)]
    subs = [(k, v) for k, v in data.items() if isinstance(v, dict)]
    arrays = [(k, v) for k, v in data.items() if _is_table_array(v)]
    if header is not None and (plain or not (subs or arrays)):
        out.append(header)
    out.extend(f"{_key(k)} = {_value(v)}" for k, v in plain)
    for k, v in subs:
        sub_path = [*path, _key(str(k))]
        if out and out[-1] != "":
            out.append("")
        _table(sub_path, v, out, header=f"[{'.'.join(sub_path)}]")
    for k, items in arrays:
        item_path = ".".join([*path, _key(str(k))])
        for item in items:
            if out and out[-1] != "":
                out.append("")
            out.append(f"[[{item_path}]]")
            # Inside an array's item, nested tables are written inline: one line each.
            out.extend(f"{_key(str(ik))} = {_value(iv)}" for ik, iv in item.items()
                       if iv is not None)


def to_toml(data: dict[str, Any]) -> str:
    """`data` (JSON-like: dicts, lists, strings, numbers, booleans, None) as TOML."""
    out: list[str] = []
    _table([], data, out, header=None)
    return "\n".join(out).strip("\n") + "\n"
