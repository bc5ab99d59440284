"""The CLI as a table: every command and option explains itself, `--version` works,
usage errors exit 2, and a daemon that cannot be reached is 69 (without a daemon)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from turnkeeper import __version__, exits
from turnkeeper.cli import main, parser
from turnkeeper.cli.commands import COMMANDS


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _walk(p: argparse.ArgumentParser, path: str = "turnkeeper"
          ) -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(path, p)]
    for name, sub in _subparsers(p).items():
        out.extend(_walk(sub, f"{path} {name}"))
    return out


def test_every_command_has_a_help_line_and_a_description() -> None:
    for cmd in COMMANDS.values():
        assert cmd.help and cmd.description, cmd.name
        assert (cmd.run is None) != (cmd.run_local is None), cmd.name
    assert set(_subparsers(parser())) == set(COMMANDS)


def test_every_option_and_argument_has_help() -> None:
    for path, p in _walk(parser()):
        assert p.description, path
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f"{path}: {action.dest}"


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([flag])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"turnkeeper {__version__}"


def test_help_lists_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "exit statuses" in out
    for code in (exits.OK, exits.FAIL, exits.UNAVAILABLE, exits.CONFIG,
                 *exits.TURN_STATUS.values()):
        assert str(code) in out


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = str(tmp_path / "none.sock")
    with pytest.raises(SystemExit) as exc:
        main(["--socket", sock, "show"])  # no id: argparse's own
    assert exc.value.code == 2
    assert main(["--socket", sock, "dead-letters", "replay"]) == 2
    assert "needs an ID" in capsys.readouterr().err
    assert main(["--socket", sock, "limits", "report", "--since", "soon"]) == 2


def test_an_unreachable_daemon_is_69(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--socket", str(tmp_path / "none.sock"), "status"]) == exits.UNAVAILABLE
    assert main(["--socket", str(tmp_path / "none.sock"), "follow", "t_1", "--json"]) \
        == exits.UNAVAILABLE
    assert "turnkeeper:" in capsys.readouterr().err


def test_the_man_page_in_the_repository_is_the_parser_s() -> None:
    from pathlib import Path

    from turnkeeper.cli import parser
    from turnkeeper.cli.manpage import render

    page = Path(__file__).resolve().parents[2] / "man" / "turnkeeper.1"
    assert page.read_text() == render(parser()), (
        "man/turnkeeper.1 is out of date: python -m turnkeeper.cli.manpage > man/turnkeeper.1")


NO_FORMAT = {"serve", "completion"}  # they take -o, as every command does; nothing to format


def _command_rows() -> dict[str, tuple[str, str]]:
    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    section = text.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def _leaves(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every command as typed: `status`, and `config check` for one with actions."""
    out: dict[str, argparse.ArgumentParser] = {}
    for name, sub in _subparsers(p).items():
        actions = _subparsers(sub)
        if actions:
            out.update({f"{name} {a}": s for a, s in actions.items()})
        else:
            out[name] = sub
    return out


def test_the_operations_table_has_every_command_its_exits_and_its_formats() -> None:
    rows = _command_rows()
    leaves = _leaves(parser())
    assert sorted(rows) == sorted(leaves)
    for name, sub in leaves.items():
        exits_cell, formats = rows[name]
        output = next(a for a in sub._actions if a.dest == "output")
        assert output.choices is not None
        if name.split()[0] in NO_FORMAT:
            assert formats == "—", name
        else:
            assert formats == ", ".join(output.choices), name
        assert any(ch.isdigit() for ch in exits_cell), name
        assert "--json" in {o for a in sub._actions for o in a.option_strings}, name
