"""Config file watching on real files: content changes are reported, everything else is not."""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from turnkeeper.lifecycle.watch import (
    ConfigChange,
    ContentTracker,
    WatchPlan,
    config_changes,
    read_config_state,
    watch_config,
    watch_plan,
)

pytestmark = pytest.mark.anyio

FAST: dict[str, Any] = {"debounce_ms": 50, "step_ms": 10}
"""Small enough for tests; the defaults wait for editors that save in several writes."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def replace_file(path: Path, data: bytes) -> None:
    """Save the way editors and config management do: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


Poke = Callable[[bytes], object]


async def next_change(changes: MemoryObjectReceiveStream[ConfigChange]) -> ConfigChange:
    with anyio.fail_after(3):
        return await changes.receive()


@asynccontextmanager
async def watching(
    path: Path, poke: Poke
) -> AsyncIterator[MemoryObjectReceiveStream[ConfigChange]]:
    """`watch_config` running on `path`, proven live: it has reported a change made by `poke`.

    The rescan is pushed far away (30 s) so that every change a test sees came from an event.
    Leaving the block cancels the watcher, which must stop at once (the 5 s bound of
    `fail_after` catches a watcher thread that blocks cancellation until its own timeout).
    """
    send, receive = anyio.create_memory_object_stream[ConfigChange](100)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(watch_config, path, send.send, rescan_s=30, **FAST))
            for attempt in itertools.count():
                data = f"warm-up {attempt}\n".encode()
                poke(data)
                with anyio.move_on_after(0.15):
                    while (await receive.receive()).sha256 != sha(data):
                        pass
                    break
            yield receive
            tg.cancel_scope.cancel()


async def test_a_rewritten_file_is_reported_with_its_new_hash(tmp_path: Path) -> None:
    config = tmp_path / "turnkeeper.toml"
    config.write_bytes(b"a = 1\n")

    async with watching(config, config.write_bytes) as changes:
        config.write_bytes(b"a = 2\n")
        change = await next_change(changes)

    assert change == ConfigChange(config, sha(b"a = 2\n"))


async def test_a_file_replaced_by_rename_is_reported(tmp_path: Path) -> None:
    config = tmp_path / "turnkeeper.toml"
    config.write_bytes(b"a = 1\n")

    async with watching(config, partial(replace_file, config)) as changes:
        replace_file(config, b"a = 3\n")
        assert (await next_change(changes)).sha256 == sha(b"a = 3\n")
        replace_file(config, b"a = 4\n")
        assert (await next_change(changes)).sha256 == sha(b"a = 4\n")


async def test_the_same_content_written_again_or_touched_is_not_a_change(tmp_path: Path) -> None:
    config = tmp_path / "turnkeeper.toml"
    config.write_bytes(b"a = 1\n")

    async with watching(config, config.write_bytes) as changes:
        config.write_bytes(b"same\n")
        assert (await next_change(changes)).sha256 == sha(b"same\n")
        config.write_bytes(b"same\n")
        replace_file(config, b"same\n")
        os.utime(config)
        (tmp_path / "unrelated.toml").write_bytes(b"x = 1\n")
        config.write_bytes(b"different\n")
        # Had any of the no-op writes been reported, it would come first.
        assert (await next_change(changes)).sha256 == sha(b"different\n")


async def test_a_missing_file_is_reported_once_and_its_return_again(tmp_path: Path) -> None:
    config = tmp_path / "turnkeeper.toml"
    config.write_bytes(b"a = 1\n")

    async with watching(config, config.write_bytes) as changes:
        config.unlink()
        gone = await next_change(changes)
        (tmp_path / "other").write_bytes(b"still missing: nothing to report\n")
        config.write_bytes(b"a = 5\n")
        back = await next_change(changes)

    assert gone.sha256 is None
    assert gone.error == f"config file missing: {config}"
    assert back == ConfigChange(config, sha(b"a = 5\n"))


