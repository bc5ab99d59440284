"""turnkeeper(1), generated from the parser: every command, its arguments and options,
and the exit statuses, as the `--help` texts say them. `man/turnkeeper.1` in the
repository is this module's output (a test keeps it so) and is installed with the
package (`share/man/man1`). Regenerate it with `python -m turnkeeper.cli.manpage >
man/turnkeeper.1`. Imported by nothing else: no command pays for it."""

from __future__ import annotations

import argparse
import re

from turnkeeper import __version__

ENVIRONMENT = (
    ("TURNKEEPER_SOCKET", "the control socket, as --socket"),
    ("TURNKEEPER_CONFIG", "the config file, as --config"),
    ("TURNKEEPER_SECTION__KEY", "overrides one key of the config (lists and tables as "
                                "JSON)"),
    ("XDG_CONFIG_HOME", "where the user's config file is looked for "
                        "($XDG_CONFIG_HOME/turnkeeper/turnkeeper.toml)"),
)
FILES = (
    ("$XDG_CONFIG_HOME/turnkeeper/turnkeeper.toml", "the user's config file, read when "
                                                    "no --config or TURNKEEPER_CONFIG names one"),
    ("/etc/turnkeeper/turnkeeper.toml", "the system's config file, read after the user's"),
    ("/run/turnkeeper/control.sock", "the control socket of the system service"),
)


def _text(s: str) -> str:
    """Plain text made safe for roff."""
    out = s.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(("\\&" + line) if line[:1] in (".", "'") else line
                     for line in out.splitlines())


def _subparsers(p: argparse.ArgumentParser) -> argparse._SubParsersAction[
        argparse.ArgumentParser] | None:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _arguments(p: argparse.ArgumentParser, skip: frozenset[str]) -> list[str]:
    out: list[str] = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings and action.dest in skip:
            continue
        if action.option_strings:
            name = ", ".join(f"\\fB{_text(o)}\\fR" for o in action.option_strings)
            if action.nargs != 0:
                metavar = action.metavar or ("{" + ",".join(map(str, action.choices)) + "}"
                                             if action.choices else action.dest.upper())
                name += f" \\fI{_text(str(metavar))}\\fR"
        else:
            name = f"\\fI{_text(str(action.metavar or action.dest))}\\fR"
        out += [".TP", name, _text(action.help or "")]
    return out


def _usage(p: argparse.ArgumentParser) -> str:
    """A command's usage on one line, without the options every command takes."""
    usage = " ".join(p.format_usage().removeprefix("usage: ").split())
    return re.sub(r" \[-h\] \[--socket SOCKET\] \[--json\] \[-o \{[a-z,]*\}\] "
                  r"\[--config CONFIG\]", "", usage)


def render(p: argparse.ArgumentParser) -> str:
    """The man page of `p` (the `turnkeeper` parser) in roff."""
    from turnkeeper.cli import EXIT_STATUSES

    common = frozenset({"socket", "json", "output", "config", "help"})
    lines = [f'.TH TURNKEEPER 1 "" "turnkeeper {__version__}" "User Commands"',
             ".SH NAME", f"turnkeeper \\- {_text(p.description or '')}",
             ".SH SYNOPSIS", "\\fBturnkeeper\\fR [\\fIOPTIONS\\fR] \\fICOMMAND\\fR "
             "[\\fIARGUMENTS\\fR]", ".SH OPTIONS",
             "Taken by every command, before or after its name.",
             *_arguments(p, frozenset()), ".SH COMMANDS"]
    sub = _subparsers(p)
    assert sub is not None
    for name, cmd in sub.choices.items():
        lines += [f'.SS "{_text(_usage(cmd))}"', _text(cmd.description or ""),
                  *_arguments(cmd, common)]
        inner = _subparsers(cmd)
        for action_name, action in (inner.choices.items() if inner else ()):
            lines += [".TP", f"\\fB{_text(name)} {_text(action_name)}\\fR",
                      _text(action.description or ""), ".RS",
                      *_arguments(action, common), ".RE"]
    lines += [".SH EXIT STATUS", ".nf",
              _text(EXIT_STATUSES.removeprefix("exit statuses:\n")), ".fi",
              ".SH ENVIRONMENT"]
    for name, what in ENVIRONMENT:
        lines += [".TP", f"\\fB{_text(name)}\\fR", _text(what)]
    lines += [".SH FILES"]
    for name, what in FILES:
        lines += [".TP", f"\\fI{_text(name)}\\fR", _text(what)]
    lines += [".SH SEE ALSO", "The documentation in docs/ of the turnkeeper sources: "
              "operations.md, configuration.md, control\\-api.md."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from turnkeeper.cli import parser

    print(render(parser()), end="")
