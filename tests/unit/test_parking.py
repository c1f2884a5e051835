"""Parking a layer on the host or on disk and resuming it gives back exactly the state it had."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvtier import ConfigError, CorruptPageError
from kvtier.engine import parking
from kvtier.placement.page_table import DISK, HOST


def _state(engine):
    k, v, pos, score = engine.pool.committed()
    return (k.clone(), v.clone(), pos.clone(), score.clone(), engine.table.tier[:, :engine.table.n].copy(),
            engine.seen)


def _feed(engine, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, engine.heads, tokens, engine.head_dim, generator=g)
    engine.write(k, k * 2)
    engine.commit()


@pytest.mark.parametrize("to", ["host", "disk"])
def test_park_and_resume_round_trip(make_engine, to):
    engine = make_engine(device_budget=16, host_budget=20, recall_pages=10_000)
    _feed(engine, 90, 0)
    before = _state(engine)
    query = torch.randn(1, engine.heads * 2, 1, engine.head_dim)
    recalled = engine.recall(query)
    assert (before[4] == HOST).any() and (before[4] == DISK).any()
    index_bytes = engine.index_bytes()
    parking.park(engine, to)
    assert engine.pool.count == 0 and engine.parked.where == to
    assert index_bytes > 0 and engine.index_bytes() == 0  # the recall index left the device too
    assert engine.stored == before[0].shape[2]  # the mask sizes still count the parked entries
    if to == "disk":
        assert engine.host.held_tokens().sum() == 0  # the host is free for other sessions
        assert (engine.table.tier[:, :engine.table.n] == DISK).all()
    parking.restore(engine)
    assert engine.index_bytes() == index_bytes
    after = _state(engine)
    for a, b in zip(before[:4], after[:4]):
        assert torch.equal(a, b)
    assert np.array_equal(before[4], after[4])
    again = engine.recall(query)
    assert torch.equal(recalled.k, again.k) and torch.equal(recalled.valid, again.valid)


def test_parked_then_written_matches_a_twin_never_parked(make_engine):
    parked = make_engine(device_budget=16, host_budget=20)
    twin = make_engine(device_budget=16, host_budget=20, layer_idx=1)
    for engine in (parked, twin):
        _feed(engine, 60, 1)
    parking.park(parked, "host")
    parking.park(parked, "disk")  # a host-parked session pushed on to disk
    assert parked.parked.where == "disk"
    for engine in (parked, twin):
        _feed(engine, 37, 2)  # the next write restores first
    assert parked.parked is None
    for a, b in zip(_state(parked), _state(twin)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else np.array_equal(a, b)
    query = torch.randn(1, parked.heads * 2, 1, parked.head_dim)
    assert torch.equal(parked.recall(query).page_ids, twin.recall(query).page_ids)


def test_bad_target(make_engine):
    engine = make_engine()
    _feed(engine, 40, 0)
    with pytest.raises(ConfigError, match="park to 'gpu'"):
        parking.park(engine, "gpu")


@pytest.mark.parametrize("damage", ["flip", "missing"])
def test_damaged_parked_index_is_an_error(make_engine, damage):
    engine = make_engine(device_budget=16, host_budget=20)
    _feed(engine, 90, 3)
    parking.park(engine, "disk")
    assert engine.usage()["host"]["bytes"] == 0 and engine.parked.index is None  # nothing left in host memory
    assert engine.usage()["disk"]["bytes"] > engine.parked.count * engine.heads * engine.pool.entry_bytes()
    path = parking._index_path(engine)
    if damage == "missing":
        os.remove(path)
    else:
        data = bytearray(open(path, "rb").read())
        data[-3] ^= 0x10
        open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptPageError, match="recall index of layer 0"):
        parking.restore(engine)


def test_reset_removes_the_parked_index_file(make_engine):
    engine = make_engine(device_budget=16, host_budget=20)
    _feed(engine, 90, 4)
    parking.park(engine, "disk")
    path = parking._index_path(engine)
    assert os.path.exists(path)
    engine.reset()
    assert not os.path.exists(path) and engine.parked is None
