"""systemd integration without libsystemd: sd_notify, the watchdog and socket activation.

The protocols are small and stable (see sd_notify(3), sd_watchdog_enabled(3),
sd_listen_fds(3)), so they are spoken here with `socket` and `os` alone. The rule for every
call that talks to systemd: a failure is counted and swallowed, never raised into the daemon.
A notification that cannot be delivered must not turn a healthy daemon into a crashed one;
systemd notices the silence on its own (start timeout, watchdog).

Environment variables are read once and then removed from `os.environ`, as libsystemd does with
`unset_environment`, so that processes the daemon starts do not inherit them and talk to
systemd in its name (`NotifyAccess=main` would drop them anyway, but a stray `LISTEN_FDS` in a
child that also speaks socket activation is worse).

The module imports no third-party package at import time: the CLI may use it and must start
fast. `watchdog_loop` imports anyio when it runs.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import TypeVar

__all__ = [
    "EXTEND_EVERY_S",
    "SD_LISTEN_FDS_START",
    "Notifier",
    "asking_for_time",
    "extend_timeout_loop",
    "listen_fds",
    "status_loop",
    "take_unix_listener",
    "watchdog_interval",
    "watchdog_loop",
]

SD_LISTEN_FDS_START = 3
"""The first file descriptor systemd passes (sd-daemon.h)."""

EXTEND_EVERY_S = 5.0
"""How often a long drain asks systemd for more time; each request is for three times this."""

_T = TypeVar("_T")


def _socket_address(value: str) -> str | None:
    """`NOTIFY_SOCKET` as an AF_UNIX address: a path, or `@name` for the abstract namespace.

    Other forms (`vsock:...` on systemd >= 254) are not spoken here: None, so the notifier is
    a no-op rather than an error on every call.
    """
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    return None


def _one_line(value: object) -> str:
    """A field value with newlines folded: the protocol is one `KEY=VALUE` per line."""
    return " ".join(str(value).splitlines())


class Notifier:
    """Sends sd_notify datagrams to systemd; a no-op when the daemon is not run by systemd.

    Build it with `Notifier.from_env()` once at start. `sent` and `errors` count datagrams
    delivered and lost; `last_error` keeps the last failure for `/v1/status` or a log line.
    """

    def __init__(self, address: str | None) -> None:
        self._address = address
        self._sock: socket.socket | None = None
        self.sent = 0
        self.errors = 0
        self.last_error: str | None = None
        self.last_status: str | None = None  # the last STATUS= sent, by any message

    @classmethod
    def from_env(
        cls, environ: MutableMapping[str, str] | None = None, *, unset: bool = True
    ) -> Notifier:
        """Read `NOTIFY_SOCKET` (and remove it from the environment unless `unset=False`)."""
        env = os.environ if environ is None else environ
        value = env.get("NOTIFY_SOCKET", "")
        if unset:
            env.pop("NOTIFY_SOCKET", None)
        return cls(_socket_address(value) if value else None)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def __repr__(self) -> str:
        where = "disabled" if self._address is None else repr(self._address.replace("\0", "@"))
        return f"<Notifier {where} sent={self.sent} errors={self.errors}>"

    def send(self, message: str) -> bool:
        """Send one datagram. True when it was handed to the kernel; False when disabled or lost."""
        if self._address is None:
            return False
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(message.encode("utf-8", "replace"), self._address)
        except OSError as exc:
            # Lost: systemd restarted, the socket vanished, or its queue is full (EAGAIN). A
            # fresh socket next time costs nothing and heals a socket left in a bad state.
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            self.close()
            return False
        self.sent += 1
        return True

    def notify(self, **fields: object) -> bool:
        """`notify(READY=1, STATUS="ready")`: one datagram, keys upper-cased, one line each."""
        status = fields.get("STATUS", fields.get("status"))
        if status is not None:
            self.last_status = str(status)
        return self.send("\n".join(f"{key.upper()}={_one_line(v)}" for key, v in fields.items()))

    def ready(self, status: str | None = None) -> bool:
        return self._with_status({"READY": 1}, status)

    def reloading(self, status: str | None = None) -> bool:
        """`RELOADING=1` with the `MONOTONIC_USEC` systemd >= 253 requires to accept it."""
        fields: dict[str, object] = {
            "RELOADING": 1,
            "MONOTONIC_USEC": time.monotonic_ns() // 1000,
        }
        return self._with_status(fields, status)

    def stopping(self, status: str | None = None) -> bool:
        return self._with_status({"STOPPING": 1}, status)

    def status(self, text: str) -> bool:
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for `seconds` more before the start/stop/reload timeout fires (systemd >= 236)."""
        return self.notify(EXTEND_TIMEOUT_USEC=max(0, int(seconds * 1_000_000)))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _with_status(self, fields: dict[str, object], status: str | None) -> bool:
        if status is not None:
            fields["STATUS"] = status
        return self.notify(**fields)


