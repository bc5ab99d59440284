"""The `turnkeeper` command (SPEC 11).

Client commands import only the standard library and the stdlib socket client, so they
start fast; `serve` and `config` import the daemon side lazily.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlencode

from turnkeeper.control.client import Client, ClientError
from turnkeeper.paths import client_socket_path

EX_USAGE = 64
EX_UNAVAILABLE = 69
EX_CONFIG = 78
EX_FAIL = 1

# Exit status of `submit --wait` / `follow` by the turn's final status.
STATUS_EXIT = {"completed": 0, "blocked": 3, "partial": 4, "failed": 5, "cancelled": 6}


def _common(*, top: bool) -> argparse.ArgumentParser:
    """The options every command takes, before or after the command name. On the
    subcommands their defaults are suppressed so they do not undo a value given first."""
    common = argparse.ArgumentParser(add_help=False)
    kw: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    common.add_argument("--socket", help="control socket (default: $TURNKEEPER_SOCKET, "
                        "the config's daemon.socket, or the per-user default)", **kw)
    common.add_argument("--json", action="store_true", help="print raw JSON", **kw)
    common.add_argument("--config", help="config file (for serve, config, and to find "
                        "the socket)", **kw)
    return common


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="turnkeeper", parents=[_common(top=True)],
                                description="Host LLM agent turns that stay alive, bounded "
                                "and honest.")
    common = _common(top=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("serve", parents=[common], help="run the daemon")
    s = sub.add_parser("submit", parents=[common], help="submit a turn")
    s.add_argument("message")
    s.add_argument("--session")
    s.add_argument("--max-tokens", type=int)
    s.add_argument("--max-seconds", type=float)
    s.add_argument("--max-steps", type=int)
    s.add_argument("--max-cost-usd", type=float)
    s.add_argument("--deadline", help="absolute deadline: epoch seconds or ISO 8601 time")
    s.add_argument("--profile", help="a budget profile of the policy ([budget.profiles.NAME])")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--wait", action="store_true", help="wait for the result")
    g.add_argument("--follow", action="store_true", help="show the turn live")
    sub.add_parser("status", parents=[common], help="daemon status")
    t = sub.add_parser("turns", parents=[common], help="list turns")
    t.add_argument("--state")
    t.add_argument("--session")
    t.add_argument("--limit", type=int, default=50)
    for name, help_ in (("show", "show one turn"), ("follow", "follow a turn live"),
                        ("cancel", "cancel a turn")):
        c = sub.add_parser(name, parents=[common], help=help_)
        c.add_argument("id")
    st = sub.add_parser("steer", parents=[common], help="add a message to a running turn")
    st.add_argument("id")
    st.add_argument("text")
    st.add_argument("--redirect", action="store_true",
                    help="cut the in-flight model call and restart the step with it")
    a = sub.add_parser("answer", parents=[common], help="answer a clarify question")
    a.add_argument("id")
    a.add_argument("text")
    sub.add_parser("events", parents=[common], help="print every event as it happens")
    sub.add_parser("reload", parents=[common], help="reload the config (waits for the "
                   "outcome; non-zero exit when invalid)")
    cfg = sub.add_parser("config", parents=[common], help="check or show the config")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    chk = cfg_sub.add_parser("check", parents=[common], help="validate without running")
    chk.add_argument("path", nargs="?")
    cfg_sub.add_parser("show", parents=[common], help="effective config, secrets redacted")
    dl = sub.add_parser("dead-letters", parents=[common], help="list or replay dead letters")
    dl.add_argument("action", nargs="?", choices=["replay"])
    dl.add_argument("id", nargs="?")
    lim = sub.add_parser("limits", parents=[common], help="limits measured from finished turns")
    lim_sub = lim.add_subparsers(dest="limits_command", required=True, metavar="ACTION")
    rep = lim_sub.add_parser("report", parents=[common],
                             help="percentiles of completed turns, suggested limits, and what "
                             "each limit stopped or would have stopped")
    rep.add_argument("--profile")
    rep.add_argument("--since", help="only turns finished in this window: 90s, 30m, 24h, 7d")
    rep.add_argument("--factor", type=float, default=2.5,
                     help="suggested limit = factor x p95 (default 2.5)")
    return p


def parse_duration(text: str) -> float:
    """`90`, `90s`, `30m`, `24h`, `7d` -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    scale = units.get(text[-1:], 0)
    number = text[:-1] if scale else text
    try:
        value = float(number) * (scale or 1)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (e.g. 90s, 30m, 24h, 7d)") from None
    if value < 0:
        raise ValueError("a duration cannot be negative")
    return value


