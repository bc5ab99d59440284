"""The built-in tools every turn offers: the legitimate ways to stop without succeeding
(`report_blocked`) and to ask the user (`clarify`), and a checklist the agent may keep
(`update_plan`). The runner handles their effects."""

from __future__ import annotations

from turnkeeper.messages import ToolSpec

REPORT_BLOCKED = ToolSpec(
    name="report_blocked",
    description=("End the turn without succeeding: say why you are blocked, what you tried "
                 "and what you found. Use it instead of guessing or looping."),
    parameters={
        "type": "object",
        "properties": {
            "reason": {"type": "string"},
            "tried": {"type": "array", "items": {"type": "string"}},
            "found": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["reason"],
    },
)

CLARIFY = ToolSpec(
    name="clarify",
    description="Ask the user one question and wait for the answer.",
    parameters={"type": "object", "properties": {"question": {"type": "string"}},
                "required": ["question"]},
)

UPDATE_PLAN = ToolSpec(
    name="update_plan",
    description=("Keep a checklist of your plan for this task: send the whole list each "
                 "time, marking the items you have finished as done. Finished items count "
                 "as progress and are reported in the result."),
    parameters={
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {
                "type": "object",
                "properties": {"text": {"type": "string"}, "done": {"type": "boolean"}},
                "required": ["text", "done"]}},
        },
        "required": ["items"],
    },
)

BUILTIN_SPECS = (REPORT_BLOCKED, CLARIFY, UPDATE_PLAN)
