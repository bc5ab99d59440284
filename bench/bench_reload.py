"""Reload latency against the daemon's own start-up time, measured in the same run.

The real daemon (`python -m turnkeeper serve`) runs as a subprocess with a real
NOTIFY_SOCKET: a datagram socket in this process stands in for systemd, and every figure
is a time from a trigger to the arrival of the daemon's `READY=1` datagram:

  start-up         process spawned -> READY=1 (fresh state, nothing to resume): the baseline
  reload, idle     SIGHUP -> READY=1 with no turn in flight
  reload, parked   SIGHUP -> READY=1 with 1,000 turns parked in `waiting` (clarify): the
                   drain holds them in their waits and the swap lets them wait on under
                   the new policy, without a write or a task woken for any of them
  back waiting     SIGHUP -> `GET /v1/status` says ready with all 1,000 waiting again;
                   then (not timed) every one of them is checked to be on the new policy
  start-up, parked process spawned -> READY=1 with the same 1,000 turns to resume after a stop

Rounds alternate; each figure is the median of its rounds (p90 beside it).

    python bench/bench_reload.py [--rounds 7] [--parked 1000]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bytecode import use_bytecode_cache
from tests.integration.harness import NotifyListener

from turnkeeper.control.client import Client

SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
tool_calls = [{ name = "clarify", arguments = { question = "which one for $message?" } }]
[[scenarios.steps]]
reply = "thanks: $last_tool_result"
"""


class Bench:
    def __init__(self, where: Path, parked: int) -> None:
        self.where = where
        self.parked = parked
        self.socket = where / "run" / "control.sock"
        self.config = where / "turnkeeper.toml"
        (where / "script.toml").write_text(SCRIPT)
        self.notify = NotifyListener(where / "notify.sock")
        self.client = Client(self.socket, timeout=120)
        self.proc: subprocess.Popen[bytes] | None = None
        self.state = "state"
        self.nudges = 0
        self.log = open(where / "daemon.log", "ab")  # noqa: SIM115 - closed in close()

    def write_config(self, state: str, nudge: int = 0) -> None:
        """`nudge`: a setting no turn here feels (`body_read_timeout`), so each reload
        is a new policy: a reload of the running one makes no version and drains nothing."""
        self.state = state
        self.config.write_text(f"""
[daemon]
socket = "{self.socket}"
state_dir = "{self.where / state}"
log_format = "json"
watch_config = false
max_queued_turns = {self.parked * 5}
drain_timeout = 30.0
body_read_timeout = {10 + nudge}.0

[[providers]]
name = "scripted"
kind = "scripted"
script = "{self.where / 'script.toml'}"
""")

    def start(self) -> float:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TURNKEEPER_", "LISTEN_", "WATCHDOG_"))}
        env["NOTIFY_SOCKET"] = str(self.notify.path)
        mark = len(self.notify.messages)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "turnkeeper", "serve", "--config", str(self.config)],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=env)
        return self._ready_after(mark) - t0

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        if self.proc.wait(120) != 0:
            raise RuntimeError(f"daemon exited {self.proc.returncode}")

    def reload(self) -> tuple[float, float]:
        """SIGHUP with a new policy: when it was sent and when READY=1 came (monotonic)."""
        assert self.proc is not None
        self.nudges += 1
        self.write_config(self.state, self.nudges)
        mark = len(self.notify.messages)
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGHUP)
        return t0, self._ready_after(mark)

    def _ready_after(self, mark: int) -> float:
        """When the first READY=1 after message `mark` arrived (monotonic)."""
        _, at, _ = self.notify.wait_for(lambda m: m.get("READY") == "1", 120.0, after=mark)
        return at

    def status(self) -> dict[str, Any]:
        code, data = self.client.request("GET", "/v1/status")
        assert code == 200, data
        return data  # type: ignore[no-any-return]

    def wait_until(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 120) -> float:
        """When (monotonic) a status answer first met `pred`."""
        deadline = time.monotonic() + timeout
        while not pred(self.status()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out: {self.status()}")
            time.sleep(0.001)
        return time.monotonic()

    def check_parked_on(self, version: int) -> None:
        """Every parked turn is waiting, on policy `version`, with its question."""
        code, data = self.client.request("GET",
                                         f"/v1/turns?state=waiting&limit={self.parked}")
        assert code == 200, data
        turns = data["turns"]
        assert len(turns) == self.parked, len(turns)
        assert all(t["policy_version"] == version and t["question"] for t in turns)

    def park(self) -> None:
        def one(i: int) -> None:
            code, data = Client(self.socket, timeout=60).request(
                "POST", "/v1/turns", {"message": f"question {i}"})
            assert code == 202, data

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(self.parked)))
        self.wait_until(lambda s: s["turns"]["waiting"] == self.parked)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()
        self.log.close()


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return f"{statistics.median(values) * 1000:9.1f} ms  (p90 {p90 * 1000:7.1f} ms)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--parked", type=int, default=1000)
    args = ap.parse_args()
    print(use_bytecode_cache())
    where = Path(tempfile.mkdtemp(prefix="tk-bench-reload-", dir="/tmp"))
    bench = Bench(where, args.parked)
    figures: dict[str, list[float]] = {k: [] for k in (
        "start-up", "reload, idle", "reload, parked", "back waiting", "start-up, parked")}
    try:
        for r in range(args.rounds):
            bench.write_config(f"state-{r}")
            figures["start-up"].append(bench.start())
            for _ in range(3):
                sent, ready = bench.reload()
                figures["reload, idle"].append(ready - sent)
            bench.park()
            sent, ready = bench.reload()
            figures["reload, parked"].append(ready - sent)
            back = bench.wait_until(lambda s: s["turns"]["waiting"] == args.parked
                                    and s["state"] == "ready")
            figures["back waiting"].append(back - sent)
            version = bench.status()["policy_version"]
            assert version == 5, version  # exactly one policy per reload
            bench.check_parked_on(version)
            bench.stop()
            figures["start-up, parked"].append(bench.start())
            bench.wait_until(lambda s: s["turns"]["waiting"] == args.parked)
            bench.stop()
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        bench.close()
    base = statistics.median(figures["start-up"])
    print(f"turnkeeper reload latency (trigger -> READY=1), {args.rounds} rounds, "
          f"{args.parked} parked turns, {os.cpu_count()} CPUs")
    for name, values in figures.items():
        ratio = statistics.median(values) / base
        print(f"  {name:<17} {summary(values)}   {ratio:6.3f} x start-up")
    shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
