"""Operators can see everything: /metrics counts exactly what happened, `follow`
draws a turn live on a real terminal, and every log line of a turn says which turn,
session, policy version and provider it is about.

The real daemon runs as a subprocess; metrics are scraped over its Unix socket (and a
TCP address on 127.0.0.1) and parsed with prometheus-client's own parser; `follow` runs
under a pseudo-terminal whose output goes through a terminal emulator (pyte), so the
assertions read the screen a person would see.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import pty
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyte
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import Daemon, script_file

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("turnkeeper", timeout=10)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(str(self._path))
        self.sock = sock


def get_metrics(d: Daemon, accept: str | None = None) -> tuple[str, str]:
    """(content type, body) of GET /metrics on the control socket."""
    conn = _Unix(d.socket)
    try:
        conn.request("GET", "/metrics", headers={"Accept": accept} if accept else {})
        resp = conn.getresponse()
        body = resp.read().decode()
        assert resp.status == 200, body
        return resp.getheader("Content-Type") or "", body
    finally:
        conn.close()


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def scrape(d: Daemon) -> Samples:
    return parse(get_metrics(d)[1])


def value(samples: Samples, metric: str, /, **labels: str) -> float:
    """One sample's value; a missing sample is a failure, not a silent zero."""
    key = (metric, frozenset(labels.items()))
    assert key in samples, f"no sample {metric}{labels}; have " + ", ".join(
        sorted(f"{n}{dict(lb)}" for n, lb in samples if n == metric))
    return samples[key]


