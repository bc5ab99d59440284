from __future__ import annotations

import pytest

# Tests that run real daemons, servers, subprocesses and signals on a shared 2-core machine.
REAL_WORLD = ("tests/integration/", "tests/providers/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A real-world test that fails is run again, up to twice, and pytest reports each
    rerun (`R`, and the `-rR` summary), so a flaky test stays visible instead of failing a
    whole run on a busy machine. Unit tests are deterministic and get no second chance."""
    for item in items:
        if item.nodeid.startswith(REAL_WORLD) and not item.get_closest_marker("flaky"):
            item.add_marker(pytest.mark.flaky(reruns=2, reruns_delay=1))
