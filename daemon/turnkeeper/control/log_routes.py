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
    after = query_float(request, "after", 0, lo=0, hi=2**62)
    assert limit is not None and after is not None
    recent = tk_logging.recent
    total = recent.total
    lines = recent.lines(turn=request.query.get("turn") or None, limit=int(limit),
                         after=int(after))
    # A line may hold a value JSON has no form for (an exception object): its text.
    # `next`: the number of the newest line seen, for `?after=` (`turnkeeper logs -f`).
    return web.json_response({"lines": lines, "window": MAX_LINES, "next": total},
                             dumps=lambda v: json.dumps(v, default=str))
