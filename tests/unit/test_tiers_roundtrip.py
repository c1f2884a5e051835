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
def test_round_trip_every_tier_is_bit_exact(make_engine, watch_fetches, dtype):
    engine = make_engine(device_budget=16, host_budget=12, page_size=4, recall_pages=10_000)
    k_all, v_all = _feed(engine, 120, dtype)
    n, P = engine.table.n, engine.cfg.page_size
    tier = engine.table.tier
    assert (tier == DISK).any() and (tier == HOST).any()
    # device tier: stored rows equal the originals at their positions
    k, v = engine.pool.contiguous(engine.pool.count)
    pos, _ = engine.pool.meta()
    for h in range(engine.heads):
        assert torch.equal(k[0, h], k_all[0, h, pos[h]]) and torch.equal(v[0, h], v_all[0, h, pos[h]])
    # each tier's slot holds exactly the page the table says, and the tiers partition the positions seen
    for h in range(engine.heads):
        positions = []
        for p in range(n):
            t, slot = engine.table.lookup(np.array([h]), np.array([p]))
            store = engine.host if t[0] == HOST else engine.disk
            pk, pv = store.load(slot)
            at = torch.from_numpy(engine.table.positions(h, p).copy())
            assert len(at) == P and (at >= 0).all()  # every page below the device is full
            assert torch.equal(pk[0], k_all[0, h, at]) and torch.equal(pv[0], v_all[0, h, at])
            positions.append(at)
        everything = torch.cat([pos[h], *positions]).sort().values
        assert torch.equal(everything, torch.arange(120)), "a position is lost or held twice"
    # every demoted page comes back through recall (the budget covers all), bit-exact, from host and disk
    fetched = watch_fetches(engine)
    k_new = torch.randn(1, engine.heads, 1, engine.head_dim).to(dtype)
    engine.write(k_new, k_new)
    out, _ = engine.attend(torch.randn(1, engine.heads * 2, 1, engine.head_dim).to(dtype))
    assert out is not None and out.shape == (1, 1, engine.heads * 2, engine.head_dim)
    assert len(fetched) == 1
    ids, rk, rv = fetched[0]
    assert ids.shape == (engine.heads, n)
    P, D = engine.cfg.page_size, engine.head_dim
    for h in range(engine.heads):
        assert sorted(ids[h].tolist()) == list(range(n))
        at = torch.from_numpy(np.stack([engine.table.positions(h, int(p)) for p in ids[h]]))   # [n, P]
        expect = torch.cat([k_all[0, h, at], v_all[0, h, at]], dim=2)                          # [n, P, 2D]
        got = torch.cat([rk[h].view(n, P, D), rv[h].view(n, P, D)], dim=2)
        assert _same_pages(got, expect)
    assert engine.counters.pages_recalled["disk"] > 0 and engine.counters.pages_recalled["host"] > 0
    assert engine.counters.pages_recalled["disk"] + engine.counters.pages_recalled["host"] == engine.heads * n


def _same_pages(got, expect):
    """Whether ``got`` ``[r, P, ...]`` holds exactly the pages of ``expect``, each once, in any order (a head's
    recalled pages are a set: `_fetch` may order them as the tiers store them)."""
    left = list(range(expect.shape[0]))
    for page in got:
        match = next((i for i in left if torch.equal(page, expect[i])), None)
        if match is None:
            return False
        left.remove(match)
    return not left


def _first_disk_slot(engine):
    h, p = np.argwhere(engine.table.tier == DISK)[0]
    return int(engine.table.lookup(np.array([h]), np.array([p]))[1][0])


def _attend_all(engine):
    k = torch.randn(1, engine.heads, 1, engine.head_dim)
    engine.write(k, k)
    result = engine.attend(torch.randn(1, engine.heads * 2, 1, engine.head_dim))
    return None if result is None else result[0]


def test_corrupted_disk_page_is_detected(make_engine):
    engine = make_engine(device_budget=16, host_budget=8, recall_pages=10_000)
    _feed(engine, 80)
    slot = _first_disk_slot(engine)
    offset = slot * engine.disk.record_size + 5  # a byte inside the keys
    with open(engine.disk.path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CorruptPageError, match=rf"checksum mismatch .* at slot {slot}\b"):
        _attend_all(engine)


