from __future__ import annotations

import sys
from typing import Any

import pytest

# Tests that run real daemons, servers, subprocesses and signals on a shared 2-core machine.
REAL_WORLD = ("tests/integration/", "tests/providers/")

# What tests/pg.py gives a test: a fresh database, or a store or proxy on one.
POSTGRES_HELPERS = frozenset({"create_database", "fresh_database", "FreshPostgresStore",
                              "CuttableProxy"})


def _calls_postgres(func: Any) -> bool:
    """Whether a fixture or test function names a helper of tests/pg.py it imported."""
    code = getattr(func, "__code__", None)
    scope = getattr(func, "__globals__", {})
    return code is not None and any(
        name in POSTGRES_HELPERS and getattr(scope.get(name), "__module__", "") == "tests.pg"
        for name in code.co_names)


def uses_postgres(item: pytest.Item) -> bool:
    """A test needs the PostgreSQL server when it, or a fixture it uses (however deep),
    makes a database with tests/pg.py, or when it runs parametrized on the `postgres`
    backend. A parametrized fixture is decided by the test's parameter, not its code."""
    spec = getattr(item, "callspec", None)
    if spec is not None and "postgres" in spec.params.values():
        return True
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return (_calls_postgres(getattr(item, "function", None))
            or any(_calls_postgres(d.func) for chain in defs for d in chain
                   if not d.params))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A real-world test that fails is run again, up to twice, and pytest reports each
    rerun (`R`, and the `-rR` summary), so a flaky test stays visible instead of failing a
    whole run on a busy machine. Unit tests are deterministic and get no second chance.

    Every test that needs the PostgreSQL server is marked `postgres`, so `-m "not
    postgres"` leaves them out; tests/pg.py fails a test that reaches the server without
    the mark (a way in that `uses_postgres` does not see: mark that test by hand)."""
    marked = set()
    for item in items:
        if item.nodeid.startswith(REAL_WORLD) and not item.get_closest_marker("flaky"):
            item.add_marker(pytest.mark.flaky(reruns=2, reruns_delay=1))
        if not item.get_closest_marker("postgres") and uses_postgres(item):
            item.add_marker(pytest.mark.postgres)
        if item.get_closest_marker("postgres"):
            marked.add(item.nodeid)
    pg = sys.modules.get("tests.pg")
    if pg is not None:
        pg.MARKED_POSTGRES = frozenset(marked)  # type: ignore[attr-defined]