def delta(before: Samples, after: Samples, metric: str, /, **labels: str) -> float:
    key = (metric, frozenset(labels.items()))
    return value(after, metric, **labels) - before.get(key, 0.0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def provider(tmp: Path, name: str, script: str) -> str:
    path = script_file(tmp / f"{name}.toml", script)
    return f'[[providers]]\nname = "{name}"\nkind = "scripted"\nscript = "{path}"\n'


ECHO_TOOL = """
[[tools]]
name = "echo"
kind = "echo"
description = "echo"
idempotent = true
"""

TOOL_THEN_ANSWER = """
[[scenarios]]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { text = "step $step" } }]
usage = { input_tokens = 100, output_tokens = 10 }
[[scenarios.steps]]
reply = "done: $last_tool_result"
usage = { input_tokens = 120, output_tokens = 7 }
"""

# The primary answers 503 to every attempt; the fallback answers.
ALWAYS_503 = """
[[scenarios]]
[[scenarios.steps]]
fail = [{ status = 503, forever = true }]
reply = "never"
"""
ANSWERS = """
[[scenarios]]
match = "stop"
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { text = "step $step" } }]
usage = { input_tokens = 50, output_tokens = 5 }
[[scenarios]]
[[scenarios.steps]]
reply = "fallback answered"
usage = { input_tokens = 50, output_tokens = 5 }
"""

FAST_RETRIES = """
[agent]
api_max_retries = 1
recovery_schedule = [0.05]
recovery_jitter = 0.0
auto_recovery_cycles = 1
[retry]
base_delay = 0.01
max_delay = 0.02
[circuit_breaker]
failure_threshold = 2
cooldown = 60.0
"""


def failover_config(tmp: Path) -> str:
    return (FAST_RETRIES + provider(tmp, "primary", ALWAYS_503)
            + provider(tmp, "fallback", ANSWERS) + ECHO_TOOL)


# -- metrics ---------------------------------------------------------------------------


def test_metrics_count_a_completed_turn_exactly(start: Any, tmp_path: Path) -> None:
    port = free_port()
    d = start(f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
              + provider(tmp_path, "primary", TOOL_THEN_ANSWER) + ECHO_TOOL)
    content_type, text = get_metrics(d)
    assert content_type.startswith("text/plain; version=0.0.4")
    before = parse(text)
    assert value(before, "turnkeeper_turns_finished_total", status="completed",
                 code="completed") == 0
    turn = d.run("count me")
    assert turn["result"]["stopped_because"]["code"] == "completed"
    after = scrape(d)
    assert delta(before, after, "turnkeeper_turns_submitted_total") == 1
    assert delta(before, after, "turnkeeper_turns_finished_total", status="completed",
                 code="completed") == 1
    assert delta(before, after, "turnkeeper_provider_requests_total", provider="primary") == 2
    assert delta(before, after, "turnkeeper_provider_attempts_total", provider="primary",
                 **{"class": "success"}) == 2
    for cls in ("retryable", "deterministic", "unknown"):
        assert delta(before, after, "turnkeeper_provider_attempts_total", provider="primary",
                     **{"class": cls}) == 0
    assert delta(before, after, "turnkeeper_tokens_total", provider="primary",
                 direction="input") == 220
    assert delta(before, after, "turnkeeper_tokens_total", provider="primary",
                 direction="output") == 17
    assert delta(before, after, "turnkeeper_tool_calls_total", tool="echo", outcome="ok") == 1
    assert delta(before, after, "turnkeeper_step_duration_seconds_count") == 2
    assert value(after, "turnkeeper_step_duration_seconds_sum") > 0
    for state in ("queued", "running", "recovering", "waiting", "suspended"):
        assert value(after, "turnkeeper_turns", state=state) == 0
    assert value(after, "turnkeeper_queue_depth") == 0
    assert value(after, "turnkeeper_daemon_state", state="ready") == 1
    assert value(after, "turnkeeper_policy_version") == 1
    assert value(after, "turnkeeper_breaker_state", kind="provider", name="primary",
                 state="closed") == 1
    # The event-loop lag task has measured by now (it wakes every 0.25 s).
    deadline = time.monotonic() + 5
    while value(scrape(d), "turnkeeper_event_loop_lag_observed_seconds_count") < 1:
        assert time.monotonic() < deadline, "no event-loop lag measurement in 5 s"
        time.sleep(0.05)
    # The same registry on the TCP address, for a Prometheus scrape; nothing else there.
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        tcp = parse(resp.read().decode())
    assert value(tcp, "turnkeeper_turns_finished_total", status="completed",
                 code="completed") == 1
    with contextlib.suppress(urllib.error.HTTPError), urllib.request.urlopen(
            f"http://127.0.0.1:{port}/v1/status", timeout=10) as resp:
        raise AssertionError(f"the control API answered on TCP: {resp.status}")
    # OpenMetrics when the scraper asks for it.
    content_type, text = get_metrics(d, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert text.rstrip().endswith("# EOF")


def test_metrics_count_retries_failover_and_the_open_breaker(start: Any,
                                                             tmp_path: Path) -> None:
    d = start(failover_config(tmp_path))
    before = scrape(d)
    turn = d.run("fail over please")
    assert turn["result"]["stopped_because"]["code"] == "completed"
    assert turn["provider"] == "fallback"
    after = scrape(d)
    # api_max_retries = 1: two attempts on the primary (one retry), then the failover.
    assert delta(before, after, "turnkeeper_provider_attempts_total", provider="primary",
                 **{"class": "retryable"}) == 2
    assert delta(before, after, "turnkeeper_retries_scheduled_total", provider="primary",
                 **{"class": "retryable"}) == 1
    assert delta(before, after, "turnkeeper_failovers_total", **{"from": "primary"},
                 to="fallback", reason="attempts_spent") == 1
    assert delta(before, after, "turnkeeper_provider_attempts_total", provider="fallback",
                 **{"class": "success"}) == 1
    assert delta(before, after, "turnkeeper_provider_attempts_total", provider="primary",
                 **{"class": "success"}) == 0
    assert delta(before, after, "turnkeeper_recovery_cycles_total") == 0
    assert delta(before, after, "turnkeeper_turns_finished_total", status="completed",
                 code="completed") == 1
    # Two consecutive failures opened the primary's breaker (cooldown 60 s): read from
    # the shared breakers at scrape time.
    assert value(after, "turnkeeper_breaker_state", kind="provider", name="primary",
                 state="open") == 1
    assert value(after, "turnkeeper_breaker_state", kind="provider", name="primary",
                 state="closed") == 0
    assert value(after, "turnkeeper_breaker_state", kind="provider", name="fallback",
                 state="closed") == 1
    # The next turn finds the breaker open: a hop with no attempt on the primary.
    d.run("again")
    again = scrape(d)
    assert delta(after, again, "turnkeeper_provider_requests_total", provider="primary") == 0
    assert delta(after, again, "turnkeeper_failovers_total", **{"from": "primary"},
                 to="fallback", reason="breaker_open") == 1
    # `turnkeeper status` shows the open breaker to a person, and as JSON to a script.
    base = [sys.executable, "-m", "turnkeeper", "--socket", str(d.socket), "status"]
    out = subprocess.run(base, capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert "primary OPEN" in out.stdout and "fallback closed" in out.stdout
    assert "policy       v1" in out.stdout
    out = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=30,
                         check=False)
    status = json.loads(out.stdout)
    assert status["breakers"] == {"primary": "open", "fallback": "closed"}
    assert status["reloads"] == {"count": 0, "failures": 0, "unchanged": 0}


def test_metrics_count_a_recovery_cycle_a_budget_stop_and_reloads(start: Any,
                                                                  tmp_path: Path) -> None:
    # One provider that fails once then answers: with api_max_retries = 0 the failure
    # spends the chain, so the turn recovers once (0.05 s), then completes.
    once = """
[[scenarios]]
match = "recover"
[[scenarios.steps]]
fail = [{ status = 503 }]
reply = "recovered"
[[scenarios]]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { text = "step $step" } }]
"""
    config = FAST_RETRIES.replace("api_max_retries = 1", "api_max_retries = 0") + provider(
        tmp_path, "only", once) + ECHO_TOOL
    d = start(config)
    before = scrape(d)
    turn = d.run("recover please")
    assert turn["result"]["stopped_because"]["code"] == "completed"
    mid = scrape(d)
    assert delta(before, mid, "turnkeeper_recovery_cycles_total") == 1
    assert delta(before, mid, "turnkeeper_provider_attempts_total", provider="only",
                 **{"class": "retryable"}) == 1
    assert delta(before, mid, "turnkeeper_provider_attempts_total", provider="only",
                 **{"class": "success"}) == 1
    # No retry on the same provider (api_max_retries = 0): the series was never made.
    assert ("turnkeeper_retries_scheduled_total",
            frozenset({("provider", "only"), ("class", "retryable")})) not in mid
    # A budget stop: two steps allowed, every step calls a tool.
    stopped = d.run("loop on tools", budget={"max_steps": 2})
    sb = stopped["result"]["stopped_because"]
    assert (sb["code"], sb["counter"], sb["value"], sb["limit"]) == ("budget.steps", "steps",
                                                                    2, 2)
    after = scrape(d)
    assert delta(mid, after, "turnkeeper_turns_finished_total", status="partial",
                 code="budget.steps") == 1
    assert delta(mid, after, "turnkeeper_tool_calls_total", tool="echo", outcome="ok") == 2
    assert delta(mid, after, "turnkeeper_turns_finished_total", status="completed",
                 code="completed") == 0
    # Reloads: one refused (invalid config), one applied; the refusal shows until then.
    d.config_path.write_text(d.config_path.read_text() + "\n[budget]\nmax_stepz = 1\n")
    status, _ = d.post("/v1/reload")
    assert status == 422
    refused = scrape(d)
    assert delta(after, refused, "turnkeeper_reloads_total", result="failed") == 1
    assert value(refused, "turnkeeper_last_reload_failed") == 1
    # The fixed config also asks for a TCP metrics address: that needs a restart.
    port = free_port()
    d.set_config(config + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
    status, data = d.post("/v1/reload")
    assert status == 200, data
    assert data["pending_restart"] == ["metrics.listen"]
    with socket.socket() as s, contextlib.suppress(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))
        raise AssertionError("metrics.listen was bound without a restart")
    reloaded = scrape(d)
    assert delta(refused, reloaded, "turnkeeper_reloads_total", result="ok") == 1
    assert delta(refused, reloaded, "turnkeeper_reload_duration_seconds_count") == 1
    assert value(reloaded, "turnkeeper_last_reload_failed") == 0
    assert value(reloaded, "turnkeeper_policy_version") == 2


# -- logs ------------------------------------------------------------------------------


def test_every_log_line_of_a_turn_carries_its_context_and_one_stop_line(
        start: Any, tmp_path: Path) -> None:
    d = start(failover_config(tmp_path))
    turn = d.run("log me")
    stopped = d.run("log my stop", budget={"max_tokens": 1})
    d.stop()
    records = d.log_records()
    assert records, d.log_text()[-2000:]
    mine = [r for r in records if r.get("turn") in (turn["id"], stopped["id"])]
    events = {r["event"] for r in mine}
    for expected in ("turn.queued", "model.attempt_failed", "model.retry_scheduled",
                     "model.failover", "turn.finished"):
        assert expected in events, (expected, sorted(events))
    for r in mine:
        for key in ("session", "policy_version", "provider"):
            assert r.get(key) not in (None, ""), (key, r)
        assert r["policy_version"] == 1
    # The provider is the one the turn is on when the line is written.
    failed = [r for r in mine if r["event"] == "model.attempt_failed"]
    assert {r["provider"] for r in failed} == {"primary"}
    finished = [r for r in mine if r["event"] == "turn.finished"]
    assert sorted(r["turn"] for r in finished) == sorted([turn["id"], stopped["id"]])
    by_turn = {r["turn"]: r for r in finished}
    assert by_turn[turn["id"]]["provider"] == "fallback"
    stop = by_turn[stopped["id"]]
    assert (stop["code"], stop["counter"], stop["limit"]) == ("budget.tokens", "tokens", 1)
    # A budget of one token holds no request: the turn stops before its first call,
    # having spent nothing.
    assert stop["value"] == stopped["result"]["stopped_because"]["value"] == 0
    for counter in ("provider_attempts", "fallback_hops", "restarts", "recovery_cycles",
                    "steps", "tokens", "seconds", "cost_usd"):
        assert counter in stop, counter
    assert stop["tokens"] == stopped["usage"]["total_tokens"]


# -- follow on a terminal --------------------------------------------------------------


class Terminal:
    """A command on a pseudo-terminal, its output fed to a terminal emulator."""

    def __init__(self, argv: list[str], cols: int = 110, rows: int = 40) -> None:
        self.screen = pyte.Screen(cols, rows)
        self.stream = pyte.ByteStream(self.screen)
        self.frames: list[str] = []
        self.raw = b""
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(cols),
               "LINES": str(rows)}
        env.pop("NO_COLOR", None)
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     close_fds=True, start_new_session=True)
        os.close(slave)
        self.fd = master
        self.exit_code: int | None = None

    def text(self) -> str:
        return "\n".join(line.rstrip() for line in self.screen.display).rstrip()

    def _pump(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        if not data:
            return False
        self.raw += data
        self.stream.feed(data)
        self.frames.append(self.text())
        return True

    def wait_for(self, predicate: Callable[[str], bool], timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.text()):
                return self.text()
            if not self._pump(0.05):
                break
        raise AssertionError(f"screen never matched; last screen:\n{self.text()}")

    def finish(self, timeout: float = 30.0) -> int:
        """Read to the end of the output (EIO once the command exits), then reap it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._pump(0.1):
            pass
        try:
            self.exit_code = self.proc.wait(max(0.1, deadline - time.monotonic()))
        finally:
            os.close(self.fd)
        return self.exit_code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def bar_line(screen: str, name: str) -> str:
    line = next((ln for ln in screen.splitlines() if ln.startswith(name + " ")), None)
    assert line is not None, f"no {name} bar on the screen:\n{screen}"
    return line


def test_follow_on_a_terminal_draws_budget_bars_a_retry_countdown_and_the_stop(
        start: Any, tmp_path: Path) -> None:
    script = """
[[scenarios]]
[[scenarios.steps]]
fail = [{ status = 503, retry_after = 0.8 }]
tool_calls = [{ name = "echo", arguments = { text = "step $step" } }]
usage = { input_tokens = 300, output_tokens = 20 }
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { text = "step $step" } }]
usage = { input_tokens = 400, output_tokens = 30 }
"""
    d = start("[retry]\nbase_delay = 0.01\n" + provider(tmp_path, "primary", script)
              + ECHO_TOOL)
    term = Terminal([sys.executable, "-m", "turnkeeper", "--socket", str(d.socket), "submit",
                     "work in steps", "--max-steps", "2", "--max-tokens", "1000", "--follow"])
    try:
        # While the turn waits out the Retry-After, the view counts down.
        waiting = term.wait_for(lambda s: "retry in" in s and "steps" in s)
        assert "503" in waiting and "primary" in waiting
        code = term.finish()
    finally:
        term.kill()
    screen = term.text()
    assert code == 4, screen  # partial
    tokens, steps = bar_line(screen, "tokens"), bar_line(screen, "steps")
    bar_line(screen, "seconds")
    assert "750 / 1,000" in tokens and "█" in tokens and "░" in tokens
    assert "2 / 2" in steps and "░" not in steps
    assert "budget.steps" in screen
    assert "steps = 2 of limit 2" in screen
    assert "step budget of 2 steps spent" in screen
    countdowns = {ln.split("retry in ")[1].split(" s")[0] for frame in term.frames
                  for ln in frame.splitlines() if "retry in " in ln}
    assert len(countdowns) >= 2, countdowns  # it moved


def test_follow_id_attaches_counts_down_a_clarify_question_and_shows_the_answer(
        start: Any, tmp_path: Path) -> None:
    script = """
