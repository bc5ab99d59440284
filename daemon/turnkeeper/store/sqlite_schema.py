"""The SQLite store's schema, its migrations, and the checks a database passes before the
store writes to it.

A database this code must not use is left exactly as it was found: the schema version
and an integrity check come before anything is written (even the switch to WAL writes
the file's header). Migrations run in order, each in its own transaction, so a crash
during one leaves the database at the version before it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from turnkeeper.store.base import StoreError, stored_message_of

SCHEMA_VERSION = 9


def _messages_apart(conn: sqlite3.Connection) -> None:
    """Every turn's message into `turn_input`, from its record, one row at a time. Read
    here, not with `json_extract`, which ends a text at its first NUL character."""
    rows = ((turn, stored_message_of(record))
            for turn, record in conn.execute("SELECT id, record FROM turns"))
    conn.executemany("INSERT INTO turn_input (turn, message) VALUES (?, ?)",
                     ((turn, message) for turn, message in rows if message is not None))


# Migrations: index i brings the schema from version i to i + 1; a step is a statement,
# or a function of the connection for what SQL cannot do.
MIGRATIONS: tuple[tuple[str | Callable[[sqlite3.Connection], None], ...], ...] = (
    (
        """CREATE TABLE turns (
            id TEXT PRIMARY KEY,
            seq INTEGER NOT NULL UNIQUE,
            session TEXT NOT NULL,
            state TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            record TEXT NOT NULL,
            checkpoint TEXT NOT NULL DEFAULT '{}',
            replayed_by TEXT
        )""",
        "CREATE INDEX turns_state ON turns(state, seq)",
        "CREATE INDEX turns_session ON turns(session, seq)",
        """CREATE TABLE events (
            seq INTEGER PRIMARY KEY,
            turn TEXT,
            ts REAL NOT NULL,
            type TEXT NOT NULL,
            data TEXT NOT NULL
        )""",
        "CREATE INDEX events_turn ON events(turn, seq)",
        """CREATE TABLE journal (
            key TEXT PRIMARY KEY,
            turn TEXT NOT NULL,
            tool TEXT NOT NULL,
            arguments TEXT NOT NULL,
            idempotent INTEGER NOT NULL,
            outcome TEXT
        )""",
    ),
    (
        # Daemon-wide values that must survive a crash (the event numbers reserved).
        """CREATE TABLE meta (
            key TEXT PRIMARY KEY,
            value INTEGER NOT NULL
        )""",
    ),
    (
        # Retention deletes a finished turn's journal entries with it.
        "CREATE INDEX journal_turn ON journal(turn)",
    ),
    (
        # A turn's conversation, one row per message, written once (a checkpoint holds
        # their count). Clustered by turn: a turn's rows are read in one range scan.
        """CREATE TABLE messages (
            turn TEXT NOT NULL,
            idx INTEGER NOT NULL,
            data TEXT NOT NULL,
            PRIMARY KEY (turn, idx)
        ) WITHOUT ROWID""",
    ),
    (
        # A turn's trail: its partial-work lines, loop guard keys and side effects'
        # outcomes, a few kilobytes of them a row, each row written once (a checkpoint
        # holds their count).
        """CREATE TABLE trail (
            turn TEXT NOT NULL,
            idx INTEGER NOT NULL,
            data TEXT NOT NULL,
            PRIMARY KEY (turn, idx)
        ) WITHOUT ROWID""",
    ),
    (
        # A turn's message (as JSON: `stored_message`), written once when the turn is
        # inserted. The turn's row is saved with every checkpoint, a step's at least, and
        # SQLite rewrites a row whole: a long message there was written again each time.
        # (A rowid table: a message may be larger than a WITHOUT ROWID table holds well.)
        # A record written before keeps its own copy, the same text.
        """CREATE TABLE turn_input (
            turn TEXT PRIMARY KEY,
            message TEXT NOT NULL
        )""",
        _messages_apart,
    ),
    (
        # A turn's rows keyed by its number (`turns.seq`), not its id. Thousands of turns
        # write at once, so a commit adds rows at as many places in whatever is ordered
        # by turn, and writes every page it touched: keyed by an 18-character id, the
        # events' index and the messages (a table clustered by turn) spread over more
        # pages than a small integer key. An event gains its turn's number (`turn_no`),
        # and its index is on that number, or on the turn's id where it has none (an
        # event stored before, or one whose turn has no row): the events already stored
        # are not rewritten, only indexed again (a second for a million). Messages and
        # trail rows are copied into tables they are appended to, found through a unique
        # index on (number, index).
        "ALTER TABLE events ADD COLUMN turn_no INTEGER",
        "DROP INDEX events_turn",
        "CREATE INDEX events_turn_key ON events(coalesce(turn_no, turn), seq)",
        *(statement.format(table=table) for table in ("messages", "trail") for statement in (
            "CREATE TABLE {table}_by_no (turn_no INTEGER NOT NULL, idx INTEGER NOT NULL,"
            " data TEXT NOT NULL)",
            "INSERT INTO {table}_by_no (turn_no, idx, data) SELECT t.seq, r.idx, r.data"
            " FROM {table} AS r JOIN turns AS t ON t.id = r.turn ORDER BY t.seq, r.idx",
            "DROP TABLE {table}",
            "ALTER TABLE {table}_by_no RENAME TO {table}",
            "CREATE UNIQUE INDEX {table}_turn ON {table}(turn_no, idx)",
        )),
    ),
    (
        # Submits' Idempotency-Keys: the turn each made and the fingerprint of the submit,
        # written in the turn's transaction; the key is unique, so one key is one turn.
        """CREATE TABLE idempotency_keys (
            key TEXT PRIMARY KEY,
            turn TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            created_at REAL NOT NULL
        )""",
        "CREATE INDEX idempotency_keys_created ON idempotency_keys(created_at)",
    ),
    (
        # The webhook outbox: a row per webhook and event it takes, written with the
        # event's row, kept until it is delivered or given up (store/outbox.py).
        """CREATE TABLE webhook_outbox (
            webhook TEXT NOT NULL,
            seq INTEGER NOT NULL,
            type TEXT NOT NULL,
            body TEXT NOT NULL,
            created_at REAL NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending',
            attempts INTEGER NOT NULL DEFAULT 0,
            next_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            last_error TEXT,
            PRIMARY KEY (webhook, seq)
        )""",
        "CREATE INDEX webhook_outbox_due ON webhook_outbox(webhook, state, next_at)",
    ),
)


def prepare(conn: sqlite3.Connection, path: Path) -> None:
    """Check the database at `path` (open on `conn`), switch it to WAL with full syncs,
    and bring its schema to `SCHEMA_VERSION`. Raises StoreError when it must not be used."""
    # Checked before anything is written: a database this code must not use is
    # left exactly as it was found (even the switch to WAL writes its header).
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"state database {path} has schema version {version}, newer than "
            f"this turnkeeper understands ({SCHEMA_VERSION}); refusing to touch it "
            "(run the newer turnkeeper, or restore a backup made by this one)")
    problems = [str(r[0]) for r in conn.execute("PRAGMA quick_check(5)").fetchall()]
    if problems != ["ok"]:
        found = " ".join("; ".join(problems).split())
        raise StoreError(
            f"state database {path} is corrupt (quick_check: {found[:300]}); "
            "restore it from a backup or move it aside to start with an empty "
            "store")
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()
    if mode is None or str(mode[0]).lower() != "wal":
        raise StoreError(f"state database {path} cannot use WAL mode "
                         f"(journal_mode is {mode[0] if mode else None!r})")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA foreign_keys = ON")
    migrate(conn)
    if version < SCHEMA_VERSION:
        # A migration of a large file leaves a write-ahead log as large as what it wrote
        # until the daemon stops: its pages go into the file now, and the log to nothing.
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def migrate(conn: sqlite3.Connection, *, to: int = SCHEMA_VERSION) -> None:
    """Bring the schema from the version the file holds (`user_version`) to `to`, one
    migration at a time, each in its own transaction: a crash during one leaves the file
    at the version before it. (Tests build the file an earlier version left with `to`.)"""
    for v in range(conn.execute("PRAGMA user_version").fetchone()[0], to):
        conn.execute("BEGIN IMMEDIATE")
        for step in MIGRATIONS[v]:
            if isinstance(step, str):
                conn.execute(step)
            else:
                step(conn)
        conn.execute(f"PRAGMA user_version = {v + 1}")
        conn.execute("COMMIT")
