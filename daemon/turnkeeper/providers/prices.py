"""The prices in force for each provider, and where each came from.

A price the provider's config gives always wins. A price it leaves unset comes from the
table shipped with the package (`prices.toml`, dated), looked up by the model's name, so
that `max_cost_usd` means something out of the box; a model the table does not know is
unpriced (costs 0) unless configured. A cache price left unset is the table's when the
input price is the table's too (a configured input price may be a negotiated one, which
the table's cache prices know nothing of), else the input price: caching then saves
nothing on paper, which errs on the side of the budget.

`turnkeeper status` shows the result per provider (`prices_status`), so an operator can
see which figures a cost limit is compared against.
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from turnkeeper.config import Config, ConfigError, ProviderConfig


@dataclass(frozen=True, slots=True)
class TablePrice:
    """One model's row of the table, USD per million tokens; a cache price None is the
    input price."""

    entry: str
    input: float
    output: float
    cache_read: float | None = None
    cache_write: float | None = None


@dataclass(frozen=True, slots=True)
class PriceTable:
    as_of: str
    models: Mapping[str, TablePrice]

    def lookup(self, model: str) -> TablePrice | None:
        """The row for `model`: an exact match, else the longest entry the name starts
        with followed by "-" (a dated or `-latest` name). A routing prefix such as
        "openai/" (LiteLLM's) is ignored."""
        name = model.rsplit("/", 1)[-1].lower()
        if not name:
            return None
        exact = self.models.get(name)
        if exact is not None:
            return exact
        best: TablePrice | None = None
        for entry, price in self.models.items():
            if name.startswith(entry + "-") and (best is None or len(entry) > len(best.entry)):
                best = price
        return best

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> PriceTable:
        models = {}
        for entry, row in dict(data.get("models") or {}).items():
            models[entry.lower()] = TablePrice(
                entry=entry.lower(), input=float(row["input"]), output=float(row["output"]),
                cache_read=None if row.get("cache_read") is None else float(row["cache_read"]),
                cache_write=(None if row.get("cache_write") is None
                             else float(row["cache_write"])))
        return cls(as_of=str(data.get("as_of") or ""), models=models)


@functools.cache
def shipped_table() -> PriceTable:
    """The package's table, read once (it changes only with the package)."""
    text = resources.files("turnkeeper.providers").joinpath("prices.toml").read_text("utf-8")
    return PriceTable.parse(tomllib.loads(text))


@dataclass(frozen=True, slots=True)
class PricesInForce:
    """What one provider's usage is charged at, USD per million tokens. `source`:
    "config" (every price configured), "table" (every price from the shipped table),
    "config+table", or "none" (unpriced: nothing configured, model not in the table)."""

    price_input_per_mtok: float
    price_output_per_mtok: float
    price_cache_read_per_mtok: float
    price_cache_write_per_mtok: float
    source: str
    table_entry: str | None = None
    table_as_of: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "input_per_mtok": self.price_input_per_mtok,
            "output_per_mtok": self.price_output_per_mtok,
            "cache_read_per_mtok": self.price_cache_read_per_mtok,
            "cache_write_per_mtok": self.price_cache_write_per_mtok,
            "source": self.source}
        if self.table_entry is not None:
            out["table_entry"] = self.table_entry
            out["table_as_of"] = self.table_as_of
        return out


