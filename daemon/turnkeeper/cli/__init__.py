"""The `turnkeeper` command: the parser and `main`; the commands are a table in
`turnkeeper.cli.commands`, what they print for people in `turnkeeper.cli.render`.

Client commands import only the standard library and the socket client, so they start
fast; `serve` and `config` import the daemon side when they run.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from turnkeeper import __version__, exits
from turnkeeper.cli.base import UsageError, common_options, settle_output
from turnkeeper.cli.commands import COMMANDS
from turnkeeper.control.client import Client, ClientError, HTTPStatusError
from turnkeeper.paths import UnsafeSocketDir, client_socket_path

USAGE_ERROR = 2  # what argparse exits with on a wrong command line, and so do we

EXIT_STATUSES = f"""exit statuses:
  {exits.OK}   done (a turn: completed; status --check: ready)
  {exits.FAIL}   the request failed (the daemon's message is printed); status --check: degraded
  {USAGE_ERROR}   wrong command line
  {exits.TURN_STATUS['blocked']}-{exits.TURN_STATUS['cancelled']} a turn ended """ + ", ".join(
    f"{status} ({code})" for status, code in exits.TURN_STATUS.items() if code) + f"""
  {exits.UNAVAILABLE}  the daemon cannot be reached (serve: the store is held by another)
  {exits.IOERR}  serve: the store cannot be used as it is
  {exits.CONFIG}  the configuration is invalid"""


class Parser(argparse.ArgumentParser):
    """argparse's parser, with a suggestion for a misspelt choice: `turnkeeper stauts`
    answers "did you mean status?" instead of listing every command."""

    def error(self, message: str) -> NoReturn:
        m = _INVALID_CHOICE.search(message)
        if m:
            import difflib  # here: only a mistake needs it

            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            if close:
                message = (message[:m.start()] + f"invalid choice: {m.group(1)!r} (did you "
                           f"mean {close[0]}?)")
        super().error(message)


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="turnkeeper", parents=[common_options(top=True)],
               description="Host LLM agent turns that stay alive, bounded and honest.",
               epilog=EXIT_STATUSES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-V", "--version", action="version", version=f"turnkeeper {__version__}",
                   help="print the version and exit")
    p.set_defaults(parser=p)  # `completion` writes its script from the whole parser
    common = common_options(top=False)
    sub: Any = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS.values():
        c = sub.add_parser(cmd.name, parents=[common], help=cmd.help,
                           description=cmd.description)
        cmd.setup(c, common)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cmd = COMMANDS[args.command]
    try:
        settle_output(args)
        if cmd.run_local is not None:
            return cmd.run_local(args)
        assert cmd.run is not None
        return cmd.run(Client(client_socket_path(args.socket, args.config)), args)
    except UsageError as exc:
        print(f"turnkeeper {cmd.name}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except ClientError as exc:
        print(f"turnkeeper: {exc}", file=sys.stderr)
        return exits.UNAVAILABLE
    except UnsafeSocketDir as exc:  # a default socket another user could have planted
        print(f"turnkeeper: {exc}", file=sys.stderr)
        return exc.exit_code
    except HTTPStatusError as exc:  # the daemon answered, with an error
        print(f"turnkeeper: {exc}", file=sys.stderr)
        return exits.FAIL
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exits.OK
