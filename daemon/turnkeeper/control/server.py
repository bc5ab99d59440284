"""The control socket server: aiohttp's web server on a Unix socket (or one handed over
by systemd), run inside the daemon's own task group, never `run_app` (which would take
the signals).

Access and the connection limits are the gate's (`control/gate.py`): every accepted
connection passes it before aiohttp sees it.

The socket's directory: one the daemon created, or its own `turnkeeper` directory, is
kept at 0750; any other is left as it is (re-moding /tmp or /run would lock other users
out), but refused when another user controls it or others can write it without the
sticky bit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from turnkeeper import exits
from turnkeeper.control import routes
from turnkeeper.control.gate import BoundedSite, PeerCheck
from turnkeeper.errors import TurnkeeperError
from turnkeeper.paths import check_socket_dir_mode, check_socket_dir_owner
from turnkeeper.supervisor import Supervisor

log = structlog.get_logger("turnkeeper.control")

MAX_BODY = 1024 * 1024


class SocketError(TurnkeeperError):
    exit_code = exits.UNAVAILABLE


def make_access_middleware(peers: PeerCheck) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def access(request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        transport = request.transport
        if transport is not None:
            # The gate at accept refused everyone else; asked again here so a connection
            # that reached the app some other way is held to the same rule.
            refusal = peers.refusal(transport)
            if refusal is not None:
                return routes.error(403, refusal)
            creds = peers.credentials(transport)
            if creds is not None:
                request[routes.PEER_UID] = creds[1]
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
    others can write without the sticky bit, raises `UnsafeSocketDir` (exit 78)."""
    parent = path.parent
    created = not parent.exists()
    try:
        parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    except OSError as exc:
        raise SocketError(f"cannot create socket directory {parent}: {exc.strerror}") from None
    check_socket_dir_owner(parent)
    st = parent.stat()
    ours = created or (_is_own_dir(parent) and st.st_uid == os.getuid())
    if ours and stat.S_IMODE(st.st_mode) & ~0o750:
        os.chmod(parent, stat.S_IMODE(st.st_mode) & 0o750)
    check_socket_dir_mode(parent)
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
        self.peers = PeerCheck(supervisor.config)
        self._runner: web.AppRunner | None = None
        self._site: BoundedSite | None = None
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound

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
            try:
                return await handler(request)
            finally:  # what the control lane last answered `status` with may be old now
                self._status_changed()

        app = web.Application(client_max_size=MAX_BODY,
                              middlewares=[make_access_middleware(self.peers), started,
                                           routes.refusals])
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
        st = os.stat(self.path)
        self._bound = (st.st_dev, st.st_ino)
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
        self._site = site = BoundedSite(runner, sock, limits=limits, peers=self.peers,
                                        status=self._status, status_key=self._status_key)
        await site.start()
        log.info("control.listening",
                 socket=str(self.path) if self.inherited is None
                 else "(systemd socket activation)",
                 mode=oct(self.mode), max_connections=limits.max_connections)

    def _status_changed(self) -> None:
        lane = self._site.lane if self._site is not None else None
        if lane is not None:
            lane.changed()

    def _status_key(self) -> object:
        """What of the daemon a status answer must match to serve: immutable values,
        read by the control lane's thread without the event loop."""
        sup = self.supervisor
        return (sup.state, sup.policy.version, sup.reload_count, sup.reload_failures,
                sup.scheduler.paused, sup.last_reload_error)

    def _status(self) -> dict[str, Any] | None:
        """`GET /v1/status`'s answer as its route gives it (None until the daemon has
        started: until then the route waits)."""
        sup = self.supervisor
        if not sup.started_event.is_set():
            return None
        return routes.status_of(sup)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._bound is not None:
            bound, self._bound = self._bound, None
            unlink_if_same(self.path, bound)


def unlink_if_same(path: Path, identity: tuple[int, int]) -> None:
    """Remove the socket we bound, and only it: a daemon started after this one (whose
    start found our socket dead, or took the path while we drained) has bound a new
    socket at the same path, and unlinking that would leave it running with nobody able
    to reach it. The check and the unlink are not atomic; the window is the few
    microseconds between them, against a bind that must first find our socket gone."""
    try:
        st = path.lstat()
    except OSError:
        return
    if (st.st_dev, st.st_ino) != identity:
        log.warning("control.socket_replaced", socket=str(path),
                    detail="another process bound this path since; left in place")
        return
    with contextlib.suppress(OSError):
        path.unlink()
