"""Which socket the CLI trusts when it is not told one, and which directory the daemon
will listen in: a directory in a place everyone can write is only trusted when it
belongs to the caller or root."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from turnkeeper import exits
from turnkeeper.paths import (
    UnsafeSocketDir,
    UnsafeStateDir,
    check_socket_dir_mode,
    client_socket_path,
    discover_socket,
    prepare_state_dir,
)

OTHER_UID = 4243


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory like /tmp: everyone may write, with the sticky bit."""
    path = Path(tempfile.mkdtemp(prefix="tk-shared-"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        for p in sorted(path.rglob("*"), reverse=True):
            p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
        path.rmdir()


def _listening(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(1)
    return sock


def _squat(parent: Path, name: str, owner: int) -> tuple[Path, socket.socket]:
    directory = parent / name
    directory.mkdir()
    sock = _listening(directory / "control.sock")
    os.chown(directory, owner, owner)
    return directory / "control.sock", sock


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")


@needs_root
def test_a_default_socket_in_a_directory_another_user_owns_in_a_shared_place_is_refused(
        shared_tmp: Path) -> None:
    path, sock = _squat(shared_tmp, "turnkeeper-0", OTHER_UID)
    with sock, pytest.raises(UnsafeSocketDir) as caught:
        discover_socket([path])
    assert f"uid {OTHER_UID}" in str(caught.value)
    assert caught.value.exit_code == exits.CONFIG


@needs_root
def test_the_cli_refuses_a_squatted_runtime_directory_through_client_socket_path(
        shared_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TURNKEEPER_SOCKET", "TURNKEEPER_DAEMON__SOCKET", "TURNKEEPER_CONFIG",
                 "RUNTIME_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared_tmp))
    _path, sock = _squat(shared_tmp, "turnkeeper", OTHER_UID)
    with sock, pytest.raises(UnsafeSocketDir, match=f"uid {OTHER_UID}"):
        client_socket_path(None)


@needs_root
def test_a_socket_given_explicitly_is_taken_as_it_is(shared_tmp: Path) -> None:
    path, sock = _squat(shared_tmp, "turnkeeper-0", OTHER_UID)
    with sock:
        assert client_socket_path(str(path)) == path


def test_a_default_socket_in_our_own_directory_is_found(shared_tmp: Path) -> None:
    path, sock = _squat(shared_tmp, "turnkeeper-0", os.getuid())
    with sock:
        assert discover_socket([shared_tmp / "absent" / "control.sock", path]) == path


@needs_root
def test_a_service_users_directory_where_only_root_can_create_one_is_trusted(
        tmp_path: Path) -> None:
    # /run/turnkeeper belongs to the service user, but only root can create entries in /run.
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    path, sock = _squat(run, "turnkeeper", OTHER_UID)
    with sock:
        assert discover_socket([path]) == path


def test_a_directory_others_can_write_without_the_sticky_bit_is_refused(
        tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafeSocketDir, match="sticky"):
        check_socket_dir_mode(open_dir)
    open_dir.chmod(0o1777)
    check_socket_dir_mode(open_dir)


def test_a_missing_state_directory_is_made_0750(tmp_path: Path) -> None:
    prepare_state_dir(tmp_path / "a" / "state")
    assert stat.S_IMODE((tmp_path / "a" / "state").stat().st_mode) == 0o750


@pytest.mark.parametrize("mode", [0o770, 0o757, 0o1777])
def test_a_state_directory_its_group_or_others_can_write_is_refused(tmp_path: Path,
                                                                     mode: int) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state").chmod(mode)
    with pytest.raises(UnsafeStateDir, match="go-w"):
        prepare_state_dir(tmp_path / "state")


def test_a_state_directory_that_is_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "state").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafeStateDir, match="symbolic link"):
        prepare_state_dir(tmp_path / "state")
