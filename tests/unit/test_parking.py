"""Parking a layer on the host or on disk and resuming it gives back exactly the state it had."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvtier import ConfigError, CorruptPageError
from kvtier.placement.page_table import DISK, HOST
from kvtier.recall import grouped, select_pages


def _pages(engine):
    """Every demoted page's keys and values, by (head, page id), wherever it lives."""
    heads, pids = np.nonzero(engine.table.tier != 0)
    tier, slot = engine.table.lookup(heads, pids)
    out = {}
    for h, p, t, s in zip(heads.tolist(), pids.tolist(), tier.tolist(), slot.tolist()):
        store = engine.host if t == HOST else engine.disk
        k, v = store.load(np.array([s]))
        out[h, p] = (k.clone(), v.clone())
    return out


def _state(engine):
    k, v = engine.pool.contiguous(engine.pool.count)
    pos, score = engine.pool.meta()
    index = {name: t.clone() for name, t in engine.index.state().items()}
    return {"k": k.clone(), "v": v.clone(), "pos": pos.clone(), "score": score.clone(),
            "tier": engine.table.tier.copy(), "rank": engine.table.rank.copy(), "seen": engine.seen,
            "index": index, "pages": _pages(engine)}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if name in ("index", "pages"):
            assert x.keys() == y.keys(), name
            for key in x:
                pair_x, pair_y = (x[key], y[key]) if name == "pages" else ((x[key],), (y[key],))
                assert all(torch.equal(p, q) for p, q in zip(pair_x, pair_y)), f"{name} {key} differs"
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y), name
        else:
            assert x == y, name


def _feed(engine, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, engine.heads, tokens, engine.head_dim, generator=g)
    engine.write(k, k * 2)
    engine.commit()


def _all_ids(engine):
    return torch.arange(engine.table.n).expand(engine.heads, -1)


def _selection(engine, query, budget=3):
    k, _ = engine.pool.contiguous(engine.pool.count)
    return select_pages(grouped(query, engine.heads), engine.index, budget, engine.head_dim ** -0.5, [k[0]])[0]


@pytest.mark.parametrize("to", ["host", "disk"])
def test_park_and_resume_round_trip(make_engine, to):
    engine = make_engine(device_budget=16, host_budget=20, recall_pages=10_000)
    _feed(engine, 90, 0)
    before = _state(engine)
    assert (before["tier"] == HOST).any() and (before["tier"] == DISK).any()
    query = torch.randn(1, engine.heads * 2, 1, engine.head_dim)
    recalled = engine._fetch(_all_ids(engine), _all_ids(engine))
    chosen = _selection(engine, query)
    index_bytes = engine.index_bytes()
    count = engine.pool.count
    engine.park(to)
    assert engine.pool.count == 0 and engine.parked.where == to and engine.parked.count == count
    assert index_bytes > 0 and engine.index_bytes() == 0  # the recall index left the device too
    assert engine.stored == count  # the mask sizes still count the parked entries
    if to == "disk":
        assert engine.host.pages() == 0 and (engine.table.tokens(HOST) == 0).all()  # the host is free
        assert (engine.table.tier == DISK).all()
        assert os.path.exists(engine.parked.meta_file.path)
    else:
        assert np.array_equal(engine.table.tier, before["tier"])  # host pages stay where they were
    engine.restore()
    assert engine.parked is None
    assert engine.index_bytes() == index_bytes
    _assert_same(before, _state(engine))
    again = engine._fetch(_all_ids(engine), _all_ids(engine))
    assert torch.equal(recalled[0], again[0]) and torch.equal(recalled[1], again[1])
    assert torch.equal(chosen, _selection(engine, query))


def test_parked_then_written_matches_a_twin_never_parked(make_engine, watch_fetches):
    parked = make_engine(device_budget=16, host_budget=20)
    twin = make_engine(device_budget=16, host_budget=20, layer_idx=1)
    for engine in (parked, twin):
        _feed(engine, 60, 1)
    parked.park("host")
    parked.park("disk")  # a host-parked session pushed on to disk
    assert parked.parked.where == "disk"
    for engine in (parked, twin):
        _feed(engine, 37, 2)  # the next write restores first
    assert parked.parked is None
    _assert_same(_state(parked), _state(twin))
    # the next step recalls the same pages (recall_pages=4 of many) and attends to the same result
    g = torch.Generator().manual_seed(3)
    k = torch.randn(1, parked.heads, 5, parked.head_dim, generator=g)
    query = torch.randn(1, parked.heads * 2, 5, parked.head_dim, generator=g)
    ids, outs = [], []
    for engine in (parked, twin):
        fetched = watch_fetches(engine)
        engine.write(k, k)
        outs.append(engine.attend(query)[0])
        engine.commit()
        assert len(fetched) == 1
        ids.append(fetched[0][0])
    assert ids[0].shape == (parked.heads, 4) and parked.table.n > 4
    assert torch.equal(ids[0], ids[1])
    assert torch.equal(outs[0], outs[1])
    _assert_same(_state(parked), _state(twin))


