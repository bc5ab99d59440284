"""Webhooks in a fleet: three real daemons on one PostgreSQL database send from one
outbox, and each delivery is sent by one node, once."""

from __future__ import annotations

import collections
import textwrap
import time
from pathlib import Path

from tests.integration.fleet_helpers import (  # noqa: F401 - fixtures `db`, `server`
    fleet_db,
    fleet_server,
    query,
    wait_finished,
)
from tests.integration.harness import Daemon, script_file, scripted_provider
from tests.integration.test_webhooks import ENV, SCRIPT, verify
from tests.integration.tool_server import ToolServer

TURNS = 60


def test_each_delivery_of_a_fleet_is_sent_by_one_node_once(
        tmp_path: Path, server: ToolServer, db: str) -> None:
    script = script_file(tmp_path / "script.toml", SCRIPT)

    def config(node: str) -> str:
        return textwrap.dedent(f"""
            [store]
            url = "{db}"

            [fleet]
            node_id = "{node}"

            [[webhooks]]
            name = "app"
            url = "{server.url('/hook')}"
            events = ["turn.finished"]
            secret_env = "APP_WEBHOOK_SECRET"
            """) + scripted_provider(script)

    daemons = [Daemon(tmp_path, config(f"n{i}"), name=f"n{i}", env=ENV) for i in range(3)]
    try:
        for d in daemons:
            d.start()
        ids = [daemons[i % 3].submit(f"work {i}")["id"] for i in range(TURNS)]
        wait_finished(db, TURNS, timeout=120)
        deadline = time.monotonic() + 60
        while query(db, "SELECT count(*) AS n FROM webhook_outbox WHERE state ="
                        " 'delivered'")[0]["n"] < TURNS:
            assert time.monotonic() < deadline, query(
                db, "SELECT state, claimed_by, count(*) FROM webhook_outbox GROUP BY 1, 2")
            time.sleep(0.1)
        # every node's status comes to an empty backlog (read once a second)
        for d in daemons:
            while d.get("/v1/status")[1]["webhooks"]["app"]["pending"]:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        for d in daemons:
            d.kill()
    calls = server.calls("/hook")
    per_id = collections.Counter(c.headers["webhook-id"] for c in calls)
    assert len(per_id) == TURNS and set(per_id.values()) == {1}, per_id
    for call in calls:
        verify(call)
    sent_for = {c.body["turn"] for c in calls}
    assert sent_for == set(ids)
