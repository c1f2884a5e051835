"""Switches read from the environment (``KVTIER_NATIVE``, ``KVTIER_SIGTERM`` on or off; ``KVTIER_LAUNCH`` a
choice; ``KVTIER_KERNEL_CACHE`` a folder): one spelling for each, and a value outside it refused by name
rather than read as whichever way a typo happens to fall."""

from __future__ import annotations

import os
from pathlib import Path

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


LAUNCHERS = ("driver", "cupy")   # KVTIER_LAUNCH: how kernels are launched (`native.loader.launcher`)


def launch_choice() -> str:
    """``KVTIER_LAUNCH``, case and spaces aside; unset or empty: ``driver``."""
    value = os.environ.get("KVTIER_LAUNCH")
    word = (value or "").strip().lower() or LAUNCHERS[0]
    if word not in LAUNCHERS:
        raise ConfigError(f"KVTIER_LAUNCH={value!r} in the environment; allowed: {', '.join(LAUNCHERS)}, or unset")
    return word


def kernel_cache_asked() -> Path | None:
    """``KVTIER_KERNEL_CACHE``: an absolute folder (``~`` expanded), or None where unset or empty. A relative one
    is refused: the kernels would be built again in every folder the program runs from."""
    value = os.environ.get("KVTIER_KERNEL_CACHE")
    if value is None or not value.strip():
        return None
    path = Path(os.path.expanduser(value.strip()))
    if not path.is_absolute():
        raise ConfigError(f"KVTIER_KERNEL_CACHE={value!r} in the environment is a relative folder; allowed: an "
                          "absolute folder (or ~/...), or unset")
    return path


def check_switches() -> None:
    """Refuse a misspelt switch when a cache is made, and at each step's first layer, before it could change
    anything (the kernels read them at their launches, in the middle of a step)."""
    for name in SWITCHES:
        env_switch(name)
    launch_choice()
    kernel_cache_asked()
