"""What the control plane admits: connections, event streams per client, message sizes.

Each limit is compared here and nowhere else, so the socket server and the routes only
ask and act (answer 503, 429 or 413). The descriptor arithmetic is here too: a daemon
that lets its control clients take every file descriptor has none left for the
providers, and its own EMFILE then looks like a provider outage.
"""

from __future__ import annotations

from dataclasses import dataclass

# A quarter of the descriptors at most go to control connections; the rest stay for the
# store, providers, tools and MCP servers.
CONTROL_SHARE_OF_DESCRIPTORS = 4
MAX_DEFAULT_CONNECTIONS = 1024


def default_max_connections(nofile_soft: int | None) -> int:
    """min(1024, a quarter of the soft descriptor limit); None = unlimited."""
    if nofile_soft is None:
        return MAX_DEFAULT_CONNECTIONS
    return max(1, min(MAX_DEFAULT_CONNECTIONS, nofile_soft // CONTROL_SHARE_OF_DESCRIPTORS))


@dataclass(frozen=True, slots=True)
class ControlLimits:
    max_connections: int
    max_followers_per_client: int
    max_message_bytes: int

    def admits_connection(self, open_now: int) -> bool:
        return open_now < self.max_connections

    def admits_peer(self, open_now: int, open_of_uid: int, *, privileged: bool) -> bool:
        """A connection from a peer already let in by the credential check. Root and the
        daemon's own uid may use every slot; any other uid at most half of them, and none
        of the last `reserved_slots`, so one user's idle connections can never lock the
        operator out of `status`."""
        if privileged:
            return self.admits_connection(open_now)
        return (open_now < self.max_connections - self.reserved_slots
                and open_of_uid < self.per_uid_connections)

    @property
    def reserved_slots(self) -> int:
        """Slots kept for root and the daemon's uid: a sixteenth, at least one (none
        when there is only one slot at all)."""
        return min(self.max_connections - 1, max(1, self.max_connections // 16))

    @property
    def per_uid_connections(self) -> int:
        """What one unprivileged uid may hold at once: half the slots, at least one."""
        return max(1, self.max_connections // 2)

    def admits_follower(self, following_now: int) -> bool:
        return following_now < self.max_followers_per_client

    def message_too_large(self, size_bytes: int) -> bool:
        return size_bytes > self.max_message_bytes


def inbox_full(pending: int, *, max_pending_messages: int) -> bool:
    """A turn's inbox holds messages its next step has not taken yet: past the limit a
    client steering in a loop would grow the daemon's memory and every checkpoint."""
    return pending >= max_pending_messages


@dataclass(frozen=True, slots=True)
class FollowerBacklog:
    """How far behind an event follower may fall before it is dropped.

    A follower's backlog is every byte the daemon holds for it: the encoded events
    waiting for its stream and what its socket has taken and not sent yet. A client that
    stops reading would otherwise make the daemon keep every event from then on. The
    follower is dropped (`"buffer"`) as soon as its backlog passes `max_bytes`, so what
    it can cost is bounded, or (`"stalled"`) once it has stayed over half of that for
    `stall_timeout_s` (it reads, but not enough to catch up). A dropped follower reopens
    its stream with `after=` the last `seq` it read and loses nothing that was stored.
    """

    max_bytes: int
    stall_timeout_s: float

    def judge(self, backlog_bytes: int, behind_since: float | None,
              now: float) -> tuple[str | None, float | None]:
        """(why it is dropped, or None to keep it; since when it has been behind, or
        None while it is not)."""
        if backlog_bytes > self.max_bytes:
            return "buffer", now if behind_since is None else behind_since
        if backlog_bytes * 2 <= self.max_bytes:
            return None, None
        if behind_since is None:
            return None, now
        if now - behind_since >= self.stall_timeout_s:
            return "stalled", behind_since
        return None, behind_since
