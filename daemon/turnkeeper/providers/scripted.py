"""The offline `scripted` provider: deterministic replies, tool calls, delays and injected
failures read from a script file (TOML or JSON; format in docs/providers.md). The embedded
default config uses its built-in demo script.

Which reply a call gets is a function of the request alone: the scenario is the first
whose `match` regex is found in the turn's user message (none: an error naming the
message, unless the script has a single scenario), the step is the turn's step
number (the last step repeats when the turn runs past the script). Injected failures
are counted per (turn, step) on this provider, so "fail twice, then answer" replays the
same way after a restart.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from string import Template
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from turnkeeper.config import ConfigError, ProviderConfig
from turnkeeper.messages import ToolCall, dumps_arguments
from turnkeeper.policy.classify import CallFailure
from turnkeeper.providers.base import (
    DeltaSink,
    ModelReply,
    ModelRequest,
    ProviderError,
    Usage,
)

DEMO_SCRIPT = Path(__file__).resolve().parent.parent / "demo" / "demo.toml"
_MAX_TRACKED_CALLS = 100_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ScriptedFailure(_Strict):
    """One injected failure. `status` makes an HTTP-like failure; `exception` a transport
    one (e.g. "TimeoutError", "ConnectionResetError"); `context_overflow` a 400 whose
    body says the prompt is too long."""

    status: int | None = None
    exception: str | None = None
    error_type: str | None = None
    message: str = "injected failure"
    retry_after: float | None = None
    context_overflow: bool = False
    times: int = Field(default=1, ge=1)
    forever: bool = False


class ScriptedToolCall(_Strict):
    name: str
    arguments: Any = Field(default_factory=dict)


class ScriptedStep(_Strict):
    delay: float = Field(default=0.0, ge=0)
    # The delay holds the first `delay_attempts` attempts of the step (default: all): a
    # stall that a retry or a redirected restart gets past.
    delay_attempts: int | None = Field(default=None, ge=1)
    reply: str | None = None
    tool_calls: tuple[ScriptedToolCall, ...] = ()
    chunks: tuple[str, ...] = ()
    usage: dict[str, int] | None = None
    fail: tuple[ScriptedFailure, ...] = ()


class Scenario(_Strict):
    match: str | None = None
    # A regex searched in the latest user message (a steer, a daemon note): lets a script
    # react to what the user said mid-turn. With `match` too, both must be found.
    match_last_user: str | None = None
    steps: tuple[ScriptedStep, ...] = Field(min_length=1)


class Script(_Strict):
    scenarios: tuple[Scenario, ...] = Field(min_length=1)


def load_script(path: Path) -> Script:
    try:
        raw = path.read_text(encoding="utf-8")
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw)
        script = Script.model_validate(data)
        for sc in script.scenarios:
            for pattern in (sc.match, sc.match_last_user):
                if pattern is not None:
                    re.compile(pattern)
        return script
    except OSError as exc:
        raise ConfigError(f"script {path} cannot be read: {exc.strerror}") from None
    except (ValueError, tomllib.TOMLDecodeError, re.error) as exc:
        detail = exc
        if isinstance(exc, ValidationError):
            detail = "; ".join(".".join(map(str, e["loc"])) + ": " + e["msg"]
                               for e in exc.errors())  # type: ignore[assignment]
        raise ConfigError(f"script {path} is invalid: {detail}") from None


def _last(messages: Any, role: str) -> str:
    for m in reversed(messages):
        if m.role == role and m.content:
            return str(m.content)
    return ""


def _render(value: Any, env: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return Template(value).safe_substitute(env)
    if isinstance(value, list | tuple):
        return [_render(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _render(v, env) for k, v in value.items()}
    return value


def _estimate_tokens(messages: Any, system: str) -> int:
    chars = len(system) + sum(len(m.content or "") + sum(len(c.arguments) for c in m.tool_calls)
                              for m in messages)
    return max(1, chars // 4)


class ScriptedProvider:
    def __init__(self, cfg: ProviderConfig) -> None:
        self._cfg = cfg
        self._script = load_script(Path(cfg.script) if cfg.script else DEMO_SCRIPT)
        self._attempts: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.calls = 0

    def __repr__(self) -> str:
        return f"ScriptedProvider({self._cfg.name!r}, script={self._cfg.script or 'demo'!r})"

    @property
    def name(self) -> str:
        return self._cfg.name

    def _scenario(self, message: str, last_user: str) -> Scenario:
        """The first scenario that matches. A script of one scenario answers everything;
        in a script of several, a message that none matches is an error naming it (a
        deterministic failure: the script, not the call, is wrong), never a silent run of
        whichever scenario came last."""
        scenarios = self._script.scenarios
        for sc in scenarios:
            if (sc.match is None or re.search(sc.match, message)) and (
                    sc.match_last_user is None or re.search(sc.match_last_user, last_user)):
                return sc
        if len(scenarios) == 1:
            return scenarios[0]
        script = self._cfg.script or "the demo script"
        shown = message if len(message) <= 200 else message[:200] + "..."
        raise ProviderError(CallFailure(
            status=400, error_type="no_matching_scenario",
            message=f"no scenario of {script} matches the message {shown!r} (nor the "
                    f"latest user message {last_user[:200]!r}); add one, or one without "
                    "`match` last to answer everything else"))

    def _attempt(self, request: ModelRequest) -> int:
        key = (request.turn_id, request.step)
        n = self._attempts.pop(key, 0) + 1
        self._attempts[key] = n
        while len(self._attempts) > _MAX_TRACKED_CALLS:
            self._attempts.popitem(last=False)
        return n

    async def complete(self, request: ModelRequest, on_delta: DeltaSink | None = None
                       ) -> ModelReply:
        self.calls += 1
        message = str(request.metadata.get("turn_message", "")) or _last(request.messages,
                                                                         "user")
        last_user = _last(request.messages, "user")
        scenario = self._scenario(message, last_user)
        step = scenario.steps[min(max(request.step, 1), len(scenario.steps)) - 1]
        attempt = self._attempt(request)
        if step.delay and (step.delay_attempts is None or attempt <= step.delay_attempts):
            if step.delay > request.timeout_s:
                await anyio.sleep(request.timeout_s)
                raise ProviderError(CallFailure(exception=("StalledStream", "TimeoutError"),
                                                message="no reply within the timeout"))
            await anyio.sleep(step.delay)
        failure = self._failure_for(step, attempt)
        if failure is not None:
            raise ProviderError(failure)
        env = {"message": message, "step": str(request.step), "turn": request.turn_id,
               "last_user": last_user,
               "last_tool_result": _last(request.messages, "tool"),
               "provider": self._cfg.name,
               "max_output_tokens": str(request.max_output_tokens),
               "timeout": f"{request.timeout_s:.3f}"}
        calls = tuple(
            ToolCall(id=f"call_{request.step}_{i}", name=c.name,
                     arguments=c.arguments if isinstance(c.arguments, str)
                     else dumps_arguments(_render(c.arguments, env)))
            for i, c in enumerate(step.tool_calls))
        text = _render(step.reply, env) if step.reply is not None else None
        if text is None and not calls:
            text = ""
        if on_delta is not None and text:
            for chunk in (step.chunks or tuple(re.findall(r"\S+\s*", text))):
                await on_delta(_render(chunk, env))
        usage = Usage(**step.usage) if step.usage else Usage(
            input_tokens=_estimate_tokens(request.messages, request.system),
            output_tokens=max(1, (len(text or "") + sum(len(c.arguments) for c in calls)) // 4))
        return ModelReply(text=text, tool_calls=calls, usage=usage,
                          finish_reason="tool_calls" if calls else "stop",
                          model=self._cfg.model or "scripted")

    @staticmethod
    def _failure_for(step: ScriptedStep, attempt: int) -> CallFailure | None:
        seen = 0
        for f in step.fail:
            if f.forever or attempt <= seen + f.times:
                return CallFailure(
                    status=400 if f.context_overflow and f.status is None else f.status,
                    error_type=("context_length_exceeded" if f.context_overflow
                                else f.error_type),
                    exception=(f.exception,) if f.exception else (),
                    message=f.message, retry_after_s=f.retry_after,
                    context_overflow=f.context_overflow)
            seen += f.times
        return None

    async def aclose(self) -> None:
        return None

