"""The README's commands, run as a reader runs them.

The first command's `turnkeeper serve` starts the daemon on its embedded defaults and
default paths (a home, a runtime and a state directory of the test's own); then every
line of the tour and of the curl block runs in bash as written, with `t_...` replaced by
the id of a turn the tour submitted and the checkout's `.venv/bin/turnkeeper` by the
one installed beside the Python running the tests. The README's test command is the one
`.ci/run` runs. A line this test does not know how to run fails it: the README and the
test change together.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_provider_configs import ModelServer
from turnkeeper.control.client import Client, ClientError

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

# Commands that run until interrupted: what each must print before Ctrl-C.
LIVE = {
    "events": "turn.queued",
    "events --after 0 --type turn.finished": "finished",
}


def sh_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)


def command_lines(block: str) -> list[str]:
    """The block's commands, without their trailing comments."""
    lines = (re.sub(r"\s+#\s.*$", "", line).strip() for line in block.splitlines())
    return [line for line in lines if line]


def turnkeeper_command() -> str:
    beside = Path(sys.executable).parent / "turnkeeper"
    if beside.exists():
        return str(beside)
    return f"{shlex.quote(sys.executable)} -m turnkeeper"  # pragma: no cover


class Reader:
    """A shell in a fresh home, with the daemon the README's first command starts."""

    def __init__(self, home: Path) -> None:
        runtime = home / "run"
        runtime.mkdir(mode=0o700)
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("TURNKEEPER_", "XDG_"))}
        self.env.update(HOME=str(home), XDG_RUNTIME_DIR=str(runtime),
                        XDG_STATE_HOME=str(home / "state"))
        self.socket = runtime / "turnkeeper" / "control.sock"
        self.home = home
        self.daemon: subprocess.Popen[bytes] | None = None

    def serve(self, line: str) -> None:
        log = open(self.home / "daemon.log", "ab")  # noqa: SIM115 - owned by the process
        self.daemon = subprocess.Popen(["bash", "-c", self.localise(line)], env=self.env,
                                       cwd=self.home, stdout=log, stderr=log,
                                       stdin=subprocess.DEVNULL)
        log.close()
        client = Client(self.socket, timeout=5.0)
        deadline = time.monotonic() + 30
        while True:
            assert self.daemon.poll() is None, (self.home / "daemon.log").read_text()
            try:
                if client.request("GET", "/v1/status")[1]["state"] == "ready":
                    return
            except (ClientError, OSError):
                pass
            assert time.monotonic() < deadline, "the daemon did not become ready"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            self.daemon.wait(timeout=30)

    def localise(self, line: str) -> str:
        return line.replace(".venv/bin/turnkeeper", turnkeeper_command())

    def run(self, line: str, turn_id: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", self.localise(line).replace("t_...", turn_id)],
                              env=self.env, cwd=self.home, capture_output=True, text=True,
                              timeout=60, check=False)

    def run_until(self, line: str, expect: str, during: str = "") -> str:
        """Run a live command until it printed `expect` (running `during` meanwhile),
        then interrupt it as Ctrl-C does; what it printed."""
        proc = subprocess.Popen(["bash", "-c", "exec " + self.localise(line)], env=self.env,
                                cwd=self.home, stdout=subprocess.PIPE,
                                start_new_session=True)
        assert proc.stdout is not None
        if during:
            self.run(during)
        seen = b""
        deadline = time.monotonic() + 30
        while expect.encode() not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                seen += chunk
            elif during:
                # The command may have subscribed only after `during` ran (both start
                # at once): run it again, its events come after the subscription.
                self.run(during)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
        proc.stdout.close()
        return seen.decode()


@pytest.fixture
def reader(tmp_path: Path) -> Iterator[Reader]:
    r = Reader(tmp_path)
    try:
        yield r
    finally:
        r.stop()


def test_the_readme_s_test_command_is_the_one_ci_runs() -> None:
    first, tests = (command_lines(b) for b in sh_blocks()[:2])
    assert first == ["python3 -m venv .venv && .venv/bin/pip install -e . && "
                     ".venv/bin/turnkeeper serve"]
    assert tests == ["python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && "
                     ".venv/bin/python -m pytest -q"]
    ci = (REPO / ".ci" / "run").read_text()
    assert ".venv/bin/pip install -q -e '.[test]'" in ci
    assert "\n.venv/bin/python -m pytest -q\n" in ci


