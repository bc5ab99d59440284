"""The package's rooms keep their one-way order, and a config limit is compared only in
`policy/`. Both rules are read from the source (AST): no module of the daemon is imported
to check them, so a broken module cannot hide a violation.

The layer table below is the same order docs/architecture.md draws: a room may import
only the rooms listed for it. A module that belongs to no room is a violation too, so a
new module has to be placed in the table on purpose, and given its line in the module map
of docs/architecture.md, in the same room (a test reads the map).

Imports under ``if TYPE_CHECKING:`` are skipped: they never run, so they add no runtime
dependency (a type annotation may name a class of a room above).
"""

from __future__ import annotations

import ast
import inspect
import itertools
import re
from pathlib import Path

import pydantic
import pytest

import turnkeeper
import turnkeeper.config

PACKAGE_DIR = Path(turnkeeper.__file__).parent

# Which room each module belongs to: the longest matching prefix of its dotted name
# (relative to the package) wins, so `control.client` is not `control`.
ROOM_OF: dict[str, str] = {
    "": "kit",  # the package itself: __version__
    "errors": "base", "exits": "base", "values": "base",
    "clock": "kit", "paths": "kit", "logging": "kit", "jsonwire": "kit", "durations": "kit",
    "messages": "messages", "event_types": "messages",
    "policy": "policy",
    "config": "config", "settings": "config",
    "events": "events",
    "store": "store",
    "providers": "providers",
    "tools": "tools",
    "runtime": "runtime", "concurrency": "runtime", "tracing": "runtime", "otel": "runtime",
    "tracecontext": "kit",
    "turn": "turn",
    "lifecycle": "lifecycle",
    "supervisor": "supervisor",
    "metrics": "metrics", "metrics_state": "metrics",
    "control": "control",
    "control.client": "client",
    "client": "client",
    "daemon": "daemon",
    "cli": "cli", "__main__": "cli",
}

# Room -> the rooms it may import (itself included where a room has several modules).
_BELOW_TURN = {"base", "kit", "messages", "policy", "config", "events", "store",
               "providers", "tools", "runtime"}
MAY_IMPORT: dict[str, frozenset[str]] = {
    "base": frozenset({"base"}),
    "kit": frozenset({"base", "kit"}),
    "messages": frozenset({"base", "messages"}),
    "policy": frozenset({"base", "policy"}),
    "config": frozenset({"base", "kit", "policy", "config"}),
    "events": frozenset({"base", "kit", "messages", "events"}),
    "store": frozenset({"base", "kit", "messages", "policy", "config", "events", "store"}),
    "providers": frozenset({"base", "kit", "messages", "policy", "config", "providers"}),
    "tools": frozenset({"base", "kit", "messages", "policy", "config", "tools"}),
    "runtime": frozenset({"base", "kit", "messages", "policy", "config", "providers",
                          "tools", "runtime"}),
    "turn": frozenset(_BELOW_TURN | {"turn"}),
    "lifecycle": frozenset({"base", "kit", "config", "lifecycle"}),
    "supervisor": frozenset(_BELOW_TURN | {"turn", "lifecycle", "supervisor"}),
    "metrics": frozenset(_BELOW_TURN | {"turn", "lifecycle", "supervisor", "metrics"}),
    "control": frozenset(_BELOW_TURN | {"turn", "lifecycle", "supervisor", "metrics",
                                        "control"}),
    "client": frozenset({"base", "kit", "client"}),
    "daemon": frozenset(_BELOW_TURN | {"turn", "lifecycle", "supervisor", "metrics",
                                       "control", "client"}),
    "cli": frozenset(_BELOW_TURN | {"turn", "lifecycle", "supervisor", "metrics",
                                    "control", "client", "daemon", "cli"}),
}

# The CLI must start fast: at module level the `cli` package and `follow.py` import only
# these (and each other); anything heavier (the daemon for `serve`, the config for
# `config check`, rich for `follow`) is imported inside the function that needs it.
LIGHT_FOR_CLI = frozenset({"", "errors", "exits", "paths", "durations", "control.client",
                           "policy.turn_state", "event_types"})
CLI_MODULES = frozenset({"cli"})


def _in_cli(module: str) -> bool:
    return module in CLI_MODULES or module.startswith("cli.")


