"""Who may connect to the control socket, and how many: every accepted connection
passes the gate before aiohttp sees it.

The peer's credentials come from the accepted socket (SO_PEERCRED, and its
supplementary groups from SO_PEERGROUPS or /proc); root, the daemon's own uid and the
configured uids/gids are let in, everyone else is answered 403 at once, before the
connection counts against any limit. Then at most `daemon.max_connections` connections
are served; one more is answered 503 without its request being read. One uid other than
root and the daemon's own may hold at most half of them, and never the last few
(`policy/admission.py` says how many), so nobody's idle connections lock the operator
out.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import struct
import weakref
from collections.abc import Callable
from typing import Any, cast

import structlog
from aiohttp import web

from turnkeeper.config import Config
from turnkeeper.control.lane import StatusLane
from turnkeeper.policy.admission import ControlLimits

log = structlog.get_logger("turnkeeper.control")

_PEERCRED = struct.Struct("3i")
# Not in Python's socket module on every version; the Linux value since 4.13.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_GID = struct.Struct("I")


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

    def allows(self, sock: socket.socket) -> bool:
        """Whether the peer of an accepted AF_UNIX socket may use it, as `refusal` says
        but silent and keeping nothing: asked from the control lane's thread."""
        try:
            pid, uid, gid = peer_credentials(sock)
        except OSError:
            return False
        return self._admits(sock, pid, uid, gid)

    def _admits(self, sock: socket.socket, pid: int, uid: int, gid: int) -> bool:
        """The rule: an allowed uid, or an allowed gid, primary or supplementary (read
        only when the first two do not decide)."""
        return (uid in self.allowed_uids or gid in self.allowed_gids
                or bool(self.allowed_gids and self.allowed_gids & peer_groups(sock, pid)))

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
        if self._admits(transport.get_extra_info("socket"), pid, uid, gid):
            return None
        log.warning("control.forbidden", uid=uid, gid=gid)
        return (f"uid {uid} is not allowed on this socket: add it to [daemon] allowed_uids,"
                f" or one of its groups to [daemon] allowed_gids, in the daemon's"
                f" configuration")


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

    def __init__(self, site: BoundedSite) -> None:
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


class BoundedSite(web.SockSite):
    """A listening socket whose connections pass `_Gate`: the peer check, then
    `max_connections` (with a share per uid). With `status` (the status answer, asked
    on the event loop; None before the daemon has started) the socket is the
    control lane's (`control/lane.py`): a thread of its own accepts, answers
    `GET /v1/status`, and hands every other connection to the gate."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, *,
                 limits: ControlLimits, peers: PeerCheck,
                 status: Callable[[], dict[str, Any] | None] | None = None,
                 status_key: Callable[[], object] = lambda: None) -> None:
        super().__init__(runner, sock)
        self._tk_status = status
        self._tk_status_key = status_key
        self.lane: StatusLane | None = None
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
        self._adopting: set[asyncio.Task[None]] = set()  # handed-over connections

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
        if self._tk_status is None:
            await self._listen()
            return
        self.lane = StatusLane(self._tk_sock, loop=loop, status=self._tk_status,
                               hand_over=self._take, allowed=self.peers.allows,
                               key=self._tk_status_key, failed=self._lane_failed)
        self.lane.start()

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Gate(self), sock=self._tk_sock,
                                                backlog=128)

    def _lane_failed(self) -> None:
        """On the event loop: the control lane's thread ended on a bug (logged as
        `control.lane_failed`). The loop accepts on the socket from now on, as it does
        without a lane; the connections the lane handed over before are served."""
        lane, self.lane = self.lane, None
        if lane is None:  # the site stopped meanwhile
            return
        lane.close()
        task = asyncio.get_running_loop().create_task(self._listen())
        self._adopting.add(task)
        task.add_done_callback(self._adopting.discard)

    def _take(self, sock: socket.socket) -> None:
        """On the event loop: a connection the control lane handed over (closed when
        the site has stopped since)."""
        if self.lane is None:
            sock.close()
            return
        self.lane.took()
        task = asyncio.get_running_loop().create_task(self._adopt(sock))
        self._adopting.add(task)
        task.add_done_callback(self._adopting.discard)

    async def _adopt(self, sock: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: _Gate(self), sock)
        except OSError:
            sock.close()

    async def stop(self) -> None:
        lane, self.lane = self.lane, None
        if lane is not None:
            lane.close()
            self._tk_sock.close()
        await super().stop()
