"""A tool call's arguments, checked before anything is sent.

Argument problems are the model's failures and are classified deterministic before any
request is made: malformed JSON, a schema violation (an unknown tool is the caller's to
answer). The built-ins' arguments are checked like any tool's: a malformed
report_blocked is the model's mistake to correct, not a reason to end the turn with raw
text. A schema plain enough is checked without jsonschema first (`plain_schema.py`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from turnkeeper.config import ConfigError, ToolConfig
from turnkeeper.messages import ToolSpec
from turnkeeper.policy.classify import CallFailure
from turnkeeper.tools.plain_schema import NEVER, plain_check


@dataclass(frozen=True, slots=True)
class ArgumentProblem:
    failure: CallFailure


Checked = tuple[dict[str, Any], None] | tuple[None, ArgumentProblem]


# A run of digits as long as 2**63's: a number orjson may read otherwise than json does
# (an integer past 64 bits comes back a float).
_LONG_NUMBER = re.compile(r"[0-9]{19}")


def parse_arguments(name: str, arguments: str) -> Checked:
    """A call's arguments as the JSON object they must be, whatever tool `name` is
    (none at all, for a call the journal answers after its tool went). Read by orjson
    (an eighth of json's cost) where it reads them as json does: not with a long number
    in them, and not what it refuses (NaN, a lone surrogate, 1e400: json reads those, or
    raises its own error)."""
    try:
        if not arguments.strip():
            args: Any = {}
        elif _LONG_NUMBER.search(arguments) is None:
            try:
                args = orjson.loads(arguments)
            except orjson.JSONDecodeError:  # json's word, and its error, on the rest
                args = json.loads(arguments)
        else:
            args = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return None, ArgumentProblem(CallFailure(
            exception=("MalformedArguments",),
            message=f"arguments of {name} are not valid JSON: {exc.msg} at {exc.pos}"))
    if not isinstance(args, dict):
        return None, ArgumentProblem(CallFailure(
            exception=("MalformedArguments",),
            message=f"arguments of {name} must be a JSON object"))
    return args, None


class ArgumentChecker:
    """The schemas of the built-ins and the configured tools, each checked once (a bad
    one is a ConfigError naming the tool), and the checks of a call's arguments."""

    def __init__(self, builtins: Iterable[ToolSpec], tools: Iterable[ToolConfig]) -> None:
        self._validators: dict[str, Draft202012Validator] = {}
        # The tools whose schema is plain enough to check without jsonschema (most are):
        # arguments that pass it are valid; any others go to the full validator, which
        # also words the error.
        self._plain: dict[str, Callable[[Any], bool]] = {}
        self._mcp_plain: dict[str, tuple[Draft202012Validator, Callable[[Any], bool]]] = {}
        configured = tuple(tools)
        for t in configured:
            try:
                Draft202012Validator.check_schema(t.parameters)
            except SchemaError as exc:
                raise ConfigError(f"tools.{t.name}.parameters: not a valid JSON schema: "
                                  f"{exc.message}") from None
        for name, schema in (*((b.name, b.parameters) for b in builtins),
                             *((t.name, t.parameters) for t in configured)):
            self._validators[name] = Draft202012Validator(schema)
            check = plain_check(schema)
            if check is not None:
                self._plain[name] = check

    def check(self, name: str, arguments: str,
              mcp_validator: Callable[[str], Draft202012Validator | None]) -> Checked:
        """Parse and validate `arguments` of tool `name`; `mcp_validator` answers the
        schema of an MCP tool (None: not one, or one that announced none)."""
        args, problem = parse_arguments(name, arguments)
        if problem is not None:
            return None, problem
        assert args is not None
        plain = self._plain.get(name)
        if plain is not None and plain(args):
            return args, None
        validator = self._validators.get(name)
        if validator is None:
            validator = mcp_validator(name)
            if validator is not None and self._mcp_check(name, validator)(args):
                return args, None
        if validator is not None:
            errors = sorted(validator.iter_errors(args), key=lambda e: list(e.path))
            if errors:
                e = errors[0]
                where = "/".join(str(p) for p in e.path) or "(arguments)"
                return None, ArgumentProblem(CallFailure(
                    exception=("SchemaViolation",),
                    message=f"arguments of {name} violate its schema at {where}: "
                            f"{e.message}"))
        return args, None

    def _mcp_check(self, name: str, validator: Draft202012Validator
                   ) -> Callable[[Any], bool]:
        """The plain check of an MCP tool's schema, made once per schema it announces."""
        known = self._mcp_plain.get(name)
        if known is None or known[0] is not validator:
            known = self._mcp_plain[name] = (validator,
                                             plain_check(validator.schema) or NEVER)
        return known[1]