def _limits_report(client: Client, args: argparse.Namespace) -> int:
    query: dict[str, Any] = {"factor": args.factor}
    if args.profile:
        query["profile"] = args.profile
    if args.since:
        try:
            query["since"] = parse_duration(args.since)
        except ValueError as exc:
            print(f"turnkeeper: --since: {exc}", file=sys.stderr)
            return EX_USAGE
    status, data = client.request("GET", "/v1/limits/report?" + urlencode(query))
    if status != 200:
        return _fail(status, data)
    if args.json:
        _print_json(data)
        return 0
    print(f"{data['turns']} finished turns; suggested limit = {data['factor']:g} x p95")
    for prof in data["profiles"]:
        print(f"\nprofile {prof['profile']}: {prof['completed_turns']} completed of "
              f"{prof['finished_turns']} finished")
        print(f"  {'':<9}{'p50':>10}{'p95':>10}{'max':>10}{'limit':>10}{'suggest':>10}"
              "   stopped / would have stopped")
        for dim, d in prof["dimensions"].items():
            def fmt(v: float | None) -> str:
                return "-" if v is None else f"{v:.6g}"
            stops = ", ".join(f"{k} {v}" for k, v in d["stopped"].items()) or "0"
            would = ", ".join(f"{k} {v}" for k, v in d["would_have_stopped"].items()) or "0"
            print(f"  {dim:<9}{fmt(d['p50']):>10}{fmt(d['p95']):>10}{fmt(d['max']):>10}"
                  f"{fmt(d['limit']):>10}{fmt(d['suggested']):>10}   {stops} / {would}")
        for code, counts in prof.get("rules", {}).items():
            stops = ", ".join(f"{k} {v}" for k, v in counts["stopped"].items()) or "0"
            would = ", ".join(f"{k} {v}" for k, v in counts["would_have_stopped"].items())
            print(f"  rule {code:<24} stopped {stops}; would have stopped {would or '0'}")
    if data.get("toml"):
        print("\n# paste into the config:\n" + data["toml"])
    return 0


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False))


def _fail(status: int, data: Any) -> int:
    msg = data.get("error") if isinstance(data, dict) else data
    print(f"turnkeeper: HTTP {status}: {msg}", file=sys.stderr)
    return EX_FAIL


def _fmt_time(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def _summary(turn: dict[str, Any]) -> str:
    c, u = turn["counters"], turn["usage"]
    lines = [
        f"turn      {turn['id']}  (session {turn['session']})",
        f"state     {turn['state']}  policy v{turn['policy_version']}  provider "
        f"{turn.get('provider') or '-'}",
        f"created   {_fmt_time(turn['created_at'])}   updated {_fmt_time(turn['updated_at'])}",
        f"counters  steps {c['steps']}  provider_attempts {c['provider_attempts']}  "
        f"fallback_hops {c['fallback_hops']}  restarts {c['restarts']}  "
        f"recovery_cycles {c['recovery_cycles']}",
        f"usage     tokens {u['total_tokens']} (in {u['input_tokens']}, out "
        f"{u['output_tokens']})  active {u['seconds']:.2f} s  cost ${u['cost_usd']:.4f}",
    ]
    if turn.get("next_attempt_at"):
        lines.append(f"next try  {_fmt_time(turn['next_attempt_at'])}")
    if turn.get("question"):
        lines.append(f"question  {turn['question']}")
    result = turn.get("result")
    if result:
        lines.extend(_result_lines(result))
    return "\n".join(lines)


def _result_lines(result: dict[str, Any]) -> list[str]:
    sb = result["stopped_because"]
    lines = [f"result    {result['status']}: {sb['code']}"
             + (f"  ({sb['counter']} = {sb['value']} of limit {sb['limit']})"
                if sb.get("counter") else "")
             + f"  {sb['message']}"]
    if result.get("answer"):
        lines.append("answer    " + str(result["answer"]).replace("\n", "\n          "))
    for item in result.get("partial") or []:
        lines.append(f"  done    {item}")
    for item in result.get("open_issues") or []:
        lines.append(f"  open    {item}")
    return lines


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600:02d} h"


