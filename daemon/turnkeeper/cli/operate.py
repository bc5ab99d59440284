"""The commands that run or operate the daemon rather than one turn: `serve`, `config`,
`status` (and its `--check`), `pause` / `resume`, `wait`, `retry` and `completion`."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from turnkeeper import exits
from turnkeeper.cli import render
from turnkeeper.cli.base import UsageError, common_options, fail, get_and_print
from turnkeeper.cli.streams import turn_exit
from turnkeeper.control.client import Client
from turnkeeper.paths import EMBEDDED, config_search, searched_places

if TYPE_CHECKING:  # the CLI imports the config only for the commands that read it
    from turnkeeper.config import Config

DEGRADED = exits.FAIL  # `status --check`: the daemon answers, but is not fully ready
WAIT_POLL_S = 60  # one long poll of `wait`; the client allows it half a minute more


def cmd_serve(args: argparse.Namespace) -> int:
    from turnkeeper.daemon import serve
    return serve(args.config, args.socket)


def config_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    chk = sub.add_parser("check", parents=[common], help="validate without running",
                         description="Load and validate a config file, then exit.")
    chk.add_argument("path", nargs="?", help="the file (default: the config the daemon "
                     f"would read: {searched_places()}, else the embedded defaults)")
    show = sub.add_parser("show", parents=[common_options(top=False, outputs=SHOW_OUTPUTS)],
                          help="effective config, secrets redacted",
                          description="Print the effective config, secrets redacted: as "
                          "JSON (the default), or with -o toml as a file to paste back.")
    show.add_argument("path", nargs="?", help="the file (default: as for check)")


SHOW_OUTPUTS = ("json", "table", "toml")


def cmd_config(args: argparse.Namespace) -> int:
    from turnkeeper.config import ConfigError, PolicyVersion, load_config, socket_path, state_dir
    from turnkeeper.runtime import Runtime

    path, how = (args.path, "the command line") if getattr(args, "path", None) \
        else config_search(args.config)
    try:
        config, digest = load_config(path)
        Runtime.build(PolicyVersion(version=0, config=config, source_path=path,
                                    content_hash=digest))
    except ConfigError as exc:
        print(f"turnkeeper: {exc}", file=sys.stderr)
        return exits.CONFIG
    where = f"{path} (found by {how})" if path else \
        f"{EMBEDDED} (no file at any of: {searched_places()})"
    if args.config_command == "check":
        warnings = _sandbox_warnings(config)
        if args.json:
            render.print_json({"ok": True, "path": path, "found_by": how,
                               "warnings": warnings})
        else:
            for warning in warnings:
                print(f"turnkeeper: warning: {warning}", file=sys.stderr)
            print(f"{where}: ok")
        return exits.OK
    as_toml = not args.json and args.output is not None
    shown = config.redacted(as_written=as_toml)
    # The paths in use, not the "" that means "the default": what an operator looks for.
    shown["daemon"]["socket"] = str(socket_path(config, args.socket))
    shown["daemon"]["state_dir"] = str(state_dir(config))
    if not as_toml:
        render.print_json(shown)
        return exits.OK
    from turnkeeper.config.toml_text import to_toml

    print(f"# the effective config of {where}; secrets are shown as <redacted>\n")
    print(to_toml(shown), end="")
    return exits.OK


def _sandbox_warnings(config: Config) -> list[str]:
    """The stdio MCP servers that cannot start under the restrictions the daemon runs
    with: this process's own (`config check` run as the unit runs it, or inside the
    same sandbox), else the installed unit's, as systemd has loaded it."""
    if not any(t.kind == "mcp" and t.command for t in config.tools):
        return []
    from turnkeeper.lifecycle import sandbox

    denied = sandbox.write_execute_denied()
    if denied is None and sandbox.unit_denies_write_execute():
        denied = "turnkeeper.service sets MemoryDenyWriteExecute=yes"
    return [] if denied is None else sandbox.jit_server_problems(config.tools, denied)


# -- the daemon's state ----------------------------------------------------------------

def status_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true",
                   help=f"say only whether the daemon is ready: exit {exits.OK} ready, "
                   f"{DEGRADED} degraded (paused, a breaker open, an MCP server down, the "
                   f"last reload refused), {exits.UNAVAILABLE} unreachable")


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    if args.check:
        return _check(client, args)
    return get_and_print(client, args, "/v1/status",
                         lambda data: "\n".join(render.status_lines(data)))


def cmd_fleet(client: Client, args: argparse.Namespace) -> int:
    return get_and_print(client, args, "/v1/fleet",
                         lambda data: "\n".join(render.fleet_lines(data)))


def _check(client: Client, args: argparse.Namespace) -> int:
    status, data = client.request("GET", "/v1/health")
    if status == 503 and not (isinstance(data, dict) and "problems" in data):
        # Not the daemon's health: the socket refused the connection (its limit).
        msg = data.get("error") if isinstance(data, dict) else data
        print(f"turnkeeper: unreachable: {msg}", file=sys.stderr)
        return exits.UNAVAILABLE
    if status not in (200, 503) or not isinstance(data, dict) or "problems" not in data:
        return fail(status, data)
    if args.json:
        render.print_json(data)
    elif data["problems"]:
        print("degraded: " + "; ".join(data["problems"]))
    else:
        print("ok")
    return exits.OK if status == 200 else DEGRADED


