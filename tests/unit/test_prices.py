"""The price table shipped with the package: used for a provider that configures no
prices, looked up by model name, and shown with its source."""

from __future__ import annotations

import datetime
import re
import tomllib
from importlib import resources

import pytest

from turnkeeper.config import Config, PolicyVersion, ProviderConfig
from turnkeeper.providers.prices import (
    PriceTable,
    prices_in_force,
    prices_status,
    shipped_table,
)
from turnkeeper.runtime import Runtime

LOCAL = "http://127.0.0.1:1/v1"


def openai(model: str, **fields: object) -> ProviderConfig:
    return ProviderConfig(name="p", kind="openai", base_url=LOCAL, model=model,
                          **fields)  # type: ignore[arg-type]


def test_the_shipped_table_is_dated_and_covers_both_vendors() -> None:
    table = shipped_table()
    datetime.date.fromisoformat(table.as_of)
    assert table.lookup("gpt-4.1-mini") is not None
    assert table.lookup("claude-sonnet-4-5") is not None
    for row in table.models.values():
        assert row.input > 0 and row.output > 0


def test_the_shipped_file_parses_and_every_entry_has_input_and_output_prices() -> None:
    text = resources.files("turnkeeper.providers").joinpath("prices.toml").read_text("utf-8")
    data = tomllib.loads(text)
    assert set(data) == {"as_of", "source", "models"}
    datetime.date.fromisoformat(data["as_of"])
    assert "genai-prices" in data["source"]
    assert len(data["models"]) > 20
    for name, row in data["models"].items():
        assert name == name.lower(), name
        assert {"input", "output"} <= set(row) <= {"input", "output", "cache_read",
                                                   "cache_write"}, name
        for key, value in row.items():
            assert isinstance(value, int | float) and not isinstance(value, bool), (name, key)
            assert value >= 0, (name, key)
        assert row["input"] > 0 and row["output"] > 0, name
    assert len(PriceTable.parse(data).models) == len(data["models"])


def test_the_gemini_and_the_responses_only_models_are_priced() -> None:
    table = shipped_table()
    for model, prices in [("gemini-2.5-flash", (0.3, 2.5)), ("gemini-2.5-pro", (1.25, 10.0)),
                          ("models/gemini-2.5-flash-lite", (0.1, 0.4)),
                          ("gemini-3.1-pro-preview", (2.0, 12.0))]:
        row = table.lookup(model)
        assert row is not None and (row.input, row.output) == prices, model
        assert row.cache_read is not None and row.cache_read < row.input
    for model in ("o1-pro", "o3-pro", "gpt-5-pro", "codex-mini", "o3-deep-research",
                  "o4-mini-deep-research"):
        row = table.lookup(model)
        assert row is not None and row.entry == model


def test_a_non_chat_row_is_kept_only_where_its_family_would_misprice_it() -> None:
    """The header says audio, realtime, speech and legacy-completion models are left
    out, except a variant named after a chat model (its own row keeps the prefix rule
    from pricing it as that model): every such row has its family's row too."""
    models = shipped_table().models
    special = re.compile(r"audio|realtime|transcribe|tts|instruct|image|embedding|whisper")
    for name in models:
        if special.search(name):
            families = [e for e in models if e != name and name.startswith(e + "-")]
            assert families, f"{name}: a non-chat model with no chat family row"


@pytest.mark.parametrize("model, entry, prices", [
    # Variants priced apart from their family take their own row, not the family's.
    ("claude-opus-4-6", "claude-opus-4-6", (5.0, 25.0)),
    ("claude-opus-4-20250514", "claude-opus-4", (15.0, 75.0)),
    ("gpt-5-pro", "gpt-5-pro", (15.0, 120.0)),
    ("gpt-5-2025-08-07", "gpt-5", (1.25, 10.0)),
    ("o1-pro", "o1-pro", (150.0, 600.0)),
    ("gpt-4o-2024-05-13", "gpt-4o-2024-05-13", (5.0, 15.0)),
    ("gpt-4o-2024-08-06", "gpt-4o", (2.5, 10.0))])
def test_a_variant_priced_apart_is_not_priced_as_its_family(
        model: str, entry: str, prices: tuple[float, float]) -> None:
    row = shipped_table().lookup(model)
    assert row is not None and row.entry == entry
    assert (row.input, row.output) == prices


