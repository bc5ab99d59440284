"""`turnkeeper.policy` is pure: no I/O, no clock, no randomness, no logging, and nothing of
the daemon above it. Every module of the package is parsed and its imports checked.

An import of another turnkeeper module under ``if TYPE_CHECKING:`` is allowed: it is never
executed, so it adds no runtime dependency (a Protocol is still the better shape). The
forbidden standard-library and I/O modules are forbidden there too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import turnkeeper.policy

FORBIDDEN = frozenset({"anyio", "aiohttp", "sqlite3", "time", "random", "logging", "asyncio"})
PACKAGE = "turnkeeper.policy"
POLICY_DIR = Path(turnkeeper.policy.__file__).parent
# The bottom of the house: the base exception, the exit codes and the value classes'
# decorator import nothing else.
BELOW_POLICY = frozenset({"turnkeeper.errors", "turnkeeper.exits", "turnkeeper.values"})


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _resolve(node: ast.ImportFrom) -> list[str]:
    """Absolute module names of a `from ... import ...` in a module of PACKAGE."""
    if node.level == 0:
        base = node.module or ""
    else:
        parts = PACKAGE.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        if not parts:
            return ["." * node.level + (node.module or "")]
        base = ".".join(parts + ([node.module] if node.module else []))
    names = [base]
    if node.module is None or node.level:  # `from . import x` may name modules
        names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def imported_modules(path: Path) -> list[tuple[str, bool]]:
    """(module, type_only) for every import of `path`, relative imports resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, type_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.extend((name, type_only) for name in _resolve(node))
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                visit(stmt, True)
            for stmt in node.orelse:
                visit(stmt, type_only)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    return found


def violations(path: Path) -> list[str]:
    out = []
    for name, type_only in imported_modules(path):
        root = name.split(".")[0]
        if root in FORBIDDEN:
            out.append(f"{path.name} imports {name}")
        elif root == "" or name.startswith("."):
            out.append(f"{path.name} has a relative import above the package: {name}")
        elif (root == "turnkeeper" and not type_only and name not in BELOW_POLICY
              and not (name == PACKAGE or name.startswith(PACKAGE + "."))):
            out.append(f"{path.name} imports {name}, outside {PACKAGE}")
    return out


def test_the_policy_package_has_modules_to_check() -> None:
    names = {p.name for p in POLICY_DIR.glob("*.py")}
    assert {"__init__.py", "classify.py", "outcome.py", "backoff.py", "breaker.py",
            "retry_budget.py", "chain.py"} <= names


def test_policy_modules_import_no_io_clock_randomness_or_daemon_layers() -> None:
    found = [v for path in sorted(POLICY_DIR.rglob("*.py")) for v in violations(path)]
    assert found == []


def test_the_checker_catches_forbidden_imports(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom random import uniform\nimport asyncio.tasks\n"
                   "from turnkeeper.config import PolicyVersion\nfrom .. import config\n"
                   "from ..store import base\nfrom . import classify\n"
                   "from .outcome import Stop\nimport re\n"
                   "def f():\n    import logging\n"
                   "if TYPE_CHECKING:\n    from turnkeeper.config import RetryConfig\n"
                   "    import sqlite3\n")
    assert violations(bad) == [
        "bad.py imports time",
        "bad.py imports random",
        "bad.py imports asyncio.tasks",
        "bad.py imports turnkeeper.config, outside turnkeeper.policy",
        "bad.py imports turnkeeper, outside turnkeeper.policy",
        "bad.py imports turnkeeper.config, outside turnkeeper.policy",
        "bad.py imports turnkeeper.store, outside turnkeeper.policy",
        "bad.py imports turnkeeper.store.base, outside turnkeeper.policy",
        "bad.py imports logging",
        "bad.py imports sqlite3",
    ]
