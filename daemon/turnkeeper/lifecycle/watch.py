"""Config file watching: report each change of the config file's *content*.

What is watched is the file's directory, not the file: editors save by writing a new file and
renaming it over the old one (the old inode, which a file watch would follow, is gone), and a
Kubernetes ConfigMap volume swaps a `..data` symlink to a new timestamped directory. Events are
only a hint that something may have changed; the decision is the content hash (sha256 of the
bytes): the same bytes written again, a `touch`, or a swap to an identical ConfigMap report
nothing. The file is also hashed whenever a watcher (re)starts and every `rescan_s` seconds
without an event, which covers the gap between loading the config and watching it and
filesystems that lose events (NFS, some bind mounts).

A missing or unreadable file *is* reported, once (`ConfigChange.sha256 is None`, with the
error): the reload step then fails with "file missing", keeps the running policy and says so in
`STATUS=`; the operator sees it instead of a silent watcher. When the file comes back, that is a
change again (even to the old bytes), and the reload clears the error.

`config_changes` is the iterator (cancel it and it stops within `step_ms`; a failing watcher
is retried, never raised); `watch_config` is the same as a callback task.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import anyio
import structlog
import watchfiles

__all__ = [
    "K8S_DATA_LINK",
    "ConfigChange",
    "ContentTracker",
    "WatchPlan",
    "config_changes",
    "read_config_state",
    "watch_config",
    "watch_plan",
]

K8S_DATA_LINK = "..data"
"""The symlink a Kubernetes ConfigMap/Secret volume swaps atomically on every update."""

_log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ConfigChange:
    """The config file's content changed: its new sha256, or None with the reason it is gone."""

    path: Path
    sha256: str | None
    error: str | None = None
    # The daemon could not read the file for want of its own resources (descriptors,
    # memory): that says nothing of the file, so it is no change; the next read decides.
    transient: bool = False


# A read that failed for one of these failed for want of the daemon's own resources.
_TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN,
                               errno.EINTR})


def read_config_state(path: Path) -> ConfigChange:
    """Hash the file's bytes now (blocking: run it in a thread from async code)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ConfigChange(path, None, f"config file missing: {path}")
    except OSError as exc:
        return ConfigChange(path, None, f"config file unreadable: {path}: {exc.strerror or exc}",
                            transient=exc.errno in _TRANSIENT_ERRNOS)
    return ConfigChange(path, hashlib.sha256(data).hexdigest())


class ContentTracker:
    """Remembers the last content hash seen; `observe` says whether a new one is a change."""

    def __init__(self, last: str | None) -> None:
        self.last = last

    def observe(self, state: ConfigChange) -> bool:
        """A read that failed for want of the daemon's own resources is no change: it
        would report a reload failure for a file nobody touched, then a reload of the
        same content once the read works again."""
        if state.transient:
            _log.warning("config_watch.read_failed", path=str(state.path), error=state.error)
            return False
        if state.sha256 == self.last:
            return False
        self.last = state.sha256
        return True

    def __repr__(self) -> str:
        return f"ContentTracker(last={self.last!r})"


@dataclass(frozen=True)
class WatchPlan:
    """Which directories to watch and which entry names in them can change the file."""

    dirs: tuple[Path, ...]
    names: frozenset[str]
    any_name: bool

    def matches(self, changed: str) -> bool:
        entry = Path(changed)
        if entry.name in self.names or entry in self.dirs:
            return True  # a watched directory itself: how the polling backend reports a rename
        return self.any_name and entry.parent == self.dirs[0]

    def watch_filter(self, _change: object, changed: str) -> bool:
        """`watchfiles`' filter signature: drop events that cannot change the file."""
        return self.matches(changed)


def watch_plan(path: Path) -> WatchPlan:
    """The plan for `path`, from where it points *now* (recomputed after every event).

    - the file's own directory, for its name and for `..data` (Kubernetes);
    - when the path resolves through a symlink to another directory (`config.toml ->
      ..data/config.toml`, or `/srv/conf/real.toml`), that directory and the target's name
      too, and every entry of the file's own directory, since any of them may be the link
      that is swapped. The plan changes with the link; the watcher then starts over.
    """
    path = path.absolute()
    parent = path.parent
    names = {path.name, K8S_DATA_LINK}
    dirs = [parent]
    any_name = False
    resolved = path.resolve()
    if resolved != path:
        names.add(resolved.name)
        if resolved.parent != parent.resolve():
            dirs.append(resolved.parent)
            any_name = True
    return WatchPlan(tuple(dirs), frozenset(names), any_name)


async def _read(path: Path) -> ConfigChange:
    return await anyio.to_thread.run_sync(read_config_state, path)


class _Halt:
    """The stop flag handed to the watcher thread: ours (set when the consumer is cancelled)
    or the caller's `stop_event`. The thread only calls `is_set()`; watchfiles may `set()`."""

    def __init__(self, outer: anyio.Event | None) -> None:
        self._outer = outer
        self._set = False

    def is_set(self) -> bool:
        return self._set or (self._outer is not None and self._outer.is_set())

    def set(self) -> None:
        self._set = True


