"""`turnkeeper top`: every live turn on one screen (state, step, provider, budget use),
refreshed in place, with the daemon's line above it.

Imported only by `top` (rich costs tens of milliseconds). It reads what any client can:
`/v1/status` and `/v1/turns` for each live state, once per refresh; nothing is kept
between refreshes, so the screen is always the daemon's word, never a guess.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from turnkeeper.cli.render import fmt_seconds
from turnkeeper.control.client import Client
from turnkeeper.policy.turn_state import LIVE_STATES

ROWS = 200  # turns per live state asked for each refresh
PIPE_WIDTH = 10_000  # the "terminal" width of a pipe: wider than any row


def snapshot(client: Client) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The daemon's status and its live turns, oldest first."""
    status, data = client.request("GET", "/v1/status")
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {data}")
    turns: list[dict[str, Any]] = []
    for state in LIVE_STATES:
        code, page = client.request("GET", f"/v1/turns?state={state.value}&limit={ROWS}")
        if code == 200:
            turns.extend(page["turns"])
    turns.sort(key=lambda t: t.get("seq", 0))
    return data, turns


def _use(value: float, limit: float | None, text: str) -> Text:
    """`text` coloured by the share of its limit spent: yellow past 75%, red past 90%."""
    share = value / limit if limit else 0.0
    return Text(text, style="bold red" if share >= 0.9 else "yellow" if share >= 0.75 else "")


def state_of(turn: dict[str, Any]) -> str:
    """The turn's state, and for a turn waiting on people what it waits on: the tool
    calls held for approval (tool and call id) or its clarify question."""
    held = turn.get("pending_approvals") or []
    if held:
        calls = ", ".join(f"{p['tool']} {p['call_id']}" for p in held)
        return f"{turn['state']}: approval of {calls}"
    if turn.get("question") is not None and turn["state"] == "waiting":
        return "waiting: an answer"
    return str(turn["state"])


def screen(status: dict[str, Any], turns: list[dict[str, Any]], now: float
           ) -> RenderableType:
    counts = "  ".join(f"{k} {v}" for k, v in status["turns"].items())
    head = Text(f"turnkeeper {status['version']}  {status['state']}  policy "
                f"v{status['policy_version']}  {counts}", style="bold")
    if status.get("paused"):
        head.append("  PAUSED", style="bold yellow")
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("ID", "STATE", "STEP", "PROVIDER", "TOKENS", "ACTIVE", "COST", "MESSAGE"):
        table.add_column(name, no_wrap=True)
    for t in turns:
        lim, u, c = t.get("limits") or {}, t["usage"], t["counters"]
        seconds = float(u["seconds"])
        if t.get("active_since"):
            seconds += max(0.0, now - float(t["active_since"]))
        table.add_row(
            t["id"], state_of(t),
            _use(c["steps"], lim.get("max_steps"), f"{c['steps']}/{lim.get('max_steps', '-')}"),
            t.get("provider") or "-",
            _use(u["total_tokens"], lim.get("max_tokens"),
                 f"{u['total_tokens']}/{lim.get('max_tokens', '-')}"),
            _use(seconds, lim.get("max_seconds"), fmt_seconds(seconds)),
            _use(u["cost_usd"], lim.get("max_cost_usd") or None, f"${u['cost_usd']:.4f}"),
            t["message"][:40].replace("\n", " "))
    if not turns:
        return Group(head, Text("no live turns", style="dim"))
    return Group(head, table)


def run_top(client: Client, *, interval_s: float, once: bool) -> None:
    """Refresh until Ctrl-C (or print one snapshot with `once`, or when not a terminal)."""
    console = Console()
    if not console.is_terminal:
        # Into a pipe or a file nothing is cut to a terminal's width: every column whole.
        Console(width=PIPE_WIDTH, soft_wrap=True).print(screen(*snapshot(client), time.time()))
        return
    if once:
        console.print(screen(*snapshot(client), time.time()))
        return
    with Live(console=console, auto_refresh=False, screen=False) as live:
        while True:
            live.update(screen(*snapshot(client), time.time()), refresh=True)
            time.sleep(interval_s)
