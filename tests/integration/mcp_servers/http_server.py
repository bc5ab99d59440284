"""A streamable-HTTP MCP server for the tests, on 127.0.0.1 only: `python http_server.py
WORKDIR`. It binds a free port and writes it to WORKDIR/port once it listens."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import anyio
import uvicorn

sys.path.insert(0, str(Path(__file__).parent))

from common import build


async def main(workdir: Path) -> None:
    server = build("remote", workdir)
    app = server.streamable_http_app(host="127.0.0.1")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    port = int(os.environ.get("MCP_PORT", "0"))
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    web = uvicorn.Server(config)
    tmp = workdir / "port.tmp"
    tmp.write_text(str(sock.getsockname()[1]))
    tmp.rename(workdir / "port")
    await web.serve(sockets=[sock])


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]))
