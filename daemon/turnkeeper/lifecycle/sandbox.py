"""Whether the stdio MCP servers of a config can run under the restrictions the daemon
runs with, said before they fail.

A stdio MCP server is the daemon's child and inherits its sandbox. One restriction
breaks a whole family of servers: memory that is writable and executable at once (or made
executable later) denied, as systemd's `MemoryDenyWriteExecute=yes` does (a seccomp
filter; newer systemd and kernels use `PR_SET_MDWE`), as SELinux's `deny_execmem` does. A
JIT compiler needs such memory: Node.js (every `npx` server) aborts at start with V8's
"Check failed: 12 == (*__errno_location ())", and Deno, Bun, a JVM or .NET fail the same
way. The daemon itself needs none, so nothing else shows the problem: the server dies,
is restarted, dies again.

The signal is the restriction itself: an anonymous mapping asked for read, write and
execute (what a JIT asks for) is refused. `PR_GET_MDWE` and the process's seccomp mode
only name which mechanism refused it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

PR_GET_MDWE = 66  # linux/prctl.h, kernel >= 6.3

# What a command's name says about the runtime it starts (the file name, without a
# version suffix: node20, python3.12). Only runtimes that compile to machine code at
# run time by default.
_JIT_RUNTIMES = {
    "node": "Node.js", "nodejs": "Node.js", "npx": "Node.js", "npm": "Node.js",
    "pnpm": "Node.js", "pnpx": "Node.js", "yarn": "Node.js", "tsx": "Node.js",
    "deno": "Deno", "bun": "Bun", "bunx": "Bun",
    "java": "a JVM", "jbang": "a JVM", "kotlin": "a JVM",
    "dotnet": ".NET",
}

REMEDY = (
    "Under systemd: remove MemoryDenyWriteExecute=yes (`systemctl edit turnkeeper`: "
    "[Service] MemoryDenyWriteExecute=no); for Node.js alone, keeping it: run the server "
    "with `node --jitless` or NODE_OPTIONS=--jitless in the tool's env (slower, no "
    "WebAssembly)")


class StdioServer(Protocol):
    """What this module reads of an MCP tool's config."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def command(self) -> str: ...
    @property
    def args(self) -> tuple[str, ...]: ...
    def resolved_env(self) -> dict[str, str]: ...


def jit_runtime(command: str, args: Sequence[str] = (),
                env: Mapping[str, str] | None = None) -> str | None:
    """The JIT runtime `command` starts ("Node.js", "a JVM"...), or None when it starts
    none or is told not to compile (`--jitless`, in its arguments or in the NODE_OPTIONS
    of `env`, the environment the server is given: the daemon's own is not passed on)."""
    base = Path(command).name.lower()
    runtime = _JIT_RUNTIMES.get(base.rstrip("0123456789.-"))
    if runtime is None:
        return None
    if runtime == "Node.js":
        node_options = (env or {}).get("NODE_OPTIONS", "")
        if "--jitless" in args or "--jitless" in node_options.split():
            return None
    return runtime


def _mdwe_flags() -> int:
    """PR_GET_MDWE's flags (0 when off or when the kernel has no such call)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        flags = int(libc.prctl(PR_GET_MDWE, 0, 0, 0, 0))
    except (OSError, AttributeError):
        return 0
    return max(flags, 0)


def _seccomp_mode(status: Path = Path("/proc/self/status")) -> int:
    try:
        for line in status.read_text().splitlines():
            if line.startswith("Seccomp:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def write_execute_denied() -> str | None:
    """How this process is denied memory that is writable and executable, or None when
    it is not (or the probe cannot tell). Its children inherit the denial."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE | getattr(mmap, "PROT_EXEC", 0)
    try:
        probe = mmap.mmap(-1, mmap.PAGESIZE, prot=prot)
    except PermissionError as exc:
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        if _mdwe_flags():
            return f"PR_SET_MDWE is in effect (a writable and executable mapping: {code})"
        if _seccomp_mode() == 2:
            return ("a seccomp filter denies it (systemd's MemoryDenyWriteExecute=yes; a "
                    f"writable and executable mapping: {code})")
        return f"a writable and executable mapping is refused ({code}; SELinux execmem?)"
    except (OSError, ValueError):
        return None
    probe.close()
    return None


def unit_denies_write_execute(unit: str = "turnkeeper.service") -> bool:
    """Whether systemd, if it runs this host, starts `unit` with
    MemoryDenyWriteExecute=yes (its unit file and drop-ins as loaded). False without
    systemd or without the unit."""
    systemctl = shutil.which("systemctl")
    if systemctl is None or not Path("/run/systemd/system").is_dir():
        return False
    try:
        out = subprocess.run([systemctl, "show", "--property=MemoryDenyWriteExecute",
                              "--value", unit], capture_output=True, text=True, timeout=5,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == "yes"


def jit_server_problems(tools: Iterable[StdioServer], denied: str) -> list[str]:
    """One line per stdio MCP server that runs on a JIT, which `denied` (how writable and
    executable memory is denied) keeps from starting, with the remedy."""
    out = []
    for tool in tools:
        if tool.kind != "mcp" or not tool.command:
            continue
        runtime = jit_runtime(tool.command, tool.args, tool.resolved_env())
        if runtime is not None:
            out.append(f"MCP server {tool.name!r} ({tool.command}) runs on {runtime}, a JIT "
                       f"that cannot start here: {denied}. {REMEDY}")
    return out