def prices_in_force(cfg: ProviderConfig, table: PriceTable | None = None) -> PricesInForce:
    """The prices `cfg` is charged at (see the module's docstring for the rule)."""
    table = table if table is not None else shipped_table()
    row = table.lookup(cfg.model) if cfg.kind != "scripted" and cfg.model else None
    configured = cfg.model_fields_set
    origins: set[str] = set()

    def pick(key: str, from_table: float | None) -> float:
        if key in configured:
            origins.add("config")
            return float(getattr(cfg, key))
        if from_table is not None:
            origins.add("table")
            return from_table
        return 0.0

    price_in = pick("price_input_per_mtok", row.input if row else None)
    price_out = pick("price_output_per_mtok", row.output if row else None)
    input_from_table = row is not None and "price_input_per_mtok" not in configured

    def cache(value: float | None, from_table: float | None) -> float:
        if value is not None:
            origins.add("config")
            return value
        if input_from_table and from_table is not None:
            return from_table
        return price_in

    read = cache(cfg.price_cache_read_per_mtok, row.cache_read if row else None)
    write = cache(cfg.price_cache_write_per_mtok, row.cache_write if row else None)
    source = "+".join(o for o in ("config", "table") if o in origins) or "none"
    used_row = row if "table" in origins else None
    return PricesInForce(price_in, price_out, read, write, source,
                         table_entry=used_row.entry if used_row else None,
                         table_as_of=table.as_of if used_row else None)


def priced(config: Config) -> Config:
    """`config` with every provider's prices in force written into its price keys, for
    what charges usage (the turn settings read the price keys)."""
    providers = []
    for p in config.providers:
        f = prices_in_force(p)
        providers.append(p.model_copy(update={
            "price_input_per_mtok": f.price_input_per_mtok,
            "price_output_per_mtok": f.price_output_per_mtok,
            "price_cache_read_per_mtok": f.price_cache_read_per_mtok,
            "price_cache_write_per_mtok": f.price_cache_write_per_mtok}))
    return config.model_copy(update={"providers": tuple(providers)})


def prices_status(config: Config) -> dict[str, dict[str, Any]]:
    """Per provider name: the prices in force and where they came from (for status)."""
    return {p.name: prices_in_force(p).to_json() for p in config.providers}


def unpriced(config: Config) -> frozenset[str]:
    """The providers with no price at all: none configured (an explicit 0 is a price)
    and a model the shipped table does not know. They cost $0 a call, so a cost limit
    over them could never stop a turn."""
    return frozenset(p.name for p in config.providers if prices_in_force(p).source == "none")


def unpriced_in(config: Config, chain: tuple[str, ...]) -> str | None:
    """Why a cost limit over `chain` cannot be: the unpriced providers it holds (None
    when it holds none)."""
    names = unpriced(config)
    found = ", ".join(f"{p.name!r} (model {p.model or p.kind!r})"
                      for p in config.providers if p.name in chain and p.name in names)
    if not found:
        return None
    return (f"a cost limit over provider {found}, which has no price (none configured, not "
            "in the shipped price table): its calls cost $0 and the limit could never stop "
            "the turn")


def unpriced_under_cost_limits(config: Config) -> list[str]:
    """A line for each cost limit (`[budget]` or a profile's) that governs an unpriced
    provider: every turn may run on any provider of the default chain, so a limit set
    anywhere governs them all."""
    names = unpriced(config)
    if not names:
        return []
    limits = []
    if config.budget.max_cost_usd > 0:
        limits.append(f"budget.max_cost_usd = {config.budget.max_cost_usd:g}")
    for name, profile in sorted(config.budget.profiles.items()):
        if profile.max_cost_usd is not None and profile.max_cost_usd > 0:
            limits.append(f"budget.profiles.{name}.max_cost_usd = {profile.max_cost_usd:g}")
    return [f"  {limit}: provider {p.name!r} (model {p.model or p.kind!r}) has no price: "
            "none is configured and the shipped price table does not know the model, so "
            "its calls cost $0 and the limit could never stop a turn. Set its "
            "price_input_per_mtok and price_output_per_mtok (0 counts as a price), or "
            "turn the limit off (0)"
            for limit in limits for p in config.providers if p.name in names]


def check_cost_limits(config: Config, source: str = "the configuration") -> None:
    """Refuse (ConfigError, exit 78) a cost limit over an unpriced provider."""
    lines = unpriced_under_cost_limits(config)
    if lines:
        raise ConfigError("\n".join([f"invalid configuration ({source}):", *lines]))
