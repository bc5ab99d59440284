"""Resume under load: N turns of S steps each accepted and running, the daemon killed with
SIGKILL half-way, then started again on the same state directory.

The real daemon (`python -m turnkeeper serve`) against the loopback model server
(bench/fake_model.py: a fixed latency, S steps a conversation: tool calls to `echo`, then
an answer). In the same run, alternating:

  empty    a daemon started on an empty state directory: the time from spawn to READY,
           then the N turns submitted and run to their end without a crash;
  crashed  the same N turns on another empty directory, killed with SIGKILL once half of
           their steps have started; then the same daemon started again: the time from
           spawn to READY, until every unfinished turn is running again (its first step
           after the restart has started) and until every turn has finished.

Times are read from the events the daemon wrote (their timestamps), not from polling.
Printed: each time and its ratio to the empty start; the crashed run's submit-to-finish
time (before the kill plus after the restart) against the uninterrupted run's.

    python bench/bench_resume.py [--turns 1000] [--steps 20] [--latency 0.2] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bytecode import use_bytecode_cache
from bench.daemon_proc import DaemonProc
from bench.fake_model import daemon_config, start_model

BATCH = 100


class Node(DaemonProc):
    """One daemon on its own state directory against the loopback model."""

    def __init__(self, root: Path, port: int, turns: int) -> None:
        super().__init__(root, f"max_concurrent_turns = {turns}\n"
                               f"max_queued_turns = {turns * 2}\n",
                         "[budget]\nmax_seconds = 600.0\n\n"
                         + daemon_config(port, max_connections=turns))

    def submit(self, turns: int) -> float:
        """Every turn, in batches; the time the first batch was sent."""
        t0 = time.time()
        for first in range(0, turns, BATCH):
            body = [{"message": f"turn {i}"} for i in range(first, min(turns, first + BATCH))]
            code, data = self.client.request("POST", "/v1/turns", body)
            if code != 202:
                raise RuntimeError(f"submit: {code} {data}")
        return t0

    def first_steps(self, after: int) -> tuple[int, float]:
        """How many turns started a step after seq `after`, and when the last of them
        started its first."""
        n, ts = self.query("SELECT COUNT(*), MAX(first) FROM (SELECT MIN(ts) AS first "
                           "FROM events WHERE seq > ? AND type = 'step.started' "
                           "GROUP BY turn)", after)
        return int(n), float(ts or 0.0)

    def wait_for(self, what: str, pred: Any, timeout: float = 300.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            got = pred()
            if got is not None:
                return got
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited while waiting for {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def finished_at(self, turns: int) -> float:
        def done() -> float | None:
            n, ts = self.count("turn.finished")
            return ts if n >= turns else None
        return float(self.wait_for("every turn finished", done))


def empty_round(root: Path, port: int, turns: int) -> dict[str, float]:
    node = Node(root, port, turns)
    try:
        t0 = node.spawn()
        ready = node.until_ready() - t0
        sent = node.submit(turns)
        return {"ready": ready, "run": node.finished_at(turns) - sent}
    finally:
        node.stop()


def crashed_round(root: Path, port: int, turns: int, steps: int) -> dict[str, float]:
    node = Node(root, port, turns)
    try:
        node.spawn()
        node.until_ready()
        sent = node.submit(turns)
        half = turns * steps // 2
        node.wait_for("half of the steps", lambda: node.count("step.started")[0] >= half
                      or None)
        node.kill()
        killed = time.time()
        before = node.max_seq()
        finished_before = node.count("turn.finished")[0]
        unfinished = turns - finished_before
        t0 = node.spawn()
        ready = node.until_ready() - t0

        def all_running() -> float | None:
            n, ts = node.first_steps(before)
            return ts if n >= unfinished else None

        running = node.wait_for("every unfinished turn running", all_running) - t0
        finished = node.finished_at(turns) - t0
        return {"ready": ready, "running": running, "finished": finished,
                "unfinished": float(unfinished), "run": (killed - sent) + finished}
    finally:
        node.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--latency", type=float, default=0.2)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    print(use_bytecode_cache())
    model, port = start_model(latency=args.latency, steps=args.steps)
    tmp = Path(tempfile.mkdtemp(prefix="tk-bench-resume-"))
    empty: list[dict[str, float]] = []
    crashed: list[dict[str, float]] = []
    try:
        for r in range(args.rounds):
            empty.append(empty_round(tmp / f"empty{r}", port, args.turns))
            crashed.append(crashed_round(tmp / f"crashed{r}", port, args.turns, args.steps))
    finally:
        model.terminate()
        model.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    e, run = med(empty, "ready"), med(empty, "run")
    ready, running = med(crashed, "ready"), med(crashed, "running")
    finished, crashed_run = med(crashed, "finished"), med(crashed, "run")
    floor = args.steps * args.latency
    print(f"resume under load: {args.turns} turns x {args.steps} steps, "
          f"{args.latency * 1e3:.0f} ms model latency (floor {floor:.1f} s a turn), SIGKILL "
          f"once half the steps had started ({med(crashed, 'unfinished'):.0f} turns "
          f"unfinished); median of {args.rounds} round(s), {os.cpu_count()} cores")
    print(f"  start-up, empty store              {e * 1e3:8.0f} ms to READY")
    print(f"  restart after the kill             {ready * 1e3:8.0f} ms to READY"
          f"   (x{ready / e:.2f} the empty start)")
    print(f"  every unfinished turn running      {running * 1e3:8.0f} ms"
          f"   (x{running / e:.2f} the empty start)")
    print(f"  every turn finished                {finished * 1e3:8.0f} ms after the restart")
    print(f"  submit to all finished: uninterrupted {run:.2f} s, crashed and resumed "
          f"{crashed_run:.2f} s (x{crashed_run / run:.2f})")


if __name__ == "__main__":
    main()
