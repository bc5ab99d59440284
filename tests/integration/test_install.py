"""The Install section of docs/operations.md, followed line by line in a throw-away root.

Each command of the section's code block runs as written, with its absolute paths moved
under the temporary root: the package is built and installed into a fresh venv there
(its dependencies lent from the test's own environment through a `.pth`, so the test
needs no network), the units, sysusers.d and tmpfiles.d files are installed and applied
with `--root`, the example config is installed for the `turnkeeper` group and checked.
`systemctl` has no PID 1 to talk to here: the daemon is started as the unit starts it
(its ExecStart= and Environment=, and the directories systemd would hand it), and the
section's last command must then complete a turn. A line this test does not know how to
follow fails it: the section and the test change together.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEMD_TOOLS = ("systemd-sysusers", "systemd-tmpfiles")


def install_block() -> list[str]:
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("## Install", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines()
            if line.split("#", 1)[0].strip()]


@pytest.fixture
def root() -> Iterator[Path]:
    if os.getuid() != 0:
        pytest.skip("the install runs as root (chown to the turnkeeper user)")
    missing = [t for t in SYSTEMD_TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed")
    path = Path(tempfile.mkdtemp(prefix="tk-root-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def clean_env() -> dict[str, str]:
    """The environment without what would make the installed command import anything but
    what was installed (a PYTHONPATH into the checkout) or find another daemon."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("TURNKEEPER_") and k != "PYTHONPATH"}


class Installer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.daemon: subprocess.Popen[bytes] | None = None
        self.log = root / "daemon.log"

    def rooted(self, word: str) -> str:
        return str(self.root) + word if word.startswith("/") else word

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300,
                             check=False)
        assert out.returncode == 0, f"{shlex.join(argv)}:\n{out.stdout}\n{out.stderr}"
        return out

    def gid(self, group: str) -> str:
        for line in (self.root / "etc" / "group").read_text().splitlines():
            name, _, gid, _ = line.split(":", 3)
            if name == group:
                return gid
        raise AssertionError(f"no group {group} in the root's /etc/group")

    def follow(self, command: str) -> None:
        argv = shlex.split(command)
        tool = argv[0]
        if tool == "python3" and argv[1:3] == ["-m", "venv"]:
            venv = Path(self.rooted(argv[3]))
            self.run([sys.executable, "-m", "venv", str(venv)])
            # The dependencies come from this test's environment, not the network.
            (next(venv.glob("lib/python3*/site-packages")) / "lent.pth").write_text(
                "\n".join(site.getsitepackages()) + "\n")
        elif tool.endswith("/pip") and argv[1:] == ["install", "."]:
            self.run([self.rooted(tool), "install", "-q", "--no-deps",
                      "--no-build-isolation", "."])
        elif tool == "ln" and argv[1] == "-s":
            link = Path(self.rooted(argv[3]))
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(self.rooted(argv[2]))
        elif tool == "install":
            args = [self.rooted(a) for a in argv[1:]]
            if "-g" in args:
                i = args.index("-g") + 1
                args[i] = self.gid(args[i])
            Path(args[-1] if args[-1].endswith("/") else Path(args[-1]).parent).mkdir(
                parents=True, exist_ok=True)
            self.run(["install", *args])
        elif tool in SYSTEMD_TOOLS:
            self.run([tool, f"--root={self.root}", *(self.rooted(a) for a in argv[1:])])
        elif tool == "systemctl":
            if "enable" in argv:
                self.start_as_the_unit_does()
        elif tool == "turnkeeper":
            env = {**clean_env(), "TURNKEEPER_SOCKET": self.socket()}
            out = subprocess.run([self.rooted("/usr/bin/turnkeeper"),
                                  *(self.rooted(a) for a in argv[1:])], env=env,
                                 capture_output=True, text=True, timeout=60, check=False)
            assert out.returncode == 0, (command, out.stdout, out.stderr,
                                         self.log.read_text() if self.log.exists() else "")
        else:
            raise AssertionError(f"the Install section has a step this test cannot "
                                 f"follow: {command!r}")

    def unit(self) -> str:
        return (self.root / "etc/systemd/system/turnkeeper.service").read_text()

    def socket(self) -> str:
        found = re.search(r"^Environment=TURNKEEPER_SOCKET=(\S+)$", self.unit(), re.M)
        assert found, "the unit sets TURNKEEPER_SOCKET"
        return self.rooted(found.group(1))

    def start_as_the_unit_does(self) -> None:
        exec_start = re.search(r"^ExecStart=(.+)$", self.unit(), re.M)
        assert exec_start
        argv = [self.rooted(a) for a in shlex.split(exec_start.group(1))]
        env = clean_env()
        # systemd hands StateDirectory= to the unit's User=, the user the daemon runs as;
        # this test runs it as itself (the interpreter under /root is not reachable by
        # the service user), so the directory is handed to this user, or the daemon
        # rightly refuses a state directory another user owns.
        state = Path(self.rooted("/var/lib/turnkeeper"))
        if state.exists():
            os.chown(state, os.getuid(), os.getgid())
        env.update(TURNKEEPER_SOCKET=self.socket(),
                   STATE_DIRECTORY=self.rooted("/var/lib/turnkeeper"),
                   RUNTIME_DIRECTORY=self.rooted("/run/turnkeeper"))
        with open(self.log, "wb") as log:
            self.daemon = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while not Path(self.socket()).exists():
            assert self.daemon.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "the daemon did not bind its socket"
            time.sleep(0.05)


@pytest.mark.slow
def test_the_install_section_works_as_written_in_a_fresh_root(root: Path) -> None:
    installer = Installer(root)
    steps = install_block()
    assert steps[-1].startswith("turnkeeper submit --wait")
    try:
        for command in steps:
            for part in command.split(" && "):
                installer.follow(part.strip())
        assert installer.daemon is not None, "the section never starts the service"
        etc = root / "etc" / "turnkeeper" / "turnkeeper.toml"
        assert oct(etc.stat().st_mode & 0o777) == "0o640"
        assert str(etc.stat().st_gid) == installer.gid("turnkeeper")
        assert (root / "var/lib/turnkeeper/turnkeeper.sqlite3").exists()
        # turnkeeper(1) came with the package, generated from the parser, and is linked
        # where man looks.
        page = root / "usr/local/share/man/man1/turnkeeper.1"
        assert page.resolve().is_file(), page
        assert page.read_text().startswith(".TH TURNKEEPER 1")
        assert "config show" in page.read_text()
    finally:
        if installer.daemon is not None:
            installer.daemon.terminate()
            installer.daemon.wait(30)