def test_the_readme_s_tour_runs_against_the_daemon_of_its_first_command(
        reader: Reader) -> None:
    blocks = sh_blocks()
    reader.serve(command_lines(blocks[0])[0].rsplit("&& ", 1)[1])
    tour = command_lines(blocks[2])
    assert tour[0].endswith('submit "hello" --follow')
    hello = ""
    for line in tour:
        live = line.split("turnkeeper ", 1)[-1]
        if live in LIVE:
            out = reader.run_until(line, LIVE[live],
                                   during='.venv/bin/turnkeeper submit "while watching"')
            assert LIVE[live] in out, (line, out)
            continue
        out = reader.run(line, hello)
        assert out.returncode == 0, (line, out.stdout, out.stderr)
        if not hello:
            hello = re.search(r"turn (t_[0-9a-f]+) queued", out.stdout).group(1)  # type: ignore[union-attr]
            assert "completed" in out.stdout
        if line.endswith("completion bash)\""):
            continue
        assert out.stdout.strip(), line
    turns = json.loads(reader.run(".venv/bin/turnkeeper turns --json").stdout)["turns"]
    messages = [t["message"] for t in turns]
    assert "hello again" in messages and any("hello from stdin" in m for m in messages)


def test_the_readme_s_curl_lines_answer(reader: Reader) -> None:
    blocks = sh_blocks()
    reader.serve(command_lines(blocks[0])[0].rsplit("&& ", 1)[1])
    curl = command_lines(blocks[3])
    assert curl[0].startswith("SOCK=/tmp/turnkeeper-$(id -u)/control.sock")
    sock = f"SOCK={shlex.quote(str(reader.socket))}; "
    turn_id = ""
    for line in curl[1:]:
        out = reader.run(sock + "curl -sS --fail-with-body " + line.removeprefix("curl "),
                         turn_id)
        assert out.returncode == 0, (line, out.stdout, out.stderr)
        if "/events" in line:
            types = [json.loads(x)["type"] for x in out.stdout.splitlines()]
            assert types[:1] == ["turn.queued"]
            continue
        body = json.loads(out.stdout)
        if "results" in body:  # the batch
            assert [r["status"] for r in body["results"]] == [202, 202]
        elif "turn" in body and not turn_id:
            turn_id = body["turn"]["id"]
    assert turn_id


def test_the_readme_s_real_provider_serves_a_turn(reader: Reader) -> None:
    """The config and the `serve` line of "Connecting a real provider", the vendor's
    endpoint moved to a model server of our own (as OPENAI_BASE_URL does)."""
    text = README.read_text()
    section = text.split("\n## Connecting a real provider\n", 1)[1].split("\n## ", 1)[0]
    toml = re.findall(r"```toml\n(.*?)```", section, re.S)
    serve = command_lines(re.findall(r"```sh\n(.*?)```", section, re.S)[0])
    assert len(toml) == 1 and len(serve) == 1 and "--config turnkeeper.toml" in serve[0]
    (reader.home / "turnkeeper.toml").write_text(toml[0])
    server = ModelServer()
    try:
        reader.env["OPENAI_BASE_URL"] = server.url + "/v1"
        reader.serve(serve[0])
        out = reader.run('.venv/bin/turnkeeper submit "Say done." --wait')
        assert out.returncode == 0, (out.stdout, out.stderr)
        assert "completed" in out.stdout
        headers = {k.lower(): v for k, v in server.requests[-1]["headers"].items()}
        assert headers["authorization"] == "Bearer sk-..."
    finally:
        reader.stop()
        server.close()


def _collect(argv: list[str]) -> set[str]:
    out = subprocess.run([*argv, "--collect-only", "-p", "no:cacheprovider"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return {line for line in out.stdout.splitlines() if "::" in line}


def test_the_readme_s_fast_test_command_selects_the_unit_tests_without_postgres() -> None:
    """The command beside the test command, collected (not run: that is the suite's job):
    it must name unit tests, and none of those the `postgres` marker selects."""
    text = README.read_text()
    commands = re.findall(r"`(\.venv/bin/python -m pytest [^`]+)`", text)
    assert commands == ['.venv/bin/python -m pytest -q -m "not postgres" tests/unit']
    argv = shlex.split(commands[0].replace(".venv/bin/python", shlex.quote(sys.executable)))
    fast = _collect(argv)
    postgres = _collect([sys.executable, "-m", "pytest", "-q", "-m", "postgres",
                         "tests/unit"])
    assert fast and postgres and not fast & postgres
    assert all(test.startswith("tests/unit/") for test in fast)