[[scenarios]]
[[scenarios.steps]]
tool_calls = [{ name = "clarify", arguments = { question = "which colour?" } }]
[[scenarios.steps]]
reply = "painting it $last_tool_result, as asked"
chunks = ["painting it ", "$last_tool_result", ", as asked"]
"""
    d = start("[clarify]\ntimeout = 600.0\n" + provider(tmp_path, "primary", script))
    turn = d.submit("paint the fence")
    term = Terminal([sys.executable, "-m", "turnkeeper", "--socket", str(d.socket), "follow",
                     turn["id"]])
    try:
        waiting = term.wait_for(lambda s: "clarify in" in s)
        assert "which colour?" in waiting
        left = float(waiting.split("clarify in ")[1].split(" s")[0])
        assert 590 < left <= 600
        assert "waiting" in waiting
        status, _ = d.post(f"/v1/turns/{turn['id']}/messages", {"kind": "answer",
                                                                 "text": "green"})
        assert status == 202
        code = term.finish()
    finally:
        term.kill()
    screen = term.text()
    assert code == 0, screen
    # The result says its status once (as `show` does), never `completed: completed`.
    assert "│completed" in screen.replace(" ", "") and "completed: completed" not in screen
    assert "painting it green, as asked" in screen
    # An unknown turn: one plain line, no view drawn.
    term = Terminal([sys.executable, "-m", "turnkeeper", "--socket", str(d.socket), "follow",
                     "t_0000000000000000"])
    try:
        assert term.finish() == 1  # reached, answered 404: not "unreachable"
    finally:
        term.kill()
    assert term.text() == "turnkeeper: HTTP 404: no turn t_0000000000000000"


def test_follow_json_prints_the_events_and_plain_follow_prints_lines(
        start: Any, tmp_path: Path) -> None:
    d = start(provider(tmp_path, "primary", TOOL_THEN_ANSWER) + ECHO_TOOL)
    turn = d.run("json please")
    base = [sys.executable, "-m", "turnkeeper", "--socket", str(d.socket), "follow",
            turn["id"]]
    out = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert events[0]["type"] == "turn.queued"
    assert events[-1]["type"] == "turn.finished"
    assert events[-1]["result"]["status"] == "completed"
    out = subprocess.run(base, capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0
    assert "\x1b[" not in out.stdout  # not a terminal: plain lines, no drawing
    assert "tool.call" in out.stdout and "completed" in out.stdout
