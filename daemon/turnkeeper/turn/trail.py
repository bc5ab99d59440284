"""The turn's trail: what a turn remembers for the rest of its run and that grows with
every step, kept so that a checkpoint stays the same size however long the turn runs.

Three lists grow with a turn besides its conversation: its partial-work lines (one per
tool call and answer), the loop guard's keys (the calls it counted, the states and
observations it saw) and the side-effect ledger's outcomes. Written whole into every
checkpoint, they made a checkpoint grow with the turn: 200 steps in, about 30 KB encoded
and stored twice a step.

A checkpoint now carries only the lines added since the last spill (its "tail", at most
about `TAIL_CHARS` characters); once the tail reaches that, the next checkpoint writes
it as one trail row (a JSON array of lines, written once) and starts an empty tail. A
turn of a few steps never writes a row (its lines ride in the checkpoint, as before, and
cost no statement of their own); a long one writes a row every 40 steps or so (a step of
one tool call adds four lines, about 100 characters), and its checkpoint stays under
a few kilobytes.

A line is a tag and its text: "p" a partial-work line, "l" a loop guard line, "e" an
effect ledger line. Each list keeps its own order: rows, then the tail, split by tag.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from turnkeeper.store.base import MessageRows

_PARTIAL, _LOOPS, _EFFECTS = "p", "l", "e"
_TAGS = (_PARTIAL, _LOOPS, _EFFECTS)

# The tail's size (characters of its lines) at which a checkpoint writes it as a row: a
# step of one tool call adds four lines of 18-60 characters, so a row every 40 steps.
TAIL_CHARS = 4096

Lists = tuple[list[str], list[str], list[str]]


def split(lines: Sequence[str]) -> Lists:
    """Tagged lines, in order, as the three lists (partial work, loop guard, effect
    ledger). Raises ValueError for a line with no known tag."""
    lists: dict[str, list[str]] = {tag: [] for tag in _TAGS}
    for line in lines:
        found = lists.get(line[:1]) if isinstance(line, str) else None
        if found is None:
            raise ValueError(f"not a trail line: {line!r}")
        found.append(line[1:])
    return lists[_PARTIAL], lists[_LOOPS], lists[_EFFECTS]


def _tagged(lists: Lists, starts: Sequence[int]) -> list[str]:
    """The lines of each list from its start on, tagged, list after list."""
    return [tag + line for tag, lines, n in zip(_TAGS, lists, starts, strict=True)
            for line in lines[n:]]


def read(stored: Mapping[str, Any]) -> tuple[Lists, int, tuple[int, ...]]:
    """A checkpoint's "trail" value, as read back from the store (`{"count", "tail",
    "rows"}`) or as `Trail.to_json` gave it (`{"count", "lines", "spilled"}`): the three
    lists, how many rows the store holds, and how many lines of each list are in them."""
    count = int(stored["count"])
    if "lines" in stored:
        return split(stored["lines"]), count, tuple(int(n) for n in stored["spilled"])
    if len(stored["rows"]) != count:
        raise ValueError(f"the checkpoint counts {count} trail rows but the store gave "
                         f"back {len(stored['rows'])}")
    in_rows: list[str] = []
    for row in stored["rows"]:
        lines = orjson.loads(row)
        if not isinstance(lines, list):
            raise ValueError(f"not a trail row: {row[:80]!r}")
        in_rows += lines
    spilled, tail = split(in_rows), split(stored["tail"])
    lists = (spilled[0] + tail[0], spilled[1] + tail[1], spilled[2] + tail[2])
    return lists, count, tuple(map(len, spilled))


class Trail:
    """The three growing lists of a live turn (the very lists its parts append to), how
    many trail rows the store holds and how many lines of each list are in them. The
    tail is kept as lines are taken from the lists, so a checkpoint costs the lines it
    adds, not the tail's length."""

    __slots__ = ("_chars", "_lists", "_rows", "_spilled", "_spilling", "_tail", "_taken")

    def __init__(self, lists: Lists, *, rows: int = 0,
                 spilled: tuple[int, ...] = (0, 0, 0)) -> None:
        self._lists = lists
        self._rows = rows
        self._spilled = spilled
        # The lines not in a row, tagged, and their characters; `_taken`: how many lines
        # of each list are in a row or in the tail (moved there by `save`). The tail list
        # is replaced, never changed, so the checkpoints that hold it need no copy of
        # their own.
        self._tail: list[str] = []
        self._chars = 0
        self._taken = spilled
        # While a save that writes the tail as a row is in flight: the lines of each list
        # that row holds.
        self._spilling: tuple[int, ...] | None = None

    def save(self) -> tuple[dict[str, Any], MessageRows | None]:
        """What a checkpoint writes of the trail: its part of the checkpoint (how many
        rows the store holds with it, and the lines not in them) and the row it adds,
        the tail, once the tail has reached `TAIL_CHARS` (None before). Call
        `mark_saved()` once that write has returned."""
        # The lines added to the lists since the last save join the tail.
        now = tuple(map(len, self._lists))
        if now != self._taken:
            new = _tagged(self._lists, self._taken)
            self._tail = self._tail + new  # a new list: a checkpoint may hold the old one
            self._chars += sum(map(len, new))
            self._taken = now
        if self._chars < TAIL_CHARS:
            self._spilling = None
            return {"count": self._rows, "tail": self._tail}, None
        self._spilling = self._taken
        row = MessageRows(self._rows, (orjson.dumps(self._tail).decode(),))
        return {"count": self._rows + 1, "tail": []}, row

    def mark_saved(self) -> None:
        """The write of the last `save()` has returned."""
        if self._spilling is None:
            return
        self._rows += 1
        self._spilled, self._spilling = self._spilling, None
        self._tail, self._chars = [], 0

    def to_json(self) -> dict[str, Any]:
        """Every line inline, and what the store holds (for a resume in the same
        process, from memory)."""
        return {"count": self._rows,
                "lines": _tagged(self._lists, (0, 0, 0)),
                "spilled": list(self._spilled)}
