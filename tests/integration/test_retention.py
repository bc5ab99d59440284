"""Retention against the real daemon: finished turns go after `store.keep_finished`, in
the background, dead letters stay; `turnkeeper prune` does it now."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import ECHO_TOOL, Daemon, script_file, scripted_provider

SCRIPT = """
[[scenarios]]
match = "fail"
[[scenarios.steps]]
fail = [{ status = 400, forever = true }]
[[scenarios]]
[[scenarios.steps]]
reply = "step"
tool_calls = [{ name = "echo", arguments = { text = "$turn" } }]
[[scenarios.steps]]
reply = "done"
"""


def config(tmp_path: Path, extra: str = "") -> str:
    return scripted_provider(script_file(tmp_path / "s.toml", SCRIPT)) + ECHO_TOOL + extra


def rows(d: Daemon) -> tuple[int, int, int]:
    conn = sqlite3.connect(d.state_dir / "turnkeeper.sqlite3")
    try:
        return (conn.execute("SELECT COUNT(*) FROM turns").fetchone()[0],
                conn.execute("SELECT COUNT(*) FROM events").fetchone()[0],
                conn.execute("SELECT COUNT(*) FROM journal").fetchone()[0])
    finally:
        conn.close()


@pytest.mark.slow
def test_under_steady_load_with_a_short_keep_the_store_stops_growing(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path, '[store]\nkeep_finished = "2s"\n'))
    letter = d.run("fail this one")
    assert letter["result"]["stopped_because"]["code"] == "providers.rejected"
    counts = []
    deadline = time.monotonic() + 9
    while time.monotonic() < deadline:
        for i in range(10):
            d.submit(f"turn {i}")
        time.sleep(0.5)
        counts.append(rows(d))
    submitted = 10 * len(counts)
    turns_late = max(c[0] for c in counts[-4:])
    # Kept: the last ~2-3 s of turns (keep + one round), never the whole run.
    assert turns_late < submitted / 2, (turns_late, submitted, counts)
    assert max(c[1] for c in counts[-4:]) < 2 * max(c[1] for c in counts[:6]), counts
    assert d.get(f"/v1/turns/{letter['id']}")[0] == 200  # the dead letter is kept
    assert "store.pruned" in d.log_text()


@pytest.mark.slow
def test_prune_now_deletes_old_turns_and_dead_letters_only_when_asked(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path))
    done = d.run("a turn")["id"]
    letter = d.run("fail this one")["id"]
    time.sleep(0.3)  # time itself: both turns are older than the 0.2 s asked below
    out = subprocess.run([sys.executable, "-m", "turnkeeper", "--socket", str(d.socket),
                          "prune", "--older-than", "0.2s"], capture_output=True, text=True,
                         timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert "pruned 1 finished turns older than 0.2s" in out.stdout
    assert d.get(f"/v1/turns/{done}")[0] == 404
    assert d.get(f"/v1/turns/{letter}")[0] == 200
    status, data = d.post("/v1/prune", {"older_than": "0.2s", "dead_letters": True})
    assert (status, data["pruned"]) == (200, 1)
    assert d.get(f"/v1/turns/{letter}")[0] == 404
    assert rows(d) == (0, 0, 0)
    status, data = d.post("/v1/prune", {"older_than": "7x"})
    assert (status, data["field"]) == (400, "older_than")
