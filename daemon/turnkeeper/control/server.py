"""The control socket server: aiohttp's web server on a Unix socket (or one handed over
by systemd), run inside the daemon's own task group, never `run_app` (which would take
the signals).

Access: the peer's credentials come from the request's transport socket (SO_PEERCRED,
and its supplementary groups from SO_PEERGROUPS or /proc); root, the daemon's own uid,
and the configured uids/gids are let in, everyone else gets 403.

The socket's directory: one the daemon created, or its own `turnkeeper` directory, is
kept at 0750; any other is left as it is (re-moding /tmp or /run would lock other users
out), but refused when another user controls it or others can write it without the
sticky bit.

Descriptors: at most `daemon.max_connections` connections are served at once; one more
gets a 503 and is closed at once, before a request is read, so a flood costs the daemon
one descriptor for an instant each.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import socket
import stat
import struct
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import structlog
from aiohttp import web

from turnkeeper import exits
from turnkeeper.config import Config
from turnkeeper.control import routes
from turnkeeper.errors import TurnkeeperError
from turnkeeper.paths import UnsafeSocketDir, check_socket_dir_mode, check_socket_dir_owner
from turnkeeper.policy.admission import ControlLimits
from turnkeeper.supervisor import Supervisor

log = structlog.get_logger("turnkeeper.control")

MAX_BODY = 1024 * 1024
_PEERCRED = struct.Struct("3i")
# Not in Python's socket module on every version; the Linux value since 4.13.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_GID = struct.Struct("I")


class SocketError(TurnkeeperError):
    exit_code = exits.UNAVAILABLE


class UnsafeSocketDirError(SocketError):
    """The socket's directory is one another user controls or others can write: a
    setting to fix, not a busy machine (exit 78)."""

    exit_code = exits.CONFIG


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer of a connected AF_UNIX socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def peer_groups(sock: socket.socket, pid: int) -> frozenset[int]:
    """The peer's supplementary groups, as they were when it connected (SO_PEERGROUPS);
    on a kernel without it, as /proc shows the peer process now. Empty when neither can
    tell: then only the primary gid counts."""
    for size in (64, 65536):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size * _GID.size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                continue
            break
        return frozenset(g for (g,) in _GID.iter_unpack(raw[:len(raw) - len(raw) % 4]))
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


def make_access_middleware(config: Config) -> Callable[..., Awaitable[web.StreamResponse]]:
    allowed_uids = {0, os.getuid(), *config.daemon.allowed_uids}
    allowed_gids = set(config.daemon.allowed_gids)
    # A connection's peer credentials are those it had when it connected (SO_PEERCRED):
    # read once per connection, not per request of a kept-alive one (uvloop wraps the
    # descriptor in a new socket object for every getsockopt: 2.2 us a request).
    peers: weakref.WeakKeyDictionary[asyncio.BaseTransport, tuple[int, int, int]] = \
        weakref.WeakKeyDictionary()

    @web.middleware
    async def access(request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None and sock.family == socket.AF_UNIX:
            assert transport is not None
            creds = peers.get(transport)
            if creds is None:
                try:
                    creds = peers[transport] = peer_credentials(sock)
                except OSError:
                    return routes.error(403, "peer credentials unavailable")
            pid, uid, gid = creds
            request[routes.PEER_UID] = uid
            if uid not in allowed_uids and gid not in allowed_gids and not (
                    allowed_gids and allowed_gids & peer_groups(sock, pid)):
                log.warning("control.forbidden", uid=uid, gid=gid, path=request.path)
                return routes.error(403, f"uid {uid} is not allowed on this socket")
        if request.content_length is not None and request.content_length > MAX_BODY:
            # Answered from the header: a client announcing 100 MB is not waited for.
            return routes.error(413, f"request body is larger than {MAX_BODY} bytes")
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return routes.error(413, f"request body is larger than {MAX_BODY} bytes")
        except web.HTTPException as exc:
            if exc.status >= 400:
                return routes.error(exc.status, exc.reason)
            raise

    return access


def _is_own_dir(directory: Path) -> bool:
    """A directory named for turnkeeper is the daemon's own to tighten: `turnkeeper`
    (under a runtime directory) or `turnkeeper-<uid>` (in /tmp)."""
    return directory.name == "turnkeeper" or directory.name.startswith("turnkeeper-")


def prepare_socket_path(path: Path) -> None:
    """Make the socket's directory safe to listen in, and clear a stale socket left by a
    dead daemon. A live one is an error.

    A directory the daemon creates, or its own (see `_is_own_dir`) owned by its uid, is
    set to 0750; any other is left as it is. A directory another user controls, or one
    others can write without the sticky bit, raises `UnsafeSocketDirError` (exit 78)."""
    parent = path.parent
    created = not parent.exists()
    try:
        parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    except OSError as exc:
        raise SocketError(f"cannot create socket directory {parent}: {exc.strerror}") from None
    try:
        check_socket_dir_owner(parent)
        st = parent.stat()
        ours = created or (_is_own_dir(parent) and st.st_uid == os.getuid())
        if ours and stat.S_IMODE(st.st_mode) & ~0o750:
            os.chmod(parent, stat.S_IMODE(st.st_mode) & 0o750)
        check_socket_dir_mode(parent)
    except UnsafeSocketDir as exc:
        raise UnsafeSocketDirError(str(exc)) from None
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SocketError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(str(path))
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                path.unlink(missing_ok=True)
            else:
                raise SocketError(f"cannot probe existing socket {path}: {exc}") from None
        else:
            raise SocketError(f"another turnkeeper is listening on {path}")
        finally:
            probe.close()


_BUSY_BODY = json.dumps({"error": "too many control connections; retry later"}).encode()
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Retry-After: 1\r\nConnection: close\r\n"
         b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class _Busy(asyncio.Protocol):
    """A connection beyond the limit: answered 503 without reading, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.WriteTransport subclasses: cast, not assert.
        writer = cast(asyncio.WriteTransport, transport)
        writer.write(_BUSY)
        writer.close()


