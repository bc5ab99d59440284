"""turnkeeper: a daemon that hosts LLM agent turns and keeps each one alive, bounded and honest.

This module stays import-light on purpose: the `turnkeeper` client commands import it, and
they must start fast. Nothing here pulls in anyio, aiohttp or pydantic.
"""

__version__ = "0.1.0"
