"""The turn's conversation: where the daemon's notes go (pure, no I/O)."""

from __future__ import annotations

from turnkeeper.messages import ToolCall
from turnkeeper.turn.conversation import NOTE_PREFIX, Conversation

A = ToolCall(id="c1", name="echo", arguments='{"q":1}')
B = ToolCall(id="c2", name="echo", arguments='{"q":2}')


def roles(conv: Conversation) -> list[str]:
    return [m.role for m in conv.messages]


def test_a_note_never_splits_tool_calls_from_their_results() -> None:
    # OpenAI and Anthropic both reject a user message between an assistant's tool calls
    # and their results; a loop note comes exactly there (before a call runs).
    conv = Conversation.start([], "task")
    conv.add_assistant(None, (A, B))
    conv.add_note("loop note")
    conv.add_tool_result(A, "one")
    assert roles(conv) == ["user", "assistant", "tool"]
    conv.add_tool_result(B, "two")
    assert roles(conv) == ["user", "assistant", "tool", "tool", "user"]
    assert conv.messages[-1].content == NOTE_PREFIX + "loop note"
    assert conv.held_notes == []


def test_a_note_with_no_results_due_goes_in_at_once() -> None:
    conv = Conversation.start([], "task")
    conv.add_assistant(None, (A,))
    conv.add_tool_result(A, "one")
    conv.add_note("budget note")
    assert roles(conv) == ["user", "assistant", "tool", "user"]


def test_held_notes_survive_a_checkpoint() -> None:
    conv = Conversation.start([], "task")
    conv.add_assistant(None, (A,))
    conv.add_note("loop note")
    again = Conversation.from_json(conv.to_json())
    assert again.held_notes == ["loop note"]
    again.add_tool_result(A, "one")
    assert again.messages[-1].content == NOTE_PREFIX + "loop note"
