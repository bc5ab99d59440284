"""Durations as operators write them: `90s`, `30m`, `24h`, `7d` or `2w` (a bare number is
seconds). One reader for the config file, the control API and the command line, light
enough for the command's start-up.
"""

from __future__ import annotations

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """`90`, `90s`, `30m`, `24h`, `7d`, `2w` -> seconds. Raises ValueError."""
    cleaned = text.strip().lower()
    scale = _UNITS.get(cleaned[-1:], 0.0)
    number = cleaned[:-1] if scale else cleaned
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (e.g. 90s, 30m, 24h, 7d, 2w)") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"a duration is a finite number of seconds >= 0 (got {text!r})")
    return value
