"""The commands that read what the daemon records as it goes: `follow` (and `submit
--follow`) and `events` read event streams (a turn's ends with its `turn.finished`; the
exit status is then the turn's); `logs` reads the daemon's recent log lines."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from urllib.parse import quote, urlencode

from turnkeeper import exits
from turnkeeper.cli import render
from turnkeeper.control.client import Client


def turn_exit(result: dict[str, Any]) -> int:
    """The exit status for a turn's final status."""
    return exits.TURN_STATUS.get(result["status"], exits.FAIL)


def follow_turn(client: Client, turn_id: str, as_json: bool) -> int:
    """Show a turn until it ends; exit with its final status."""
    if not as_json and sys.stdout.isatty():
        from turnkeeper.cli.follow import follow_live  # rich: imported only here

        result = follow_live(client, turn_id, render.event_line)
        if result is None:
            print("turnkeeper: the event stream ended before the turn finished",
                  file=sys.stderr)
            return exits.UNAVAILABLE
        return turn_exit(result)
    final: dict[str, Any] | None = None
    streaming = False
    # Imported here: the catalogue (dataclasses) costs the other commands start-up time.
    from turnkeeper.event_types import ModelDelta, TurnFinished

    for ev in client.stream(f"/v1/turns/{quote(turn_id)}/events"):
        if as_json:
            print(json.dumps(ev, ensure_ascii=False), flush=True)
        elif ev["type"] == ModelDelta.TYPE:
            sys.stdout.write(ev.get("text", ""))
            streaming = True
            sys.stdout.flush()
        else:
            if streaming:
                sys.stdout.write("\n")
                streaming = False
            line = render.event_line(ev)
            if line:
                print(line, flush=True)
        if ev["type"] == TurnFinished.TYPE:
            final = ev["result"]
    if final is None:
        print("turnkeeper: the event stream ended before the turn finished", file=sys.stderr)
        return exits.UNAVAILABLE
    return turn_exit(final)


def cmd_follow(client: Client, args: argparse.Namespace) -> int:
    return follow_turn(client, args.id, args.json)


def events_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("--after", type=int, metavar="SEQ",
                   help="first the stored events after this seq (0: all of them), then "
                   "live: give the last seq seen to lose nothing across a reconnect")
    p.add_argument("--turn", metavar="ID", help="only this turn's events")
    p.add_argument("--type", metavar="T", action="append",
                   help="only events of this type, or of a prefix ending in a dot "
                   "(tool.); may be repeated")


def cmd_events(client: Client, args: argparse.Namespace) -> int:
    if args.after is not None and args.after < 0:
        from turnkeeper.cli.base import UsageError

        raise UsageError("--after: a seq is 0 or more")
    query = {k: v for k, v in (("after", args.after), ("turn", args.turn),
                               ("type", ",".join(args.type or ()))) if v not in (None, "")}
    for ev in client.stream("/v1/events" + ("?" + urlencode(query) if query else "")):
        if args.json:
            print(json.dumps(ev, ensure_ascii=False), flush=True)
        else:
            line = render.event_line(ev)
            if line:
                print((ev.get("turn") or "daemon") + " " + line, flush=True)
    return exits.OK


LOG_UNIT = "turnkeeper.service"


def logs_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("id", nargs="?", metavar="ID", help="only this turn's lines")
    p.add_argument("-n", "--lines", type=int, default=200, metavar="N",
                   help="at most this many, the newest (default 200, at most 10000)")
    p.add_argument("-f", "--follow", action="store_true",
                   help="then print new lines as the daemon writes them, until Ctrl-C")


LOGS_POLL_S = 0.5  # `logs -f`: how often new lines are asked for

def _journal_lines(turn_id: str, limit: int) -> list[str]:
    """A turn's lines from systemd's journal, for a turn older than the daemon's window
    (or than its last restart): [] when there is no journal to read."""
    import shutil
    import subprocess

    if shutil.which("journalctl") is None:
        return []
    out = subprocess.run(["journalctl", "--unit", LOG_UNIT, "--output", "cat",
                          "--no-pager", "--grep", turn_id], capture_output=True,
                         text=True, timeout=30, check=False)
    if out.returncode != 0:
        return []
    return [line for line in out.stdout.splitlines() if turn_id in line][-limit:]


def _print_log_lines(lines: list[dict[str, Any]], args: argparse.Namespace) -> None:
    for line in lines:
        if args.json or not sys.stdout.isatty():
            print(json.dumps(line, ensure_ascii=False, default=str), flush=True)
        else:
            print(render.log_line(line), flush=True)


def cmd_logs(client: Client, args: argparse.Namespace) -> int:
    from turnkeeper.cli.base import UsageError, fail

    if not 1 <= args.lines <= 10_000:
        raise UsageError("--lines: from 1 to 10000")
    if args.id:  # an unknown id is an error, as for every command that names a turn
        status, data = client.request("GET", f"/v1/turns/{quote(args.id)}")
        if status != 200:
            return fail(status, data)
    turn = {"turn": args.id} if args.id else {}
    status, data = client.request("GET", "/v1/logs?" + urlencode(
        {"limit": args.lines, **turn}))
    if status != 200:
        return fail(status, data)
    lines = data["lines"]
    if not lines and args.id and not args.follow:
        journal = _journal_lines(args.id, args.lines)
        if journal:
            print("\n".join(journal))
            return exits.OK
        print(f"no log lines of {args.id} in the daemon's last {data['window']} lines"
              " (nor in the journal)", file=sys.stderr)
        return exits.OK
    _print_log_lines(lines, args)
    if not args.follow:
        return exits.OK
    import time  # here: only -f needs it

    after = data["next"]
    while True:
        time.sleep(LOGS_POLL_S)
        status, data = client.request("GET", "/v1/logs?" + urlencode(
            {"limit": 10_000, "after": after, **turn}))
        if status != 200:
            return fail(status, data)
        if data["next"] < after:  # the daemon restarted and numbers from 1 again
            after = 0
            continue
        _print_log_lines(data["lines"], args)
        after = data["next"]