def make_configmap(root: Path, stamp: str, data: bytes) -> None:
    """What the kubelet does for a ConfigMap volume: a new timestamped dir, `..data` swapped to
    it by rename, the old dir removed. `turnkeeper.toml -> ..data/turnkeeper.toml` never moves."""
    (root / stamp).mkdir()
    (root / stamp / "turnkeeper.toml").write_bytes(data)
    old = os.readlink(root / "..data") if (root / "..data").is_symlink() else None
    os.symlink(stamp, root / "..data_tmp")
    os.replace(root / "..data_tmp", root / "..data")
    if old is not None:
        shutil.rmtree(root / old)
    if not (root / "turnkeeper.toml").is_symlink():
        os.symlink("..data/turnkeeper.toml", root / "turnkeeper.toml")


async def test_a_kubernetes_data_link_swap_is_reported(tmp_path: Path) -> None:
    stamps = (f"..2024_01_01_00_00_{n:02}.{n}" for n in itertools.count())
    make_configmap(tmp_path, next(stamps), b"a = 1\n")
    config = tmp_path / "turnkeeper.toml"

    async with watching(config, lambda data: make_configmap(tmp_path, next(stamps), data)) as ch:
        make_configmap(tmp_path, next(stamps), b"a = 6\n")
        assert (await next_change(ch)).sha256 == sha(b"a = 6\n")
        make_configmap(tmp_path, next(stamps), b"a = 6\n")  # identical ConfigMap: no change
        make_configmap(tmp_path, next(stamps), b"a = 7\n")
        assert (await next_change(ch)).sha256 == sha(b"a = 7\n")


async def test_a_symlink_into_another_directory_follows_the_target(tmp_path: Path) -> None:
    etc, srv = tmp_path / "etc", tmp_path / "srv"
    etc.mkdir()
    srv.mkdir()
    target = srv / "real.toml"
    target.write_bytes(b"a = 1\n")
    config = etc / "turnkeeper.toml"
    config.symlink_to(target)

    async with watching(config, partial(replace_file, target)) as changes:
        replace_file(target, b"a = 8\n")
        assert (await next_change(changes)).sha256 == sha(b"a = 8\n")


async def test_a_change_before_the_watcher_started_is_found_by_the_rescan(tmp_path: Path) -> None:
    config = tmp_path / "turnkeeper.toml"
    config.write_bytes(b"loaded later than the policy\n")
    stop = anyio.Event()

    with anyio.fail_after(3):
        changes = config_changes(
            config, initial_hash=sha(b"policy\n"), rescan_s=0.05, stop_event=stop
        )
        change = await anext(changes)
        stop.set()
        await changes.aclose()

    assert change.sha256 == sha(b"loaded later than the policy\n")


async def test_config_changes_ends_when_its_stop_event_is_set(tmp_path: Path) -> None:
    config = tmp_path / "turnkeeper.toml"
    config.write_bytes(b"a = 1\n")
    stop = anyio.Event()
    seen: list[ConfigChange] = []

    async def consume() -> None:
        async for change in config_changes(config, stop_event=stop, **FAST):
            seen.append(change)

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.sleep(0.05)
            stop.set()

    assert seen == []


async def test_cancelling_the_consumer_stops_the_watcher_at_once(tmp_path: Path) -> None:
    """awatch alone holds a cancellation until its thread wakes (rescan_s, 5 s by default)."""
    config = tmp_path / "turnkeeper.toml"
    config.write_bytes(b"a = 1\n")
    started = anyio.Event()

    async def consume() -> None:
        started.set()
        async for _change in config_changes(config, step_ms=20):
            pass

    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await started.wait()
            await anyio.sleep(0.1)  # let the watcher thread start waiting
            tg.cancel_scope.cancel()


