"""`GET /v1/logs`: the daemon's recent log lines, all of them or one turn's, from the
window it keeps in memory (`turnkeeper.logging.recent`)."""

from __future__ import annotations

import json

from aiohttp import web

from turnkeeper import logging as tk_logging
from turnkeeper.control.http import query_float

MAX_LINES = tk_logging.RECENT_LINES


async def recent_logs(request: web.Request) -> web.Response:
    limit = query_float(request, "limit", 200, lo=1, hi=MAX_LINES)
    if isinstance(limit, web.Response):
        return limit
    assert limit is not None
    lines = tk_logging.recent.lines(turn=request.query.get("turn") or None, limit=int(limit))
    # A line may hold a value JSON has no form for (an exception object): its text.
    return web.json_response({"lines": lines, "window": MAX_LINES},
                             dumps=lambda v: json.dumps(v, default=str))
