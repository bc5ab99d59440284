"""`turnkeeper approvals`, `approve` and `deny`: the tool calls turns hold for a person,
and the person's decisions (`GET /v1/approvals`, `POST /v1/turns/{id}/approvals`).
Standard library and the socket client only, like every client command."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any
from urllib.parse import quote

from turnkeeper import exits
from turnkeeper.cli import render
from turnkeeper.cli.base import Command, UsageError, fail, turn_id_arg, wants_json
from turnkeeper.control.client import Client

APPROVALS_HEADER = (f"{'TURN':<18}  {'CALL':<24} {'TOOL':<20} {'WAITING':<9} "
                    "ARGUMENTS (KEY)")


def approval_row(a: dict[str, Any], now: float) -> str:
    """One line of `turnkeeper approvals`, under APPROVALS_HEADER."""
    waited = render.duration(max(0.0, now - float(a.get("requested_at") or now)))
    args = json.dumps(a.get("arguments"), ensure_ascii=False, sort_keys=True)
    args = args if len(args) <= 60 else args[:57] + "..."
    return (f"{a['turn']:<18}  {a['call_id']:<24} {a['tool']:<20} {waited:<9} "
            f"{args}  ({a.get('key')})")


def approvals_lines(data: dict[str, Any], now: float) -> list[str]:
    pending = data.get("approvals") or []
    if not pending:
        return ["no tool call is waiting for approval"]
    return [APPROVALS_HEADER, *(approval_row(a, now) for a in pending)]


def cmd_approvals(client: Client, args: argparse.Namespace) -> int:
    status, data = client.request("GET", "/v1/approvals")
    if status != 200:
        return fail(status, data)
    if wants_json(args):
        render.print_json(data)
    else:
        print("\n".join(approvals_lines(data, time.time())))
    return exits.OK


def _decide_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    turn_id_arg(p, common)
    p.add_argument("call_id", metavar="CALL_ID",
                   help="the call's id, as `turnkeeper approvals` lists it")


def _approve_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    _decide_setup(p, common)
    p.add_argument("--arguments", metavar="JSON",
                   help="run the call with these arguments instead (a JSON object the "
                        "tool's input schema accepts)")


def _deny_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    _decide_setup(p, common)
    p.add_argument("--reason", required=True, metavar="TEXT",
                   help="what the agent reads: \"denied by the operator: TEXT\"")


def _decide(client: Client, args: argparse.Namespace, body: dict[str, Any]) -> int:
    status, data = client.request("POST", f"/v1/turns/{quote(args.id)}/approvals",
                                  {"call_id": args.call_id, **body})
    if status != 202:
        return fail(status, data)
    if wants_json(args):
        render.print_json(data)
    elif body["decision"] == "approve":
        print(f"{args.id}: {args.call_id} approved"
              + (" with edited arguments" if "arguments" in body else "")
              + "; it runs once every call the turn waits on is decided")
    else:
        print(f"{args.id}: {args.call_id} denied; the agent reads why")
    return exits.OK


def cmd_approve(client: Client, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"decision": "approve"}
    if args.arguments is not None:
        try:
            edited = json.loads(args.arguments)
        except ValueError as exc:
            raise UsageError(f"--arguments: not JSON: {exc}") from None
        if not isinstance(edited, dict):
            raise UsageError("--arguments: must be a JSON object")
        body["arguments"] = edited
    return _decide(client, args, body)


def cmd_deny(client: Client, args: argparse.Namespace) -> int:
    return _decide(client, args, {"decision": "deny", "reason": args.reason})


def _no_args(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    pass


APPROVAL_COMMANDS = (
    Command("approvals", "tool calls waiting for approval",
            "Every tool call a turn holds for a person's approval, oldest first, on every "
            "node: its turn, call id, tool, how long it has waited, its arguments and its "
            "Idempotency-Key.", _no_args, cmd_approvals),
    Command("approve", "approve a tool call held for approval",
            "Let a held tool call run (once), as asked or with --arguments; the turn "
            "resumes when every call it waits on is decided.", _approve_setup,
            cmd_approve),
    Command("deny", "deny a tool call held for approval",
            "Refuse a held tool call: it never runs, and the agent reads \"denied by the "
            "operator: REASON\" as its result.", _deny_setup, cmd_deny),
)