class _BoundedSite(web.SockSite):
    """A listening socket whose connections beyond `max_connections` get `_Busy`."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, *,
                 limits: ControlLimits) -> None:
        super().__init__(runner, sock)
        self._tk_runner = runner
        self._tk_sock = sock
        self._tk_limits = limits
        self.refused = 0

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._tk_runner.server
        assert server is not None
        admits = self._tk_limits.admits_connection

        def factory() -> asyncio.Protocol:
            if not admits(len(server.connections)):
                self.refused += 1
                return _Busy()
            return server()

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(factory, sock=self._tk_sock, backlog=128)


class ControlServer:
    def __init__(self, supervisor: Supervisor, *, path: Path, mode: int,
                 inherited: socket.socket | None = None) -> None:
        self.supervisor = supervisor
        self.path = path
        self.mode = mode
        self.inherited = inherited
        self._runner: web.AppRunner | None = None
        self._bound = False

    def __repr__(self) -> str:
        return f"ControlServer({str(self.path)!r})"

    def build_app(self) -> web.Application:
        supervisor = self.supervisor

        @web.middleware
        async def started(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
            # The socket listens (or systemd's did) before the turns are resumed: a request
            # that comes that early waits for the daemon instead of failing.
            await supervisor.wait_started()
            return await handler(request)

        app = web.Application(client_max_size=MAX_BODY,
                              middlewares=[make_access_middleware(self.supervisor.config),
                                           started])
        app[routes.SUPERVISOR] = self.supervisor
        routes.add_routes(app)
        return app

    def _bind(self) -> socket.socket:
        prepare_socket_path(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            sock.bind(str(self.path))
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old_umask)
        self._bound = True
        os.chmod(self.path, self.mode)
        sock.listen(128)
        sock.setblocking(False)
        return sock

    async def start(self, extra_app_setup: Callable[[web.Application], None] | None = None
                    ) -> None:
        app = self.build_app()
        if extra_app_setup is not None:
            extra_app_setup(app)
        daemon = self.supervisor.config.daemon
        limits = routes.control_limits(daemon)
        runner = web.AppRunner(app, handle_signals=False, access_log=None,
                               keepalive_timeout=daemon.control_idle_timeout,
                               shutdown_timeout=5.0)
        await runner.setup()
        self._runner = runner
        sock = self.inherited if self.inherited is not None else self._bind()
        site = _BoundedSite(runner, sock, limits=limits)
        await site.start()
        log.info("control.listening",
                 socket=str(self.path) if self.inherited is None
                 else "(systemd socket activation)",
                 mode=oct(self.mode), max_connections=limits.max_connections)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._bound:
            self._bound = False
            with contextlib.suppress(OSError):
                self.path.unlink()
