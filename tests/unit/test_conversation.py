"""The turn's conversation: where the daemon's notes go, and which of its messages the
store holds as rows (pure, no I/O)."""

from __future__ import annotations

import json

import pytest

from turnkeeper.messages import Message, ToolCall, message_text
from turnkeeper.policy.replies import CONTINUE_NOTE
from turnkeeper.store.base import MessageRows
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


# -- which messages the store holds -------------------------------------------------------

HISTORY = [{"message": f"question {i}", "result": {"answer": f"answer {i}"}}
           for i in range(4)]


def saved(conv: Conversation, rows: list[str]) -> MessageRows:
    """One checkpoint as the store takes it: rows from `start` replaced, and those past
    its end deleted only when it trims (a stale row left behind shows in `rows`)."""
    out = conv.unsaved_rows()
    end = out.start + len(out.rows)
    rows[out.start:end] = out.rows
    if out.trims:
        del rows[end:]
    conv.mark_saved()
    return out


def as_stored(conv: Conversation) -> list[str]:
    return [message_text(m) for m in conv.messages]


def test_a_new_conversation_writes_every_message_then_only_what_a_step_appends() -> None:
    conv = Conversation.start(HISTORY, "task")
    rows: list[str] = []
    first = saved(conv, rows)
    assert first.start == 0 and len(first.rows) == 9 and rows == as_stored(conv)
    assert saved(conv, rows) == MessageRows(9, (), trims=False)  # nothing written
    conv.add_assistant(None, (A,))
    conv.add_tool_result(A, "one")
    step = saved(conv, rows)
    assert step.start == 9 and [json.loads(r)["role"] for r in step.rows] == [
        "assistant", "tool"]
    assert rows == as_stored(conv) and conv.stored == 11


def test_a_save_that_failed_is_written_again_with_what_came_after() -> None:
    conv = Conversation.start([], "task")
    rows: list[str] = []
    saved(conv, rows)
    conv.add_assistant(None, (A,))
    conv.unsaved_rows()  # the write fails: no mark_saved
    conv.add_tool_result(A, "one")
    again = saved(conv, rows)
    assert again.start == 1 and len(again.rows) == 2 and rows == as_stored(conv)


def test_each_message_is_encoded_once() -> None:
    conv = Conversation.start([], "task")
    conv.add_assistant("text", ())
    first = conv.unsaved_rows()
    second = conv.unsaved_rows()  # the first write failed: the same texts go again
    assert all(a is b for a, b in zip(first.rows, second.rows, strict=True))


def test_dropping_history_rewrites_every_row_from_the_first() -> None:
    conv = Conversation.start(HISTORY, "task")
    rows: list[str] = []
    saved(conv, rows)
    kept = conv.unsaved_rows()  # nothing changed yet
    assert kept.rows == ()
    assert conv.compact()
    out = saved(conv, rows)
    assert out.start == 0 and len(out.rows) == len(conv.messages) == 5
    assert rows == as_stored(conv) and conv.turn_start == 4


def test_dropping_a_step_rewrites_from_the_step_dropped() -> None:
    conv = Conversation.start([], "task")
    for call in (A, B):
        conv.add_assistant(None, (call,))
        conv.add_tool_result(call, "done")
    conv.add_assistant(None, (A,))  # the step in progress
    rows: list[str] = []
    saved(conv, rows)
    assert conv.compact()
    out = saved(conv, rows)
    assert out.start == 1  # the note that stands for the dropped step, then the rest
    assert json.loads(out.rows[0])["content"].startswith(NOTE_PREFIX)
    assert rows == as_stored(conv) and len(rows) == 5


def test_a_change_while_a_save_is_in_flight_stays_unsaved() -> None:
    conv = Conversation.start(HISTORY, "task")
    rows: list[str] = []
    out = conv.unsaved_rows()
    assert conv.compact()  # before the write returned
    del rows[out.start:]
    rows.extend(out.rows)
    conv.mark_saved()
    assert conv.stored == 0
    saved(conv, rows)
    assert rows == as_stored(conv)


def test_held_notes_are_checkpointed_and_their_flush_is_appended() -> None:
    conv = Conversation.start([], "task")
    conv.add_assistant(None, (A, B))
    rows: list[str] = []
    saved(conv, rows)
    conv.add_note("loop note")
    assert conv.stored_json() == {"count": 2, "turn_start": 0,
                                  "held_notes": ["loop note"]}
    conv.add_tool_result(A, "one")
    conv.add_tool_result(B, "two")
    out = saved(conv, rows)
    assert out.start == 2 and len(out.rows) == 3 and rows == as_stored(conv)
    assert conv.stored_json() == {"count": 5, "turn_start": 0}


