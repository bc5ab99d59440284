"""The real daemon on a real PostgreSQL database: turns run and survive a kill -9 with
the same resume rules as on the SQLite file, killed connections cost nothing, a second
daemon on the database is refused, and a bad URL stops start-up with a clear status."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from tests.integration.fleet_helpers import fleet_db  # noqa: F401 - the `db` fixture
from tests.integration.harness import Daemon
from tests.integration.test_effects import effects_config, of_type, unknown_issues
from tests.integration.tool_server import ToolServer
from turnkeeper.policy.effects import effect_key


@pytest.fixture(scope="module")
def server() -> Iterator[ToolServer]:
    s = ToolServer().start()
    try:
        yield s
    finally:
        s.stop()


def pg_config(tmp: Path, server: ToolServer, url: str) -> str:
    return f'[store]\nurl = "{url}"\n\n' + effects_config(tmp, server)


def terminate_backends(url: str) -> int:
    async def run() -> int:
        conn = await asyncpg.connect(url)
        try:
            return int(await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE"
                " datname = current_database() AND pid <> pg_backend_pid()"
                " AND application_name LIKE 'turnkeeper%'"))
        finally:
            await conn.close()
    return asyncio.run(run())


def test_turns_run_on_postgres_and_a_kill_9_resumes_with_the_journal(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    daemon = Daemon(tmp_path, pg_config(tmp_path, server, db), name="pg").start()
    try:
        done = daemon.run("twice")
        assert done["state"] == "completed", done["result"]
        server.hold("/mail_crash")
        try:
            tid = daemon.submit("mail_crash")["id"]
            server.wait_for_calls("/mail_crash", 1)
            daemon.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            daemon.proc.wait()  # type: ignore[union-attr]
        finally:
            server.release("/mail_crash")
        daemon.start()
        turn = daemon.wait(tid)
        events = daemon.events(tid)
        status, data = daemon.get(f"/v1/turns/{done['id']}")
    finally:
        daemon.kill()
    assert status == 200 and data["turn"]["state"] == "completed"  # kept in the database
    assert turn["state"] == "completed", turn["result"]
    assert len(server.calls("/mail_crash")) == 1  # a non-idempotent call is never re-sent
    key = effect_key(tid, "mail_crash", {"to": "ada"}, 1)
    assert unknown_issues(turn) == [
        f'outcome unknown: mail_crash {{"to":"ada"}} (Idempotency-Key {key})']
    [unknown] = of_type(events, "tool.outcome_unknown")
    assert unknown["key"] == key and "daemon stopped" in unknown["reason"]


def test_killed_connections_mid_run_cost_no_turn(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    daemon = Daemon(tmp_path, pg_config(tmp_path, server, db), name="pgkill").start()
    stop = threading.Event()
    killed: list[int] = []

    def keep_killing() -> None:
        while not stop.wait(0.05):
            killed.append(terminate_backends(db))

    killer = threading.Thread(target=keep_killing, name="pg_terminate_backend")
    try:
        server.hold("/note")  # the turns mid-run while their connections are killed
        try:
            ids = [daemon.submit("twice")["id"] for _ in range(30)]
            killer.start()
            deadline = time.monotonic() + 10
            while sum(killed) == 0:
                assert time.monotonic() < deadline, "no connection was killed"
                time.sleep(0.01)
        finally:
            server.release("/note")
        turns = [daemon.wait(tid, timeout=60) for tid in ids]
    finally:
        stop.set()
        if killer.is_alive():
            killer.join()
        daemon.kill()
    assert sum(killed) > 0
    assert [t["state"] for t in turns] == ["completed"] * 30, [t["result"] for t in turns]


def test_a_second_daemon_under_the_same_node_id_exits_69(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    same = '[fleet]\nnode_id = "same"\n' + pg_config(tmp_path, server, db)
    first = Daemon(tmp_path, same, name="one").start()
    try:
        second = Daemon(tmp_path, same, name="two")
        second.start(wait=False)
        assert second.proc is not None
        assert second.proc.wait(30) == 69
        assert "node id 'same' is in use by a running turnkeeper" in second.log_text()
    finally:
        first.kill()


def serve(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "turnkeeper", "serve", "--config",
                           str(config)], capture_output=True, text=True, timeout=60,
                          check=False, stdin=subprocess.DEVNULL)


def test_a_bad_store_url_exits_78_and_an_unreachable_one_74(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    sock = tmp_path / "s.sock"
    config.write_text(f'[daemon]\nsocket = "{sock}"\nstate_dir = "{tmp_path}"\n'
                      '[store]\nurl = "mysql://tk:s3cret@127.0.0.1/x"\n')
    bad = serve(config)
    assert bad.returncode == 78, bad.stderr
    assert "store.url" in bad.stderr and "s3cret" not in bad.stderr
    config.write_text(f'[daemon]\nsocket = "{sock}"\nstate_dir = "{tmp_path}"\n'
                      '[store]\nurl = "postgresql://tk:s3cret@127.0.0.1:1/x"\n'
                      '[[providers]]\nname = "offline"\nkind = "scripted"\n')
    gone = serve(config)
    assert gone.returncode == 74, gone.stderr
    assert "<redacted>@127.0.0.1:1/x" in gone.stderr and "s3cret" not in gone.stderr