def room_of(module: str) -> str | None:
    """The room of `module` (dotted, relative to the package), or None if it has none."""
    parts = module.split(".") if module else []
    for n in range(len(parts), -1, -1):
        room = ROOM_OF.get(".".join(parts[:n]))
        if room is not None and (n > 0 or not parts):
            return room
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _own(name: str) -> str | None:
    """`turnkeeper.x.y` -> `x.y`; `turnkeeper` -> ``; anything else -> None."""
    if name == "turnkeeper":
        return ""
    if name.startswith("turnkeeper."):
        return name[len("turnkeeper."):]
    return None


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The own modules (relative to the package) a `from ... import ...` may load."""
    if node.level == 0:
        base = _own(node.module or "")
        if base is None:
            return []
    else:
        here = ["turnkeeper", *module.split(".")] if module else ["turnkeeper"]
        if not is_package:
            here = here[:-1]
        here = here[: len(here) - (node.level - 1)]
        own = _own(".".join(here + ([node.module] if node.module else [])))
        if own is None:
            return []
        base = own
    # `from turnkeeper import exits` or `from . import x` names submodules: those are what
    # the import depends on. `from turnkeeper import __version__` depends on the package.
    subs = []
    for alias in node.names:
        sub = f"{base}.{alias.name}" if base else alias.name
        path = PACKAGE_DIR.joinpath(*sub.split("."))
        if path.is_dir() or path.with_suffix(".py").exists():
            subs.append(sub)
    return subs if len(subs) == len(node.names) else [base, *subs]


def own_imports(source: str, module: str, is_package: bool = False, *,
                type_checking: bool = False) -> list[tuple[str, bool]]:
    """(imported own module, at module level) for every import that runs; with
    `type_checking`, those under `if TYPE_CHECKING:` too (a dependency all the same)."""
    tree = ast.parse(source)
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                own = _own(alias.name)
                if own is not None:
                    found.append((own, top))
        elif isinstance(node, ast.ImportFrom):
            found.extend((name, top) for name in _resolve(node, module, is_package))
        elif (isinstance(node, ast.If) and _is_type_checking(node.test)
              and not type_checking):
            for stmt in node.orelse:
                visit(stmt, top)
            return
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                               ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, True)
    return found


def layer_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every import of `module` against the layer table, as readable lines."""
    room = room_of(module)
    if room is None:
        return [f"{module or 'turnkeeper'} belongs to no room of the layer table"]
    out = []
    for imported, top in own_imports(source, module, is_package):
        target = room_of(imported)
        if target is None:
            # `from turnkeeper import __version__` names a symbol, not a module.
            continue
        if target not in MAY_IMPORT[room]:
            out.append(f"{module} ({room}) imports {imported} ({target})")
        elif (_in_cli(module) and top and imported not in LIGHT_FOR_CLI
              and not _in_cli(imported)):
            out.append(f"{module} imports {imported} at module level; the CLI must stay light")
    return out


