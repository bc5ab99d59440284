"""POSIX signals as calls on the supervisor, in the shape of gunicorn's arbiter.

The handler installed with the event loop only enqueues the signal number (anyio's signal
receiver does exactly that); one loop here takes them in order and calls the handler for each.
So a handler runs as ordinary async code in the daemon's task group, never inside a C signal
handler, and two signals never run their handlers at the same time.

Handlers should *request* (set an event, ask for a reload, start a stop) and return quickly: a
SIGTERM that arrives during a long SIGHUP handler waits for it. Reloads coalesce in the
supervisor, so a burst of SIGHUPs costs one reload.
"""

from __future__ import annotations

import inspect
import signal
from collections.abc import Awaitable, Callable, Mapping

import anyio
from anyio.abc import TaskStatus

__all__ = ["DEFAULT_SIGNALS", "SignalHandler", "signal_dispatcher"]

SignalHandler = Callable[[], Awaitable[None] | None]

DEFAULT_SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
"""Reload, stop, stop: SIGHUP reloads, SIGTERM (systemd) and SIGINT (Ctrl-C) both stop."""


async def signal_dispatcher(
    handlers: Mapping[int, SignalHandler],
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Receive the signals named by `handlers`' keys and call each one's handler, in order.

    Start it with `await tg.start(signal_dispatcher, handlers)`: `start` returns once the
    handlers are installed, so `READY=1` is never sent while a SIGTERM would still kill the
    process the default way. Runs until cancelled; on exit anyio restores the default handlers.
    """
    with anyio.open_signal_receiver(*(signal.Signals(n) for n in handlers)) as received:
        task_status.started()
        async for signum in received:
            handler = handlers.get(signum)
            if handler is None:
                continue
            result = handler()
            if inspect.isawaitable(result):
                await result
