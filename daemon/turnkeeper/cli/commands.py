"""The table of the `turnkeeper` commands: what `main` looks a command up in.

Each row carries what `turnkeeper --help` shows (a help line and a description), how its
arguments are declared, and the function that runs it; the functions live with their
kind: the turns in turns.py, approvals in approvals.py, the event and log streams in
streams.py, serve / config / status / wait / retry in operate.py, the daemon's upkeep in
upkeep.py. Adding a command is one function there and one row here, in the order
`--help`, the man page and shell completion list them. Client commands import only the
standard library and the socket client, so they start fast; `serve` and `config` import
the daemon side when they run.
"""

from __future__ import annotations

from turnkeeper.cli.approvals import APPROVAL_COMMANDS
from turnkeeper.cli.base import Command, no_args, turn_id_arg
from turnkeeper.cli.operate import (
    cmd_completion,
    cmd_config,
    cmd_fleet,
    cmd_pause,
    cmd_prune,
    cmd_resume,
    cmd_retry,
    cmd_serve,
    cmd_status,
    cmd_top,
    cmd_wait,
    completion_setup,
    config_setup,
    prune_setup,
    retry_setup,
    status_setup,
    top_setup,
)
from turnkeeper.cli.streams import cmd_events, cmd_follow, cmd_logs, events_setup, logs_setup
from turnkeeper.cli.turns import (
    answer_setup,
    cancel_setup,
    cmd_answer,
    cmd_cancel,
    cmd_show,
    cmd_steer,
    cmd_submit,
    cmd_turns,
    steer_setup,
    submit_setup,
    turns_setup,
)
from turnkeeper.cli.upkeep import (
    cmd_dead_letters,
    cmd_limits,
    cmd_reload,
    dead_letters_setup,
    limits_setup,
)

COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("serve", "run the daemon",
            "Run the daemon in the foreground until SIGTERM or SIGINT.",
            no_args, run_local=cmd_serve),
    Command("submit", "submit a turn",
            "Queue a turn; print its id, or wait for (or follow) its result.",
            submit_setup, cmd_submit),
    Command("status", "daemon status",
            "The daemon's state, policy, reloads, turns, queue, breakers, MCP servers and "
            "webhooks.",
            status_setup, cmd_status),
    Command("fleet", "the daemons sharing the store",
            "Every node on the shared PostgreSQL store: up, stopped or silent, the turns it "
            "holds, its pid and host, its last heartbeat (this daemon marked *).",
            no_args, cmd_fleet),
    Command("turns", "list turns", "List turns, newest first.", turns_setup, cmd_turns),
    Command("show", "show one turn", "A turn's state, counters, usage and result.",
            turn_id_arg, cmd_show),
    Command("follow", "follow a turn live",
            "Show a turn's events as they happen (a live view on a terminal) until it "
            "ends; the exit status is the turn's.", turn_id_arg, cmd_follow),
    Command("cancel", "cancel a turn",
            "Cancel a queued, running or parked turn. A side effect in flight finishes "
            "first unless --now.", cancel_setup, cmd_cancel),
    Command("steer", "add a message to a running turn",
            "Give a running turn a message it reads before its next step.",
            steer_setup, cmd_steer),
    Command("answer", "answer a clarify question",
            "Answer the question a waiting turn asked; it resumes with the answer.",
            answer_setup, cmd_answer),
    *APPROVAL_COMMANDS,
    Command("events", "print every event as it happens",
            "Every event of every turn and of the daemon, live, until interrupted; with "
            "--after, the stored ones after that seq first, so a consumer that "
            "reconnects loses nothing.", events_setup, cmd_events),
    Command("logs", "the daemon's recent log lines",
            "The daemon's recent log lines (the last 10,000 it keeps in memory), or one "
            "turn's; a turn older than that window is looked up in systemd's journal.",
            logs_setup, cmd_logs),
    Command("reload", "reload the config (waits for the outcome; non-zero exit when "
            "invalid)", "Re-read the config and apply it; an invalid one is refused and "
            "the running policy kept.", no_args, cmd_reload),
    Command("top", "every live turn, refreshed in place",
            "Every live turn on one screen (state, step, provider, budget use), refreshed "
            "until Ctrl-C; one snapshot when not on a terminal.", top_setup, cmd_top),
    Command("pause", "stop starting queued turns",
            "Hold the queue: no queued turn starts until `resume`. Submits are still "
            "accepted and queued; running and parked turns go on.", no_args, cmd_pause),
    Command("resume", "start queued turns again", "Let go of a `pause`: queued turns "
            "start again, in order.", no_args, cmd_resume),
    Command("wait", "wait for a turn's result",
            "Wait until a turn ends and print its result; the exit status is the turn's.",
            turn_id_arg, cmd_wait),
    Command("retry", "submit a finished turn's input again",
            "Submit a finished turn's message, budget, profile and session (when it named "
            "one) as a new turn; print its id, or wait for its result.",
            retry_setup, cmd_retry),
    Command("completion", "print a shell completion script",
            "Print a completion script for bash, zsh or fish, generated from this command "
            "table (a turn's id completes from the recent ones): eval \"$(turnkeeper "
            "completion bash)\"; turnkeeper completion fish | source.", completion_setup,
            run_local=cmd_completion),
    Command("config", "check or show the config",
            "Validate the config, or print the effective one; needs no daemon.",
            config_setup, run_local=cmd_config),
    Command("dead-letters", "list or replay dead letters",
            "List the turns that failed for good, or replay one from its last checkpoint.",
            dead_letters_setup, cmd_dead_letters),
    Command("prune", "delete old finished turns now",
            "Delete the turns that finished more than --older-than ago, with their "
            "events and journal (the daemon does it by itself at store.keep_finished); "
            "dead letters only with --dead-letters.", prune_setup, cmd_prune),
    Command("limits", "limits measured from finished turns",
            "What the finished turns used, against the limits.", limits_setup, cmd_limits),
)}
