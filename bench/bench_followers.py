"""What event followers that never read cost the daemon's memory.

The same daemon config twice in one run: once with no follower, once with N clients
(16 by default) that open `GET /v1/events` on the control socket and then never read a
byte. Each run sends the same turns (3 steps against the loopback model, no latency)
and samples the daemon's resident memory (`VmRSS` in /proc/PID/status) every 50 ms.
Printed: RSS before the turns, the peak while they ran, the growth, and the growth with
followers against the growth without (the ratio); and what `/v1/status` says of the
followers at the end (how many are open, the bytes each holds, how many were dropped).

    python bench/bench_followers.py [--turns 400] [--followers 16] [--steps 3]
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.daemon_proc import DaemonProc
from bench.fake_model import daemon_config, start_model


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def open_followers(path: Path, n: int) -> list[socket.socket]:
    """`n` event streams whose clients send the request and never read the answer."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        s.sendall(b"GET /v1/events HTTP/1.1\r\nHost: turnkeeper\r\n\r\n")
        socks.append(s)
    return socks


def run(root: Path, port: int, *, turns: int, followers: int, batch: int) -> dict[str, Any]:
    d = DaemonProc(root, "max_concurrent_turns = 50\nmax_queued_turns = 100000\n"
                   f"max_followers_per_client = {max(followers, 1)}",
                   daemon_config(port))
    d.spawn()
    d.until_ready()
    assert d.proc is not None
    pid = d.proc.pid
    socks = open_followers(d.socket, followers)
    # Wait until every stream is open (the daemon counts them), then let it settle.
    d.until(lambda s: s.get("followers", {}).get("open", followers) >= followers)
    time.sleep(0.5)
    before = rss_kb(pid)
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_kb(pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    for first in range(0, turns, batch):
        body = [{"message": f"turn {first + k}"} for k in range(min(batch, turns - first))]
        code, data = d.client.request("POST", "/v1/turns", body)
        assert code == 202, (code, data)
    d.until(lambda s: sum(s["turns"].values()) == 0 and s["queue"]["depth"] == 0,
            timeout=600)
    wall = time.perf_counter() - t0
    time.sleep(0.3)
    done.set()
    sampler.join()
    after = rss_kb(pid)
    status = d.status() or {}
    for s in socks:
        s.close()
    d.stop()
    return {"before": before, "peak": max(peak[0], after), "after": after, "wall": wall,
            "followers": status.get("followers")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=400)
    ap.add_argument("--followers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=50)
    args = ap.parse_args()
    model, port = start_model(latency=0.0, steps=args.steps)
    try:
        with tempfile.TemporaryDirectory(prefix="tk-bench-followers-") as tmp:
            results = {}
            for n in (0, args.followers):
                results[n] = run(Path(tmp) / f"f{n}", port, turns=args.turns, followers=n,
                                 batch=args.batch)
    finally:
        model.terminate()
        model.wait()
    print(f"{args.turns} turns x {args.steps} steps, followers that never read:")
    for n, r in results.items():
        growth = r["peak"] - r["before"]
        print(f"  {n:3d} followers: RSS {r['before'] / 1024:7.1f} MiB before, "
              f"peak {r['peak'] / 1024:7.1f} MiB, growth {growth / 1024:7.1f} MiB, "
              f"{r['wall']:.1f} s; followers: {r['followers']}")
    base = max(results[0]["peak"] - results[0]["before"], 1)
    grown = results[args.followers]["peak"] - results[args.followers]["before"]
    print(f"  growth with {args.followers} followers / without: {grown / base:.2f}x "
          f"({(grown - base) / 1024 / max(args.followers, 1):.2f} MiB a follower)")


if __name__ == "__main__":
    main()
