"""Config file watching (SPEC 9): report each change of the config file's *content*.

What is watched is the file's directory, not the file: editors save by writing a new file and
renaming it over the old one (the old inode, which a file watch would follow, is gone), and a
Kubernetes ConfigMap volume swaps a `..data` symlink to a new timestamped directory. Events are
only a hint that something may have changed; the decision is the content hash (sha256 of the
bytes): the same bytes written again, a `touch`, or a swap to an identical ConfigMap report
nothing. Every `rescan_s` seconds the file is hashed even without an event, which closes the
gap between loading the config and starting the watcher and covers filesystems that lose
events (NFS, some bind mounts).

A missing or unreadable file *is* reported, once (`ConfigChange.sha256 is None`, with the
error): the reload step then fails with "file missing", keeps the running policy and says so in
`STATUS=`; the operator sees it instead of a silent watcher. When the file comes back, that is a
change again (even to the old bytes), and the reload clears the error.

`config_changes` is the iterator; `watch_config` is the task the supervisor runs (it stops
promptly when cancelled and survives watcher errors).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def read_config_state(path: Path) -> ConfigChange:
    """Hash the file's bytes now (blocking: run it in a thread from async code)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ConfigChange(path, None, f"config file missing: {path}")
    except OSError as exc:
        return ConfigChange(path, None, f"config file unreadable: {path}: {exc.strerror or exc}")
    return ConfigChange(path, hashlib.sha256(data).hexdigest())


class ContentTracker:
    """Remembers the last content hash seen; `observe` says whether a new one is a change."""

    def __init__(self, last: str | None) -> None:
        self.last = last

    def observe(self, sha256: str | None) -> bool:
        if sha256 == self.last:
            return False
        self.last = sha256
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


async def config_changes(
    path: Path,
    *,
    baseline: str | None = None,
    debounce_ms: int = 1600,
    step_ms: int = 100,
    rescan_s: float = 5.0,
    stop_event: anyio.Event | None = None,
    force_polling: bool | None = None,
) -> AsyncGenerator[ConfigChange, None]:
    """Yield a `ConfigChange` each time the content hash of `path` differs from the last seen.

    `baseline` is the hash the running policy was loaded from (None: hash the file now).
    `step_ms` is the quiet time after the last event before the file is read (so a save in
    several writes is read once), `debounce_ms` the longest a burst of events is collected.

    `force_polling` is off unless set or `WATCHFILES_FORCE_POLLING` is in the environment
    (for filesystems without inotify); the rescan covers lost events either way.

    Stop it with `stop_event`: cancelling alone waits for the watcher thread's next wake-up
    (up to `rescan_s`); `watch_config` does this for you.
    """
    stop = anyio.Event() if stop_event is None else stop_event
    if baseline is None:
        baseline = (await anyio.to_thread.run_sync(read_config_state, path)).sha256
    tracker = ContentTracker(baseline)
    while not stop.is_set():
        plan = watch_plan(path)
        watcher = watchfiles.awatch(
            *plan.dirs,
            watch_filter=plan.watch_filter,
            debounce=debounce_ms,
            step=step_ms,
            stop_event=stop,
            rust_timeout=max(1, int(rescan_s * 1000)),
            yield_on_timeout=True,  # an empty set every rescan_s: hash anyway
            recursive=False,
            force_polling=force_polling,
        )
        async with aclosing(watcher):
            async for events in watcher:
                state = await anyio.to_thread.run_sync(read_config_state, path)
                if tracker.observe(state.sha256):
                    yield state
                if events and watch_plan(path) != plan:
                    break  # a link now points elsewhere: watch the new place


ChangeHandler = Callable[[ConfigChange], Awaitable[None] | None]


async def watch_config(
    path: Path,
    on_change: ChangeHandler,
    *,
    baseline: str | None = None,
    retry_s: float = 5.0,
    **options: Any,
) -> None:
    """Call `on_change` for each content change of `path` until cancelled (a daemon task).

    An error of the watcher itself (the directory removed, inotify limits) is logged and the
    watch restarts after `retry_s`, comparing against the last hash seen: losing the watcher
    must not take the daemon down. `options` go to `config_changes`.
    """
    stop = anyio.Event()
    last = baseline

    async def run() -> None:
        nonlocal last
        while True:
            try:
                async for change in config_changes(path, baseline=last, stop_event=stop, **options):
                    last = change.sha256
                    result = on_change(change)
                    if inspect.isawaitable(result):
                        await result
                return
            except OSError as exc:
                _log.warning("config_watch.failed", path=str(path), error=str(exc), retry_s=retry_s)
            await anyio.sleep(retry_s)
            state = await anyio.to_thread.run_sync(read_config_state, path)
            if state.sha256 != last:
                last = state.sha256
                result = on_change(state)
                if inspect.isawaitable(result):
                    await result

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, name=f"config-watch {path}")
        try:
            await anyio.sleep_forever()
        finally:
            # Wakes the watcher thread within one step; cancellation alone would wait for it.
            stop.set()
