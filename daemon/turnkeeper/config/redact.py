"""Credentials a URL may carry, masked wherever the daemon prints a URL it was given:
`config show`, and error messages that name an endpoint."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote_plus, urlsplit, urlunsplit

REDACTED = "<redacted>"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S+")
# Names (of a query parameter, a header, a variable) whose value is a credential: api_key,
# access_token, client_secret, password, sig / signature (a SAS or presigned URL),
# X-Amz-Credential, Authorization...
SECRET_NAME = re.compile(r"key|token|secret|passw|pwd|sig|auth|credential", re.IGNORECASE)


def redact_url(value: str) -> str:
    """`value` with the credentials a URL may carry masked: its userinfo (`user:password@`)
    and the values of query parameters named like a key, token, secret, password or
    signature. A string that is not a whole URL is returned as it is."""
    if not _URL.fullmatch(value):
        return value
    try:
        parts = urlsplit(value)
    except ValueError:
        return value
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    query = "&".join(
        f"{name}={REDACTED}" if val and SECRET_NAME.search(unquote_plus(name)) else pair
        for pair in parts.query.split("&")
        for name, _, val in (pair.partition("="),))
    if (netloc, query) == (parts.netloc, parts.query):
        return value
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def redact_urls(data: Any) -> Any:
    """Every URL-valued string inside `data` (config show's JSON) through `redact_url`."""
    if isinstance(data, str):
        return redact_url(data)
    if isinstance(data, dict):
        return {k: redact_urls(v) for k, v in data.items()}
    if isinstance(data, list):
        return [redact_urls(v) for v in data]
    return data
