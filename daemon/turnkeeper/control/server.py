"""The control socket server: aiohttp's web server on a Unix socket (or one handed over
by systemd), run inside the daemon's own task group, never `run_app` (which would take
the signals).

Access: the peer's credentials come from the accepted socket (SO_PEERCRED, and its
supplementary groups from SO_PEERGROUPS or /proc); root, the daemon's own uid, and the
configured uids/gids are let in, everyone else gets 403 at accept, before its
connection counts against any limit.

The socket's directory: one the daemon created, or its own `turnkeeper` directory, is
kept at 0750; any other is left as it is (re-moding /tmp or /run would lock other users
out), but refused when another user controls it or others can write it without the
sticky bit.

Descriptors: at most `daemon.max_connections` connections are served at once; one more
gets a 503 without its request being read, so a flood costs the daemon one descriptor
for an instant each. One uid other than root and the daemon's own may hold at most half
of them, and never the last few, so nobody's idle connections lock the operator out.
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


class PeerCheck:
    """Who may use the socket: root, the daemon's own uid, and the configured uids and
    gids (supplementary groups included). Asked once per connection, at accept, before
    the connection holds one of `max_connections`: a peer it refuses never counts."""

    def __init__(self, config: Config) -> None:
        self.allowed_uids = frozenset({0, os.getuid(), *config.daemon.allowed_uids})
        self.allowed_gids = frozenset(config.daemon.allowed_gids)
        self.privileged_uids = frozenset({0, os.getuid()})
        # A connection's credentials are those it had when it connected (SO_PEERCRED):
        # read once per connection, not per request of a kept-alive one (uvloop wraps
        # the descriptor in a new socket object for every getsockopt: 2.2 us a request).
        self._peers: weakref.WeakKeyDictionary[asyncio.BaseTransport, tuple[int, int, int]] = \
            weakref.WeakKeyDictionary()

    def credentials(self, transport: asyncio.BaseTransport) -> tuple[int, int, int] | None:
        """(pid, uid, gid) of an AF_UNIX peer; None for another kind of socket.
        Raises OSError when the kernel will not say."""
        creds = self._peers.get(transport)
        if creds is None:
            sock = transport.get_extra_info("socket")
            if sock is None or sock.family != socket.AF_UNIX:
                return None
            creds = self._peers[transport] = peer_credentials(sock)
        return creds

    def refusal(self, transport: asyncio.BaseTransport) -> str | None:
        """Why this peer may not use the socket, with the setting that would admit it;
        None when it may."""
        try:
            creds = self.credentials(transport)
        except OSError:
            return "peer credentials unavailable"
        if creds is None:
            return None
        pid, uid, gid = creds
        if uid in self.allowed_uids or gid in self.allowed_gids:
            return None
        if self.allowed_gids and self.allowed_gids & peer_groups(
                transport.get_extra_info("socket"), pid):
            return None
        log.warning("control.forbidden", uid=uid, gid=gid)
        return (f"uid {uid} is not allowed on this socket: add it to [daemon] allowed_uids,"
                f" or one of its groups to [daemon] allowed_gids, in the daemon's"
                f" configuration")


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


def _answer_and_close(status: str, body: dict[str, str], *, retry_after: bool) -> bytes:
    payload = json.dumps(body).encode()
    return (b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: application/json\r\n"
            + (b"Retry-After: 1\r\n" if retry_after else b"") + b"Connection: close\r\n"
            + b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)


_BUSY = _answer_and_close("503 Service Unavailable",
                          {"error": "too many control connections; retry later"},
                          retry_after=True)


class _Refused(asyncio.Protocol):
    """A connection not let in: answered without reading its request. Our side of it is
    shut at once, and the peer's request is read and dropped for at most
    `LINGER_S` before the connection is closed: closing with the request unread would
    make a client that is still sending see a broken pipe instead of the answer. While
    `lingering` is at its cap, a refused connection is closed at once."""

    LINGER_S = 1.0

    def __init__(self, answer: bytes, lingering: list[int], cap: int) -> None:
        self._answer = answer
        self._lingering = lingering
        self._cap = cap
        self._transport: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.WriteTransport subclasses: cast, not assert.
        writer = cast(asyncio.WriteTransport, transport)
        writer.write(self._answer)
        if self._lingering[0] >= self._cap or not writer.can_write_eof():
            writer.close()
            return
        self._transport = writer
        self._lingering[0] += 1
        writer.write_eof()
        asyncio.get_running_loop().call_later(self.LINGER_S, writer.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request of a connection already answered

    def eof_received(self) -> bool:
        if self._transport is not None:
            self._transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._transport = None
            self._lingering[0] -= 1


class _Gate(asyncio.Protocol):
    """Every accepted connection starts here. The peer is checked first, then the
    limits; only a connection let in is handed to aiohttp's protocol (and counts in its
    connections). A refused peer costs a descriptor for an instant and holds no slot."""

    def __init__(self, site: _BoundedSite) -> None:
        self._site = site

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        site = self._site
        refusal = site.peers.refusal(transport)
        if refusal is not None:
            site.forbidden += 1
            self._refuse(transport, _answer_and_close("403 Forbidden", {"error": refusal},
                                                      retry_after=False))
            return
        if not site.admits(transport):
            site.refused += 1
            self._refuse(transport, _BUSY)
            return
        protocol = site.server()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)

    def _refuse(self, transport: asyncio.BaseTransport, answer: bytes) -> None:
        site = self._site
        refused = _Refused(answer, site.lingering, site.max_lingering)
        transport.set_protocol(refused)
        refused.connection_made(transport)


class _BoundedSite(web.SockSite):
    """A listening socket whose connections pass `_Gate`: the peer check, then
    `max_connections` (with a share per uid)."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, *,
                 limits: ControlLimits, peers: PeerCheck) -> None:
        super().__init__(runner, sock)
        self._tk_runner = runner
        self._tk_sock = sock
        self._tk_limits = limits
        self.peers = peers
        self.refused = 0
        self.forbidden = 0
        # Refused connections still reading their request (see `_Refused`); as many as
        # may be served at once, so a flood of them costs at most that many descriptors.
        self.lingering = [0]
        self.max_lingering = limits.max_connections

    @property
    def server(self) -> web.Server:
        server = self._tk_runner.server
        assert server is not None
        return server

    def admits(self, transport: asyncio.BaseTransport) -> bool:
        open_now = self.server.connections
        try:
            creds = self.peers.credentials(transport)
        except OSError:
            creds = None
        if creds is None or creds[1] in self.peers.privileged_uids:
            return self._tk_limits.admits_peer(len(open_now), 0, privileged=True)
        uid = creds[1]
        of_uid = 0
        for handler in open_now:
            other = handler.transport
            if other is not None and self._uid_of(other) == uid:
                of_uid += 1
        return self._tk_limits.admits_peer(len(open_now), of_uid, privileged=False)

    def _uid_of(self, transport: asyncio.BaseTransport) -> int | None:
        try:
            creds = self.peers.credentials(transport)
        except OSError:
            return None
        return None if creds is None else creds[1]

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Gate(self), sock=self._tk_sock,
                                                backlog=128)


class ControlServer:
    def __init__(self, supervisor: Supervisor, *, path: Path, mode: int,
                 inherited: socket.socket | None = None) -> None:
        self.supervisor = supervisor
        self.path = path
        self.mode = mode
        self.inherited = inherited
        self.peers = PeerCheck(supervisor.config)
        self._runner: web.AppRunner | None = None
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
            return await handler(request)

        app = web.Application(client_max_size=MAX_BODY,
                              middlewares=[make_access_middleware(self.peers), started])
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
        site = _BoundedSite(runner, sock, limits=limits, peers=self.peers)
        await site.start()
        log.info("control.listening",
                 socket=str(self.path) if self.inherited is None
                 else "(systemd socket activation)",
                 mode=oct(self.mode), max_connections=limits.max_connections)

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
