"""The `turnkeeper` commands, one small function each, and the table that names them.

Each entry carries what `turnkeeper --help` shows (a help line and a description), how
its arguments are declared, and the function that runs it: `main` looks the command up
here, so adding one is one function and one row. Client commands import only the
standard library and the socket client, so they start fast; `serve` and `config` import
the daemon side when they run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode

from turnkeeper import exits
from turnkeeper.cli import render
from turnkeeper.cli.streams import cmd_events, cmd_follow, follow_turn, turn_exit
from turnkeeper.control.client import Client
from turnkeeper.errors import TurnkeeperError
from turnkeeper.policy.turn_state import TurnState

# Declares a command's arguments; the second parser holds the options every command
# takes, for a command with actions of its own (`config check`) to pass on.
Setup = Callable[[argparse.ArgumentParser, argparse.ArgumentParser], None]


class UsageError(TurnkeeperError):
    """The command line is wrong in a way argparse cannot see; exits 2 like its own."""


class Command:
    """One command: what `--help` shows for it, how its arguments are declared, and what
    runs it (`run` with a client of the daemon, or `run_local` for one that needs none).
    A plain class: a dataclass or NamedTuple costs every command start-up time."""

    __slots__ = ("description", "help", "name", "run", "run_local", "setup")

    def __init__(self, name: str, help: str, description: str, setup: Setup,
                 run: Callable[[Client, argparse.Namespace], int] | None = None, *,
                 run_local: Callable[[argparse.Namespace], int] | None = None) -> None:
        self.name, self.help, self.description, self.setup = name, help, description, setup
        self.run, self.run_local = run, run_local


def _fail(status: int, data: Any) -> int:
    msg = data.get("error") if isinstance(data, dict) else data
    print(f"turnkeeper: HTTP {status}: {msg}", file=sys.stderr)
    return exits.FAIL


def _no_args(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    pass


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (0 and negatives mean nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def parse_deadline(text: str, now: float) -> float:
    """`--deadline`: a span from now (`90s`, `30m`, `2h`, `1d`), epoch seconds, or an ISO
    8601 time (local time when it names no zone), as epoch seconds. A deadline already
    passed is refused here: a turn that could never run is a mistake on the line."""
    from datetime import datetime  # here: only this option needs it

    text = text.strip()
    if text[-1:].lower() in "smhd" and text[:-1].replace(".", "", 1).isdigit():
        when = now + render.parse_duration(text)
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


def _turn_id(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("id", help="the turn's id (t_...)")


# -- serve, config ------------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    from turnkeeper.daemon import serve
    return serve(args.config, args.socket)


def _config_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    chk = sub.add_parser("check", parents=[common], help="validate without running",
                         description="Load and validate a config file, then exit.")
    chk.add_argument("path", nargs="?", help="the file (default: --config, or the "
                     "config the daemon would read)")
    sub.add_parser("show", parents=[common], help="effective config, secrets redacted",
                   description="Print the effective config as JSON, secrets redacted.")


def cmd_config(args: argparse.Namespace) -> int:
    from turnkeeper.config import (
        ConfigError,
        Policy,
        config_path_from_env,
        load_config,
        socket_path,
        state_dir,
    )
    from turnkeeper.runtime import Runtime

    path = getattr(args, "path", None) or config_path_from_env(args.config)
    try:
        config, digest = load_config(path)
        Runtime.build(Policy(version=0, config=config, source_path=path, content_hash=digest))
    except ConfigError as exc:
        print(f"turnkeeper: {exc}", file=sys.stderr)
        return exits.CONFIG
    if args.config_command == "check":
        if args.json:
            render.print_json({"ok": True, "path": path})
        else:
            print(f"{path or 'embedded defaults'}: ok")
        return exits.OK
    shown = config.redacted()
    # The paths in use, not the "" that means "the default": what an operator looks for.
    shown["daemon"]["socket"] = str(socket_path(config, args.socket))
    shown["daemon"]["state_dir"] = str(state_dir(config))
    render.print_json(shown)
    return exits.OK


# -- turns --------------------------------------------------------------------------------

def _submit_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("message", help="what the agent is asked to do")
    p.add_argument("--session", help="a session to continue (default: a new one)")
    p.add_argument("--max-tokens", type=int, help="token budget of this turn")
    p.add_argument("--max-seconds", type=float, help="active-seconds budget of this turn")
    p.add_argument("--max-steps", type=int, help="step budget of this turn")
    p.add_argument("--max-cost-usd", type=float, help="cost budget of this turn, in USD")
    p.add_argument("--deadline", help="when the turn must end: a span from now (30m, 2h), "
                   "an ISO 8601 time (local unless it names a zone) or epoch seconds")
    p.add_argument("--profile", help="a budget profile of the policy ([budget.profiles.NAME])")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--wait", action="store_true", help="wait for the result")
    g.add_argument("--follow", action="store_true", help="show the turn live")


def _submit_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"message": args.message}
    if args.session:
        body["session"] = args.session
    budget = {k: v for k, v in (("max_tokens", args.max_tokens),
                                ("max_seconds", args.max_seconds),
                                ("max_steps", args.max_steps),
                                ("max_cost_usd", args.max_cost_usd)) if v is not None}
    if budget:
        body["budget"] = budget
    if args.deadline:
        import time  # here: only this option needs it

        body["deadline"] = parse_deadline(args.deadline, time.time())
    if args.profile:
        body["profile"] = args.profile
    return body


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    status, data = client.request("POST", "/v1/turns", _submit_body(args))
    if status != 202:
        return _fail(status, data)
    turn = data["turn"]
    if args.follow:
        if not args.json:
            print(f"turn {turn['id']} queued")
        return follow_turn(client, turn["id"], args.json)
    if not args.wait:
        if args.json:
            render.print_json(turn)
        else:
            print(turn["id"])
        return exits.OK
    while True:
        status, data = client.request("GET", f"/v1/turns/{turn['id']}?wait=60", timeout=90)
        if status != 200:
            return _fail(status, data)
        turn = data["turn"]
        if turn.get("result"):
            break
    if args.json:
        render.print_json(turn)
    else:
        print(render.summary(turn))
    return turn_exit(turn["result"])


def _turns_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("--state", choices=[s.value for s in TurnState], metavar="STATE",
                   help="only turns in this state: " + ", ".join(s.value for s in TurnState))
    p.add_argument("--session", help="only turns of this session")
    p.add_argument("--limit", type=positive_int, default=50,
                   help="at most this many (default 50)")


def cmd_turns(client: Client, args: argparse.Namespace) -> int:
    q = {k: v for k, v in (("state", args.state), ("session", args.session),
                           ("limit", args.limit)) if v}
    status, data = client.request("GET", "/v1/turns?" + urlencode(q))
    if status != 200:
        return _fail(status, data)
    if args.json:
        render.print_json(data)
        return exits.OK
    if not data["turns"]:
        print("no turns" + (" matching" if args.state or args.session else ""))
        return exits.OK
    print(render.TURNS_HEADER)
    for t in data["turns"]:
        print(render.turn_row(t))
    return exits.OK


def cmd_show(client: Client, args: argparse.Namespace) -> int:
    status, data = client.request("GET", f"/v1/turns/{quote(args.id)}")
    if status != 200:
        return _fail(status, data)
    if args.json:
        render.print_json(data["turn"])
    else:
        print(render.summary(data["turn"]))
    return exits.OK


def _steer_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    _turn_id(p, common)
    p.add_argument("text", help="the message for the agent")
    p.add_argument("--redirect", action="store_true",
                   help="cut the in-flight model call and restart the step with it")


def _answer_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    _turn_id(p, common)
    p.add_argument("text", help="the answer to the turn's question")


def _message(client: Client, args: argparse.Namespace, kind: str) -> int:
    body: dict[str, Any] = {"kind": kind, "text": args.text}
    if kind == "steer" and args.redirect:
        body["redirect"] = True
    status, data = client.request("POST", f"/v1/turns/{quote(args.id)}/messages", body)
    if status != 202:
        return _fail(status, data)
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


def _cancel_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    _turn_id(p, common)
    p.add_argument("--now", action="store_true",
                   help="also cut a side effect in flight (its outcome is then unknown); "
                        "without it, such a call finishes first")


def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    status, data = client.request("POST", f"/v1/turns/{quote(args.id)}/cancel",
                                  {"now": True} if args.now else None)
    if status != 202:
        return _fail(status, data)
    if args.json:
        render.print_json(data)
    else:
        print(f"{args.id}: {data['state']}")
    return exits.OK


# -- the daemon ---------------------------------------------------------------------------

def cmd_status(client: Client, args: argparse.Namespace) -> int:
    status, data = client.request("GET", "/v1/status")
    if status != 200:
        return _fail(status, data)
    if args.json:
        render.print_json(data)
    else:
        print("\n".join(render.status_lines(data)))
    return exits.OK


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
              + (f" (pending restart: {', '.join(data['pending_restart'])})"
                 if data.get("pending_restart") else ""))
    return exits.OK


def _limits_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
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
            query["since"] = render.parse_duration(args.since)
        except ValueError as exc:
            raise UsageError(f"--since: {exc}") from None
    status, data = client.request("GET", "/v1/limits/report?" + urlencode(query))
    if status != 200:
        return _fail(status, data)
    if args.json:
        render.print_json(data)
    else:
        print("\n".join(render.limits_lines(data)))
    return exits.OK


def _dead_letters_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["replay"],
                   help="replay: resume the dead letter's turn from its last checkpoint")
    p.add_argument("id", nargs="?", help="the dead letter to replay")


def cmd_dead_letters(client: Client, args: argparse.Namespace) -> int:
    if args.action == "replay":
        if not args.id:
            raise UsageError("dead-letters replay needs an ID")
        status, data = client.request("POST", f"/v1/dead-letters/{quote(args.id)}/replay")
        if status != 202:
            return _fail(status, data)
        print(data["turn"]["id"] if not args.json else json.dumps(data))
        return exits.OK
    status, data = client.request("GET", "/v1/dead-letters")
    if status != 200:
        return _fail(status, data)
    if args.json:
        render.print_json(data)
        return exits.OK
    if not data["dead_letters"]:
        print("no dead letters")
    for d in data["dead_letters"]:
        sb = d.get("stopped_because") or {}
        print(f"{d['id']}  {sb.get('code', '-'):<20} {d.get('last_error') or '-'}"
              + (f"  (replayed as {d['replayed_by']})" if d.get("replayed_by") else ""))
    return exits.OK


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("serve", "run the daemon",
            "Run the daemon in the foreground until SIGTERM or SIGINT.",
            _no_args, run_local=cmd_serve),
    Command("submit", "submit a turn",
            "Queue a turn; print its id, or wait for (or follow) its result.",
            _submit_setup, cmd_submit),
    Command("status", "daemon status",
            "The daemon's state, policy, reloads, turns, queue, breakers and MCP servers.",
            _no_args, cmd_status),
    Command("turns", "list turns", "List turns, newest first.", _turns_setup, cmd_turns),
    Command("show", "show one turn", "A turn's state, counters, usage and result.",
            _turn_id, cmd_show),
    Command("follow", "follow a turn live",
            "Show a turn's events as they happen (a live view on a terminal) until it "
            "ends; the exit status is the turn's.", _turn_id, cmd_follow),
    Command("cancel", "cancel a turn",
            "Cancel a queued, running or parked turn. A side effect in flight finishes "
            "first unless --now.", _cancel_setup, cmd_cancel),
    Command("steer", "add a message to a running turn",
            "Give a running turn a message it reads before its next step.",
            _steer_setup, cmd_steer),
    Command("answer", "answer a clarify question",
            "Answer the question a waiting turn asked; it resumes with the answer.",
            _answer_setup, cmd_answer),
    Command("events", "print every event as it happens",
            "Every event of every turn and of the daemon, live, until interrupted.",
            _no_args, cmd_events),
    Command("reload", "reload the config (waits for the outcome; non-zero exit when "
            "invalid)", "Re-read the config and apply it; an invalid one is refused and "
            "the running policy kept.", _no_args, cmd_reload),
    Command("config", "check or show the config",
            "Validate the config, or print the effective one; needs no daemon.",
            _config_setup, run_local=cmd_config),
    Command("dead-letters", "list or replay dead letters",
            "List the turns that failed for good, or replay one from its last checkpoint.",
            _dead_letters_setup, cmd_dead_letters),
    Command("limits", "limits measured from finished turns",
            "What the finished turns used, against the limits.", _limits_setup, cmd_limits),
)}
