"""Secrets a peer is given, read when it is built: a file's content, a systemd credential,
`env:NAME` values resolved from the daemon's environment, and which of them must be
redacted wherever text leaves the daemon."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from turnkeeper.config.redact import SECRET_NAME
from turnkeeper.config.sections import ConfigError

# A file name under $CREDENTIALS_DIRECTORY: no path separator, no leading dot.
CREDENTIAL_NAME = r"^([A-Za-z0-9_@:\-][A-Za-z0-9_.@:\-]*)?$"


def read_credential(name: str, where: str) -> str:
    """A systemd credential's content (`LoadCredential=`: a file under
    `$CREDENTIALS_DIRECTORY`); `where` is the key that names it, for the error."""
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        raise ConfigError(f"{where}: $CREDENTIALS_DIRECTORY is not set (systemd sets it "
                          "for LoadCredential=)")
    return read_secret(Path(directory) / name, where)


def read_secret(path: Path, where: str) -> str:
    """A secret file's content without surrounding whitespace (editors add a newline)."""
    try:
        value = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ConfigError(f"{where}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{where}: {path} cannot be read: {reason}") from None
    if not value:
        raise ConfigError(f"{where}: {path} is empty")
    return value


def secret_values(given: Mapping[str, str], resolved: Mapping[str, str]) -> list[str]:
    """Of headers (or variables) as configured (`given`) and as sent (`resolved`), the
    values read from the environment or named like a credential, each with the token
    alone of a value such as `Bearer <token>`."""
    out: list[str] = []
    for name, raw in given.items():
        value = resolved.get(name, "")
        if value and (raw.startswith("env:") or SECRET_NAME.search(name)):
            out.append(value)
            token = value.partition(" ")[2].strip()
            if token:
                out.append(token)
    return out


def resolve_env_refs(values: Mapping[str, str]) -> dict[str, str]:
    return {k: os.environ.get(v[4:], "") if v.startswith("env:") else v
            for k, v in values.items()}
