"""Default locations, shared by the daemon and the light CLI (standard library only)."""

from __future__ import annotations

import os
from pathlib import Path


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


def client_socket_path(option: str | None, config_option: str | None = None) -> Path:
    """--socket, then TURNKEEPER_SOCKET, then the config file's daemon.socket (read with
    tomllib only), then TURNKEEPER_DAEMON__SOCKET, then the default."""
    if option:
        return Path(option)
    if os.environ.get("TURNKEEPER_SOCKET"):
        return Path(os.environ["TURNKEEPER_SOCKET"])
    if os.environ.get("TURNKEEPER_DAEMON__SOCKET"):
        return Path(os.environ["TURNKEEPER_DAEMON__SOCKET"])
    config = config_option or os.environ.get("TURNKEEPER_CONFIG")
    if config:
        import tomllib  # here, not at the top: most commands never read a config file

        try:
            with open(config, "rb") as f:
                sock = tomllib.load(f).get("daemon", {}).get("socket")
            if isinstance(sock, str) and sock:
                return Path(sock)
        except (OSError, tomllib.TOMLDecodeError):
            pass
    return default_socket_path()