@pytest.mark.parametrize("model, entry", [
    ("gpt-4o", "gpt-4o"), ("gpt-4o-mini", "gpt-4o-mini"),
    ("gpt-4o-mini-2024-07-18", "gpt-4o-mini"), ("gpt-4o-2024-08-06", "gpt-4o"),
    ("claude-sonnet-4-5-20250929", "claude-sonnet-4-5"),
    ("claude-sonnet-4-20250514", "claude-sonnet-4"),
    ("claude-3-5-haiku-latest", "claude-3-5-haiku"), ("openai/o3-mini", "o3-mini"),
    ("GPT-4.1", "gpt-4.1")])
def test_a_model_matches_exactly_or_by_its_longest_dated_prefix(model: str,
                                                                 entry: str) -> None:
    row = shipped_table().lookup(model)
    assert row is not None and row.entry == entry


@pytest.mark.parametrize("model", ["llama3", "gpt-4o2", "", "claude", "o"])
def test_a_model_the_table_does_not_know_is_not_priced_by_it(model: str) -> None:
    assert shipped_table().lookup(model) is None


def test_the_table_prices_a_provider_that_configures_none() -> None:
    f = prices_in_force(openai("gpt-4.1-mini"))
    assert (f.price_input_per_mtok, f.price_output_per_mtok) == (0.4, 1.6)
    assert (f.price_cache_read_per_mtok, f.price_cache_write_per_mtok) == (0.1, 0.4)
    assert f.source == "table" and f.table_entry == "gpt-4.1-mini"
    assert f.table_as_of == shipped_table().as_of


def test_configured_prices_win_and_cache_prices_then_follow_the_input_price() -> None:
    f = prices_in_force(openai("gpt-4.1-mini", price_input_per_mtok=0.3,
                               price_output_per_mtok=1.2))
    assert (f.price_input_per_mtok, f.price_output_per_mtok) == (0.3, 1.2)
    assert (f.price_cache_read_per_mtok, f.price_cache_write_per_mtok) == (0.3, 0.3)
    assert f.source == "config" and f.table_entry is None


def test_a_price_configured_as_zero_is_free_not_unset() -> None:
    f = prices_in_force(openai("gpt-4o", price_input_per_mtok=0.0,
                               price_output_per_mtok=0.0))
    assert f.price_input_per_mtok == 0.0 and f.source == "config"


def test_one_configured_price_and_the_rest_from_the_table() -> None:
    f = prices_in_force(openai("gpt-4o", price_output_per_mtok=9.0,
                               price_cache_read_per_mtok=0.5))
    assert (f.price_input_per_mtok, f.price_output_per_mtok) == (2.5, 9.0)
    assert f.price_cache_read_per_mtok == 0.5
    assert f.source == "config+table"


def test_an_unknown_model_without_prices_is_unpriced() -> None:
    f = prices_in_force(openai("llama3"))
    assert f.source == "none" and f.price_input_per_mtok == 0.0
    assert f.price_cache_read_per_mtok == 0.0


def test_a_table_without_cache_prices_charges_the_input_price_for_the_cache() -> None:
    table = PriceTable.parse({"as_of": "2025-01-01",
                              "models": {"m": {"input": 1.0, "output": 2.0}}})
    f = prices_in_force(openai("m"), table)
    assert (f.price_cache_read_per_mtok, f.price_cache_write_per_mtok) == (1.0, 1.0)


def test_status_shows_each_providers_prices_and_their_source() -> None:
    config = Config(providers=(
        ProviderConfig(name="a", kind="anthropic", base_url=LOCAL, model="claude-haiku-4-5"),
        openai("llama3").model_copy(update={"name": "local"})))
    status = prices_status(config)
    assert status["a"] == {"input_per_mtok": 1.0, "output_per_mtok": 5.0,
                           "cache_read_per_mtok": 0.1, "cache_write_per_mtok": 1.25,
                           "source": "table", "table_entry": "claude-haiku-4-5",
                           "table_as_of": shipped_table().as_of}
    assert status["local"]["source"] == "none"


def test_turns_are_charged_the_prices_in_force() -> None:
    config = Config(providers=(openai("gpt-4o-mini"),))
    runtime = Runtime.build(PolicyVersion(version=1, config=config, source_path=None,
                                   content_hash=""))
    prices = runtime.settings.providers["p"]
    assert (prices.price_input_per_mtok, prices.price_output_per_mtok) == (0.15, 0.6)
    assert runtime.config.providers[0].price_input_per_mtok == 0.0  # as configured
