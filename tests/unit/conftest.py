"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from tests.pg import fresh_database


@pytest.fixture
async def db() -> AsyncIterator[str]:
    """The URL of a fresh database on the PostgreSQL server (its tests are marked
    `postgres` by tests/conftest.py)."""
    async with fresh_database() as url:
        yield url
