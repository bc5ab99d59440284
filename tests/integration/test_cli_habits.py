"""The habits every `turnkeeper` command shares, on the real daemon: an unknown turn is
exit 1 and "no turn ID" everywhere; an unknown name lists the known ones; `-o json` is
taken wherever `--json` is; a misspelt command gets a suggestion; a pipe gets whole
lines; a finished turn is not changed; a result reads the same live and after."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.integration.harness import Daemon, script_file, scripted_provider
from tests.integration.test_cli import cli, slow_config
from tests.integration.test_observability import Terminal

BLOCK_SCRIPT = """
[[scenarios]]
match = "block"
[[scenarios.steps]]
tool_calls = [{ name = "report_blocked", arguments = { reason = "no access" } }]

[[scenarios]]
[[scenarios.steps]]
reply = "done: $message"
"""


def test_every_command_naming_an_unknown_turn_exits_1_saying_no_turn(start: Any) -> None:
    d = start()
    for args in (("show", "t_nope"), ("wait", "t_nope"), ("follow", "t_nope"),
                 ("retry", "t_nope"), ("steer", "t_nope", "x"), ("answer", "t_nope", "x"),
                 ("cancel", "t_nope"), ("logs", "t_nope")):
        out = cli(*args, socket=d.socket)
        assert out.returncode == 1, (args, out)
        assert "no turn t_nope" in out.stderr, (args, out.stderr)


def test_an_unknown_profile_is_an_error_naming_the_known_ones(start: Any) -> None:
    d = start("[budget.profiles.quick]\nmax_steps = 3\n")
    d.run("hello", profile="quick")
    out = cli("limits", "report", "--profile", "nope", socket=d.socket)
    assert out.returncode == 1, out
    assert "no budget profile 'nope'" in out.stderr
    assert "default" in out.stderr and "quick" in out.stderr
    assert cli("limits", "report", "--profile", "quick", socket=d.socket).returncode == 0
    for args in (("--profile", "nope"), ("--model", "nope")):
        out = cli("submit", "x", *args, socket=d.socket)
        assert out.returncode == 1 and "known:" in out.stderr, out


def test_output_json_is_taken_wherever_json_is(start: Any) -> None:
    d = start()
    turn = d.run("hello")
    for args in (("show", turn["id"]), ("wait", turn["id"]), ("status",),
                 ("submit", "again", "--wait"), ("top",), ("fleet",)):
        for flag in (("-o", "json"), ("--output", "json")):
            out = cli(*args[:1], *flag, *args[1:], socket=d.socket)
            if args == ("fleet",):  # not a fleet: refused, but not for the option
                assert out.returncode == 1 and "not a fleet" in out.stderr, out
                continue
            assert out.returncode == 0, (args, out.stderr)
            assert isinstance(json.loads(out.stdout), dict), args
    shown = json.loads(cli("show", "-o", "json", turn["id"], socket=d.socket).stdout)
    assert shown["id"] == turn["id"]
    # Before the command, too, and against --json.
    assert json.loads(cli("-o", "json", "status", socket=d.socket).stdout)["state"] == "ready"
    both = cli("status", "--json", "-o", "table", socket=d.socket)
    assert both.returncode == 2 and "two formats" in both.stderr
    assert cli("status", "-o", "toml", socket=d.socket).returncode == 2


def test_a_misspelt_command_gets_a_suggestion_not_the_whole_list() -> None:
    out = cli("stauts")
    assert out.returncode == 2
    assert "did you mean status?" in out.stderr, out.stderr
    assert "dead-letters" not in out.stderr  # not the list of every command
    out = cli("config", "shwo")
    assert out.returncode == 2 and "did you mean show?" in out.stderr, out.stderr
    out = cli("xyzzy")  # nothing close: the list, as before
    assert out.returncode == 2 and "dead-letters" in out.stderr


def test_top_into_a_pipe_is_not_cut_to_a_terminal_s_width(start: Any, tmp_path: Path) -> None:
    d = start(slow_config(tmp_path))
    turn = d.submit("a message long enough to be worth reading whole", budget={"max_steps": 9})
    out = cli("top", socket=d.socket)  # stdout is a pipe
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout, out.stdout
    header = next(line for line in out.stdout.splitlines() if line.startswith("ID"))
    assert header.split() == ["ID", "STATE", "STEP", "PROVIDER", "TOKENS", "ACTIVE", "COST",
                              "MESSAGE"]
    row = next(line for line in out.stdout.splitlines() if turn["id"] in line)
    assert "a message long enough to be worth" in row
    d.wait(turn["id"])


def test_acting_on_a_finished_turn_changes_nothing_and_exits_1(start: Any) -> None:
    d = start()
    turn = d.run("hello")
    for args, verb in ((("cancel", turn["id"]), "cancel"),
                       (("steer", turn["id"], "more"), "steer"),
                       (("answer", turn["id"], "yes"), "answer")):
        out = cli(*args, socket=d.socket)
        assert out.returncode == 1, (args, out)
        assert f"turn {turn['id']} has already finished (completed): nothing to {verb}" \
            in out.stderr, out.stderr
    assert d.get(f"/v1/turns/{turn['id']}")[1]["turn"]["state"] == "completed"
    status, data = d.post(f"/v1/turns/{turn['id']}/cancel")
    assert status == 202 and data == {"turn": turn["id"], "state": "completed",
                                      "finished": True}


def test_a_blocked_turn_reads_blocked_once_live_and_after(start: Any, tmp_path: Path) -> None:
    d = start(scripted_provider(script_file(tmp_path / "s.toml", BLOCK_SCRIPT)))
    term = Terminal([sys.executable, "-m", "turnkeeper", "--socket", str(d.socket), "submit",
                     "block me", "--follow"])
    try:
        code = term.finish()
    finally:
        term.kill()
    screen = term.text()
    assert code == 3, screen  # blocked
    assert "blocked" in screen and "blocked: blocked" not in screen, screen
    turn = json.loads(cli("turns", "-o", "json", socket=d.socket).stdout)["turns"][0]
    shown = cli("show", turn["id"], socket=d.socket).stdout
    assert "result    blocked" in shown and "blocked: blocked" not in shown


def test_status_check_after_a_refused_reload_names_the_bad_key(start: Any) -> None:
    d = start()
    text = d.config_path.read_text()
    d.config_path.write_text(text + "\n[budget]\nmax_stpes = 3\n")
    out = cli("reload", socket=d.socket)
    assert out.returncode == 78, out
    check = cli("status", "--check", socket=d.socket)
    assert check.returncode == 1, check
    assert "budget.max_stpes: unknown key" in check.stdout, check.stdout
    assert not check.stdout.rstrip().endswith(":")


def test_a_config_file_typo_gets_its_line_and_a_suggestion(tmp_path: Path) -> None:
    cfg = tmp_path / "tk.toml"
    cfg.write_text('[budget]\nmax_stpes = 3\n\n[budgte]\nx = 1\n\n'
                   '[[providers]]\nname = "one"\nkind = "scripted"\n\n'
                   '[[providers]]\nname = "primary"\nkind = "antropic"\nmodel = "m"\n\n'
                   '[[providers]]\nname = "third"\nkind = "scripted"\nbase_url = "http://x"\n')
    out = cli("config", "check", str(cfg))
    assert out.returncode == 78, out
    err = out.stderr
    assert "line 2: budget.max_stpes: unknown key (did you mean max_steps?)" in err, err
    assert "line 4: budgte: unknown key (did you mean budget?)" in err, err
    assert "line 13: providers.primary.kind:" in err and "(did you mean anthropic?)" in err
    assert "line 16: providers.third:" in err, err  # by name, at its table
    assert not re.search(r"providers\.\d", err), err


def test_config_show_takes_a_path_and_prints_toml_that_reads_back(tmp_path: Path) -> None:
    cfg = tmp_path / "tk.toml"
    cfg.write_text('[budget]\nmax_steps = 7\n\n[budget.profiles.quick]\nmax_steps = 3\n\n'
                   '[[providers]]\nname = "p"\nkind = "openai"\napi_key_env = ""\n'
                   'base_url = "http://127.0.0.1:9/v1"\nheaders = { X-Key = "s3cret" }\n'
                   'options = { temperature = 0.2 }\n\n[models.fast]\nchain = ["p"]\n')
    as_json = cli("config", "show", str(cfg))
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["budget"]["max_steps"] == 7
    out = cli("config", "show", str(cfg), "-o", "toml")
    assert out.returncode == 0, out.stderr
    assert "s3cret" not in out.stdout
    assert out.stdout.startswith(f"# the effective config of {cfg}")
    back = tmp_path / "back.toml"
    back.write_text(out.stdout)
    check = cli("config", "check", str(back))
    assert check.returncode == 0, (check.stderr, out.stdout)
    again = json.loads(cli("config", "show", str(back)).stdout)
    first = json.loads(as_json.stdout)
    assert again["budget"] == first["budget"] and again["models"] == first["models"]
    assert again["providers"][0]["options"] == {"temperature": 0.2}
    missing = cli("config", "show", str(tmp_path / "nope.toml"))
    assert missing.returncode == 78 and "does not exist" in missing.stderr


def test_without_config_the_user_s_file_is_found_and_named(tmp_path: Path,
                                                          daemons: list[Daemon]) -> None:
    home = tmp_path / "xdg"
    found = home / "turnkeeper" / "turnkeeper.toml"
    found.parent.mkdir(parents=True)
    d = Daemon(tmp_path, '[budget]\nmax_steps = 11\n\n[[providers]]\nname = "offline"\n'
                         'kind = "scripted"\n')
    found.write_text(d.config_path.read_text())
    env = {"XDG_CONFIG_HOME": str(home)}
    out = cli("config", "show", "-o", "toml", env=env)
    assert out.returncode == 0, out.stderr
    assert f"{found} (found by $XDG_CONFIG_HOME)" in out.stdout.splitlines()[0]
    assert "max_steps = 11" in out.stdout
    assert f"{found} (found by $XDG_CONFIG_HOME): ok" in cli("config", "check", env=env).stdout
    # The daemon started with no --config reads it, and `status` names it.
    daemons.append(d)
    d.env_extra = env
    log = open(d.log_path, "ab")  # noqa: SIM115 - owned by the process
    d.proc = subprocess.Popen([sys.executable, "-m", "turnkeeper", "serve"],
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=d.env())
    log.close()
    d.wait_ready()
    status = cli("status", env=env)  # finds the socket through the same file
    assert status.returncode == 0, status.stderr
    assert str(found) in status.stdout
    # Nowhere to look: the embedded defaults, and where they were looked for.
    empty = {"XDG_CONFIG_HOME": str(tmp_path / "none")}
    out = cli("config", "check", env=empty)
    assert "embedded defaults (no file at any of:" in out.stdout
    assert str(tmp_path / "none" / "turnkeeper" / "turnkeeper.toml") in out.stdout


def test_logs_follow_prints_new_lines_as_the_daemon_writes_them(start: Any) -> None:
    d = start()
    proc = subprocess.Popen([sys.executable, "-m", "turnkeeper", "--socket", str(d.socket),
                             "logs", "-f", "-n", "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        json.loads(proc.stdout.readline())  # the newest line so far
        turn = d.run("hello")  # written after `logs -f` started
        seen: list[dict[str, Any]] = []
        while not any(x.get("turn") == turn["id"] and x.get("event") == "turn.finished"
                      for x in seen):
            seen.append(json.loads(proc.stdout.readline()))
        assert any(x.get("event") == "turn.queued" for x in seen)
        assert proc.poll() is None  # still following
    finally:
        proc.kill()
        proc.wait()


def _complete(script: Path, words: str, env: dict[str, str]) -> list[str]:
    """What bash offers for the last word of `words` (a trailing space: a new word)."""
    parts = words.split() + ([""] if words.endswith(" ") else [])
    probe = subprocess.run(
        ["bash", "-c", f"source {script}; COMP_WORDS=({shlex.join(parts)}); "
         f'COMP_CWORD={len(parts) - 1}; _turnkeeper; printf "%s\\n" "${{COMPREPLY[@]}}"'],
        capture_output=True, text=True, timeout=60, check=False, env=env)
    assert probe.returncode == 0, probe.stderr
    return probe.stdout.split()


def test_completion_offers_recent_turn_ids_in_bash_and_fish(start: Any, tmp_path: Path
                                                            ) -> None:
    import os

    d = start()
    ids = [d.run(f"turn {i}")["id"] for i in range(3)]
    script = tmp_path / "c.bash"
    script.write_text(cli("completion", "bash").stdout)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("TURNKEEPER_SOCKET", None)
    offered = _complete(script, f"turnkeeper --socket {d.socket} show ", env)
    assert set(ids) <= set(offered), offered
    assert _complete(script, f"turnkeeper --socket {d.socket} cancel {ids[0][:6]}",
                     env) == [i for i in reversed(ids) if i.startswith(ids[0][:6])]
    # Only where a turn's id goes: not after it, not for a command that takes none.
    assert not set(ids) & set(_complete(script, f"turnkeeper --socket {d.socket} steer "
                                                f"{ids[0]} ", env))
    assert not set(ids) & set(_complete(script, f"turnkeeper --socket {d.socket} status ",
                                        env))
    quiet = cli("turns", "--quiet", socket=d.socket).stdout.split()
    assert quiet == list(reversed(ids))
    fish = cli("completion", "fish")
    assert fish.returncode == 0, fish.stderr
    lines = fish.stdout.splitlines()
    assert "complete -c turnkeeper -n __fish_use_subcommand -a status -d 'daemon status'" \
        in lines
    id_line = next(line for line in lines if "turns --quiet" in line)
    for command in ("show", "wait", "follow", "cancel", "steer", "answer", "retry", "logs"):
        assert f" {command}" in id_line.split("-a")[0], command



def test_a_bad_save_then_a_reload_is_one_refusal(start: Any) -> None:
    d = start()
    text = d.config_path.read_text()
    new = d.config_path.with_suffix(".new")
    new.write_text(text + "\n[budget]\nmax_stpes = 9\n")
    new.replace(d.config_path)  # the watcher refuses it, and so does the reload
    assert cli("reload", socket=d.socket).returncode == 78
    assert cli("reload", socket=d.socket).returncode == 78
    assert d.get("/v1/status")[1]["reloads"]["failures"] == 1
    status = cli("status", socket=d.socket).stdout
    assert "0 done, 1 refused" in status, status