async def _next_events(
    watcher: AsyncGenerator[set[tuple[watchfiles.Change, str]], None], halt: _Halt
) -> set[tuple[watchfiles.Change, str]] | None:
    """The watcher's next batch, or None when it stopped; cancellable at once.

    `awatch` waits in a worker thread that anyio does not abandon, so cancelling it directly
    waits for the thread's own timeout (seconds, measured: ~5 s). Here the wait runs in a child
    task and a cancellation of ours sets `halt`, which the thread checks every `step_ms`.
    """
    outcome: list[set[tuple[watchfiles.Change, str]] | None] = []
    failure: list[OSError] = []

    async def pull() -> None:
        try:
            outcome.append(await anext(watcher, None))
        except OSError as exc:
            failure.append(exc)
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(pull)
        try:
            await anyio.sleep_forever()
        finally:
            if not (outcome or failure):
                halt.set()  # cancelled from outside: wake the thread
    if failure:
        raise failure[0]
    return outcome[0] if outcome else None


async def config_changes(
    path: Path,
    *,
    initial_hash: str | None = None,
    debounce_ms: int = 1600,
    step_ms: int = 100,
    rescan_s: float = 5.0,
    retry_s: float = 5.0,
    stop_event: anyio.Event | None = None,
    force_polling: bool | None = None,
) -> AsyncGenerator[ConfigChange, None]:
    """Yield a `ConfigChange` each time the content hash of `path` differs from the last seen.

    `initial_hash` is the sha256 the running policy was loaded from (`PolicyVersion.content_hash`;
    None: hash the file now). `step_ms` is the quiet time after the last event before the file
    is read (so a save in several writes is read once), `debounce_ms` the longest a burst of
    events is collected; every `rescan_s` the file is hashed even without an event.

    Runs until `stop_event` is set or the consumer is cancelled; either stops it within
    `step_ms`. It never raises for the watcher's own trouble (the directory removed, inotify
    limits): that is logged, and after `retry_s` the file is hashed and the watch starts over.

    `force_polling` is off unless set or `WATCHFILES_FORCE_POLLING` is in the environment
    (for filesystems without inotify; the polling backend sees mtimes only to the second, the
    rescan covers what it misses).
    """
    halt = _Halt(stop_event)
    if initial_hash is None:
        initial_hash = (await _read(path)).sha256
    tracker = ContentTracker(initial_hash)
    while not halt.is_set():
        # On every (re)start: a change made while no watcher was live (before the first start,
        # between a link swap and the new watch, during a retry) has no event to wait for.
        # Read again after each yield: the consumer may have taken its time.
        while tracker.observe(state := await _read(path)):
            yield state
            if halt.is_set():
                return
        plan = watch_plan(path)
        watcher = _awatch(plan, halt, debounce_ms=debounce_ms, step_ms=step_ms,
                          rescan_s=rescan_s, force_polling=force_polling)
        failed = False
        async with aclosing(watcher):
            while True:
                events, failed = await _next_batch(watcher, halt, path, retry_s)
                if events is None:
                    break
                if tracker.observe(state := await _read(path)):
                    yield state
                if watch_plan(path) != plan:
                    break  # a link now points elsewhere: watch the new place
        if failed:
            await anyio.sleep(retry_s)


def _awatch(plan: WatchPlan, halt: _Halt, *, debounce_ms: int, step_ms: int, rescan_s: float,
            force_polling: bool | None) -> AsyncGenerator[set[tuple[watchfiles.Change, str]], None]:
    """A watch of the plan's directories, stopped by `halt`, yielding an empty batch
    every `rescan_s` without an event (the file is hashed anyway)."""
    return watchfiles.awatch(
        *plan.dirs,
        watch_filter=plan.watch_filter,
        debounce=debounce_ms,
        step=step_ms,
        # Duck-typed: watchfiles only calls is_set() (from its thread) and set().
        stop_event=cast(anyio.Event, halt),
        rust_timeout=max(1, int(rescan_s * 1000)),
        yield_on_timeout=True,  # an empty set every rescan_s: hash anyway
        recursive=False,
        force_polling=force_polling,
    )


async def _next_batch(
    watcher: AsyncGenerator[set[tuple[watchfiles.Change, str]], None], halt: _Halt,
    path: Path, retry_s: float,
) -> tuple[set[tuple[watchfiles.Change, str]] | None, bool]:
    """The watcher's next batch (None: it stopped), and whether it failed instead (the
    directory removed, inotify limits): logged, the watch starts over after `retry_s`."""
    try:
        return await _next_events(watcher, halt), False
    except OSError as exc:
        _log.warning("config_watch.failed", path=str(path), error=str(exc), retry_s=retry_s)
        return None, True


ChangeHandler = Callable[[ConfigChange], Awaitable[None] | None]


async def watch_config(path: Path, on_change: ChangeHandler, **options: Any) -> None:
    """Call `on_change` for each content change of `path` until cancelled: the daemon task.

    `options` go to `config_changes`. A reload takes long (drain); changes seen meanwhile
    are reported after it returns, and the supervisor coalesces them.
    """
    async for change in config_changes(path, **options):
        result = on_change(change)
        if inspect.isawaitable(result):
            await result
