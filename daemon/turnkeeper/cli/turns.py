"""The commands about turns: `submit`, `turns`, `show`, `steer`, `answer` and `cancel`
(`wait` and `retry` are in operate.py, `follow` in streams.py). Standard library and the
socket client only, like every client command; the table in commands.py names them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from urllib.parse import quote, urlencode

from turnkeeper import exits
from turnkeeper.cli import render
from turnkeeper.cli.base import UsageError, fail, positive_int, turn_id_arg, wants_json
from turnkeeper.cli.operate import print_result, wait_result
from turnkeeper.cli.streams import follow_turn
from turnkeeper.control.client import Client
from turnkeeper.durations import parse_duration
from turnkeeper.policy.turn_state import TurnState


def parse_deadline(text: str, now: float) -> float:
    """`--deadline`: a span from now (`90s`, `30m`, `2h`, `1d`), epoch seconds, or an ISO
    8601 time (local time when it names no zone), as epoch seconds. A deadline already
    passed is refused here: a turn that could never run is a mistake on the line."""
    from datetime import datetime  # here: only this option needs it

    text = text.strip()
    if text[-1:].lower() in "smhd" and text[:-1].replace(".", "", 1).isdigit():
        when = now + parse_duration(text)
    else:
        try:
            when = float(text)
        except ValueError:
            try:
                when = datetime.fromisoformat(text).timestamp()
            except ValueError:
                raise UsageError(f"--deadline: not a time: {text!r} (e.g. 30m, 2h, "
                                 "2026-12-01T10:00:00Z or epoch seconds)") from None
    if when <= now:
        raise UsageError(f"--deadline: {render.fmt_time(when)} has already passed")
    return when


def submit_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("message", help="what the agent is asked to do; - reads it from stdin")
    p.add_argument("--session", help="a session to continue (default: a new one)")
    p.add_argument("--max-tokens", type=int, help="token budget of this turn")
    p.add_argument("--max-seconds", type=float, help="active-seconds budget of this turn")
    p.add_argument("--max-steps", type=int, help="step budget of this turn")
    p.add_argument("--max-cost-usd", type=float, help="cost budget of this turn, in USD")
    p.add_argument("--max-wall-seconds", type=float,
                   help="wall-clock budget of this turn: every second from its start, "
                   "waits included (0 = off)")
    p.add_argument("--deadline", help="when the turn must end: a span from now (30m, 2h), "
                   "an ISO 8601 time (local unless it names a zone) or epoch seconds")
    p.add_argument("--profile", help="a budget profile of the policy ([budget.profiles.NAME])")
    p.add_argument("--model", help="the provider chain to run: a [models.NAME] alias or one "
                   "provider's name (default: every provider, in order)")
    p.add_argument("--agent", help="the named agent to run as ([agents.NAME]: its system "
                   "prompt, tools, model and profile; default: [agent])")
    p.add_argument("--output-schema", metavar="FILE_OR_JSON",
                   help="a JSON Schema the final answer must match (a file, or the JSON "
                   "itself); the result then carries the answer parsed as `output`")
    p.add_argument("--idempotency-key", metavar="K",
                   help="submit at most once: the same K with the same submit answers the "
                   "turn it made ([daemon] idempotency_window), so a retry is safe")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--wait", action="store_true", help="wait for the result")
    g.add_argument("--follow", action="store_true", help="show the turn live")


def _message_text(arg: str) -> str:
    """The message as given, or stdin's whole text for `-` (a prompt from a file or a
    pipe keeps its lines; only the trailing newline is dropped)."""
    if arg != "-":
        return arg
    text = sys.stdin.read()
    text = text[:-1] if text.endswith("\n") else text
    if not text.strip():
        raise UsageError("submit -: stdin was empty")
    return text


def _submit_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"message": _message_text(args.message)}
    if args.session:
        body["session"] = args.session
    budget = {k: v for k, v in (("max_tokens", args.max_tokens),
                                ("max_seconds", args.max_seconds),
                                ("max_steps", args.max_steps),
                                ("max_cost_usd", args.max_cost_usd),
                                ("max_wall_seconds", args.max_wall_seconds)) if v is not None}
    if budget:
        body["budget"] = budget
    if args.deadline:
        import time  # here: only this option needs it

        body["deadline"] = parse_deadline(args.deadline, time.time())
    if args.profile:
        body["profile"] = args.profile
    if args.model:
        body["model"] = args.model
    if args.agent:
        body["agent"] = args.agent
    if args.idempotency_key:
        body["idempotency_key"] = args.idempotency_key
    if args.output_schema:
        body["output_schema"] = _output_schema(args.output_schema)
    return body


def _output_schema(arg: str) -> Any:
    """`--output-schema`: the JSON given (it starts with `{`), else the file's. The daemon
    checks it is a JSON Schema; here only that it is JSON."""
    if arg.lstrip().startswith("{"):
        text, where = arg, "--output-schema"
    else:
        try:
            with open(arg, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--output-schema: cannot read {arg}: {exc}") from None
        where = f"--output-schema {arg}"
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{where}: not valid JSON: {exc}") from None


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    status, data = client.request("POST", "/v1/turns", _submit_body(args))
    if status not in (200, 202):  # 200: the idempotency key's turn, made before
        return fail(status, data)
    turn = data["turn"]
    if args.follow:
        if not args.json:
            print(f"turn {turn['id']} {'queued' if status == 202 else 'submitted before'}")
        return follow_turn(client, turn["id"], args.json)
    if not args.wait:
        if args.json:
            render.print_json(turn)
        else:
            print(turn["id"])
        return exits.OK
    status, data = wait_result(client, turn["id"])
    if status != 200:
        return fail(status, data)
    return print_result(data, args.json)


def turns_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("--state", choices=[s.value for s in TurnState], metavar="STATE",
                   help="only turns in this state: " + ", ".join(s.value for s in TurnState))
    p.add_argument("--session", help="only turns of this session")
    p.add_argument("--limit", type=positive_int, default=50,
                   help="at most this many (default 50)")
    p.add_argument("--since", metavar="D",
                   help="only turns submitted in the last D (90s, 30m, 24h, 7d, 2w)")
    p.add_argument("--before", type=positive_int, metavar="SEQ",
                   help="the next page: turns numbered below SEQ (printed after a full page)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="only the ids, one a line (for scripts and shell completion)")


def cmd_turns(client: Client, args: argparse.Namespace) -> int:
    since = None
    if args.since is not None:
        try:
            since = parse_duration(args.since)
        except ValueError as exc:
            raise UsageError(f"--since: {exc}") from None
    q = {k: v for k, v in (("state", args.state), ("session", args.session),
                           ("limit", args.limit), ("since", since),
                           ("before", args.before)) if v is not None and v != ""}
    as_json = wants_json(args)
    status, data = client.request("GET", "/v1/turns?" + urlencode(q))
    if status != 200:
        return fail(status, data)
    if as_json:
        render.print_json(data)
        return exits.OK
    if args.quiet:
        for t in data["turns"]:
            print(t["id"])
        return exits.OK
    if not data["turns"]:
        print("no turns" + (" matching" if args.state or args.session else ""))
        return exits.OK
    print(render.TURNS_HEADER)
    for t in data["turns"]:
        print(render.turn_row(t))
    if data.get("next") is not None:
        print(f"more: turnkeeper turns --before {data['next']} (with the same filters)")
    return exits.OK


def cmd_show(client: Client, args: argparse.Namespace) -> int:
    status, data = client.request("GET", f"/v1/turns/{quote(args.id)}")
    if status != 200:
        return fail(status, data)
    if args.json:
        render.print_json(data["turn"])
    else:
        print(render.summary(data["turn"]))
    return exits.OK


def steer_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    turn_id_arg(p, common)
    p.add_argument("text", help="the message for the agent")
    p.add_argument("--redirect", action="store_true",
                   help="cut the in-flight model call and restart the step with it")


def answer_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    turn_id_arg(p, common)
    p.add_argument("text", help="the answer to the turn's question")


def _message(client: Client, args: argparse.Namespace, kind: str) -> int:
    body: dict[str, Any] = {"kind": kind, "text": args.text}
    if kind == "steer" and args.redirect:
        body["redirect"] = True
    status, data = client.request("POST", f"/v1/turns/{quote(args.id)}/messages", body)
    if status == 409:  # a finished turn, or an answer to a turn that asked nothing
        code, turn = client.request("GET", f"/v1/turns/{quote(args.id)}")
        if code == 200 and turn["turn"].get("result"):
            return finished(args.id, turn["turn"]["state"], kind)
    if status != 202:
        return fail(status, data)
    if args.json:
        render.print_json(data)
    elif kind == "steer":
        print(f"{args.id}: steer queued" + (", the model call in flight is cut and the step "
              "restarts with it" if args.redirect else "; the turn reads it before its next "
              "step"))
    else:
        print(f"{args.id}: answered; the turn resumes with it")
    return exits.OK


def cmd_steer(client: Client, args: argparse.Namespace) -> int:
    return _message(client, args, "steer")


def cmd_answer(client: Client, args: argparse.Namespace) -> int:
    return _message(client, args, "answer")


def finished(turn_id: str, state: str, what: str) -> int:
    """The one rule for a command that would change a finished turn (cancel, steer,
    answer): nothing changes, and it exits 1 saying how the turn ended."""
    print(f"turnkeeper: turn {turn_id} has already finished ({state}): nothing to {what}",
          file=sys.stderr)
    return exits.FAIL


def cancel_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    turn_id_arg(p, common)
    p.add_argument("--now", action="store_true",
                   help="also cut a side effect in flight (its outcome is then unknown); "
                        "without it, such a call finishes first")


def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    status, data = client.request("POST", f"/v1/turns/{quote(args.id)}/cancel",
                                  {"now": True} if args.now else None)
    if status != 202:
        return fail(status, data)
    if data.get("finished"):  # it had ended before: nothing was cancelled
        return finished(args.id, data["state"], "cancel")
    if args.json:
        render.print_json(data)
    else:
        print(f"{args.id}: {data['state']}")
    return exits.OK
