"""The turn's conversation: session history, the user's message, steps, notes from the
daemon, steer messages, and the rebuild after a context overflow.

The store keeps the messages as rows, one per message, written once. The conversation
knows how many of its leading messages the store holds as they are now: a checkpoint
writes the rows from the lowest index changed since the last save (`unsaved_rows`),
which for a step is just the messages it appended; a compaction changes earlier ones
and rewrites from there. Each message is encoded to JSON text once and the text kept.
Change `messages` only through the methods here, or the store is not told."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from turnkeeper.messages import Message, ToolCall, message_text
from turnkeeper.policy.replies import CONTINUE_NOTE
from turnkeeper.policy.usage import PER_ITEM_TOKENS, text_tokens
from turnkeeper.store.base import MessageRows

NOTE_PREFIX = "[turnkeeper note] "


def message_texts(m: Message) -> list[str]:
    """What a provider is sent of a message's text: its content, and each tool call's
    name and arguments (no empty content: it weighs nothing)."""
    texts = [m.content] if m.content else []
    for c in m.tool_calls:
        texts += (c.name, c.arguments)
    return texts


def message_tokens(m: Message) -> int:
    """`item_tokens(message_texts(m))`, without the list: each message is sized as it
    joins (an ASCII text's estimate worked out here, any other's by `text_tokens`)."""
    content = m.content
    n = PER_ITEM_TOKENS
    if content:
        n += -(-len(content) // 4) if content.isascii() else text_tokens(content)
    for c in m.tool_calls:
        for text in (c.name, c.arguments):
            n += -(-len(text) // 4) if text.isascii() else text_tokens(text)
    return n


def _sized(messages: Iterable[Message]) -> int:
    return sum(map(message_tokens, messages))


class Conversation:
    def __init__(self, messages: Iterable[Message] = (), *, turn_start: int = 0,
                 held_notes: Iterable[str] = (), stored: int = 0,
                 written: int | None = 0) -> None:
        self.messages: list[Message] = list(messages)
        # Index of the turn's own user message: what comes before is session history.
        self.turn_start = turn_start
        # Notes that came while tool results were due: they follow the last result.
        self.held_notes: list[str] = list(held_notes)
        # Each message's stored JSON text, once encoded (None: not yet).
        self._texts: list[str | None] = [None] * len(self.messages)
        # The leading messages the store holds as they are now.
        self._stored = max(0, min(stored, len(self.messages)))
        # The most rows the store may hold (None: not known): every save so far wrote at
        # most this many. A save ending below it deletes the rows past its end.
        self._written = None if written is None else max(written, self._stored)
        # While a save is in flight: the length it writes up to, and the lowest index
        # changed since it was taken.
        self._saving: int | None = None
        self._touched = 0
        # Counts every change to `messages`: what was worked out from them holds while
        # it stays the same.
        self.revision = 0
        # The messages' input tokens, estimated on the large side (`policy.usage`): each
        # message is sized once, as it joins, for the budget's pre-flight of each call.
        self.tokens = _sized(self.messages)

    def _append(self, message: Message) -> None:
        self.messages.append(message)
        self._texts.append(None)
        self.revision += 1
        self.tokens += message_tokens(message)

    def _changed_from(self, index: int) -> None:
        """Messages from `index` on no longer match the stored rows (nor their size)."""
        self._stored = min(self._stored, index)
        self._touched = min(self._touched, index)
        self.revision += 1
        self.tokens = _sized(self.messages)

    @property
    def stored(self) -> int:
        """How many leading messages the store holds as they are now."""
        return self._stored

    def unsaved_rows(self) -> MessageRows:
        """The rows a checkpoint writes: every message from the lowest index changed since
        the last save, as JSON text. Call `mark_saved()` once that write has returned."""
        start, texts, messages = self._stored, self._texts, self.messages
        rows: list[str] = []
        for i in range(start, len(messages)):
            text = texts[i]
            if text is None:
                texts[i] = text = message_text(messages[i])
            rows.append(text)
        end = self._saving = self._touched = len(messages)
        written = self._written
        self._written = None if written is None else max(written, end)
        return MessageRows(start, tuple(rows), trims=written is None or written > end)

    def mark_saved(self) -> None:
        """The rows of the last `unsaved_rows()` are stored. A change made while they were
        being written (below what they covered) stays unsaved."""
        if self._saving is not None:
            self._stored = min(self._saving, self._touched)
            self._saving = None

    def __repr__(self) -> str:
        return f"Conversation({len(self.messages)} messages, turn_start={self.turn_start})"

    @classmethod
    def start(cls, history: Iterable[Mapping[str, Any]], message: str) -> Conversation:
        msgs: list[Message] = []
        for turn in history:
            msgs.append(Message(role="user", content=str(turn["message"])))
            result = turn.get("result") or {}
            answer = result.get("answer")
            if answer is None:
                stop = (result.get("stopped_because") or {}).get("message", "no answer")
                answer = f"(that turn ended {result.get('status', 'unfinished')}: {stop})"
            msgs.append(Message(role="assistant", content=str(answer)))
        conv = cls(msgs, turn_start=len(msgs))
        conv._append(Message(role="user", content=message))
        return conv

    def add_user(self, text: str) -> None:
        self._append(Message(role="user", content=text))

    def add_note(self, text: str) -> None:
        """A note from the daemon to the agent (soft budget warning, loop warning, unknown
        outcome). Sent as a user message so every wire format accepts it mid-conversation;
        never between an assistant's tool calls and their results (OpenAI and Anthropic
        both reject that), so a note that comes while results are due waits for them."""
        if self.pending_tool_calls():
            self.held_notes.append(text)
            return
        self._append(Message(role="user", content=NOTE_PREFIX + text))

    def add_assistant(self, text: str | None, tool_calls: tuple[ToolCall, ...],
                      opaque: tuple[Mapping[str, Any], ...] = ()) -> None:
        self._append(Message(role="assistant", content=text, tool_calls=tool_calls,
                             opaque=opaque))

    def continued_parts(self, end: int | None = None) -> list[str]:
        """The cut answers the next reply continues, oldest first (of the messages before
        `end`, all by default): each an assistant answer followed by the daemon's note
        asking to continue, and nothing but the daemon's notes. Empty when the daemon has
        not asked to continue since the last answer (a steer starts a new answer)."""
        msgs = self.messages
        end = len(msgs) if end is None else end
        if end - 1 <= self.turn_start or msgs[end - 1].role != "user":
            return []  # the usual case: no note asked to continue (see below)
        parts: list[str] = []
        while True:
            j, asked = end - 1, False
            while j > self.turn_start and msgs[j].role == "user" \
                    and (msgs[j].content or "").startswith(NOTE_PREFIX):
                asked = asked or msgs[j].content == NOTE_PREFIX + CONTINUE_NOTE
                j -= 1
            if not asked or j <= self.turn_start or msgs[j].role != "assistant" \
                    or msgs[j].tool_calls:
                break
            parts.append(msgs[j].content or "")
            end = j
        parts.reverse()
        return parts

    def add_tool_result(self, call: ToolCall, content: str) -> None:
        self._append(Message(role="tool", content=content, tool_call_id=call.id,
                             name=call.name))
        if self.held_notes and not self.pending_tool_calls():
            notes, self.held_notes = self.held_notes, []
            for text in notes:
                self._append(Message(role="user", content=NOTE_PREFIX + text))

    def pending_tool_calls(self) -> tuple[ToolCall, ...]:
        """Tool calls of the last assistant message that have no result yet (a step cut
        short by a crash or a suspend between the model's reply and its tools)."""
        for i in range(len(self.messages) - 1, -1, -1):
            m = self.messages[i]
            if m.role == "assistant":
                done = {x.tool_call_id for x in self.messages[i + 1:] if x.role == "tool"}
                return tuple(c for c in m.tool_calls if c.id not in done)
            if m.role == "user":
                return ()
        return ()

    def compact(self) -> bool:
        """Rebuild after a context overflow: drop the oldest half of the session history,
        or, with none left, the oldest complete step of this turn (an assistant message
        with its tool results). Returns False when nothing can be dropped."""
        if self.turn_start > 0:
            drop = max(2, self.turn_start // 2)
            drop -= drop % 2
            drop = min(drop, self.turn_start)
            del self.messages[:drop]
            del self._texts[:drop]  # the texts stand; every row moves to a new index
            self.turn_start -= drop
            self._changed_from(0)
            return True
        body = self.messages[self.turn_start + 1:]
        for i, m in enumerate(body):
            if m.role == "assistant":
                j = i + 1
                while j < len(body) and body[j].role == "tool":
                    j += 1
                if j >= len(body):
                    return False  # that is the step in progress
                start = self.turn_start + 1 + i
                del self.messages[start:start + (j - i)]
                del self._texts[start:start + (j - i)]
                self.messages.insert(start, Message(
                    role="user", content=NOTE_PREFIX + "an earlier step was removed to fit "
                    "the model's context window"))
                self._texts.insert(start, None)
                self._changed_from(start)
                return True
        return False

    def last_assistant_text(self) -> str | None:
        for m in reversed(self.messages):
            if m.role == "assistant" and m.content:
                return m.content
        return None

    def stored_json(self) -> dict[str, Any]:
        """The checkpoint's part, without the messages (they go as rows): how many there
        are, where the turn's own start is, and the notes held for later."""
        out: dict[str, Any] = {"count": len(self.messages), "turn_start": self.turn_start}
        if self.held_notes:
            out["held_notes"] = list(self.held_notes)
        return out

    def to_json(self) -> dict[str, Any]:
        """The whole conversation, messages inline, as a checkpoint reads back from the
        store; "saved" says how many of them the store holds (for a resume in the same
        process, from memory)."""
        out = self.stored_json()
        out["messages"] = [m.to_json() for m in self.messages]
        out["saved"] = self._stored
        out["written"] = self._written
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Conversation:
        """From a checkpoint as read back: messages inline with "count" (the store holds
        them all), with "saved" (from `to_json`), or neither (written before messages were
        rows: the first save writes them all). The store holds exactly "count" rows; with
        "saved", "written" says how many it may hold."""
        messages = [Message.from_json(m) for m in d.get("messages", ())]
        stored = 0
        written: int | None = None
        if "count" in d:
            stored = int(d["count"])
            if stored != len(messages):
                raise ValueError(f"the checkpoint counts {stored} messages but the store "
                                 f"gave back {len(messages)}")
            written = stored
        if "saved" in d:
            stored = int(d["saved"])
            written = None if d.get("written") is None else int(d["written"])
        return cls(messages, turn_start=int(d.get("turn_start", 0)),
                   held_notes=[str(n) for n in d.get("held_notes", ())], stored=stored,
                   written=written)