def watchdog_interval(
    environ: MutableMapping[str, str] | None = None, *, unset: bool = True
) -> float | None:
    """Seconds between `WATCHDOG=1` pings: half of `WATCHDOG_USEC`, or None when not asked.

    As sd_watchdog_enabled(3): the request is ours only when `WATCHDOG_PID` is unset or names
    this process. Half the interval leaves a whole half for a slow tick before systemd kills us.
    """
    env = os.environ if environ is None else environ
    usec_text = env.get("WATCHDOG_USEC")
    pid_text = env.get("WATCHDOG_PID")
    if unset:
        env.pop("WATCHDOG_USEC", None)
        env.pop("WATCHDOG_PID", None)
    if usec_text is None:
        return None
    try:
        usec = int(usec_text)
        pid = int(pid_text) if pid_text else None
    except ValueError:
        return None
    if usec <= 0 or (pid is not None and pid != os.getpid()):
        return None
    return usec / 2 / 1_000_000


async def watchdog_loop(notifier: Notifier, interval_s: float) -> None:
    """Ping the watchdog every `interval_s` seconds from the event loop itself, forever.

    It runs as a task of the daemon's own task group on purpose: a loop wedged by a blocking
    call stops the pings, and systemd restarts the daemon: the watchdog's whole point. A
    thread would keep pinging for a dead daemon.
    """
    import anyio

    while True:
        notifier.watchdog()
        await anyio.sleep(interval_s)


async def extend_timeout_loop(notifier: Notifier, every_s: float = EXTEND_EVERY_S) -> None:
    """While a drain runs: `EXTEND_TIMEOUT_USEC` for `3 * every_s`, every `every_s`, until
    cancelled.

    systemd honours it only once the current state's own timeout (`TimeoutStopSec=` for a
    stop, `TimeoutStartSec=` for a start or reload) has passed, so it costs nothing when the
    drain is short, and a drain longer than the unit allows is not killed for its length.
    Sent from the event loop, in small steps: a loop that wedges stops asking, and the
    timeout comes back within three steps.
    """
    import anyio

    while True:
        notifier.extend_timeout(3 * every_s)
        await anyio.sleep(every_s)


async def asking_for_time(notifier: Notifier, work: Callable[[], Awaitable[_T]], *,
                          status: str, after_s: float = EXTEND_EVERY_S,
                          every_s: float = EXTEND_EVERY_S) -> _T:
    """`await work()`, and once it has run `after_s`: `STATUS=` `status`, then
    `extend_timeout_loop` until it returns. A start-up step that may take minutes (a
    schema migration of a large state file) is then not killed by `TimeoutStartSec=` for
    its length, and one that is over at once sends nothing."""
    import anyio

    async def ask() -> None:
        await anyio.sleep(after_s)
        notifier.status(status)
        await extend_timeout_loop(notifier, every_s)

    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
        try:
            result = await work()
        except Exception as exc:  # raised below as it is, not in the task group's group
            failure = exc
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result


async def status_loop(notifier: Notifier, status: Callable[[], str],
                      every_s: float = 1.0) -> None:
    """Keep `STATUS=` current: every `every_s`, send `status()` if it changed since
    the last `STATUS=` any message carried. Nothing is sent while nothing changes."""
    import anyio

    if not notifier.enabled:
        return
    while True:
        await anyio.sleep(every_s)
        line = status()
        if line != notifier.last_status:
            notifier.status(line)


def listen_fds(
    environ: MutableMapping[str, str] | None = None, *, unset: bool = True
) -> list[tuple[int, str]]:
    """The sockets systemd passed (socket activation), as `(fd, name)` pairs; [] when none.

    As sd_listen_fds_with_names(3): honoured only when `LISTEN_PID` is this process; the fds
    start at 3; names come from `LISTEN_FDNAMES` (":"-separated, "unknown" when absent or short).
    Each fd is marked close-on-exec so children do not inherit the listener. The three variables
    are removed from the environment unless `unset=False`.
    """
    env = os.environ if environ is None else environ
    pid_text = env.get("LISTEN_PID", "")
    count_text = env.get("LISTEN_FDS", "")
    names_text = env.get("LISTEN_FDNAMES")
    if unset:
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            env.pop(key, None)
    try:
        pid = int(pid_text)
        count = int(count_text)
    except ValueError:
        return []
    if pid != os.getpid() or count <= 0:
        return []
    names = names_text.split(":") if names_text else []
    result: list[tuple[int, str]] = []
    for index in range(count):
        fd = SD_LISTEN_FDS_START + index
        try:
            os.set_inheritable(fd, False)
        except OSError:
            continue  # not open: LISTEN_FDS lied; skip rather than hand out a dead number
        name = names[index] if index < len(names) and names[index] else "unknown"
        result.append((fd, name))
    return result


def _is_unix_stream_listener(sock: socket.socket) -> bool:
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    except OSError:
        return False
    return sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM and listening


def take_unix_listener(
    name_preference: str = "control", fds: Iterable[tuple[int, str]] | None = None
) -> socket.socket | None:
    """The listening AF_UNIX stream socket systemd passed, preferring the one named
    `name_preference` (`FileDescriptorName=` in the .socket unit); None when there is none.

    `fds` defaults to `listen_fds()`, which reads and clears the environment: call this once.
    Sockets not chosen are left open and untouched.
    """
    candidates = list(listen_fds() if fds is None else fds)
    chosen: socket.socket | None = None
    # Stable sort: the preferred name first, then systemd's order.
    for fd, _name in sorted(candidates, key=lambda item: item[1] != name_preference):
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        if chosen is None and _is_unix_stream_listener(sock):
            chosen = sock
        else:
            sock.detach()  # not ours to close
    return chosen