def test_truncated_disk_file_is_detected(make_engine):
    engine = make_engine(device_budget=16, host_budget=8, recall_pages=10_000)
    _feed(engine, 80)
    os.truncate(engine.disk.path, engine.disk.record_size // 2)
    with pytest.raises(CorruptPageError, match="missing or truncated"):
        _attend_all(engine)


def test_misplaced_page_is_detected(make_engine):
    """A record that is intact but not the one written to that slot (another slot's page) is refused."""
    engine = make_engine(device_budget=16, host_budget=8, recall_pages=10_000)
    _feed(engine, 80)
    slots = engine.table.lookup(*engine.table.pages_in(DISK))[1]
    assert len(slots) >= 2
    a, b = int(slots[0]), int(slots[1])
    rs = engine.disk.record_size
    with open(engine.disk.path, "r+b") as f:
        f.seek(b * rs)
        record = f.read(rs)
        f.seek(a * rs)
        f.write(record)
    with pytest.raises(CorruptPageError, match=rf"slot {a}: expected"):
        _attend_all(engine)


def test_evict_mode_drops(make_engine):
    engine = make_engine(device_budget=16, mode="evict")
    _feed(engine, 100)
    # whole pages go; with 10 unprotected entries under the budget a page can always be found, so the
    # device never sits above its budget here
    assert engine.pool.count <= 16
    assert (100 - engine.pool.count) % engine.cfg.page_size == 0
    assert engine.table.n == 0 and engine.host is None and engine.disk is None
    assert engine.counters.tokens_dropped == engine.heads * (100 - engine.pool.count)
    assert _attend_all(engine) is None


def test_close_frees_pages_and_closing_the_cache_removes_files(make_engine):
    engine = make_engine(device_budget=16, host_budget=0)
    _feed(engine, 60)
    disk, path, folder = engine.disk, engine.disk.path, engine.shared.private_path
    assert os.path.exists(path) and disk.pages() > 0
    engine.close()
    assert disk.pages() == 0  # the layer gave its slots back to the cache's shared store
    engine.shared.close()
    assert not os.path.exists(path) and not os.path.exists(folder)


def _decode_with_few_recall_pages(engine, watch_fetches, total=1200, prefill=600):
    """Prefill, then decode one token at a time with queries near stored keys (recall keeps coming back to
    the same region); check that every recalled page is exactly the page the table names."""
    g = torch.Generator().manual_seed(9)
    k_all = torch.randn(1, engine.heads, total, engine.head_dim, generator=g)
    v_all = torch.randn(1, engine.heads, total, engine.head_dim, generator=g)
    fetched = watch_fetches(engine)
    engine.write(k_all[:, :, :prefill], v_all[:, :, :prefill])
    engine.commit()
    P, D = engine.cfg.page_size, engine.head_dim
    for t in range(prefill, total):
        engine.write(k_all[:, :, t:t + 1], v_all[:, :, t:t + 1])
        near = k_all[0, :, (t * 7) % prefill].repeat_interleave(2, dim=0)[None, :, None] * 3
        fetched.clear()
        engine.attend(near + 0.1 * torch.randn(1, engine.heads * 2, 1, D, generator=g))
        engine.commit()
        ids, rk, rv = fetched[0]
        for h in range(engine.heads):
            at = torch.from_numpy(np.stack([engine.table.positions(h, int(p)) for p in ids[h]]))
            expect = torch.cat([k_all[0, h, at], v_all[0, h, at]], dim=2)
            got = torch.cat([rk[h].view(-1, P, D), rv[h].view(-1, P, D)], dim=2)
            assert _same_pages(got, expect), f"step {t}, head {h}"


def test_recall_through_the_read_ahead_cache_is_bit_exact(make_engine, watch_fetches):
    engine = make_engine(heads=2, head_dim=8, device_budget=32, host_budget=64, page_size=4, recall_pages=3)
    _decode_with_few_recall_pages(engine, watch_fetches)
    ra = engine.readahead
    assert ra is not None and ra.hits > 0 and ra.pages() <= ra.capacity
    assert engine.counters.pages_recalled["disk"] > 0


def test_read_ahead_runs_once_its_cache_is_full(make_engine, watch_fetches):
    """The read-ahead cache holds about one step's recall, which the first recall's own disk pages fill;
    short-listed pages are still read ahead (replacing the least recently used), so reading ahead goes on
    in a steady decode."""
    engine = make_engine(heads=2, head_dim=8, device_budget=32, host_budget=64, page_size=4, recall_pages=3)
    _decode_with_few_recall_pages(engine, watch_fetches)
    assert engine.readahead.pages() == engine.readahead.capacity
    assert engine.readahead.read_ahead > 0, "no short-listed disk page was ever read ahead"


def test_read_ahead_cache_serves_verified_pages(tmp_path):
    """The read-ahead cache on its own: pages read ahead are served from memory, bit-exact; demand reads
    are kept too; the least recently used go first; forgotten slots are read again."""
    from kvtier.tiers.disk import DiskStore
    from kvtier.tiers.readahead import DiskReadAhead

    disk = DiskStore(str(tmp_path), 4, 8, torch.float32)
    try:
        g = torch.Generator().manual_seed(10)
        k, v = torch.randn(20, 4, 8, generator=g), torch.randn(20, 4, 8, generator=g)
        slots = disk.store(k, v)
        ra = DiskReadAhead(disk, 8, 4, 8, torch.float32, pin=False)
        ra.prefetch(slots[[3, 5, 7, 9, 11]])
        assert ra.read_ahead == 2          # at most a quarter of the capacity is read ahead a step
        got = ra.load(slots[[5, 3]])
        assert torch.equal(got[0], k[[5, 3]]) and torch.equal(got[1], v[[5, 3]])
        assert ra.hits == 2 and ra.misses == 0
        got = ra.load(slots[[0, 1, 7, 2]])
        assert torch.equal(got[0], k[[0, 1, 7, 2]]) and torch.equal(got[1], v[[0, 1, 7, 2]])
        assert ra.hits == 2 and ra.misses == 4 and ra.pages() == 6
        ra.load(slots[[12, 13, 14]])       # over capacity: the least recently used (5) goes
        assert ra.pages() == 8
        hits, misses = ra.hits, ra.misses
        ra.load(slots[[3, 7, 0]])
        assert (ra.hits, ra.misses) == (hits + 3, misses)
        got = ra.load(slots[[5]])
        assert (ra.hits, ra.misses) == (hits + 3, misses + 1) and torch.equal(got[0], k[[5]])
        ra.forget(slots[[12]])
        assert ra.pages() == 7
        got = ra.load(slots[[12, 14]])
        assert torch.equal(got[0], k[[12, 14]]) and torch.equal(got[1], v[[12, 14]])
        ra.close()
    finally:
        disk.close()
