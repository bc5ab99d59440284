"""The commands that look after the daemon rather than one turn: `reload`, `limits` and
`dead-letters` (serve, config, status, pause and prune are in operate.py). Standard
library and the socket client only, like every client command."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from urllib.parse import quote, urlencode

from turnkeeper import exits
from turnkeeper.cli import render
from turnkeeper.cli.base import UsageError, fail, get_and_print, wants_json
from turnkeeper.control.client import Client
from turnkeeper.durations import parse_duration


def cmd_reload(client: Client, args: argparse.Namespace) -> int:
    # No timeout of our own: a reload drains turns for up to daemon.drain_timeout and
    # more; as ExecReload= it is bounded by the unit's timeout instead.
    status, data = Client(client.path, timeout=None).request("POST", "/v1/reload")
    if status != 200:
        print(f"turnkeeper: reload failed: {data.get('error') if data else status}",
              file=sys.stderr)
        return {422: exits.CONFIG, 503: exits.UNAVAILABLE}.get(status, exits.FAIL)
    if args.json:
        render.print_json(data)
    else:
        print(f"reloaded: policy v{data['policy_version']}"
              + (" unchanged (the file gives the running policy: no new version)"
                 if data.get("unchanged") else "")
              + (f" (pending restart: {', '.join(data['pending_restart'])})"
                 if data.get("pending_restart") else ""))
    return exits.OK


def limits_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="limits_command", required=True, metavar="ACTION")
    rep = sub.add_parser("report", parents=[common],
                         help="percentiles of completed turns, suggested limits, and what "
                         "each limit stopped or would have stopped",
                         description="Measure finished turns and suggest limits from them.")
    rep.add_argument("--profile", help="only turns of this budget profile")
    rep.add_argument("--since", help="only turns finished in this window: 90s, 30m, 24h, 7d")
    rep.add_argument("--factor", type=float, default=2.5,
                     help="suggested limit = factor x p95 (default 2.5)")


def cmd_limits(client: Client, args: argparse.Namespace) -> int:
    query: dict[str, Any] = {"factor": args.factor}
    if args.profile:
        query["profile"] = args.profile
    if args.since:
        try:
            query["since"] = parse_duration(args.since)
        except ValueError as exc:
            raise UsageError(f"--since: {exc}") from None
    return get_and_print(client, args, "/v1/limits/report?" + urlencode(query),
                         lambda data: "\n".join(render.limits_lines(data)))


def dead_letters_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["replay"],
                   help="replay: resume the dead letter's turn from its last checkpoint")
    p.add_argument("id", nargs="?", help="the dead letter to replay")


def cmd_dead_letters(client: Client, args: argparse.Namespace) -> int:
    as_json = wants_json(args)
    if args.action == "replay":
        if not args.id:
            raise UsageError("dead-letters replay needs an ID")
        status, data = client.request("POST", f"/v1/dead-letters/{quote(args.id)}/replay")
        if status != 202:
            return fail(status, data)
        print(data["turn"]["id"] if not as_json else json.dumps(data))
        return exits.OK
    status, data = client.request("GET", "/v1/dead-letters")
    if status != 200:
        return fail(status, data)
    if as_json:
        render.print_json(data)
        return exits.OK
    if not data["dead_letters"]:
        print("no dead letters")
    for d in data["dead_letters"]:
        sb = d.get("stopped_because") or {}
        print(f"{d['id']}  {sb.get('code', '-'):<20} {d.get('last_error') or '-'}"
              + (f"  (replayed as {d['replayed_by']})" if d.get("replayed_by") else ""))
    return exits.OK
