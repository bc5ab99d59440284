"""Durable state behind one interface (base.py): the embedded SQLite file by default, a
shared PostgreSQL database when `[store] url` names one."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from turnkeeper.clock import Clock
    from turnkeeper.config import Config
    from turnkeeper.store.postgres import PostgresStore
    from turnkeeper.store.sqlite import SQLiteStore

DB_NAME = "turnkeeper.sqlite3"
POSTGRES_INSTALL_HINT = ("the PostgreSQL store needs the asyncpg driver: "
                         "pip install 'turnkeeper[postgres]'")


def open_store(config: Config, state_dir: Path, *, clock: Clock | None = None
               ) -> SQLiteStore | PostgresStore:
    """The store `config` names, not opened yet: PostgreSQL for a `[store] url`, else
    the SQLite file in `state_dir`. The driver is imported only when it is used."""
    if config.store.is_postgres:
        try:
            from turnkeeper.store.postgres import PostgresStore
        except ImportError as exc:
            from turnkeeper.store.base import StoreError
            raise StoreError(f"{POSTGRES_INSTALL_HINT} ({exc})") from None
        from turnkeeper.store.fleet import default_node_id
        return PostgresStore(config.store.url, clock=clock,
                             fatal_after=config.store.fatal_after,
                             node_id=config.fleet.node_id or default_node_id(state_dir),
                             lease_s=config.fleet.lease_seconds)
    from turnkeeper.store.sqlite import SQLiteStore
    return SQLiteStore(state_dir / DB_NAME, clock=clock,
                       fatal_after_s=config.store.fatal_after)
