"""On/off switches read from the environment (``KVTIER_NATIVE``, ``KVTIER_SIGTERM``): one spelling for all of
them, and a value outside it refused by name rather than read as whichever way a typo happens to fall."""

from __future__ import annotations

import os

from .errors import ConfigError

ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")
SWITCHES = ("KVTIER_NATIVE", "KVTIER_SIGTERM")   # both on when unset


def is_on(name: str, value: str | None, default: bool = True) -> bool:
    """Whether `value`, the environment's value of switch `name`, turns it on (unset or empty: `default`)."""
    if value is None or not value.strip():
        return default
    word = value.strip().lower()
    if word in ON or word in OFF:
        return word in ON
    raise ConfigError(f"{name}={value!r} in the environment; allowed: {', '.join(ON)} (on), {', '.join(OFF)} (off), "
                      "or unset")


def env_switch(name: str, default: bool = True) -> bool:
    return is_on(name, os.environ.get(name), default)


def check_switches() -> None:
    """Refuse a misspelt switch when a cache is made, before it could change anything."""
    for name in SWITCHES:
        env_switch(name)
