"""`turnkeeper follow` on a terminal: a live view of one turn, drawn with rich.

Imported only by the follow path of the CLI (rich costs tens of milliseconds to import;
the other commands stay fast). Two sources feed it: the turn's NDJSON event stream
(read by a thread, from the turn's first event, so sums over events are exact) and a
poll of the turn's JSON every half second (state, counters, usage, the effective budget
limits, and `active_since` to run the seconds bar between checkpoints).

What it shows: the current step, provider and attempt; one bar per budget dimension
(tokens, seconds, steps, cost) against the turn's own limits, and the deadline; a
countdown while the turn waits on a retry, a recovery cycle or a clarify answer; the
answer text as it streams; the latest events; and, at the end, the result with its stop
code, counter, value and limit. What the view knows of the turn, and how each event
moves it, is follow_state.py's; this module draws it and runs the loop that feeds it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from turnkeeper.cli.follow_state import FollowState
from turnkeeper.cli.render import fmt_measure, result_message, result_title
from turnkeeper.control.client import Client, ClientError, HTTPStatusError
from turnkeeper.policy.turn_state import TurnState

POLL_INTERVAL_S = 0.5
FRAME_S = 0.1
BAR_WIDTH = 30
ANSWER_CHARS = 600

_END = object()


# -- drawing ---------------------------------------------------------------------------


def _bar(fraction: float, width: int = BAR_WIDTH) -> Text:
    fraction = min(1.0, max(0.0, fraction))
    filled = round(fraction * width)
    style = "green" if fraction < 0.8 else "yellow" if fraction < 1.0 else "red"
    bar = Text("█" * filled, style=style)
    bar.append("░" * (width - filled), style="grey37")
    return bar


def _num(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def _budget_table(st: FollowState, now: float) -> Table:
    limits = st.turn.get("limits") or {}
    table = Table.grid(padding=(0, 1))
    table.add_column(style="bold", min_width=8)
    table.add_column(no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    if not limits:
        table.add_row("budget", Text("(known once the turn starts)", style="dim"), "", "")
        return table
    rows: list[tuple[str, float, float, str]] = [
        ("tokens", float(st.tokens), float(limits.get("max_tokens") or 0), ""),
        ("seconds", st.seconds(now), float(limits.get("max_seconds") or 0), " s"),
        ("steps", float(st.step), float(limits.get("max_steps") or 0), ""),
    ]
    for name, value, limit, unit in rows:
        fraction = value / limit if limit else 0.0
        table.add_row(name, _bar(fraction), f"{_num(value)} / {_num(limit)}{unit}",
                      f"{fraction:4.0%}")
    max_cost = float(limits.get("max_cost_usd") or 0.0)
    if max_cost > 0:
        table.add_row("cost", _bar(st.cost_usd / max_cost),
                      f"${st.cost_usd:.4f} / ${max_cost:.4f}", f"{st.cost_usd / max_cost:4.0%}")
    else:
        table.add_row("cost", Text(f"${st.cost_usd:.4f}  (no cost limit)", style="dim"), "", "")
    deadline = limits.get("deadline")
    if deadline is not None:
        left = float(deadline) - now
        table.add_row("deadline", Text(time.strftime("%H:%M:%S", time.localtime(deadline))),
                      f"{max(0.0, left):.1f} s left" if left > 0 else "passed", "")
    return table


def render(st: FollowState, now: float) -> RenderableType:
    c = st.turn.get("counters") or {}
    head = Text()
    head.append(f"turn {st.turn_id}", style="bold")
    if st.turn.get("session"):
        head.append(f"  session {st.turn['session']}")
    if st.turn.get("policy_version"):
        head.append(f"  policy v{st.turn['policy_version']}")
    head.append("  ")
    head.append(st.state, style=_STATE_STYLE.get(st.state, "bold"))
    where = Text()
    where.append(f"step {st.step}", style="bold")
    where.append(f"  provider {st.provider or '-'}")
    if st.attempt:
        where.append(f"  attempt {st.attempt}")
    where.append(f"  hops {c.get('fallback_hops', 0)}  restarts {c.get('restarts', 0)}"
                 f"  recovery cycles {c.get('recovery_cycles', 0)}", style="dim")
    parts: list[RenderableType] = [head, where, _budget_table(st, now)]
    if st.wait is not None:
        line = Text("⏳ ", style="yellow")
        if st.wait.until is not None:
            line.append(f"{st.wait.kind} in {max(0.0, st.wait.until - now):.1f} s",
                        style="bold yellow")
        else:
            line.append(st.wait.kind, style="bold yellow")
        line.append(f"  {st.wait.detail}")
        parts.append(line)
    elif st.activity and st.result is None:
        parts.append(Text(f"▶ {st.activity}", style="cyan"))
    if st.answer:
        text = st.answer if len(st.answer) <= ANSWER_CHARS else "…" + st.answer[-ANSWER_CHARS:]
        parts.append(Panel(Text(text), title="answer", title_align="left",
                           border_style="blue"))
    if st.events:
        parts.append(Text("\n".join(st.events), style="dim", no_wrap=True,
                          overflow="ellipsis"))
    return Group(*parts)


_STATE_STYLE: dict[str, str] = {
                TurnState.RUNNING: "bold green", TurnState.RECOVERING: "bold yellow",
                TurnState.WAITING: "bold yellow", TurnState.SUSPENDED: "bold yellow",
                TurnState.QUEUED: "bold", TurnState.COMPLETED: "bold green",
                TurnState.BLOCKED: "bold yellow", TurnState.PARTIAL: "bold yellow",
                TurnState.FAILED: "bold red", TurnState.CANCELLED: "bold red"}


def render_result(result: dict[str, Any]) -> RenderableType:
    sb = result["stopped_because"]
    status = result["status"]
    style = _STATE_STYLE.get(status, "bold")
    lines = Text()
    lines.append(result_title(result), style=style)
    if sb.get("counter"):
        c = sb["counter"]
        lines.append(f"   {c} = {fmt_measure(c, sb['value'])} of limit "
                     f"{fmt_measure(c, sb['limit'])}", style="bold")
    message = result_message(result)
    if message:
        lines.append(f"\n{message}")
    if result.get("answer"):
        lines.append("\n\nanswer  ", style="bold")
        lines.append(str(result["answer"]))
    for item in result.get("partial") or []:
        lines.append("\n  done  ", style="dim")
        lines.append(str(item))
    for item in result.get("open_issues") or []:
        lines.append("\n  open  ", style="yellow")
        lines.append(str(item))
    return Panel(lines, title="result", title_align="left", border_style=style.split()[-1])


# -- the loop --------------------------------------------------------------------------


def _read_events(client: Client, turn_id: str, out: queue.Queue[object]) -> None:
    try:
        for ev in client.stream(f"/v1/turns/{quote(turn_id)}/events"):
            out.put(ev)
    except Exception as exc:  # handed to the drawing thread, which raises it
        out.put(exc)
    out.put(_END)


def follow_live(client: Client, turn_id: str,
                event_line: Callable[[dict[str, Any]], str | None]) -> dict[str, Any] | None:
    """Draw the turn until it finishes; return its result (None if the stream ended
    first). Raises ClientError when the daemon cannot be reached, HTTPStatusError when
    it answers with an error (an unknown turn)."""
    console = Console()
    st = FollowState(turn_id)
    status, data = client.request("GET", f"/v1/turns/{quote(turn_id)}", timeout=10)
    if status != 200 or not isinstance(data, dict):  # nothing to draw: say why, plainly
        raise HTTPStatusError(status, str((data or {}).get("error", "no answer")))
    st.seen_turn(data["turn"])
    events: queue.Queue[object] = queue.Queue()
    threading.Thread(target=_read_events, args=(client, turn_id, events),
                     name="turnkeeper follow events", daemon=True).start()
    next_poll = time.monotonic() + POLL_INTERVAL_S
    ended = False
    with Live(render(st, time.time()), console=console, auto_refresh=False,
              redirect_stdout=False, redirect_stderr=False) as live:
        while not ended:
            deadline = time.monotonic() + FRAME_S
            while True:
                try:
                    item = events.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is _END:
                    ended = True
                    break
                if isinstance(item, Exception):
                    raise item
                assert isinstance(item, dict)
                quiet = item["type"] in ("model.delta", "turn.finished")  # the result panel
                st.apply(item, None if quiet else event_line(item))
                if st.result is not None:
                    ended = True
                    break
            if time.monotonic() >= next_poll or ended:
                next_poll = time.monotonic() + POLL_INTERVAL_S
                try:
                    status, data = client.request("GET", f"/v1/turns/{quote(turn_id)}",
                                                  timeout=5)
                except ClientError:
                    status, data = 0, None
                if status == 200 and isinstance(data, dict):
                    st.seen_turn(data["turn"])
            live.update(render(st, time.time()), refresh=True)
    if st.result is not None:
        console.print(render_result(st.result))
    return st.result
