"""A bytecode cache for every daemon a benchmark starts.

This project's sandbox runs with PYTHONDONTWRITEBYTECODE=1 and the package is an
editable install, so a daemon started as it is compiles every module of its own at each
start: a reload, a restart or a node's start-up measured that way measures the
compiler. `use_bytecode_cache()` drops the variable from the benchmark's environment
(which the daemons it starts inherit) and points PYTHONPYCACHEPREFIX at a directory
kept between runs, compiled once here; it returns a line saying what it did, which the
benchmark prints.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

DAEMON_SOURCE = Path(__file__).resolve().parent.parent / "daemon"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or tempfile.gettempdir()
    return Path(base) / "turnkeeper-bench-pycache"


def use_bytecode_cache() -> str:
    had = os.environ.pop("PYTHONDONTWRITEBYTECODE", "")
    prefix = cache_dir()
    prefix.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(DAEMON_SOURCE)],
                   env=os.environ.copy(), check=False, stdout=subprocess.DEVNULL)
    note = " (PYTHONDONTWRITEBYTECODE was set: dropped for the daemons)" if had else ""
    return f"bytecode cache: {prefix}{note}"
