from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import Daemon
from tests.integration.tool_server import (  # noqa: F401 - shared fixtures
    module_tool_server,
    tool_server,
)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[Daemon]]:
    """Every daemon a test starts is put here and killed at the end, whatever happens."""
    started: list[Daemon] = []
    yield started
    for d in started:
        d.kill()


@pytest.fixture
def start(tmp_path: Path, daemons: list[Daemon]):  # type: ignore[no-untyped-def]
    def _start(config: str = "", *, wait: bool = True, name: str | None = None,
               env: dict[str, str] | None = None, socket: Path | None = None,
               pid_env: tuple[str, ...] = (), listen_fd: int | None = None,
               nofile: int | None = None) -> Daemon:
        d = Daemon(tmp_path, config, env=env, name=name or f"d{len(daemons)}", socket=socket,
                   pid_env=pid_env, listen_fd=listen_fd, nofile=nofile)
        daemons.append(d)
        return d.start(wait=wait)

    return _start

