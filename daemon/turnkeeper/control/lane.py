"""The control socket's own thread: `GET /v1/status` answered ahead of turn work.

Under thousands of turns a turn of the event loop takes 10-20 ms, and a new connection
waits for several of them (the accept, its request read, the handler's task, the
answer): `status` took 20-30 ms at best and over 100 ms at the tail. So a thread of its
own accepts every connection to the control socket and peeks at its request head.

A `GET /v1/status` that asks for its connection to be closed (as `turnkeeper status`
does), from a peer the gate lets in, is answered there. The event loop is asked for the
answer each time; while it answers quickly (within `BUSY_S`) the thread waits for it,
and the answer is the daemon's now. While the loop is busy (an answer to the lane took
longer, within the last `BUSY_FOR_S`), the thread answers at once with the loop's last
answer, when that is at most `MAX_AGE_S` old and the daemon's state, policy version,
reload counts and pause are still what they were then; else it waits for the loop's.
So under load what changes without a request (turns that start and end) may show up
to `MAX_AGE_S` late; but any request through the loop takes the answer again before
its own is sent (while someone asks often; else the old one is dropped): a client sees
its change, or what it was shown, in its next status. A status that keeps its
connection goes to the loop, where it holds one of `max_connections` as before.

Every other connection (another request, a status the loop does not answer within
`SLOW_WAIT_S`, a peer the gate refuses, one that sent no whole head within `HOLD_S`,
one more than `MAX_OPEN` at once) is handed to the event loop as it was accepted (the
lane peeks at a request, and reads only the one it answers), where the gate and aiohttp
take it as if they had accepted it. The lane accepts only while the loop keeps up with
what it hands over (`MAX_IN_TRANSIT`) and descriptors are left: the rest wait in the
socket's backlog, as they would for the loop.

The thread holds the GIL only to accept, peek at a head and write an answer: it runs
while the event loop's thread is in Python, at the interpreter's next switch, not after
the loop's turn. Of the supervisor it reads only the `key`'s immutable values; the loop
makes the answer, the thread encodes it in one call that holds the GIL throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from turnkeeper import jsonwire

log = structlog.get_logger("turnkeeper.control")

HOLD_S = 0.1  # a connection's request head waited for this long, then handed over
MAX_OPEN = 32  # connections read at once; one more is handed over at once
MAX_HEAD = 8192  # a request head longer than this is handed over
MAX_IN_TRANSIT = 64  # connections handed over and not yet taken: no accepting past it
PAUSE_S = 0.05  # no accepting this long when out of descriptors
RECHECK_S = 0.005  # a head come in part looked at again this often
BUSY_S = 0.005  # a loop that takes longer to answer is busy: the last answer serves
BUSY_FOR_S = 1.0  # ... for this long after it answered that late
MAX_AGE_S = 0.1  # an answer the loop gave this long ago serves while it is busy
SLOW_WAIT_S = 1.0  # with none that young, how long to wait for the loop's answer
STATUS_LINES = (b"GET /v1/status HTTP/1.1", b"GET /v1/status HTTP/1.0")


def _is_status(head: bytes, read: int) -> bool:
    """A whole `GET /v1/status` with no body that asks for its connection to be closed
    (`Connection: close`, or HTTP/1.0 without keep-alive): `head` is the request up to
    its blank line, `read` how many bytes came. One that keeps its connection goes to
    the event loop: there it holds one of `max_connections` as before."""
    first, _, headers = head.partition(b"\r\n")
    if first not in STATUS_LINES or read != len(head) + 4:
        return False
    close = first.endswith(b"1.0")
    for line in headers.split(b"\r\n"):
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name in (b"content-length", b"transfer-encoding"):
            return False
        if name == b"connection":
            close = value.strip().lower() == b"close"
    return close


def answer(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
            + body)


class StatusLane:
    """The thread that accepts the control socket's connections (see the module)."""

    def __init__(self, listener: socket.socket, *, loop: asyncio.AbstractEventLoop,
                 status: Callable[[], dict[str, Any] | None],
                 hand_over: Callable[[socket.socket], None],
                 allowed: Callable[[socket.socket], bool],
                 key: Callable[[], object] = lambda: None,
                 failed: Callable[[], None] = lambda: None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._listener = listener
        self._loop = loop
        self._status = status  # on the event loop: the answer (None: not started)
        self._hand_over = hand_over  # on the event loop: take this connection
        self._allowed = allowed  # in this thread: the peer may be answered here
        # In this thread too: what of the daemon an answer must match to serve (its
        # state, policy version...: immutable values, read without the loop).
        self._key = key
        # On the event loop: the thread ended on a bug, the listener is the loop's again.
        self._failed = failed
        self._now = now
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        # The loop's last answer: (when, `key` then, the answer).
        self._last: tuple[float, object, dict[str, Any]] | None = None
        self._busy_until = 0.0  # the loop answered late: busy until then
        self.answered = 0  # status requests answered here
        self.handed = 0  # connections handed to the event loop (counted here)
        self.taken = 0  # of them, those the event loop took (counted there: `took`)

    def __repr__(self) -> str:
        return f"StatusLane(answered={self.answered}, handed={self.handed})"

    def start(self) -> None:
        self._listener.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="turnkeeper control lane",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting; the connections being read are closed. Returns once the
        thread has ended."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        thread.join(timeout=5.0)
        self._wake_r.close()
        self._wake_w.close()

    # -- on the event loop -------------------------------------------------------

    def changed(self) -> None:
        """A request through the loop may have changed what `status` shows (a submit,
        a cancel, a reload...), or shown the client something newer than the last
        answer (a turn's state); called before its answer is sent. While the lane has a
        young answer (someone asks often) the loop answers again now, so a client that
        has its answer sees the change in its next status; else the old one serves no
        more."""
        last = self._last
        if last is not None and self._now() - last[0] <= MAX_AGE_S:
            self.refresh()
        else:
            self._last = None

    def took(self) -> None:
        """The event loop took a connection handed over."""
        self.taken += 1

    def refresh(self) -> None:
        """Ask the status now, on the event loop, and keep its answer."""
        key = self._key()
        out = self._status()
        self._last = None if out is None else (self._now(), key, out)

    # -- in the thread -----------------------------------------------------------

    def _hand(self, sock: socket.socket) -> None:
        self.handed += 1
        try:
            self._loop.call_soon_threadsafe(self._hand_over, sock)
        except RuntimeError:  # the loop is closed: the daemon is gone
            sock.close()

    def _fresh(self) -> bytes | None:
        """The status's body. The loop is asked for it at once. While the loop is busy
        (it took over `BUSY_S` to answer an ask within `BUSY_FOR_S`), the last answer
        serves if it is within `MAX_AGE_S` and the daemon's `key` is still what it was
        (the loop's answer to this ask is for the next); else the loop's answer, when it
        comes within `SLOW_WAIT_S` (None: not even then, or the daemon has not started,
        or the answer is not plain JSON: the request goes to the event loop). Encoded
        here, in one call that holds the GIL: the loop changes nothing of it meanwhile."""
        done = threading.Event()
        asked = self._now()

        def answer() -> None:  # on the loop
            try:
                now = self._now()
                if now - asked > BUSY_S:
                    self._busy_until = now + BUSY_FOR_S
                self.refresh()
            finally:
                done.set()

        last = self._last
        try:
            self._loop.call_soon_threadsafe(answer)
        except RuntimeError:
            return None
        if not (asked < self._busy_until and last is not None
                and asked - last[0] <= MAX_AGE_S and last[1] == self._key()):
            if not done.wait(SLOW_WAIT_S):
                return None
            last = self._last
            if last is None:
                return None
        try:
            return jsonwire.dumps_plain(last[2])
        except TypeError:
            return None

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        # Connections whose head has not come whole: when to hand each over. Those
        # with part of it are looked at again every `RECHECK_S`, out of the selector
        # (the request is peeked, not read: the socket stays readable).
        waiting: dict[socket.socket, float] = {}
        partial: set[socket.socket] = set()
        accepting = False
        paused_until = 0.0
        try:
            while True:
                # Accept only while the event loop keeps up with what is handed over
                # and descriptors are left: the rest wait in the socket's backlog.
                now = self._now()
                want = self.handed - self.taken < MAX_IN_TRANSIT and now >= paused_until
                if want != accepting:
                    if want:
                        sel.register(self._listener, selectors.EVENT_READ, None)
                    else:
                        sel.unregister(self._listener)
                    accepting = want
                deadlines = list(waiting.values())
                if partial:
                    deadlines.append(now + RECHECK_S)
                if not accepting:
                    deadlines.append(max(paused_until, now + RECHECK_S))
                timeout = None if not deadlines else max(0.0, min(deadlines) - now)
                ready = [key.fileobj for key, _ in sel.select(timeout)]
                if self._wake_r in ready:
                    return
                for sock in ready:
                    if sock is self._listener:
                        if not self._accept(sel, waiting):
                            paused_until = self._now() + PAUSE_S
                    else:
                        assert isinstance(sock, socket.socket)
                        sel.unregister(sock)
                        partial.add(sock)
                for sock in list(partial):
                    if self._look(sock):  # answered, handed over or gone
                        partial.discard(sock)
                        del waiting[sock]
                now = self._now()
                for sock, deadline in list(waiting.items()):
                    if deadline <= now:
                        if sock in partial:
                            partial.discard(sock)
                        else:
                            sel.unregister(sock)
                        del waiting[sock]
                        self._hand(sock)
        except Exception:  # a bug here must not take the control socket with it
            log.exception("control.lane_failed")
            failed = True
        else:
            failed = False
        finally:
            for sock in waiting:
                sock.close()
            sel.close()
        if failed:  # the event loop accepts on the socket from now on, as without a lane
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to serve
                self._loop.call_soon_threadsafe(self._failed)

    def _accept(self, sel: selectors.BaseSelector, waiting: dict[socket.socket, float]
                ) -> bool:
        """Accept what is waiting (False: out of descriptors, or the like)."""
        for _ in range(MAX_IN_TRANSIT):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("control.accept_failed", error=str(exc))
                return False
            sock.setblocking(False)
            if len(waiting) >= MAX_OPEN or not self._allowed(sock):
                self._hand(sock)
                if self.handed - self.taken >= MAX_IN_TRANSIT:
                    return True
                continue
            if self._look(sock):  # its request came with it: no wait for another wake
                continue
            waiting[sock] = self._now() + HOLD_S
            sel.register(sock, selectors.EVENT_READ, None)
        return True

    def _look(self, sock: socket.socket) -> bool:
        """Peek at what came: a whole status answered, any other whole head (or one
        too long) handed over, a peer gone closed: True; False, more is to come."""
        try:
            buf = sock.recv(MAX_HEAD + 1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            buf = b""
        if not buf:  # the peer went away before a whole head
            sock.close()
            return True
        end = buf.find(b"\r\n\r\n")
        if end < 0 and len(buf) <= MAX_HEAD:
            return False
        body = self._fresh() if end >= 0 and _is_status(buf[:end], len(buf)) else None
        if body is None:
            self._hand(sock)
            return True
        self.answered += 1
        try:
            sock.recv(len(buf))  # what was peeked: read, so closing resets nothing
            sock.settimeout(1.0)
            sock.sendall(answer(body))
        except OSError:
            pass
        finally:
            sock.close()
        return True
