"""The local control plane: an aiohttp server on a Unix socket, and a stdlib client."""
