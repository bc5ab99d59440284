"""Large reads do not hold the event loop: a limits report over 50,000 finished turns and
a page of 10,000 turns are read, decoded, computed and encoded off it. The daemon's own
lag measurement (sampled every 0.1 s into `turnkeeper_event_loop_lag_observed_seconds`)
must see no lag over 100 ms while they run."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import Daemon, wait_until
from turnkeeper.turn.record import TurnRecord

TURNS = 50_000


def lag_counts(d: Daemon) -> tuple[float, float]:
    """(samples at or under 100 ms, all samples) so far."""
    status, data = d.get("/metrics")  # not JSON: the client hands back its text
    assert status == 200
    under = total = 0.0
    for line in data["error"].splitlines():
        if line.startswith('turnkeeper_event_loop_lag_observed_seconds_bucket{le="0.1"}'):
            under = float(line.split()[-1])
        elif line.startswith("turnkeeper_event_loop_lag_observed_seconds_count"):
            total = float(line.split()[-1])
    return under, total


def fill(db: Path) -> None:
    now = time.time()
    rows = []
    for i in range(TURNS):
        rec = TurnRecord(id=f"t_{i:016x}", session=f"s{i % 100}", message=f"turn {i} " * 20,
                         created_at=now - 3600, updated_at=now - 60, state="completed",
                         seq=i + 1, policy_version=1).to_json()
        rec["usage"].update(total_tokens=100 + i % 1000, seconds=0.5 + i % 7)
        rec["counters"]["steps"] = 1 + i % 9
        rec["result"] = {"status": "completed", "answer": "done " * 40,
                         "stopped_because": {"code": "completed", "message": "done"}}
        rows.append((rec["id"], i + 1, rec["session"], "completed", rec["created_at"],
                     rec["updated_at"], json.dumps(rec)))
    conn = sqlite3.connect(db)
    conn.executemany("INSERT INTO turns (id, seq, session, state, created_at, updated_at,"
                     " record) VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    conn.commit()
    conn.close()


@pytest.mark.slow
def test_a_report_over_50000_turns_and_a_page_of_10000_leave_the_loop_free(
        start: Any) -> None:
    d = start()
    d.stop()
    fill(d.state_dir / "turnkeeper.sqlite3")
    d.start()
    wait_until(lambda: lag_counts(d)[1] >= 3, what="a few samples of the idle loop first")
    before = lag_counts(d)
    status, report = d.get("/v1/limits/report", timeout=120)
    assert status == 200 and report["turns"] == TURNS
    status, page = d.get("/v1/turns?limit=10000", timeout=120)
    assert status == 200 and len(page["turns"]) == 10_000
    # The samples taken while the last answer went out: two more after it.
    answered = lag_counts(d)[1]
    wait_until(lambda: lag_counts(d)[1] >= answered + 2, what="two samples after the answer")
    after = lag_counts(d)
    samples = after[1] - before[1]
    late = samples - (after[0] - before[0])
    assert samples >= 3, f"only {samples} lag samples: the loop was not watched"
    assert late == 0, f"{late:.0f} of {samples:.0f} lag samples over 100 ms"
