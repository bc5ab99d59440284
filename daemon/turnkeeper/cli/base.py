"""What every `turnkeeper` command is built from: the `Command` row of the table, the
usage error, and the small argument helpers the commands share."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from turnkeeper import exits
from turnkeeper.cli import render
from turnkeeper.control.client import Client
from turnkeeper.errors import TurnkeeperError

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


def fail(status: int, data: Any) -> int:
    msg = data.get("error") if isinstance(data, dict) else data
    print(f"turnkeeper: HTTP {status}: {msg}", file=sys.stderr)
    return exits.FAIL


OUTPUTS = ("json", "table")


def common_options(*, top: bool, outputs: tuple[str, ...] = OUTPUTS
                   ) -> argparse.ArgumentParser:
    """The options every command takes, before or after the command name. On the
    subcommands their defaults are suppressed so they do not undo a value given first.
    `-o` is declared here, once, so that every command taking `--json` takes it too
    (and argparse never reads `-o json ID` as an id)."""
    common = argparse.ArgumentParser(add_help=False)
    kw: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    common.add_argument("--socket", help="control socket (default: $TURNKEEPER_SOCKET, "
                        "the config's daemon.socket, or the per-user default)", **kw)
    common.add_argument("--json", action="store_true", help="print raw JSON (as -o json)",
                        **kw)
    common.add_argument("-o", "--output", choices=outputs,
                        help="json: the daemon's answer as it is, for a script; table: "
                        "for people (the default)"
                        + ("; toml: a config file to paste back" if "toml" in outputs
                           else ""), **kw)
    common.add_argument("--config", help="config file (for serve, config, and to find "
                        "the socket)", **kw)
    return common


def settle_output(args: argparse.Namespace) -> None:
    """Fold `--json` and `-o` into one answer, `args.json`, that every command reads;
    `args.output` keeps a third format (`config show -o toml`)."""
    output = getattr(args, "output", None)
    if args.json and output not in (None, "json"):
        raise UsageError(f"--json and --output {output} ask for two formats: give one")
    args.json = bool(args.json) or output == "json"


def wants_json(args: argparse.Namespace) -> bool:
    """Whether to print the API's JSON: `--json` or `--output json`."""
    return bool(args.json) or getattr(args, "output", None) == "json"


def get_and_print(client: Client, args: argparse.Namespace, path: str,
                  text: Callable[[Any], str]) -> int:
    """GET `path`; print the answer as JSON with `--json` (or `--output json`), else as
    `text(answer)`."""
    status, data = client.request("GET", path)
    if status != 200:
        return fail(status, data)
    if wants_json(args):
        render.print_json(data)
    else:
        print(text(data))
    return exits.OK


def no_args(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
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


def turn_id_arg(p: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    p.add_argument("id", help="the turn's id (t_...)")
