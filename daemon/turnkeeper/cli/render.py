"""What the `turnkeeper` commands print for people: turns, results, the daemon's status,
event lines and the limits report. Pure functions from the daemon's JSON to text."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False))


def fmt_time(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def fmt_seconds(seconds: float) -> str:
    """Active or waiting seconds for people: `2.5 ms`, `1.25 s`, `3 min 05 s`."""
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 60:
        return f"{seconds:.3g} s"
    return duration(seconds)


def fmt_measure(counter: str, value: Any) -> str:
    """A counter's value or limit as the unit it is in: an instant for the deadline, a
    span for a clock, dollars for a cost, a short number for anything else."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if counter == "deadline":
        return fmt_time(value)
    if counter.endswith("seconds"):
        return fmt_seconds(value)
    if counter == "cost_usd":
        return f"${value:.4g}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def fmt_field(key: str, value: Any) -> str:
    """An event's field in a line: instants (`*_at`) as times, floats shortened."""
    if key.endswith("_at") and isinstance(value, (int, float)) and value:
        return fmt_time(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value, ensure_ascii=False)


def summary(turn: dict[str, Any]) -> str:
    c, u = turn["counters"], turn["usage"]
    lines = [
        f"turn      {turn['id']}  (session {turn['session']})",
        f"state     {turn['state']}  policy v{turn['policy_version']}  provider "
        f"{turn.get('provider') or '-'}"
        + (f"  agent {turn['agent']}" if turn.get("agent") else ""),
        f"created   {fmt_time(turn['created_at'])}   updated {fmt_time(turn['updated_at'])}",
        f"counters  steps {c['steps']}  provider_attempts {c['provider_attempts']}  "
        f"fallback_hops {c['fallback_hops']}  restarts {c['restarts']}  "
        f"recovery_cycles {c['recovery_cycles']}",
        f"usage     tokens {u['total_tokens']} (in {u['input_tokens']}, out "
        f"{u['output_tokens']})  active {fmt_seconds(u['seconds'])}  cost "
        f"${u['cost_usd']:.4f}",
    ]
    if turn.get("next_attempt_at"):
        lines.append(f"next try  {fmt_time(turn['next_attempt_at'])}")
    if turn.get("question"):
        lines.append(f"question  {turn['question']}")
    for held in turn.get("pending_approvals") or ():
        args = json.dumps(held.get("arguments"), ensure_ascii=False, sort_keys=True)
        lines.append(f"approval  {held['tool']} {held['call_id']} {args[:200]}  (turnkeeper "
                     f"approve {turn['id']} {held['call_id']}, or deny)")
    result = turn.get("result")
    if result:
        lines.extend(result_lines(result))
    return "\n".join(lines)


def result_title(result: dict[str, Any]) -> str:
    """`partial: budget.steps`, but `blocked`, not `blocked: blocked`: the code is shown
    when it adds to the status (the terminal view and `show` say it the same way)."""
    code, status = str(result["stopped_because"]["code"]), str(result["status"])
    return status + (f": {code}" if code != status else "")


def result_message(result: dict[str, Any]) -> str:
    """The stop's message, or "" when it only repeats the code or the status."""
    sb = result["stopped_because"]
    message = str(sb.get("message") or "")
    return message if message not in (sb["code"], result["status"]) else ""


def result_lines(result: dict[str, Any]) -> list[str]:
    sb = result["stopped_because"]
    head = result_title(result)
    if sb.get("counter"):
        c = sb["counter"]
        head += (f"  ({c} = {fmt_measure(c, sb['value'])} of limit "
                 f"{fmt_measure(c, sb['limit'])})")
    message = result_message(result)
    if message:
        head += f"  {message}"
    lines = [f"result    {head}"]
    if result.get("answer"):
        lines.append("answer    " + str(result["answer"]).replace("\n", "\n          "))
    for item in result.get("partial") or []:
        lines.append(f"  done    {item}")
    for item in result.get("done") or []:
        lines.append(f"  plan    done: {item}")
    for item in result.get("open_issues") or []:
        lines.append(f"  open    {item}")
    return lines


def duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600:02d} h"


NO_CONFIG = ("embedded defaults (no config file: none given, none at "
             "$XDG_CONFIG_HOME/turnkeeper/turnkeeper.toml or /etc/turnkeeper/turnkeeper.toml)")


def status_lines(data: dict[str, Any]) -> list[str]:
    """`turnkeeper status` for people: one line per concern, problems in capitals."""
    return [line for concern in _STATUS_CONCERNS for line in concern(data)]


def _daemon_lines(data: dict[str, Any]) -> list[str]:
    return [f"state        {data['state']}  (turnkeeper {data['version']}, up "
            f"{duration(data['uptime_s'])})",
            f"policy       v{data['policy_version']}  {data['config_path'] or NO_CONFIG}"]


