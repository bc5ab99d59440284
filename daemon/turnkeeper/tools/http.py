"""One attempt of a tool of kind http, and what its answer means for the side effect.

The point of this module is to be honest about whether the effect happened:
- nothing was sent (the connection was refused, the name did not resolve, the connect
  timed out): `failed`, the effect did not happen;
- the request went out and no answer came back (a timeout while waiting, a connection
  reset or closed after sending): for a non-idempotent tool, `unknown`: the server may
  have done it, so the model is told to verify, not to repeat;
- an answer came: `ok`, or `failed` with the server's words. A 2xx whose JSON body holds
  an error (a non-null top-level `error`, or the value at the tool's `error_field`) is a
  failure of class unknown: the server says something went wrong, not whether to retry;
- except an answer that does not tell: 408 or a 5xx other than 501 is what a gateway or
  proxy sends when the server behind it was slow or went away, whether or not it did
  the work. For a non-idempotent tool that is `unknown` too (`unknown_after_status`).

A cancel while the request is in flight cannot return an outcome from here (the task is
cancelled): the caller that cancels a non-idempotent call records it as unknown.

Redirects are not followed unless the tool says so (a POST silently replayed elsewhere
is a second effect); when followed, every hop must stay on the allowed hosts. A body
larger than `max_response_bytes` is not read further.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
from yarl import URL

from turnkeeper.config import ToolConfig
from turnkeeper.policy.classify import (
    CallFailure,
    exception_names,
    local_exhaustion,
    redirect_refused,
    retry_after_of,
)
from turnkeeper.policy.effects import unknown_after_status
from turnkeeper.tools.outcome import ToolOutcome, truncate

MAX_REDIRECTS = 10
_CHUNK = 65_536

# aiohttp errors raised before any byte of the request left: the effect did not happen.
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError,
             aiohttp.InvalidURL)


class _Refused(Exception):
    """A hop this tool may not take; carries the failure to report."""

    def __init__(self, failure: CallFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def allowed_hosts(tool: ToolConfig) -> frozenset[str]:
    """The hosts this tool may reach: its own list, else only the host of its url."""
    if tool.allowed_hosts:
        return frozenset(h.lower() for h in tool.allowed_hosts)
    return frozenset({(URL(tool.url).host or "").lower()})


def error_at(body: Any, pointer: str) -> Any:
    """The value at a JSON pointer ("" = the top-level "error"); None when absent."""
    if not pointer:
        return body.get("error") if isinstance(body, dict) else None
    node = body
    for raw in pointer.split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


async def call_http(session: aiohttp.ClientSession, tool: ToolConfig, args: dict[str, Any],
                    *, idempotency_key: str, timeout_s: float,
                    traceparent: str | None = None) -> ToolOutcome:
    headers = {**tool.resolved_headers(), "Idempotency-Key": idempotency_key,
               "Accept": "application/json, text/plain;q=0.9"}
    if traceparent is not None:
        headers["traceparent"] = traceparent
    timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(timeout_s, 10.0))
    kwargs: dict[str, Any] = {"headers": headers, "timeout": timeout,
                              "allow_redirects": False}
    if tool.method in ("GET", "DELETE"):
        kwargs["params"] = {k: v if isinstance(v, str) else json.dumps(v)
                            for k, v in args.items()}
    else:
        kwargs["json"] = args
    hosts = allowed_hosts(tool)
    method, url = tool.method, URL(tool.url)
    try:
        for _hop in range(MAX_REDIRECTS + 1):
            if (url.host or "").lower() not in hosts:
                raise _Refused(CallFailure(
                    exception=("HostNotAllowed",),
                    message=f"{tool.name}: host {url.host} is not in allowed_hosts"))
            async with session.request(method, url, **kwargs) as resp:
                status = resp.status
                if 300 <= status < 400 and "Location" in resp.headers:
                    target = url.join(URL(resp.headers["Location"]))
                    if not tool.follow_redirects:
                        return ToolOutcome(content="", failure=redirect_refused(
                            tool.name, status, str(target), "follow_redirects = false"))
                    if status in (301, 302, 303) and method not in ("GET", "DELETE"):
                        method = "GET"
                        kwargs.pop("json", None)
                    url = target
                    continue
                text = await _read_limited(resp, tool)
                resp_headers = dict(resp.headers)
                return _answer(tool, status, text, resp_headers)
        return ToolOutcome(content="", failure=CallFailure(
            exception=("TooManyRedirects",),
            message=f"{tool.name}: more than {MAX_REDIRECTS} redirects"))
    except _Refused as refused:
        return ToolOutcome(content="", failure=refused.failure)
    except _NOT_SENT as exc:
        return ToolOutcome(content="", failure=_failure_of(exc))
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return ToolOutcome(content="", failure=_failure_of(exc), unknown=not tool.idempotent)


def _failure_of(exc: BaseException) -> CallFailure:
    return CallFailure(exception=exception_names(exc), message=str(exc) or type(exc).__name__,
                       local=local_exhaustion(exc))


async def _read_limited(resp: aiohttp.ClientResponse, tool: ToolConfig) -> str:
    limit = tool.max_response_bytes
    if resp.content_length is not None and resp.content_length > limit:
        raise _Refused(_too_large(tool, f"{resp.content_length} bytes announced"))
    data = bytearray()
    async for chunk in resp.content.iter_chunked(_CHUNK):
        data += chunk
        if len(data) > limit:
            raise _Refused(_too_large(tool, f"more than {limit} bytes"))
    return data.decode(resp.get_encoding() if resp.charset else "utf-8", errors="replace")


def _too_large(tool: ToolConfig, what: str) -> CallFailure:
    return CallFailure(exception=("ResponseTooLarge",),
                       message=f"{tool.name}: answer too large ({what}; "
                               f"max_response_bytes = {tool.max_response_bytes})")


def _answer(tool: ToolConfig, status: int, text: str,
            headers: dict[str, str]) -> ToolOutcome:
    body: Any = None
    try:
        body = json.loads(text) if text else None
    except json.JSONDecodeError:
        body = None
    if status >= 400:
        err = body.get("error") if isinstance(body, dict) else None
        return ToolOutcome(content=truncate(text), failure=CallFailure(
            status=status,
            error_type=str(err.get("type")) if isinstance(err, dict) and err.get("type")
            else None,
            message=truncate(text)[:500],
            retry_after_s=retry_after_of(headers, body, now_epoch=time.time())),
            unknown=not tool.idempotent and unknown_after_status(status))
    error = error_at(body, tool.error_field)
    if error is not None:
        said = error if isinstance(error, str) else json.dumps(error, sort_keys=True)
        return ToolOutcome(content=truncate(text), failure=CallFailure(
            exception=("ErrorInBody",),
            message=f"{tool.name}: HTTP {status} with an error in the body: {said[:400]}"))
    state = body.get("state") if isinstance(body, dict) else None
    return ToolOutcome(content=truncate(text),
                       state=None if state is None else json.dumps(state, sort_keys=True))
