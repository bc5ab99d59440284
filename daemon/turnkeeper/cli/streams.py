"""The commands that read an event stream: `follow` (and `submit --follow`) and `events`.
A turn's stream ends with its `turn.finished`; the exit status is then the turn's."""

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
        from turnkeeper.follow import follow_live  # rich: imported only here

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