def _intake(client: Client, args: argparse.Namespace, *, open_: bool) -> int:
    status, data = client.request("POST", "/v1/intake", {"open": open_})
    if status != 200:
        return fail(status, data)
    if args.json:
        render.print_json(data)
        return exits.OK
    queued = f"{data['queued']} queued"
    if open_:
        print(("resumed" if data["changed"] else "not paused") + f": queued turns start "
              f"again ({queued})")
    else:
        print(("paused" if data["changed"] else "already paused") + ": queued turns wait "
              f"until `turnkeeper resume`; submits are still queued, running turns go on "
              f"({queued})")
    return exits.OK


def cmd_pause(client: Client, args: argparse.Namespace) -> int:
    return _intake(client, args, open_=False)


def cmd_resume(client: Client, args: argparse.Namespace) -> int:
    return _intake(client, args, open_=True)


def prune_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("--older-than", required=True, metavar="D",
                   help="delete the turns that finished more than D ago (90s, 30m, 24h, "
                   "7d, 2w) with their events and journal")
    p.add_argument("--dead-letters", action="store_true",
                   help="dead letters among them too (kept otherwise, until replayed)")


def cmd_prune(client: Client, args: argparse.Namespace) -> int:
    from turnkeeper.durations import parse_duration

    try:
        parse_duration(args.older_than)
    except ValueError as exc:
        raise UsageError(f"--older-than: {exc}") from None
    status, data = client.request("POST", "/v1/prune", {
        "older_than": args.older_than, "dead_letters": args.dead_letters})
    if status != 200:
        return fail(status, data)
    if args.json:
        render.print_json(data)
    else:
        print(f"pruned {data['pruned']} finished turns older than {args.older_than}"
              + (" (dead letters included)" if args.dead_letters else ""))
    return exits.OK


# -- one turn's end -----------------------------------------------------------------------

def wait_result(client: Client, turn_id: str) -> tuple[int, Any]:
    """Long-poll a turn until it has a result: (200, the turn), or the error answer."""
    while True:
        status, data = client.request("GET", f"/v1/turns/{quote(turn_id)}?wait={WAIT_POLL_S}",
                                      timeout=WAIT_POLL_S + 30)
        if status != 200:
            return status, data
        if data["turn"].get("result"):
            return status, data["turn"]


def print_result(turn: dict[str, Any], as_json: bool) -> int:
    if as_json:
        render.print_json(turn)
    else:
        print(render.summary(turn))
    return turn_exit(turn["result"])


def cmd_wait(client: Client, args: argparse.Namespace) -> int:
    status, data = wait_result(client, args.id)
    if status != 200:
        return fail(status, data)
    return print_result(data, args.json)


def retry_body(turn: dict[str, Any]) -> dict[str, Any]:
    """A new turn with a finished one's input: its message, budget, profile, model and
    agent, and its session when it named one (a turn that was its own session gets a
    fresh one). Not its deadline: an absolute time, most likely passed."""
    body: dict[str, Any] = {"message": turn["message"]}
    if turn.get("session") and turn["session"] != turn["id"]:
        body["session"] = turn["session"]
    if turn.get("budget"):
        body["budget"] = turn["budget"]
    if turn.get("profile"):
        body["profile"] = turn["profile"]
    if turn.get("model"):
        body["model"] = turn["model"]
    if turn.get("agent"):
        body["agent"] = turn["agent"]
    return body


def retry_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("id", help="the finished turn whose input to submit again (t_...)")
    p.add_argument("--wait", action="store_true", help="wait for the new turn's result")


def cmd_retry(client: Client, args: argparse.Namespace) -> int:
    status, data = client.request("GET", f"/v1/turns/{quote(args.id)}")
    if status != 200:
        return fail(status, data)
    turn = data["turn"]
    if not turn.get("result"):
        print(f"turnkeeper: turn {args.id} is {turn['state']}, not finished: nothing to "
              "retry yet", file=sys.stderr)
        return exits.FAIL
    status, data = client.request("POST", "/v1/turns", retry_body(turn))
    if status != 202:
        return fail(status, data)
    new = data["turn"]
    if args.wait:
        status, data = wait_result(client, new["id"])
        if status != 200:
            return fail(status, data)
        return print_result(data, args.json)
    if args.json:
        render.print_json(new)
    else:
        print(new["id"])
    return exits.OK


# -- every live turn ----------------------------------------------------------------------

def top_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between refreshes (default 1)")
    p.add_argument("--once", action="store_true",
                   help="print one snapshot and exit (also when not on a terminal)")


def cmd_top(client: Client, args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise UsageError("--interval: must be more than 0")
    if args.json:
        from turnkeeper.cli.top import snapshot  # rich: imported only here

        status, turns = snapshot(client)
        render.print_json({"status": status, "turns": turns})
        return exits.OK
    from turnkeeper.cli.top import run_top  # rich: imported only here

    run_top(client, interval_s=args.interval, once=args.once)
    return exits.OK


# -- shell completion ---------------------------------------------------------------------

def completion_setup(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("shell", choices=["bash", "zsh", "fish"], help="the shell to complete for")


def cmd_completion(args: argparse.Namespace) -> int:
    from turnkeeper.cli.completion import script  # here only: `status` stays fast

    # The whole command line's parser, handed over by the parser itself (`cli.parser`):
    # the commands are below it and do not import it.
    print(script(args.parser, args.shell))
    return exits.OK
