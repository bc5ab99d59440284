"""structlog setup: JSON lines on stderr when not a TTY, readable console lines
on a TTY; with JOURNAL_STREAM set, each JSON line carries the `<N>` syslog priority
prefix so journald keeps the level.

Lines from libraries that log through the standard library (aiohttp, asyncio, the MCP
SDK) go through the same processors (`structlog.stdlib.ProcessorFormatter` on the root
logger): a plain-text line among the JSON ones made `jq` abort on the whole stream."""

from __future__ import annotations

import logging as std_logging
import os
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, WrappedLogger

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
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderers: list[Any] = [structlog.processors.format_exc_info]
    if fmt == "json":
        renderers.append(structlog.processors.JSONRenderer(sort_keys=False))
        if os.environ.get("JOURNAL_STREAM"):
            renderers.append(_journald_prefix)
    else:
        renderers.append(structlog.dev.ConsoleRenderer(colors=out.isatty()))
    structlog.configure(
        processors=[*shared, *renderers],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[log_level]),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
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