def _modules() -> list[tuple[str, Path, bool]]:
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR).with_suffix("")
        is_package = rel.name == "__init__"
        parts = rel.parts[:-1] if is_package else rel.parts
        found.append((".".join(parts), path, is_package))
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other in a loop (Tarjan's strongly
    connected components of more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def module_graph() -> dict[str, set[str]]:
    """Module -> the own modules it imports, anywhere in it, `TYPE_CHECKING` included."""
    return {module: {imported for imported, _ in own_imports(
                path.read_text(), module, is_package, type_checking=True)
                     if imported != module}
            for module, path, is_package in _modules()}


def test_no_modules_import_each_other_in_a_circle() -> None:
    """Inside a room too: rooms that call each other are handed their collaborators,
    never reach them through a shared object that imports them all."""
    circles = import_circles(module_graph())
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_circle_and_only_that() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert import_circles(graph) == [["a", "b", "c"], ["e"]]


def test_every_room_of_the_table_may_import_only_rooms_of_the_table() -> None:
    rooms = set(MAY_IMPORT)
    assert set(ROOM_OF.values()) <= rooms
    assert all(allowed <= rooms for allowed in MAY_IMPORT.values())


def test_the_layer_table_is_the_one_the_architecture_page_describes() -> None:
    page = PACKAGE_DIR.parents[1] / "docs" / "architecture.md"
    if not page.exists():  # an installed package without its docs
        pytest.skip("docs/architecture.md is not beside the package")
    text = page.read_text(encoding="utf-8")
    table = text[text.index("| room | may import |"):]
    rows = itertools.takewhile(lambda line: line.startswith("|"), table.splitlines()[2:])
    rooms = {row.split("|")[1].strip() for row in rows}
    assert rooms == set(MAY_IMPORT)


def test_no_module_imports_against_the_layer_order() -> None:
    found = [v for module, path, is_package in _modules()
             for v in layer_violations(path.read_text(encoding="utf-8"), module, is_package)]
    assert found == []


def test_the_layer_checker_catches_an_upward_import() -> None:
    source = ("from turnkeeper.supervisor import Supervisor\n"
              "from ..tools import registry\n"
              "from turnkeeper.errors import TurnkeeperError\n"
              "if TYPE_CHECKING:\n    from turnkeeper.control.routes import x\n")
    assert layer_violations(source, "providers.openai") == [
        "providers.openai (providers) imports supervisor (supervisor)",
        "providers.openai (providers) imports tools.registry (tools)",
    ]
    assert layer_violations("import turnkeeper.cli\n", "turn.runner") == [
        "turn.runner (turn) imports cli (cli)"]
    assert layer_violations("", "gadgets") == ["gadgets belongs to no room of the layer table"]


def test_the_layer_checker_keeps_the_cli_light_at_module_level() -> None:
    source = ("from turnkeeper.control.client import Client\n"
              "from turnkeeper.config import load_config\n"
              "def serve():\n    from turnkeeper.daemon import serve\n")
    assert layer_violations(source, "cli") == [
        "cli imports config at module level; the CLI must stay light"]


# --- a config limit is compared in one place: policy/ -------------------------------------

# A field of the config models is a limit when its name says so: a maximum or minimum, a
# threshold, a timeout, a number of cycles or probes allowed. (The failure-loop streak
# limits are called `retryable`, `deterministic` and `unknown`: names too common to tell
# apart from a failure class in an AST, so they are left out.)
_LIMIT_NAME = re.compile(r"(^|_)(max|min)_|_max$|(^|_)timeout$|_threshold$|_limit$"
                         r"|_cycles$|_probes$|^max_|_max_")
ROOMS_THAT_MAY_NOT_COMPARE = ("turn", "supervisor", "control")


def limit_fields() -> frozenset[str]:
    """The names of the limit fields of every pydantic model in `turnkeeper.config`."""
    names = set()
    for obj in vars(turnkeeper.config).values():
        if (inspect.isclass(obj) and issubclass(obj, pydantic.BaseModel)
                and obj.__module__.startswith(turnkeeper.config.__name__)):
            names.update(name for name in obj.model_fields if _LIMIT_NAME.search(name))
    return frozenset(names)


_ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of one scope: a function's body without the functions nested in it."""
    found: list[ast.AST] = []
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        found.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return found


def limit_comparisons(source: str, filename: str, fields: frozenset[str]) -> list[str]:
    """`file:line: <expr>` for every ordering comparison that has `<something>.<limit>`
    among its operands, or a plain name its function bound to one (`limit =
    cfg.agent.max_restarts` then `if restarts > limit:` is the same rule, renamed)."""
    tree = ast.parse(source)
    scopes: list[ast.AST] = [tree, *(node for node in ast.walk(tree) if isinstance(
        node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))]
    out = []
    for scope in scopes:
        nodes = list(_own_nodes(scope))
        aliases = {target.id
                   for node in nodes if isinstance(node, ast.Assign)
                   and isinstance(node.value, ast.Attribute) and node.value.attr in fields
                   for target in node.targets if isinstance(target, ast.Name)}

        def is_limit(operand: ast.expr, aliases: set[str] = aliases) -> bool:
            return ((isinstance(operand, ast.Attribute) and operand.attr in fields)
                    or (isinstance(operand, ast.Name) and operand.id in aliases))

        for node in nodes:
            if not isinstance(node, ast.Compare):
                continue
            if not any(isinstance(op, _ORDERING) for op in node.ops):
                continue
            if any(is_limit(o) for o in [node.left, *node.comparators]):
                out.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return sorted(out, key=lambda hit: int(hit.split(":")[1]))


def _files_that_may_not_compare() -> list[Path]:
    files = []
    for room in ROOMS_THAT_MAY_NOT_COMPARE:
        single = PACKAGE_DIR / f"{room}.py"
        if single.exists():
            files.append(single)
        if (PACKAGE_DIR / room).is_dir():
            files.extend(sorted((PACKAGE_DIR / room).rglob("*.py")))
    return files


def test_the_limit_fields_are_read_from_the_config_models() -> None:
    fields = limit_fields()
    assert {"max_steps", "max_tokens", "max_restarts", "failure_threshold", "timeout",
            "max_concurrent_turns", "max_queued_turns", "drain_timeout"} <= fields
    assert not {"base_delay", "jitter", "ratio", "mode", "name"} & fields


def test_turn_supervisor_and_control_compare_no_config_limit() -> None:
    fields = limit_fields()
    found = [hit for path in _files_that_may_not_compare()
             for hit in limit_comparisons(path.read_text(encoding="utf-8"),
                                          str(path.relative_to(PACKAGE_DIR)), fields)]
    assert found == []


def test_the_limit_checker_catches_a_planted_comparison() -> None:
    source = ("def f(x, cfg, step):\n"
              "    if x >= cfg.agent.max_restarts:\n        return 1\n"
              "    if cfg.budget.max_steps < step:\n        return 2\n"
              "    if x == cfg.agent.max_restarts:\n        return 3\n"
              "    if x >= cfg.retry.base_delay:\n        return 4\n"
              "    limit = cfg.daemon.max_queued_turns\n"
              "    if len(q) > limit:\n        return 5\n")
    assert limit_comparisons(source, "turn/runner.py", limit_fields()) == [
        "turn/runner.py:2: x >= cfg.agent.max_restarts",
        "turn/runner.py:4: cfg.budget.max_steps < step",
        "turn/runner.py:11: len(q) > limit",
    ]


# --- every module is on the map -----------------------------------------------------------

def map_rows(page: str) -> list[tuple[str, list[str]]]:
    """(room, module paths) for each row of the module map of docs/architecture.md. A row
    with no room is in the room above it. In a modules cell a path names its directory
    once; the bare names after it are in that directory (`policy/backoff.py`,
    `retry_budget.py` is `policy/retry_budget.py`) until another path names another."""
    table = page[page.index("| room | modules | what lives there |"):]
    rows = itertools.takewhile(lambda line: line.startswith("|"), table.splitlines()[2:])
    out: list[tuple[str, list[str]]] = []
    room = ""
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        room = cells[0] or room
        folder, modules = "", []
        for name in re.findall(r"`([^`]+\.py)`", cells[1]):
            if "/" in name:
                folder, _, name = name.rpartition("/")
                folder += "/"
            modules.append(folder + name)
        out.append((room, modules))
    return out


def map_problems(page: str, modules: list[str]) -> list[str]:
    """What is wrong with the map for `modules` (paths relative to the package): a
    module missing, named twice, or in a room other than the layer table's."""
    on_map: dict[str, str] = {}
    problems = []
    for room, paths in map_rows(page):
        for path in paths:
            if path in on_map:
                problems.append(f"{path} is on the map twice")
            on_map[path] = room
    for path in modules:
        dotted = path.removesuffix(".py").removesuffix("__init__").rstrip("/")
        dotted = dotted.replace("/", ".")
        if path not in on_map:
            problems.append(f"{path} is missing from the module map of docs/architecture.md"
                            f" (a line in the {room_of(dotted)} room)")
        elif on_map[path] != room_of(dotted):
            problems.append(f"{path} is on the map in {on_map[path]}, "
                            f"but ROOM_OF puts it in {room_of(dotted)}")
    problems += [f"{path} is on the map but not in the package"
                 for path in sorted(set(on_map) - set(modules))]
    return problems


def test_every_module_is_on_the_module_map_in_its_room() -> None:
    page = PACKAGE_DIR.parents[1] / "docs" / "architecture.md"
    if not page.exists():  # an installed package without its docs
        pytest.skip("docs/architecture.md is not beside the package")
    modules = [str(path.relative_to(PACKAGE_DIR)) for _, path, _ in _modules()]
    assert map_problems(page.read_text(encoding="utf-8"), modules) == []


def test_the_map_checker_catches_a_missing_a_misplaced_and_a_stale_module() -> None:
    page = ("| room | modules | what lives there |\n|---|---|---|\n"
            "| policy | `policy/backoff.py`, `breaker.py` | rules |\n"
            "| | `runtime.py` | a runtime misplaced |\n"
            "| config | `config/__init__.py`, `gone.py` | models |\n")
    assert map_problems(page, ["policy/backoff.py", "policy/breaker.py", "policy/chain.py",
                               "runtime.py", "config/__init__.py"]) == [
        "policy/chain.py is missing from the module map of docs/architecture.md"
        " (a line in the policy room)",
        "runtime.py is on the map in policy, but ROOM_OF puts it in runtime",
        "config/gone.py is on the map but not in the package",
    ]