def test_read_back_from_the_store_every_message_is_stored() -> None:
    conv = Conversation.start(HISTORY, "task")
    stored = {**conv.stored_json(),
              "messages": [json.loads(t) for t in conv.unsaved_rows().rows]}
    again = Conversation.from_json(stored)
    assert again.stored == 9 and again.unsaved_rows() == MessageRows(9, (), trims=False)
    assert again.messages == conv.messages and again.turn_start == 8


def test_a_save_trims_only_while_the_store_may_hold_rows_past_its_end() -> None:
    conv = Conversation.start(HISTORY, "task")
    rows: list[str] = []
    assert not saved(conv, rows).trims  # a new turn: nothing stored
    assert conv.compact()  # 9 messages -> 5
    assert saved(conv, rows).trims and rows == as_stored(conv)
    for n in range(5):  # up to 10 messages: past the 9 the store ever held
        conv.add_assistant(f"step {n}", ())
        out = saved(conv, rows)
        assert out.trims == (len(conv.messages) < 9) and rows == as_stored(conv)


def test_a_resume_from_memory_keeps_what_the_store_may_hold() -> None:
    conv = Conversation.start(HISTORY, "task")
    rows: list[str] = []
    saved(conv, rows)
    assert conv.compact()  # not saved yet: the store still holds 9 rows
    again = Conversation.from_json(conv.to_json())
    assert saved(again, rows).trims and rows == as_stored(again)
    older = {k: v for k, v in conv.to_json().items() if k != "written"}
    assert Conversation.from_json(older).unsaved_rows().trims  # not known: trims
    assert Conversation.from_json({"messages": []}).unsaved_rows().trims


def test_a_checkpoint_whose_rows_are_missing_is_refused() -> None:
    conv = Conversation.start(HISTORY, "task")
    short = {**conv.stored_json(), "messages": [m.to_json() for m in conv.messages[:5]]}
    with pytest.raises(ValueError, match="counts 9 messages but the store gave back 5"):
        Conversation.from_json(short)


def test_a_checkpoint_from_before_rows_writes_every_message_on_its_first_save() -> None:
    legacy = {"messages": [{"role": "user", "content": "task"},
                           {"role": "assistant", "content": "hi"}], "turn_start": 0}
    conv = Conversation.from_json(legacy)
    assert conv.stored == 0 and conv.unsaved_rows().start == 0


def test_a_resume_from_memory_knows_what_the_store_holds() -> None:
    conv = Conversation.start([], "task")
    rows: list[str] = []
    saved(conv, rows)
    conv.add_note("after the checkpoint")  # then the turn was suspended
    again = Conversation.from_json(conv.to_json())
    assert again.stored == 1
    out = saved(again, rows)
    assert out.start == 1 and rows == as_stored(again)


def test_a_lone_surrogate_is_stored_escaped_and_reads_back_equal() -> None:
    conv = Conversation.start([], "broken \ud800 text")
    (text,) = conv.unsaved_rows().rows
    text.encode()  # valid UTF-8, as a database column needs
    assert Message.from_json(json.loads(text)) == conv.messages[0]


def test_the_parts_of_a_continued_answer_are_the_cut_answers_asked_to_go_on() -> None:
    conv = Conversation.start([{"message": "earlier", "result": {"answer": "old"}}], "task")
    assert conv.continued_parts() == []
    conv.add_assistant("one ", ())
    assert conv.continued_parts() == []  # not asked to continue
    conv.add_note(CONTINUE_NOTE)
    conv.add_note("soft budget note")  # other notes between do not break the chain
    assert conv.continued_parts() == ["one "]
    conv.add_assistant("two ", ())
    conv.add_note(CONTINUE_NOTE)
    assert conv.continued_parts() == ["one ", "two "]
    conv.add_assistant("three", ())
    assert conv.continued_parts(end=len(conv.messages) - 1) == ["one ", "two "]
    conv.add_user("a steer")  # a user message starts a new answer
    assert conv.continued_parts() == []


def test_opaque_blocks_and_cut_calls_survive_the_stored_form() -> None:
    thinking = {"type": "thinking", "thinking": "t", "signature": "sig=="}
    cut = ToolCall(id="c3", name="echo", arguments='{"q":', cut_at=64)
    conv = Conversation.start([], "task")
    conv.add_assistant(None, (A, cut), opaque=(thinking,))
    rows = conv.unsaved_rows().rows
    back = [Message.from_json(json.loads(r)) for r in rows]
    assert back == conv.messages
    assert back[1].opaque == (thinking,) and back[1].tool_calls[1].cut_at == 64
    assert "cut_at" not in json.loads(message_text(Message(role="assistant",
                                                           tool_calls=(A,))))["tool_calls"][0]
