"""`TurnContext` owns its fields: another module asks it (`ctx.begin_wait()`,
`ctx.hold_stop(stop)`, `ctx.apply_limits()`) instead of writing `ctx.<field> = ...` or
the guards' limits behind its back, so what a checkpoint keeps is decided in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import turnkeeper

PACKAGE = Path(turnkeeper.__file__).parent
CONTEXT = PACKAGE / "turn" / "context.py"


def outside_writes(source: str, name: str) -> list[str]:
    """Every `ctx.X = ...` (or `ctx.guard.X` / `ctx.watch.X`) in `source`, as text."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign)
                   else [])
        for target in targets:
            owner = target.value if isinstance(target, ast.Attribute) else None
            if isinstance(owner, ast.Attribute) and owner.attr in ("guard", "watch"):
                owner = owner.value  # the guards' limits are the context's too
            if isinstance(owner, ast.Name) and owner.id == "ctx":
                found.append(f"{name}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_no_module_but_the_context_writes_its_fields() -> None:
    found = [w for path in sorted(PACKAGE.rglob("*.py")) if path != CONTEXT
             for w in outside_writes(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert not found, "write through a TurnContext method instead:\n" + "\n".join(found)


def test_the_checker_finds_a_field_and_a_guards_limits_written() -> None:
    source = ("ctx.waiting_since = 1.0\nctx.guard.limits = x\nctx.record.question = 'q'\n"
              "ctx.pending_stop += 1\n")
    assert outside_writes(source, "m.py") == [
        "m.py:1: ctx.waiting_since", "m.py:2: ctx.guard.limits", "m.py:4: ctx.pending_stop"]
