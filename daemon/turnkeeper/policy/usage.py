"""What one model call costs: estimated before it is made, checked and priced after.

Before the call, `estimate_tokens` sizes the request from its text alone (the system
prompt, every message, the tool calls' names and arguments, the tool specs), erring on
the large side: never fewer than one token for four characters, more for text outside
ASCII (a CJK character is one token or more), plus a few tokens for each message's
framing. The budget's pre-flight (`BudgetGuard.preflight`) compares that estimate with
what is left.

After the call, `metered` takes the usage as the provider reported it and either
returns whole counts and their price, or says what is wrong with them: a negative, a
fraction, a non-number or an absurd figure (over `MAX_TOKENS_PER_CALL`) is not a usage
to charge or credit, and the model call treats it as a failed attempt of class unknown.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from turnkeeper.values import value_class

# The most tokens one call may report, input and output together. The largest context
# windows on offer hold a few million tokens; a figure above this is a broken counter.
MAX_TOKENS_PER_CALL = 10_000_000
# Added to every request estimate, and for every message or tool spec in it: the
# framing (role, separators) a provider's tokenizer counts beyond the text itself.
REQUEST_TOKENS = 8
PER_ITEM_TOKENS = 4


def text_tokens(text: str) -> int:
    """A conservative token count of `text`: ceil(characters / 4) for ASCII; a character
    of n UTF-8 bytes counts (3n - 2) / 4, so a 2-byte one 1 token, a 3-byte (CJK) 1.75
    and a 4-byte (emoji) 2.5. A lone surrogate (JSON can carry one) counts as the three
    bytes it is written with."""
    if text.isascii():
        return -(-len(text) // 4)
    return -(-(3 * len(text.encode("utf-8", "surrogatepass")) - 2 * len(text)) // 4)


def item_tokens(texts: Iterable[str]) -> int:
    """The estimate of one message or tool spec made of `texts`: their text and its
    framing."""
    return PER_ITEM_TOKENS + sum(map(text_tokens, texts))


def estimate_tokens(items: Iterable[Iterable[str]]) -> int:
    """The input tokens of a request of `items` (messages and tool specs, each as its
    texts): never fewer than its characters / 4."""
    return REQUEST_TOKENS + sum(map(item_tokens, items))


@value_class
class Prices:
    """USD per million tokens, as providers publish them. A cache price None is the
    input price."""

    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0
    cache_read_per_mtok: float | None = None
    cache_write_per_mtok: float | None = None

    @property
    def worst_input_per_mtok(self) -> float:
        """The dearest an input token may be billed: a cache read is cheaper, an
        Anthropic cache write dearer, and which ones a request gets is only known after.
        What an estimate prices its input at, so a discount never lowers it."""
        return max(self.input_per_mtok,
                   self.input_per_mtok if self.cache_read_per_mtok is None
                   else self.cache_read_per_mtok,
                   self.input_per_mtok if self.cache_write_per_mtok is None
                   else self.cache_write_per_mtok)

    def worst_cost_usd(self, input_tokens: int, output_tokens: int) -> float:
        """The most a call of that many tokens can cost."""
        return (input_tokens * self.worst_input_per_mtok
                + output_tokens * self.output_per_mtok) / 1e6


def cost_usd(input_tokens: int, output_tokens: int, *, price_input_per_mtok: float,
             price_output_per_mtok: float, cache_read_tokens: int = 0,
             cache_write_tokens: int = 0, price_cache_read_per_mtok: float | None = None,
             price_cache_write_per_mtok: float | None = None) -> float:
    """Price of one model usage, prices per million tokens as providers publish them:

        (plain * price_in + cache_read * price_cache_read + cache_write * price_cache_write
         + output * price_out) / 1e6,   plain = input - cache_read - cache_write (>= 0)

    `input_tokens` counts every input token, cached or not; the cache counts are the
    parts of it read from or written to the provider's prompt cache, which providers
    bill at other rates (a read is much cheaper, an Anthropic write dearer). A cache price
    left None is the input price, so a provider without cache prices is charged as if
    nothing were cached. Unpriced providers (all prices 0) cost nothing, which is why
    `max_cost_usd` needs prices (configured or from the shipped table) to mean anything."""
    read = max(0, min(cache_read_tokens, input_tokens))
    write = max(0, min(cache_write_tokens, input_tokens - read))
    plain = input_tokens - read - write
    read_price = price_input_per_mtok if price_cache_read_per_mtok is None \
        else price_cache_read_per_mtok
    write_price = price_input_per_mtok if price_cache_write_per_mtok is None \
        else price_cache_write_per_mtok
    return (plain * price_input_per_mtok + read * read_price + write * write_price
            + output_tokens * price_output_per_mtok) / 1e6


def wire_count(raw: object) -> float:
    """A usage figure as a provider's JSON gave it, for `metered` to judge: a number as
    it is (an int stays an int), a missing one 0, anything else (a string, a boolean, an
    object) NaN, which no check lets through."""
    if raw is None:
        return 0
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return math.nan
    return raw


class Metered(NamedTuple):
    """One call's usage, checked: whole counts, and its price."""

    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    cost_usd: float

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


