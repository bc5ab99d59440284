"""Default locations, shared by the daemon and the light CLI (standard library only),
and the rules that say whether a socket's directory can be trusted.

A directory in a place every user can write (`/tmp`) can be created by anyone first: a
socket found there is only ours if the directory is ours (or root's). A directory whose
own parent only its owner or root can write (`$XDG_RUNTIME_DIR`, `/run`) cannot have been
squatted, whoever owns it (the systemd unit's `/run/turnkeeper` belongs to the service
user, not to the caller).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from turnkeeper import exits
from turnkeeper.errors import TurnkeeperError

SYSTEM_SOCKET = Path("/run/turnkeeper/control.sock")
SYSTEM_CONFIG = Path("/etc/turnkeeper/turnkeeper.toml")
EMBEDDED = "embedded defaults"


class UnsafeSocketDir(TurnkeeperError):
    """A socket's directory another user controls, or one others can write without the
    sticky bit. A setting to fix, not a transient failure: exit 78 (EX_CONFIG)."""

    exit_code = exits.CONFIG


class UnsafeStateDir(TurnkeeperError):
    """A state directory another user controls or can write: whoever can write it can
    plant a link that makes the daemon overwrite a file of its choosing, or read the
    turns. A setting to fix: exit 78 (EX_CONFIG)."""

    exit_code = exits.CONFIG


class StateDirUnusable(TurnkeeperError):
    """The state directory cannot be made or read (a file in its place, no permission):
    exit 74 (EX_IOERR), as for a store that cannot be opened."""

    exit_code = exits.IOERR


def default_state_dir() -> Path:
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "turnkeeper"


def default_socket_path() -> Path:
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0]) / "control.sock"
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "turnkeeper" / "control.sock"
    return Path(f"/tmp/turnkeeper-{os.getuid()}") / "control.sock"


def _owner_name(uid: int) -> str:
    try:
        import pwd  # here: only an error message needs it

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _only_trusted_can_write(st: os.stat_result, uid: int) -> bool:
    """Only `uid` or root could have created an entry in a directory with this stat."""
    return st.st_uid in (0, uid) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def check_socket_dir_owner(directory: Path, *, uid: int | None = None) -> None:
    """Refuse `directory` if another user may have put it there: it is owned by neither
    `uid` (default: ours) nor root, and its parent lets others create entries."""
    me = os.getuid() if uid is None else uid
    st = directory.stat()
    if st.st_uid in (0, me):
        return
    if _only_trusted_can_write(directory.parent.stat(), me):
        return
    raise UnsafeSocketDir(
        f"socket directory {directory} is owned by {_owner_name(st.st_uid)}, not by you or "
        f"root, in a directory others can write: refusing a socket another user may have "
        f"put there (give --socket or TURNKEEPER_SOCKET to use it anyway)")


def check_socket_dir_mode(directory: Path) -> None:
    """Refuse a directory others can write without the sticky bit: anyone could replace
    the socket in it."""
    mode = directory.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        raise UnsafeSocketDir(
            f"socket directory {directory} (mode {stat.S_IMODE(mode):04o}) can be written "
            f"by others and has no sticky bit: anyone could replace the socket in it")


def prepare_state_dir(directory: Path) -> None:
    """Create the state directory (0750) if it is missing, then refuse one that is a
    link, is owned by neither us nor root, or can be written by its group or others.
    Every file in it is then ours alone to create, and the files the daemon opens there
    are opened without following links as well (O_NOFOLLOW)."""
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o750)
        st = directory.lstat()
    except OSError as exc:
        raise StateDirUnusable(f"state directory {directory} is not usable: "
                               f"{exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeStateDir(
            f"state directory {directory} is a symbolic link: name the directory it "
            f"points to ({directory.resolve()}) in daemon.state_dir instead")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStateDir(f"state directory {directory} is not a directory")
    if st.st_uid not in (0, os.getuid()):
        raise UnsafeStateDir(
            f"state directory {directory} is owned by {_owner_name(st.st_uid)}, not by "
            f"the daemon's user or root: whoever owns it could make the daemon overwrite "
            f"files through links planted there (chown it, or choose another "
            f"daemon.state_dir)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeStateDir(
            f"state directory {directory} (mode {stat.S_IMODE(st.st_mode):04o}) can be "
            f"written by its group or others: chmod go-w it (0750 or 0700)")


def default_socket_candidates() -> list[Path]:
    """Where the CLI looks when not told, in order: the per-user runtime directory, the
    per-user directory in /tmp, then the systemd unit's socket."""
    out = []
    if os.environ.get("RUNTIME_DIRECTORY"):
        out.append(Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0]) / "control.sock")
    if os.environ.get("XDG_RUNTIME_DIR"):
        out.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "turnkeeper" / "control.sock")
    out.append(Path(f"/tmp/turnkeeper-{os.getuid()}") / "control.sock")
    out.append(SYSTEM_SOCKET)
    return out