def _reload_lines(data: dict[str, Any]) -> list[str]:
    r = data.get("reloads") or {}
    same = f", {r['unchanged']} unchanged" if r.get("unchanged") else ""
    reloads = (f"{r.get('count', 0)} done{same}, {r.get('failures', 0)} refused; "
               if r else "")
    error = data.get("last_reload_error")
    lines = [f"reloads      {reloads}last "
             + ("FAILED (the running policy is kept):\n             "
                + str(error).replace("\n", "\n             ") if error else "ok")]
    if data.get("pending_restart"):
        lines.append(f"restart for  {', '.join(data['pending_restart'])} (changed, not "
                     "applied until a restart)")
    return lines


def _turn_lines(data: dict[str, Any]) -> list[str]:
    lines = ["turns        " + "  ".join(f"{k} {v}" for k, v in data["turns"].items())]
    if data.get("paused"):
        lines.append("intake       PAUSED: queued turns do not start until `turnkeeper "
                     "resume`")
    q = data.get("queue") or {}
    if q:
        fleet = data.get("fleet") or {}
        # In a fleet the bound is on the turns no node holds yet (read each second).
        depth, where = ((fleet["waiting"], " in the fleet") if "waiting" in fleet
                        else (q["depth"], ""))
        lines.append(f"queue        {depth} waiting{where} of {q['max']} allowed; at most "
                     f"{q['max_concurrent']} run at once")
    return lines


def _peer_lines(data: dict[str, Any]) -> list[str]:
    """The breakers, the peers that asked to wait, and the in-flight gates."""
    breakers = data.get("breakers") or {}
    lines = ["breakers     " + ("  ".join(
        f"{name} {state.upper() if state != 'closed' else state}"
        for name, state in breakers.items()) or "-")]
    waits = data.get("retry_after") or {}
    if waits:  # peers that asked, in a Retry-After, not to be called yet
        lines.append("retry-after  " + "  ".join(f"{name} {left:.1f} s"
                                                 for name, left in waits.items()))
    for name, gate in (data.get("in_flight") or {}).items():
        if gate.get("limit") is None:
            continue
        mode = "adaptive" if gate.get("adaptive") else "fixed"
        lines.append(f"in flight    {name} {gate['in_flight']} of {gate['limit']} ({mode}"
                     f", max {gate.get('max_in_flight')}), {gate.get('waiting', 0)} waiting,"
                     f" {gate.get('decreases', 0)} cuts")
    return lines


def _mcp_lines(data: dict[str, Any]) -> list[str]:
    lines = []
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


def _webhook_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    for name, hook in (data.get("webhooks") or {}).items():
        oldest = hook.get("oldest_pending_age_s")
        waiting = f" (oldest {duration(oldest)})" if oldest is not None else ""
        failed = hook.get("failed") or 0
        error = hook.get("last_error")
        lines.append(f"webhook      {name} {hook['pending']} pending{waiting}, "
                     f"{hook['in_flight']} on the wire, {hook['delivered']} delivered, "
                     + (f"{failed} FAILED" if failed else "0 failed")
                     + ("" if hook.get("configured", True) else " (no longer configured)")
                     + (f"; last error: {error}" if error else ""))
    return lines


def _agent_lines(data: dict[str, Any]) -> list[str]:
    return [f"agent        {name}: {agent['tools']} tools, model "
            f"{agent.get('model') or 'default'}, profile {agent.get('profile') or 'default'}"
            for name, agent in (data.get("agents") or {}).items()]


def _fleet_lines(data: dict[str, Any]) -> list[str]:
    fleet = data.get("fleet")
    return fleet_status_lines(fleet) if fleet else []


def _trouble_lines(data: dict[str, Any]) -> list[str]:
    """A store that cannot be written, an event loop too late to take more work."""
    lines = []
    store = data.get("store") or {}
    if store.get("writable") is False:
        lines.append(f"store        UNWRITABLE for {duration(store['failing_for_s'])}: "
                     f"{store.get('last_error')}; writes wait (exit 74 after "
                     f"{duration(store['fatal_after_s'])}), submits get 507")
    overload = data.get("overload") or {}
    if overload.get("state") == "shedding":
        lines.append(f"intake       OVERLOADED: the event loop lags {overload['lag_s']} s; "
                     f"new submits get 503 ({overload['refused']} so far)")
    return lines


# The concerns of `turnkeeper status`, in the order it prints them.
_STATUS_CONCERNS: tuple[Callable[[dict[str, Any]], list[str]], ...] = (
    _daemon_lines, _reload_lines, _turn_lines, _peer_lines, _mcp_lines, _webhook_lines,
    _agent_lines, _fleet_lines, _trouble_lines)


def fleet_status_lines(fleet: dict[str, Any]) -> list[str]:
    """The fleet part of `turnkeeper status`: this node and its leases, then every node
    as the daemon last read them (at its heartbeat's pace, not at each status)."""
    held = f"{fleet['held']} turn{'' if fleet['held'] == 1 else 's'}"
    lines = [f"fleet        node {fleet['node_id']}, holding {held} (lease "
             f"{fleet['lease_seconds']:g} s, renewed {fleet['lease_renewed_s_ago']:.1f} s "
             f"ago; {fleet['lost']} lost, {fleet['released']} handed back)"]
    nodes = fleet.get("nodes")
    if nodes is None:
        return [*lines, "nodes        not read yet"]
    up = sum(1 for n in nodes if n["alive"])
    lines.append(f"nodes        {up} up of {len(nodes)}, as read "
                 f"{fleet['nodes_read_s_ago']:.1f} s ago:")
    return lines + [" " * 13 + row for row in fleet_lines(fleet)]