_COUNT_NAMES = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")


def _count(name: str, value: float) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return f"{name} is not a number"
    if not math.isfinite(value) or not float(value).is_integer():
        return f"{name} {value!r} is not a whole number"
    if value < 0:
        return f"{name} {value!r} is negative"
    if value > MAX_TOKENS_PER_CALL:
        return f"{name} {value!r} is over {MAX_TOKENS_PER_CALL:,} tokens for one call"
    return int(value)


def metered(input_tokens: float, output_tokens: float, cache_read_tokens: float = 0,
            cache_write_tokens: float = 0, *, prices: Prices) -> Metered | str:
    """The usage a provider reported, checked and priced; a string saying what is wrong
    when it cannot be a real usage (see the module's docstring): nothing of it is then
    counted. The cached parts are parts of the input, so together they cannot exceed
    it (an Anthropic input of -1,000,005 plus its cache counts shows as that)."""
    # The usual usage, four ints in range, needs no word on each (`_count` agrees).
    if (type(input_tokens) is int and type(output_tokens) is int
            and type(cache_read_tokens) is int and type(cache_write_tokens) is int
            and 0 <= input_tokens <= MAX_TOKENS_PER_CALL
            and 0 <= output_tokens <= MAX_TOKENS_PER_CALL
            and 0 <= cache_read_tokens <= MAX_TOKENS_PER_CALL
            and 0 <= cache_write_tokens <= MAX_TOKENS_PER_CALL):
        inp, out, read, write = input_tokens, output_tokens, cache_read_tokens, cache_write_tokens
    else:
        counts: list[int] = []
        values = (input_tokens, output_tokens, cache_read_tokens, cache_write_tokens)
        for name, value in zip(_COUNT_NAMES, values, strict=True):
            checked = _count(name, value)
            if isinstance(checked, str):
                return f"usage {checked}"
            counts.append(checked)
        inp, out, read, write = counts
    if inp + out > MAX_TOKENS_PER_CALL:
        return (f"usage of {inp + out:,} tokens is over {MAX_TOKENS_PER_CALL:,} tokens "
                "for one call")
    if read + write > inp:
        return (f"usage cache_read_tokens {read} + cache_write_tokens {write} is more "
                f"than input_tokens {inp}")
    # `cost_usd` written out (the counts are checked: 0 <= read + write <= inp): this
    # prices every reply.
    price_in = prices.input_per_mtok
    read_price, write_price = prices.cache_read_per_mtok, prices.cache_write_per_mtok
    cost = ((inp - read - write) * price_in
            + read * (price_in if read_price is None else read_price)
            + write * (price_in if write_price is None else write_price)
            + out * prices.output_per_mtok) / 1e6
    if not math.isfinite(cost) or cost < 0:
        return f"usage priced at {cost!r} USD"
    # Built as a tuple is: a named tuple's own constructor is a Python call.
    return tuple.__new__(Metered, (inp, out, read, write, cost))