def test_bad_target(make_engine):
    engine = make_engine()
    _feed(engine, 40, 0)
    with pytest.raises(ConfigError, match="park to 'gpu'"):
        engine.park("gpu")
    assert engine.parked is None


@pytest.mark.parametrize("damage", ["flip", "missing"])
def test_damaged_parked_file_is_an_error_and_changes_nothing(make_engine, damage):
    engine = make_engine(device_budget=16, host_budget=20)
    _feed(engine, 90, 3)
    before = _state(engine)
    engine.park("disk")
    parked = engine.parked
    assert engine.usage()["host"]["bytes"] == 0 and parked.entries is None  # nothing left in host memory
    assert engine.usage()["disk"]["bytes"] > parked.count * engine.heads * engine.pool.entry_bytes()
    path = parked.meta_file.path
    assert os.path.dirname(path) == engine.shared.private_path and "layer000" in os.path.basename(path)
    tier, disk_pages, seen = engine.table.tier.copy(), engine.disk.pages(), engine.seen
    data = open(path, "rb").read()
    if damage == "missing":
        os.remove(path)
    else:
        flipped = bytearray(data)
        flipped[-3] ^= 0x10
        open(path, "wb").write(bytes(flipped))
    why = "missing or unreadable" if damage == "missing" else "fails its CRC-32 check"
    with pytest.raises(CorruptPageError, match=rf"parked layer file .*layer000.* {why}"):
        engine.restore()
    k = torch.randn(1, engine.heads, 1, engine.head_dim)
    with pytest.raises(CorruptPageError, match="parked layer file"):
        engine.write(k, k)  # a write restores first, and fails the same way
    # all or nothing: the layer is still parked on disk, exactly as it was
    assert engine.parked is parked and parked.where == "disk" and engine.pending is None
    assert engine.seen == seen and np.array_equal(engine.table.tier, tier) and engine.disk.pages() == disk_pages
    if damage == "flip":  # repaired, it resumes in the state it was parked in
        open(path, "wb").write(data)
        engine.restore()
        _assert_same(before, _state(engine))


def test_reset_removes_the_parked_file_and_pages(make_engine):
    engine = make_engine(device_budget=16, host_budget=20)
    _feed(engine, 90, 4)
    engine.park("disk")
    path = engine.parked.meta_file.path
    assert os.path.exists(path) and engine.disk.pages() > 0
    engine.reset()
    assert not os.path.exists(path) and engine.parked is None
    assert engine.disk.pages() == 0 and engine.table.n == 0 and engine.stored == 0


def test_disk_parked_layer_drops_its_read_ahead_cache(make_engine):
    """A layer parked on disk leaves nothing in host memory: the pages read ahead before parking are let go
    too."""
    engine = make_engine(device_budget=16, host_budget=20, recall_pages=10_000)
    _feed(engine, 90, 5)
    k = torch.randn(1, engine.heads, 1, engine.head_dim)
    engine.write(k, k)
    assert engine.attend(torch.randn(1, engine.heads * 2, 1, engine.head_dim)) is not None  # recalls disk pages
    engine.commit()
    slots = engine.table.lookup(*engine.table.pages_in(DISK))[1]
    engine.readahead.prefetch(slots)
    engine.readahead.load(slots[:1])   # waits for the read ahead of that page
    assert engine.readahead.pages() > 0
    engine.park("disk")
    assert engine.host.pages() == 0
    assert engine.usage()["host"]["bytes"] == 0, "a disk-parked layer still holds host memory (read-ahead cache)"


@pytest.mark.parametrize("first", [None, "host"])
def test_a_failed_park_to_disk_changes_nothing(make_engine, monkeypatch, first):
    """Disk full while writing the pages, or the parked file cannot be made: the layer stays as it was
    (on the device, or parked on the host), no disk slot is left taken, and a later park succeeds."""
    import errno

    from kvtier import CapacityError

    engine = make_engine(device_budget=16, host_budget=20)
    _feed(engine, 90, 6)
    before, disk_pages = _state(engine), engine.disk.pages()
    if first:
        engine.park(first)
    parked = engine.parked

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(CapacityError, match="disk full"):
        engine.park("disk")
    monkeypatch.undo()
    assert engine.parked is parked and engine.disk.pages() == disk_pages
    path = os.path.join(engine.shared.private_path, "layer000.parked.safetensors")
    with open(path, "wb") as f:   # a file an interrupted park left: the cache's own (its folder is private)
        f.write(b"left over")
    engine.park("disk")           # goes first (a link in the way is refused: test_reliability_park)
    assert engine.parked.where == "disk"
    engine.restore()
    _assert_same(before, _state(engine))
    assert engine.disk.pages() == disk_pages


