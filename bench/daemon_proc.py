"""A real daemon process for the benchmarks that kill and restart one: `python -m
turnkeeper serve` on a state directory of its own, its control socket, and reads of its
SQLite file from outside. Times are wall-clock (`time.time()`), so they compare with
the timestamps of the events the daemon stored."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnkeeper.control.client import Client, ClientError


class DaemonProc:
    """One daemon on `root` (its state, socket, config and log there), spawned again
    after a kill. `daemon_options` is the rest of the config's `[daemon]` table, `rest`
    the tables after it."""

    def __init__(self, root: Path, daemon_options: str, rest: str, *,
                 timeout: float = 60.0) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.socket = root / "run" / "control.sock"
        self.db = root / "state" / "turnkeeper.sqlite3"
        self.config = root / "turnkeeper.toml"
        self.config.write_text(
            f'[daemon]\nsocket = "{self.socket}"\nstate_dir = "{root / "state"}"\n'
            f'log_format = "json"\nlog_level = "warning"\nwatch_config = false\n'
            f"{daemon_options}\n{rest}")
        self.client = Client(self.socket, timeout=timeout)
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> float:
        """Start the daemon (without this process's systemd or turnkeeper variables);
        the time it was started."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TURNKEEPER_", "NOTIFY_SOCKET", "WATCHDOG_", "LISTEN_"))}
        t0 = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "turnkeeper", "serve", "--config", str(self.config)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(self.root / "daemon.log", "ab"),  # noqa: SIM115
            env=env)
        return t0

    def status(self) -> dict[str, Any] | None:
        try:
            code, data = self.client.request("GET", "/v1/status", timeout=5)
        except ClientError:
            return None
        return data if code == 200 else None

    def until(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 120.0) -> float:
        """Poll the status until `pred` holds; the time it did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}; see "
                                   f"{self.root / 'daemon.log'}")
            status = self.status()
            if status is not None and pred(status):
                return time.time()
            time.sleep(0.005)
        raise RuntimeError("timed out")

    def until_ready(self, timeout: float = 120.0) -> float:
        return self.until(lambda s: bool(s["state"] == "ready"), timeout)

    def query(self, sql: str, *args: Any) -> Any:
        """The first row of a read of the daemon's SQLite file."""
        conn = sqlite3.connect(self.db, timeout=30)
        try:
            return conn.execute(sql, args).fetchone()
        finally:
            conn.close()

    def max_seq(self) -> int:
        return int(self.query("SELECT COALESCE(MAX(seq), 0) FROM events")[0])

    def count(self, type_: str, after: int = 0) -> tuple[int, float]:
        """How many `type_` events after seq `after` are stored, and the time of the last."""
        n, ts = self.query("SELECT COUNT(*), MAX(ts) FROM events WHERE seq > ? AND type = ?",
                           after, type_)
        return int(n), float(ts or 0.0)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
