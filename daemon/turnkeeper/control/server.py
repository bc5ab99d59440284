"""The control socket server: aiohttp's web server on a Unix socket (or one handed over
by systemd), run inside the daemon's own task group, never `run_app` (which would take
the signals).

Access: the peer's credentials come from the request's transport socket (SO_PEERCRED);
root, the daemon's own uid, and the configured uids/gids are let in, everyone else gets
403. The socket is created with `daemon.socket_mode` inside a directory no wider than
0750.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog
from aiohttp import web

from turnkeeper import exits
from turnkeeper.config import Config
from turnkeeper.control import routes
from turnkeeper.errors import TurnkeeperError
from turnkeeper.supervisor import Supervisor

log = structlog.get_logger("turnkeeper.control")

MAX_BODY = 1024 * 1024
_PEERCRED = struct.Struct("3i")


class SocketError(TurnkeeperError):
    exit_code = exits.UNAVAILABLE


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer of a connected AF_UNIX socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def make_access_middleware(config: Config) -> Callable[..., Awaitable[web.StreamResponse]]:
    allowed_uids = {0, os.getuid(), *config.daemon.allowed_uids}
    allowed_gids = set(config.daemon.allowed_gids)

    @web.middleware
    async def access(request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None and sock.family == socket.AF_UNIX:
            try:
                _pid, uid, gid = peer_credentials(sock)
            except OSError:
                return routes.error(403, "peer credentials unavailable")
            if uid not in allowed_uids and gid not in allowed_gids:
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


def prepare_socket_path(path: Path) -> None:
    """Create the parent directory (0750), refuse one wider than that which we cannot
    tighten, and clear a stale socket left by a dead daemon. A live one is an error."""
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    except OSError as exc:
        raise SocketError(f"cannot create socket directory {parent}: {exc.strerror}") from None
    st = parent.stat()
    if st.st_mode & 0o027:
        if st.st_uid == os.getuid():
            os.chmod(parent, stat.S_IMODE(st.st_mode) & 0o750)
        else:
            raise SocketError(f"socket directory {parent} is wider than 0750 and not ours")
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

    async def start(self, extra_app_setup: Callable[[web.Application], None] | None = None
                    ) -> None:
        app = self.build_app()
        if extra_app_setup is not None:
            extra_app_setup(app)
        runner = web.AppRunner(app, handle_signals=False, access_log=None,
                               keepalive_timeout=30.0, shutdown_timeout=5.0)
        await runner.setup()
        self._runner = runner
        site: web.BaseSite
        if self.inherited is not None:
            site = web.SockSite(runner, self.inherited)
        else:
            prepare_socket_path(self.path)
            old_umask = os.umask(0o177)
            try:
                site = web.UnixSite(runner, str(self.path))
                await site.start()
                self._bound = True
            finally:
                os.umask(old_umask)
            os.chmod(self.path, self.mode)
            log.info("control.listening", socket=str(self.path), mode=oct(self.mode))
            return
        await site.start()
        log.info("control.listening", socket="(systemd socket activation)")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._bound:
            self._bound = False
            with contextlib.suppress(OSError):
                self.path.unlink()
