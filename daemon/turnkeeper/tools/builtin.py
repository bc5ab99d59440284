"""The built-in tools every turn offers: the legitimate ways to stop without succeeding
(`report_blocked`) and to ask the user (`clarify`). The runner handles their effects."""

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

BUILTIN_SPECS = (REPORT_BLOCKED, CLARIFY)