def test_park_and_resume_without_pages(make_engine):
    """A layer with no demoted pages yet parks on disk and comes back exactly."""
    engine = make_engine(device_budget=64, host_budget=20)
    _feed(engine, 40, 7)
    assert engine.table.n == 0
    _park_twice_and_compare(engine)


def _park_twice_and_compare(engine):
    k, v = (t.clone() for t in engine.pool.contiguous(engine.pool.count))
    pos, score = (t.clone() for t in engine.pool.meta())
    engine.park("host")
    engine.park("disk")
    assert engine.parked.where == "disk" and engine.pool.count == 0
    engine.restore()
    k2, v2 = engine.pool.contiguous(engine.pool.count)
    pos2, score2 = engine.pool.meta()
    assert torch.equal(k, k2) and torch.equal(v, v2) and torch.equal(pos, pos2) and torch.equal(score, score2)
    assert engine.disk.pages() == 0


def test_evict_mode_layer_parks_on_disk(make_engine):
    """In evict mode a layer has no host tier; parking on disk still takes its device entries there and back."""
    engine = make_engine(device_budget=16, mode="evict")
    _feed(engine, 90, 7)
    _park_twice_and_compare(engine)
    assert engine.host is None


def _with_clean_copies(make_engine, seed):
    """A layer whose pages lie on the host, on disk, and on the host with clean copies on disk (promoted)."""
    engine = make_engine(device_budget=16, host_budget=20, recall_pages=3, promote=True)
    engine.promote_every = 1
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, engine.heads, 90, engine.head_dim, generator=g)
    engine.write(k, k * 2)
    engine.commit()
    for _ in range(6):
        k = torch.randn(1, engine.heads, 1, engine.head_dim, generator=g)
        engine.write(k, k)
        engine.attend(torch.randn(1, engine.heads * 2, 1, engine.head_dim, generator=g))
        engine.commit()
    assert (engine.table.copy_slot >= 0).any() and (engine.table.tier == DISK).any()
    return engine


def test_a_host_parked_layer_holds_its_pages_in_tensors_of_their_own_size(make_engine):
    """Parked on the host, a layer's host pages leave the pool's slabs (fixed-size, in part empty) for a copy of
    their own size, and the ring's slabs go too; resumed, the layer is as it was, clean copies on disk included."""
    engine = _with_clean_copies(make_engine, 8)
    slots = engine.table.lookup(*engine.table.pages_in(DISK))[1]
    engine.readahead.prefetch(slots)
    engine.readahead.load(slots[:1])
    assert engine.readahead.reserved_bytes() > 0
    before, copies, disk_pages = _state(engine), engine.table.copy_slot.copy(), engine.disk.pages()
    live = engine.usage()["host"]
    assert live["reserved_bytes"] > live["bytes"]   # the slabs' empty rows
    engine.park("host")
    parked = engine.parked
    host = engine.usage()["host"]
    pages = engine.table.pages(HOST)
    assert parked.host_pages[0].shape == (pages, engine.cfg.page_size, engine.head_dim)
    assert engine.host.reserved_bytes() == 0 and engine.readahead.reserved_bytes() == 0
    assert host["reserved_bytes"] == host["bytes"] == parked.host_bytes()
    assert np.array_equal(engine.table.copy_slot, copies) and engine.disk.pages() == disk_pages
    engine.restore()
    _assert_same(before, _state(engine))
    assert np.array_equal(engine.table.copy_slot, copies) and engine.disk.pages() == disk_pages
    engine.reset()
    assert engine.disk.pages() == 0   # no copy's slot was lost on the way


