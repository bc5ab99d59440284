"""Pure decisions: every rule of the daemon, fed with events and a clock, no I/O.

Nothing in this package imports anyio, aiohttp, sqlite3, time, random or logging; a test
enforces it. Callers pass `now` (seconds, from the injected clock) and, where randomness
is part of a rule, a `rand(a, b)` uniform source.
"""
