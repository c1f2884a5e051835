"""Entries go device -> host -> disk and come back bit-exact; a damaged disk page is an error."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvtier import CorruptPageError
from kvtier.placement.page_table import DISK, HOST


def _feed(engine, tokens, dtype=torch.float32, seed=0, chunk=7):
    """Write `tokens` random entries in chunks (placing after each) and return all K and V."""
    g = torch.Generator().manual_seed(seed)
    H, D = engine.heads, engine.head_dim
    k_all = torch.randn(1, H, tokens, D, generator=g).to(dtype)
    v_all = torch.randn(1, H, tokens, D, generator=g).to(dtype)
    for start in range(0, tokens, chunk):
        engine.write(k_all[:, :, start:start + chunk], v_all[:, :, start:start + chunk])
        engine.commit()
    return k_all, v_all


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_every_tier_is_bit_exact(make_engine, dtype):
    engine = make_engine(device_budget=16, host_budget=12, page_size=4, recall_pages=10_000)
    k_all, v_all = _feed(engine, 120, dtype)
    assert (engine.table.tier[:, :engine.table.n] == DISK).any()
    assert (engine.table.tier[:, :engine.table.n] == HOST).any()
    # device tier: stored rows equal the originals at their positions
    k, v, pos, _ = engine.pool.committed()
    for h in range(engine.heads):
        assert torch.equal(k[0, h], k_all[0, h, pos[h]]) and torch.equal(v[0, h], v_all[0, h, pos[h]])
    # every demoted page comes back (recall budget covers all), bit-exact, from host and disk
    rec = engine.recall(torch.randn(1, engine.heads * 2, 1, engine.head_dim).to(dtype))
    pages = rec.page_ids.shape[1]
    assert pages == engine.table.n
    counts = engine.table.count[:, :pages]
    for h in range(engine.heads):
        positions = []
        for p in range(pages):
            slot = engine.host.slot_positions(h, engine.table.slot[h, p]) if engine.table.tier[h, p] == HOST \
                else engine.disk.read(h, p, engine.table.crc[h, p])[2]
            positions.append(slot[: counts[h, p]])
        positions = torch.cat(positions)
        valid = rec.valid[h]
        assert torch.equal(rec.k[h][valid], k_all[0, h, positions])
        assert torch.equal(rec.v[h][valid], v_all[0, h, positions])
        # the tiers partition the positions seen: nothing lost, nothing doubled
        everything = torch.cat([pos[h], positions]).sort().values
        assert torch.equal(everything, torch.arange(120))
    assert engine.counters.pages_recalled["disk"] > 0 and engine.counters.pages_recalled["host"] > 0


def _first_disk_page(engine):
    h, p = np.argwhere(engine.table.tier[:, :engine.table.n] == DISK)[0]
    return int(h), int(p)


def test_corrupted_disk_page_is_detected(make_engine):
    engine = make_engine(device_budget=16, host_budget=8, recall_pages=10_000)
    _feed(engine, 80)
    h, p = _first_disk_page(engine)
    offset = engine.disk._offset(h, p) + 64 + 5  # a byte inside the keys
    with open(engine.disk.path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CorruptPageError, match=rf"checksum mismatch .*head {h}, page {p}"):
        engine.recall(torch.randn(1, 4, 1, engine.head_dim))


def test_truncated_disk_file_is_detected(make_engine):
    engine = make_engine(device_budget=16, host_budget=8, recall_pages=10_000)
    _feed(engine, 80)
    os.truncate(engine.disk.path, engine.disk.record_size // 2)
    with pytest.raises(CorruptPageError, match="missing or truncated|bad page header"):
        engine.recall(torch.randn(1, 4, 1, engine.head_dim))


def test_stale_page_is_detected(make_engine):
    """A record that is intact but not the one written last (e.g. another run's) is refused."""
    engine = make_engine(device_budget=16, host_budget=8, recall_pages=10_000)
    _feed(engine, 80)
    h, p = _first_disk_page(engine)
    engine.table.crc[h, p] ^= 1
    with pytest.raises(CorruptPageError, match="expected"):
        engine.recall(torch.randn(1, 4, 1, engine.head_dim))


def test_evict_mode_drops(make_engine):
    engine = make_engine(device_budget=16, mode="evict")
    _feed(engine, 100)
    assert engine.pool.count <= 16
    assert engine.table.n == 0 and engine.host is None
    assert engine.counters.tokens_dropped == engine.heads * (100 - engine.pool.count)
    assert engine.recall(torch.randn(1, 4, 1, engine.head_dim)) is None


def test_close_removes_files(make_engine):
    engine = make_engine(device_budget=16, host_budget=0)
    _feed(engine, 60)
    path = engine.disk.path
    assert os.path.exists(path)
    engine.close()
    assert not os.path.exists(path)
