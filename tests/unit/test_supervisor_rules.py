"""The supervisor applies decisions; it does not make them. A config limit compared in
its code is a rule that escaped `policy/` (where each limit is compared in one place)."""

from __future__ import annotations

import ast
from pathlib import Path

import turnkeeper.supervisor

PACKAGE = Path(turnkeeper.supervisor.__file__).parent


def _mentions_config(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Attribute) and n.attr in ("config", "daemon", "budget"))
               or (isinstance(n, ast.Name) and n.id in ("cfg", "config"))
               for n in ast.walk(node))


def test_no_supervisor_module_compares_a_config_value() -> None:
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(
                    isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) for op in node.ops) \
                    and _mentions_config(node):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "limits compared outside policy/:\n" + "\n".join(found)


def test_every_supervisor_module_is_small() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert max(sizes.values()) <= 400, sizes