def _status_lines(data: dict[str, Any]) -> list[str]:
    """`turnkeeper status` for people: one line per concern, problems in capitals."""
    t, q, r = data["turns"], data.get("queue") or {}, data.get("reloads") or {}
    lines = [f"state        {data['state']}  (turnkeeper {data['version']}, up "
             f"{_duration(data['uptime_s'])})",
             f"policy       v{data['policy_version']}  "
             f"{data['config_path'] or 'embedded defaults'}"]
    reloads = f"{r.get('count', 0)} done, {r.get('failures', 0)} refused; " if r else ""
    error = data.get("last_reload_error")
    lines.append(f"reloads      {reloads}last "
                 + ("FAILED (the running policy is kept):\n             "
                    + str(error).replace("\n", "\n             ") if error else "ok"))
    if data.get("pending_restart"):
        lines.append(f"restart for  {', '.join(data['pending_restart'])} (changed, not "
                     "applied until a restart)")
    lines.append("turns        " + "  ".join(f"{k} {v}" for k, v in t.items()))
    if q:
        lines.append(f"queue        {q['depth']} waiting of {q['max']} allowed; at most "
                     f"{q['max_concurrent']} run at once")
    breakers = data.get("breakers") or {}
    lines.append("breakers     " + ("  ".join(
        f"{name} {state.upper() if state != 'closed' else state}"
        for name, state in breakers.items()) or "-"))
    for name, srv in (data.get("mcp_servers") or {}).items():
        restarts = f"{srv['restarts']} restart{'s' if srv['restarts'] != 1 else ''}"
        if srv["state"] == "up":
            lines.append(f"mcp server   {name} up ({srv['transport']}), "
                         f"{len(srv['tools'])} tools, {restarts}")
            continue
        nxt = srv.get("next_restart_at")
        wait = f"; next start in {max(0.0, nxt - time.time()):.1f} s" if nxt else ""
        lines.append(f"mcp server   {name} {srv['state'].upper()} ({srv['transport']}): "
                     f"{srv.get('last_error') or '-'}{wait}; {restarts}")
    return lines


def _event_line(ev: dict[str, Any]) -> str | None:
    kind = ev["type"]
    data = {k: v for k, v in ev.items() if k not in ("seq", "ts", "turn", "type")}
    if kind == "model.delta":
        return None
    if kind == "turn.finished":
        return "finished  " + "\n          ".join(_result_lines(data["result"]))
    detail = " ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in data.items())
    return f"{time.strftime('%H:%M:%S', time.localtime(ev['ts']))} {kind:<22} {detail}"


def _follow(client: Client, turn_id: str, as_json: bool) -> int:
    if not as_json and sys.stdout.isatty():
        from turnkeeper.follow import follow_live  # rich: imported only here

        result = follow_live(client, turn_id, _event_line)
        if result is None:
            print("turnkeeper: the event stream ended before the turn finished",
                  file=sys.stderr)
            return EX_UNAVAILABLE
        return STATUS_EXIT.get(result["status"], EX_FAIL)
    final: dict[str, Any] | None = None
    streaming = False
    for ev in client.stream(f"/v1/turns/{quote(turn_id)}/events"):
        if as_json:
            print(json.dumps(ev, ensure_ascii=False), flush=True)
        elif ev["type"] == "model.delta":
            sys.stdout.write(ev.get("text", ""))
            streaming = True
            sys.stdout.flush()
        else:
            if streaming:
                sys.stdout.write("\n")
                streaming = False
            line = _event_line(ev)
            if line:
                print(line, flush=True)
        if ev["type"] == "turn.finished":
            final = ev["result"]
    if final is None:
        print("turnkeeper: the event stream ended before the turn finished", file=sys.stderr)
        return EX_UNAVAILABLE
    return STATUS_EXIT.get(final["status"], EX_FAIL)


