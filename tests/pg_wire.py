"""A counting proxy in front of PostgreSQL, for tests and benchmarks: how many statements
the daemons send, how many transactions they commit and how many round trips they wait
for.

pg_stat_statements needs `shared_preload_libraries` (a server restart), so the count is
taken on the wire instead: every message each way is framed and read by its type.
Statements are the server's CommandComplete messages (one per statement run, whatever
protocol or pipelining carried it: a simple query of four statements counts four);
transactions the COMMIT tags among them; round trips the times a client sent something
with nothing outstanding (every Sync and simple Query it sent before answered by
ReadyForQuery), so statements pipelined behind one another count one round trip.

The proxy runs its own event loop in a thread of the test's or benchmark's process (not
a daemon's: its CPU is not counted with theirs). It adds a hop to every round trip:
benchmarks count through it in a round of their own and time the other rounds without
it. `tags` counts the statements by their command tag's first word (`COMMIT`, `RESET`,
`INSERT`...); `queries` by their text (whitespace folded, cut at 120 characters), and
`query_s` the seconds each text's statements took, from when the client sent one (or
the one before it completed, pipelined behind it) to its CommandComplete: on a loopback
server not otherwise busy, about the time it ran.
"""

from __future__ import annotations

import asyncio
import collections
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104


@dataclass
class Counts:
    statements: int = 0
    commits: int = 0
    round_trips: int = 0
    connections: int = 0
    tags: collections.Counter[str] = field(default_factory=collections.Counter)
    queries: collections.Counter[str] = field(default_factory=collections.Counter)
    query_s: dict[str, float] = field(default_factory=dict)

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.statements - other.statements, self.commits - other.commits,
                      self.round_trips - other.round_trips,
                      self.connections - other.connections, self.tags - other.tags,
                      self.queries - other.queries,
                      {q: s - other.query_s.get(q, 0.0) for q, s in self.query_s.items()
                       if q in self.queries - other.queries})

    def copy(self) -> Counts:
        return Counts(self.statements, self.commits, self.round_trips, self.connections,
                      collections.Counter(self.tags), collections.Counter(self.queries),
                      dict(self.query_s))


def _text(raw: bytes) -> str:
    return " ".join(raw.decode("utf-8", "replace").split())[:120]


class _Conn:
    """One client connection's framing state, both ways."""

    def __init__(self, counts: Counts) -> None:
        self.counts = counts
        self.up = b""  # client -> server bytes not yet framed
        self.down = b""
        self.startup = True  # the client's next message is untyped
        self.raw_bytes = 0  # single-byte answers to SSL/GSS requests still to come
        self.opaque = False  # TLS: nothing more can be read
        self.outstanding = 0  # Syncs and Queries sent, not yet answered
        self.prepared: dict[bytes, str] = {}  # statement name -> its text
        self.portals: dict[bytes, str] = {}  # portal -> the text bound to it
        # The statements sent and not yet completed, by Sync (or simple Query): the
        # server answers them in order, and skips the rest of a group after an error.
        self.groups: collections.deque[collections.deque[tuple[str, float]]] = (
            collections.deque([collections.deque()]))
        self.done_at = 0.0  # when the last statement completed

    def client(self, data: bytes) -> None:
        if self.opaque:
            return
        if self.outstanding == 0 and not self.startup:
            self.counts.round_trips += 1
        self.up += data
        buf = self.up
        at = 0
        while True:
            if self.startup:
                if len(buf) - at < 4:
                    break
                (n,) = struct.unpack_from("!i", buf, at)
                if len(buf) - at < n:
                    break
                code = struct.unpack_from("!i", buf, at + 4)[0] if n >= 8 else 0
                if code in (SSL_REQUEST, GSSENC_REQUEST):
                    self.raw_bytes += 1
                else:
                    self.startup = False
                at += n
                continue
            if len(buf) - at < 5:
                break
            kind = buf[at:at + 1]
            (n,) = struct.unpack_from("!i", buf, at + 1)
            if len(buf) - at < n + 1:
                break
            if kind in (b"S", b"Q"):
                self.outstanding += 1
            self._statement(kind, bytes(buf[at + 5:at + 1 + n]))
            at += n + 1
        self.up = buf[at:]

    def _statement(self, kind: bytes, body: bytes) -> None:
        now = time.perf_counter()
        if kind == b"P":
            name, _, rest = body.partition(b"\0")
            self.prepared[name] = _text(rest.partition(b"\0")[0])
        elif kind == b"B":
            portal, _, rest = body.partition(b"\0")
            self.portals[portal] = self.prepared.get(rest.partition(b"\0")[0], "?")
        elif kind == b"E":
            portal = body.partition(b"\0")[0]
            self.groups[-1].append((self.portals.get(portal, "?"), now))
        elif kind == b"Q":
            text = body.rstrip(b"\0")
            for part in text.split(b";"):
                if part.strip():
                    self.groups[-1].append((_text(part), now))
            self.groups.append(collections.deque())
        elif kind == b"S":
            self.groups.append(collections.deque())

    def server(self, data: bytes) -> None:
        if self.opaque:
            return
        if self.raw_bytes:
            self.raw_bytes -= 1
            if data[:1] == b"S":
                self.opaque = True
                return
            data = data[1:]
        self.down += data
        buf = self.down
        at = 0
        while len(buf) - at >= 5:
            kind = buf[at:at + 1]
            (n,) = struct.unpack_from("!i", buf, at + 1)
            if len(buf) - at < n + 1:
                break
            if kind == b"C":
                self._completed()
                self.counts.statements += 1
                tag = bytes(buf[at + 5:at + 1 + n]).split(b" ", 1)[0].rstrip(b"\0")
                self.counts.tags[tag.decode("ascii", "replace")] += 1
                if tag == b"COMMIT":
                    self.counts.commits += 1
            elif kind == b"Z":
                self.outstanding = max(0, self.outstanding - 1)
                if len(self.groups) > 1:
                    self.groups.popleft()
            at += n + 1
        self.down = buf[at:]

    def _completed(self) -> None:
        group = self.groups[0]
        if not group:
            return
        text, sent = group.popleft()
        now = time.perf_counter()
        self.counts.queries[text] += 1
        self.counts.query_s[text] = (self.counts.query_s.get(text, 0.0)
                                     + now - max(sent, self.done_at))
        self.done_at = now


class CountingProxy:
    """`url()` is `target_url` through the proxy; `counts` what went through so far."""

    def __init__(self, target_url: str) -> None:
        parts = urllib.parse.urlsplit(target_url)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self.target_url = target_url
        self.counts = Counts()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def url(self, target_url: str | None = None) -> str:
        parts = urllib.parse.urlsplit(target_url or self.target_url)
        user = f"{parts.username}@" if parts.username else ""
        return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{self.port}"))

    def snapshot(self) -> Counts:
        return self.counts.copy()

    def start(self) -> CountingProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result()
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                     ) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.counts.connections += 1
        conn = _Conn(self.counts)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       seen: object) -> None:
            try:
                while data := await src.read(65536):
                    seen(data)  # type: ignore[operator]
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_w, conn.client), pump(up_r, writer, conn.server))