def _decode_alike(a, b, seed, steps=3):
    """Decode steps of the same random token and query on engines `a` and `b`: the same outputs, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        k = torch.randn(1, a.heads, 1, a.head_dim, generator=g)
        query = torch.randn(1, a.heads * 2, 1, a.head_dim, generator=g)
        outs = []
        for engine in (a, b):
            engine.write(k, k)
            outs.append(engine.attend(query)[0])
            engine.commit()
        assert torch.equal(outs[0], outs[1])


def test_a_host_parked_layer_pushed_to_disk_comes_back_as_a_twin_never_parked(make_engine):
    parked, twin = _with_clean_copies(make_engine, 9), _with_clean_copies(make_engine, 9)
    parked.park("host")
    parked.park("disk")
    assert parked.parked.where == "disk" and parked.parked.host_pages is None
    assert (parked.table.tier == DISK).all() and parked.usage()["host"]["reserved_bytes"] == 0
    _decode_alike(parked, twin, seed=10)
    assert parked.parked is None
    _assert_same(_state(parked), _state(twin))
    parked.reset()
    assert parked.disk.pages() == 0


@pytest.mark.parametrize("fails", ["park", "restore"])
def test_a_host_park_that_runs_out_of_memory_changes_nothing(make_engine, monkeypatch, fails):
    """No memory for the host pages' copy (park), or for the pool's slabs again (restore): a `CapacityError`,
    the layer where it was, and the next try goes through."""
    from kvtier import CapacityError
    from kvtier.tiers.host import HostPool

    engine = _with_clean_copies(make_engine, 11)
    before, disk_pages = _state(engine), engine.disk.pages()
    if fails == "restore":
        engine.park("host")
    parked, tier = engine.parked, engine.table.tier.copy()
    real = HostPool.load if fails == "park" else HostPool.store

    def short(self, *args, **kwargs):
        raise CapacityError("could not allocate a host slab")

    monkeypatch.setattr(HostPool, real.__name__, short)
    with pytest.raises(CapacityError, match="host slab"):
        engine.park("host") if fails == "park" else engine.restore()
    monkeypatch.undo()
    assert engine.parked is parked and np.array_equal(engine.table.tier, tier)
    if fails == "park":
        assert engine.pool.count > 0 and engine.host.pages() == engine.table.pages(HOST)
        _assert_same(before, _state(engine))
        engine.park("host")
    else:   # the slabs the restore took for the pages went again
        assert engine.pool.count == 0 and engine.host.pages() == 0 and engine.host.reserved_bytes() == 0
    engine.restore()
    _assert_same(before, _state(engine))
    assert engine.disk.pages() == disk_pages


def test_a_host_pool_mostly_full_keeps_its_pages_when_parked_on_the_host(make_engine, monkeypatch):
    """Where little of the pool's slabs is empty, its pages stay in them (no copy out, none back at the restore),
    through a park to the host, one on to disk and the restore."""
    from kvtier.engine import parking

    engine = _with_clean_copies(make_engine, 12)
    host = engine.host
    monkeypatch.setattr(parking, "SPARE_SHARE", 1 - host.nbytes() / host.reserved_bytes())
    before, reserved = _state(engine), host.reserved_bytes()
    engine.park("host")
    assert engine.parked.host_pages is None and host.reserved_bytes() == reserved
    assert engine.usage()["host"]["reserved_bytes"] == reserved + engine.parked.host_bytes()
    engine.restore()
    _assert_same(before, _state(engine))
    monkeypatch.setattr(parking, "SPARE_SHARE", 1 - host.nbytes() / host.reserved_bytes() - 1e-9)
    engine.park("host")
    assert engine.parked.host_pages is not None and host.reserved_bytes() == 0
    engine.park("disk")
    engine.restore()
    _assert_same(before, _state(engine))


@pytest.mark.parametrize("to", ["host", "disk"])
def test_a_restore_from_host_slabs_filled_ahead_is_the_restore_on_demand(make_engine, to):
    """A read made ahead (`ParkedLayer.read` given the layer's host pool) puts the host pages into slabs of their
    own and changes nothing; the restore's pool takes those slabs whole, and the layer, its pool's bookkeeping
    included, is as a twin's restored on demand, then decodes as it does."""
    ahead, twin = _with_clean_copies(make_engine, 13), _with_clean_copies(make_engine, 13)
    before = _state(ahead)
    for engine in (ahead, twin):
        engine.park(to)
    pages = len(ahead.parked.was_on_host[0])
    got = ahead.parked.read(ahead.disk, ahead.table, ahead.cfg.page_size, host=ahead.host)
    filled = got["slabs"]
    assert filled.count == pages > 0 and ahead.host.reserved_bytes() == 0
    addresses = [t.data_ptr() for t in (*filled.k.slabs, *filled.v.slabs)]
    ahead.restore(got)
    twin.restore()
    assert [t.data_ptr() for t in (*ahead.host.k.slabs, *ahead.host.v.slabs)] == addresses
    _assert_same(before, _state(ahead))
    _assert_same(_state(twin), _state(ahead))
    a, b = ahead.host, twin.host
    assert (a._next, a._used, a._written, a._free, a._released) == (b._next, b._used, b._written, b._free, b._released)
    assert np.array_equal(a._held[:a._next], b._held[:b._next]) and a.reserved_bytes() == b.reserved_bytes()
    _decode_alike(ahead, twin, seed=14)
    _assert_same(_state(twin), _state(ahead))
