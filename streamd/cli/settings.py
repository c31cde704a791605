"""`--config FILE` and `--set KEY=VALUE`: the arguments of every command that reads the configuration.

`streamd serve` and `streamd chat` load it the same way (defaults < `--config` file <
`STREAMD_<SECTION>__<KEY>` < flags), so `streamd chat` finds the server `streamd serve` started with the
same settings.
"""

from __future__ import annotations

import argparse
from typing import Any

from streamd.config import Config, ConfigError, load_config, parse_value


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a streamd.toml file")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set server.api_keys=k1,k2 (repeatable)",
    )


def load_settings(args: argparse.Namespace, flags: dict[str, Any]) -> Config:
    """The configuration of `--config`, the environment, `--set`, then `flags` (section.key -> value; None:
    the flag was not given)."""
    overrides: dict[str, Any] = dict(_parse_set(item) for item in args.set)
    overrides.update({key: value for key, value in flags.items() if value is not None})
    return load_config(args.config, overrides)


def _parse_set(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    return key.strip(), parse_value(raw)
