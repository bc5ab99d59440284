"""Structured output: is a final answer the JSON its schema asks for, and what then.

A caller that wants a machine-readable answer gives a JSON Schema (`output_schema`, on
the submit or the agent). The provider is asked for it the way it can be (`mode_of`:
natively, through a forced answer tool, or in the system prompt), and whatever comes
back is checked here, never trusted: a provider's own enforcement may be partial (a
schema keyword it ignores, a server that ignored the request).

The rule of one answer (`check_output`): parse it, validate it, and either keep it
(`Valid`, the parsed value), send it back to the agent with what failed (`Retry`: one
user-role message naming the failing paths, counted in `output_attempts`), or stop the
turn `output.invalid` once `max_output_attempts` answers have failed (`Invalid`).

The schema itself is checked once, where it enters (`schema_problem`): against the
metaschema its `$schema` names, else draft 2020-12.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError, ValidationError

from turnkeeper.policy.outcome import Stop, StopCode

# How a provider is asked for structured output (`[[providers]] structured_output`).
MODES = ("auto", "native", "tool", "prompt")
# What `auto` means for each kind: the provider's own JSON Schema mechanism where it has
# one that takes any schema (OpenAI's `response_format` / `text.format`, Gemini's
# `responseJsonSchema`); Anthropic's native JSON outputs only run on its newest models
# and refuse many schemas, so a forced answer tool, which every tool-using model has,
# is its default. The offline scripted model reads no request: `prompt` costs nothing.
AUTO_MODE = {"openai": "native", "openai-responses": "native", "gemini": "native",
             "anthropic": "tool", "scripted": "prompt"}

# Errors listed to the agent at most, and the characters of each.
MAX_ERRORS = 8
MAX_ERROR_CHARS = 200

# A whole answer in one Markdown code fence (```json ... ``` or ``` ... ```).
_FENCE = re.compile(r"\A\s*```[A-Za-z0-9_-]*[ \t]*\n(?P<body>.*?)\n?[ \t]*```\s*\Z", re.S)


def mode_of(kind: str, configured: str) -> str:
    """The mode a provider of `kind` configured with `configured` uses."""
    if configured != "auto":
        return configured
    return AUTO_MODE.get(kind, "prompt")


def _validator_class(schema: Mapping[str, Any]) -> Any:
    return validators.validator_for(schema, default=Draft202012Validator)


def schema_problem(schema: object) -> str | None:
    """None when `schema` is a JSON Schema its metaschema accepts (the draft its
    `$schema` names, else 2020-12); else why not, in one line."""
    if not isinstance(schema, Mapping):
        return "must be a JSON Schema: a JSON object"
    schema_uri = schema.get("$schema")
    if schema_uri is not None and not isinstance(schema_uri, str):
        return "$schema: must be a string naming a JSON Schema draft"
    try:
        _validator_class(schema).check_schema(schema)
    except SchemaError as exc:
        where = _path(exc.absolute_path)
        return f"not a valid JSON Schema: {_short(exc.message)} (at {where})"
    return None


@dataclass(frozen=True, slots=True)
class Valid:
    """The answer is JSON that matches: `value` is it parsed; `attempts` answers have
    been checked in the turn, this one included."""

    value: Any
    attempts: int


@dataclass(frozen=True, slots=True)
class Retry:
    """The answer failed; the agent is told (`message`, a user-role message) and
    answers again. `attempts` answers have been checked, this one included."""

    message: str
    errors: tuple[str, ...]
    attempts: int


@dataclass(frozen=True, slots=True)
class Invalid:
    """The answer failed and no attempt is left: the turn stops `output.invalid`."""

    stop: Stop
    errors: tuple[str, ...]
    attempts: int


Checked = Valid | Retry | Invalid


def strip_fence(text: str) -> str:
    """The body of an answer written as one fenced code block, else the text as is."""
    m = _FENCE.match(text)
    return m.group("body") if m else text


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def check_output(text: str | None, schema: Mapping[str, Any], *, attempts: int,
                 max_attempts: int, fenced: bool = False) -> Checked:
    """The verdict on one final answer. `attempts`: answers already checked in the turn;
    `fenced`: accept an answer wrapped in a Markdown code fence (the `prompt` mode, where
    nothing but the instruction keeps the model from adding one)."""
    now = attempts + 1
    errors = answer_errors(text or "", schema, fenced=fenced)
    if isinstance(errors, Parsed):
        return Valid(errors.value, now)
    if now < max_attempts:
        return Retry(retry_message(errors, attempt=now, of=max_attempts), errors, now)
    first = errors[0] if errors else "invalid"
    return Invalid(Stop(StopCode.OUTPUT_INVALID,
                        f"the final answer did not match the output schema after "
                        f"{now} attempt(s): {first}", value=now, limit=max_attempts),
                   errors, now)


@dataclass(frozen=True, slots=True)
class Parsed:
    value: Any


def answer_errors(text: str, schema: Mapping[str, Any], *, fenced: bool = False
                  ) -> Parsed | tuple[str, ...]:
    """The answer parsed when it is JSON that validates, else what is wrong with it,
    one line per fault (the failing path first), most relevant first."""
    body = strip_fence(text) if fenced else text
    try:
        value = json.loads(body, parse_constant=_reject_constant)
    except ValueError as exc:
        return (f"the answer is not JSON: {_short(str(exc))}",)
    try:
        found = sorted(_validator_class(schema)(schema).iter_errors(value),
                       key=lambda e: (list(map(str, e.absolute_path)), e.message))
    except Exception as exc:
        return (f"the output schema could not be applied: {_short(str(exc))}",)
    if not found:
        return Parsed(value)
    return tuple(_error_line(e) for e in found[:MAX_ERRORS]) + (
        (f"... and {len(found) - MAX_ERRORS} more",) if len(found) > MAX_ERRORS else ())


def _error_line(e: ValidationError) -> str:
    return f"at {_path(e.absolute_path)}: {_short(e.message)}"


def retry_message(errors: tuple[str, ...], *, attempt: int, of: int) -> str:
    """What the agent reads after an answer that failed: why, concisely, and what to
    send instead."""
    lines = "\n".join(f"- {e}" for e in errors)
    return (f"Your final answer must be JSON that matches the output schema, and it does "
            f"not (attempt {attempt} of {of}):\n{lines}\n"
            "Answer again with only the corrected JSON.")


def _path(parts: Any) -> str:
    """A JSON path: `$`, `$.items[0].price`."""
    out = "$"
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _short(text: str) -> str:
    one = " ".join(text.split())
    return one if len(one) <= MAX_ERROR_CHARS else one[:MAX_ERROR_CHARS - 3] + "..."