def node_row(n: dict[str, Any], me: str) -> str:
    """One node of the fleet under NODES_HEADER; `me` (this daemon) is marked."""
    state = "stopped" if n["stopped_at"] else "up" if n["alive"] else "SILENT"
    mark = " *" if n["node_id"] == me else ""
    return (f"{n['node_id'] + mark:<24} {state:<8} {n['turns']:>5}  {n['pid']:>7}  "
            f"{n['host']}, heartbeat {n['heartbeat_age_s']:.1f} s ago")


NODES_HEADER = f"{'node':<24} {'state':<8} {'turns':>5}  {'pid':>7}  host, heartbeat"


def fleet_lines(data: dict[str, Any]) -> list[str]:
    """`turnkeeper fleet`: every node on the shared store, this one marked."""
    return [NODES_HEADER, *(node_row(n, data["node_id"]) for n in data["nodes"])]


def event_line(ev: dict[str, Any]) -> str | None:
    """One line for an event; None for streamed text, which is printed as it comes."""
    # Imported here: the catalogue (dataclasses) costs `turnkeeper status` milliseconds.
    from turnkeeper.event_types import ENVELOPE, ModelDelta, TurnFinished, parse

    body = parse(ev)
    if isinstance(body, ModelDelta):
        return None
    if isinstance(body, TurnFinished):
        return "finished  " + "\n          ".join(result_lines(body.result))
    data = {k: v for k, v in ev.items() if k not in ENVELOPE}
    detail = " ".join(f"{k}={fmt_field(k, v)}" for k, v in data.items())
    return f"{time.strftime('%H:%M:%S', time.localtime(ev['ts']))} {ev['type']:<22} {detail}"


LOG_HEAD = ("timestamp", "level", "event")


def log_line(line: dict[str, Any]) -> str:
    """One daemon log line for a terminal: time, level, event, then its fields."""
    ts = str(line.get("timestamp", ""))[11:23]  # HH:MM:SS.mmm of the ISO time
    rest = " ".join(f"{k}={fmt_field(k, v)}" for k, v in line.items() if k not in LOG_HEAD)
    return f"{ts} {line.get('level', '')!s:<7} {line.get('event', '')} {rest}".rstrip()


TURNS_HEADER = f"{'ID':<18}  {'STATE':<10} {'STOPPED BECAUSE':<22} {'STEPS':<5} MESSAGE"


def turn_row(t: dict[str, Any]) -> str:
    """One line of `turnkeeper turns`, under TURNS_HEADER."""
    code = (t.get("result") or {}).get("stopped_because", {}).get("code", "-")
    return (f"{t['id']:<18}  {t['state']:<10} {code:<22} {t['counters']['steps']:<5} "
            f"{t['message'][:50]!r}")


def limits_lines(data: dict[str, Any]) -> list[str]:
    """`turnkeeper limits report`: per profile, the measured percentiles against each
    limit, and what each limit stopped or would have stopped."""
    lines = [f"{data['turns']} finished turns; suggested limit = {data['factor']:g} x p95"]

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.6g}"

    for prof in data["profiles"]:
        lines.append(f"\nprofile {prof['profile']}: {prof['completed_turns']} completed of "
                     f"{prof['finished_turns']} finished")
        lines.append(f"  {'':<9}{'p50':>10}{'p95':>10}{'max':>10}{'limit':>10}"
                     f"{'suggest':>10}   stopped / would have stopped")
        for dim, d in prof["dimensions"].items():
            stops = ", ".join(f"{k} {v}" for k, v in d["stopped"].items()) or "0"
            would = ", ".join(f"{k} {v}" for k, v in d["would_have_stopped"].items()) or "0"
            lines.append(f"  {dim:<9}{fmt(d['p50']):>10}{fmt(d['p95']):>10}"
                         f"{fmt(d['max']):>10}{fmt(d['limit']):>10}{fmt(d['suggested']):>10}"
                         f"   {stops} / {would}")
        for code, counts in prof.get("rules", {}).items():
            stops = ", ".join(f"{k} {v}" for k, v in counts["stopped"].items()) or "0"
            would = ", ".join(f"{k} {v}" for k, v in counts["would_have_stopped"].items())
            lines.append(f"  rule {code:<24} stopped {stops}; would have stopped "
                         f"{would or '0'}")
        extended = prof.get("extended_turns") or {}
        if extended:
            lines.append("  extended by progress: " + ", ".join(
                f"{k} {v}" for k, v in extended.items()))
    if data.get("toml"):
        lines.append("\n# paste into the config:\n" + data["toml"])
    return lines
