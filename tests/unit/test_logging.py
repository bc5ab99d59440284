"""Every log line is one of ours: lines from libraries that log through the standard
library (aiohttp, asyncio, the MCP SDK) are rendered by the same processors, so a JSON
log stays JSON from the first line to the last, and journald keeps their level."""

from __future__ import annotations

import datetime
import io
import json
import logging
import time
from collections.abc import Iterator

import pytest
import structlog

from turnkeeper import logging as tk_logging


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


def test_a_standard_library_line_is_json_with_its_logger_and_level() -> None:
    out = io.StringIO()
    tk_logging.configure(log_format="json", stream=out)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("aiohttp.server").exception("Error handling request")
    logging.getLogger("asyncio").warning("slow callback %s", "x")
    lines = out.getvalue().splitlines()
    records = [json.loads(line) for line in lines]  # every line parses
    assert records[0]["logger"] == "aiohttp.server"
    assert records[0]["level"] == "error"
    assert "ValueError: boom" in records[0]["exception"]
    assert records[1] == {**records[1], "event": "slow callback x", "level": "warning"}


def test_under_journald_a_standard_library_line_carries_its_priority_prefix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
    out = io.StringIO()
    tk_logging.configure(log_format="json", stream=out)
    logging.getLogger("mcp.client").error("server went away")
    structlog.get_logger("turnkeeper").warning("ours")
    first, second = out.getvalue().splitlines()
    assert first.startswith("<3>{")
    assert json.loads(first[3:])["event"] == "server went away"
    assert second.startswith("<4>{")


def test_standard_library_info_lines_stay_out_at_the_info_level() -> None:
    out = io.StringIO()
    tk_logging.configure(log_format="json", log_level="info", stream=out)
    logging.getLogger("aiohttp.access").info("GET /v1/status")
    assert out.getvalue() == ""


def test_a_line_is_stamped_with_the_time_in_utc_to_the_microsecond(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stamp = tk_logging.UtcStamp()
    for now in (1_764_898_990.774567, 1_764_898_990.0, 1_764_898_991.5, 0.25,
                1_764_898_990.9999996):
        monkeypatch.setattr(time, "time", lambda now=now: now)
        line = stamp(None, "info", {})["timestamp"]
        expected = datetime.datetime.fromtimestamp(now, tz=datetime.UTC)
        assert line == expected.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), now
        assert datetime.datetime.fromisoformat(line.replace("Z", "+00:00")) == expected
