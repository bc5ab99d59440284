"""The control API described as OpenAPI 3.1, served at `GET /v1/openapi.json` and kept in
the repository as docs/openapi.json (a test fails when the two differ; regenerate with
`python -m turnkeeper.control.openapi > docs/openapi.json`).

The request bodies are the JSON Schemas of the strict pydantic models the routes
validate with (`control/bodies.py`), so the description cannot promise a field the
daemon refuses or forget one it takes. The answers are described by hand below, as the
routes build them: the fields a client relies on, each object open to fields added
later.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from turnkeeper.control.bodies import (
    ApprovalBody,
    CancelBody,
    IntakeBody,
    MessageBody,
    PruneBody,
    SubmitBody,
)

REF = "#/components/schemas/{model}"
MAX_BATCH = 1000


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required)}


_NUM = {"type": "number"}
_INT = {"type": "integer"}
_STR = {"type": "string"}
_NULLABLE_STR = {"type": ["string", "null"]}

# The answers' shapes (see docs/control-api.md for every field).
ANSWERS: dict[str, Any] = {
    "Error": _obj({"error": _STR, "field": _STR, "index": _INT}, ("error",)),
    "StoppedBecause": _obj({"code": _STR, "counter": _NULLABLE_STR, "value": {},
                            "limit": {}, "message": _STR}, ("code",)),
    "Result": _obj({"status": {"enum": ["completed", "blocked", "partial", "failed",
                                        "cancelled"]},
                    "stopped_because": _ref("StoppedBecause"),
                    "answer": _NULLABLE_STR,
                    # The answer parsed, when the turn had an output schema it matched.
                    "output": {},
                    "partial": {"type": "array", "items": _STR},
                    "open_issues": {"type": "array", "items": _STR}},
                   ("status", "stopped_because")),
    "Turn": _obj({"id": _STR, "session": _STR, "state": _STR, "policy_version": _INT,
                  "created_at": _NUM, "updated_at": _NUM, "provider": _NULLABLE_STR,
                  "message": _STR, "seq": _INT, "traceparent": _STR,
                  "counters": {"type": "object", "additionalProperties": _INT},
                  "usage": {"type": "object", "additionalProperties": _NUM},
                  "result": {"oneOf": [_ref("Result"), {"type": "null"}]},
                  "output_schema": {"type": "object"}},
                 ("id", "session", "state")),
    "TurnAnswer": _obj({"turn": _ref("Turn")}, ("turn",)),
    "BatchAnswer": _obj({"results": {"type": "array", "items": _obj(
        {"status": _INT, "turn": _ref("Turn"), "error": _STR, "field": _STR},
        ("status",))}}, ("results",)),
    "Event": _obj({"seq": _INT, "ts": _NUM, "type": _STR, "turn": _NULLABLE_STR},
                  ("seq", "ts", "type")),
    "Object": {"type": "object"},
}

_ERRORS = {"400": "the request is invalid: `field` names what", "404": "no such turn",
           "409": "the turn cannot take this now", "413": "too large",
           "422": "refused as it stands: `field` names what",
           "503": "busy, starting or stopping: retry after `Retry-After` seconds",
           "507": "the state store cannot be written: nothing was taken"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _op(summary: str, ok: dict[str, tuple[str, str]], *, body: dict[str, Any] | None = None,
        errors: tuple[str, ...] = ("400",), query: tuple[tuple[str, str, str], ...] = (),
        ndjson: bool = False, headers: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for status, (schema, description) in ok.items():
        if ndjson:
            responses[status] = {"description": description, "content": {
                "application/x-ndjson": {"schema": _ref(schema)}}}
        else:
            responses[status] = _json(_ref(schema), description)
    for status in errors:
        responses[status] = _json(_ref("Error"), _ERRORS[status])
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    params = [{"name": n, "in": "query", "required": False, "description": d,
               "schema": {"type": t}} for n, t, d in query]
    params += [{"name": n, "in": "header", "required": False, "description": d,
                "schema": _STR} for n, d in headers]
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": body}}}
    return op


def _optional(body: dict[str, Any]) -> dict[str, Any]:
    return {"required": False, "content": {"application/json": {"schema": body}}}


def _id_param() -> list[dict[str, Any]]:
    return [{"name": "id", "in": "path", "required": True, "schema": _STR}]


def _paths() -> dict[str, Any]:
    paths = {**_turn_paths(), **_daemon_paths()}
    for path, ops in paths.items():
        if "{id}" in path:
            for op in ops.values():
                op["parameters"] = _id_param() + op.get("parameters", [])
    return paths


def _turn_paths() -> dict[str, Any]:
    """Submitting, reading, following, steering, cancelling and approving turns."""
    turn = ("TurnAnswer", "the turn")
    key = (("Idempotency-Key", "submit at most once: the same key and body answer the "
                               "turn it made (200)"),
           ("traceparent", "W3C trace context: the turn's spans and requests join the "
                           "caller's trace (a body's own `traceparent` wins)"))
    cancel = _op("cancel a turn", {"202": ("Object", "cancelling or cancelled")},
                 errors=("400", "404"))
    cancel["requestBody"] = _optional(_ref("CancelBody"))
    return {
        "/v1/turns": {
            "post": _op("submit a turn, or a batch of them (a list)", {
                "202": ("TurnAnswer", "queued (a batch: BatchAnswer)"),
                "200": ("TurnAnswer", "its Idempotency-Key made this turn before")},
                body={"oneOf": [_ref("SubmitBody"), {
                    "type": "array", "items": _ref("SubmitBody"), "minItems": 1,
                    "maxItems": MAX_BATCH}]},
                errors=("400", "413", "422", "503", "507"), headers=key),
            "get": _op("recent turns, newest first", {"200": ("Object", "`turns`, `next`")},
                       query=(("state", "string", "only this state"),
                              ("session", "string", "only this session"),
                              ("limit", "integer", "at most this many (100)"),
                              ("since", "number", "submitted in the last S seconds"),
                              ("before", "integer", "the next page: seq below this")))},
        "/v1/turns/{id}": {"get": _op("one turn", {"200": turn}, errors=("400", "404"),
                                      query=(("wait", "number",
                                              "answer once it ends or S seconds pass"),))},
        "/v1/turns/{id}/events": {"get": _op(
            "the turn's events so far, then live, ending with turn.finished",
            {"200": ("Event", "NDJSON, one event a line")}, errors=("404",), ndjson=True)},
        "/v1/turns/{id}/messages": {"post": _op(
            "steer a turn or answer its question", {"202": ("Object", "taken")},
            body=_ref("MessageBody"), errors=("400", "404", "409", "413"))},
        "/v1/turns/{id}/cancel": {"post": cancel},
        "/v1/turns/{id}/approvals": {"post": _op(
            "approve (arguments as asked, or edited) or deny a tool call the turn holds "
            "for approval", {"202": ("Object", "taken: `turn`, `call_id`, `decision`")},
            body=_ref("ApprovalBody"), errors=("400", "404", "409"))},
        "/v1/approvals": {"get": _op(
            "every tool call waiting for approval, oldest first",
            {"200": ("Object", "`approvals`: turn, call_id, tool, arguments, key, "
                               "requested_at")}, errors=())},
        "/v1/events": {"get": _op("every event as it happens", {
            "200": ("Event", "NDJSON, one event a line")}, ndjson=True,
            query=(("after", "integer", "the stored events after this seq first"),
                   ("turn", "string", "one turn's"),
                   ("type", "string", "these types: exact, or a prefix ending in a dot")))},
    }


def _daemon_paths() -> dict[str, Any]:
    """The daemon's state, its intake, reload, logs, fleet, dead letters and limits."""
    turn = ("TurnAnswer", "the turn")
    return {
        "/v1/status": {"get": _op("the daemon's state", {"200": ("Object", "status")},
                                  errors=())},
        "/v1/health": {"get": _op("ready, or degraded and why", {
            "200": ("Object", "ready"), "503": ("Object", "degraded: `problems` say why")},
            errors=())},
        "/v1/openapi.json": {"get": _op("this description", {
            "200": ("Object", "OpenAPI 3.1")}, errors=())},
        "/v1/intake": {"post": _op("pause or resume the start of queued turns",
                                   {"200": ("Object", "the queue")},
                                   body=_ref("IntakeBody"))},
        "/v1/prune": {"post": _op("delete finished turns older than a duration",
                                  {"200": ("Object", "how many went")},
                                  body=_ref("PruneBody"))},
        "/v1/logs": {"get": _op("recent log lines", {"200": ("Object", "`logs`")})},
        "/v1/reload": {"post": _op("reload the config now", {
            "200": ("Object", "the new policy"), "422": ("Object", "refused: invalid"),
            "503": ("Object", "the daemon is stopping")}, errors=())},
        "/v1/fleet": {"get": _op("the fleet's nodes", {"200": ("Object", "nodes")},
                                 errors=("409", "503"))},
        "/v1/dead-letters": {"get": _op("the dead-letter list", {
            "200": ("Object", "`dead_letters`")}, errors=())},
        "/v1/dead-letters/{id}/replay": {"post": _op(
            "resume a dead letter from its last checkpoint", {"202": turn},
            errors=("404", "409", "503", "507"))},
        "/v1/limits/report": {"get": _op("what finished turns used against their limits",
                                         {"200": ("Object", "the report")},
                                         query=(("since", "number", "the last S seconds"),
                                                ("factor", "number", "headroom (2.5)"),
                                                ("profile", "string", "one profile")))},
    }


def document() -> dict[str, Any]:
    bodies: list[type[BaseModel]] = [SubmitBody, MessageBody, ApprovalBody, CancelBody,
                                      IntakeBody, PruneBody]
    _, defs = models_json_schema([(m, "validation") for m in bodies], ref_template=REF)
    schemas = {**defs.get("$defs", {}), **ANSWERS}
    return {
        "openapi": "3.1.0",
        "info": {"title": "turnkeeper control API", "version": "1",
                 "description": "HTTP/1.1 and JSON over the daemon's Unix socket "
                                "(curl --unix-socket SOCK http://turnkeeper/v1/status)."},
        "servers": [{"url": "http://turnkeeper"}],
        "paths": _paths(),
        "components": {"schemas": dict(sorted(schemas.items()))},
    }


@functools.cache
def text() -> str:
    """The document as docs/openapi.json holds it (built once: it is the same for the
    life of the process)."""
    return json.dumps(document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(text(), end="")
