"""The environment's on/off switches: one spelling for all, and a misspelt value refused when a cache is made."""

from __future__ import annotations

import pytest

from kvtier import ConfigError, TieredCache
from kvtier.native.loader import switched_off
from kvtier.switches import env_switch
from tiny_models import tiny_llama


@pytest.mark.parametrize("value, on", [("1", True), ("on", True), (" Yes ", True), ("TRUE", True), ("", True),
                                       ("0", False), ("off", False), ("False", False), ("no", False)])
@pytest.mark.parametrize("name", ["KVTIER_NATIVE", "KVTIER_SIGTERM"])
def test_every_switch_reads_one_spelling(name, value, on, monkeypatch):
    monkeypatch.setenv(name, value)
    assert env_switch(name) is on
    if name == "KVTIER_NATIVE":
        assert switched_off(value) is not on


@pytest.mark.parametrize("name", ["KVTIER_NATIVE", "KVTIER_SIGTERM"])
def test_a_misspelt_switch_is_refused_when_a_cache_is_made(name, monkeypatch):
    """``disable`` or ``of`` had left the kernels on and the SIGTERM handler installed, with no word."""
    monkeypatch.setenv(name, "disable")
    with pytest.raises(ConfigError, match=f"{name}='disable' in the environment; allowed: 1, on, true, yes \\(on\\), "
                                          "0, off, false, no \\(off\\), or unset"):
        TieredCache(tiny_llama().config, device_budget=0.5)
