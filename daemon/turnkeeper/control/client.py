"""A client for the control socket with the standard library only, so the `turnkeeper`
commands start fast: HTTP/1.1 over AF_UNIX on a plain socket.

Not `http.client`: importing it (with the `email` package it parses headers with, and
`ssl`) was about half of the start-up time of `turnkeeper status`. The daemon is ours and
answers with a status line, headers, and a body sized by Content-Length or chunked, so
that is all this reads."""

from __future__ import annotations

import contextlib
import json
import socket

from turnkeeper.errors import TurnkeeperError

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs start-up time
if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path
    from typing import Any, BinaryIO

MAX_HEADER_LINE = 65536


class ClientError(TurnkeeperError):
    """The daemon could not be reached."""


class HTTPStatusError(TurnkeeperError):
    """The daemon answered a stream request with an error (an unknown turn: 404). Not a
    `ClientError`: the daemon was reached, and the CLI tells the two apart by exit status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class _Response:
    """One response read from `fp`: the status, then the body, whole or line by line."""

    def __init__(self, fp: BinaryIO) -> None:
        self._fp = fp
        status_line = self._line()
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise ValueError(f"not an HTTP response: {status_line[:80]!r}")
        self.status = int(parts[1])
        self._length: int | None = None
        self._chunked = False
        self.headers: dict[str, str] = {}
        while True:
            line = self._line()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            self.headers[name.decode("latin-1")] = value.strip().decode("latin-1")
            if name == b"content-length":
                self._length = int(value.strip())
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
        self._buffer = b""
        self._done = False

    def close(self) -> None:
        self._fp.close()

    def _line(self) -> bytes:
        line = self._fp.readline(MAX_HEADER_LINE + 1)
        if len(line) > MAX_HEADER_LINE:
            raise ValueError("header line too long")
        return line

    def _next_data(self) -> bytes:
        """The next piece of the body; b"" at its end."""
        if self._done:
            return b""
        if self._chunked:
            size = int(self._line().split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while self._line() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                self._done = True
                return b""
            data = self._fp.read(size)
            self._fp.read(2)  # CRLF after the chunk
            if len(data) < size:
                raise ValueError("the connection closed inside a chunk")
            return data
        self._done = True
        if self._length is not None:
            data = self._fp.read(self._length)
            if len(data) < self._length:
                raise ValueError("the connection closed before the end of the body")
            return data
        return self._fp.read()

    def read(self) -> bytes:
        parts = [self._buffer]
        self._buffer = b""
        while True:
            data = self._next_data()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def readline(self) -> bytes:
        """The next line of the body (with its newline); b"" at its end."""
        while b"\n" not in self._buffer:
            if self._chunked or self._length is not None:
                data = self._next_data()
            else:  # read to EOF: a line at a time, so a live stream is not held back
                data = self._fp.readline()
                self._done = not data
            if not data:
                line, self._buffer = self._buffer, b""
                return line
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line + b"\n"


class Client:
    def __init__(self, path: Path, *, timeout: float | None = 30.0) -> None:
        self.path = path
        self.timeout = timeout

    def _open(self, method: str, target: str, body: Any, timeout: float | None
              ) -> tuple[socket.socket, _Response]:
        payload = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {target} HTTP/1.1\r\nHost: turnkeeper\r\nConnection: close\r\n"
                "Accept: application/json\r\n")
        if body is not None:
            head += "Content-Type: application/json\r\n"
        if body is not None or method not in ("GET", "HEAD"):
            head += f"Content-Length: {len(payload)}\r\n"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(str(self.path))
            # Answered and closed before it read us (a 403 or a 503 at accept): the
            # answer is in our receive buffer all the same.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(head.encode("latin-1") + b"\r\n" + payload)
            fp = sock.makefile("rb")
            try:
                return sock, _Response(fp)
            except BaseException:
                fp.close()
                raise
        except FileNotFoundError:
            sock.close()
            raise ClientError(f"no turnkeeper socket at {self.path} (is the daemon running?"
                              " set --socket or TURNKEEPER_SOCKET)") from None
        except ConnectionRefusedError:
            sock.close()
            if self.path.exists() and not self.path.is_socket():
                raise ClientError(f"{self.path} is not a socket (set --socket or "
                                  "TURNKEEPER_SOCKET to the daemon's control socket)"
                                  ) from None
            raise ClientError(f"nothing listens on {self.path} (the daemon is not running)"
                              ) from None
        except PermissionError:
            sock.close()
            raise ClientError(f"permission denied on {self.path}") from None
        except (OSError, ValueError) as exc:
            sock.close()
            raise ClientError(f"control socket {self.path}: {exc}") from None

    def request(self, method: str, target: str, body: Any = None, *,
                timeout: float | None = None) -> tuple[int, Any]:
        sock, resp = self._open(method, target, body, timeout or self.timeout)
        try:
            raw = resp.read()
        except (OSError, ValueError) as exc:
            raise ClientError(f"control socket {self.path}: {exc}") from None
        finally:
            resp.close()
            sock.close()
        try:
            data = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            data = {"error": raw.decode(errors="replace")}
        return resp.status, data

    def stream(self, target: str) -> Iterator[dict[str, Any]]:
        """NDJSON lines as they come, until the daemon closes the stream."""
        sock, resp = self._open("GET", target, None, None)
        try:
            if resp.status != 200:
                raw = resp.read()
                try:
                    message = json.loads(raw).get("error", raw.decode())
                except (json.JSONDecodeError, AttributeError):
                    message = raw.decode(errors="replace")
                raise HTTPStatusError(resp.status, str(message))
            while True:
                try:
                    line = resp.readline()
                except ValueError as exc:
                    raise ClientError(f"control socket {self.path}: {exc}") from None
                if not line:
                    return
                line = line.strip()
                if line:
                    yield json.loads(line)
        finally:
            resp.close()
            sock.close()
