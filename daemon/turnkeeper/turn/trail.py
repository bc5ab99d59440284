"""The turn's trail: what a turn remembers for the rest of its run and that grows with
every step, kept as lines appended once.

Three lists grow with a turn besides its conversation: its partial-work lines (one per
tool call and answer), the loop guard's keys (the calls it counted, the states and
observations it saw) and the side-effect ledger's outcomes. Written whole into every
checkpoint they made a checkpoint grow with the turn: 200 steps in, a few kilobytes
encoded and stored twice a step. As a trail, a checkpoint holds their count, and writes
only the lines added since the last save, as rows, the way the conversation's messages
go (`Conversation.unsaved_rows`).

A row is a tag and a line: "p" a partial-work line, "l" a loop guard line, "e" an
effect ledger line. The three lists keep their own order; the rows of one checkpoint
are the new lines of each list in turn, so rows of different lists interleave in the
store, and reading them back splits them by tag.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from turnkeeper.store.base import MessageRows

_PARTIAL, _LOOPS, _EFFECTS = "p", "l", "e"
_TAGS = (_PARTIAL, _LOOPS, _EFFECTS)


def split(rows: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """The rows of a trail, in order, as its three lists (partial work, loop guard,
    effect ledger). Raises ValueError for a row with no known tag."""
    lists: dict[str, list[str]] = {tag: [] for tag in _TAGS}
    for row in rows:
        lines = lists.get(row[:1]) if isinstance(row, str) else None
        if lines is None:
            raise ValueError(f"not a trail row: {row!r}")
        lines.append(row[1:])
    return lists[_PARTIAL], lists[_LOOPS], lists[_EFFECTS]


def read(stored: Mapping[str, Any]) -> tuple[list[str], list[str], list[str],
                                              tuple[int, int, int]]:
    """A checkpoint's "trail" value as read back (`{"count", "rows"}`, every row in the
    store) or as `Trail.to_json` gave it (with "saved"): the three lists, and how many
    lines of each the store holds."""
    partial, loops, effects = split(stored["rows"])
    saved = stored.get("saved")
    if saved is None:
        return partial, loops, effects, (len(partial), len(loops), len(effects))
    p, lo, e = (int(n) for n in saved)
    return partial, loops, effects, (p, lo, e)


class Trail:
    """The three growing lists of a live turn (the very lists its parts append to) and
    how many lines of each the store holds."""

    __slots__ = ("_lists", "_saved", "_saving")

    def __init__(self, partial: list[str], loops: list[str], effects: list[str], *,
                 saved: tuple[int, int, int] = (0, 0, 0)) -> None:
        self._lists = (partial, loops, effects)
        self._saved = tuple(min(n, len(lines)) for n, lines in zip(saved, self._lists, strict=True))
        self._saving: tuple[int, ...] | None = None

    @property
    def count(self) -> int:
        """Lines in all three lists: the rows the store holds once they are saved."""
        return sum(len(lines) for lines in self._lists)

    def unsaved_rows(self) -> MessageRows | None:
        """The rows a checkpoint writes: the lines added since the last save, after the
        rows the store holds (None when there are none). Call `mark_saved()` once that
        write has returned."""
        saved = self._saved
        self._saving = tuple(len(lines) for lines in self._lists)
        rows = [tag + line for tag, lines, n in zip(_TAGS, self._lists, saved, strict=True)
                for line in lines[n:]]
        return MessageRows(sum(saved), tuple(rows)) if rows else None

    def mark_saved(self) -> None:
        """The rows of the last `unsaved_rows()` are stored."""
        if self._saving is not None:
            self._saved, self._saving = self._saving, None

    def stored_json(self) -> dict[str, Any]:
        """The checkpoint's part: how many rows the trail has."""
        return {"count": self.count}

    def to_json(self) -> dict[str, Any]:
        """Every line inline, and how many of each list the store holds (for a resume in
        the same process, from memory)."""
        return {"count": self.count,
                "rows": [tag + line for tag, lines in zip(_TAGS, self._lists, strict=True)
                         for line in lines],
                "saved": list(self._saved)}
