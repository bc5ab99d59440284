"""A client for the control socket with the standard library only, so the `turnkeeper`
commands start fast: HTTP/1.1 over AF_UNIX with http.client."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class ClientError(Exception):
    """The daemon could not be reached."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float | None) -> None:
        super().__init__("turnkeeper", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.timeout is not None:
            sock.settimeout(self.timeout)
        try:
            sock.connect(str(self._path))
        except OSError:
            sock.close()
            raise
        self.sock = sock


class Client:
    def __init__(self, path: Path, *, timeout: float | None = 30.0) -> None:
        self.path = path
        self.timeout = timeout

    def _open(self, method: str, target: str, body: Any, timeout: float | None
              ) -> tuple[_UnixConnection, http.client.HTTPResponse]:
        conn = _UnixConnection(self.path, timeout)
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        try:
            conn.request(method, target, body=payload, headers=headers)
            return conn, conn.getresponse()
        except FileNotFoundError:
            conn.close()
            raise ClientError(f"no turnkeeper socket at {self.path} (is the daemon running?"
                              " set --socket or TURNKEEPER_SOCKET)") from None
        except ConnectionRefusedError:
            conn.close()
            raise ClientError(f"nothing listens on {self.path} (the daemon is not running)"
                              ) from None
        except PermissionError:
            conn.close()
            raise ClientError(f"permission denied on {self.path}") from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise ClientError(f"control socket {self.path}: {exc}") from None

    def request(self, method: str, target: str, body: Any = None, *,
                timeout: float | None = None) -> tuple[int, Any]:
        conn, resp = self._open(method, target, body, timeout or self.timeout)
        try:
            raw = resp.read()
        finally:
            conn.close()
        try:
            data = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            data = {"error": raw.decode(errors="replace")}
        return resp.status, data

    def stream(self, target: str) -> Iterator[dict[str, Any]]:
        """NDJSON lines as they come, until the daemon closes the stream."""
        conn, resp = self._open("GET", target, None, None)
        try:
            if resp.status != 200:
                raw = resp.read()
                try:
                    message = json.loads(raw).get("error", raw.decode())
                except (json.JSONDecodeError, AttributeError):
                    message = raw.decode(errors="replace")
                raise ClientError(f"HTTP {resp.status}: {message}")
            while True:
                line = resp.readline()
                if not line:
                    return
                line = line.strip()
                if line:
                    yield json.loads(line)
        finally:
            conn.close()