async def test_a_vanished_directory_is_retried_not_raised(tmp_path: Path) -> None:
    config = tmp_path / "conf" / "turnkeeper.toml"
    stop = anyio.Event()

    with anyio.fail_after(3):
        changes = config_changes(config, initial_hash="0" * 64, retry_s=0.05, stop_event=stop)
        gone = await anext(changes)  # the watch fails (no directory), the rescan reports
        config.parent.mkdir()
        config.write_bytes(b"a = 9\n")
        back = await anext(changes)
        stop.set()
        await changes.aclose()

    assert gone.sha256 is None
    assert back.sha256 == sha(b"a = 9\n")


def test_read_config_state_names_an_unreadable_file(tmp_path: Path) -> None:
    state = read_config_state(tmp_path)  # a directory cannot be read as a file

    assert state.sha256 is None
    assert state.error is not None and state.error.startswith("config file unreadable")


def test_content_tracker_reports_only_a_different_hash() -> None:
    tracker = ContentTracker("a")

    assert [tracker.observe(ConfigChange(Path("x"), h))
            for h in ["a", "b", "b", None, None, "b"]] == [
        False,
        True,
        False,
        True,
        False,
        True,
    ]


def test_watch_plan_for_a_plain_file_watches_its_directory(tmp_path: Path) -> None:
    config = tmp_path / "turnkeeper.toml"
    config.write_bytes(b"")

    plan = watch_plan(config)

    assert plan == WatchPlan((tmp_path,), frozenset({"turnkeeper.toml", "..data"}), False)
    assert plan.matches(str(tmp_path / "turnkeeper.toml"))
    assert plan.matches(str(tmp_path / "..data"))
    assert not plan.matches(str(tmp_path / "turnkeeper.toml.tmp"))


def test_watch_plan_for_a_link_inside_its_directory_matches_any_entry(tmp_path: Path) -> None:
    make_configmap(tmp_path, "..2024_01_01", b"")

    plan = watch_plan(tmp_path / "turnkeeper.toml")

    assert plan.dirs == (tmp_path, (tmp_path / "..2024_01_01").resolve())
    assert plan.any_name
    assert plan.matches(str(tmp_path / "..2024_01_02"))
    assert plan.matches(str(tmp_path / "..2024_01_01" / "turnkeeper.toml"))
    assert not plan.matches(str(tmp_path / "..2024_01_01" / "other.toml"))


def test_watch_plan_for_a_link_elsewhere_adds_the_target(tmp_path: Path) -> None:
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "real.toml").write_bytes(b"")
    config = tmp_path / "turnkeeper.toml"
    config.symlink_to(tmp_path / "srv" / "real.toml")

    plan = watch_plan(config)

    assert plan.dirs == (tmp_path, (tmp_path / "srv").resolve())
    assert plan.names == {"turnkeeper.toml", "..data", "real.toml"}
    assert plan.matches(str(tmp_path / "srv" / "real.toml"))
    assert not plan.matches(str(tmp_path / "srv" / "other.toml"))


def test_a_read_that_failed_for_want_of_descriptors_is_no_change(tmp_path: Path) -> None:
    """At the descriptor limit the file cannot be opened: that says nothing of the file.
    Read for real, in a child process that has used up its descriptors."""
    import subprocess
    import sys

    config = tmp_path / "tk.toml"
    config.write_text("[agent]\n")
    child = subprocess.run([sys.executable, "-c", f"""
import os, resource
from pathlib import Path
from turnkeeper.lifecycle.watch import ContentTracker, read_config_state
path = Path({str(config)!r})
tracker = ContentTracker(read_config_state(path).sha256)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
state = read_config_state(path)
print(state.transient, tracker.observe(state))
"""], capture_output=True, text=True, timeout=60, check=True)
    assert child.stdout.splitlines()[-1].split() == ["True", "False"], child.stderr


def test_a_missing_file_is_a_change_and_not_transient(tmp_path: Path) -> None:
    state = read_config_state(tmp_path / "gone.toml")
    assert not state.transient
    assert ContentTracker("abc").observe(state)
