"""CLI latency: `turnkeeper status` against a running daemon, against `python -c pass`
(the same interpreter), measured in the same run.

With hyperfine on the PATH (Debian: `apt-get install hyperfine`) both commands run under
it (no shell, warm-up runs first); otherwise a subprocess loop alternates them. Figures:
median and p90 wall time of each, and the ratio of the medians.

    python bench/bench_cli.py [--runs 60] [--no-hyperfine]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.integration.harness import Daemon


def turnkeeper_command() -> list[str]:
    """The console script installed next to this interpreter, else `python -m`."""
    script = Path(sys.executable).parent / "turnkeeper"
    if script.exists():
        return [str(script)]
    found = shutil.which("turnkeeper")
    return [found] if found else [sys.executable, "-m", "turnkeeper"]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Timing = tuple[list[float], float]  # wall seconds of each run, mean CPU (user + sys) s


def with_hyperfine(hyperfine: str, commands: list[list[str]], runs: int, env: dict[str, str]
                   ) -> list[Timing]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([hyperfine, "-N", "--warmup", "5", "--runs", str(runs),
                        "--style", "none", "--export-json", out.name,
                        *(" ".join(c) for c in commands)],
                       check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        data = json.loads(Path(out.name).read_text())
    return [(r["times"], r["user"] + r["system"]) for r in data["results"]]


def with_loop(commands: list[list[str]], runs: int, env: dict[str, str]) -> list[Timing]:
    times: list[list[float]] = [[] for _ in commands]
    cpu = [0.0 for _ in commands]
    for i in range(runs + 5):
        for j, cmd in enumerate(commands):
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            if i >= 5:  # the first runs warm the page cache
                times[j].append(time.perf_counter() - t0)
                r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu[j] += (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return [(t, c / runs) for t, c in zip(times, cpu, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--no-hyperfine", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tk-bench-cli-"))
    d = Daemon(tmp, '[daemon]\nlog_level = "warning"\n').start()
    try:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("TURNKEEPER_") and k != "PYTHONDONTWRITEBYTECODE"}
        env["TURNKEEPER_SOCKET"] = str(d.socket)
        # Bytecode cached, as for an installed package (pip compiles it at install time),
        # in a directory of our own so the tree is not touched: the warm-up runs fill it.
        env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
        status = [*turnkeeper_command(), "status"]
        subprocess.run(status, check=True, env=env, stdout=subprocess.DEVNULL)  # it works
        commands = [[sys.executable, "-c", "pass"], status]
        hyperfine = None if args.no_hyperfine else shutil.which("hyperfine")
        how = f"hyperfine ({hyperfine})" if hyperfine else "subprocess loop"
        if hyperfine and any(" " in part for c in commands for part in c):
            hyperfine, how = None, "subprocess loop (a path has a space)"

        def measure(commands: list[list[str]], env: dict[str, str]) -> list[Timing]:
            return (with_hyperfine(hyperfine, commands, args.runs, env) if hyperfine
                    else with_loop(commands, args.runs, env))

        base, tk = measure(commands, env)
        # The same where the package has no bytecode cache (an editable install run with
        # PYTHONDONTWRITEBYTECODE=1, as in this project's sandbox): compiled every start.
        cold_env = {k: v for k, v in env.items() if k != "PYTHONPYCACHEPREFIX"}
        cold_env["PYTHONDONTWRITEBYTECODE"] = "1"
        (cold,) = measure([status], cold_env)
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"cli latency: {args.runs} runs each, {how}; {os.cpu_count()} cores; wall median "
          f"and p90, and CPU (user + sys, mean: steadier than wall on a busy machine)")
    print(f"  {'command':<40}{'median ms':>10}{'p90 ms':>8}{'ratio':>8}{'CPU ms':>8}"
          f"{'ratio':>8}")
    (bt, bc) = base
    for label, (t, c) in (("python -c pass (baseline)", base), ("turnkeeper status", tk),
                          ("turnkeeper status, no bytecode cache", cold)):
        print(f"  {label:<40}{statistics.median(t) * 1e3:>10.1f}{quantile(t, 0.9) * 1e3:>8.1f}"
              f"{statistics.median(t) / statistics.median(bt):>7.2f}x{c * 1e3:>8.1f}"
              f"{c / bc:>7.2f}x")

if __name__ == "__main__":
    main()
