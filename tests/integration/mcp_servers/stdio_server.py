"""A stdio MCP server for the tests: `python stdio_server.py` with MCP_TEST_DIR set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import build

if __name__ == "__main__":
    build(os.environ.get("MCP_NAME", "calc"), Path(os.environ["MCP_TEST_DIR"])).run("stdio")