def _config_command(args: argparse.Namespace) -> int:
    from turnkeeper.config import ConfigError, Policy, config_path_from_env, load_config
    from turnkeeper.runtime import Runtime

    path = getattr(args, "path", None) or config_path_from_env(args.config)
    try:
        config, digest = load_config(path)
        Runtime.build(Policy(version=0, config=config, source_path=path, content_hash=digest))
    except ConfigError as exc:
        print(f"turnkeeper: {exc}", file=sys.stderr)
        return EX_CONFIG
    if args.config_command == "check":
        if args.json:
            _print_json({"ok": True, "path": path})
        else:
            print(f"{path or 'embedded defaults'}: ok")
        return 0
    _print_json(config.redacted())
    return 0


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
        try:
            body["deadline"] = float(args.deadline)
        except ValueError:
            body["deadline"] = args.deadline
    if args.profile:
        body["profile"] = args.profile
    return body


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        from turnkeeper.daemon import serve
        return serve(args.config)
    if args.command == "config":
        return _config_command(args)
    client = Client(client_socket_path(args.socket, args.config))
    try:
        return _run(client, args)
    except ClientError as exc:
        print(f"turnkeeper: {exc}", file=sys.stderr)
        return EX_UNAVAILABLE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(client: Client, args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "status":
        status, data = client.request("GET", "/v1/status")
        if status != 200:
            return _fail(status, data)
        if args.json:
            _print_json(data)
        else:
            print("\n".join(_status_lines(data)))
        return 0
    if cmd == "submit":
        status, data = client.request("POST", "/v1/turns", _submit_body(args))
        if status != 202:
            return _fail(status, data)
        turn = data["turn"]
        if args.follow:
            if not args.json:
                print(f"turn {turn['id']} queued")
            return _follow(client, turn["id"], args.json)
        if args.wait:
            while True:
                status, data = client.request("GET", f"/v1/turns/{turn['id']}?wait=60",
                                              timeout=90)
                if status != 200:
                    return _fail(status, data)
                turn = data["turn"]
                if turn.get("result"):
                    break
            if args.json:
                _print_json(turn)
            else:
                print(_summary(turn))
            return STATUS_EXIT.get(turn["result"]["status"], EX_FAIL)
        if args.json:
            _print_json(turn)
        else:
            print(turn["id"])
        return 0
    if cmd == "turns":
        q = {k: v for k, v in (("state", args.state), ("session", args.session),
                               ("limit", args.limit)) if v}
        status, data = client.request("GET", "/v1/turns?" + urlencode(q))
        if status != 200:
            return _fail(status, data)
        if args.json:
            _print_json(data)
        else:
            for t in data["turns"]:
                code = (t.get("result") or {}).get("stopped_because", {}).get("code", "")
                print(f"{t['id']}  {t['state']:<10} {code:<22} steps {t['counters']['steps']:<3}"
                      f" {t['message'][:50]!r}")
        return 0
    if cmd == "show":
        status, data = client.request("GET", f"/v1/turns/{quote(args.id)}")
        if status != 200:
            return _fail(status, data)
        if args.json:
            _print_json(data["turn"])
        else:
            print(_summary(data["turn"]))
        return 0
    if cmd == "follow":
        return _follow(client, args.id, args.json)
    if cmd in ("steer", "answer"):
        body = {"kind": cmd, "text": args.text}
        if cmd == "steer" and args.redirect:
            body["redirect"] = True
        status, data = client.request("POST", f"/v1/turns/{quote(args.id)}/messages", body)
        if status != 202:
            return _fail(status, data)
        if args.json:
            _print_json(data)
        return 0
    if cmd == "cancel":
        status, data = client.request("POST", f"/v1/turns/{quote(args.id)}/cancel")
        if status != 202:
            return _fail(status, data)
        if args.json:
            _print_json(data)
        else:
            print(f"{args.id}: {data['state']}")
        return 0
    if cmd == "events":
        for ev in client.stream("/v1/events"):
            if args.json:
                print(json.dumps(ev, ensure_ascii=False), flush=True)
            else:
                line = _event_line(ev)
                if line:
                    print((ev.get("turn") or "daemon") + " " + line, flush=True)
        return 0
    if cmd == "reload":
        # No timeout of our own: a reload drains turns for up to daemon.drain_timeout and
        # more; as ExecReload= it is bounded by the unit's timeout instead.
        status, data = Client(client.path, timeout=None).request("POST", "/v1/reload")
        if status != 200:
            print(f"turnkeeper: reload failed: {data.get('error') if data else status}",
                  file=sys.stderr)
            return {422: EX_CONFIG, 503: EX_UNAVAILABLE}.get(status, EX_FAIL)
        if args.json:
            _print_json(data)
        else:
            print(f"reloaded: policy v{data['policy_version']}"
                  + (f" (pending restart: {', '.join(data['pending_restart'])})"
                     if data.get("pending_restart") else ""))
        return 0
    if cmd == "limits":
        return _limits_report(client, args)
    if cmd == "dead-letters":
        if args.action == "replay":
            if not args.id:
                print("turnkeeper: dead-letters replay needs an ID", file=sys.stderr)
                return EX_USAGE
            status, data = client.request("POST",
                                          f"/v1/dead-letters/{quote(args.id)}/replay")
            if status != 202:
                return _fail(status, data)
            print(data["turn"]["id"] if not args.json else json.dumps(data))
            return 0
        status, data = client.request("GET", "/v1/dead-letters")
        if status != 200:
            return _fail(status, data)
        if args.json:
            _print_json(data)
        else:
            for d in data["dead_letters"]:
                sb = d.get("stopped_because") or {}
                print(f"{d['id']}  {sb.get('code', '-'):<20} {d.get('last_error') or '-'}"
                      + (f"  (replayed as {d['replayed_by']})" if d.get("replayed_by") else ""))
        return 0
    raise AssertionError(f"unhandled command {cmd}")
