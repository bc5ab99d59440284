"""Reading the configuration: the TOML file (or the embedded defaults), the
environment's overrides checked first, every error worded for the operator (the file's
line, the key at fault), the files a key names made relative to the config file, and
the checks made only on loading: a file must name its providers, and every provider's
key and webhook's secret must be readable now.
"""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from turnkeeper.config import agents as agents_config
from turnkeeper.config import explain
from turnkeeper.config.env import ENV_PREFIX, env_names, env_override_errors
from turnkeeper.config.root import Config
from turnkeeper.config.sections import ConfigError
from turnkeeper.config.webhooks import check_webhook_secrets
from turnkeeper.paths import config_search


def _read_config(path: Path) -> tuple[dict[str, Any], str, str]:
    """The parsed TOML, the hash of its bytes and its text. Raises ConfigError naming
    the file."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"invalid configuration ({path}): not valid TOML: {exc}") from None
    return data, hashlib.sha256(raw).hexdigest(), text


def read_config_file(path: Path) -> tuple[dict[str, Any], str]:
    """The parsed TOML and the hash of its bytes. Raises ConfigError naming the file."""
    data, digest, _ = _read_config(path)
    return data, digest


def build_config(data: Mapping[str, Any], source: str = "embedded defaults",
                 text: str | None = None) -> Config:
    """`text`: the file's, to point at the line of an error."""
    wrong = env_override_errors(Config.model_fields)
    if wrong:
        raise ConfigError("\n".join(["invalid environment override:", *wrong]))
    try:
        return Config(**data)
    except ValidationError as exc:
        raise ConfigError(explain.format_errors(exc, source, Config, data, text)) from None
    except SettingsError as exc:  # an override the checks above did not foresee
        cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
        raise ConfigError(f"invalid environment override: {exc}{cause}") from None


def load_config(path: str | Path | None) -> tuple[Config, str]:
    """Load the config (file or embedded defaults) with environment overrides.
    Returns it with the hash of the file's content ("" for embedded defaults)."""
    if path is None or str(path) == "":
        config = build_config({})
        check_provider_keys(config, "embedded defaults")
        return config, ""
    p = Path(path)
    data, digest, text = _read_config(p)
    _resolve_relative_scripts(data, p.parent)
    agents_config.resolve_relative_files(data, p.parent)
    config = build_config(data, str(p), text)
    _check_providers_named(data, digest, p)
    check_provider_keys(config, str(p))
    return config, digest


EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def _check_providers_named(data: Mapping[str, Any], digest: str, path: Path) -> None:
    """A config file must say which providers run. The built-in demo provider is for a
    daemon nobody configured (no file at all): a file without `[[providers]]` is far more
    likely half-written, or written to change a few limits, than a wish to answer real
    turns with the demo's canned replies (a reload that applied one ran 32 turns to
    `completed` on them, their tool calls never made). `TURNKEEPER_PROVIDERS` in the
    environment names them as well as the file does."""
    if "providers" in data or ENV_PREFIX + "PROVIDERS" in env_names():
        return
    if digest == EMPTY_SHA256:
        raise ConfigError(f"config file {path} is empty (half-written?); a config file "
                          "must name its [[providers]]")
    raise ConfigError(
        f"invalid configuration ({path}): no [[providers]]. A config file must name the "
        "providers it runs; the built-in demo provider runs only without a config file. "
        "To run the offline demo from this file, say so:\n"
        '  [[providers]]\n  name = "offline"\n  kind = "scripted"')


def check_provider_keys(config: Config, source: str) -> None:
    """A provider whose key cannot be read (an unset or empty variable, a missing key file
    or credential, an `env:NAME` header or query value whose variable is unset) would fail
    every call with a 401 at run time, and a webhook whose secret cannot be read or is
    not a Standard Webhooks secret could sign nothing; refuse it now, naming where the
    key was to come from (never a value). Done on loading a file (config check, start-up,
    reload), not in the model, so a config can still be built and inspected where the
    secrets are not present; a reload reads every key again."""
    missing: list[str] = []
    for p in config.providers:
        if p.kind == "scripted":
            continue
        try:
            p.secrets()
        except ConfigError as exc:
            missing.append(f"  {exc}")
    missing.extend(check_webhook_secrets(config.webhooks))
    if missing:
        raise ConfigError("\n".join([f"invalid configuration ({source}):", *missing]))


def _resolve_relative_scripts(data: dict[str, Any], base: Path) -> None:
    """A scripted provider's relative `script` is relative to the config file."""
    providers = data.get("providers")
    if not isinstance(providers, list):
        return
    for p in providers:
        if isinstance(p, dict) and isinstance(p.get("script"), str) and p["script"]:
            script = Path(p["script"])
            if not script.is_absolute():
                p["script"] = str(base / script)



def config_path_from_env(cli_value: str | None) -> str | None:
    """The config file to read (`paths.config_search`), or None for the defaults."""
    return config_search(cli_value)[0]
