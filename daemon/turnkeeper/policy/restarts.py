"""The restart counter: how many times a turn's context was rebuilt automatically.

A rebuild (older history compacted after a context overflow) is a restart, and nothing
else is: a stream that broke part-way is a failure of its provider, asked again there
or on the next one, which the provider chain counts (`provider_attempts`,
`fallback_hops`), so that a flaky provider never reads as "automatic rebuilds". A turn
that keeps rebuilding is not getting anywhere, so past `limit` rebuilds it stops with
`restarts.exhausted`. A user message resets the count: the person has changed the
situation, so earlier rebuilds no longer say anything about this one. This is the one
place `max_restarts` is compared.
"""

from __future__ import annotations

import re

from turnkeeper.policy.outcome import Stop, StopCode

# What providers say when a prompt does not fit: OpenAI's "maximum context length is 8192
# tokens ... you requested 9000 tokens" and Anthropic's "prompt is too long: 210000
# tokens > 200000 maximum".
_OPENAI = re.compile(r"maximum context length is (\d+) tokens.*?(?:requested|resulted in)"
                     r"\s+(\d+)\s+tokens", re.IGNORECASE | re.DOTALL)
_ANTHROPIC = re.compile(r"prompt is too long:\s*(\d+)\s+tokens\s*>\s*(\d+)",
                        re.IGNORECASE)


def overflow_numbers(message: str) -> tuple[int, int] | None:
    """(the request's tokens, the model's window) as the provider's overflow error states
    them; None when it states neither in a form known here."""
    m = _OPENAI.search(message)
    if m is not None:
        return int(m.group(2)), int(m.group(1))
    m = _ANTHROPIC.search(message)
    if m is not None:
        return int(m.group(1)), int(m.group(2))
    return None


def context_exhausted(*, message: str, estimate_tokens: int) -> Stop:
    """The context overflowed and compaction freed nothing: no rebuild can help, so the
    turn stops now whatever the restart count. The stop names what really stopped it,
    the context: the request's tokens against the window, as the provider said them, or
    else the daemon's own estimate against an unknown window."""
    numbers = overflow_numbers(message)
    tokens, window = numbers if numbers is not None else (estimate_tokens, None)
    size = f"{tokens} tokens" + (f" > the model's {window}" if window is not None else
                                 " (estimated)")
    return Stop(StopCode.CONTEXT_EXHAUSTED,
                f"the context overflowed ({size}) and nothing more can be compacted",
                value=tokens, limit=window)


class RestartCounter:
    def __init__(self, limit: int, *, count: int = 0) -> None:
        """`count` restores the counter of a resumed turn (it lives in the turn's
        counters, which are checkpointed)."""
        if limit < 0:
            raise ValueError(f"max_restarts must be >= 0, got {limit}")
        self.limit = limit
        self.count = count

    def __repr__(self) -> str:
        return f"RestartCounter({self.count}/{self.limit})"

    def restart(self, why: str) -> Stop | None:
        """Count one rebuild; the stop when it is one too many. `why` goes into nothing
        but the caller's log: the stop message says how many, which is what a user needs."""
        del why
        self.count += 1
        if self.count > self.limit:
            return self._exhausted(f"{self.count} automatic rebuilds, more than "
                                   f"max_restarts = {self.limit}")
        return None

    def reset(self) -> None:
        """A user message arrived."""
        self.count = 0

    def _exhausted(self, message: str) -> Stop:
        return Stop(StopCode.RESTARTS_EXHAUSTED, message, value=self.count, limit=self.limit)
