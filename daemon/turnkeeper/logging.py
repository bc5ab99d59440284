"""structlog setup: JSON lines on stderr when not a TTY, readable console lines
on a TTY; with JOURNAL_STREAM set, each JSON line carries the `<N>` syslog priority
prefix so journald keeps the level.

Lines from libraries that log through the standard library (aiohttp, asyncio, the MCP
SDK) go through the same processors (`structlog.stdlib.ProcessorFormatter` on the root
logger): a plain-text line among the JSON ones made `jq` abort on the whole stream.

The daemon also keeps its last `RECENT_LINES` lines in memory (`recent`), so
`turnkeeper logs ID` can show a turn's lines without access to the journal; a restart
starts the window afresh, and the journal keeps the rest."""

from __future__ import annotations

import logging as std_logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, WrappedLogger

from turnkeeper import jsonwire

_PRIORITY = {"critical": 2, "error": 3, "warning": 4, "info": 6, "debug": 7}
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


def _journald_prefix(_: WrappedLogger, method: str, event: str | bytes) -> str | bytes:
    if isinstance(event, str):
        return f"<{_PRIORITY.get(method, 6)}>{event}"
    return event


# The context of the turn whose task is logging, read when each line is written (so a
# provider that changed mid-turn shows up at once). Set in the turn's own task, so every
# log line of that task carries it, whichever module writes it.
_turn_context: ContextVar[Callable[[], dict[str, Any]] | None] = ContextVar(
    "turnkeeper_turn_context", default=None)


def bind_turn_context(fields: Callable[[], dict[str, Any]]) -> None:
    """Every later log line of the current task carries `fields()` (keys it sets itself
    win). Bind it in the turn's own task: contextvars are task-local under asyncio."""
    _turn_context.set(fields)


def _merge_turn_context(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    fields = _turn_context.get()
    if fields is not None:
        for key, value in fields().items():
            event_dict.setdefault(key, value)
    return event_dict


RECENT_LINES = 10_000


class RecentLines:
    """The daemon's last log lines, as the dicts they were rendered from (a reference
    each, no copy: a line is never changed once written). Meta keys (`_record`, from the
    standard library's lines) are left out when read."""

    def __init__(self, maxlen: int = RECENT_LINES) -> None:
        self._lines: deque[EventDict] = deque(maxlen=maxlen)
        self._total = 0  # lines ever kept: the number of the newest (`logs -f` reads after it)

    def __repr__(self) -> str:
        return f"RecentLines({len(self._lines)} of {self._lines.maxlen}, {self._total} kept)"

    @property
    def total(self) -> int:
        return self._total

    def keep(self, _: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        self._lines.append(event_dict)
        self._total += 1
        return event_dict

    def lines(self, *, turn: str | None = None, limit: int, after: int = 0
              ) -> list[dict[str, Any]]:
        """The newest `limit` lines (of `turn`, when given; numbered above `after`),
        oldest first. Lines are numbered from 1 as they are kept."""
        picked: list[dict[str, Any]] = []
        found: Iterator[EventDict] = reversed(self._lines)
        number = self._total
        for line in found:
            if number <= after:
                break
            number -= 1
            if turn is None or line.get("turn") == turn:
                picked.append({k: v for k, v in line.items() if not k.startswith("_")})
                if len(picked) >= limit:
                    break
        picked.reverse()
        return picked


recent = RecentLines()


def _dumps(value: Any, **_: Any) -> str:
    """A log line's JSON, encoded as the daemon's events are (`jsonwire`): a third of
    the standard library encoder's time per line."""
    return jsonwire.dumps_any(value)


class UtcStamp:
    """Each line's `timestamp`: the time in UTC, ISO 8601 to the microsecond
    ("2026-12-05T01:23:10.774567Z"), as structlog's `TimeStamper(fmt="iso", utc=True)`
    writes it but for the fraction, always there (it leaves it out on the whole second),
    with the date and the second formatted once a second: 0.9 us a line instead of
    1.7."""

    __slots__ = ("_second",)

    def __init__(self) -> None:
        self._second: tuple[int, str] = (-1, "")  # one tuple: lines come from any thread

    def __call__(self, _: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        now = time.time()
        whole = int(now)
        micros = round((now - whole) * 1_000_000)  # as datetime rounds it
        if micros == 1_000_000:
            whole, micros = whole + 1, 0
        second = self._second
        if second[0] != whole:
            second = self._second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S",
                                                          time.gmtime(whole)))
        event_dict["timestamp"] = f"{second[1]}.{micros:06d}Z"
        return event_dict


def _to_level(_: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
    event_dict.setdefault("level", method if method != "exception" else "error")
    return event_dict


def configure(*, log_format: str = "auto", log_level: str = "info",
              stream: TextIO | None = None) -> None:
    out = stream or sys.stderr
    fmt = log_format
    if fmt == "auto":
        fmt = "console" if out.isatty() else "json"
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        _merge_turn_context,
        _to_level,
        UtcStamp(),
        recent.keep,
    ]
    renderers: list[Any] = [structlog.processors.format_exc_info]
    if fmt == "json":
        renderers.append(structlog.processors.JSONRenderer(serializer=_dumps))
        if os.environ.get("JOURNAL_STREAM"):
            renderers.append(_journald_prefix)
    else:
        renderers.append(structlog.dev.ConsoleRenderer(colors=out.isatty()))
    structlog.configure(
        processors=[*shared, *renderers],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[log_level]),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        # The level and the format are read at start only: a module's logger is bound
        # once, on its first line, not again at every line (1.1 us a line).
        cache_logger_on_first_use=True,
    )
    # Libraries that log through the standard library: the same processors, the same
    # stream, and at least warning (their info lines are noise in a daemon's log).
    handler = std_logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *renderers],
    ))
    root = std_logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(_LEVELS[log_level], 30))
