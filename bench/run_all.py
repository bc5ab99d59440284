"""Run every benchmark in bench/ with sizes that fit the whole suite in its 25-minute
budget on 2 cores, one after the other (never two at once:
they would measure each other).

Each benchmark prints its own figures with the ratio to its baseline from the same run;
this script prints them as they come, then a summary (status and time of each). A
benchmark that is not in this tree is skipped with a note; one that fails or overruns its
time is reported and the suite goes on.

    python bench/run_all.py [--only step,cli] [--full] [--out results.txt]

Sizes (the suite's; `--full` runs each script's own defaults instead, which takes longer):
  bench_step         200 turns x 5 steps, 3 rounds (the script's defaults)
  bench_concurrency  5,000 turns x 3 steps, 200 ms model latency
  bench_submit       5,000 submits, one per request and in batches of 100 (its defaults)
  bench_providers    1,000 calls at 10 and 2,000 at 1,000 concurrent, 3 rounds
                     (half its default calls)
  bench_cli          40 runs of each command (default 60)
  bench_guards, bench_outage, bench_reload, bench_durability: their own defaults
  bench_resume       its defaults: 1,000 turns x 20 steps, one round (about 90 s)
  bench_followers    2,000 turns x 3 steps, 16 followers that never read vs none
  bench_adaptive     its defaults: about 6 minutes, most of it the run without adaptation
                     waiting out its recovery cycles
  bench_fleet        the store part 200 turns x 5 steps, 2 rounds; 150 turns x 3 steps
                     against a 200 ms model on 1, 2 and 3 nodes; a take-over after
                     kill -9 (needs a PostgreSQL server)
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITE_BUDGET_S = 1500.0


@dataclass(frozen=True)
class Bench:
    key: str
    script: str
    what: str
    args: tuple[str, ...] = ()
    timeout_s: float = 180.0


BENCHES = (
    Bench("step", "bench_step.py", "per-step orchestration CPU vs a raw loopback call, the "
          "floor of its rows and peers",
          ("--turns", "200", "--steps", "5", "--rounds", "3"), 200.0),
    Bench("concurrency", "bench_concurrency.py", "5,000 turns x 3 steps through the socket "
          "vs a bare aiohttp loop", ("--turns", "5000", "--steps", "3"), 240.0),
    Bench("submit", "bench_submit.py", "submits accepted per second, single and in "
          "batches, vs a bare aiohttp server on a Unix socket", ("--turns", "5000"), 120.0),
    Bench("providers", "bench_providers.py", "provider CPU per model call vs bare aiohttp",
          ("--rounds", "3", "--calls-10", "1000", "--calls-1000", "2000"), 150.0),
    Bench("cli", "bench_cli.py", "`turnkeeper status` vs `python -c pass`",
          ("--runs", "40"), 120.0),
    Bench("guards", "bench_guards.py", "guards CPU per step, on vs off", (), 150.0),
    Bench("outage", "bench_outage.py", "attempts on a dead primary vs naive retries"),
    Bench("adaptive", "bench_adaptive.py", "1,000 turns against a concurrency quota, "
          "adaptive concurrency off vs on", (), 720.0),
    Bench("reload", "bench_reload.py", "reload with parked turns; resume after kill -9"),
    Bench("durability", "bench_durability.py", "durability under crashes"),
    Bench("resume", "bench_resume.py", "1,000 turns x 20 steps killed half-way and resumed "
          "vs an empty start and an uninterrupted run", (), 200.0),
    Bench("followers", "bench_followers.py", "RSS growth with 16 event followers that "
          "never read vs none", ("--turns", "2000"), 120.0),
    Bench("fleet", "bench_fleet.py", "PostgreSQL store, 1 and 3 daemons, vs the SQLite file; "
          "take-over after kill -9", ("--turns", "200", "--rounds", "2"), 300.0),
)


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--only", default="", help="comma-separated keys: "
                    + ",".join(b.key for b in BENCHES))
    ap.add_argument("--full", action="store_true",
                    help="each script's own default sizes (longer than 10 minutes)")
    ap.add_argument("--out", help="also write everything printed to this file")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    out = open(args.out, "w") if args.out else None  # noqa: SIM115 - closed below

    def say(text: str = "") -> None:
        print(text, flush=True)
        if out is not None:
            out.write(text + "\n")
            out.flush()

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent / "daemon"), str(HERE.parent), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    say(f"turnkeeper benchmark suite: {machine()}")
    say(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    started = time.monotonic()
    summary: list[tuple[str, str, float]] = []
    for bench in BENCHES:
        if only is not None and bench.key not in only:
            continue
        path = HERE / bench.script
        if not path.exists():
            summary.append((bench.script, "skipped: not in this tree", 0.0))
            say(f"\n== {bench.script}: skipped, not in this tree ({bench.what})")
            continue
        left = SUITE_BUDGET_S - (time.monotonic() - started)
        timeout: float | None = None if args.full else bench.timeout_s
        if timeout is not None and left < 30:
            summary.append((bench.script, "skipped: the 25-minute budget is spent", 0.0))
            say(f"\n== {bench.script}: skipped, the suite's 25-minute budget is spent")
            continue
        if timeout is not None:
            timeout = min(timeout, left)
        cmd = [sys.executable, str(path), *(() if args.full else bench.args)]
        say(f"\n== {bench.script}: {bench.what}")
        say("   $ " + " ".join(["python", f"bench/{bench.script}", *cmd[2:]]))
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=HERE.parent)
        assert proc.stdout is not None
        overran = threading.Event()

        def stop(p: subprocess.Popen[str] = proc, flag: threading.Event = overran) -> None:
            flag.set()
            p.kill()

        timer = threading.Timer(timeout, stop) if timeout is not None else None
        if timer is not None:
            timer.start()
        try:
            for line in proc.stdout:
                say(line.rstrip("\n"))
            proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
        if overran.is_set():
            status = f"stopped after {timeout:.0f} s"
        elif proc.returncode != 0:
            status = f"failed (exit {proc.returncode})"
        else:
            status = "ok"
        elapsed = time.monotonic() - t0
        summary.append((bench.script, status, elapsed))
    total = time.monotonic() - started
    say(f"\n== summary ({total:.0f} s in all; budget {SUITE_BUDGET_S:.0f} s)")
    for script, status, elapsed in summary:
        say(f"   {script:<24}{status:<42}{elapsed:7.1f} s")
    if out is not None:
        out.close()
    return 0 if all(s in ("ok",) or s.startswith("skipped") for _, s, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