def discover_socket(candidates: list[Path] | None = None) -> Path:
    """The first of `candidates` (default: `default_socket_candidates()`) that holds a
    socket, checked with `check_socket_dir_owner` (a squatted one raises
    `UnsafeSocketDir` rather than being skipped: the user must hear about it); the
    per-user default when none does."""
    for path in default_socket_candidates() if candidates is None else candidates:
        try:
            if not stat.S_ISSOCK(path.lstat().st_mode):
                continue
        except OSError:
            continue
        check_socket_dir_owner(path.parent)
        return path
    return default_socket_path()


def user_config_path() -> Path:
    """`$XDG_CONFIG_HOME/turnkeeper/turnkeeper.toml` (`~/.config` when it is unset)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "turnkeeper" / "turnkeeper.toml"


def config_search(option: str | None) -> tuple[str | None, str]:
    """The config file to read and how it was found: `--config`, then
    TURNKEEPER_CONFIG, then the first of the user's and the system's files that exists;
    (None, "embedded defaults") when none does. A file named by the option or the
    variable is taken as it is (a missing one is an error, not a fall-through)."""
    if option:
        return option, "--config"
    if os.environ.get("TURNKEEPER_CONFIG"):
        return os.environ["TURNKEEPER_CONFIG"], "TURNKEEPER_CONFIG"
    for path, how in ((user_config_path(), "$XDG_CONFIG_HOME"),
                      (SYSTEM_CONFIG, "the system default")):
        if path.is_file():
            return str(path), how
    return None, EMBEDDED


def searched_places() -> str:
    """Where a config is looked for, in order: for a message about the defaults."""
    return (f"--config, TURNKEEPER_CONFIG, {user_config_path()}, {SYSTEM_CONFIG}")


def client_socket_path(option: str | None, config_option: str | None = None) -> Path:
    """--socket, then TURNKEEPER_SOCKET, then the config file's daemon.socket (read with
    tomllib only), then TURNKEEPER_DAEMON__SOCKET, then the default locations (see
    `discover_socket`; raises `UnsafeSocketDir` for one another user controls). A path
    given explicitly is taken as it is: the user chose it."""
    if option:
        return Path(option)
    if os.environ.get("TURNKEEPER_SOCKET"):
        return Path(os.environ["TURNKEEPER_SOCKET"])
    if os.environ.get("TURNKEEPER_DAEMON__SOCKET"):
        return Path(os.environ["TURNKEEPER_DAEMON__SOCKET"])
    config, _ = config_search(config_option)
    if config:
        import tomllib  # here, not at the top: most commands never read a config file

        try:
            with open(config, "rb") as f:
                sock = tomllib.load(f).get("daemon", {}).get("socket")
            if isinstance(sock, str) and sock:
                return Path(sock)
        except (OSError, tomllib.TOMLDecodeError):
            pass
    return discover_socket()
