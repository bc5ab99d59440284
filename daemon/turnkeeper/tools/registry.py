"""The tools of one policy: specs to offer, argument checks, and one attempt of a call.

Argument problems are the model's failures and are classified deterministic before any
request is made: malformed JSON, an unknown tool, a schema violation. Retrying, breakers
and the journal live in the runner; a call here is one attempt.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from turnkeeper.config import ConfigError, ToolConfig
from turnkeeper.policy.classify import CallFailure, exception_names, retry_after_of
from turnkeeper.providers.base import ToolSpec
from turnkeeper.tools.builtin import BUILTIN_SPECS

MAX_RESULT_CHARS = 32_768


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """One attempt's outcome. `state` is the tool's own declared state value (a JSON
    object's top-level "state" key), used by loop detection."""

    content: str
    failure: CallFailure | None = None
    state: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def to_json(self) -> dict[str, Any]:
        return {"content": self.content, "state": self.state,
                "failure": self.failure.to_json() if self.failure else None}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ToolOutcome:
        f = d.get("failure")
        failure = None
        if f:
            failure = CallFailure(status=f.get("status"), error_type=f.get("error_type"),
                                  exception=tuple(f.get("exception") or ()),
                                  message=f.get("message", ""),
                                  retry_after_s=f.get("retry_after_s"))
        return cls(content=d.get("content", ""), failure=failure, state=d.get("state"))


@dataclass(frozen=True, slots=True)
class ArgumentProblem:
    failure: CallFailure


def _truncate(text: str) -> str:
    if len(text) <= MAX_RESULT_CHARS:
        return text
    return text[:MAX_RESULT_CHARS] + f"\n[truncated: {len(text)} characters in all]"


class ToolBox:
    def __init__(self, tools: tuple[ToolConfig, ...]) -> None:
        self._tools = {t.name: t for t in tools}
        self._validators: dict[str, Draft202012Validator] = {}
        for t in tools:
            try:
                Draft202012Validator.check_schema(t.parameters)
            except SchemaError as exc:
                raise ConfigError(f"tools.{t.name}.parameters: not a valid JSON schema: "
                                  f"{exc.message}") from None
            self._validators[t.name] = Draft202012Validator(t.parameters)
        self.specs: tuple[ToolSpec, ...] = BUILTIN_SPECS + tuple(
            ToolSpec(name=t.name, description=t.description or t.name,
                     parameters=t.parameters) for t in tools)
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"ToolBox({sorted(self._tools)})"

    def get(self, name: str) -> ToolConfig | None:
        return self._tools.get(name)

    def check_arguments(self, name: str, arguments: str
                        ) -> tuple[dict[str, Any], None] | tuple[None, ArgumentProblem]:
        """Parse and validate before anything is sent."""
        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return None, ArgumentProblem(CallFailure(
                exception=("MalformedArguments",),
                message=f"arguments of {name} are not valid JSON: {exc.msg} at {exc.pos}"))
        if not isinstance(args, dict):
            return None, ArgumentProblem(CallFailure(
                exception=("MalformedArguments",),
                message=f"arguments of {name} must be a JSON object"))
        validator = self._validators.get(name)
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

    async def call(self, name: str, args: dict[str, Any], *, idempotency_key: str,
                   timeout_s: float) -> ToolOutcome:
        tool = self._tools[name]
        if tool.kind == "echo":
            return ToolOutcome(content=json.dumps(args, ensure_ascii=False, sort_keys=True))
        return await self._http(tool, args, idempotency_key=idempotency_key,
                                timeout_s=timeout_s)

    async def _http(self, tool: ToolConfig, args: dict[str, Any], *, idempotency_key: str,
                    timeout_s: float) -> ToolOutcome:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=200), auto_decompress=True)
        headers = {**tool.resolved_headers(), "Idempotency-Key": idempotency_key,
                   "Accept": "application/json, text/plain;q=0.9"}
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(timeout_s, 10.0))
        kwargs: dict[str, Any] = {"headers": headers, "timeout": timeout}
        if tool.method in ("GET", "DELETE"):
            kwargs["params"] = {k: v if isinstance(v, str) else json.dumps(v)
                                for k, v in args.items()}
        else:
            kwargs["json"] = args
        try:
            async with self._session.request(tool.method, tool.url, **kwargs) as resp:
                text = await resp.text(errors="replace")
                status = resp.status
                resp_headers = dict(resp.headers)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return ToolOutcome(content="", failure=CallFailure(
                exception=exception_names(exc), message=str(exc) or type(exc).__name__))
        body: Any = None
        try:
            body = json.loads(text) if text else None
        except json.JSONDecodeError:
            body = None
        if status >= 400:
            err = body.get("error") if isinstance(body, dict) else None
            return ToolOutcome(content=_truncate(text), failure=CallFailure(
                status=status,
                error_type=str(err.get("type")) if isinstance(err, dict) and err.get("type")
                else None,
                message=_truncate(text)[:500],
                retry_after_s=retry_after_of(resp_headers, body, now_epoch=time.time())))
        state = body.get("state") if isinstance(body, dict) else None
        return ToolOutcome(content=_truncate(text),
                           state=None if state is None else json.dumps(state, sort_keys=True))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
